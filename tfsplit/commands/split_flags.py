"""A command's split options from its flags: one SplitConfig.

A flag named as a SplitConfig field with dashes (--microbatches, --zero,
--sequence-parallel, ...) sets that field, so a new option is one field, one
flag and one docs line; the few flags spelled otherwise (a unit or a CLI
form of their own) are in SPELLED. The mesh flags (--mesh, --stages,
--devices, --job, --cluster, --across-tasks, --devices-per-task) place the
mesh, and --plan fills in what a plan sets, by Plan.apply, as
tfsplit.split(plan=) does. A command reads only the flags it defines.
"""
from tfsplit.errors import PlanError, TfsplitError


def parse_annotation(text):
  """'VARIABLE_GLOB=DIMS' (e.g. '*/fc1/kernel=-,tp') -> (glob, dims)."""
  pattern, sep, dims = text.rpartition("=")
  if not sep or not pattern:
    raise TfsplitError(f"cannot read --annotate '{text}'; write VARIABLE_GLOB=DIMS, e.g. "
                       "'*/fc1/kernel=-,tp'")
  return pattern, tuple(None if d.strip() in ("-", "", "none") else d.strip()
                        for d in dims.split(","))


def parse_layer_ranges(text):
  """'0:3,3:6' -> [(0, 3), (3, 6)]; None for None."""
  if not text:
    return None
  try:
    return [tuple(int(x) for x in part.split(":")) for part in text.split(",")]
  except ValueError:
    raise TfsplitError(f"cannot read --layers '{text}'; write start:end ranges, "
                       "e.g. 0:3,3:6") from None


# flag -> (SplitConfig field, how its value reads)
SPELLED = {
    "annotate": ("annotations", lambda v: dict(parse_annotation(a) for a in v or ())),
    "layers": ("layer_ranges", parse_layer_ranges),
    "bucket-mb": ("bucket_bytes", lambda v: int(round(v * 2**20))),
    "collective-timeout": ("timeout_seconds", float),
    "batch": ("batch_size", lambda v: v),
}
MESH_FLAGS = ("mesh", "stages")


def options(fv):
  """({SplitConfig field: value} of every option flag `fv` defines,
  {field: value} of those given on the command line, {field: flag})."""
  from tfsplit.passes.config import SplitConfig  # pylint: disable=import-outside-toplevel
  flag_of = {name: name.replace("_", "-") for name in SplitConfig.options()}
  flag_of.update({field: flag for flag, (field, _) in SPELLED.items()})
  out, given = {}, {}
  for field, flag in flag_of.items():
    if flag not in fv:
      continue
    value = fv[flag].value
    if flag in SPELLED:
      value = SPELLED[flag][1](value)
    out[field] = value
    if fv[flag].present:
      given[field] = value
  return out, given, {field: f"--{flag}" for field, flag in flag_of.items()}


def place(fv, axes):
  """The Mesh of `axes` on the devices the flags name: --devices/--job, or
  a cluster's tasks (--cluster, --across-tasks, --devices-per-task)."""
  from tfsplit.layout.mesh import Mesh  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import placement  # pylint: disable=import-outside-toplevel
  kind = fv.devices if "devices" in fv else "cpu"
  cluster = fv.cluster if "cluster" in fv else None
  if cluster is not None:
    from tfsplit.runtime import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
    found = cluster_lib.resolve(cluster, devices_per_task=fv["devices-per-task"].value,
                                required=True)
    found.kind = kind.upper() if kind != "cpu" else found.kind
    return placement.make_mesh(axes, cluster=found, across=tuple(fv["across-tasks"].value))
  job = fv.job if "job" in fv else "localhost"
  return placement.make_mesh(axes, devices=placement.device_names(kind, Mesh(axes).size,
                                                                 job))


def split_config(fv, graph_def=None, source="the graph"):
  """The SplitConfig the flags ask for; with --plan, the plan's (checked
  against `graph_def`, read from `source`), a flag it sets otherwise
  refused in one line."""
  from tfsplit.passes.config import SplitConfig  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import placement  # pylint: disable=import-outside-toplevel
  found, given, flag_of = options(fv)
  if found.get("task") is not None and ("cluster" not in fv or fv.cluster is None):
    raise PlanError("--task needs --cluster: a task is one of the cluster's workers")
  plan_path = fv.plan if "plan" in fv else None
  if plan_path is None:
    axes = placement.mesh_axes(fv.mesh, fv.stages if "stages" in fv else 1)
    return SplitConfig(place(fv, axes), **found)
  from tfsplit import plan as plan_lib  # pylint: disable=import-outside-toplevel
  plan = plan_lib.resolve(plan_path, graph_def, source=source)
  if any(fv[name].present for name in MESH_FLAGS if name in fv):
    given["mesh"] = placement.mesh_axes(fv.mesh, fv.stages if "stages" in fv else 1)
  flag_of["mesh"] = "--mesh"
  plan.refuse(given, flag_of)
  unplanned = {k: v for k, v in found.items() if k not in plan_lib.Plan.PLANNED}
  return plan.apply(SplitConfig(place(fv, placement.mesh_axes(plan.mesh)), **unplanned))
