"""The whole calibration of `tfsplit calibrate`: calibrate() runs the
micro-benchmark, the dispatch chains, the logical-device and pipeline-stage
measurements, the small training steps and the user's graphs, in that order,
and fits their times into one CostTable (with machine_info, the machine it
was measured on). It only sequences the work: the graphs, the runs and the
device measurements are tfsplit.calibration's other modules, the fits
tfsplit.cost.fitting.
"""
import dataclasses
import os
import platform
from typing import Callable, Optional

import tensorflow as tf
from absl import logging

from tfsplit.calibration import graphs
from tfsplit.calibration.devices import device_benchmark, stage_overhead
from tfsplit.calibration.measure import (entries_from_profile, function_and_args,
                                         micro_benchmark, profile_graph, training_steps)
from tfsplit.cost import op_cost
from tfsplit.cost.cluster import LOCAL, ClusterSpec, Device, Host
from tfsplit.cost.fitting import (CALL_TENSORS, call_costs, fit_step_model, in_step_points,
                                  kernel_and_gap_concurrency, lines_fitted_in_steps,
                                  step_scale)
from tfsplit.graph.ir import Graph
from tfsplit.graph.shapes import infer_shapes


def _sequential_sum(graph, entries):
  """(summed traced seconds, ops that ran) over the graph's nodes."""
  total, count = 0.0, 0
  for node in graph.nodes:
    seconds = entries.get(node.name)
    if seconds:
      total += seconds
      count += 1
  return total, count


def machine_info():
  return {"platform": platform.platform(), "processor": platform.processor(),
          "cpus": os.cpu_count(), "tensorflow": tf.__version__,
          "python": platform.python_version()}


def calibrate(graph_defs=(), repeats=10, traced=5, cluster=None,
              progress=None):
  """A CostTable: the micro-benchmark plus every op of `graph_defs`.

  cluster: the ClusterSpec the roofline factors refer to for unmeasured
  devices (default: the machine's own measured FLOP/s and bandwidth).
  progress(message) is called before each long step.

  Op times are measured where they matter: inside a whole graph run by TF's
  executor (after Grappler), from the step stats of a traced Session run. Each
  node's kernel time lands in the table under its signature (op and shapes):
  the median over such nodes of each one's fastest run. A node that Grappler
  fused into a neighbour or folded away has no time of its own and is
  recorded as 0: its work is in the fused node's time, as it is when the
  graph runs for real.

  The standard micro-benchmarks give the machine-level part, without the
  graph to be predicted:
  - chains of one op each (MatMuls, elementwise ops, transposes, reductions,
    copies, and the ops of attention, GELU, masks, the loss and Adam, at
    several sizes; einsums and batched matmuls in each of their forms, see
    op_cost.op_form): the best MatMul FLOP/s and copy bandwidth (the roofline),
    the launch cost of a step, and `time_scale`, the ratio of an untraced
    run's time to the summed traced op times. Their op times only fit the
    lines below; the table keeps no entry for them (an op alone in a chain
    costs less than inside a step, so a model whose shapes matched a chain's
    would be priced low); entries are the graphs' own ops;
  - small synthetic training steps (transformer blocks written with matmuls,
    as tf_keras writes them (einsums) and as Keras 3 does (batched matmuls by
    a matrix, attention einsums), MLPs; forward, gradients, an Adam update),
    the transformer-shaped ones also in 4 micro-batches ordered as the
    rewrite orders them: on a small CPU an op inside a step costs several
    times what it costs alone in a chain (ops run side by side and wait for
    the same intra-op threads). Each line (an op type, or one of its forms)
    is fixed seconds per call plus a factor times the roofline, fitted on its
    times inside the steps where it runs there (each node's traced time
    scaled by its step's untraced over traced time), else on the chains. The
    fixed part is what a call costs alone (the chains) for the ops an MLP's
    step runs too, and is fitted in the steps for the ops only transformer
    steps run (attention's; not Keras 3's dense layers, a MatMul over the
    rows), whose fixed part inside a step is twice their chains'.
    `graph_scale` scales the lines to the steps' untraced times;
  - copies of the training steps on two and four logical CPUs, run in
    lockstep: how much of their work overlaps (`concurrency`: 1 where the
    devices' work runs one after the other); the MLP-shaped ones' copies
    also all-reducing each block's output and gradient over them, in the
    same turns: the fixed cost of one collective over them all inside a
    step (at least what a chain of collectives alone gives); between two
    devices, a chain's cost of one cross-device transfer;
  - the MLP-shaped steps cut into 2 and 4 pipeline stages, one per logical
    CPU, in turns with the uncut ones: what each further stage adds to a
    step beyond its transfers (`stage_overhead`).
  Untraced times are the fastest of rounds of repeated runs (each round's
  median call), as the benchmarks time a plan; the training steps take
  turns in the rounds, with the call of a 2-op function that is a step's
  launch cost. Traced op times are each node's fastest run: other work on
  the machine adds the most to the ops that hand work to the intra-op
  threads (their wake-ups wait for the cores), which would skew one op type
  against another; the level of a step comes from the untraced times.
  """
  run = _Calibration(repeats, traced, progress or (lambda m: logging.info("%s", m)))
  entries, graph, shapes = _chains(run)
  devices = _logical_devices(run)
  _roofline(run, entries, graph, shapes)
  for i, graph_def in enumerate(graph_defs):
    run.say(f"graph {i + 1}/{len(graph_defs)}: {len(graph_def.node)} nodes")
    _user_graph(run, graph_def)
  if cluster is None:
    cluster = _this_machine(run.table)
  steps, microbatched = _training_steps(run)
  chain_overhead = _fit_lines(run, cluster, steps, microbatched)
  table = run.table
  table.graph_scale, table.op_overhead = step_scale(table, steps + microbatched, cluster)
  table.kernel_concurrency, table.gap_concurrency = kernel_and_gap_concurrency(
      table, steps, {int(n): r for n, r in devices["per_step"].items()}, cluster)
  table.machine["chain_op_overhead"] = chain_overhead
  return table


