"""Fitting measured times into a CostTable's numbers, and reading a table
against the machine now: the arithmetic of calibration, apart from the
measuring. Each function takes times already measured (step and round
seconds, per-node kernel times in a Profile, the exchanging copies' times)
and returns what the table keeps: the step model's scale and gaps, the
per-argument and per-output cost of a call, what a further pipeline stage
and an in-step collective add, how far devices' kernels and gaps overlap,
which lines are fitted inside the training steps, and the machine's level
against a table's. It lives with the cost model and uses only numpy and
op_cost's pricing (no TensorFlow API, no runtime), so a table's numbers can
be fitted and checked without running a graph; tfsplit.calibration
measures and calls it.
"""
import collections
import statistics

import numpy as np
from absl import logging

from tfsplit.cost import op_cost

# Arguments and outputs of the calls that price what a call pays for each
# beyond the launch's one (call_costs; tfsplit.calibration.graphs.call_graph).
CALL_TENSORS = 40
# In-step collectives timed (tfsplit.calibration.devices.step_concurrency):
# (n, g), g groups of n copies exchanging at once (a dp=2,tp=2 split runs
# two tensor-parallel pairs' all-reduces at the same moments, and two
# data-parallel pairs').
EXCHANGES = ((2, 1), (4, 1), (2, 2))
EXCHANGE = "exchange"     # key of a step's exchanging copies (step_concurrency)
# Lines of dense layers that only the transformer-shaped steps run (Keras
# 3's Dense on a sequence: one MatMul over the rows), whose fixed part is
# nevertheless the chains', as the MLP steps' MatMuls' is. Fitted in the
# steps, that part came out at 22 us a call: Keras 3's GPT's 32 such calls
# were priced at 90 us each against 37 traced in its own step, and the GPT
# in four micro-batches (each call paid four times) read 1.20 (median of
# nine processes) where the raw and tf_keras GPTs read 1.07; with the
# chains' part (16-17 us), 1.09 (three processes).
_DENSE_LINES = frozenset({"BatchMatMulV2:broadcast"})


class Profile:
  """Per-node kernel times of traced runs, and the untraced step time."""

  def __init__(self, node_times, step_time, traced_sum):
    self.node_times = node_times   # node name -> [seconds per traced run]
    self.step_time = step_time     # untraced call (fastest round), seconds
    self.traced_sum = traced_sum   # median summed kernel time of a traced run

  def fastest(self, name):
    times = self.node_times.get(name)
    return min(times) if times else None


def fit_step_model(runs):
  """(time_scale s, op_overhead d, step_overhead c) from measured runs.

  Each run is (step seconds, summed traced kernel seconds, ops that ran) and
  obeys step = s * kernels + ops * d + c: tracing stretches every kernel a
  little (s), the executor adds a gap per op (d) and every step a fixed
  launch cost (c). The chains of tiny ops pin d and c, the micro-benchmark s.
  Least squares with every term kept >= 0.
  """
  rows = np.array([[k, n, 1.0] for _, k, n in runs])
  target = np.array([t for t, _, _ in runs])
  best = None
  for mask in ((1, 1, 1), (1, 0, 1), (1, 1, 0), (1, 0, 0)):
    cols = [i for i, m in enumerate(mask) if m]
    sol, *_ = np.linalg.lstsq(rows[:, cols], target, rcond=None)
    if (sol < 0).any():
      continue
    full = np.zeros(3)
    full[cols] = sol
    err = float(np.sum((rows @ full - target) ** 2))
    if best is None or err < best[0]:
      best = (err, full)
  if best is None:
    return 1.0, 0.0, 0.0
  s, d, c = (float(x) for x in best[1])
  return (s or 1.0), d, c


def call_costs(seconds, launch):
  """(seconds per argument, seconds per output) of a call beyond the
  launch's one of each, from the seconds of the calls of
  calibration.graphs.call_graph in `seconds` ('arguments', 'outputs'
  keys) and of the launch's."""
  extra = CALL_TENSORS - 1
  return (max(0.0, (seconds["arguments"] - launch) / extra),
          max(0.0, (seconds["outputs"] - launch) / extra))


def further_stage_seconds(round_medians, transfer):
  """(seconds, {(k, S): seconds}) from take_turns' round medians of the
  cut steps ((k, S) keys) and the uncut ones (k keys): per cut, the median
  over rounds of (cut - uncut) / (S - 1), each round's pair timed in
  adjacent turns (a level that drifts between rounds cancels); overall
  the median over the cuts less 2 `transfer`, at least 0. Not a second
  launch: a 2-op function cut over 4 devices took no longer than on one
  (160-200 us either way), where the MLP steps cut into 2 and 4 stages
  took 20-100 us a stage more than uncut."""
  per_cut = {key: statistics.median((cut - whole) / (key[1] - 1) for cut, whole in
                                    zip(rounds, round_medians[key[0]]))
             for key, rounds in round_medians.items() if isinstance(key, tuple)}
  return max(0.0, statistics.median(per_cut.values()) - 2 * transfer), per_cut


