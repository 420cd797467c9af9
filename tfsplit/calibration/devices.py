"""Measurements over this process's logical CPUs: how far copies of the
training steps overlap when each device runs one in lockstep (the
concurrency of data-parallel replicas and pipeline stages sharing the
machine's cores), what a collective costs in a chain of them and inside a
step (alone, and with several groups exchanging at once), what a transfer
between two devices costs, and what each further pipeline stage adds to a
step. Each runs copies or cuts of the graphs of tfsplit.calibration.graphs
with the timing of tfsplit.calibration.measure, and leaves the arithmetic
on the times to tfsplit.cost.fitting.
"""
import statistics
import time

import numpy as np
import tensorflow as tf

from tfsplit.calibration import graphs, measure
from tfsplit.cost.fitting import (EXCHANGE, EXCHANGES, collective_overlap,
                                  further_stage_seconds, in_step_collective)
from tfsplit.errors import TfsplitError
from tfsplit.graph.ir import Graph
from tfsplit.runtime import timing
from tfsplit.runtime.devices import ensure_logical_devices

_DEVICE_COUNTS = (2, 4)   # logical CPUs the concurrency and collectives are measured on
# Pipeline cuts of the MLP-shaped training steps, timed in turns with the
# uncut steps, _STAGE_ROUNDS rounds (stage_overhead): (k of
# graphs.TRAINING_STEPS, stages). Only those: a transformer-shaped step's
# time moves by more than a stage costs.
_STAGE_CUTS = ((4, 2), (4, 4), (5, 2))
_STAGE_ROUNDS = 15


def _session_seconds(graph_def, repeats):
  """Median seconds of an untraced Session run of `graph_def` (every op)."""
  graph = Graph(graph_def)
  tf_graph, _, feeds, _ = measure.session_graph(graph_def, graph, np.random.default_rng(0))
  fetches = [tf_graph.get_operation_by_name(n.name) for n in graph.nodes
             if not graph.consumers(n.name)]
  config = tf.compat.v1.ConfigProto(allow_soft_placement=True)
  config.device_count["CPU"] = max(_DEVICE_COUNTS)
  times = []
  with tf.compat.v1.Session(graph=tf_graph, config=config) as sess:
    for _ in range(3):
      sess.run(fetches, feeds)
    for _ in range(repeats):
      t0 = time.perf_counter()
      sess.run(fetches, feeds)
      times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _unit_seconds(kind, repeats, lengths=(20, 120), trials=3, devices=2):
  """Seconds one more unit of graphs.devices_graph(kind, devices=devices) adds:
  the median over `trials` of the slope between two lengths, each the
  median of `repeats` runs."""
  by_length = [graphs.devices_graph(kind, n, devices) for n in lengths]
  slopes = []
  for _ in range(trials):
    short, long = (_session_seconds(g, repeats) for g in by_length)
    slopes.append((long - short) / (lengths[1] - lengths[0]))
  return max(0.0, statistics.median(slopes))


def _copies_session(graph_def, copies, graph=None):
  """A Session running `copies` copies of a training step's GraphDef (or
  of a list of one GraphDef per copy, differing only in attributes; graph:
  its Graph, when the caller has it), copy d on logical CPU d, its fed
  weights and optimizer state held in variables there (feeding them would
  cost more than a small step); the (fn, args) of one run, and the session
  (to close)."""
  per_copy = graph_def if isinstance(graph_def, list) else [graph_def] * copies
  graph = graph or Graph(per_copy[0])
  ends = [n.name for n in graph.nodes if not graph.consumers(n.name)]
  tf_graph, fetches = tf.Graph(), []
  with tf_graph.as_default():
    for d, graph_def in enumerate(per_copy):
      with tf.device(f"/device:CPU:{d}"):
        reads, rng = {}, np.random.default_rng(0)   # every copy computes the same
        for node in graph.nodes:
          if node.op == "Placeholder":
            value = measure.feed_value(node.attr["dtype"].type,
                                       tf.TensorShape(node.attr["shape"].shape).as_list(), rng)
            reads[node.name + ":0"] = tf.Variable(value).read_value()
        tf.graph_util.import_graph_def(graph_def, input_map=reads, name=f"copy{d}")
      fetches += [tf_graph.get_operation_by_name(f"copy{d}/{name}") for name in ends]
    init = tf.compat.v1.global_variables_initializer()
  config = tf.compat.v1.ConfigProto(allow_soft_placement=True)
  config.device_count["CPU"] = max(_DEVICE_COUNTS)
  sess = tf.compat.v1.Session(graph=tf_graph, config=config)
  sess.run(init)
  return (lambda: sess.run(fetches), ()), sess


