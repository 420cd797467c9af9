"""Measuring op costs on this machine, for a CostTable (`tfsplit calibrate`).

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
launch cost. Traced
op times are each node's fastest run: other work on the machine adds the
most to the ops that hand work to the intra-op threads (their wake-ups wait
for the cores), which would skew one op type against another; the level
of a step comes from the untraced times.
"""
import collections
import contextlib
import itertools
import os
import platform
import statistics
import time

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.core.framework import graph_pb2

from tfsplit.cost import op_cost
from tfsplit.errors import CalibrationError, TfsplitError
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.ir import Graph
from tfsplit.graph.shapes import infer_shapes
from tfsplit.runtime import timing
from tfsplit.runtime.devices import ensure_logical_devices

_MATMUL_SIZES = (16, 32, 64, 128, 256, 512)
_ELEMENT_SIZES = (64, 1024, 16384, 262144)
_COPIES = 8  # chained copies of each micro-benchmark op
_DISPATCH_CHAIN = 400
_DEVICE_COUNTS = (2, 4)   # logical CPUs the concurrency and collectives are measured on
# In-step collectives timed (step_concurrency): (n, g), g groups of n
# copies exchanging at once (a dp=2,tp=2 split runs two tensor-parallel
# pairs' all-reduces at the same moments, and two data-parallel pairs').
_EXCHANGES = ((2, 1), (4, 1), (2, 2))
_EXCHANGE_GROUP = 100     # group keys of the steps' collectives (+ 8 x group + its size)
EXCHANGE = "exchange"     # key of a step's exchanging copies (step_concurrency)
# (blocks, batch, sequence, hidden) of the small training steps whose ops
# are timed where they run, inside a step; sequence 1 is an MLP.
_TRAINING_STEPS = ((1, 4, 24, 48), (2, 6, 24, 48), (2, 12, 48, 96), (3, 4, 48, 96),
                   (4, 24, 1, 96), (2, 48, 1, 160))
# The transformer-shaped steps are also timed in these micro-batch counts
# (where the batch divides): a micro-batch runs the step's ops on a
# fraction of the batch, and an attention op's time inside a step has a
# fixed part per call far above its chain's, which only smaller sizes
# show (see calibrate). Adding 2 micro-batches moved no prediction of the
# example models by more than 0.03 and cost calibration 4 more steps.
_MICROBATCHES = (4,)
# Lines of dense layers that only the transformer-shaped steps run (Keras
# 3's Dense on a sequence: one MatMul over the rows), whose fixed part is
# nevertheless the chains', as the MLP steps' MatMuls' is. Fitted in the
# steps, that part came out at 22 us a call: Keras 3's GPT's 32 such calls
# were priced at 90 us each against 37 traced in its own step, and the GPT
# in four micro-batches (each call paid four times) read 1.20 (median of
# nine processes) where the raw and tf_keras GPTs read 1.07; with the
# chains' part (16-17 us), 1.09 (three processes).
_DENSE_LINES = frozenset({"BatchMatMulV2:broadcast"})
# Pipeline cuts of the MLP-shaped training steps, timed in turns with the
# uncut steps, _STAGE_ROUNDS rounds (stage_overhead): (k of
# _TRAINING_STEPS, stages). Only those: a transformer-shaped step's time
# moves by more than a stage costs.
_STAGE_CUTS = ((4, 2), (4, 4), (5, 2))
_STAGE_ROUNDS = 15
# Untraced steps: calls before timing, rounds, and calls before each turn's
# timed ones (tfsplit.runtime.timing).
_WARMUP, _ROUNDS, _SETTLE = 5, 5, 2
# (batch x heads, sequence, head size) of attention's batched matmuls, and
# (rows, features) of the row-wise ops: around the example models' sizes.
_ATTENTION_SIZES = ((8, 32, 16), (32, 32, 16), (32, 64, 32))
_ROW_SIZES = ((64, 64), (256, 64), (256, 256))


class Profile:
  """Per-node kernel times of traced runs, and the untraced step time."""

  def __init__(self, node_times, step_time, traced_sum):
    self.node_times = node_times   # node name -> [seconds per traced run]
    self.step_time = step_time     # untraced call (fastest round), seconds
    self.traced_sum = traced_sum   # median summed kernel time of a traced run

  def fastest(self, name):
    times = self.node_times.get(name)
    return min(times) if times else None


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


