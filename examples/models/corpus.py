"""A corpus of real-structure transformer models in Keras 3 and tf_keras.

    import models
    ex = models.build("llama_keras3", size="tiny", seed=0)
    loss = ex.train_step(*ex.make_inputs("train", seed=1))

Families (each `<family>_keras3` and `<family>_tfkeras`; one definition
against the Keras layer API, `K` is `keras` or `tf_keras`):

  causallm  `CausalLM(backbone=Backbone(...))`: the backbone is its own Model
            (token + learned position embedding, pre-LayerNorm blocks with
            Keras MultiHeadAttention and a causal mask, final LayerNorm); the
            LM head is tied to the backbone's token-embedding matrix
            (logits = h @ E^T). Inputs: tokens [B, T]; labels [B, T].
  llama     RMSNorm (own layer, weight `gamma`), rotary position embedding
            from tf.range + sin/cos, grouped-query attention (kv heads
            repeated), causal mask, SwiGLU MLP (gate/up/down, no bias), final
            RMSNorm, untied head. Inputs: tokens [B, T]; labels [B, T].
  bert      token + token-type + position embeddings, embedding LayerNorm,
            post-LayerNorm encoder blocks with an additive padding mask
            [B, 1, 1, T] built from attention_mask [B, T], a tanh pooler on
            [CLS] and a classifier. Inputs: tokens, token_type_ids,
            attention_mask [B, T] int32 (rows padded with trailing zeros of
            varying lengths); labels [B] classes.
  vit       Conv2D patch embedding (kernel = stride = patch), a learned class
            token tiled over the batch and concatenated in front, learned
            position embedding, pre-LayerNorm blocks (Keras
            MultiHeadAttention), final LayerNorm, head on the class token.
            Inputs: images [B, H, W, C] float32; labels [B].
  moe       a Mixtral-style mixture-of-experts decoder: token embedding,
            pre-RMSNorm blocks with the llama attention (RoPE, grouped-query)
            and a sparse MoE block instead of the MLP: a router (Dense, no
            bias) gives each token softmax probabilities over `experts`
            experts; the top `top_k` are kept and renormalised as one-hot
            routing weights [B, T, E]; every expert (SwiGLU, weights stacked
            [E, ...] per matrix) computes every token densely and the routing
            weights select. The loss adds `aux_coef` x a router
            load-balancing loss per sequence (DeepSeek-V3's sequence-wise
            balance: E * sum_e f_e * P_e over the tokens of each sequence,
            f_e the share of the sequence's top-k choices that went to e,
            P_e its mean probability; the mean over sequences), which
            micro-batches and replicas compute exactly. Inputs: tokens
            [B, T]; labels [B, T].
  switch    the same decoder with capacity routing (GShard / Switch): each
            sequence is a group, each expert takes at most `capacity` tokens
            of it (first choices before second choices, in token order; the
            rest are dropped, their residual passing through), tokens reach
            experts through a dispatch tensor [B, T, E, C] (einsum
            `btec,btd->becd`) and come back through the combine tensor
            (`btec,becd->btd`), so each expert computes only its C slots.

Every layer is named, so graph scopes are stable: `<family>/block_{i}/...`
(causallm: `causallm/backbone/block_{i}/...`). Weights come from `seed` only
(common.init_weights: LayerNorm / RMSNorm `gamma` ones, biases zeros,
anything under an `embed` scope N(0, 0.02), other matrices Glorot). No
dropout. Sizes: tiny (tests) and small (benchmarks); every model has at
least 4 blocks, so pp=4 is possible.
"""
import dataclasses

import numpy as np
import tensorflow as tf

from tfsplit.errors import TfsplitError

from . import common
from . import example
from . import keras_models
from .example import CORPUS_FAMILIES, CORPUS_NAMES, ExampleModel

FAMILIES = CORPUS_FAMILIES
NAMES = CORPUS_NAMES
SIZES = ("tiny", "small")


