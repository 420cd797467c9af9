"""The same MLP and GPT written once against the Keras layer API.

`K` is either Keras 3 (`import keras`) or tf_keras; both take the layers used
here with the same arguments, so the two flavors are one definition and only
the lowering differs (Keras 3: BatchMatMulV2 projections, tf_keras: Einsum).
Every layer is named so that graph scopes are stable: `mlp/layer_{i}`,
`gpt/embed`, `gpt/block_{i}/{ln_1,attn,ln_2,mlp}`, `gpt/ln_f`, `gpt/head`.
"""
import numpy as np
import tensorflow as tf

from . import common
from .example import GptConfig


def text_layers(K):
  """(Embed, FeedForward) bound to the Keras module `K`: the token + learned
  position embedding and the gelu MLP of a transformer block, shared with
  the corpus (corpus.py)."""
  layers = K.layers

  class Embed(layers.Layer):

    def __init__(self, cfg, **kwargs):
      super().__init__(**kwargs)
      self.seq = cfg.seq
      self.tok = layers.Embedding(cfg.vocab, cfg.hidden, name="tok")
      self.pos = layers.Embedding(cfg.seq, cfg.hidden, name="pos")

    def call(self, tokens):
      # tok before pos: weights are created in call order, and init_weights
      # draws in that order, matching the raw model's variable order.
      x = self.tok(tokens)
      return x + self.pos(tf.range(self.seq))[tf.newaxis]

  class FeedForward(layers.Layer):

    def __init__(self, cfg, **kwargs):
      super().__init__(**kwargs)
      self.fc1 = layers.Dense(cfg.mlp_dim, activation="gelu", name="fc1")
      self.fc2 = layers.Dense(cfg.hidden, name="fc2")

    def call(self, x):
      return self.fc2(self.fc1(x))

  return Embed, FeedForward


def _define(K):
  """Model classes bound to the Keras module `K`."""
  layers = K.layers
  Embed, FeedForward = text_layers(K)

  class Mlp(K.Model):

    def __init__(self, cfg, **kwargs):
      super().__init__(**kwargs)
      self.cfg = cfg
      self.hidden = [
          layers.Dense(cfg.width, activation="relu", name=f"layer_{i}")
          for i in range(cfg.layers - 1)]
      self.out = layers.Dense(cfg.classes, name=f"layer_{cfg.layers - 1}")

    def call(self, x, training=False):
      for layer in self.hidden:
        x = layer(x)
      return self.out(x)

  class Block(layers.Layer):

    def __init__(self, cfg, **kwargs):
      super().__init__(**kwargs)
      self.ln_1 = layers.LayerNormalization(epsilon=cfg.eps, name="ln_1")
      self.attn = layers.MultiHeadAttention(
          num_heads=cfg.heads, key_dim=cfg.head_dim, dropout=0.0, name="attn")
      self.ln_2 = layers.LayerNormalization(epsilon=cfg.eps, name="ln_2")
      self.mlp = FeedForward(cfg, name="mlp")

    def call(self, x):
      h = self.ln_1(x)
      x = x + self.attn(h, h, use_causal_mask=True)
      return x + self.mlp(self.ln_2(x))

  class Gpt(K.Model):

    def __init__(self, cfg, **kwargs):
      super().__init__(**kwargs)
      self.cfg = cfg
      self.embed = Embed(cfg, name="embed")
      self.blocks = [Block(cfg, name=f"block_{i}") for i in range(cfg.blocks)]
      self.ln_f = layers.LayerNormalization(epsilon=cfg.eps, name="ln_f")
      self.head = layers.Dense(cfg.vocab, use_bias=False, name="head")

    def call(self, tokens, training=False):
      x = self.embed(tokens)
      for block in self.blocks:
        x = block(x)
      return self.head(self.ln_f(x))

  return Mlp, Gpt


def build(K, name, size, cfg, seed):
  """An ExampleModel for Keras module `K` (keras or tf_keras)."""
  mlp_cls, gpt_cls = _define(K)
  is_gpt = isinstance(cfg, GptConfig)
  model = gpt_cls(cfg, name="gpt") if is_gpt else mlp_cls(cfg, name="mlp")
  # One eager call creates every weight with its final (static) shape.
  if is_gpt:
    model(np.zeros([cfg.batch, cfg.seq], np.int32))
  else:
    model(np.zeros([cfg.batch, cfg.in_dim], np.float32))

  keras3 = K.__name__ == "keras"
  tape_vars = list(model.trainable_variables)
  if keras3:
    # Keras 3 variables wrap a tf.Variable; `path` is their scoped name.
    named = [(v.path, common.tf_variable(v)) for v in tape_vars]
  else:
    named = [(common.strip_port(v.name), v) for v in tape_vars]
  common.init_weights(named, seed)

  optimizer = K.optimizers.Adam(learning_rate=cfg.lr, name="adam")
  # Slot variables must exist before tracing so the concrete train function
  # captures them instead of creating them on first call.
  optimizer.build(tape_vars)
  if keras3:
    opt_vars = lambda: [(v.path, common.tf_variable(v))
                        for v in optimizer.variables]
  else:
    # tf_keras keeps the learning-rate variable out of variables(), but the
    # train step reads it.
    lr = getattr(optimizer, "_learning_rate", None)
    extra = [lr] if isinstance(lr, tf.Variable) else []
    opt_vars = lambda: [(f"adam/{common.strip_port(v.name)}", v)
                        for v in list(optimizer.variables()) + extra]

  return common.make_example(
      name, size, cfg, model_fn=model, named_variables=named,
      tape_variables=tape_vars, optimizer=optimizer,
      optimizer_variables_fn=opt_vars, model=model)
