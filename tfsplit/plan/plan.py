"""A plan: what the planner chose, as a record and as a readable JSON file.

    {"format": "tfsplit-plan", "version": 1,
     "devices": 8, "device_memory": 16000000000, "cluster": "h100-80gb x8",
     "layers": ["gpt/embed", "gpt/block_0", ...],     # the graph's model layers
     "mesh": "pp=2,dp=2,tp=2", "microbatches": 4, "schedule": "1f1b",
     "virtual_stages": 1, "layer_ranges": [[0, 3], [3, 6]],
     "recompute": "none", "zero": 0,      # or "blocks", or the blocks recomputed:
                                          # ["gpt/block_0", ...] (name scopes)
     "replicate": ["gpt/block_3"],        # blocks left whole over tp (not split)
     "offload": "none",                   # or "optimizer": state on the host
     "memory_reserve": 0.1,               # of device_memory, left free
     "predicted": {"step_time": ..., "per_device_memory": ..., "bubble": ...},
     "candidates": [...]}                               # the runners-up

`layers` ties the plan to the graph it was made for: applying it to a graph
whose layers differ is refused, naming the first difference, as is a plan
for more devices than there are. Every malformed field is one line naming
the file and the field. `replicate` and `offload` may be absent (none).
"""
import dataclasses
import json
import math
from typing import List, Optional, Tuple

from tfsplit.errors import PlanError, TfsplitError
from tfsplit.fileio import read_json, write_atomically
from tfsplit.passes.config import exact_pattern
from tfsplit.plan import space
from tfsplit.plan.search import DEFAULT_RESERVE, check_reserve

FORMAT = "tfsplit-plan"
VERSION = 1