@dataclasses.dataclass(frozen=True)
class CorpusConfig:
  """Dimensions of one corpus model (fields a family does not use are 0)."""
  family: str
  hidden: int
  heads: int
  blocks: int
  batch: int
  mlp_dim: int
  seq: int = 0          # tokens per example (text families)
  vocab: int = 0        # text families
  classes: int = 0      # bert, vit
  kv_heads: int = 0     # llama, moe, switch (grouped-query attention)
  experts: int = 0      # moe, switch
  top_k: int = 0        # moe, switch: experts per token
  capacity: int = 0     # switch: tokens per expert per sequence
  aux_coef: float = 0.0  # moe, switch: weight of the load-balancing loss
  type_vocab: int = 0   # bert
  image: int = 0        # vit: images are image x image x channels
  patch: int = 0
  channels: int = 0
  lr: float = 1e-3
  eps: float = 1e-5
  rope_base: float = 10000.0

  @property
  def head_dim(self):
    return self.hidden // self.heads

  @property
  def patches(self):
    return (self.image // self.patch) ** 2

  @property
  def tokens(self):
    """Sequence length inside the blocks (vit: patches + class token)."""
    return self.patches + 1 if self.family == "vit" else self.seq


# Batch 16 divides by dp=2 x 8 micro-batches; hidden, heads and MLP widths
# are multiples of 8 (of 2 for kv heads) so tp can split them 2 or 4 ways.
CONFIGS = {
    "causallm": {
        "tiny": CorpusConfig("causallm", hidden=32, heads=4, blocks=4,
                             batch=16, mlp_dim=128, seq=8, vocab=64),
        "small": CorpusConfig("causallm", hidden=128, heads=4, blocks=8,
                              batch=16, mlp_dim=512, seq=32, vocab=256),
    },
    "llama": {
        "tiny": CorpusConfig("llama", hidden=32, heads=4, kv_heads=2,
                             blocks=4, batch=16, mlp_dim=96, seq=8, vocab=64),
        "small": CorpusConfig("llama", hidden=128, heads=8, kv_heads=4,
                              blocks=8, batch=16, mlp_dim=352, seq=32,
                              vocab=256),
    },
    # 4 experts, top-2 (Mixtral's ratio); switch's capacity is 1.25x the
    # even share (2 * 8 / 4 = 4 tokens -> 5), so some tokens are dropped.
    "moe": {
        "tiny": CorpusConfig("moe", hidden=32, heads=4, kv_heads=2, blocks=4,
                             batch=16, mlp_dim=64, seq=8, vocab=64, experts=4,
                             top_k=2, aux_coef=0.01),
        "small": CorpusConfig("moe", hidden=128, heads=8, kv_heads=4,
                              blocks=8, batch=16, mlp_dim=256, seq=32,
                              vocab=256, experts=4, top_k=2, aux_coef=0.01),
    },
    "switch": {
        "tiny": CorpusConfig("switch", hidden=32, heads=4, kv_heads=2,
                             blocks=4, batch=16, mlp_dim=64, seq=8, vocab=64,
                             experts=4, top_k=2, capacity=5, aux_coef=0.01),
        "small": CorpusConfig("switch", hidden=128, heads=8, kv_heads=4,
                              blocks=8, batch=16, mlp_dim=256, seq=32,
                              vocab=256, experts=4, top_k=2, capacity=20,
                              aux_coef=0.01),
    },
    "bert": {
        "tiny": CorpusConfig("bert", hidden=32, heads=4, blocks=4, batch=16,
                             mlp_dim=128, seq=8, vocab=64, classes=8,
                             type_vocab=2, eps=1e-12),
        "small": CorpusConfig("bert", hidden=128, heads=4, blocks=8, batch=16,
                              mlp_dim=512, seq=32, vocab=256, classes=8,
                              type_vocab=2, eps=1e-12),
    },
    "vit": {
        "tiny": CorpusConfig("vit", hidden=32, heads=4, blocks=4, batch=16,
                             mlp_dim=128, classes=8, image=8, patch=4,
                             channels=3, eps=1e-6),
        "small": CorpusConfig("vit", hidden=128, heads=4, blocks=8, batch=16,
                              mlp_dim=512, classes=16, image=32, patch=8,
                              channels=3, eps=1e-6),
    },
}


def config_for(family, size, batch_size=None):
  return example.config_for(family, size, batch_size, CONFIGS,
                            f" for the corpus model '{family}'")


def signatures(cfg):
  """(forward, train) lists of TensorSpec, all with a static batch size."""
  b = cfg.batch
  if cfg.family == "vit":
    images = tf.TensorSpec([b, cfg.image, cfg.image, cfg.channels],
                           tf.float32, name="images")
    labels = tf.TensorSpec([b], tf.int32, name="labels")
    return [images], [images, labels]
  tokens = tf.TensorSpec([b, cfg.seq], tf.int32, name="tokens")
  if cfg.family == "bert":
    fwd = [tokens,
           tf.TensorSpec([b, cfg.seq], tf.int32, name="token_type_ids"),
           tf.TensorSpec([b, cfg.seq], tf.int32, name="attention_mask")]
    return fwd, fwd + [tf.TensorSpec([b], tf.int32, name="labels")]
  labels = tf.TensorSpec([b, cfg.seq], tf.int32, name="labels")
  return [tokens], [tokens, labels]


def input_fn(cfg):
  """make_inputs(kind, seed): seeded numpy arrays matching the signature."""
  def make(kind, seed):
    rng = np.random.default_rng(seed)
    b = cfg.batch
    if cfg.family == "vit":
      images = rng.standard_normal(
          [b, cfg.image, cfg.image, cfg.channels]).astype(np.float32)
      inputs = [images]
      labels = rng.integers(0, cfg.classes, [b], dtype=np.int32)
    elif cfg.family == "bert":
      t = cfg.seq
      tokens = rng.integers(0, cfg.vocab, [b, t], dtype=np.int32)
      # Row r keeps 1 + ((r + seed) % t) tokens: every padding length from
      # none to t - 1 trailing zeros appears (batch >= t).
      lengths = 1 + (np.arange(b) + seed) % t
      mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.int32)
      # Segment A then segment B from a random split point inside the row.
      split = rng.integers(0, t, [b, 1])
      types = ((np.arange(t)[None, :] >= split) * mask).astype(np.int32)
      tokens = tokens * mask  # pad id 0 where masked
      inputs = [tokens, types, mask]
      labels = rng.integers(0, cfg.classes, [b], dtype=np.int32)
    else:
      seq = rng.integers(0, cfg.vocab, [b, cfg.seq + 1], dtype=np.int32)
      inputs = [seq[:, :-1].copy()]
      labels = seq[:, 1:].copy()
    return inputs if kind == "forward" else inputs + [labels]
  return make