def level_ratios(table, seconds):
  """{k: each small training step's time now ({k: seconds},
  calibration.measure.level_steps timed) over its time in the table
  (CostTable.machine['training_steps'])}."""
  then = table.machine.get("training_steps") or []
  return {k: t / then[k] for k, t in sorted(seconds.items()) if k < len(then) and then[k] > 0}


def machine_level(table, seconds):
  """How much slower (> 1) or faster the machine runs now than when `table`
  was calibrated: the median of level_ratios; None for a table without
  the steps' times. A benchmark that judges predictions priced by an older
  table multiplies them by it. The median, not one step: a step's time
  drifts by up to a fifth on its own (in one process the GPT-shaped step
  read 1.18 while the six's median read 1.05)."""
  ratios = level_ratios(table, seconds)
  return statistics.median(ratios.values()) if ratios else None


def fused_matmuls(graph, profile):
  """{untraced MatMul, or BiasAdd after it: the traced node whose time is
  theirs}. Grappler's remapper runs a MatMul, the BiasAdd on its output
  and an activation after that as one _FusedMatMul kernel under the last
  one's name, so the trace has no time for the MatMul and a matmul's time
  for the BiasAdd or activation (30 us a call in the synthetic steps,
  where a bias add alone takes 3)."""
  def first_input(name):
    inputs = graph.data_inputs(name)
    return graph.get(inputs[0][0]) if inputs else None

  fused = {}
  for node in graph.nodes:
    if profile.fastest(node.name) is None:
      continue
    group, source = [], first_input(node.name)
    while (source is not None and source.op == "BiasAdd" and
           profile.fastest(source.name) is None):
      group.append(source.name)
      source = first_input(source.name)
    if (source is not None and source.op == "MatMul" and
        profile.fastest(source.name) is None and (group or node.op == "BiasAdd")):
      fused.update({name: node.name for name in group + [source.name]})
  return fused


def in_step_points(steps, launch=0.0, call_cost=None):
  """{signature: (line, NodeCost, seconds)} of the ops of the training
  steps, as they run inside a step: each node's fastest traced run times
  its step's untraced time (less the `launch` of a step and, with
  call_cost(graph), what its call's arguments and outputs cost) over the
  sum of its nodes' fastest traced runs; the median over a signature's
  nodes.
  Traced, an op inside a step is stretched by what the ops beside it take
  from the cores, and by more the more ops run side by side: a
  GPT-shaped step's traced ops summed to 2.7 times its untraced time in
  one micro-batch and 1.4 times in eight, an MLP's to 1.3 times; scaled
  by its own step, each op counts what it adds to a step."""
  samples, costs = collections.defaultdict(list), {}
  for graph, shapes, profile in steps:
    # A MatMul fused with its BiasAdd (and an activation) into one kernel
    # is a point of the MatMul's line (the rest is a hundredth of its
    # work): the BiasAdd's line keeps the times of bias adds alone, and a
    # model's pair, priced by both lines, is not counted twice.
    fused = fused_matmuls(graph, profile)
    kernels = set(fused.values())
    ran = []
    for node in graph.nodes:
      if node.name in fused and node.op == "MatMul":
        seconds = profile.fastest(fused[node.name])
      elif node.name in fused or node.name in kernels:
        continue
      else:
        seconds = profile.fastest(node.name)
      cost = op_cost.node_cost(node, shapes, graph)
      if seconds is not None and not cost.comm:
        ran.append((node, seconds, cost))
    traced = sum(seconds for _, seconds, _ in ran)
    outside = launch + (call_cost(graph) if call_cost else 0.0)
    scale = max(0.0, profile.step_time - outside) / traced if traced > 0 else 1.0
    for node, seconds, cost in ran:
      sig = op_cost.signature(node, shapes)
      samples[sig].append(seconds * scale)
      costs[sig] = (cost.line, cost)
  return {sig: (costs[sig][0], costs[sig][1], statistics.median(v))
          for sig, v in samples.items()}


def step_lines(steps):
  """The lines (op types or forms) of the ops that run in `steps`."""
  return {op_cost.node_cost(node, shapes, graph).line
          for graph, shapes, profile in steps for node in graph.nodes
          if profile.fastest(node.name) is not None}


def lines_fitted_in_steps(in_step, mlp_steps):
  """The lines of `in_step` (those timed in the training steps) whose
  fixed part, too, is fitted on the steps' times (see
  calibration.run.calibrate): those the MLP steps (`mlp_steps`) do not
  run, but for _DENSE_LINES."""
  return set(in_step) - _DENSE_LINES - step_lines(mlp_steps)


def _priced_ops(model, graph, shapes):
  """(seconds, count) of the ops of `graph` the planner prices (all but
  collectives) by `model`."""
  seconds, ops = 0.0, 0
  for node in graph.nodes:
    cost = op_cost.node_cost(node, shapes, graph)
    if not cost.comm:
      seconds += model.compute_time(cost, 0, None)
      ops += 1
  return seconds, ops


