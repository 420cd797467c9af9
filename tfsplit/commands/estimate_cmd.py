"""Memory of model states from the parameter count alone, a simulated pipeline
schedule on uniform stages, or, given a graph, its per-device memory and
simulated step time.

  tfsplit estimate --params 100e9 --optimizer adam --device-memory 16GB,32GB
  tfsplit estimate --simulate-pipeline --stages 4 --microbatches 8 \\
      --schedule 1f1b --trace step.json --gantt step.png
  tfsplit estimate train_step.pb --cluster h100-80gb --calibration table.json \\
      --trace step.json

In graph mode each node runs on the device its `device` field names (an
empty one is device 0); --place-layers N first spreads the layers over N
devices. Costs are the roofline of the cluster's devices unless a
calibration table (`tfsplit calibrate`) measured them.

Sizes are decimal: 16GB = 16e9 bytes (write 16GiB for 16 * 2**30). A device
memory may also be a hardware preset name, e.g. h100-80gb.
"""
from absl import flags

from tfsplit import constants
from tfsplit.commands import common
from tfsplit.cost import cluster as cluster_lib
from tfsplit.cost import estimate
from tfsplit.errors import EstimateError
from tfsplit.memory import estimator
from tfsplit.memory import report as memory_report

USAGE = "tfsplit estimate [GRAPH] [--params P | --simulate-pipeline] [--flags]"
ARGS = (0, 1)
_PRESETS = ", ".join(cluster_lib.preset_names())
_ACTIVATION = ("activations", "layers", "hidden", "seq-len", "heads", "micro-batch",
               "recompute")
_PIPELINE = ("stages", "microbatches", "schedule", "forward-ms", "backward-ms", "p2p-ms",
             "activation-size", "trace", "gantt", "virtual-stages", "weight-fraction")
_GRAPH = ("cluster", "devices", "calibration", "place-layers", "trace", "gantt")


