"""Operator splitting: split graphs compute what the single-device graph computes."""
import numpy as np
import pytest
import tensorflow as tf

import tfsplit
from tfsplit.errors import PlanError
from tfsplit.graph import load_graph
from tfsplit.runtime import shards as shards_lib
from tfsplit.runtime.graph_function import import_graph
from tfsplit.runtime.split_function import make_mesh
from tfsplit.passes import split_graph

import models  # examples/models (see conftest.py)
from _util import TIMEOUT, check_training, example, names

_example = example
_names = names


def _run_split(ex, kind, mesh, steps):
  graph_def = load_graph(ex.concrete(kind), variable_names=_names(ex))
  result = split_graph(graph_def, make_mesh(mesh), timeout_seconds=TIMEOUT)
  full = {n: v.numpy() for v, n in _names(ex)}
  shard_vars = shards_lib.create_shard_variables(result.manifest, full)
  fn = import_graph(result.graph_def, shard_vars)
  inputs = [tf.constant(x) for x in ex.make_inputs(kind, seed=5)]
  outs = [fn(*inputs)[0].numpy() for _ in range(steps)]
  return result, outs, shard_vars, inputs


@pytest.mark.parametrize("mesh", ["tp=2", "tp=4"])
@pytest.mark.parametrize("name", ["mlp_raw", "gpt_raw", "gpt_tfkeras"])
def test_forward_matches(name, mesh):
  ex = _example(name)
  result, outs, _, inputs = _run_split(ex, "forward", mesh, 1)
  want = ex.forward(*inputs).numpy()
  np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  assert not result.fallbacks
  assert result.variable_specs  # something was actually split


@pytest.mark.parametrize("mesh", ["tp=2", "tp=4"])
@pytest.mark.parametrize("name", ["gpt_raw", "gpt_keras3", "gpt_tfkeras"])
def test_training_matches_single_device(name, mesh):
  ex = _example(name)
  step = check_training(ex, seed=7, mesh=mesh)
  assert any(s for s in step.result.variable_specs.values())  # something was split


@pytest.mark.parametrize("name", ["gpt_raw", "gpt_keras3", "gpt_tfkeras"])
def test_megatron_collective_count(name):
  """Exactly 2 all-reduces forward and 2 backward per block; no weight gathered."""
  ex = _example(name)
  graph_def = load_graph(ex.concrete("train"), variable_names=_names(ex))
  result = split_graph(graph_def, make_mesh("tp=2"))
  blocks = ex.config.blocks
  reduces = [c for c in result.collectives if c.kind == "all_reduce"]
  forward = [c for c in reduces if not c.tensor.startswith("gradient_tape/")
             and not c.tensor.startswith("AddN")]
  assert len(forward) == 2 * blocks, [c.tensor for c in forward]
  assert len(reduces) == 4 * blocks, [c.tensor for c in reduces]
  assert result.count("all_gather") == 0, [c.tensor for c in result.collectives]
  for b in range(blocks):
    assert sum(f"block_{b}" in c.tensor for c in forward) == 2
  # Every all-reduce moves one b*s*h activation (Megatron's optimum).
  cfg = ex.config
  for c in reduces:
    assert c.num_elements == cfg.batch * cfg.seq * cfg.hidden


def test_output_is_deterministic(tmp_path):
  """Two processes with different hash seeds write byte-identical graphs and
  manifests (set or dict order cannot leak into node order, names or keys)."""
  import hashlib  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  example_pb = os.path.join(os.path.dirname(__file__), "..", "examples",
                            "gpt_raw_train_tiny.pb")
  digests = []
  for seed in ("1", "2"):
    out = tmp_path / f"out_{seed}.pb"
    env = dict(os.environ, PYTHONHASHSEED=seed)
    subprocess.run([sys.executable, "-m", "tfsplit.cli", "rewrite", example_pb, "-o",
                    str(out), "--mesh", "dp=2,tp=2", "--microbatches", "2"],
                   check=True, env=env, capture_output=True, timeout=300)
    manifest = (tmp_path / f"out_{seed}.manifest.json").read_bytes()
    digests.append((hashlib.sha256(out.read_bytes()).hexdigest(),
                    hashlib.sha256(manifest.replace(str(tmp_path).encode(), b"")).hexdigest()))
  assert digests[0] == digests[1]


def test_heads_not_divisible_is_a_clear_error():
  ex = models.build("gpt_tfkeras", size="tiny", seed=0)  # 4 heads
  graph_def = load_graph(ex.concrete("forward"), variable_names=_names(ex))
  with pytest.raises(PlanError, match=r"does not divide by tp=3"):
    split_graph(graph_def, make_mesh("tp=3"))


def test_mesh_larger_than_devices():
  with pytest.raises(PlanError, match=r"needs 8 devices but this process has 4"):
    make_mesh("tp=8")


def test_op_without_rule_falls_back_exactly():
  """An op with no split rule between the pair is replicated (logged), not wrong."""
  w1 = tf.Variable(np.random.RandomState(0).randn(8, 16).astype(np.float32), name="w1")
  w2 = tf.Variable(np.random.RandomState(1).randn(16, 4).astype(np.float32), name="w2")

  @tf.function
  def f(x):
    h = tf.matmul(x, w1)
    h = tf.reverse(h, axis=[1])  # no split rule for ReverseV2
    return tf.matmul(h, w2)
  x = np.random.RandomState(2).randn(2, 8).astype(np.float32)
  step = tfsplit.split(f, mesh="tp=2", input_signature=[tf.TensorSpec([2, 8])],
                       timeout_seconds=TIMEOUT)
  assert any("ReverseV2" in msg for msg in step.result.fallbacks)
  np.testing.assert_allclose(step(tf.constant(x)).numpy(), f(x).numpy(), rtol=1e-5)


def test_annotations_override_strategy():
  """Megatron splits the pair w1 (columns) / w2 (rows); an annotation makes w1
  row-split instead, and the result is still exact."""
  rng = np.random.RandomState(3)
  w1 = tf.Variable(rng.randn(4, 8).astype(np.float32), name="w1")
  w2 = tf.Variable(rng.randn(8, 6).astype(np.float32), name="w2")

  @tf.function
  def f(x):
    return tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
  x = rng.randn(3, 4).astype(np.float32)
  plain = tfsplit.split(f, mesh="tp=2", input_signature=[tf.TensorSpec([3, 4])],
                        timeout_seconds=TIMEOUT)
  assert plain.manifest["w1"]["sharding"] == [None, "tp"]
  step = tfsplit.split(f, mesh="tp=2", annotations={"w1": ("tp", None)},
                       input_signature=[tf.TensorSpec([3, 4])], timeout_seconds=TIMEOUT)
  assert step.manifest["w1"]["sharding"] == ["tp", None]
  assert [s["offsets"] for s in step.manifest["w1"]["shards"]] == [[0, 0], [2, 0]]
  want = f(x).numpy()
  np.testing.assert_allclose(step(tf.constant(x)).numpy(), want, rtol=1e-6,
                             atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("mesh", ["tp=2", "dp=2", "dp=2,tp=2"])
@pytest.mark.parametrize("name", ["mlp_raw", "mlp_keras3", "mlp_tfkeras"])
def test_mlp_training_matches_single_device(name, mesh):
  """The MLP examples train split: every shard, every update, 3 steps."""
  step = check_training(_example(name), seed=3, mesh=mesh)
  if "tp" in mesh:
    assert any(any(s) for s in step.result.variable_specs.values())
