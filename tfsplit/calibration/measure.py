"""Running graphs on this machine and timing them: a GraphDef in a Session on
fresh variables (traced with FULL_TRACE for each node's kernel time) and as
a TF2 function called eagerly, as a user's step runs (its untraced time, in
rounds of turns with other steps so that a burst of other work lands on all
of them). It owns the timing settings every calibration run shares (WARMUP,
ROUNDS, SETTLE), the micro-benchmark and training-step profiles, and the
table entries read from a profile; the graphs come from
tfsplit.calibration.graphs, and tfsplit.cost.fitting turns the times into a
table's numbers.
"""
import collections
import statistics

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tfsplit.calibration import graphs
from tfsplit.cost import op_cost
from tfsplit.cost.fitting import Profile
from tfsplit.errors import CalibrationError
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.endpoints import graph_inputs, graph_outputs
from tfsplit.graph.ir import Graph
from tfsplit.graph.shapes import infer_shapes
from tfsplit.runtime import timing
from tfsplit.runtime.graph_function import import_graph

# Untraced steps: calls before timing, rounds, and calls before each turn's
# timed ones (tfsplit.runtime.timing).
WARMUP, ROUNDS, SETTLE = 5, 5, 2
# The transformer-shaped steps are also timed in these micro-batch counts
# (where the batch divides): a micro-batch runs the step's ops on a
# fraction of the batch, and an attention op's time inside a step has a
# fixed part per call far above its chain's, which only smaller sizes
# show (see calibration.run.calibrate). Adding 2 micro-batches moved no
# prediction of the example models by more than 0.03 and cost calibration
# 4 more steps.
_MICROBATCHES = (4,)


def feed_value(dtype, shape, rng):
  shape = [1 if d is None else d for d in shape]
  np_dtype = tf.as_dtype(dtype).as_numpy_dtype
  if tf.as_dtype(dtype).is_floating:
    return (rng.random(shape) * 0.02).astype(np_dtype)
  return np.zeros(shape, dtype=np_dtype)


def session_graph(graph_def, graph, rng):
  """A tf.Graph running `graph_def` on fresh variables; (graph, fetches, feeds)."""
  variables = variables_lib.find_variables(graph)
  unknown = [v for v in variables if v.shape is None or not v.dtype]
  if unknown:
    infer_shapes(graph, variables)   # fills in shapes that ops assigning them give
    unknown = [v for v in variables if v.shape is None or not v.dtype]
  if unknown:
    raise CalibrationError(
        f"node '{unknown[0].node}' (op Placeholder): variable "
        f"'{unknown[0].name}' has no known shape or dtype, so calibration "
        "cannot create it; load the graph from its tf.function")
  tf_graph = tf.Graph()
  with tf_graph.as_default():
    input_map = {}
    for var in variables:
      if var.kind == "VarHandleOp":
        continue
      input_map[var.node + ":0"] = _fresh_variable(graph, var, rng, "calibration_var").handle
    clean = graph_pb2.GraphDef()
    clean.CopyFrom(graph_def)
    outputs = graph_outputs(graph)
    tf.graph_util.import_graph_def(clean, input_map=input_map, name="")
    fetches = [tf_graph.get_operation_by_name(name) for name in outputs]
    init = tf.compat.v1.global_variables_initializer()
  feeds = {}
  for name in graph_inputs(graph):
    node = graph.node(name)
    shape = tf.TensorShape(node.attr["shape"].shape)
    if shape.rank is None:
      raise CalibrationError(f"node '{name}' (op Placeholder): input of "
                             "unknown rank; give inputs a static shape")
    feeds[tf_graph.get_tensor_by_name(name + ":0")] = feed_value(
        node.attr["dtype"].type, shape.as_list(), rng)
  return tf_graph, fetches, feeds, init


def _config(graph):
  devices = {n.device for n in graph.nodes if n.device}
  config = tf.compat.v1.ConfigProto(allow_soft_placement=True)
  config.device_count["CPU"] = max(1, len(devices))
  return config