def _relative_least_squares(x, y):
  """The least-squares solution of x @ sol = y relative to each y."""
  w = 1.0 / y
  sol, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
  return sol


def step_scale(table, steps, cluster):
  """(scale s, overhead per op d) of ops inside a training step: the
  untraced step times of `steps` (training steps, micro-batched ones too)
  against the table's time for their ops, step = s * ops' times + d * ops
  + launch + the call's arguments and outputs (CostTable.call_overhead),
  least squares relative to each step. Every op the planner prices counts
  (all but collectives, also those Grappler folds), as it counts them.
  The lines were fitted on each op's time inside such steps, yet a ratio
  of sums alone (d = 0), dominated by the largest steps, priced the MLP-
  shaped steps at 0.53-0.69 of their times and the largest at 1.17: each
  op pays about a microsecond a call whatever its line, which the lines'
  fixed parts (their chains', for the ops an MLP runs) do not hold. s
  also takes out what tracing adds and what running ops side by side
  saves."""
  model = op_cost.CostModel(cluster, table=table, op_overhead=0.0)
  rows, target = [], []
  for graph, shapes, profile in steps:
    seconds, ops = _priced_ops(model, graph, shapes)
    outside = table.step_overhead + table.graph_call_overhead(graph)
    logging.info("training step: %.3f ms, %d ops, %.3f ms by the lines",
                 profile.step_time * 1e3, ops, seconds * 1e3)
    if profile.step_time > outside and seconds > 0:
      rows.append((seconds, ops))
      target.append(profile.step_time - outside)
  if not rows:
    return 1.0, 0.0
  x, y = np.array(rows, dtype=float), np.array(target)
  sol = _relative_least_squares(x, y)
  if sol[0] > 0 and sol[1] >= 0:
    return float(sol[0]), float(sol[1])
  return float(y.sum() / x[:, 0].sum()), 0.0   # the ratio of the sums, no gap


def kernel_and_gap_concurrency(table, steps, per_step, cluster):
  """({n: kernels' concurrency}, {n: gaps' concurrency}) of n logical
  CPUs: each training step of `steps` (one per entry of per_step[n], its
  measured concurrency C, calibration.devices.step_concurrency) is its
  ops' work K (the lines at graph_scale) and their gaps G (op_overhead
  each), and n copies in lockstep take n K / c_k + n G / c_g, so 1 / C =
  (K / c_k + G / c_g) / (K + G): least squares relative to each step, each within [1, n].
  One concurrency for both priced a GPT's dp=2 replicas, a third of whose
  time is gaps, at up to 1.27 of their measured step: the small steps,
  mostly gaps, overlap on the cores further than large ones (1.5-1.7
  against 1.25-1.35 measured); ({}, {}) without gaps (op_overhead 0)."""
  if not table.op_overhead:
    return {}, {}
  model = op_cost.CostModel(cluster, table=table, op_overhead=0.0)
  work = []
  for graph, shapes, _ in steps:
    seconds, ops = _priced_ops(model, graph, shapes)
    work.append((seconds, table.op_overhead * ops))
  kernels, gaps = {}, {}
  for n, measured in per_step.items():
    rows = [(k / (k + g), g / (k + g), 1.0 / c)
            for (k, g), c in zip(work, measured) if c and k + g > 0]
    if len(rows) < 2:
      continue
    x = np.array([[a, b] for a, b, _ in rows])
    y = np.array([t for _, _, t in rows])
    inverse = np.clip(_relative_least_squares(x, y), 1.0 / n, 1.0)
    kernels[int(n)], gaps[int(n)] = float(1.0 / inverse[0]), float(1.0 / inverse[1])
  return kernels, gaps


def in_step_collective(seconds, exchanges, shapes=None):
  """{(n, g): seconds that g groups of n devices, each running one
  collective at once, add to a step}: over the exchanging copies' timed
  `seconds` ({key: seconds}, keys as step_concurrency makes them: (k, c)
  c plain copies, (k, n, EXCHANGE, g) n * g copies exchanging in g groups
  of n) for the steps of `exchanges` ({k: collectives per copy}), what the
  exchanges added over as many plain copies' time, summed, over the
  collectives each copy ran (a ratio of sums: the step with the most
  collectives, the steadiest difference, weighs most). shapes: the (n, g)
  to read (default EXCHANGES)."""
  count = sum(exchanges.values())
  return {(n, g): sum(seconds[(k, n, EXCHANGE, g)] - seconds[(k, n * g)]
                      for k in exchanges) / count
          for n, g in (shapes or EXCHANGES)}


def collective_overlap(at_once, single, groups):
  """The share of one collective's cost that each further group running
  one at the same time adds (0: their waits overlap fully, 1: not at all):
  from `at_once`, seconds that `groups` groups' collectives at once add,
  and `single`, one group's; within [0, 1]."""
  if single <= 0 or groups < 2:
    return 1.0
  return min(1.0, max(0.0, (at_once / single - 1.0) / (groups - 1)))
