"""A GPT-2-style decoder whose weights come from its layers' own seeded
initializers (the other examples assign seeded values after building), so
it can be built under tfsplit.deferred_init() and give the same weights as
built whole: Keras 3 (`import keras`) or tf_keras, tied embeddings (or an
LM head of its own, tied=False),
pre-norm blocks of causal multi-head attention and a GELU MLP, Adam.

    model = seeded.build(keras, seeded.GPT2_SMALL, seed=0)
    loss = model.train_step(tokens, labels)
"""
import collections

import numpy as np
import tensorflow as tf

Config = collections.namedtuple("Config", "vocab width blocks heads seq batch lr tied",
                                defaults=(True,))

TINY = Config(vocab=96, width=32, blocks=2, heads=4, seq=8, batch=4, lr=1e-2)
# 124 M parameters (GPT-2 small's shapes, 50257-token vocabulary), 1.49 GB
# of weights and Adam moments.
GPT2_SMALL = Config(vocab=50257, width=768, blocks=12, heads=12, seq=32, batch=4, lr=1e-4)
# 1.07 B parameters: 12.0 GiB of weights and Adam moments.
GPT_1B = Config(vocab=32000, width=2048, blocks=20, heads=16, seq=32, batch=4, lr=1e-4)


class SeededGpt(object):
  """The model, its optimizer (built: slots exist), the training step and
  what tfsplit.split needs of it."""

  def __init__(self, K, cfg, seed):
    self.K, self.cfg = K, cfg
    K.utils.set_random_seed(seed)
    tokens = K.Input((cfg.seq,), dtype="int32", name="tokens")
    self.embedding = K.layers.Embedding(cfg.vocab, cfg.width, name="embed")
    x = self.embedding(tokens)
    for i in range(cfg.blocks):
      h = K.layers.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln1")(x)
      h = K.layers.MultiHeadAttention(cfg.heads, cfg.width // cfg.heads,
                                      name=f"block{i}_attention")(h, h, use_causal_mask=True)
      x = x + h
      h = K.layers.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln2")(x)
      h = K.layers.Dense(4 * cfg.width, activation="gelu", name=f"block{i}_up")(h)
      x = x + K.layers.Dense(cfg.width, name=f"block{i}_down")(h)
    x = K.layers.LayerNormalization(epsilon=1e-5, name="final_ln")(x)
    if not cfg.tied:   # an LM head of its own (the default reads the embedding)
      x = K.layers.Dense(cfg.vocab, use_bias=False, name="lm_head")(x)
    self.model = K.Model(tokens, x, name="gpt")
    self.optimizer = K.optimizers.Adam(cfg.lr, name="adam")
    self.optimizer.build(self.model.trainable_variables)
    self.train_step = tf.function(self._step)
    self.signature = [tf.TensorSpec([cfg.batch, cfg.seq], tf.int32)] * 2

  def _step(self, tokens, labels):
    variables = self.model.trainable_variables
    with tf.GradientTape() as tape:
      hidden = self.model(tokens, training=True)
      logits = (tf.matmul(hidden, self.embedding.embeddings, transpose_b=True)
                if self.cfg.tied else hidden)
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
    grads = tape.gradient(loss, variables)
    self.optimizer.apply_gradients(zip(grads, variables))
    return loss

  def variables(self):
    """Every variable of the model and its optimizer."""
    extra = self.optimizer.variables
    extra = list(extra() if callable(extra) else extra)
    # tf_keras: the learning rate is a variable the step reads, not listed.
    rate = getattr(self.optimizer, "_learning_rate", None)
    if isinstance(rate, tf.Variable) and all(rate is not v for v in extra):
      extra.append(rate)
    return list(self.model.variables) + extra

  def variable_names(self):
    """[(variable, unique name)] for tfsplit.split (Keras 3: its path)."""
    return [(v, getattr(v, "path", None) or v.name.split(":")[0]) for v in self.variables()]

  def inputs(self, seed):
    rng = np.random.default_rng(seed)
    shape = (self.cfg.batch, self.cfg.seq)
    return (rng.integers(0, self.cfg.vocab, shape).astype(np.int32),
            rng.integers(0, self.cfg.vocab, shape).astype(np.int32))

  def state_bytes(self):
    """Bytes of every variable (weights, optimizer moments)."""
    return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in self.variables())


def process_memory(key="VmHWM"):
  """Bytes of this process's memory a line of /proc/self/status gives
  (VmHWM: the peak resident memory; VmRSS: now): what a split of this model
  is measured by (tools/bench_memory.py, tests/test_deferred.py)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(key + ":"):
        return int(line.split()[1]) * 1024
  return 0


def build(K, cfg=TINY, seed=0):
  return SeededGpt(K, cfg, seed)