@dataclasses.dataclass
class Plan:
  devices: int
  layers: List[str]
  mesh: str
  microbatches: int = 1
  schedule: str = "1f1b"
  virtual_stages: int = 1
  layer_ranges: Optional[List[Tuple[int, int]]] = None
  recompute: object = "none"   # 'none', 'blocks', or the layers recomputed
  zero: int = 0
  replicate: List[str] = dataclasses.field(default_factory=list)  # blocks not split
  offload: Optional[str] = None   # None or 'optimizer'
  # The regions between tensor-parallel blocks split over the sequence
  # (strategies/sequence_parallel.py); the planner prices a split layer's
  # activations as 1/tp of them, which it makes true.
  sequence_parallel: bool = False
  device_memory: Optional[int] = None
  memory_reserve: float = DEFAULT_RESERVE
  cluster: Optional[str] = None
  graph: Optional[str] = None
  predicted: dict = dataclasses.field(default_factory=dict)
  candidates: list = dataclasses.field(default_factory=list)
  # The replicated blocks' annotations once bound to a graph (`bind`).
  bound_annotations: Optional[dict] = dataclasses.field(default=None, repr=False,
                                                        compare=False)

  @classmethod
  def from_estimate(cls, est, profile, cluster=None, device_memory=None, graph=None,
                    runners_up=(), memory_reserve=DEFAULT_RESERVE):
    c = est.candidate
    return cls(devices=c.devices, layers=profile.names, mesh=c.mesh,
               microbatches=c.microbatches, schedule=c.schedule,
               virtual_stages=c.virtual_stages,
               layer_ranges=[tuple(r) for r in est.ranges] if c.pp > 1 else None,
               recompute=_recompute(est, profile), zero=c.zero,
               replicate=[profile.layers[i].name for i in c.replicate],
               offload="optimizer" if c.offload else None, device_memory=device_memory,
               memory_reserve=memory_reserve, cluster=cluster, graph=graph,
               predicted={k: v for k, v in est.to_json().items()
                          if k in _PREDICTED},
               candidates=[e.to_json() for e in runners_up])

  @property
  def recompute_option(self):
    """recompute= of split_graph: None, 'blocks' or a tuple of layer scopes."""
    if isinstance(self.recompute, list):
      return tuple(self.recompute)
    return None if self.recompute == "none" else self.recompute

  def bind(self, graph_def, analysis=None):
    """A copy of the plan tied to `graph_def` (the graph it was made for;
    `analysis`: its Analysis, if the caller has one): what options
    needs of it is kept, so it is called without the graph."""
    return dataclasses.replace(
        self, bound_annotations=replicated_annotations(graph_def, self.replicate, analysis)
        if self.replicate else {})

  # The SplitConfig fields a plan always sets (offload and sequence
  # parallelism only when it has them; its replicated blocks add annotations).
  PLANNED = ("mesh", "microbatches", "schedule", "layer_ranges", "virtual_stages",
             "recompute", "zero")

  def options(self, graph_def=None):
    """{SplitConfig field: value} the plan sets (mesh as its text; with
    replicated blocks, their weights' annotations, which need the graph:
    `graph_def`, the one the plan was made for, or `bind` first)."""
    options = {"mesh": self.mesh, "microbatches": self.microbatches,
               "schedule": self.schedule, "virtual_stages": self.virtual_stages,
               "layer_ranges": [tuple(r) for r in self.layer_ranges]
                               if self.layer_ranges else None,
               "recompute": self.recompute_option, "zero": self.zero}
    if self.offload:
      options["offload"] = self.offload
    if self.sequence_parallel:
      options["sequence_parallel"] = True
    if self.replicate:
      if graph_def is not None:
        options["annotations"] = replicated_annotations(graph_def, self.replicate)
      elif self.bound_annotations is not None:
        options["annotations"] = dict(self.bound_annotations)
      else:
        raise PlanError(f"the plan replicates {', '.join(self.replicate)}: applying it "
                        "needs the graph (Plan.options(graph_def), or bind it first)")
    return options

  def refuse(self, given, names=None):
    """PlanError naming the first option in `given` ({SplitConfig field:
    value} the user set besides the plan) that the plan sets otherwise;
    annotations add to the plan's, sequence parallelism may be asked on top.
    `names`: {field: how the user spelled it} (a command's flags)."""
    planned = self.options()
    for name, value in given.items():
      if name in ("annotations", "sequence_parallel") or name not in planned:
        continue
      if _same(name, value, planned[name]):
        continue
      said = (names or {}).get(name, name)
      raise PlanError(f"the plan sets {said} {_shown(planned[name])} but {said} "
                      f"{_shown(value)} is given too; give either the plan or {said}")

  def apply(self, config, given=None):
    """`config` (a SplitConfig whose mesh is the plan's, placed by the caller)
    with the plan's choices, by dataclasses.replace; `given`: the options
    the user set besides the plan (see refuse)."""
    from tfsplit.layout.mesh import Mesh  # pylint: disable=import-outside-toplevel
    self.refuse(given or {})
    options = self.options()
    if dict(config.mesh.axes) != Mesh.parse(options.pop("mesh")).axes:
      raise PlanError(f"the plan is for mesh {self.mesh}, the config's mesh is "
                      f"{config.mesh}; place the plan's mesh")
    options["annotations"] = {**config.annotations, **options.get("annotations", {})}
    options["sequence_parallel"] = bool(options.get("sequence_parallel") or
                                        config.sequence_parallel)
    return dataclasses.replace(config, **options)

  def to_json(self):
    return {"format": FORMAT, "version": VERSION, "graph": self.graph,
            "devices": self.devices, "device_memory": self.device_memory,
            "cluster": self.cluster, "layers": list(self.layers), "mesh": self.mesh,
            "microbatches": self.microbatches, "schedule": self.schedule,
            "virtual_stages": self.virtual_stages,
            "layer_ranges": [list(r) for r in self.layer_ranges]
                            if self.layer_ranges else None,
            "recompute": list(self.recompute) if isinstance(self.recompute, (list, tuple))
                         else self.recompute, "zero": self.zero,
            "replicate": list(self.replicate), "offload": self.offload or "none",
            "sequence_parallel": self.sequence_parallel, "memory_reserve": self.memory_reserve,
            "predicted": self.predicted, "candidates": self.candidates}

  def save(self, path):
    write_atomically(path, json.dumps(self.to_json(), indent=2) + "\n")

  def check_graph(self, layer_names, source="the graph"):
    """Refuses a graph whose model layers are not the plan's."""
    names = list(layer_names)
    if names == list(self.layers):
      return
    unknown = [l for l in self.layers if l not in names]
    missing = [l for l in names if l not in self.layers]
    if unknown:
      what = (f"layer '{unknown[0]}' of the plan is not in {source}"
              + (f" ({len(unknown)} such layers)" if len(unknown) > 1 else ""))
    elif missing:
      what = (f"layer '{missing[0]}' of {source} is not in the plan"
              + (f" ({len(missing)} such layers)" if len(missing) > 1 else ""))
    else:
      what = f"{source} orders its layers differently from the plan"
    raise PlanError(f"plan does not match {source}: {what}; make the plan from this graph "
                    "with 'tfsplit plan'")

  def check_devices(self, available):
    if self.devices > available:
      raise PlanError(f"the plan is for {self.devices} devices but {available} are "
                      f"available; make a plan for {available} devices or provide more")