def _define(K):
  """Model classes (by family) bound to the Keras module `K`."""
  layers = K.layers

  # --- shared pieces ------------------------------------------------------
  # Token + learned position embedding; fc1 (gelu) -> fc2.
  TextEmbed, FeedForward = keras_models.text_layers(K)

  class PreNormBlock(layers.Layer):
    """x + attn(ln_1(x)); x + mlp(ln_2(x)) with Keras MultiHeadAttention."""

    def __init__(self, cfg, causal, **kwargs):
      super().__init__(**kwargs)
      self.causal = causal
      self.ln_1 = layers.LayerNormalization(epsilon=cfg.eps, name="ln_1")
      self.attn = layers.MultiHeadAttention(
          num_heads=cfg.heads, key_dim=cfg.head_dim, dropout=0.0, name="attn")
      self.ln_2 = layers.LayerNormalization(epsilon=cfg.eps, name="ln_2")
      self.mlp = FeedForward(cfg, name="mlp")

    def call(self, x):
      h = self.ln_1(x)
      x = x + self.attn(h, h, use_causal_mask=self.causal)
      return x + self.mlp(self.ln_2(x))

  def split_heads(t, heads, head_dim, name):
    """[b, t, heads * head_dim] -> [b, heads, t, head_dim] (static shapes)."""
    b, s = t.shape[0], t.shape[1]
    with tf.name_scope(f"split_{name}"):
      return tf.transpose(tf.reshape(t, [b, s, heads, head_dim]),
                          [0, 2, 1, 3])

  def merge_heads(t):
    """[b, heads, t, head_dim] -> [b, t, heads * head_dim]."""
    b, h, s, d = t.shape
    with tf.name_scope("merge"):
      return tf.reshape(tf.transpose(t, [0, 2, 1, 3]), [b, s, h * d])

  # --- causallm: a task model around a backbone model ---------------------

  class Backbone(K.Model):
    """Embedding, pre-norm causal blocks, final LayerNorm: hidden states."""

    def __init__(self, cfg, **kwargs):
      super().__init__(**kwargs)
      self.cfg = cfg
      self.embed = TextEmbed(cfg, name="embed")
      self.blocks = [PreNormBlock(cfg, causal=True, name=f"block_{i}")
                     for i in range(cfg.blocks)]
      self.ln_f = layers.LayerNormalization(epsilon=cfg.eps, name="ln_f")

    @property
    def token_embeddings(self):
      return self.embed.tok.embeddings

    def call(self, tokens, training=False):
      x = self.embed(tokens)
      for block in self.blocks:
        x = block(x)
      return self.ln_f(x)

  class CausalLM(K.Model):
    """backbone -> tied LM head (logits = h @ token_embeddings^T)."""

    def __init__(self, backbone, **kwargs):
      super().__init__(**kwargs)
      self.cfg = backbone.cfg
      self.backbone = backbone

    def call(self, tokens, training=False):
      h = self.backbone(tokens, training=training)
      with tf.name_scope("lm_head"):
        emb = tf.convert_to_tensor(self.backbone.token_embeddings)
        # Under a mixed policy the float32 matrix meets 16-bit activations
        # (a no-op cast in float32).
        return tf.matmul(h, tf.cast(emb, h.dtype), transpose_b=True)

  def causallm(cfg):
    return CausalLM(backbone=Backbone(cfg, name="backbone"), name="causallm")

  # --- llama --------------------------------------------------------------

  class RMSNorm(layers.Layer):
    """x * rsqrt(mean(x^2) + eps) * gamma (gamma initialised to ones)."""

    def __init__(self, eps, **kwargs):
      super().__init__(**kwargs)
      self.eps = eps

    def build(self, input_shape):
      self.gamma = self.add_weight(name="gamma", shape=[int(input_shape[-1])],
                                   initializer="ones", trainable=True)
      super().build(input_shape)

    def call(self, x):
      ms = tf.reduce_mean(tf.square(x), axis=-1, keepdims=True)
      return x * tf.math.rsqrt(ms + self.eps) * tf.convert_to_tensor(
          self.gamma)

  def rotary(seq, head_dim, base):
    """(cos, sin), each [1, 1, seq, head_dim], from tf.range positions."""
    with tf.name_scope("rotary"):
      pos = tf.cast(tf.range(seq), tf.float32)
      exponent = tf.cast(tf.range(0, head_dim, 2), tf.float32) / head_dim
      inv_freq = 1.0 / tf.pow(tf.constant(base, tf.float32), exponent)
      freqs = pos[:, tf.newaxis] * inv_freq[tf.newaxis, :]  # [seq, hd/2]
      angles = tf.concat([freqs, freqs], axis=-1)[tf.newaxis, tf.newaxis]
      return tf.cos(angles), tf.sin(angles)

  def apply_rotary(x, cos, sin):
    """x * cos + rotate_half(x) * sin on [b, heads, seq, head_dim]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = tf.cast(cos, x.dtype), tf.cast(sin, x.dtype)  # no-ops in float32
    return x * cos + tf.concat([-x2, x1], axis=-1) * sin

  class GroupedQueryAttention(layers.Layer):
    """q/k/v/o without bias; kv heads repeated to the query heads; RoPE."""

    def __init__(self, cfg, **kwargs):
      super().__init__(**kwargs)
      self.cfg = cfg
      hd = cfg.head_dim
      self.q = layers.Dense(cfg.heads * hd, use_bias=False, name="q")
      self.k = layers.Dense(cfg.kv_heads * hd, use_bias=False, name="k")
      self.v = layers.Dense(cfg.kv_heads * hd, use_bias=False, name="v")
      self.o = layers.Dense(cfg.hidden, use_bias=False, name="o")

    def call(self, x):
      cfg = self.cfg
      nh, kvh, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
      b, s = x.shape[0], x.shape[1]
      q = split_heads(self.q(x), nh, hd, "q")
      k = split_heads(self.k(x), kvh, hd, "k")
      v = split_heads(self.v(x), kvh, hd, "v")
      cos, sin = rotary(s, hd, cfg.rope_base)
      with tf.name_scope("rope"):
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
      with tf.name_scope("repeat_kv"):
        rep = nh // kvh
        k = tf.reshape(tf.broadcast_to(k[:, :, tf.newaxis],
                                       [b, kvh, rep, s, hd]), [b, nh, s, hd])
        v = tf.reshape(tf.broadcast_to(v[:, :, tf.newaxis],
                                       [b, kvh, rep, s, hd]), [b, nh, s, hd])
      scores = tf.matmul(q, k, transpose_b=True) * (1.0 / np.sqrt(hd))
      with tf.name_scope("causal_mask"):
        causal = tf.cast(tf.linalg.band_part(tf.ones([s, s]), -1, 0), tf.bool)
        scores = tf.where(causal[tf.newaxis, tf.newaxis], scores,
                          tf.float32.min)
      probs = tf.nn.softmax(scores, axis=-1)
      return self.o(merge_heads(tf.matmul(probs, v)))

  class SwiGlu(layers.Layer):
    """down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, cfg, **kwargs):
      super().__init__(**kwargs)
      self.gate = layers.Dense(cfg.mlp_dim, use_bias=False, name="gate")
      self.up = layers.Dense(cfg.mlp_dim, use_bias=False, name="up")
      self.down = layers.Dense(cfg.hidden, use_bias=False, name="down")

    def call(self, x):
      return self.down(tf.nn.silu(self.gate(x)) * self.up(x))

  class LlamaBlock(layers.Layer):

    def __init__(self, cfg, **kwargs):
      super().__init__(**kwargs)
      self.attn_norm = RMSNorm(cfg.eps, name="attn_norm")
      self.attn = GroupedQueryAttention(cfg, name="attn")
      self.mlp_norm = RMSNorm(cfg.eps, name="mlp_norm")
      self.mlp = SwiGlu(cfg, name="mlp")

    def call(self, x):
      x = x + self.attn(self.attn_norm(x))
      return x + self.mlp(self.mlp_norm(x))

  class Llama(K.Model):

    def __init__(self, cfg, **kwargs):
      super().__init__(**kwargs)
      self.cfg = cfg
      self.embed = layers.Embedding(cfg.vocab, cfg.hidden, name="embed")
      self.blocks = [LlamaBlock(cfg, name=f"block_{i}")
                     for i in range(cfg.blocks)]
      self.norm = RMSNorm(cfg.eps, name="norm")
      self.lm_head = layers.Dense(cfg.vocab, use_bias=False, name="lm_head")

    def call(self, tokens, training=False):
      x = self.embed(tokens)
      for block in self.blocks:
        x = block(x)
      return self.lm_head(self.norm(x))

  def llama(cfg):
    return Llama(cfg, name="llama")

  # --- moe, switch: mixture-of-experts decoders -----------------------------

  class Router(layers.Layer):
    """Softmax router: (probs [b, t, E], top-k indices [b, t, k], their
    renormalised weights [b, t, k]) and the sequence-wise balance loss.
    Computed in float32 under a mixed policy, as Switch Transformers do: a
    16-bit softmax over experts flips near-tied top-k choices."""

    def __init__(self, cfg, **kwargs):
      super().__init__(**kwargs)
      self.cfg = cfg
      mixed = K.mixed_precision.global_policy().compute_dtype != "float32"
      self.proj = layers.Dense(cfg.experts, use_bias=False, name="proj",
                               dtype="float32" if mixed else None)

    def call(self, x):
      cfg = self.cfg
      probs = tf.nn.softmax(self.proj(tf.cast(x, tf.float32)), axis=-1)
      top, index = tf.math.top_k(probs, k=cfg.top_k)
      weights = top / tf.reduce_sum(top, axis=-1, keepdims=True)
      with tf.name_scope("balance"):
        # f_e: share of the sequence's top-k choices that went to expert e
        # (no gradient flows through a choice); P_e: its mean probability.
        chosen = tf.reduce_sum(tf.one_hot(index, cfg.experts), axis=2)
        share = tf.reduce_mean(chosen, axis=1) / cfg.top_k       # [b, E]
        mean_prob = tf.reduce_mean(probs, axis=1)                 # [b, E]
        aux = cfg.experts * tf.reduce_mean(
            tf.reduce_sum(share * mean_prob, axis=-1))
      return index, weights, aux

  class Experts(layers.Layer):
    """E SwiGLU experts, each matrix stacked over the expert dimension: the
    tokens meet the [E, d, f] matrices by einsum `equation_in`, the [E, f, d]
    one by `equation_out`."""

    def __init__(self, cfg, equation_in, equation_out, **kwargs):
      super().__init__(**kwargs)
      self.cfg = cfg
      self.equation_in = equation_in
      self.equation_out = equation_out

    def build(self, input_shape):
      cfg = self.cfg
      e, d, f = cfg.experts, cfg.hidden, cfg.mlp_dim
      self.gate = self.add_weight(name="gate", shape=[e, d, f])
      self.up = self.add_weight(name="up", shape=[e, d, f])
      self.down = self.add_weight(name="down", shape=[e, f, d])
      super().build(input_shape)

    def call(self, x):
      equation_in, equation_out = self.equation_in, self.equation_out
      gate = tf.convert_to_tensor(self.gate)
      up = tf.convert_to_tensor(self.up)
      down = tf.convert_to_tensor(self.down)
      h = tf.nn.silu(tf.einsum(equation_in, x, gate)) * tf.einsum(
          equation_in, x, up)
      return tf.einsum(equation_out, h, down)

  class MoELayer(layers.Layer):
    """A router and experts whose einsums are the class's EQUATIONS."""
    EQUATIONS = None

    def __init__(self, cfg, **kwargs):
      super().__init__(**kwargs)
      self.cfg = cfg
      self.router = Router(cfg, name="router")
      self.experts = Experts(cfg, *self.EQUATIONS, name="experts")

  class DenseMoE(MoELayer):
    """Every expert computes every token; one-hot routing weights select."""
    EQUATIONS = ("btd,edf->btef", "btef,efd->bted")

    def call(self, x):
      index, weights, aux = self.router(x)
      with tf.name_scope("routing"):
        routing = tf.reduce_sum(
            tf.one_hot(index, self.cfg.experts) * weights[..., tf.newaxis],
            axis=2)                                              # [b, t, E]
        routing = tf.cast(routing, x.dtype)
      out = self.experts(x)
      return tf.einsum("bted,bte->btd", out, routing), aux

  class CapacityMoE(MoELayer):
    """GShard / Switch dispatch: each sequence a group, `capacity` slots per
    expert, first choices placed before second choices in token order."""
    EQUATIONS = ("becd,edf->becf", "becf,efd->becd")

    def call(self, x):
      cfg = self.cfg
      index, weights, aux = self.router(x)
      with tf.name_scope("dispatch"):
        dispatch, combine = 0.0, 0.0
        taken = tf.zeros([x.shape[0], 1, cfg.experts])          # [b, 1, E]
        for k in range(cfg.top_k):
          mask = tf.one_hot(index[:, :, k], cfg.experts)        # [b, t, E]
          slot = tf.cumsum(mask, axis=1, exclusive=True) + taken
          taken = taken + tf.reduce_sum(mask, axis=1, keepdims=True)
          keep = mask * tf.cast(slot < cfg.capacity, tf.float32)
          # [b, t, E, C]: 1 where the token takes slot c of expert e.
          place = keep[..., tf.newaxis] * tf.one_hot(
              tf.cast(tf.reduce_sum(slot * mask, axis=-1), tf.int32),
              cfg.capacity)[:, :, tf.newaxis, :]
          dispatch = dispatch + place
          combine = combine + place * weights[:, :, k, tf.newaxis, tf.newaxis]
        dispatch, combine = tf.cast(dispatch, x.dtype), tf.cast(combine, x.dtype)
      slots = tf.einsum("btec,btd->becd", dispatch, x)
      out = self.experts(slots)
      return tf.einsum("btec,becd->btd", combine, out), aux

  class MoEBlock(layers.Layer):

    def __init__(self, cfg, moe_layer, **kwargs):
      super().__init__(**kwargs)
      self.attn_norm = RMSNorm(cfg.eps, name="attn_norm")
      self.attn = GroupedQueryAttention(cfg, name="attn")
      self.moe_norm = RMSNorm(cfg.eps, name="moe_norm")
      self.moe = moe_layer(cfg, name="moe")

    def call(self, x):
      x = x + self.attn(self.attn_norm(x))
      y, aux = self.moe(self.moe_norm(x))
      return x + y, aux

  class MoEDecoder(K.Model):
    """(logits, the blocks' balance losses summed)."""

    def __init__(self, cfg, moe_layer, **kwargs):
      super().__init__(**kwargs)
      self.cfg = cfg
      self.embed = layers.Embedding(cfg.vocab, cfg.hidden,
                                    name="token_embedding")
      self.blocks = [MoEBlock(cfg, moe_layer, name=f"block_{i}")
                     for i in range(cfg.blocks)]
      self.norm = RMSNorm(cfg.eps, name="norm")
      self.lm_head = layers.Dense(cfg.vocab, use_bias=False, name="lm_head")

    def call(self, tokens, training=False):
      x = self.embed(tokens)
      aux = 0.0
      for block in self.blocks:
        x, block_aux = block(x)
        aux = aux + block_aux
      return self.lm_head(self.norm(x)), aux

  def moe(cfg):
    return MoEDecoder(cfg, DenseMoE, name="moe")

  def switch(cfg):
    return MoEDecoder(cfg, CapacityMoE, name="switch")

  # --- bert ---------------------------------------------------------------

  class BertEmbed(layers.Layer):
    """tok + type + pos embeddings, then LayerNorm."""

    def __init__(self, cfg, **kwargs):
      super().__init__(**kwargs)
      self.seq = cfg.seq
      self.tok = layers.Embedding(cfg.vocab, cfg.hidden, name="tok")
      self.type = layers.Embedding(cfg.type_vocab, cfg.hidden, name="type")
      self.pos = layers.Embedding(cfg.seq, cfg.hidden, name="pos")
      self.ln = layers.LayerNormalization(epsilon=cfg.eps, name="ln")

    def call(self, tokens, token_type_ids):
      x = self.tok(tokens) + self.type(token_type_ids)
      x = x + self.pos(tf.range(self.seq))[tf.newaxis]
      return self.ln(x)

  class BertAttention(layers.Layer):
    """q/k/v/o with biases; `additive_mask` [b, 1, 1, t] added to scores."""

    def __init__(self, cfg, **kwargs):
      super().__init__(**kwargs)
      self.cfg = cfg
      self.q = layers.Dense(cfg.hidden, name="q")
      self.k = layers.Dense(cfg.hidden, name="k")
      self.v = layers.Dense(cfg.hidden, name="v")
      self.o = layers.Dense(cfg.hidden, name="o")

    def call(self, x, additive_mask):
      nh, hd = self.cfg.heads, self.cfg.head_dim
      q = split_heads(self.q(x), nh, hd, "q")
      k = split_heads(self.k(x), nh, hd, "k")
      v = split_heads(self.v(x), nh, hd, "v")
      scores = tf.matmul(q, k, transpose_b=True) * (1.0 / np.sqrt(hd))
      probs = tf.nn.softmax(scores + tf.cast(additive_mask, scores.dtype), axis=-1)
      return self.o(merge_heads(tf.matmul(probs, v)))

  class BertBlock(layers.Layer):
    """Post-norm: ln_1(x + attn(x)); ln_2(x + mlp(x))."""

    def __init__(self, cfg, **kwargs):
      super().__init__(**kwargs)
      self.attn = BertAttention(cfg, name="attn")
      self.ln_1 = layers.LayerNormalization(epsilon=cfg.eps, name="ln_1")
      self.mlp = FeedForward(cfg, name="mlp")
      self.ln_2 = layers.LayerNormalization(epsilon=cfg.eps, name="ln_2")

    def call(self, x, additive_mask):
      x = self.ln_1(x + self.attn(x, additive_mask))
      return self.ln_2(x + self.mlp(x))

  class Bert(K.Model):

    def __init__(self, cfg, **kwargs):
      super().__init__(**kwargs)
      self.cfg = cfg
      self.embed = BertEmbed(cfg, name="embed")
      self.blocks = [BertBlock(cfg, name=f"block_{i}")
                     for i in range(cfg.blocks)]
      self.pooler = layers.Dense(cfg.hidden, activation="tanh", name="pooler")
      self.classifier = layers.Dense(cfg.classes, name="classifier")

    def call(self, tokens, token_type_ids=None, attention_mask=None,
             training=False):
      with tf.name_scope("mask"):
        keep = tf.cast(attention_mask, tf.float32)[:, tf.newaxis, tf.newaxis]
        additive = (1.0 - keep) * -1e9  # [b, 1, 1, t]
      x = self.embed(tokens, token_type_ids)
      for block in self.blocks:
        x = block(x, additive)
      return self.classifier(self.pooler(x[:, 0]))

  def bert(cfg):
    return Bert(cfg, name="bert")

  # --- vit ----------------------------------------------------------------

  class PatchEmbed(layers.Layer):
    """Conv2D patches, class token in front, learned position embedding."""

    def __init__(self, cfg, **kwargs):
      super().__init__(**kwargs)
      self.cfg = cfg
      self.patch = layers.Conv2D(cfg.hidden, cfg.patch, strides=cfg.patch,
                                 padding="valid", name="patch")

    def build(self, input_shape):
      cfg = self.cfg
      self.cls = self.add_weight(name="cls", shape=[1, 1, cfg.hidden],
                                 initializer="zeros", trainable=True)
      self.pos = self.add_weight(name="pos",
                                 shape=[1, cfg.tokens, cfg.hidden],
                                 initializer="zeros", trainable=True)
      super().build(input_shape)

    def call(self, images):
      cfg = self.cfg
      x = self.patch(images)  # [b, h/p, w/p, hidden]
      b = x.shape[0]
      x = tf.reshape(x, [b, cfg.patches, cfg.hidden])
      cls = tf.tile(tf.convert_to_tensor(self.cls), [b, 1, 1])
      x = tf.concat([cls, x], axis=1)
      return x + tf.convert_to_tensor(self.pos)

  class Vit(K.Model):

    def __init__(self, cfg, **kwargs):
      super().__init__(**kwargs)
      self.cfg = cfg
      self.embed = PatchEmbed(cfg, name="embed")
      self.blocks = [PreNormBlock(cfg, causal=False, name=f"block_{i}")
                     for i in range(cfg.blocks)]
      self.ln_f = layers.LayerNormalization(epsilon=cfg.eps, name="ln_f")
      self.head = layers.Dense(cfg.classes, name="head")

    def call(self, images, training=False):
      x = self.embed(images)
      for block in self.blocks:
        x = block(x)
      return self.head(self.ln_f(x)[:, 0])

  def vit(cfg):
    return Vit(cfg, name="vit")

  return {"causallm": causallm, "llama": llama, "moe": moe, "switch": switch,
          "bert": bert, "vit": vit}


