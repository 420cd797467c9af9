"""Data parallelism, micro-batching and dp x tp meshes: exact training."""
import collections
import re

import pytest
import tensorflow as tf

import tfsplit
from tfsplit.errors import PlanError
from tfsplit.graph import load_graph
from tfsplit.runtime.split_function import make_mesh
from tfsplit.sharding.split_pass import split_graph

from _util import check_training, example, names

BATCH = 16  # divisible by dp x m for every case below


def _check_training(name, mesh, m):
  step = check_training(example(name, batch_size=BATCH), mesh=mesh, microbatches=m)
  # tf_keras's sparse Adam deduplicates the token ids of the embedding
  # update (Unique): that needs all ids, so they are gathered, correctly.
  assert all("(op Unique)" in f for f in step.result.fallbacks), step.result.fallbacks
  return step


CASES = [(mesh, m) for mesh in ("dp=2", "dp=4", "dp=2,tp=2") for m in (1, 2, 4)]
# The CI subset; the whole matrix runs with -m slow.
_CI_CASES = {("dp=2", 1), ("dp=2", 4), ("dp=4", 2), ("dp=2,tp=2", 2)}
RAW_CASES = [c if c in _CI_CASES else pytest.param(*c, marks=pytest.mark.slow)
             for c in CASES]


@pytest.mark.parametrize("mesh,m", RAW_CASES)
def test_gpt_raw_training(mesh, m):
  _check_training("gpt_raw", mesh, m)


@pytest.mark.parametrize("mesh,m", [("dp=2", 2), ("dp=2,tp=2", 2)])
@pytest.mark.parametrize("name", ["gpt_keras3", "gpt_tfkeras"])
def test_keras_training(name, mesh, m):
  _check_training(name, mesh, m)


@pytest.mark.slow
@pytest.mark.parametrize("mesh,m", CASES)
@pytest.mark.parametrize("name", ["gpt_keras3", "gpt_tfkeras"])
def test_keras_training_full_matrix(name, mesh, m):
  _check_training(name, mesh, m)


def test_gradient_all_reduce_once_per_parameter_over_dp():
  ex = example("gpt_raw", batch_size=BATCH)
  graph_def = load_graph(ex.concrete("train"), variable_names=names(ex))
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
  ex = example("gpt_raw", batch_size=BATCH)
  graph_def = load_graph(ex.concrete("train"), variable_names=names(ex))
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
  ex = example("gpt_raw", batch_size=BATCH)
  graph_def = load_graph(ex.concrete("train"), variable_names=names(ex))
  result = split_graph(graph_def, make_mesh("dp=1"), microbatches=4)
  slices = {n.name: n for n in result.graph_def.node
            if re.fullmatch(r"tokens/shard_\d+", n.name)}
  assert len(slices) == 4
  waits = {name: [t for t in node.input if t.startswith("^")] for name, node in slices.items()}
  assert not waits["tokens/shard_0"]
  for j in (1, 2, 3):
    assert waits[f"tokens/shard_{j}"], f"micro-batch {j} does not wait for {j - 1}"
