"""Choose how to split a training step over N devices: the fastest plan that
fits the per-device memory.

Searches meshes dp x tp x pp (x ep for a model with mixture-of-experts
layers), micro-batch counts, pipeline schedules
(gpipe, 1f1b, interleaved), stage cuts over the detected layers,
recomputation of the repeated blocks, optimizer-state sharding, which
blocks to replicate rather than split over tp, and optimizer offload to the
host (only where a plan needs it to fit), prices
each with the cost model on the cluster (--cluster: a hardware preset or a
cluster spec JSON file; --calibration: measured op times), prints the best
candidates with their predicted step time, memory per device and pipeline
bubble, and why the winner won. -o writes the plan as JSON (atomically), for
`tfsplit rewrite GRAPH --plan plan.json -o out.pb` or
`tfsplit.split(fn, plan="plan.json", ...)`.

Sizes are decimal: 16GB = 16e9 bytes (16GiB = 16 * 2**30); a hardware
preset name (h100-80gb) gives its device memory. Without --device-memory the
cluster's device memory is the cap. Plans leave --memory-reserve of it free
(default 10%: workspaces and allocator fragmentation, which the memory
model does not count). A model that fits under no plan is one line with the
smallest per-device memory that would work, reserve included.
"""
import json
import sys
import time

from absl import flags

from tfsplit.commands import common
from tfsplit.cost import cluster as cluster_lib

USAGE = ("tfsplit plan GRAPH --devices N [--device-memory 16GB] [--memory-reserve 0.1] "
         "[--cluster PRESET|spec.json] [--top 5] [-o plan.json]")
ARGS = (1, 1)
_PRESETS = ", ".join(cluster_lib.preset_names())


def define_flags(fv):
  common.define_output(fv, "Write the chosen plan here as JSON.")
  common.define_format(fv)
  common.define_source(fv)
  flags.DEFINE_integer("devices", None, "Devices to plan for (N).", flag_values=fv)
  flags.DEFINE_string("device-memory", None, "Memory cap per device, e.g. 16GB (decimal; "
                      "16GiB = 16 * 2**30) or a preset name; default: the cluster's.",
                      flag_values=fv)
  flags.DEFINE_float("memory-reserve", None, "Fraction of the device memory plans "
                     "leave free, in [0, 1) (default 0.1): the memory model does not "
                     "count workspaces or allocator fragmentation.", flag_values=fv)
  flags.DEFINE_string("cluster", "cpu-host", "Hardware: a preset "
                      f"({_PRESETS}) or a cluster spec JSON file with at least N devices.",
                      flag_values=fv)
  flags.DEFINE_string("calibration", None, "A cost table from 'tfsplit calibrate': "
                      "measured op times override the roofline.", flag_values=fv)
  flags.DEFINE_integer("top", 5, "Candidates to print.", lower_bound=1, flag_values=fv)
  flags.DEFINE_list("schedules", None, "Pipeline schedules plans may use, e.g. "
                    "1f1b,gpipe (default: all of 1f1b, gpipe, interleaved, zb-h1, zb-h2).",
                    flag_values=fv)
  flags.DEFINE_integer("simulate", 0, "Also rewrite the best N candidates and simulate "
                       "each whole rewritten graph (tfsplit.cost.graph_sim): its step time "
                       "and peak memory per device beside the layer-level prediction.",
                       lower_bound=0, flag_values=fv)
  flags.DEFINE_integer("max-tp", None, "Largest tensor-parallel size to try (default: the "
                       "devices of one host).", lower_bound=1, flag_values=fv)


def _progress():
  """Prints the search's progress on stderr once it has run for a second."""
  start = time.perf_counter()
  last = [start]

  def report(done, total):
    now = time.perf_counter()
    if now - start > 1.0 and (now - last[0] > 0.5 or done == total):
      last[0] = now
      sys.stderr.write(f"planning: {done}/{total} meshes\n")
      sys.stderr.flush()
  return report