def _call(model, cfg, inputs, training):
  """(logits, auxiliary loss or None)."""
  if cfg.family == "bert":
    tokens, types, mask = inputs
    return model(tokens, token_type_ids=types, attention_mask=mask,
                 training=training), None
  (x,) = inputs
  out = model(x, training=training)
  return out if cfg.experts else (out, None)


PRECISIONS = ("mixed_bfloat16", "mixed_float16")


def _policy(K, precision):
  """Context: Keras's global dtype policy set to `precision` (None: as is)
  while the model's layers are made (each layer keeps the policy it was
  made under)."""
  import contextlib  # pylint: disable=import-outside-toplevel
  if precision is None:
    return contextlib.nullcontext()
  if precision not in PRECISIONS:
    raise TfsplitError(f"unknown precision '{precision}'; choose one of "
                       f"{', '.join(PRECISIONS)}")
  mp = K.mixed_precision

  @contextlib.contextmanager
  def scoped():
    if K.__name__ == "keras":
      before = mp.dtype_policy()
      mp.set_dtype_policy(precision)
    else:
      before = mp.global_policy()
      mp.set_global_policy(precision)
    try:
      yield
    finally:
      if K.__name__ == "keras":
        mp.set_dtype_policy(before)
      else:
        mp.set_global_policy(before)
  return scoped()


