"""Data parallelism, micro-batching and dp x tp meshes: exact training."""
import collections
import re

import pytest
import tensorflow as tf

import tfsplit
from tfsplit.errors import PlanError
from tfsplit.graph import Graph, load_graph
from tfsplit.graph.endpoints import graph_outputs
from tfsplit.runtime.split_function import make_mesh
from tfsplit.passes import split_graph

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
  """Micro-batch j+1's first ops that depend on a weight wait for exactly
  micro-batch j's contribution to every running gradient sum (the loss's sum
  comes after the updates and orders nothing); every op of micro-batch j+1
  that depends on a weight comes after them; what depends on no weight (the
  input slices) waits for nothing."""
  ex = example("gpt_raw", batch_size=BATCH)
  graph_def = load_graph(ex.concrete("train"), variable_names=names(ex))
  result = split_graph(graph_def, make_mesh("dp=1"), microbatches=4)
  nodes = {n.name: n for n in result.graph_def.node}
  sums = result.count("local_sum")
  assert sums >= len([v for v in ex.all_variables() if v.trainable])
  accumulators = {}  # micro-batch -> {node holding the running sum after it}
  outputs = graph_outputs(Graph(graph_def))
  for name, node in nodes.items():
    m = re.search(r"/sum_mb/group_0/acc_(\d+)$", name)
    if m and not name.startswith(tuple(f"{o}/port_" for o in outputs)):
      j = int(m.group(1))
      accumulators.setdefault(j, set()).add(name)
      if j == 1:  # micro-batch 0's own contribution starts the chain
        accumulators.setdefault(0, set()).add(node.input[0].split(":")[0])
  assert all(len(accumulators[j]) == sums - len(outputs) for j in range(4)), \
      {j: len(a) for j, a in accumulators.items()}
  all_acc = set().union(*accumulators.values())
  waiting = {}  # micro-batch -> local nodes ordered after the previous one
  for name, node in nodes.items():
    waits = {t[1:] for t in node.input if t.startswith("^")} & all_acc
    if waits:
      j = result.records[name].device_id
      assert waits == accumulators[j - 1], f"{name} of micro-batch {j}"
      waiting.setdefault(j, set()).add(name)
  assert sorted(waiting) == [1, 2, 3]
  for name in ("tokens", "labels"):
    for j in range(4):
      assert not [t for t in nodes[f"{name}/shard_{j}"].input if t.startswith("^")]
  # Every per-micro-batch op that reads a weight (through its data inputs)
  # descends from its micro-batch's waiting ops.
  for j in (1, 2, 3):
    after = _descendants(result.graph_def, waiting[j])
    for name, record in result.records.items():
      if record.device_id == j and not record.shared and \
          nodes[name].op in ("MatMul", "BatchMatMulV2"):
        assert name in after, f"{name} runs outside micro-batch {j}'s order"


def _descendants(graph_def, starts):
  consumers = collections.defaultdict(set)
  for n in graph_def.node:
    for t in n.input:
      consumers[t.lstrip("^").split(":")[0]].add(n.name)
  seen, todo = set(starts), list(starts)
  while todo:
    for c in consumers[todo.pop()]:
      if c not in seen:
        seen.add(c)
        todo.append(c)
  return seen


class _LaggingReplica(object):
  """A split step whose last replica takes only 90% of each step for one
  variable: what the training check must catch."""

  def __init__(self, step, shard):
    self.step, self.manifest, self.shard_values = step, step.manifest, step.shard_values
    self.var = step.variables[shard]

  def __call__(self, *args):
    before = self.var.numpy()
    out = self.step(*args)
    self.var.assign(before + 0.9 * (self.var.numpy() - before))
    return out


def test_training_check_fails_on_a_lagging_replica():
  """The check behind every training test fails on one replica's 10% short
  step, after 1 step and after 3, and names that replica's device."""
  from _util import TIMEOUT, training_report  # pylint: disable=import-outside-toplevel
  ex = example("gpt_raw")
  variables = ex.all_variables()
  start = [v.numpy().copy() for v in variables]
  step = tfsplit.split(ex.train_step, mesh="dp=2", input_signature=ex.train_signature,
                       variable_names=names(ex), timeout_seconds=TIMEOUT)
  kernel = "gpt/block_0/mlp/fc1/kernel"
  lagging = _LaggingReplica(step, step.manifest[kernel]["shards"][1]["name"])
  inputs = ex.make_inputs("train", seed=2)
  try:
    for steps in (1, 3):
      report, _ = training_report(lagging, ex, inputs, steps)
      failed = {c.what for c in report.failures}
      assert f"{kernel} on /device:CPU:1" in failed, report.table()
      assert report.first_divergent_copy() is not None
      if steps == 1:  # later steps spread the error to every replica's gradients
        assert failed == {f"{kernel} on /device:CPU:1",
                          f"{kernel} on /device:CPU:1 vs /device:CPU:0"}, failed
  finally:
    for v, s in zip(variables, start):
      v.assign(s)