def _fresh_variable(graph, var, rng, name):
  """A tf.Variable for `var` (a VariableInfo of `graph`) with a small random
  value (_feed_value), on its placeholder's device: a pipeline stage's
  weights live on its device, and created on CPU:0 each read would be a
  transfer."""
  with tf.device(graph.node(var.node).device or None):
    return tf.Variable(_feed_value(var.dtype, var.shape, rng), name=name)


def step_function(graph_def, graph, seed):
  """`graph_def` as a TF2 function on fresh variables (_fresh_variable, one
  per captured variable, in the graph's order), arguments for it, and the
  variables: (fn, args, [tf.Variable])."""
  from tfsplit.graph.endpoints import graph_inputs  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime.graph_function import import_graph  # pylint: disable=import-outside-toplevel
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
      args.append(tf.constant(_feed_value(
          node.attr["dtype"].type,
          tf.TensorShape(node.attr["shape"].shape).as_list(), rng)))
  return fn, args, variables


def _function_and_args(graph_def, graph, seed):
  """(fn, args) of step_function."""
  return step_function(graph_def, graph, seed)[:2]


def _function_step_time(graph_def, graph, repeats, seed):
  """Seconds of calling `graph_def` as a TF2 function, untraced.

  Timed the way a user runs a training step (an eager call of a function,
  which costs more per call than Session.run), on fresh variables, in
  rounds (_steps_time).
  """
  return _steps_time({0: _function_and_args(graph_def, graph, seed)}, repeats)[0]


def _steps_time(steps_by_key, repeats):
  """{key: seconds of a call} of {key: (fn, args)} functions timed in
  turns: _ROUNDS rounds of `repeats` calls each, after _WARMUP calls (a
  function's first calls run slower: a GPT-shaped step's first calls
  after tracing took 20, 16, 16 and 16 ms, then 14) and _SETTLE calls per
  turn; each key's fastest round (timing.fastest_of_rounds: what a step
  costs when other work leaves the machine to it, as the benchmarks
  that judge the predictions time the plans). In turns, a burst of other
  work lands on all the steps rather than on one, whose time alone would
  then move graph_scale."""
  return timing.fastest_of_rounds(steps_by_key, warmup=_WARMUP, rounds=_ROUNDS,
                                  steps=repeats, settle=_SETTLE)


