"""`tfsplit estimate`: memory of model states from the parameter count alone,
a simulated pipeline schedule on uniform stages, or, given a graph, its
per-device memory and simulated step time.

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
import json
import sys

from absl import flags

from tfsplit import units
from tfsplit.cost import cluster as cluster_lib
from tfsplit.cost import output
from tfsplit.cost import pipeline_sim
from tfsplit.memory import estimator
from tfsplit.memory.estimator import EstimateError

_DEFAULT_MEMORY = "16GB,32GB,40GB,80GB,141GB"


def _define_flags(fv):
  """Flags live on their own FlagValues so commands can share a process."""
  flags.DEFINE_string(
      "params", None, "Parameter count: 100e9, 175B (B = billion), 1.5M.",
      flag_values=fv)
  flags.DEFINE_string(
      "optimizer", "adam",
      f"Optimizer: {', '.join(estimator.optimizer_names())}.", flag_values=fv)
  flags.DEFINE_string(
      "device-memory", _DEFAULT_MEMORY,
      "Comma-separated device memory sizes (decimal: 16GB = 16e9 bytes; "
      "16GiB = 16 * 2**30) or hardware presets "
      f"({', '.join(cluster_lib.preset_names())}).", flag_values=fv)
  flags.DEFINE_enum("precision", "both", ["fp32", "mixed", "both"],
                    "Training precision to estimate.", flag_values=fv)
  flags.DEFINE_integer("zero-devices", 64,
                       "N, the data-parallel devices ZeRO shards over.",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_enum("format", "table", ["table", "json"], "Output format.",
                    flag_values=fv)
  flags.DEFINE_string(
      "activations", None,
      "Activation bytes of one micro-batch on a device (e.g. 30GB), added to "
      "the total and to every ZeRO row.", flag_values=fv)
  flags.DEFINE_integer("layers", None, "Transformer layers, to estimate "
                       "activations (with --hidden, --seq-len, --heads).",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("hidden", None, "Transformer hidden size.",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("seq-len", None, "Sequence length.", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_integer("heads", None, "Attention heads.", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_integer("micro-batch", 1, "Micro-batch size.", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_boolean("recompute", False, "Full activation recomputation: "
                       "keep only each layer's input.", flag_values=fv)
  flags.DEFINE_boolean("simulate-pipeline", False,
                       "Simulate a pipeline schedule on uniform stages.",
                       flag_values=fv)
  flags.DEFINE_integer("stages", 4, "Pipeline stages S.", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_integer("microbatches", 8, "Micro-batches m per step.",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_enum("schedule", "1f1b", ["1f1b", "gpipe"],
                    "Pipeline schedule.", flag_values=fv)
  flags.DEFINE_float("forward-ms", 1.0, "Forward time of one micro-batch on "
                     "one stage, ms.", lower_bound=0.0, flag_values=fv)
  flags.DEFINE_float("backward-ms", 2.0, "Backward time of one micro-batch on "
                     "one stage, ms.", lower_bound=0.0, flag_values=fv)
  flags.DEFINE_float("p2p-ms", 0.0, "Send time of an activation or gradient "
                     "between neighbouring stages, ms.", lower_bound=0.0,
                     flag_values=fv)
  flags.DEFINE_string("activation-size", None,
                      "Activation bytes one micro-batch leaves on a stage "
                      "(e.g. 2GB), to report peak memory per stage.",
                      flag_values=fv)
  flags.DEFINE_string(
      "cluster", "cpu-host",
      "Graph mode: a cluster spec JSON file or a hardware preset "
      f"({', '.join(cluster_lib.preset_names())}).", flag_values=fv)
  flags.DEFINE_integer("devices", None, "Graph mode: devices of a preset "
                       "cluster (default: as many as the graph uses).",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_string("calibration", None, "Graph mode: a cost table written "
                      "by 'tfsplit calibrate'; measured costs override the "
                      "roofline.", flag_values=fv)
  flags.DEFINE_integer("place-layers", None, "Graph mode: place the layers "
                       "over this many devices, contiguously, before "
                       "simulating.", lower_bound=1, flag_values=fv)
  flags.DEFINE_string("trace", None, "Write the simulated schedule as "
                      "Chrome-trace / Perfetto JSON here.", flag_values=fv)
  flags.DEFINE_string("gantt", None, "Write a PNG Gantt chart here (needs "
                      "matplotlib).", flag_values=fv)


def _parse(argv):
  fv = flags.FlagValues()
  _define_flags(fv)
  try:
    rest = fv(argv)
  except flags.Error as e:
    raise EstimateError(f"{e}; run 'tfsplit estimate --help' for the flags") \
        from None
  if len(rest) > 2:
    raise EstimateError(f"unexpected argument(s) {' '.join(rest[2:])}; "
                        "estimate takes at most one graph, e.g. "
                        "'tfsplit estimate train_step.pb'")
  return fv, (rest[1] if len(rest) == 2 else None)


def _device_memory(text):
  sizes = []
  for token in text.split(","):
    token = token.strip()
    if not token:
      continue
    if token.lower() in cluster_lib.preset_names():
      preset = cluster_lib.load_preset(token.lower())
      sizes.append(units.parse_bytes(preset["device"]["memory_bytes"]))
    else:
      sizes.append(units.parse_bytes(token))
  if not sizes:
    raise EstimateError("--device-memory is empty; give sizes such as "
                        "16GB,32GB")
  return sizes


def _activation_bytes(fv, precision):
  if fv["activations"].value:
    return units.parse_bytes(fv["activations"].value)
  shape = {k: fv[k].value for k in ("layers", "hidden", "seq-len", "heads")}
  if not any(v is not None for v in shape.values()):
    return 0
  missing = [k for k, v in shape.items() if v is None]
  if missing:
    raise EstimateError("an activation estimate needs --layers, --hidden, "
                        f"--seq-len and --heads; missing --{', --'.join(missing)}")
  return estimator.transformer_activation_bytes(
      shape["layers"], shape["hidden"], shape["seq-len"],
      fv["micro-batch"].value, shape["heads"], recompute=fv["recompute"].value,
      precision=precision)


def _table(rows, align):
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  out = []
  for r in rows:
    cells = [c.ljust(w) if a == "<" else c.rjust(w)
             for c, w, a in zip(r, widths, align)]
    out.append("  " + "  ".join(cells).rstrip())
  return out


_PRECISION_TITLE = {
    "fp32": "fp32",
    "mixed": "mixed precision (16-bit weights and gradients; fp32 master "
             "copy and optimizer state)",
}


def _estimate_lines(est, memory, zero_devices):
  mem_heads = [f"{units.format_bytes(m)}" for m in memory]
  lines = [_PRECISION_TITLE[est.precision]]
  rows = [["", "bytes/param", "size"] + mem_heads]
  grouped = [c for c in est.components if c.group != "activations"]
  subtotal_after = max(i for i, c in enumerate(grouped)
                       if c.group in ("weights", "optimizer"))
  for i, c in enumerate(grouped):
    rows.append([c.name, f"{c.bytes_per_param:g}", units.format_bytes(c.nbytes)]
                + [""] * len(memory))
    if i == subtotal_after:
      rows.append(["= weights + optimizer state",
                   f"{est.weights_and_optimizer_per_param:g}",
                   units.format_bytes(est.weights_and_optimizer)] +
                  [str(estimator.devices_needed(est.weights_and_optimizer, m))
                   for m in memory])
  for c in est.components:
    if c.group == "activations":
      rows.append([c.name, "", units.format_bytes(c.nbytes)] +
                  [""] * len(memory))
  rows.append(["= total", f"{est.bytes_per_param:g}",
               units.format_bytes(est.total)] +
              [str(estimator.devices_needed(est.total, m)) for m in memory])
  lines += _table(rows, "<>>" + ">" * len(memory))
  lines.append(f"  (columns {', '.join(mem_heads)}: devices needed to hold "
               "the line, split perfectly)")
  lines.append("")
  lines.append(f"ZeRO, {est.precision}, sharded over N = {zero_devices} "
               "devices (P = parameters)")
  rows = [["stage", "shards", "bytes/device", f"at N={zero_devices}"] +
          [f"N for {h}" for h in mem_heads]]
  for r in est.zero(zero_devices):
    fewest = [r.fewest_devices(m, est.params, est.activation_bytes)
              for m in memory]
    rows.append([str(r.stage), r.label, r.formula,
                 units.format_bytes(r.per_device)] +
                ["-" if n is None else str(n) for n in fewest])
  lines += _table(rows, "><<>" + ">" * len(memory))
  lines.append("  (N for a size: fewest devices at which a device of that "
               "size holds its share; - if none does)")
  return lines


def _simulate(fv):
  f_ms, b_ms, p_ms = (fv["forward-ms"].value, fv["backward-ms"].value,
                      fv["p2p-ms"].value)
  if f_ms <= 0 or b_ms <= 0:
    raise EstimateError("--forward-ms and --backward-ms must be > 0")
  if fv["gantt"].value:
    output.require_matplotlib()
  act = fv["activation-size"].value
  act_bytes = units.parse_bytes(act) if act else 1
  res = pipeline_sim.simulate_pipeline(
      fv["stages"].value, fv["microbatches"].value, fv["schedule"].value,
      forward_time=f_ms / 1e3, backward_time=b_ms / 1e3,
      activation_bytes=act_bytes, p2p_time=p_ms / 1e3)
  if fv["trace"].value:
    output.write_chrome_trace(res.sim, fv["trace"].value)
  if fv["gantt"].value:
    output.write_gantt(res.sim, fv["gantt"].value, title=(
        f"{res.schedule}: S={res.stages}, m={res.microbatches}, bubble "
        f"{100 * res.bubble_fraction:.1f}%"))
  return res, bool(act)


def _pipeline_lines(res, with_memory):
  S, m = res.stages, res.microbatches
  theory = (pipeline_sim.theoretical_bubble(S, m),
            pipeline_sim.theoretical_peak_activations(res.schedule, S, m))
  sim = res.sim
  lines = [f"pipeline {res.schedule}: S = {S} stages, m = {m} micro-batches",
           f"  step time {sim.step_time * 1e3:.4g} ms; bubble "
           f"{100 * res.bubble_fraction:.2f}% (uniform-stage theory "
           f"(S-1)/(m+S-1) = {100 * theory[0]:.2f}%); communication "
           f"{sim.comm_time * 1e3:.4g} ms"]
  rows = [["stage", "busy ms", "idle ms", "bubble", "peak activations",
           "theory"] + (["peak memory"] if with_memory else [])]
  for s in range(S):
    busy = sim.busy[s]
    rows.append([str(s), f"{busy * 1e3:.4g}",
                 f"{(sim.step_time - busy) * 1e3:.4g}",
                 f"{100 * res.stage_bubble[s]:.2f}%",
                 str(res.peak_activations[s]), str(theory[1][s])] +
                ([units.format_bytes(res.peak_memory[s])] if with_memory
                 else []))
  lines += _table(rows, ">>>>>>>")
  return lines


def main(argv):
  if any(a in ("-h", "--help", "-help", "--helpshort") for a in argv[1:]):
    fv = flags.FlagValues()
    _define_flags(fv)
    sys.stdout.write(__doc__ + "\nflags:\n" +
                     fv.module_help(__name__) + "\n")
    return 0
  fv, graph_path = _parse(argv)
  if graph_path is not None:
    return _graph_main(fv, graph_path)
  if fv["params"].value is None and not fv["simulate-pipeline"].value:
    raise EstimateError("nothing to estimate: give --params (e.g. --params "
                        "100e9) and/or --simulate-pipeline")
  if not fv["simulate-pipeline"].value:
    for name in ("trace", "gantt"):
      if fv[name].value:
        raise EstimateError(f"--{name} writes the simulated pipeline; add "
                            "--simulate-pipeline")
  result = {}
  lines = []
  if fv["params"].value is not None:
    params = units.parse_count(fv["params"].value)
    memory = _device_memory(fv["device-memory"].value)
    zero_n = fv["zero-devices"].value
    precisions = (estimator.PRECISIONS if fv["precision"].value == "both"
                  else (fv["precision"].value,))
    estimates = [estimator.estimate(params, fv["optimizer"].value, p,
                                    activation_bytes=_activation_bytes(fv, p))
                 for p in precisions]
    opt = estimates[0].optimizer
    result["estimate"] = {
        "params": params, "optimizer": opt, "device_memory": memory,
        "units": "bytes (decimal: 1 GB = 1e9)",
        "precisions": [e.to_json(memory, zero_n) for e in estimates]}
    lines.append(f"model states for {units.format_count(params)} parameters "
                 f"({params:,}), optimizer {opt}")
    lines.append("sizes are decimal (1 GB = 1e9 bytes); device counts are "
                 "lower bounds: activations (unless given), workspace and "
                 "fragmentation are left out")
    for e in estimates:
      lines.append("")
      lines += _estimate_lines(e, memory, zero_n)
  if fv["simulate-pipeline"].value:
    res, with_memory = _simulate(fv)
    result["pipeline"] = res.summary()
    if lines:
      lines.append("")
    lines += _pipeline_lines(res, with_memory)
    for name in ("trace", "gantt"):
      if fv[name].value:
        result["pipeline"][name] = fv[name].value
        lines.append(f"  wrote {name} to {fv[name].value}")
  if fv["format"].value == "json":
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
  else:
    sys.stdout.write("\n".join(lines) + "\n")
  return 0


def _cluster(fv, num_devices):
  spec = fv["cluster"].value
  count = fv["devices"].value or num_devices
  if spec in cluster_lib.preset_names():
    return cluster_lib.from_preset(spec, count)
  cluster = cluster_lib.ClusterSpec.load(spec)
  if cluster.num_devices < num_devices:
    raise EstimateError(f"cluster '{spec}' has {cluster.num_devices} devices "
                        f"but the graph uses {num_devices}; give a bigger "
                        "cluster")
  return cluster


def _graph_main(fv, path):
  """Graph mode: per-device memory and simulated step of one GraphDef."""
  # TensorFlow is only needed here; the size-only modes start without it.
  from tfsplit.cli import _quiet_tensorflow  # pylint: disable=import-outside-toplevel
  _quiet_tensorflow()
  from tfsplit.cost import graph_sim  # pylint: disable=import-outside-toplevel
  from tfsplit.cost import op_cost  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import Graph, find_variables, infer_shapes, load_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.layers import detect_layers  # pylint: disable=import-outside-toplevel
  for name in ("params", "activations", "layers"):
    if fv[name].value is not None:
      raise EstimateError(f"unexpected argument '{path}' with --{name}: give "
                          "either a graph or the size-only flags (a graph "
                          "brings its own sizes)")
  if fv["simulate-pipeline"].value:
    raise EstimateError("--simulate-pipeline is for uniform stages; with a "
                        "graph, place it with --place-layers instead")
  if fv["gantt"].value:
    output.require_matplotlib()
  table = (op_cost.CostTable.load(fv["calibration"].value)
           if fv["calibration"].value else None)
  graph_def = load_graph(path)
  graph = Graph(graph_def)
  variables = find_variables(graph)
  shapes = infer_shapes(graph, variables)
  report = detect_layers(graph, shapes, variables)
  if fv["place-layers"].value:
    graph_def = graph_sim.place_by_layers(graph_def, fv["place-layers"].value,
                                          report=report)
    graph = Graph(graph_def)
    variables = find_variables(graph)
  _, labels = graph_sim.device_indices(graph)
  cluster = _cluster(fv, len(labels))
  model = op_cost.CostModel(cluster, table=table)
  res = graph_sim.simulate_graph(graph, cluster, model, shapes=shapes,
                                 variables=variables, roles=report.role)
  sim = res.sim
  summary = res.summary()
  summary.update({"graph": path, "cluster": cluster.name,
                  "calibration": fv["calibration"].value})
  for name in ("trace", "gantt"):
    if fv[name].value:
      summary[name] = fv[name].value
  if fv["trace"].value:
    output.write_chrome_trace(sim, fv["trace"].value)
  if fv["gantt"].value:
    output.write_gantt(sim, fv["gantt"].value)
  if fv["format"].value == "json":
    sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    return 0
  costs = (f"calibrated ({res.measured_ops} ops measured, "
           f"{res.modelled_ops} modelled)" if table else
           "roofline (no calibration)")
  lines = [f"{path}: {len(graph)} nodes on {len(labels)} device(s) of "
           f"{cluster.name}; costs: {costs}",
           f"  step time {sim.step_time * 1e3:.4g} ms; communication "
           f"{sim.comm_time * 1e3:.4g} ms over {res.transfers} transfers and "
           f"{res.collectives} collectives; {len(sim.graph)} tasks "
           f"simulated in {res.simulate_seconds:.3f} s"]
  rows = [["device", "params", "optimizer", "const+in", "transient",
           "peak", "busy ms", "idle", "comm ms"]]
  fb = units.format_bytes
  for row, mem in zip(sim.device_summary(), res.memory):
    rows.append([mem.device, fb(mem.parameters), fb(mem.optimizer_state),
                 fb(mem.constants + mem.inputs), fb(mem.transient_peak),
                 fb(mem.peak), f"{row['busy'] * 1e3:.4g}",
                 f"{100 * row['idle_fraction']:.1f}%",
                 f"{row['comm'] * 1e3:.4g}"])
  lines += _table(rows, "<" + ">" * 8)
  lines.append("  (transient: activations, gradients and temporaries at "
               "their simulated peak; sizes decimal)")
  for name in ("trace", "gantt"):
    if fv[name].value:
      lines.append(f"  wrote {name} to {fv[name].value}")
  sys.stdout.write("\n".join(lines) + "\n")
  return 0