def _normal(name, value):
  """`value` of option `name` in one spelling, to compare a user's with a plan's."""
  if name == "mesh":
    from tfsplit.layout.mesh import Mesh  # pylint: disable=import-outside-toplevel
    if isinstance(value, Mesh):
      return dict(value.axes)
    return Mesh.parse(value).axes if isinstance(value, str) else dict(value)
  if value == "none":
    return None
  if isinstance(value, (list, tuple)):
    return tuple(_normal(None, v) for v in value)
  return value


def _same(name, a, b):
  return _normal(name, a) == _normal(name, b)


def _shown(value):
  if isinstance(value, dict):
    return ",".join(f"{k}={v}" for k, v in value.items())
  if isinstance(value, (list, tuple)):
    return ",".join(":".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)
                    for v in value)
  return str(value)


def replicated_annotations(graph_def, layers, analysis=None):
  """{variable glob: all-None dims} for the weights of `layers` (names of
  the graph's model layers): annotations that keep those layers whole on
  every device of the tensor-parallel axis (they override the strategy).
  `analysis`: graph_def's Analysis, if the caller has one."""
  if analysis is None:
    from tfsplit.passes.analysis import Analysis  # pylint: disable=import-outside-toplevel
    analysis = Analysis(graph_def)
  by_name = {l.name: l for l in analysis.layers.model_layers}
  var_of = {v.node: v for v in analysis.variables}
  out = {}
  for name in layers:
    if name not in by_name:
      raise PlanError(f"the plan replicates layer '{name}', which the graph does not "
                      "have; make the plan from this graph with 'tfsplit plan'")
    for node in by_name[name].variables:
      var = var_of.get(node)
      if var is not None and var.shape:   # scalars are never split
        out[exact_pattern(var.name)] = (None,) * len(var.shape)
  return out


def _recompute(est, profile):
  """'none', 'blocks', or (recompute='stages') the repeated blocks of the
  stages that recompute, by layer name (name scopes for the recompute pass)."""
  c = est.candidate
  if c.recompute != "stages":
    return c.recompute
  names = [profile.layers[i].name for s, (j, k) in enumerate(est.ranges)
           if est.recomputed[s] for i in range(j, k) if profile.layers[i].splittable]
  return names or "none"


_PREDICTED = ("step_time", "pipeline_time", "sync_time", "update_time", "bubble",
              "per_device_memory", "stage_memory", "stage_time")


def _field(obj, key, source, kind, default=dataclasses.MISSING):
  if key not in obj or obj[key] is None:
    if default is not dataclasses.MISSING:
      return default
    raise PlanError(f"plan '{source}': missing field '{key}'")
  value = obj[key]
  ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
  if not ok:
    raise PlanError(f"plan '{source}': field '{key}' must be {_KIND_NAMES.get(kind, kind)}, "
                    f"got {json.dumps(value)[:60]}")
  return value


_KIND_NAMES = {int: "an integer", str: "a string", list: "a list", dict: "an object",
               bool: "true or false",
               (str, list): "a string or a list"}