@dataclasses.dataclass
class _Calibration:
  """What the phases of one calibrate() share: how many runs each
  measurement takes, where progress goes, the table being filled, and the
  op signatures measured so far."""
  repeats: int
  traced: int
  say: Callable[[str], None]
  table: Optional[op_cost.CostTable] = None
  # signature -> (its line, its OpCost): the ops the lines are fitted on.
  costs: dict = dataclasses.field(default_factory=dict)
  # signature -> seconds: every op time measured, the chains' and the
  # graphs'. The lines are fitted on all of them; only the graphs' own ops
  # keep their times in the table. A chain's op runs alone: it costs less
  # than the same op inside a step, so a model whose shapes happen to match
  # the chains' (a raw TF GPT's 2-d MatMuls and BiasAdds) would be priced
  # below one priced by the lines (Keras' einsums).
  measured: dict = dataclasses.field(default_factory=dict)


def _chains(run):
  """The micro-benchmark and the dispatch chains: makes run.table with
  the step model fitted on them (time_scale, op and step overheads);
  returns the micro-benchmark's (entries, Graph, shapes)."""
  run.say("micro-benchmark: matmul, elementwise, transpose, reduce, copy; "
          "dispatch chain")
  entries, profile, graph, shapes = micro_benchmark(run.repeats, run.traced)
  runs = [(profile.step_time,) + _sequential_sum(
      graph, {n: profile.fastest(n) for n in graph.node_names()})]
  for length in (graphs.DISPATCH_CHAIN // 4, graphs.DISPATCH_CHAIN):
    _, chain_profile, chain, _ = micro_benchmark(run.repeats, run.traced,
                                                 graphs.dispatch_graph(length))
    runs.append((chain_profile.step_time,) + _sequential_sum(
        chain, {n: chain_profile.fastest(n) for n in chain.node_names()}))
  table = run.table = op_cost.CostTable(machine=machine_info())
  table.time_scale, table.op_overhead, table.step_overhead = \
      fit_step_model(runs)
  return entries, graph, shapes


def _logical_devices(run):
  """Concurrency, collectives and transfers over logical CPUs, and the
  cost of pipeline stages, into run.table; returns device_benchmark's
  measurements."""
  table = run.table
  run.say("logical devices: concurrency, collectives, transfers")
  devices = device_benchmark(run.repeats)
  for record, key in (("step_concurrency", "per_step"), ("chain_collective", "chain"),
                      ("in_step_collective", "in_step")):   # JSON keys are strings
    table.machine[record] = {str(n): r for n, r in devices[key].items()}
  concurrency, collective = dict(devices["concurrency"]), dict(devices["collective"])
  table.transfer_overhead = devices["transfer"]
  table.concurrency, table.collective_overhead = concurrency.pop(2), collective.pop(2)
  table.concurrency_at, table.collective_at = concurrency, collective
  table.machine["in_step_collectives_at_once"] = {f"{n}x{g}": t
                                                 for (n, g), t in devices["at_once"].items()}
  table.collective_overlap = devices["overlap"]
  run.say("pipeline stages: small MLP steps cut into 2 and 4 stages")
  table.stage_overhead, per_cut = stage_overhead(run.repeats, table.transfer_overhead)
  table.machine["stage_cuts"] = {f"{k}x{n}": t for (k, n), t in per_cut.items()}
  return devices


def _roofline(run, entries, graph, shapes):
  """The costs of the micro-benchmark's measured ops (run.costs, their
  times run.measured), and the best MatMul FLOP/s and copy bandwidth among
  them: the table's roofline."""
  best_flops = best_bw = 0.0
  for node in graph.nodes:
    sig = op_cost.signature(node, shapes)
    if sig not in entries or not entries[sig]:
      continue
    seconds = entries[sig]
    cost = op_cost.node_cost(node, shapes, graph)
    run.costs[sig] = (cost.line, cost)
    if node.op == "MatMul" and cost.flops:
      best_flops = max(best_flops, cost.flops / seconds)
    if node.op == "DeepCopy" and cost.bytes_moved:
      best_bw = max(best_bw, cost.bytes_moved / seconds)
  run.table.flops = best_flops or None
  run.table.bandwidth = best_bw or None
  run.measured = dict(entries)


def _user_graph(run, graph_def):
  """A user's graph profiled: its ops' times into the table's entries and
  run.measured, their costs into run.costs (a signature the chains gave
  keeps theirs)."""
  g = Graph(graph_def)
  g_shapes = infer_shapes(g)
  g_profile = profile_graph(graph_def, repeats=run.repeats, traced=run.traced)
  g_entries = entries_from_profile(g, g_shapes, g_profile)
  run.measured.update(g_entries)
  run.table.entries.update(g_entries)
  for node in g.nodes:
    sig = op_cost.signature(node, g_shapes)
    if sig in g_entries and sig not in run.costs:
      cost = op_cost.node_cost(node, g_shapes, g)
      run.costs[sig] = (cost.line, cost)
  run.table.machine.setdefault("graphs", []).append(
      {"nodes": len(graph_def.node), "step_time": g_profile.step_time,
       "traced_sum": g_profile.traced_sum})


def _this_machine(table):
  """A ClusterSpec of one device: this machine at its measured roofline."""
  return ClusterSpec([Device("this", "h", "this", 1, table.bandwidth or 1e10,
                             {"float32": table.flops or 1e10})],
                     [Host("h", LOCAL, LOCAL)], name="this machine")


def _training_steps(run):
  """The small training steps timed (training_steps), with the launch
  cost of a step and of each argument and output beside them into the
  table; returns (steps, micro-batched steps)."""
  table = run.table
  # The launch cost of a step, measured directly (a call of a 2-op graph;
  # the intercept of the chains' fit swings by milliseconds with the noise),
  # in turns with the training steps: timed alone, at another moment, it
  # came out at 78-150 us in five calibrations, and a small MLP's step
  # (0.4 ms) is a third launch.
  # The calls of many arguments or outputs beside it price what each costs.
  calls = {"launch": graphs.dispatch_graph(2),
           "arguments": graphs.call_graph(arguments=CALL_TENSORS),
           "outputs": graphs.call_graph(outputs=CALL_TENSORS)}
  steps, microbatched, beside = training_steps(
      run.repeats, run.traced, run.say, beside={key: function_and_args(g, Graph(g), 0)
                                                for key, g in calls.items()})
  table.step_overhead = beside["launch"]
  table.argument_overhead, table.output_overhead = call_costs(beside, beside["launch"])
  table.machine["training_steps"] = [profile.step_time for _, _, profile in steps]
  return steps, microbatched


def _fit_lines(run, cluster, steps, microbatched):
  """Each op line's fixed seconds and factor into the table: the op types
  the small training steps run fitted on their times there, the others on
  the chains and graphs. The steps' entries stay out of the table: only the
  lines (fixed + factor * roofline) carry over to other shapes. Leaves the
  table's op_overhead 0 and returns the chains' op overhead it held."""
  table, costs, measured = run.table, run.costs, run.measured
  model = op_cost.CostModel(cluster, table=table, op_overhead=0.0)
  points = in_step_points(steps + microbatched, table.step_overhead,
                          table.graph_call_overhead)
  in_step = {op for op, _, _ in points.values()}
  fit = {sig: (op, model.roofline(cost), measured[sig])
         for sig, (op, cost) in costs.items()
         if op not in in_step and sig in measured}
  fit.update({sig: (op, model.roofline(cost), seconds)
              for sig, (op, cost, seconds) in points.items()})
  # Fitted on traced times as they are: step_scale then scales the lines to
  # untraced steps in one number (time_scale, from the chains' fit, swings
  # with the noise, and step_scale would only undo it).
  chain_overhead, table.op_overhead = table.op_overhead, 0.0
  time_scale, table.time_scale = table.time_scale, 1.0
  table.fit_factors({sig: (op, model.roofline(cost)) for sig, (op, cost) in costs.items()},
                    seconds=measured)
  # The fixed time of a call is what it costs alone (the chains) for the
  # ops an MLP's step runs too (matmuls, bias, elementwise math): fitting
  # both parts on the steps' times prices a small model's ops at the
  # steps' sizes (the example MLPs came out at twice their measured
  # steps), so the in-step times fit only the factor. The lines of the ops
  # only the transformer-shaped steps run (attention's batched matmuls and
  # einsums, head transposes, softmax, masks) are fitted on both parts in
  # the steps, whose micro-batched variants give them sizes down to a
  # quarter: alone in a chain such an op costs 20-25 us a call, in a step
  # 45-55 us whatever its size, and with the chains' fixed part a GPT's
  # step in four micro-batches was priced at 0.72 of its time. Keras 3's
  # dense layers only run in transformer steps, yet keep the chains' fixed
  # part (fitting._DENSE_LINES).
  in_steps_fixed = lines_fitted_in_steps(
      in_step, [step for step, (_, _, seq, _) in zip(steps, graphs.TRAINING_STEPS) if seq == 1])
  alone = {op: table.op_fixed.get(op, table.default_fixed)
           for op in (set(table.op_fixed) | in_step) - in_steps_fixed}
  table.fit_factors({sig: (op, roof) for sig, (op, roof, _) in fit.items()},
                    seconds={sig: t for sig, (_, _, t) in fit.items()}, fixed=alone)
  table.time_scale = time_scale
  return chain_overhead