def run(fv, args):
  from tfsplit import plan as plan_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.plan import report as report_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.errors import PlanError  # pylint: disable=import-outside-toplevel
  if fv.devices is None:
    raise PlanError(f"missing --devices; usage: {USAGE}")
  plan_lib.check_devices(fv.devices)
  if fv.output:
    from tfsplit.fileio import require_folder  # pylint: disable=import-outside-toplevel
    require_folder(fv.output)  # before any work
  reserve = fv["memory-reserve"].value
  reserve = plan_lib.DEFAULT_RESERVE if reserve is None else reserve
  from tfsplit.plan.search import check_reserve  # pylint: disable=import-outside-toplevel
  check_reserve(reserve)
  spec = plan_lib.cluster_for(fv.cluster, fv.devices)  # a bad cluster fails first
  cap = plan_lib.memory_cap(fv["device-memory"].value, spec)
  from tfsplit.graph import load_graph, recover  # pylint: disable=import-outside-toplevel
  source = args[0]
  graph_def = load_graph(source, signature=fv.signature, variables_from=fv.variables)
  recover.require_variable_shapes(graph_def, source, fv.variables)
  profile = plan_lib.profile_graph(graph_def, fv.devices, spec, fv.calibration, source)
  plan, result = plan_lib.plan_profile(profile, fv.devices, cap, spec, top=fv.top,
                                       progress=_progress(), max_tp=fv["max-tp"].value,
                                       graph=source, memory_reserve=reserve,
                                       schedules=fv.schedules)
  lines = report_lib.lines(result, result.costing, source, spec.name, fv.top)
  if fv.simulate:
    simulated = simulate_top(graph_def, result.ranked[:fv.simulate], spec, profile,
                             fv.calibration)
    plan.predicted.update(simulated[0])
    lines += simulation_lines(result.ranked, simulated, result.usable)
  if fv.output:
    plan.save(fv.output)
    lines.append(f"wrote {fv.output} (apply it: tfsplit rewrite {source} --plan "
                 f"{fv.output} -o OUT.pb)")
  if fv.format == "json":
    sys.stdout.write(json.dumps(dict(plan.to_json(), search={
        "evaluated": result.evaluated, "seconds": result.seconds}), indent=2) + "\n")
  else:
    sys.stdout.write("\n".join(lines) + "\n")
  return 0


def simulate_top(graph_def, estimates, spec, profile, calibration=None):
  """[{'simulated_step_time', 'simulated_memory'}] per estimate: its plan
  rewritten (tfsplit.passes.split_graph) and the whole graph simulated on
  `spec` (with the `calibration` table, if any), mesh device i on cluster
  device i."""
  from tfsplit.cost import graph_sim  # pylint: disable=import-outside-toplevel
  from tfsplit.cost import op_cost  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import split_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.passes.config import SplitConfig  # pylint: disable=import-outside-toplevel
  from tfsplit.plan import Plan  # pylint: disable=import-outside-toplevel
  from tfsplit.layout.mesh import Mesh  # pylint: disable=import-outside-toplevel
  table = op_cost.CostTable.load(calibration) if calibration else None
  out = []
  for est in estimates:
    plan = Plan.from_estimate(est, profile).bind(graph_def)
    mesh = Mesh.parse(plan.mesh)
    result = split_graph(graph_def, plan.apply(SplitConfig(mesh)))
    sim = graph_sim.simulate_graph(result.graph_def, spec,
                                   op_cost.CostModel(spec, table=table),
                                   device_map={d: i for i, d in enumerate(mesh.devices)})
    out.append({"simulated_step_time": sim.step_time,
                "simulated_memory": max(m.peak for m in sim.memory)})
  return out


def simulation_lines(estimates, simulated, usable):
  """The whole-graph simulation beside the layer-level prediction, as lines."""
  from tfsplit.plan.report import format_time  # pylint: disable=import-outside-toplevel
  from tfsplit.report import format_table  # pylint: disable=import-outside-toplevel
  from tfsplit.units import format_bytes  # pylint: disable=import-outside-toplevel
  rows = [[str(k + 1), e.label(), format_time(e.step_time),
           format_time(s["simulated_step_time"]), format_bytes(e.memory),
           format_bytes(s["simulated_memory"])]
          for k, (e, s) in enumerate(zip(estimates, simulated))]
  out = ["whole-graph simulation of the rewritten candidates:"]
  out += format_table(["rank", "plan", "predicted", "simulated", "memory", "simulated "
                       "peak"], rows, "<<>>>>", indent="  ").split("\n")
  if simulated and simulated[0]["simulated_memory"] > usable:
    out.append(f"  note: the simulated peak of the winner is over the "
               f"{format_bytes(usable)} a plan may use; plan with a larger "
               "--memory-reserve to leave room")
  return out
