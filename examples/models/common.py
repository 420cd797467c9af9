"""TensorFlow pieces shared by every example: signatures, inputs, init, loss."""
import numpy as np
import tensorflow as tf

from .example import ExampleModel, GptConfig


def signatures(cfg):
  """(forward, train) lists of TensorSpec, all with a static batch size."""
  if isinstance(cfg, GptConfig):
    tokens = tf.TensorSpec([cfg.batch, cfg.seq], tf.int32, name="tokens")
    labels = tf.TensorSpec([cfg.batch, cfg.seq], tf.int32, name="labels")
    return [tokens], [tokens, labels]
  x = tf.TensorSpec([cfg.batch, cfg.in_dim], tf.float32, name="x")
  labels = tf.TensorSpec([cfg.batch], tf.int32, name="labels")
  return [x], [x, labels]


def input_fn(cfg):
  """make_inputs(kind, seed) for `cfg`: next-token pairs or random features."""
  def make(kind, seed):
    rng = np.random.default_rng(seed)
    if isinstance(cfg, GptConfig):
      seq = rng.integers(0, cfg.vocab, [cfg.batch, cfg.seq + 1], dtype=np.int32)
      tokens, labels = seq[:, :-1].copy(), seq[:, 1:].copy()
    else:
      tokens = rng.standard_normal([cfg.batch, cfg.in_dim]).astype(np.float32)
      labels = rng.integers(0, cfg.classes, [cfg.batch], dtype=np.int32)
    return [tokens] if kind == "forward" else [tokens, labels]
  return make


def init_weights(named_variables, seed):
  """Overwrites weights from one seeded stream, whatever the library.

  Library initializers draw from global RNG state that depends on what ran
  before in the process; assigning from our own stream makes two builds with
  the same seed identical. Biases are zeros, LayerNorm gamma ones,
  embeddings N(0, 0.02), other matrices truncated Glorot normal. Equal
  variable order and sizes across flavors give equal weights, so the raw,
  Keras 3 and tf_keras builds of a family compute the same function.
  """
  rng = np.random.default_rng(seed)
  for name, var in named_variables:
    shape = var.shape.as_list()
    leaf = name.split(":")[0].rsplit("/", 1)[-1]
    if leaf == "gamma":
      value = np.ones(shape)
    elif len(shape) <= 1 or leaf in ("bias", "beta"):  # MHA biases are [h, d]
      value = np.zeros(shape)
    elif "embed" in name:
      value = rng.standard_normal(shape) * 0.02
    else:
      fan_in, fan_out = _matrix_fans(shape)
      std = np.sqrt(2.0 / (fan_in + fan_out))
      value = np.clip(rng.standard_normal(shape), -2.0, 2.0) * std
    var.assign(value.astype(var.dtype.as_numpy_dtype))


def _matrix_fans(shape):
  # A rank-3 attention kernel ([d, heads, head_dim] or [heads, head_dim, d])
  # is the matrix whose two sides are closest in size.
  best = None
  for k in range(1, len(shape)):
    rows, cols = int(np.prod(shape[:k])), int(np.prod(shape[k:]))
    score = abs(np.log(rows / cols))
    if best is None or score < best[0]:
      best = (score, rows, cols)
  return best[1], best[2]


def sparse_xent(labels, logits):
  """Mean token (or example) cross-entropy, the loss of every example."""
  with tf.name_scope("loss"):
    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                       logits=logits))


def make_example(name, size, cfg, *, model_fn, named_variables,
                 tape_variables, optimizer, optimizer_variables_fn,
                 model=None):
  """Wraps a callable model into forward / train_step tf.functions.

  `tape_variables` are the objects the tape and optimizer see (Keras 3
  variables for Keras 3); `named_variables` the (path, tf.Variable) behind
  them, in the same order.
  """
  fwd_sig, train_sig = signatures(cfg)

  # autograph is off: the models have no tensor-dependent Python control
  # flow, and tracing a 48-block model is noticeably faster without it.
  @tf.function(input_signature=fwd_sig, autograph=False)
  def forward(inputs):
    return model_fn(inputs, training=False)

  @tf.function(input_signature=train_sig, autograph=False)
  def train_step(inputs, labels):
    with tf.GradientTape() as tape:
      logits = model_fn(inputs, training=True)
      loss = sparse_xent(labels, logits)
    grads = tape.gradient(loss, tape_variables)
    optimizer.apply_gradients(zip(grads, tape_variables))
    return loss

  return ExampleModel(
      name=name, size=size, config=cfg,
      variables=[v for _, v in named_variables],
      variable_paths=[path for path, _ in named_variables],
      optimizer=optimizer, forward=forward, train_step=train_step,
      forward_signature=fwd_sig, train_signature=train_sig, model=model,
      input_fn=input_fn(cfg), optimizer_variables_fn=optimizer_variables_fn)


def tf_variable(var):
  """The tf.Variable behind a Keras 3 variable (identity for tf.Variable)."""
  if isinstance(var, tf.Variable):
    return var
  inner = var.value
  if not isinstance(inner, tf.Variable):
    raise TypeError(f"cannot find the tf.Variable behind {var!r}")
  return inner


def strip_port(name):
  """'gpt/head/kernel:0' -> 'gpt/head/kernel'."""
  return name[:-2] if name.endswith(":0") else name