def profile_graph(graph_def, repeats=10, traced=5, seed=0):
  """Runs `graph_def`; returns its Profile.

  `repeats` untraced calls of the graph as a function in each of _ROUNDS
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
    _model_ops(rng)
  return g.as_graph_def()


def _chain(name, shape, fn, dtype=tf.float32):
  """_COPIES dependent calls x = fn(x) from a fed placeholder of `shape`."""
  with tf.name_scope(name):
    x = tf.compat.v1.placeholder(dtype, shape)
    for _ in range(_COPIES):
      x = fn(x)
  return x


def _model_ops(rng):
  """Chains of the other ops transformer and MLP training steps spend their
  time in (attention's batched matmuls, softmax and head transposes, bias,
  GELU, masks, reductions, the loss, the optimizer's elementwise math), at
  three sizes each around a small model's, so that each op type's fixed
  time per call and its slope can be fitted. Binary forms throughout:
  Grappler fuses chains of unary ops into one kernel."""
  const = lambda shape: tf.constant(  # pylint: disable=unnecessary-lambda-assignment
      (rng.random(shape, dtype=np.float32) * 0.5 + 0.5))
  for b, n, d in _ATTENTION_SIZES:
    # softmax(x x^T) x keeps x bounded over the chain (no denormals).
    _chain(f"attention_{b}_{n}_{d}", [b, n, d], lambda x: tf.linalg.matmul(
        tf.nn.softmax(tf.linalg.matmul(x, x, transpose_b=True)), x))
    heads = 4
    # Keras' dense layers over heads: einsums (TF runs one as transposes,
    # reshapes and a batched matmul: a large fixed time per call).
    w_in, w_out = const([d, heads, d // heads]) / d, const([heads, d // heads, d]) / d
    _chain(f"einsum_{b}_{n}_{d}", [b, n, d], lambda x, w_in=w_in, w_out=w_out: tf.einsum(
        "abcd,cde->abe", tf.einsum("abc,cde->abde", x, w_in), w_out))
    # Keras 3's attention: batched einsums over [batch, sequence, heads,
    # head size]; its dense layers: a batched matmul by one matrix.
    _chain(f"einsum_attention_{b}_{n}_{d}", [b, n, heads, d // heads],
           lambda x: tf.einsum("BNTS,BSNH->BTNH", tf.nn.softmax(
               tf.einsum("BTNH,BSNH->BNTS", x, x)), x))
    w = const([d, d]) / d
    _chain(f"dense_{b}_{n}_{d}", [b, n, d], lambda x, w=w: tf.linalg.matmul(x, w))
    # Head split and merge: one transpose a link (Grappler cancels a pair
    # around a multiply by a constant; a sine between keeps each).
    _chain(f"heads_{b}_{n}_{d}", [b, n, heads, d // heads],
           lambda x: tf.math.sin(tf.transpose(x, [0, 2, 1, 3])))
  for rows, cols in _ROW_SIZES:
    bias, c = const([cols]), const([rows, cols])
    mask = tf.constant(rng.random([rows, cols]) > 0.5)
    _chain(f"bias_{rows}_{cols}", [rows, cols],
           lambda x, bias=bias: tf.nn.bias_add(x, bias) * 0.5)
    _chain(f"gelu_{rows}_{cols}", [rows, cols],
           lambda x, c=c: tf.math.erf(x) * c)
    _chain(f"select_{rows}_{cols}", [rows, cols],
           lambda x, c=c, mask=mask: tf.where(mask, x, c) - c)
    _chain(f"adam_{rows}_{cols}", [rows, cols],
           lambda x, c=c: tf.math.sqrt(tf.square(x) + c) / (c + 1.0))
    _chain(f"addn_{rows}_{cols}", [rows, cols],
           lambda x, c=c: tf.math.add_n([x, c, c]) * 0.3)
    _chain(f"mean_{rows}_{cols}", [rows, cols],
           lambda x, c=c: tf.reduce_mean(x, axis=-1, keepdims=True) + c)
    with tf.name_scope(f"loss_{rows}_{cols}"):
      tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=tf.compat.v1.placeholder(tf.int32, [rows]),
          logits=tf.compat.v1.placeholder(tf.float32, [rows, cols]))


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


# Arguments and outputs of the calls that price what a call pays for each
# beyond the launch's one (call_costs).
_CALL_TENSORS = 40


def _call_graph(arguments=1, outputs=1):
  """A one-op function (an AddN of its arguments) of `arguments` inputs
  and `outputs` outputs. A call passes each argument through the eager
  function call (3-4 us each here), an output less; the calibration's
  training steps feed their weights and moments (17-143 arguments), a
  user's step captures them."""
  g = tf.Graph()
  with g.as_default():
    xs = [tf.compat.v1.placeholder(tf.float32, [16], name=f"x{i}") for i in range(arguments)]
    y = tf.add_n(xs) if arguments > 1 else tf.multiply(xs[0], 2.0)
    for i in range(outputs):
      tf.identity(y, name=f"out{i}")
  return g.as_graph_def()


def call_costs(seconds, launch):
  """(seconds per argument, seconds per output) of a call beyond the
  launch's one of each, from the seconds of the _call_graph calls in
  `seconds` ('arguments', 'outputs' keys) and of the launch's."""
  extra = _CALL_TENSORS - 1
  return (max(0.0, (seconds["arguments"] - launch) / extra),
          max(0.0, (seconds["outputs"] - launch) / extra))


def _training_graph(blocks, batch, seq=32, hidden=64, heads=4, vocab=256,
                    first_style=0, microbatches=1, exchange_over=0, exchange_group=0,
                    stages=1):
  """A small transformer's training step (forward, tf.gradients, an Adam
  update) with its weights and optimizer state fed: the op mix and the
  parallel structure of a real step, which chains of one op lack. Inside a
  step, ops run side by side on the inter-op threads and their kernels wait
  for the same intra-op threads: on a small CPU each op costs several times
  what it costs alone in a chain. Block i is written in style
  (i + first_style) % 3: matmuls and transposes (0), tf_keras' einsums (1),
  Keras 3's batched matmuls by a matrix and attention einsums (2).

  With `microbatches` m, the forward and backward run on m slices of the
  batch one after another, as the micro-batch rewrite orders them (slice
  j + 1 waits for slice j's gradients to join the running sums), and the
  update (under the name scope 'update') runs once on the sums.

  With `exchange_over` n > 1, each block's output is all-reduced over n
  copies of the step (one per logical CPU, _copies_session), and so is its
  gradient: 2 collectives per block, on the step's critical path as a
  tensor-parallel layer's are (see in_step_collective); `exchange_group` g
  numbers the group of n copies, for copies of several groups exchanging
  at once (their keys differ).

  With `stages` S > 1, the step is cut as a pipeline of S stages cuts it:
  block i, its weights, their gradients and update on logical CPU
  i * S // blocks, the head and the loss on the last (see
  stage_overhead)."""
  g = tf.Graph()
  instances = itertools.count(1 + 1000 * exchange_group)

  def exchange(t):   # the mean over the copies, forward and back
    if exchange_over < 2:
      return t

    def mean(u):
      return tf.raw_ops.CollectiveReduceV2(
          input=u, group_size=exchange_over,
          group_key=_EXCHANGE_GROUP + 8 * exchange_group + exchange_over,
          instance_key=next(instances), ordering_token=[], merge_op="Add",
          final_op="Div", communication_hint="auto", timeout_seconds=0.0)

    @tf.custom_gradient
    def across(u):
      return mean(u), mean
    return across(t)

  with g.as_default():
    feed = lambda shape, dtype=tf.float32: tf.compat.v1.placeholder(dtype, shape)  # pylint: disable=unnecessary-lambda-assignment
    tokens = feed([batch * seq, hidden])
    labels = feed([batch * seq], tf.int32)
    weights, used = [], [0]

    def weight(*shape):   # made by the first micro-batch, shared by the others
      if used[0] == len(weights):
        weights.append(feed(list(shape)))
      used[0] += 1
      return weights[used[0] - 1]

    def stage_of(i):   # the device scope of block i (i == blocks: the head)
      if stages < 2:
        return contextlib.nullcontext()
      return tf.device(f"/device:CPU:{min(i, blocks - 1) * stages // blocks}")

    def loss_of(x, labels, batch):
      used[0] = 0

      def norm(x):
        mean = tf.reduce_mean(x, -1, keepdims=True)
        var = tf.reduce_mean(tf.square(x - mean), -1, keepdims=True)
        return (x - mean) * tf.math.rsqrt(var + 1e-5) * weight(hidden) + weight(hidden)

      def dense(t, units):   # Keras 3's Dense on a sequence
        return tf.linalg.matmul(tf.reshape(t, [batch, seq, -1]),
                                weight(t.shape[-1], units)) + weight(units)

      def heads_of(t):
        return tf.transpose(tf.reshape(t, [batch, seq, heads, hidden // heads]),
                            [0, 2, 1, 3])

      causal = tf.constant(np.tril(np.ones([seq, seq], dtype=bool)))
      norm = norm if seq > 1 else (lambda t: t)
      hd = hidden // heads

      def block(i, x):
        if i:
          x = exchange(x)
        if seq == 1:   # an MLP's block: dense, GELU
          h = tf.nn.bias_add(tf.linalg.matmul(x, weight(hidden, hidden)), weight(hidden))
          return 0.5 * h * (1.0 + tf.math.erf(h * 0.7071))
        style = (i + first_style) % 3
        if style == 2:   # as Keras 3 writes it: 3-d dense matmuls, batched einsums
          y = norm(x)
          q, k, v = (tf.reshape(dense(y, hidden), [batch, seq, heads, hd]) for _ in range(3))
          scores = tf.einsum("BTNH,BSNH->BNTS", q, k) * hd ** -0.5
          probs = tf.nn.softmax(tf.where(causal, scores, -1e9))
          ctx = tf.reshape(tf.einsum("BNTS,BSNH->BTNH", probs, v), [batch * seq, hidden])
          x = x + tf.reshape(dense(ctx, hidden), [batch * seq, hidden])
          h = dense(norm(x), 4 * hidden)
          h = 0.5 * h * (1.0 + tf.math.erf(h * 0.7071))
          x = x + tf.reshape(dense(h, hidden), [batch * seq, hidden])
          return x
        if style == 1:   # as tf_keras' MultiHeadAttention writes it: einsums
          y = tf.reshape(norm(x), [batch, seq, hidden])
          q, k, v = (tf.einsum("abc,cde->abde", y, weight(hidden, heads, hd)) +
                     weight(heads, hd) for _ in range(3))
          scores = tf.einsum("aecd,abcd->acbe", k, q) * hd ** -0.5
          probs = tf.nn.softmax(tf.where(causal, scores, -1e9))
          ctx = tf.einsum("acbe,aecd->abcd", probs, v)
          out = tf.einsum("abcd,cde->abe", ctx, weight(heads, hd, hidden)) + weight(hidden)
          x = x + tf.reshape(out, [batch * seq, hidden])
          h = tf.einsum("abc,cd->abd", tf.reshape(norm(x), [batch, seq, hidden]),
                        weight(hidden, 4 * hidden)) + weight(4 * hidden)
          h = 0.5 * h * (1.0 + tf.math.erf(h * 0.7071))
          x = x + tf.reshape(tf.einsum("abc,cd->abd", h, weight(4 * hidden, hidden)) +
                             weight(hidden), [batch * seq, hidden])
          return x
        qkv = tf.nn.bias_add(tf.linalg.matmul(norm(x), weight(hidden, 3 * hidden)),
                             weight(3 * hidden))
        q, k, v = (heads_of(t) for t in tf.split(qkv, 3, axis=-1))
        scores = tf.linalg.matmul(q, k, transpose_b=True) * (hidden // heads) ** -0.5
        probs = tf.nn.softmax(tf.where(causal, scores, -1e9))
        ctx = tf.reshape(tf.transpose(tf.linalg.matmul(probs, v), [0, 2, 1, 3]),
                         [batch * seq, hidden])
        x = x + tf.nn.bias_add(tf.linalg.matmul(ctx, weight(hidden, hidden)), weight(hidden))
        h = tf.nn.bias_add(tf.linalg.matmul(norm(x), weight(hidden, 4 * hidden)),
                           weight(4 * hidden))
        h = 0.5 * h * (1.0 + tf.math.erf(h * 0.7071))
        x = x + tf.nn.bias_add(tf.linalg.matmul(h, weight(4 * hidden, hidden)),
                               weight(hidden))
        return x

      for i in range(blocks):
        with stage_of(i):
          x = block(i, x)
      with stage_of(blocks):
        logits = tf.linalg.matmul(norm(exchange(x)), weight(hidden, vocab))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))

    rows = batch // microbatches * seq
    sums = None
    for j in range(microbatches):
      if microbatches == 1:
        x, y = tokens, labels
      else:
        rows_j = tokens[j * rows:(j + 1) * rows]
        with tf.control_dependencies(sums or []):
          x = tf.identity(rows_j)
        y = labels[j * rows:(j + 1) * rows]
      loss = loss_of(x, y, batch // microbatches)
      if microbatches > 1:   # the sums are then the whole batch's mean's gradients
        loss = loss / microbatches
      grads = tf.gradients(loss, weights)
      sums = grads if sums is None else [a + b for a, b in zip(sums, grads)]
    with tf.name_scope("update"):
      for w, grad in zip(weights, sums):
        with tf.device(w.device):   # its stage's (stage_of)
          m, v = feed(w.shape), feed(w.shape)
          m = 0.9 * m + 0.1 * grad
          v = 0.999 * v + 0.001 * tf.square(grad)
          tf.identity(w - 1e-3 * m / (tf.sqrt(v) + 1e-7))
  return g.as_graph_def()


def training_steps(repeats, traced, say=None, beside=None):
  """([(graph, shapes, Profile)] of _TRAINING_STEPS, the same of their
  micro-batched variants (_MICROBATCHES), {key: seconds}): each step
  traced alone, then all of them untraced, in turns (_steps_time), so that
  the level of their times (graph_scale, the machine's level) is one
  moment's; and the seconds of a call of each {key: (fn, args)} of
  `beside`, timed in the same turns."""
  cases = [(k, 1) for k in range(len(_TRAINING_STEPS))]
  cases += [(k, m) for k, (_, batch, seq, _) in enumerate(_TRAINING_STEPS)
            for m in _MICROBATCHES if seq > 1 and batch % m == 0]
  graphs, traces, functions = {}, {}, dict(beside or {})
  for k, m in cases:
    if say:
      blocks, batch, seq, hidden = _TRAINING_STEPS[k]
      say(f"training step: {blocks} blocks, batch {batch}, sequence {seq}, hidden {hidden}" +
          (f", {m} micro-batches" if m > 1 else ""))
    graph_def, graphs[(k, m)] = _training_step(k, m)
    traces[(k, m)] = _trace_graph(graph_def, graphs[(k, m)], traced, 0)
    functions[(k, m)] = _function_and_args(graph_def, graphs[(k, m)], 0)
  if say:
    say(f"training steps, untraced: {_ROUNDS} rounds in turns")
  seconds = _steps_time(functions, repeats)
  steps = {case: (graphs[case], infer_shapes(graphs[case], []),
                  Profile(traces[case][0], seconds[case], traces[case][1]))
           for case in cases}
  return ([steps[case] for case in cases if case[1] == 1],
          [steps[case] for case in cases if case[1] > 1],
          {key: seconds[key] for key in beside or {}})


def _training_step(k, microbatches=1, exchange_over=0, exchange_group=0):
  """(GraphDef, Graph) of _TRAINING_STEPS[k] in `microbatches`: each style
  of block (the first block's style is k's) at several sizes; with
  `exchange_over`, its blocks' outputs all-reduced over that many copies
  (group `exchange_group` of them)."""
  blocks, batch, seq, hidden = _TRAINING_STEPS[k]
  graph_def = _training_graph(blocks, batch, seq, hidden, first_style=k,
                              microbatches=microbatches, exchange_over=exchange_over,
                              exchange_group=exchange_group)
  return graph_def, Graph(graph_def)


def stage_steps():
  """{(k, S): (fn, args)}: _STAGE_CUTS' steps cut into S pipeline stages
  (_training_graph's `stages`), one per logical CPU; {} where this
  process has too few logical CPUs (a function would place the missing
  ones' ops on CPU:0)."""
  try:
    ensure_logical_devices(max(n for _, n in _STAGE_CUTS))
  except TfsplitError:
    return {}
  steps = {}
  for k, stages in _STAGE_CUTS:
    blocks, batch, seq, hidden = _TRAINING_STEPS[k]
    graph_def = _training_graph(blocks, batch, seq, hidden, first_style=k, stages=stages)
    steps[(k, stages)] = _function_and_args(graph_def, Graph(graph_def), 0)
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
    steps[k] = _function_and_args(*_training_step(k), 0)
  _, rounds = timing.take_turns(steps, warmup=_WARMUP, rounds=_STAGE_ROUNDS, steps=repeats,
                                settle=_SETTLE)
  return further_stage_seconds(rounds, transfer)


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


def level_steps():
  """{k: (fn, args)}: the calibration's small training steps (_TRAINING_STEPS)
  as functions, to time again beside other work (tfsplit.runtime.timing)
  and read the machine's level (machine_level)."""
  return {k: _function_and_args(*_training_step(k), 0) for k in range(len(_TRAINING_STEPS))}


def level_ratios(table, seconds):
  """{k: each small training step's time now ({k: seconds}, level_steps
  timed) over its time in the table (CostTable.machine['training_steps'])}."""
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
  fixed part, too, is fitted on the steps' times (see calibrate): those
  the MLP steps (`mlp_steps`) do not run, but for _DENSE_LINES."""
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
  measured concurrency C, step_concurrency) is its ops' work K (the lines
  at graph_scale) and their gaps G (op_overhead each), and n copies in
  lockstep take n K / c_k + n G / c_g, so 1 / C = (K / c_k + G / c_g) /
  (K + G): least squares relative to each step, each within [1, n].
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


def _devices_graph(kind, length, devices=2):
  """A graph over `devices` logical CPUs whose time grows by one unit per
  `length`:

    'collective' a chain of all-reduces of a small tensor over them all
    'transfer'   a chain of small ops alternating between two devices
  """
  g = tf.Graph()
  with g.as_default():
    size = 16
    x = tf.compat.v1.placeholder(tf.float32, [size])
    consts = []
    for d in range(devices):
      with tf.device(f"/device:CPU:{d}"):
        consts.append(tf.constant(np.linspace(0.5, 1.0, size, dtype=np.float32)))
    if kind == "collective":
      ys = []
      for d in range(devices):
        with tf.device(f"/device:CPU:{d}"):
          ys.append(tf.identity(x))
      for i in range(length):
        for d in range(devices):
          with tf.device(f"/device:CPU:{d}"):
            ys[d] = tf.raw_ops.CollectiveReduceV2(
                input=ys[d], group_size=devices, group_key=1, instance_key=i + 1,
                ordering_token=[], merge_op="Add", final_op="Id",
                communication_hint="auto", timeout_seconds=0.0)
    else:
      y = x
      for i in range(length):
        with tf.device(f"/device:CPU:{i % 2}"):
          y = tf.maximum(y, consts[i % 2]) if (i // 2) % 2 else \
              tf.multiply(y, consts[i % 2])
  return g.as_graph_def()


def _session_seconds(graph_def, repeats):
  """Median seconds of an untraced Session run of `graph_def` (every op)."""
  graph = Graph(graph_def)
  tf_graph, _, feeds, _ = _session_graph(graph_def, graph, np.random.default_rng(0))
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
  """Seconds one more unit of _devices_graph(kind, devices=devices) adds:
  the median over `trials` of the slope between two lengths, each the
  median of `repeats` runs."""
  graphs = [_devices_graph(kind, n, devices) for n in lengths]
  slopes = []
  for _ in range(trials):
    short, long = (_session_seconds(g, repeats) for g in graphs)
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
            value = _feed_value(node.attr["dtype"].type,
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


def in_step_collective(seconds, exchanges, shapes=None):
  """{(n, g): seconds that g groups of n devices, each running one
  collective at once, add to a step}: over the exchanging copies' timed
  `seconds` ({key: seconds}, keys as step_concurrency makes them: (k, c)
  c plain copies, (k, n, EXCHANGE, g) n * g copies exchanging in g groups
  of n) for the steps of `exchanges` ({k: collectives per copy}), what the
  exchanges added over as many plain copies' time, summed, over the
  collectives each copy ran (a ratio of sums: the step with the most
  collectives, the steadiest difference, weighs most). shapes: the (n, g)
  to read (default _EXCHANGES)."""
  count = sum(exchanges.values())
  return {(n, g): sum(seconds[(k, n, EXCHANGE, g)] - seconds[(k, n * g)]
                      for k in exchanges) / count
          for n, g in (shapes or _EXCHANGES)}


def collective_overlap(at_once, single, groups):
  """The share of one collective's cost that each further group running
  one at the same time adds (0: their waits overlap fully, 1: not at all):
  from `at_once`, seconds that `groups` groups' collectives at once add,
  and `single`, one group's; within [0, 1]."""
  if single <= 0 or groups < 2:
    return 1.0
  return min(1.0, max(0.0, (at_once / single - 1.0) / (groups - 1)))


def step_concurrency(repeats=10):
  """({n: concurrency}, {n: [each step's n * one / together]}, {(n, g):
  seconds per collective in a step, g groups of n at once}) of n logical
  CPUs for each count of _DEVICE_COUNTS: n copies of each of _TRAINING_STEPS, one per device, run
  together in lockstep (as data-parallel replicas and pipeline stages run),
  against one copy alone, n * one / together; the concurrency is the
  median over the steps, within [1, n]. The steps' ops are small: each
  runs on one core or little more, so copies on two devices overlap on a
  2-core machine (1.2-1.4 measured) where chains of larger elementwise
  ops, which spread over the intra-op threads, did not (1.0).

  In the same turns, the copies of the MLP-shaped steps exchanging their
  blocks' outputs and gradients, alone and in groups exchanging side by
  side (_EXCHANGES): what a collective adds to a step
  (in_step_collective). Only those: a transformer-shaped step's time
  moves by more than its few collectives cost."""
  steps, sessions, exchanges = {}, [], {}
  try:
    for k, (blocks, _, seq, _) in enumerate(_TRAINING_STEPS):
      graph_def, graph = _training_step(k)
      for n in (1,) + _DEVICE_COUNTS:
        steps[(k, n)], sess = _copies_session(graph_def, n, graph)
        sessions.append(sess)
      if seq == 1:   # MLP-shaped: 2 collectives a block (_training_graph)
        exchanges[k] = 2 * blocks
        for n, groups in _EXCHANGES:
          group_steps = [_training_step(k, exchange_over=n, exchange_group=g)[0]
                         for g in range(groups)]
          per_copy = [group_steps[d // n] for d in range(n * groups)]
          steps[(k, n, EXCHANGE, groups)], sess = _copies_session(per_copy, n * groups)
          sessions.append(sess)
    seconds = _steps_time(steps, repeats)
  finally:
    for sess in sessions:
      sess.close()
  per_step = {n: [n * seconds[(k, 1)] / seconds[(k, n)] for k in range(len(_TRAINING_STEPS))]
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
  size, groups = next(iter(at_once))   # _EXCHANGES' first shape of several groups
  return {"concurrency": concurrency, "per_step": per_step, "chain": chain,
          "in_step": {n: t for (n, g), t in in_step.items() if g == 1},
          "transfer": _unit_seconds("transfer", repeats), "collective": collective,
          "at_once": at_once,
          "overlap": collective_overlap(at_once[(size, groups)], collective[size], groups)}


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
      graph, {n: profile.fastest(n) for n in graph.node_names()})]
  for length in (_DISPATCH_CHAIN // 4, _DISPATCH_CHAIN):
    _, chain_profile, chain, _ = micro_benchmark(repeats, traced,
                                                 _dispatch_graph(length))
    runs.append((chain_profile.step_time,) + _sequential_sum(
        chain, {n: chain_profile.fastest(n) for n in chain.node_names()}))
  table = op_cost.CostTable(machine=machine_info())
  table.time_scale, table.op_overhead, table.step_overhead = \
      fit_step_model(runs)
  say("logical devices: concurrency, collectives, transfers")
  devices = device_benchmark(repeats)
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
  say("pipeline stages: small MLP steps cut into 2 and 4 stages")
  table.stage_overhead, per_cut = stage_overhead(repeats, table.transfer_overhead)
  table.machine["stage_cuts"] = {f"{k}x{n}": t for (k, n), t in per_cut.items()}
  costs = {}
  best_flops = best_bw = 0.0
  for node in graph.nodes:
    sig = op_cost.signature(node, shapes)
    if sig not in entries or not entries[sig]:
      continue
    seconds = entries[sig]
    cost = op_cost.node_cost(node, shapes, graph)
    costs[sig] = (cost.line, cost)
    if node.op == "MatMul" and cost.flops:
      best_flops = max(best_flops, cost.flops / seconds)
    if node.op == "DeepCopy" and cost.bytes_moved:
      best_bw = max(best_bw, cost.bytes_moved / seconds)
  table.flops = best_flops or None
  table.bandwidth = best_bw or None
  # The lines are fitted on every measured op time, the chains' and the
  # graphs'; only the graphs' own ops keep their times in the table. A
  # chain's op runs alone: it costs less than the same op inside a step, so
  # a model whose shapes happen to match the chains' (a raw TF GPT's 2-d
  # MatMuls and BiasAdds) would be priced below one priced by the lines
  # (Keras' einsums).
  measured = dict(entries)
  for i, graph_def in enumerate(graph_defs):
    say(f"graph {i + 1}/{len(graph_defs)}: {len(graph_def.node)} nodes")
    g = Graph(graph_def)
    g_shapes = infer_shapes(g)
    g_profile = profile_graph(graph_def, repeats=repeats, traced=traced)
    g_entries = entries_from_profile(g, g_shapes, g_profile)
    measured.update(g_entries)
    table.entries.update(g_entries)
    for node in g.nodes:
      sig = op_cost.signature(node, g_shapes)
      if sig in g_entries and sig not in costs:
        cost = op_cost.node_cost(node, g_shapes, g)
        costs[sig] = (cost.line, cost)
    table.machine.setdefault("graphs", []).append(
        {"nodes": len(graph_def.node), "step_time": g_profile.step_time,
         "traced_sum": g_profile.traced_sum})
  if cluster is None:
    from tfsplit.cost.cluster import ClusterSpec, Device, Host, LOCAL  # pylint: disable=import-outside-toplevel
    cluster = ClusterSpec([Device("this", "h", "this", 1, table.bandwidth or 1e10,
                                  {"float32": table.flops or 1e10})],
                          [Host("h", LOCAL, LOCAL)], name="this machine")
  model = op_cost.CostModel(cluster, table=table, op_overhead=0.0)
  # Ops inside a step wait for the cores other ops hold: the op types the
  # small training steps run are fitted on their times there, the others
  # on the chains. The steps' entries stay out of the table: only the lines
  # (fixed + factor * roofline) carry over to other shapes.
  # The launch cost of a step, measured directly (a call of a 2-op graph;
  # the intercept of the chains' fit swings by milliseconds with the noise),
  # in turns with the training steps: timed alone, at another moment, it
  # came out at 78-150 us in five calibrations, and a small MLP's step
  # (0.4 ms) is a third launch.
  # The calls of many arguments or outputs beside it price what each costs.
  calls = {"launch": _dispatch_graph(2), "arguments": _call_graph(arguments=_CALL_TENSORS),
           "outputs": _call_graph(outputs=_CALL_TENSORS)}
  steps, microbatched, beside = training_steps(
      repeats, traced, say, beside={key: _function_and_args(g, Graph(g), 0)
                                    for key, g in calls.items()})
  table.step_overhead = beside["launch"]
  table.argument_overhead, table.output_overhead = call_costs(beside, beside["launch"])
  table.machine["training_steps"] = [profile.step_time for _, _, profile in steps]
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
  # part (_DENSE_LINES).
  in_steps_fixed = lines_fitted_in_steps(
      in_step, [step for step, (_, _, seq, _) in zip(steps, _TRAINING_STEPS) if seq == 1])
  alone = {op: table.op_fixed.get(op, table.default_fixed)
           for op in (set(table.op_fixed) | in_step) - in_steps_fixed}
  table.fit_factors({sig: (op, roof) for sig, (op, roof, _) in fit.items()},
                    seconds={sig: t for sig, (_, _, t) in fit.items()}, fixed=alone)
  table.time_scale = time_scale
  table.graph_scale, table.op_overhead = step_scale(table, steps + microbatched, cluster)
  table.kernel_concurrency, table.gap_concurrency = kernel_and_gap_concurrency(
      table, steps, {int(n): r for n, r in devices["per_step"].items()}, cluster)
  table.machine["chain_op_overhead"] = chain_overhead
  return table