def define_flags(fv):
  """Size-only, pipeline and graph-mode flags, in that order."""
  # Short names for the definers: one or two lines per flag.
  s, i, f, e, b = (flags.DEFINE_string, flags.DEFINE_integer, flags.DEFINE_float,
                   flags.DEFINE_enum, flags.DEFINE_boolean)
  s("params", None, "Parameter count: 100e9, 175B (B = billion), 1.5M.", flag_values=fv)
  s("optimizer", "adam", f"Optimizer: {', '.join(estimator.optimizer_names())}.",
    flag_values=fv)
  s("device-memory", "16GB,32GB,40GB,80GB,141GB", "Comma-separated device memory sizes "
    f"(decimal: 16GB = 16e9 bytes; 16GiB = 16 * 2**30) or hardware presets ({_PRESETS}).",
    flag_values=fv)
  e("precision", "both", ["fp32", "mixed", "both"], "Training precision to estimate.",
    flag_values=fv)
  i("zero-devices", 64, "N, the data-parallel devices ZeRO shards over.", lower_bound=1,
    flag_values=fv)
  common.define_format(fv)
  s("activations", None, "Activation bytes of one micro-batch on a device (e.g. 30GB), "
    "added to the total and to every ZeRO row.", flag_values=fv)
  i("layers", None, "Transformer layers, to estimate activations (with --hidden, "
    "--seq-len, --heads).", lower_bound=1, flag_values=fv)
  i("hidden", None, "Transformer hidden size.", lower_bound=1, flag_values=fv)
  i("seq-len", None, "Sequence length.", lower_bound=1, flag_values=fv)
  i("heads", None, "Attention heads.", lower_bound=1, flag_values=fv)
  i("micro-batch", 1, "Micro-batch size.", lower_bound=1, flag_values=fv)
  b("recompute", False, "Full activation recomputation: keep only each layer's input.",
    flag_values=fv)
  b("simulate-pipeline", False, "Simulate a pipeline schedule on uniform stages.",
    flag_values=fv)
  i("stages", 4, "Pipeline stages S.", lower_bound=1, flag_values=fv)
  i("microbatches", 8, "Micro-batches m per step.", lower_bound=1, flag_values=fv)
  e("schedule", "1f1b", list(constants.PIPELINE_SCHEDULES), "Pipeline schedule.",
    flag_values=fv)
  i("virtual-stages", 1, "Model chunks per stage for --schedule interleaved (>= 2; "
    "--microbatches a multiple of --stages).", lower_bound=1, flag_values=fv)
  f("forward-ms", 1.0, "Forward time of one micro-batch on one stage, ms.",
    lower_bound=0.0, flag_values=fv)
  f("backward-ms", 2.0, "Backward time of one micro-batch on one stage, ms.",
    lower_bound=0.0, flag_values=fv)
  f("weight-fraction", constants.DEFAULT_WEIGHT_FRACTION, "Share of --backward-ms that computes weight gradients "
    "(the W blocks --schedule zb-h1 / zb-h2 run apart; 0.5: a dense layer's).",
    lower_bound=0.0, upper_bound=1.0, flag_values=fv)
  f("p2p-ms", 0.0, "Send time of an activation or gradient between neighbouring "
    "stages, ms.", lower_bound=0.0, flag_values=fv)
  s("activation-size", None, "Activation bytes one micro-batch leaves on a stage (e.g. "
    "2GB), to report peak memory per stage.", flag_values=fv)
  s("cluster", "cpu-host", "Graph mode: a cluster spec JSON file or a hardware preset "
    f"({_PRESETS}).", flag_values=fv)
  i("devices", None, "Graph mode: devices of a preset cluster (default: as many as the "
    "graph uses).", lower_bound=1, flag_values=fv)
  s("calibration", None, "Graph mode: a cost table written by 'tfsplit calibrate'; "
    "measured costs override the roofline.", flag_values=fv)
  i("place-layers", None, "Graph mode: place the layers over this many devices, "
    "contiguously, before simulating.", lower_bound=1, flag_values=fv)
  s("trace", None, "Write the simulated schedule as Chrome-trace / Perfetto JSON here.",
    flag_values=fv)
  s("gantt", None, "Write a PNG Gantt chart here (needs matplotlib).", flag_values=fv)


def run(fv, args):
  if args:
    data, lines = _graph_mode(fv, args[0])
    common.emit_report(fv.format, data, lines)
    return 0
  simulate = fv["simulate-pipeline"].value
  if fv.params is None and not simulate:
    raise EstimateError("nothing to estimate: give --params (e.g. --params 100e9) "
                        "and/or --simulate-pipeline")
  for name in ("trace", "gantt"):
    if fv[name].value and not simulate:
      raise EstimateError(f"--{name} writes the simulated pipeline; add "
                          "--simulate-pipeline")
  data, lines = {}, []
  if fv.params is not None:
    data["estimate"], lines = memory_report.model_states(
        fv.params, cluster_lib.device_memory_sizes(fv["device-memory"].value),
        **common.values(fv, "optimizer", "precision", "zero-devices", *_ACTIVATION))
  if simulate:
    data["pipeline"], pipeline_lines = estimate.uniform_pipeline(
        **common.values(fv, *_PIPELINE))
    lines += ([""] if lines else []) + pipeline_lines
  common.emit_report(fv.format, data, lines)
  return 0


def _graph_mode(fv, path):
  for name in ("params", "activations", "layers"):
    if fv[name].value is not None:
      raise EstimateError(f"unexpected argument '{path}' with --{name}: give either a "
                          "graph or the size-only flags (a graph brings its own sizes)")
  if fv["simulate-pipeline"].value:
    raise EstimateError("--simulate-pipeline is for uniform stages; with a graph, place "
                        "it with --place-layers instead")
  common.quiet_tensorflow()  # only graph mode needs TensorFlow
  return estimate.graph_estimate(path, **common.values(fv, *_GRAPH))
