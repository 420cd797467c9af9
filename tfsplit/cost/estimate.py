"""The simulated estimates of `tfsplit estimate`: a pipeline schedule on
uniform stages, or one graph's per-device memory and step time.

Each returns (the dict `--format json` prints, text lines), after writing the
simulated schedule as a Chrome trace and/or a PNG Gantt chart when asked.
Graph mode imports TensorFlow; the uniform pipeline does not.
"""
from tfsplit import constants
from tfsplit import units
from tfsplit.cost import cluster as cluster_lib
from tfsplit.cost import output
from tfsplit.cost import pipeline_sim
from tfsplit.errors import EstimateError
from tfsplit.report import format_table


def _wrote(written):
  return [f"  wrote {name} to {path}" for name, path in written.items()]


def uniform_pipeline(stages, microbatches, schedule="1f1b", forward_ms=1.0,
                     backward_ms=2.0, p2p_ms=0.0, activation_size=None,
                     trace=None, gantt=None, virtual_stages=1,
                     weight_fraction=pipeline_sim.DEFAULT_WEIGHT_FRACTION):
  """Simulates `schedule` over `stages` equal stages and `microbatches`
  micro-batches (times of one micro-batch on one stage, in ms).

  activation_size: bytes one micro-batch leaves on a stage (e.g. '2GB'), to
  report peak memory per stage. virtual_stages: model chunks per stage
  (the interleaved schedule's v). weight_fraction: the share of the
  backward that is weight gradients (the zero-bubble schedules' W).
  """
  if forward_ms <= 0 or backward_ms <= 0:
    raise EstimateError("--forward-ms and --backward-ms must be > 0")
  if gantt:
    output.require_matplotlib()  # before minutes of work, and before the trace
  res = pipeline_sim.simulate_pipeline(
      stages, microbatches, schedule, forward_time=forward_ms / 1e3,
      backward_time=backward_ms / 1e3, p2p_time=p2p_ms / 1e3,
      activation_bytes=units.parse_bytes(activation_size) if activation_size else
      virtual_stages,  # one byte per chunk: peak activations are counted
      chunks=virtual_stages, weight_fraction=weight_fraction)
  written = output.write_schedule(res.sim, trace, gantt, title=(
      f"{res.schedule}: S={res.stages}, m={res.microbatches}, bubble "
      f"{100 * res.bubble_fraction:.1f}%"))
  return dict(res.summary(), **written), \
      pipeline_lines(res, with_memory=bool(activation_size)) + _wrote(written)


def pipeline_lines(res, with_memory=False):
  """A PipelineResult as text: step, bubble against theory, one row per stage."""
  S, m, v, sim = res.stages, res.microbatches, res.chunks, res.sim
  bubble = pipeline_sim.theoretical_bubble(S, m, v)
  peaks = pipeline_sim.theoretical_peak_activations(res.schedule, S, m, v)
  formula = "(S-1)/(m+S-1)" if v == 1 else "(S-1)/(vm+S-1)"
  lines = [f"pipeline {res.schedule}: S = {S} stages, m = {m} micro-batches" +
           (f", v = {v} model chunks per stage (activations counted per chunk)"
            if v > 1 else "")]
  theory = f"uniform-stage theory {formula} = {100 * bubble:.2f}%"
  waits = ""
  if res.schedule in constants.ZERO_BUBBLE_SCHEDULES:
    # No closed form for every F : B : W; the 1f1b formula is what it beats.
    theory = f"1f1b's on uniform stages {formula} = {100 * bubble:.2f}%"
    waits = (f"; the most idle stage waits {res.bubble_time * 1e3:.4g} ms in the step, "
             f"{res.steady_bubble_time * 1e3:.4g} ms between its first and last "
             "block (steady bubble)")
  lines.append(f"  step time {sim.step_time * 1e3:.4g} ms; bubble "
               f"{100 * res.bubble_fraction:.2f}% ({theory}){waits}; communication "
               f"{sim.comm_time * 1e3:.4g} ms")
  header = ["stage", "busy ms", "idle ms", "bubble", "peak activations",
            "theory"] + (["peak memory"] if with_memory else [])
  rows = [[str(s), f"{sim.busy[s] * 1e3:.4g}",
           f"{(sim.step_time - sim.busy[s]) * 1e3:.4g}",
           f"{100 * res.stage_bubble[s]:.2f}%", str(res.peak_activations[s]),
           str(peaks[s])] +
          ([units.format_bytes(res.peak_memory[s])] if with_memory else [])
          for s in range(S)]
  return lines + format_table(header, rows, ">" * len(header), indent="  ",
                              rule=False).split("\n")


