"""Examples written with raw TF ops: tf.Variable, tf.matmul, tf.gather.

Variables are created and used under per-layer tf.name_scopes, so graph node
names read `mlp/layer_1/MatMul`, `gpt/block_0/attn/q/MatMul`, ... and the
gradients `gradient_tape/<same scope>/...`.

The GPT keeps its activations as a [batch*seq, hidden] matrix (as TF1 BERT
did), so projections are plain 2-D MatMuls and attention is BatchMatMulV2
between a reshape + transpose into heads and back.
"""
import keras
import numpy as np
import tensorflow as tf

from . import common
from .example import GptConfig


class _Builder:
  """Creates zero-initialised variables and remembers them in order."""

  def __init__(self):
    self.variables = []

  def var(self, name, shape):
    v = tf.Variable(tf.zeros(shape, tf.float32), name=name)
    self.variables.append(v)
    return v

  def dense(self, name, n_in, n_out, bias=True):
    with tf.name_scope(name):
      kernel = self.var("kernel", [n_in, n_out])
      return (kernel, self.var("bias", [n_out])) if bias else (kernel, None)

  def layer_norm(self, name, dim):
    with tf.name_scope(name):
      return self.var("gamma", [dim]), self.var("beta", [dim])


def _dense(x, params, name, activation=None):
  kernel, bias = params
  with tf.name_scope(name):
    y = tf.matmul(x, kernel)
    if bias is not None:
      y = tf.nn.bias_add(y, bias)
    return activation(y) if activation is not None else y


def _layer_norm(x, params, name, eps):
  # Written out (not tf.nn.moments / fused ops) so every piece is a plain op.
  gamma, beta = params
  with tf.name_scope(name):
    mean = tf.reduce_mean(x, axis=-1, keepdims=True)
    centered = x - mean
    var = tf.reduce_mean(tf.square(centered), axis=-1, keepdims=True)
    return centered * tf.math.rsqrt(var + eps) * gamma + beta


class RawMlp:
  """mlp/layer_{i}: x @ kernel + bias, relu on all but the last layer."""

  def __init__(self, cfg):
    self.cfg = cfg
    b = _Builder()
    dims = [cfg.in_dim] + [cfg.width] * (cfg.layers - 1) + [cfg.classes]
    with tf.name_scope("mlp"):
      self.layers = [b.dense(f"layer_{i}", dims[i], dims[i + 1])
                     for i in range(cfg.layers)]
    self.variables = b.variables

  def __call__(self, x, training=False):
    del training  # no dropout / batch norm
    with tf.name_scope("mlp"):
      for i, params in enumerate(self.layers):
        last = i == len(self.layers) - 1
        x = _dense(x, params, f"layer_{i}", None if last else tf.nn.relu)
    return x


class RawGpt:
  """GPT-2 style decoder; see the module docstring for the op layout."""

  def __init__(self, cfg):
    self.cfg = cfg
    d, b = cfg.hidden, _Builder()
    with tf.name_scope("gpt"):
      with tf.name_scope("embed"):
        self.tok = b.var("tok", [cfg.vocab, d])
        self.pos = b.var("pos", [cfg.seq, d])
      self.blocks = []
      for i in range(cfg.blocks):
        with tf.name_scope(f"block_{i}"):
          blk = {"ln_1": b.layer_norm("ln_1", d)}
          with tf.name_scope("attn"):
            for proj in ("q", "k", "v", "o"):
              blk[proj] = b.dense(proj, d, d)
          blk["ln_2"] = b.layer_norm("ln_2", d)
          with tf.name_scope("mlp"):
            blk["fc1"] = b.dense("fc1", d, cfg.mlp_dim)
            blk["fc2"] = b.dense("fc2", cfg.mlp_dim, d)
          self.blocks.append(blk)
      self.ln_f = b.layer_norm("ln_f", d)
      self.head = b.dense("head", d, cfg.vocab, bias=False)
    self.variables = b.variables
    mask = np.tril(np.ones([cfg.seq, cfg.seq], dtype=bool))
    self._causal = mask.reshape([1, 1, cfg.seq, cfg.seq])

  def __call__(self, tokens, training=False):
    del training
    cfg = self.cfg
    bs, s, d = cfg.batch, cfg.seq, cfg.hidden
    with tf.name_scope("gpt"):
      with tf.name_scope("embed"):
        x = tf.gather(self.tok, tokens) + self.pos  # ResourceGather
        x = tf.reshape(x, [bs * s, d])
      for i, blk in enumerate(self.blocks):
        with tf.name_scope(f"block_{i}"):
          h = _layer_norm(x, blk["ln_1"], "ln_1", cfg.eps)
          x = x + self._attention(h, blk)
          h = _layer_norm(x, blk["ln_2"], "ln_2", cfg.eps)
          with tf.name_scope("mlp"):
            gelu = lambda t: tf.nn.gelu(t, approximate=False)
            h = _dense(h, blk["fc1"], "fc1", gelu)
            x = x + _dense(h, blk["fc2"], "fc2")
      x = _layer_norm(x, self.ln_f, "ln_f", cfg.eps)
      logits = _dense(x, self.head, "head")
      return tf.reshape(logits, [bs, s, cfg.vocab])

  def _attention(self, h, blk):
    cfg = self.cfg
    bs, s, nh, hd = cfg.batch, cfg.seq, cfg.heads, cfg.head_dim
    with tf.name_scope("attn"):
      def heads(t, name):
        # [b*s, h*d] -> [b, s, h, d] -> [b, h, s, d]
        with tf.name_scope(f"split_{name}"):
          return tf.transpose(tf.reshape(t, [bs, s, nh, hd]), [0, 2, 1, 3])
      q = heads(_dense(h, blk["q"], "q"), "q")
      k = heads(_dense(h, blk["k"], "k"), "k")
      v = heads(_dense(h, blk["v"], "v"), "v")
      scores = tf.matmul(q, k, transpose_b=True) * (1.0 / np.sqrt(hd))
      scores = tf.where(self._causal, scores, -1e9)
      probs = tf.nn.softmax(scores, axis=-1)
      ctx = tf.matmul(probs, v)  # [b, h, s, d]
      with tf.name_scope("merge"):
        ctx = tf.reshape(tf.transpose(ctx, [0, 2, 1, 3]), [bs * s, nh * hd])
      return _dense(ctx, blk["o"], "o")


def build(family, name, size, cfg, seed):
  model = RawGpt(cfg) if isinstance(cfg, GptConfig) else RawMlp(cfg)
  named = [(common.strip_port(v.name), v) for v in model.variables]
  common.init_weights(named, seed)
  # Keras 3 Adam accepts plain tf.Variables; building it here creates the
  # slot variables before tracing, as a ConcreteFunction needs.
  optimizer = keras.optimizers.Adam(learning_rate=cfg.lr, name="adam")
  optimizer.build(model.variables)
  return common.make_example(
      name, size, cfg, model_fn=model, named_variables=named,
      tape_variables=model.variables, optimizer=optimizer,
      optimizer_variables_fn=lambda: [(v.path, common.tf_variable(v))
                                      for v in optimizer.variables],
      model=model)