def from_json(obj, source="plan"):
  """A Plan from its JSON form, every field checked (PlanError on the first bad one)."""
  if not isinstance(obj, dict) or obj.get("format") != FORMAT:
    raise PlanError(f"plan '{source}' is not a tfsplit plan (no \"format\": \"{FORMAT}\"); "
                    "write one with 'tfsplit plan GRAPH -o plan.json'")
  if obj.get("version") != VERSION:
    raise PlanError(f"plan '{source}': version {obj.get('version')!r} is not supported "
                    f"(this tfsplit reads version {VERSION})")
  devices = _field(obj, "devices", source, int)
  layers = _field(obj, "layers", source, list)
  if not layers or not all(isinstance(l, str) for l in layers):
    raise PlanError(f"plan '{source}': field 'layers' must be a non-empty list of layer names")
  text = _field(obj, "mesh", source, str)
  try:
    from tfsplit.layout.mesh import Mesh  # pylint: disable=import-outside-toplevel
    mesh = Mesh.parse(text)
  except TfsplitError as e:
    raise PlanError(f"plan '{source}': field 'mesh': {e}") from None
  unknown = [a for a in mesh.axes if a not in ("pp", "dp", "ep", "tp")]
  if unknown:
    raise PlanError(f"plan '{source}': mesh {mesh} has axis '{unknown[0]}'; plans use pp, "
                    "dp, ep and tp")
  if mesh.size != devices:
    raise PlanError(f"plan '{source}': mesh {mesh} has {mesh.size} devices but the plan says "
                    f"devices={devices}")
  m = _field(obj, "microbatches", source, int, 1)
  v = _field(obj, "virtual_stages", source, int, 1)
  schedule = _field(obj, "schedule", source, str, "1f1b")
  recompute = _field(obj, "recompute", source, (str, list), "none")
  if isinstance(recompute, list):
    stray = [r for r in recompute if r not in layers]
    if not recompute or stray:
      raise PlanError(f"plan '{source}': field 'recompute' lists "
                      + (f"'{stray[0]}', not one of the plan's layers" if stray else
                         "no layers") + "; give 'none', 'blocks' or layers of 'layers'")
  zero = _field(obj, "zero", source, int, 0)
  replicate = _field(obj, "replicate", source, list, [])
  stray = [r for r in replicate if r not in layers]
  if stray:
    raise PlanError(f"plan '{source}': field 'replicate' lists {json.dumps(stray[0])[:60]}, "
                    "not one of the plan's layers")
  offload = _field(obj, "offload", source, str, "none")
  sequence_parallel = _field(obj, "sequence_parallel", source, bool, False)
  for key, value, allowed in (("schedule", schedule, space.SCHEDULES),
                              ("recompute", recompute if isinstance(recompute, str)
                               else "blocks", ("none", "blocks")),
                              ("zero", zero, (0, 1, 2, 3)),
                              ("offload", offload, ("none", "optimizer"))):
    if value not in allowed:
      raise PlanError(f"plan '{source}': field '{key}' is {value!r}; use one of "
                      f"{', '.join(str(a) for a in allowed)}")
  if m < 1 or v < 1:
    raise PlanError(f"plan '{source}': microbatches and virtual_stages must be >= 1, got "
                    f"{m} and {v}")
  ranges = _ranges(obj.get("layer_ranges"), len(layers), mesh.axes.get("pp", 1) * v, source)
  memory = obj.get("device_memory")
  if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, float))
                             or not memory > 0 or not math.isfinite(memory)):
    raise PlanError(f"plan '{source}': field 'device_memory' must be a number of bytes, "
                    f"got {memory!r}")
  reserve = obj.get("memory_reserve", DEFAULT_RESERVE)
  try:
    check_reserve(reserve)
  except PlanError as e:
    raise PlanError(f"plan '{source}': field 'memory_reserve': {e}") from None
  return Plan(devices=devices, layers=layers, mesh=str(mesh), microbatches=m,
              schedule=schedule, virtual_stages=v, layer_ranges=ranges,
              recompute=recompute, zero=zero, replicate=list(replicate),
              offload=None if offload == "none" else offload,
              sequence_parallel=sequence_parallel, device_memory=memory,
              memory_reserve=reserve,
              cluster=obj.get("cluster"), graph=obj.get("graph"),
              predicted=obj.get("predicted") or {}, candidates=obj.get("candidates") or [])


def _ranges(value, n, chunks, source):
  """Checked layer ranges: `chunks` contiguous [start, end) covering 0..n."""
  if value is None:
    if chunks > 1:
      raise PlanError(f"plan '{source}': the mesh has a pipeline but no 'layer_ranges'")
    return None
  if not isinstance(value, list) or not all(
      isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) and
                                                  not isinstance(x, bool) for x in r)
      for r in value):
    raise PlanError(f"plan '{source}': field 'layer_ranges' must be a list of [start, end] "
                    "integer pairs")
  if len(value) != chunks:
    raise PlanError(f"plan '{source}': {len(value)} layer ranges for {chunks} pipeline "
                    "chunks (stages x virtual stages)")
  edge = 0
  for start, end in value:
    if start != edge or end <= start:
      raise PlanError(f"plan '{source}': layer ranges {value} must be contiguous, non-empty "
                      f"and start at 0 (at [{start}, {end}])")
    edge = end
  if edge != n:
    raise PlanError(f"plan '{source}': layer ranges end at {edge} but the plan has {n} "
                    "layers")
  return [tuple(r) for r in value]


def read(path):
  """The Plan in JSON file `path`."""
  obj = read_json(path, PlanError,
                  f"plan '{path}' does not exist; write one with 'tfsplit plan GRAPH "
                  "-o plan.json'",
                  f"cannot read plan '{path}': {{error}}; it must be "
                  "a JSON file written by 'tfsplit plan'")
  return from_json(obj, source=str(path))
