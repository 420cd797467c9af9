"""Data parallelism, micro-batching and dp x tp meshes: exact training."""
import collections
import re

import numpy as np
import pytest
import tensorflow as tf

import tfsplit
from tfsplit import models
from tfsplit.errors import PlanError
from tfsplit.graph import load_graph
from tfsplit.runtime.split_function import make_mesh
from tfsplit.sharding.split_pass import split_graph

TIMEOUT = 60.0
BATCH = 16  # divisible by dp x m for every case below
_CACHE = {}


def _example(name):
  if name not in _CACHE:
    _CACHE[name] = models.build(name, size="tiny", seed=0, batch_size=BATCH)
  return _CACHE[name]


def _names(ex):
  return list(zip(ex.all_variables(), ex.variable_names()))


def _close(got, want, what):
  got, want = np.asarray(got), np.asarray(want)
  err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1.0) if want.size else 0
  assert err <= 1e-4, f"{what}: relative error {err:.2e}"


def _check_training(name, mesh, m):
  ex = _example(name)
  variables = ex.all_variables()
  start = [v.numpy().copy() for v in variables]
  try:
    step = tfsplit.split(ex.train_step, mesh=mesh, microbatches=m,
                         input_signature=ex.train_signature, variable_names=_names(ex),
                         timeout_seconds=TIMEOUT)
    inputs = [tf.constant(x) for x in ex.make_inputs("train", seed=11)]
    got = [float(step(*inputs)) for _ in range(3)]
    want = [float(ex.train_step(*inputs)) for _ in range(3)]
    for g, w in zip(got, want):
      _close(g, w, "loss")
    full = step.full_values()
    for v, n in _names(ex):
      _close(full[n], v.numpy(), n)
    # tf_keras's sparse Adam deduplicates the token ids of the embedding
    # update (Unique): that needs all ids, so they are gathered, correctly.
    assert all("(op Unique)" in f for f in step.result.fallbacks), step.result.fallbacks
    return step
  finally:
    for v, s in zip(variables, start):
      v.assign(s)


CASES = [(mesh, m) for mesh in ("dp=2", "dp=4", "dp=2,tp=2") for m in (1, 2, 4)]


@pytest.mark.parametrize("mesh,m", CASES)
def test_gpt_raw_training(mesh, m):
  _check_training("gpt_raw", mesh, m)


@pytest.mark.parametrize("mesh,m", [("dp=2", 2), ("dp=2,tp=2", 2), ("dp=4", 1),
                                    ("dp=1", 4)])
@pytest.mark.parametrize("name", ["gpt_keras3", "gpt_tfkeras"])
def test_keras_training(name, mesh, m):
  _check_training(name, mesh, m)


@pytest.mark.slow
@pytest.mark.parametrize("mesh,m", CASES)
@pytest.mark.parametrize("name", ["gpt_keras3", "gpt_tfkeras"])
def test_keras_training_full_matrix(name, mesh, m):
  _check_training(name, mesh, m)


def test_gradient_all_reduce_once_per_parameter_over_dp():
  ex = _example("gpt_raw")
  graph_def = load_graph(ex.concrete("train"), variable_names=_names(ex))
  result = split_graph(graph_def, make_mesh("dp=2,tp=2"), microbatches=2)
  by_axis = collections.Counter(c.axis for c in result.collectives if c.kind == "all_reduce")
  params = len(ex.variables)
  # One per parameter (the sparse embedding updates sum g and g*g separately:
  # one more per embedding table), plus the loss.
  assert params + 1 <= by_axis["dp"] <= params + 1 + 2, by_axis
  # Over tp only Megatron's 2 forward + 2 backward per block.
  assert by_axis["tp"] == 4 * ex.config.blocks, by_axis
  assert result.count("all_gather") == 0
  # Micro-batch gradients are summed locally (no communication) before dp.
  local = [c for c in result.collectives if c.kind == "local_sum"]
  assert len(local) >= params


def test_batch_not_divisible():
  ex = _example("gpt_raw")
  graph_def = load_graph(ex.concrete("train"), variable_names=_names(ex))
  with pytest.raises(PlanError, match=r"global batch 16 does not divide by dp=2 x mb=3"):
    split_graph(graph_def, make_mesh("dp=2"), microbatches=3)


def test_input_without_batch_dimension():
  w = tf.Variable(tf.ones([3]), name="w")

  @tf.function
  def f(x):
    return tf.reduce_sum(w * x)
  with pytest.raises(PlanError, match=r"needs a static batch dimension"):
    tfsplit.split(f, mesh="dp=2", input_signature=[tf.TensorSpec([])])


def test_microbatches_run_in_order():
  """Micro-batch j+1's inputs wait for micro-batch j's gradient contributions."""
  ex = _example("gpt_raw")
  graph_def = load_graph(ex.concrete("train"), variable_names=_names(ex))
  result = split_graph(graph_def, make_mesh("dp=1"), microbatches=4)
  slices = {n.name: n for n in result.graph_def.node
            if re.fullmatch(r"tokens/shard_\d+", n.name)}
  assert len(slices) == 4
  waits = {name: [t for t in node.input if t.startswith("^")] for name, node in slices.items()}
  assert not waits["tokens/shard_0"]
  for j in (1, 2, 3):
    assert waits[f"tokens/shard_{j}"], f"micro-batch {j} does not wait for {j - 1}"
