"""Measuring op costs on this machine, for a CostTable (`tfsplit calibrate`).

Op times are measured where they matter: inside a whole graph run by TF's
executor (after Grappler), from the step stats of a traced Session run. Each
node's kernel time lands in the table under its signature (op and shapes);
the median over nodes and runs is kept. A node that Grappler fused into a
neighbour or folded away has no time of its own and is recorded as 0: its
work is in the fused node's time, as it is when the graph runs for real.

The standard micro-benchmark (MatMuls, elementwise ops, transposes,
reductions and copies over a range of sizes) gives the machine-level part:
the best MatMul FLOP/s and copy bandwidth (the roofline), the per-op-type
efficiency of ops next to it, the overhead of one op, and `time_scale`, the
ratio of an untraced run's time to the summed traced op times of the same
graph (tracing slows every op a little; inter-op parallelism speeds a step).
"""
import collections
import os
import platform
import statistics
import time

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.core.framework import graph_pb2

from tfsplit.cost import op_cost
from tfsplit.errors import CalibrationError
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.ir import Graph
from tfsplit.graph.shapes import infer_shapes

_MATMUL_SIZES = (16, 32, 64, 128, 256, 512)
_ELEMENT_SIZES = (64, 1024, 16384, 262144)
_COPIES = 8  # chained copies of each micro-benchmark op
_DISPATCH_CHAIN = 400


class Profile:
  """Per-node kernel times of traced runs, and the untraced step time."""

  def __init__(self, node_times, step_time, traced_sum):
    self.node_times = node_times   # node name -> [seconds per traced run]
    self.step_time = step_time     # median untraced Session.run, seconds
    self.traced_sum = traced_sum   # median summed kernel time of a traced run

  def median(self, name):
    times = self.node_times.get(name)
    return statistics.median(times) if times else None


def _feed_value(dtype, shape, rng):
  shape = [1 if d is None else d for d in shape]
  np_dtype = tf.as_dtype(dtype).as_numpy_dtype
  if tf.as_dtype(dtype).is_floating:
    return (rng.random(shape) * 0.02).astype(np_dtype)
  return np.zeros(shape, dtype=np_dtype)