def _kernel_seconds(stats):
  if stats.op_end_rel_nanos or stats.op_start_rel_nanos:
    return (stats.op_end_rel_nanos - stats.op_start_rel_nanos) * 1e-9
  return (stats.op_end_rel_micros - stats.op_start_rel_micros) * 1e-6


def _fresh_variable(graph, var, rng, name):
  """A tf.Variable for `var` (a VariableInfo of `graph`) with a small random
  value (feed_value), on its placeholder's device: a pipeline stage's
  weights live on its device, and created on CPU:0 each read would be a
  transfer."""
  with tf.device(graph.node(var.node).device or None):
    return tf.Variable(feed_value(var.dtype, var.shape, rng), name=name)


def step_function(graph_def, graph, seed):
  """`graph_def` as a TF2 function on fresh variables (_fresh_variable, one
  per captured variable, in the graph's order), arguments for it, and the
  variables: (fn, args, [tf.Variable])."""
  rng = np.random.default_rng(seed)
  variables = [_fresh_variable(graph, var, rng, var.name)
               for var in variables_lib.find_variables(graph) if var.kind == "captured"]
  fn = import_graph(graph_def, variables)
  args = []
  for name in graph_inputs(graph):
    node = graph.node(name)
    # On its placeholder's device: a pipeline stage's weights live on its
    # device, and one fed from CPU:0 would add a copy per call.
    with tf.device(node.device or None):
      args.append(tf.constant(feed_value(
          node.attr["dtype"].type,
          tf.TensorShape(node.attr["shape"].shape).as_list(), rng)))
  return fn, args, variables


def function_and_args(graph_def, graph, seed):
  """(fn, args) of step_function."""
  return step_function(graph_def, graph, seed)[:2]


def _function_step_time(graph_def, graph, repeats, seed):
  """Seconds of calling `graph_def` as a TF2 function, untraced.

  Timed the way a user runs a training step (an eager call of a function,
  which costs more per call than Session.run), on fresh variables, in
  rounds (steps_time).
  """
  return steps_time({0: function_and_args(graph_def, graph, seed)}, repeats)[0]


def steps_time(steps_by_key, repeats):
  """{key: seconds of a call} of {key: (fn, args)} functions timed in
  turns: ROUNDS rounds of `repeats` calls each, after WARMUP calls (a
  function's first calls run slower: a GPT-shaped step's first calls
  after tracing took 20, 16, 16 and 16 ms, then 14) and SETTLE calls per
  turn; each key's fastest round (timing.fastest_of_rounds: what a step
  costs when other work leaves the machine to it, as the benchmarks
  that judge the predictions time the plans). In turns, a burst of other
  work lands on all the steps rather than on one, whose time alone would
  then move graph_scale."""
  return timing.fastest_of_rounds(steps_by_key, warmup=WARMUP, rounds=ROUNDS,
                                  steps=repeats, settle=SETTLE)


def profile_graph(graph_def, repeats=10, traced=5, seed=0):
  """Runs `graph_def`; returns its Profile.

  `repeats` untraced calls of the graph as a function in each of ROUNDS
  rounds give the step time (the fastest round); `traced` FULL_TRACE
  Session runs the per-node kernel times. Variables are fresh (small
  random values).
  """
  graph = Graph(graph_def)
  node_times, traced_sum = _trace_graph(graph_def, graph, traced, seed)
  return Profile(node_times, _function_step_time(graph_def, graph, repeats, seed),
                 traced_sum)


