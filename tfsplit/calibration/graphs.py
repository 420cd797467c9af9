"""The synthetic graphs calibration times, as GraphDefs: the micro-benchmark's
chains of one op each (matmuls, elementwise ops, copies and the ops of
attention, GELU, masks, the loss and Adam at several sizes), chains of tiny
ops whose time is dispatch, one-op calls of many arguments or outputs, small
training steps written as the example models write them (also in
micro-batches, exchanging over copies, or cut into pipeline stages), and
chains of collectives and transfers over logical CPUs. The graphs only
describe work; tfsplit.calibration.measure and .devices run and time them,
so their shapes and counts (TRAINING_STEPS) are read from here, at call time,
by every measurement that builds them.
"""
import contextlib
import dataclasses
import itertools
from typing import Iterator

import numpy as np
import tensorflow as tf

from tfsplit.graph.ir import Graph

_MATMUL_SIZES = (16, 32, 64, 128, 256, 512)
_ELEMENT_SIZES = (64, 1024, 16384, 262144)
_COPIES = 8  # chained copies of each micro-benchmark op
DISPATCH_CHAIN = 400
_EXCHANGE_GROUP = 100     # group keys of the steps' collectives (+ 8 x group + its size)
# (blocks, batch, sequence, hidden) of the small training steps whose ops
# are timed where they run, inside a step; sequence 1 is an MLP.
TRAINING_STEPS = ((1, 4, 24, 48), (2, 6, 24, 48), (2, 12, 48, 96), (3, 4, 48, 96),
                  (4, 24, 1, 96), (2, 48, 1, 160))
# (batch x heads, sequence, head size) of attention's batched matmuls, and
# (rows, features) of the row-wise ops: around the example models' sizes.
_ATTENTION_SIZES = ((8, 32, 16), (32, 32, 16), (32, 64, 32))
_ROW_SIZES = ((64, 64), (256, 64), (256, 256))


def micro_graph():
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


def dispatch_graph(length=DISPATCH_CHAIN):
  """A chain of tiny ops: its time is almost all executor dispatch."""
  g = tf.Graph()
  with g.as_default():
    # Binary ops: Grappler fuses chains of unary ops into one kernel.
    x = tf.compat.v1.placeholder(tf.float32, [16])
    c = tf.constant(np.linspace(0.5, 1.0, 16, dtype=np.float32))
    for i in range(length):
      x = tf.maximum(x, c) if i % 2 else tf.multiply(x, c)
  return g.as_graph_def()


def call_graph(arguments=1, outputs=1):
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


