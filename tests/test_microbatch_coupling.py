"""Micro-batches never wait for each other's activations.

What depends on no weight (padding masks combined with a causal mask by
Minimum, position ids from Cumsum, a loss normalised by the batch's token
count) may need every micro-batch: it is built from the inputs alone, runs
outside the micro-batch order, and training stays exact and ordered. A tensor
that needs every micro-batch's activations (a batch statistic in training) is
refused with one line naming the node and the op; so is a coupling through
an op that runs once on the whole batch (a batch-wide router balance loss,
an op with no batch rule), naming the micro-batch op, the whole-batch op
between them and the tensor."""
import types

import numpy as np
import pytest
import tensorflow as tf

from tfsplit.errors import PlanError
from tfsplit.graph import load_graph
from tfsplit.passes import split_graph
from tfsplit.pipeline.microbatches import ordered_microbatches
from tfsplit.runtime.split_function import make_mesh

from _util import check_training, names

B, T, D, V = 16, 8, 16, 32


def _model(kind, seed=0):
  """An example-like object (train_step, train_signature, make_inputs, variables)."""
  rng = np.random.default_rng(seed)
  emb = tf.Variable(rng.standard_normal([V, D]).astype(np.float32) * 0.1, name="embed")
  proj = tf.Variable(rng.standard_normal([D, D]).astype(np.float32) * 0.3, name="proj")
  head = tf.Variable(rng.standard_normal([D, V]).astype(np.float32) * 0.3, name="head")
  variables = [emb, proj, head]
  signature = [tf.TensorSpec([B, T], tf.int32, name="tokens"),
               tf.TensorSpec([B, T], tf.int32, name="labels")]

  def forward(tokens):
    with tf.name_scope("model"):
      pad = tf.cast(tf.not_equal(tokens, 0), tf.float32)               # [B, T]
      causal = tf.linalg.band_part(tf.ones([T, T]), -1, 0)             # [T, T]
      mask = tf.minimum(causal[tf.newaxis], pad[:, tf.newaxis, :])      # [B, T, T]
      positions = tf.cumsum(tf.cast(pad, tf.int32), axis=1)            # [B, T]
      with tf.name_scope("embed"):
        h = tf.gather(emb, tokens) + tf.gather(emb, positions) * 0.5
      with tf.name_scope("block"):
        q = tf.einsum("btd,de->bte", h, proj)
        if kind == "batch_statistic":
          # BatchNormalization in training: the mean over the whole batch.
          q = q - tf.reduce_mean(q, axis=[0, 1], keepdims=True)
        if kind == "no_batch_rule":
          q = tf.reverse(q, axis=[2])  # ReverseV2: no split rule
        scores = tf.einsum("bqd,bkd->bqk", q, h) + (1.0 - mask) * -1e4
        h = h + tf.einsum("bqk,bkd->bqd", tf.nn.softmax(scores), h)
      aux = 0.0
      if kind == "batch_balance":
        with tf.name_scope("balance"):
          # Switch's load-balancing loss over the whole batch: the share of
          # tokens each of 4 "experts" wins times its mean probability.
          probs = tf.nn.softmax(h[..., :4])
          share = tf.reduce_mean(tf.one_hot(tf.argmax(probs, axis=-1), 4), axis=[0, 1])
          aux = 4.0 * tf.reduce_sum(share * tf.reduce_mean(probs, axis=[0, 1]))
      with tf.name_scope("head"):
        return tf.einsum("btd,dv->btv", h, head), pad, aux

  @tf.function(input_signature=signature, autograph=False)
  def train_step(tokens, labels):
    with tf.GradientTape() as tape:
      logits, pad, aux = forward(tokens)
      xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
      # A masked LM loss: the mean over real tokens of the whole batch.
      loss = tf.reduce_sum(xent * pad) / tf.reduce_sum(pad) + 0.01 * aux
    grads = tape.gradient(loss, variables)
    for v, g in zip(variables, grads):
      v.assign_sub(0.5 * tf.convert_to_tensor(g))
    return loss

  def make_inputs(kind_, seed):
    del kind_
    r = np.random.default_rng(seed)
    tokens = r.integers(1, V, [B, T], dtype=np.int32)
    for i, n in enumerate(r.integers(0, T - 1, [B])):
      if n:
        tokens[i, T - n:] = 0  # trailing padding
    return [tokens, r.integers(0, V, [B, T], dtype=np.int32)]

  return types.SimpleNamespace(
      name=kind, train_step=train_step, train_signature=signature,
      make_inputs=make_inputs, all_variables=lambda: variables,
      variable_names=lambda: ["embed", "proj", "head"])


@pytest.mark.parametrize("mesh,m", [("dp=2", 4), ("dp=1", 8)])
def test_masks_and_token_counts_keep_microbatches_exact(mesh, m):
  """A mask from Minimum(causal, padding), Cumsum position ids and a loss over
  the batch's token count: exact, and every micro-batch after the first waits
  for the previous one."""
  ex = _model("masked")
  step = check_training(ex, mesh=mesh, microbatches=m)
  mb_mesh = step.result.mesh
  waiting = ordered_microbatches(step.graph_def, step.result.records, mb_mesh)
  assert len(waiting) == mb_mesh.size // m * (m - 1)


def test_batch_statistic_is_refused_with_one_line():
  ex = _model("batch_statistic")
  graph_def = load_graph(ex.train_step.get_concrete_function(), variable_names=names(ex))
  split_graph(graph_def, make_mesh("dp=2"))  # over replicas: an all-reduce, exact
  with pytest.raises(PlanError) as info:
    split_graph(graph_def, make_mesh("dp=2"), microbatches=4)
  message = str(info.value)
  assert "\n" not in message
  assert "model/block/" in message and "(op " in message and "micro-batches" in message
  assert "microbatches=1" in message


@pytest.mark.parametrize("kind,whole_op,tensor,fix", [
    ("batch_balance", "(op Mul)", "model/balance/Mean", "per micro-batch (per example"),
    ("no_batch_rule", "(op ReverseV2)", "model/block/einsum/Einsum", "has a batch rule"),
])
def test_coupling_through_a_whole_batch_op_names_it(kind, whole_op, tensor, fix):
  """The gathered tensor reaches each micro-batch's work through an op that
  runs once on the whole batch: one line naming both ops, the tensor, why
  the op runs whole and the fix that fits; data parallelism alone is exact."""
  ex = _model(kind)
  graph_def = load_graph(ex.train_step.get_concrete_function(), variable_names=names(ex))
  check_training(ex, mesh="dp=2")
  with pytest.raises(PlanError) as info:
    split_graph(graph_def, make_mesh("dp=2"), microbatches=2)
  message = str(info.value)
  assert "\n" not in message and "cycle" not in message, message
  assert "micro-batches are not independent" in message, message
  assert whole_op in message and f"'{tensor}" in message and fix in message, message