def graph_estimate(path, cluster="cpu-host", devices=None, calibration=None,
                   place_layers=None, trace=None, gantt=None):
  """Simulates one step of the graph at `path` on `cluster` (a preset name or
  a cluster spec JSON file; `devices` of a preset, default: as many as the
  graph uses). Each node runs on the device its `device` field names;
  place_layers=N first spreads the layers over N devices. calibration: a
  cost table (`tfsplit calibrate`) whose measured costs override the roofline.
  """
  from tfsplit.cost import graph_sim  # pylint: disable=import-outside-toplevel
  from tfsplit.cost import op_cost  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import Graph, find_variables, infer_shapes, load_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.layers import detect_layers  # pylint: disable=import-outside-toplevel
  if gantt:
    output.require_matplotlib()
  table = op_cost.CostTable.load(calibration) if calibration else None
  graph_def = load_graph(path)
  graph = Graph(graph_def)
  variables = find_variables(graph)
  shapes = infer_shapes(graph, variables)
  report = detect_layers(graph, shapes, variables)
  if place_layers:
    graph_def = graph_sim.place_by_layers(graph_def, place_layers, report=report)
    graph = Graph(graph_def)
    variables = find_variables(graph)
  _, labels = graph_sim.device_indices(graph)
  spec = cluster_lib.for_graph(cluster, len(labels), devices)
  res = graph_sim.simulate_graph(graph, spec, op_cost.CostModel(spec, table=table),
                                 shapes=shapes, variables=variables, roles=report.role)
  sim = res.sim
  written = output.write_schedule(sim, trace, gantt)
  summary = dict(res.summary(), graph=path, cluster=spec.name, calibration=calibration,
                 shared_peak=res.shared_peak, **written)
  costs = (f"calibrated ({res.measured_ops} ops measured, {res.modelled_ops} modelled)"
           if table else "roofline (no calibration)")
  lines = [f"{path}: {len(graph)} nodes on {len(labels)} device(s) of "
           f"{spec.name}; costs: {costs}",
           f"  step time {sim.step_time * 1e3:.4g} ms; communication "
           f"{sim.comm_time * 1e3:.4g} ms over {res.transfers} transfers and "
           f"{res.collectives} collectives; {len(sim.graph)} tasks "
           f"simulated in {res.simulate_seconds:.3f} s"]
  fb = units.format_bytes
  rows = [[mem.device, fb(mem.parameters), fb(mem.optimizer_state),
           fb(mem.constants + mem.inputs), fb(mem.transient_peak), fb(mem.peak),
           f"{row['busy'] * 1e3:.4g}", f"{100 * row['idle_fraction']:.1f}%",
           f"{row['comm'] * 1e3:.4g}"]
          for row, mem in zip(sim.device_summary(), res.memory)]
  lines += format_table(["device", "params", "optimizer", "const+in", "transient",
                         "peak", "busy ms", "idle", "comm ms"], rows, "<" + ">" * 8,
                        indent="  ", rule=False).split("\n")
  lines.append("  (transient: activations, gradients and temporaries at "
               "their simulated peak; sizes decimal)")
  if len(res.memory) > 1:
    # Logical devices of one process (CPU:0, CPU:1, ...) share one allocator,
    # whose peak is that of the sum, not the sum of the devices' peaks.
    lines.append(f"  all devices on one allocator (logical devices of one "
                 f"process): peak {fb(res.shared_peak)} (sum of the devices' "
                 f"peaks {fb(sum(m.peak for m in res.memory))})")
  return summary, lines + _wrote(written)