def training_graph(blocks, batch, seq=32, hidden=64, heads=4, vocab=256,
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
  copies of the step (one per logical CPU, devices._copies_session), and so
  is its gradient: 2 collectives per block, on the step's critical path as
  a tensor-parallel layer's are (see fitting.in_step_collective);
  `exchange_group` g
  numbers the group of n copies, for copies of several groups exchanging
  at once (their keys differ).

  With `stages` S > 1, the step is cut as a pipeline of S stages cuts it:
  block i, its weights, their gradients and update on logical CPU
  i * S // blocks, the head and the loss on the last (see
  devices.stage_overhead)."""
  g = tf.Graph()
  step = _Step(blocks, batch // microbatches, seq, hidden, heads, vocab, first_style,
               microbatches, stages, exchange_over, exchange_group)
  with g.as_default():
    tokens = _feed([batch * seq, hidden])
    labels = _feed([batch * seq], tf.int32)
    step.update(step.gradients(tokens, labels))
  return g.as_graph_def()


def _feed(shape, dtype=tf.float32):
  """A placeholder of `shape`: what the step is fed."""
  return tf.compat.v1.placeholder(dtype, shape)


def _gelu(h):
  """GELU as the example models write it, with erf."""
  return 0.5 * h * (1.0 + tf.math.erf(h * 0.7071))


@dataclasses.dataclass
class _Step:
  """The sizes and the cut of one training_graph step, and what its
  micro-batches share: the weights (made by the first, fed) and the
  instance keys of its collectives."""
  blocks: int
  batch: int           # of one micro-batch
  seq: int
  hidden: int
  heads: int
  vocab: int
  first_style: int
  microbatches: int
  stages: int
  exchange_over: int
  exchange_group: int
  weights: list = dataclasses.field(default_factory=list)
  used: int = 0        # weights the micro-batch being written has used
  instances: Iterator[int] = dataclasses.field(init=False)

  def __post_init__(self):
    self.instances = itertools.count(1 + 1000 * self.exchange_group)

  def exchange(self, t):
    """The mean of `t` over the copies, forward and back (t itself
    without exchange_over)."""
    if self.exchange_over < 2:
      return t

    def mean(u):
      return tf.raw_ops.CollectiveReduceV2(
          input=u, group_size=self.exchange_over,
          group_key=_EXCHANGE_GROUP + 8 * self.exchange_group + self.exchange_over,
          instance_key=next(self.instances), ordering_token=[], merge_op="Add",
          final_op="Div", communication_hint="auto", timeout_seconds=0.0)

    @tf.custom_gradient
    def across(u):
      return mean(u), mean
    return across(t)

  def weight(self, *shape):
    """The next weight of the micro-batch being written: fed, made by the
    first micro-batch and shared by the others."""
    if self.used == len(self.weights):
      self.weights.append(_feed(list(shape)))
    self.used += 1
    return self.weights[self.used - 1]

  def stage_of(self, i):
    """The device scope of block i (i == blocks: the head)."""
    if self.stages < 2:
      return contextlib.nullcontext()
    return tf.device(f"/device:CPU:{min(i, self.blocks - 1) * self.stages // self.blocks}")

  def norm(self, x):
    """Layer normalization over the features (none in an MLP)."""
    if self.seq == 1:
      return x
    mean = tf.reduce_mean(x, -1, keepdims=True)
    var = tf.reduce_mean(tf.square(x - mean), -1, keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + 1e-5) * self.weight(self.hidden) + \
        self.weight(self.hidden)

  def dense(self, t, units):
    """Keras 3's Dense on a sequence."""
    return tf.linalg.matmul(tf.reshape(t, [self.batch, self.seq, -1]),
                            self.weight(t.shape[-1], units)) + self.weight(units)

  def heads_of(self, t):
    """[batch, heads, sequence, head size] of [batch x sequence, hidden]."""
    return tf.transpose(tf.reshape(t, [self.batch, self.seq, self.heads,
                                       self.hidden // self.heads]), [0, 2, 1, 3])

  def block(self, i, x, causal):
    """Block i on x (its output exchanged first after the first block), in
    its style."""
    if i:
      x = self.exchange(x)
    if self.seq == 1:
      return self.mlp_block(x)
    style = (i + self.first_style) % 3
    if style == 2:
      return self.keras3_block(x, causal)
    if style == 1:
      return self.tf_keras_block(x, causal)
    return self.matmul_block(x, causal)

  def mlp_block(self, x):
    """An MLP's block: dense, GELU."""
    hidden = self.hidden
    h = tf.nn.bias_add(tf.linalg.matmul(x, self.weight(hidden, hidden)), self.weight(hidden))
    return _gelu(h)

  def keras3_block(self, x, causal):
    """A transformer block as Keras 3 writes it: 3-d dense matmuls, batched
    einsums."""
    batch, seq, heads, hidden = self.batch, self.seq, self.heads, self.hidden
    hd = hidden // heads
    y = self.norm(x)
    q, k, v = (tf.reshape(self.dense(y, hidden), [batch, seq, heads, hd]) for _ in range(3))
    scores = tf.einsum("BTNH,BSNH->BNTS", q, k) * hd ** -0.5
    probs = tf.nn.softmax(tf.where(causal, scores, -1e9))
    ctx = tf.reshape(tf.einsum("BNTS,BSNH->BTNH", probs, v), [batch * seq, hidden])
    x = x + tf.reshape(self.dense(ctx, hidden), [batch * seq, hidden])
    h = _gelu(self.dense(self.norm(x), 4 * hidden))
    return x + tf.reshape(self.dense(h, hidden), [batch * seq, hidden])

  def tf_keras_block(self, x, causal):
    """A transformer block as tf_keras' MultiHeadAttention writes it: einsums."""
    batch, seq, heads, hidden = self.batch, self.seq, self.heads, self.hidden
    hd = hidden // heads
    weight = self.weight
    y = tf.reshape(self.norm(x), [batch, seq, hidden])
    q, k, v = (tf.einsum("abc,cde->abde", y, weight(hidden, heads, hd)) +
               weight(heads, hd) for _ in range(3))
    scores = tf.einsum("aecd,abcd->acbe", k, q) * hd ** -0.5
    probs = tf.nn.softmax(tf.where(causal, scores, -1e9))
    ctx = tf.einsum("acbe,aecd->abcd", probs, v)
    out = tf.einsum("abcd,cde->abe", ctx, weight(heads, hd, hidden)) + weight(hidden)
    x = x + tf.reshape(out, [batch * seq, hidden])
    h = tf.einsum("abc,cd->abd", tf.reshape(self.norm(x), [batch, seq, hidden]),
                  weight(hidden, 4 * hidden)) + weight(4 * hidden)
    h = _gelu(h)
    return x + tf.reshape(tf.einsum("abc,cd->abd", h, weight(4 * hidden, hidden)) +
                          weight(hidden), [batch * seq, hidden])

  def matmul_block(self, x, causal):
    """A transformer block of 2-d matmuls and head transposes."""
    batch, seq, heads, hidden = self.batch, self.seq, self.heads, self.hidden
    weight = self.weight
    qkv = tf.nn.bias_add(tf.linalg.matmul(self.norm(x), weight(hidden, 3 * hidden)),
                         weight(3 * hidden))
    q, k, v = (self.heads_of(t) for t in tf.split(qkv, 3, axis=-1))
    scores = tf.linalg.matmul(q, k, transpose_b=True) * (hidden // heads) ** -0.5
    probs = tf.nn.softmax(tf.where(causal, scores, -1e9))
    ctx = tf.reshape(tf.transpose(tf.linalg.matmul(probs, v), [0, 2, 1, 3]),
                     [batch * seq, hidden])
    x = x + tf.nn.bias_add(tf.linalg.matmul(ctx, weight(hidden, hidden)), weight(hidden))
    h = tf.nn.bias_add(tf.linalg.matmul(self.norm(x), weight(hidden, 4 * hidden)),
                       weight(4 * hidden))
    h = _gelu(h)
    return x + tf.nn.bias_add(tf.linalg.matmul(h, weight(4 * hidden, hidden)),
                              weight(hidden))

  def loss(self, x, labels):
    """The mean cross-entropy of one micro-batch: its blocks, each on its
    stage, then the head and the loss on the last."""
    self.used = 0
    causal = tf.constant(np.tril(np.ones([self.seq, self.seq], dtype=bool)))
    for i in range(self.blocks):
      with self.stage_of(i):
        x = self.block(i, x, causal)
    with self.stage_of(self.blocks):
      logits = tf.linalg.matmul(self.norm(self.exchange(x)),
                                self.weight(self.hidden, self.vocab))
      return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=labels, logits=logits))

  def gradients(self, tokens, labels):
    """The weights' gradients summed over the micro-batches, each slice
    after the previous one's gradients (the sums are then the whole batch's
    mean's gradients)."""
    m = self.microbatches
    rows = self.batch * self.seq
    sums = None
    for j in range(m):
      if m == 1:
        x, y = tokens, labels
      else:
        rows_j = tokens[j * rows:(j + 1) * rows]
        with tf.control_dependencies(sums or []):
          x = tf.identity(rows_j)
        y = labels[j * rows:(j + 1) * rows]
      loss = self.loss(x, y)
      if m > 1:
        loss = loss / m
      grads = tf.gradients(loss, self.weights)
      sums = grads if sums is None else [a + b for a, b in zip(sums, grads)]
    return sums

  def update(self, sums):
    """Adam's update of every weight by its gradient in `sums`, on the
    weight's stage, under the name scope 'update'."""
    with tf.name_scope("update"):
      for w, grad in zip(self.weights, sums):
        with tf.device(w.device):   # its stage's (stage_of)
          m, v = _feed(w.shape), _feed(w.shape)
          m = 0.9 * m + 0.1 * grad
          v = 0.999 * v + 0.001 * tf.square(grad)
          tf.identity(w - 1e-3 * m / (tf.sqrt(v) + 1e-7))


def training_step(k, microbatches=1, exchange_over=0, exchange_group=0):
  """(GraphDef, Graph) of TRAINING_STEPS[k] in `microbatches`: each style
  of block (the first block's style is k's) at several sizes; with
  `exchange_over`, its blocks' outputs all-reduced over that many copies
  (group `exchange_group` of them)."""
  blocks, batch, seq, hidden = TRAINING_STEPS[k]
  graph_def = training_graph(blocks, batch, seq, hidden, first_style=k,
                             microbatches=microbatches, exchange_over=exchange_over,
                             exchange_group=exchange_group)
  return graph_def, Graph(graph_def)


def devices_graph(kind, length, devices=2):
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