def step_concurrency(repeats=10):
  """({n: concurrency}, {n: [each step's n * one / together]}, {(n, g):
  seconds per collective in a step, g groups of n at once}) of n logical
  CPUs for each count of _DEVICE_COUNTS: n copies of each of
  graphs.TRAINING_STEPS, one per device, run together in lockstep (as
  data-parallel replicas and pipeline stages run), against one copy
  alone, n * one / together; the concurrency is the median over the
  steps, within [1, n]. The steps' ops are small: each
  runs on one core or little more, so copies on two devices overlap on a
  2-core machine (1.2-1.4 measured) where chains of larger elementwise
  ops, which spread over the intra-op threads, did not (1.0).

  In the same turns, the copies of the MLP-shaped steps exchanging their
  blocks' outputs and gradients, alone and in groups exchanging side by
  side (EXCHANGES): what a collective adds to a step
  (in_step_collective). Only those: a transformer-shaped step's time
  moves by more than its few collectives cost."""
  steps, sessions, exchanges = {}, [], {}
  try:
    for k, (blocks, _, seq, _) in enumerate(graphs.TRAINING_STEPS):
      graph_def, graph = graphs.training_step(k)
      for n in (1,) + _DEVICE_COUNTS:
        steps[(k, n)], sess = _copies_session(graph_def, n, graph)
        sessions.append(sess)
      if seq == 1:   # MLP-shaped: 2 collectives a block (graphs.training_graph)
        exchanges[k] = 2 * blocks
        for n, groups in EXCHANGES:
          group_steps = [graphs.training_step(k, exchange_over=n, exchange_group=g)[0]
                         for g in range(groups)]
          per_copy = [group_steps[d // n] for d in range(n * groups)]
          steps[(k, n, EXCHANGE, groups)], sess = _copies_session(per_copy, n * groups)
          sessions.append(sess)
    seconds = measure.steps_time(steps, repeats)
  finally:
    for sess in sessions:
      sess.close()
  per_step = {n: [n * seconds[(k, 1)] / seconds[(k, n)]
                  for k in range(len(graphs.TRAINING_STEPS))]
              for n in _DEVICE_COUNTS}
  return ({n: min(float(n), max(1.0, statistics.median(r))) for n, r in per_step.items()},
          per_step, in_step_collective(seconds, exchanges))


def device_benchmark(repeats=10):
  """{name: value} of logical CPUs of this process, timed untraced:

    concurrency   {n: concurrency}, per_step {n: [each step's]}
                  (step_concurrency); n devices' work over the time it
                  takes them together (n: they run in parallel; 1: one
                  after the other, as logical CPUs sharing a machine's
                  cores do), at least 1;
    chain         {n: seconds per collective in a chain of them alone};
    in_step       {n: seconds a collective adds to the MLP-shaped steps}
                  (step_concurrency);
    collective    {n: seconds per collective}: the in-step cost, at least
                  the chain's;
    at_once       {(n, g): seconds that g groups' collectives over n
                  devices each add when they run at the same moments}, g > 1;
    overlap       the share of a collective's cost each further group
                  running one at once adds (collective_overlap, from the
                  first of at_once);
    transfer      seconds per cross-device transfer.

  For n in _DEVICE_COUNTS. Inside a step a collective costs more than in
  a chain (its devices' threads are busy with the step's ops and wake
  late): the example models' own all-reduces (each split graph timed
  against itself with its collectives made identities) added 180-320 us
  each one morning (MLP and GPT, tp=2 and dp=2) where the chain read
  84-114 us, and priced at the chain's, the example MLPs' dp and tp
  splits read 0.66-0.89 of their measured times."""
  chain = {n: _unit_seconds("collective", repeats, devices=n) for n in _DEVICE_COUNTS}
  concurrency, per_step, in_step = step_concurrency(repeats)
  collective = {n: max(chain[n], in_step[(n, 1)]) for n in _DEVICE_COUNTS}
  at_once = {shape: t for shape, t in in_step.items() if shape[1] > 1}
  size, groups = next(iter(at_once))   # EXCHANGES' first shape of several groups
  return {"concurrency": concurrency, "per_step": per_step, "chain": chain,
          "in_step": {n: t for (n, g), t in in_step.items() if g == 1},
          "transfer": _unit_seconds("transfer", repeats), "collective": collective,
          "at_once": at_once,
          "overlap": collective_overlap(at_once[(size, groups)], collective[size], groups)}


def stage_steps():
  """{(k, S): (fn, args)}: _STAGE_CUTS' steps cut into S pipeline stages
  (graphs.training_graph's `stages`), one per logical CPU; {} where this
  process has too few logical CPUs (a function would place the missing
  ones' ops on CPU:0)."""
  try:
    ensure_logical_devices(max(n for _, n in _STAGE_CUTS))
  except TfsplitError:
    return {}
  steps = {}
  for k, stages in _STAGE_CUTS:
    blocks, batch, seq, hidden = graphs.TRAINING_STEPS[k]
    graph_def = graphs.training_graph(blocks, batch, seq, hidden, first_style=k, stages=stages)
    steps[(k, stages)] = measure.function_and_args(graph_def, Graph(graph_def), 0)
  return steps


def stage_overhead(repeats, transfer):
  """(seconds, {(k, S): seconds}): what each further pipeline stage adds
  to a step beyond its two transfers (the activation forward, its
  gradient back; `transfer` seconds each), and per cut of _STAGE_CUTS
  what it added a stage (further_stage_seconds); (None, {}) where this
  process has too few logical CPUs. The cut steps and their uncut ones
  take turns, _STAGE_ROUNDS rounds of their own: timed in the training
  steps' five rounds, between steps 20 times longer, the estimate swung
  from 0 to 68 us over three calibrations one morning; in 9 rounds of
  their own, 25-65 us over six, and 18-85 over nine in a noisier hour."""
  steps = stage_steps()
  if not steps:
    return None, {}
  for k in sorted({k for k, _ in steps}):
    steps[k] = measure.function_and_args(*graphs.training_step(k), 0)
  _, rounds = timing.take_turns(steps, warmup=measure.WARMUP, rounds=_STAGE_ROUNDS,
                                steps=repeats, settle=measure.SETTLE)
  return further_stage_seconds(rounds, transfer)