def _trace_graph(graph_def, graph, traced, seed):
  """({node: [kernel seconds per traced run]}, median summed kernel
  seconds of a run) of `traced` FULL_TRACE Session runs."""
  rng = np.random.default_rng(seed)
  tf_graph, fetches, feeds, init = session_graph(graph_def, graph, rng)
  names = set(graph.node_names())
  node_times = collections.defaultdict(list)
  sums = []
  with tf.compat.v1.Session(graph=tf_graph, config=_config(graph)) as sess:
    sess.run(init)
    for _ in range(2):
      sess.run(fetches, feeds)  # warm-up: Grappler, kernel creation
    options = tf.compat.v1.RunOptions(
        trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    for _ in range(traced):
      metadata = tf.compat.v1.RunMetadata()
      sess.run(fetches, feeds, options=options, run_metadata=metadata)
      total = 0.0
      for dev in metadata.step_stats.dev_stats:
        for stats in dev.node_stats:
          seconds = _kernel_seconds(stats)
          total += seconds
          if stats.node_name in names:
            node_times[stats.node_name].append(seconds)
      sums.append(total)
  return dict(node_times), statistics.median(sums)


def entries_from_profile(graph, shapes, profile):
  """{signature: seconds} over the graph's nodes that do work: the median
  over its nodes of each node's fastest traced run.

  Nodes absent from the step stats (fused or folded by Grappler) count 0.
  """
  samples = collections.defaultdict(list)
  for node in graph.nodes:
    if node.op in ("Const", "Placeholder", "VarHandleOp") or \
        variables_lib.is_variable_node(node):
      continue
    seconds = profile.fastest(node.name)
    sig = op_cost.signature(node, shapes)
    if seconds is not None:
      samples[sig].append(seconds)
    else:
      samples[sig].append(0.0)
  return {sig: statistics.median(v) for sig, v in samples.items()}


def micro_benchmark(repeats=10, traced=5, graph_def=None):
  """(entries, Profile, graph, shapes) of the standard micro-benchmark."""
  graph_def = graph_def or graphs.micro_graph()
  graph = Graph(graph_def)
  shapes = infer_shapes(graph, [])
  profile = profile_graph(graph_def, repeats=repeats, traced=traced)
  return entries_from_profile(graph, shapes, profile), profile, graph, shapes


def training_steps(repeats, traced, say=None, beside=None):
  """([(graph, shapes, Profile)] of graphs.TRAINING_STEPS, the same of their
  micro-batched variants (_MICROBATCHES), {key: seconds}): each step
  traced alone, then all of them untraced, in turns (steps_time), so that
  the level of their times (graph_scale, the machine's level) is one
  moment's; and the seconds of a call of each {key: (fn, args)} of
  `beside`, timed in the same turns."""
  cases = [(k, 1) for k in range(len(graphs.TRAINING_STEPS))]
  cases += [(k, m) for k, (_, batch, seq, _) in enumerate(graphs.TRAINING_STEPS)
            for m in _MICROBATCHES if seq > 1 and batch % m == 0]
  built, traces, functions = {}, {}, dict(beside or {})
  for k, m in cases:
    if say:
      blocks, batch, seq, hidden = graphs.TRAINING_STEPS[k]
      say(f"training step: {blocks} blocks, batch {batch}, sequence {seq}, hidden {hidden}" +
          (f", {m} micro-batches" if m > 1 else ""))
    graph_def, built[(k, m)] = graphs.training_step(k, m)
    traces[(k, m)] = _trace_graph(graph_def, built[(k, m)], traced, 0)
    functions[(k, m)] = function_and_args(graph_def, built[(k, m)], 0)
  if say:
    say(f"training steps, untraced: {ROUNDS} rounds in turns")
  seconds = steps_time(functions, repeats)
  steps = {case: (built[case], infer_shapes(built[case], []),
                  Profile(traces[case][0], seconds[case], traces[case][1]))
           for case in cases}
  return ([steps[case] for case in cases if case[1] == 1],
          [steps[case] for case in cases if case[1] > 1],
          {key: seconds[key] for key in beside or {}})


def level_steps():
  """{k: (fn, args)}: the calibration's small training steps
  (graphs.TRAINING_STEPS) as functions, to time again beside other work
  (tfsplit.runtime.timing) and read the machine's level
  (fitting.machine_level)."""
  return {k: function_and_args(*graphs.training_step(k), 0)
          for k in range(len(graphs.TRAINING_STEPS))}