def build(name, size="tiny", seed=0, batch_size=None, precision=None, experts=None):
  """An ExampleModel for corpus model `name` ('<family>_<keras3|tfkeras>').

  precision: None (float32), 'mixed_bfloat16' (bf16 compute, float32
  weights and Adam) or 'mixed_float16' (float16 compute, float32 weights,
  the step under Keras's LossScaleOptimizer with a dynamic scale).
  experts: the mixture-of-experts decoders' expert count, if not the size's."""
  family, _, flavor = name.partition("_")
  if name not in NAMES:
    raise TfsplitError(f"unknown corpus model '{name}'; choose one of "
                       f"{', '.join(NAMES)}")
  if flavor == "keras3":
    import keras as K  # pylint: disable=import-outside-toplevel
  else:
    import tf_keras as K  # pylint: disable=import-outside-toplevel
  cfg = config_for(family, size, batch_size)
  if experts is not None:
    if not cfg.experts:
      raise TypeError(f"{name}: experts= is for the mixture-of-experts decoders")
    cfg = dataclasses.replace(cfg, experts=int(experts))
  fwd_sig, train_sig = signatures(cfg)
  with _policy(K, precision):
    model = _define(K)[family](cfg)
    # One eager call creates every weight with its final (static) shape.
    _call(model, cfg, [np.zeros(s.shape, s.dtype.as_numpy_dtype)
                       for s in fwd_sig], training=False)

  keras3 = K.__name__ == "keras"
  tape_vars = list(model.trainable_variables)
  if keras3:
    named = [(v.path, common.tf_variable(v)) for v in tape_vars]
  else:
    named = [(common.strip_port(v.name), v) for v in tape_vars]
  paths = [p for p, _ in named]
  if len(set(paths)) != len(paths):
    raise AssertionError(f"{name}: variable paths are not unique: {paths}")
  common.init_weights(named, seed)

  optimizer = K.optimizers.Adam(learning_rate=cfg.lr, name="adam")
  scaled = precision == "mixed_float16"
  if scaled:
    # A small initial scale: tiny models overflow fp16 at Keras's 2**15
    # only by luck; the dynamic scale still grows and halves.
    if keras3:
      optimizer = K.optimizers.LossScaleOptimizer(optimizer, initial_scale=2.0 ** 10)
    else:
      optimizer = K.mixed_precision.LossScaleOptimizer(optimizer, initial_scale=2.0 ** 10)
  optimizer.build(tape_vars)  # slots exist before tracing
  if keras3:
    opt_vars = lambda: [(v.path, common.tf_variable(v))
                        for v in optimizer.variables]
  else:
    # tf_keras keeps the learning-rate variable out of variables(), but the
    # train step reads it.
    lr = getattr(getattr(optimizer, "inner_optimizer", optimizer), "_learning_rate", None)
    extra = [lr] if isinstance(lr, tf.Variable) else []
    opt_vars = lambda: [(f"adam/{common.strip_port(v.name)}", v)
                        for v in list(optimizer.variables()) + extra]

  @tf.function(input_signature=fwd_sig, autograph=False)
  def forward(*inputs):
    return _call(model, cfg, inputs, training=False)[0]

  @tf.function(input_signature=train_sig, autograph=False)
  def train_step(*args):
    inputs, labels = args[:-1], args[-1]
    with tf.GradientTape() as tape:
      logits, aux = _call(model, cfg, inputs, training=True)
      # The loss in float32 (Keras's advice under a mixed policy).
      loss = common.sparse_xent(labels, tf.cast(logits, tf.float32))
      if aux is not None:
        loss = loss + cfg.aux_coef * tf.cast(aux, tf.float32)
      if scaled:
        target = optimizer.scale_loss(loss) if keras3 else optimizer.get_scaled_loss(loss)
      else:
        target = loss
    grads = tape.gradient(target, tape_vars)
    if scaled and not keras3:
      grads = optimizer.get_unscaled_gradients(grads)
    optimizer.apply_gradients(zip(grads, tape_vars))
    return loss

  return ExampleModel(
      name=name, size=size, config=cfg,
      variables=[v for _, v in named], variable_paths=paths,
      optimizer=optimizer, forward=forward, train_step=train_step,
      forward_signature=fwd_sig, train_signature=train_sig, model=model,
      input_fn=input_fn(cfg), optimizer_variables_fn=opt_vars)