def _session_graph(graph_def, graph, rng):
  """A tf.Graph running `graph_def` on fresh variables; (graph, fetches, feeds)."""
  from tfsplit.graph.endpoints import graph_inputs, graph_outputs  # pylint: disable=import-outside-toplevel
  variables = variables_lib.find_variables(graph)
  unknown = [v for v in variables if v.shape is None or not v.dtype]
  if unknown:
    shapes = infer_shapes(graph, variables)
    del shapes
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
      value = _feed_value(var.dtype, var.shape, rng)
      handle = tf.Variable(value, name="calibration_var").handle
      input_map[var.node + ":0"] = handle
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
    feeds[tf_graph.get_tensor_by_name(name + ":0")] = _feed_value(
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


def _function_step_time(graph_def, graph, repeats, seed):
  """Median seconds of calling `graph_def` as a TF2 function, untraced.

  Timed the way a user runs a training step (an eager call of a function,
  which costs more per call than Session.run), on fresh variables.
  """
  from tfsplit.graph.endpoints import graph_inputs  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime.graph_function import import_graph  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  variables = []
  for var in variables_lib.find_variables(graph):
    if var.kind == "captured":
      variables.append(tf.Variable(_feed_value(var.dtype, var.shape, rng),
                                   name=var.name))
  fn = import_graph(graph_def, variables)
  args = []
  for name in graph_inputs(graph):
    node = graph.node(name)
    args.append(tf.constant(_feed_value(
        node.attr["dtype"].type,
        tf.TensorShape(node.attr["shape"].shape).as_list(), rng)))
  for _ in range(2):
    fn(*args)
  steps = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn(*args)
    steps.append(time.perf_counter() - t0)
  return statistics.median(steps)


def profile_graph(graph_def, repeats=10, traced=5, seed=0):
  """Runs `graph_def`; returns its Profile.

  `repeats` untraced calls of the graph as a function give the step time
  (median); `traced` FULL_TRACE Session runs the per-node kernel times.
  Variables are fresh (small random values).
  """
  graph = Graph(graph_def)
  rng = np.random.default_rng(seed)
  tf_graph, fetches, feeds, init = _session_graph(graph_def, graph, rng)
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
  step = _function_step_time(graph_def, graph, repeats, seed)
  return Profile(dict(node_times), step, statistics.median(sums))


def entries_from_profile(graph, shapes, profile):
  """{signature: median seconds} over the graph's nodes that do work.

  Nodes absent from the step stats (fused or folded by Grappler) count 0.
  """
  samples = collections.defaultdict(list)
  for node in graph.nodes:
    if node.op in ("Const", "Placeholder", "VarHandleOp") or \
        variables_lib.is_variable_node(node):
      continue
    times = profile.node_times.get(node.name)
    sig = op_cost.signature(node, shapes)
    if times:
      samples[sig].extend(times)
    else:
      samples[sig].append(0.0)
  return {sig: statistics.median(v) for sig, v in samples.items()}


def _micro_graph():
  """The standard micro-benchmark as a GraphDef.

  One chain of _COPIES dependent ops per op and size (a model's ops mostly
  wait on each other too); the chains are independent of each other. Chains
  start from fed placeholders, so Grappler cannot fold them away.
  """
  g = tf.Graph()
  rng = np.random.default_rng(0)
  with g.as_default():
    for n in _MATMUL_SIZES:
      a = tf.constant(rng.random([n, n], dtype=np.float32) / n)
      with tf.name_scope(f"matmul_{n}"):
        x = tf.compat.v1.placeholder(tf.float32, [n, n])
        for _ in range(_COPIES):
          x = tf.linalg.matmul(x, a)
      with tf.name_scope(f"transpose_{n}"):
        x = tf.compat.v1.placeholder(tf.float32, [n, n])
        for _ in range(_COPIES):
          x = tf.transpose(x) * a  # a lone transpose pair would be removed
    for size in _ELEMENT_SIZES:
      c = tf.constant(rng.random([size], dtype=np.float32))
      for name, fn in (("add", lambda t: tf.add(t, t)),
                       ("mul", lambda t: tf.multiply(t, c)),
                       ("exp", tf.exp),
                       ("copy", lambda t: tf.raw_ops.DeepCopy(x=t))):
        with tf.name_scope(f"{name}_{size}"):
          x = tf.compat.v1.placeholder(tf.float32, [size])
          for _ in range(_COPIES):
            x = fn(x)
      with tf.name_scope(f"sum_{size}"):
        tf.reduce_sum(tf.compat.v1.placeholder(tf.float32, [size]))
  return g.as_graph_def()


def _dispatch_graph(length=_DISPATCH_CHAIN):
  """A chain of tiny ops: its time is almost all executor dispatch."""
  g = tf.Graph()
  with g.as_default():
    # Binary ops: Grappler fuses chains of unary ops into one kernel.
    x = tf.compat.v1.placeholder(tf.float32, [16])
    c = tf.constant(np.linspace(0.5, 1.0, 16, dtype=np.float32))
    for i in range(length):
      x = tf.maximum(x, c) if i % 2 else tf.multiply(x, c)
  return g.as_graph_def()


def micro_benchmark(repeats=10, traced=5, graph_def=None):
  """(entries, Profile, graph, shapes) of the standard micro-benchmark."""
  graph_def = graph_def or _micro_graph()
  graph = Graph(graph_def)
  shapes = infer_shapes(graph, [])
  profile = profile_graph(graph_def, repeats=repeats, traced=traced)
  return entries_from_profile(graph, shapes, profile), profile, graph, shapes


def _sequential_sum(graph, entries):
  """(summed traced seconds, ops that ran) over the graph's nodes."""
  total, count = 0.0, 0
  for node in graph.nodes:
    seconds = entries.get(node.name)
    if seconds:
      total += seconds
      count += 1
  return total, count


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
  """
  say = progress or (lambda m: logging.info("%s", m))
  say("micro-benchmark: matmul, elementwise, transpose, reduce, copy; "
      "dispatch chain")
  entries, profile, graph, shapes = micro_benchmark(repeats, traced)
  runs = [(profile.step_time,) + _sequential_sum(
      graph, {n: profile.median(n) for n in graph.node_names()})]
  for length in (_DISPATCH_CHAIN // 4, _DISPATCH_CHAIN):
    _, chain_profile, chain, _ = micro_benchmark(repeats, traced,
                                                 _dispatch_graph(length))
    runs.append((chain_profile.step_time,) + _sequential_sum(
        chain, {n: chain_profile.median(n) for n in chain.node_names()}))
  table = op_cost.CostTable(machine=machine_info())
  table.time_scale, table.op_overhead, table.step_overhead = \
      fit_step_model(runs)
  costs = {}
  best_flops = best_bw = 0.0
  for node in graph.nodes:
    sig = op_cost.signature(node, shapes)
    if sig not in entries or not entries[sig]:
      continue
    seconds = entries[sig]
    cost = op_cost.node_cost(node, shapes, graph)
    costs[sig] = (node.op, cost)
    if node.op == "MatMul" and cost.flops:
      best_flops = max(best_flops, cost.flops / seconds)
    if node.op == "DeepCopy" and cost.bytes_moved:
      best_bw = max(best_bw, cost.bytes_moved / seconds)
  table.flops = best_flops or None
  table.bandwidth = best_bw or None
  table.entries.update(entries)
  for i, graph_def in enumerate(graph_defs):
    say(f"graph {i + 1}/{len(graph_defs)}: {len(graph_def.node)} nodes")
    g = Graph(graph_def)
    g_shapes = infer_shapes(g)
    g_profile = profile_graph(graph_def, repeats=repeats, traced=traced)
    g_entries = entries_from_profile(g, g_shapes, g_profile)
    table.entries.update(g_entries)
    for node in g.nodes:
      sig = op_cost.signature(node, g_shapes)
      if sig in g_entries and sig not in costs:
        costs[sig] = (node.op, op_cost.node_cost(node, g_shapes, g))
    table.machine.setdefault("graphs", []).append(
        {"nodes": len(graph_def.node), "step_time": g_profile.step_time,
         "traced_sum": g_profile.traced_sum})
  if cluster is None:
    from tfsplit.cost.cluster import ClusterSpec, Device, Host, LOCAL  # pylint: disable=import-outside-toplevel
    cluster = ClusterSpec([Device("this", "h", "this", 1, table.bandwidth or 1e10,
                                  {"float32": table.flops or 1e10})],
                          [Host("h", LOCAL, LOCAL)], name="this machine")
  model = op_cost.CostModel(cluster, table=table, op_overhead=0.0)
  table.fit_factors({sig: (op, model.roofline(cost))
                     for sig, (op, cost) in costs.items()})
  return table
