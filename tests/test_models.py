"""The example model zoo: runs, trains, is seeded, and has the expected graphs."""
import numpy as np
import pytest
import tensorflow as tf

from tfsplit.errors import TfsplitError

import models  # examples/models (see conftest.py)

GPT_NAMES = [n for n in models.NAMES if n.startswith("gpt")]

_cache = {}


def _example(name, role):
  """One tiny build per (name, role); 'untrained' ones are never stepped."""
  key = (name, role)
  if key not in _cache:
    _cache[key] = models.build(name, "tiny", seed=0)
  return _cache[key]


def _graph_def(name, kind):
  return _example(name, "trainee").concrete(kind).graph.as_graph_def()


def _weights(ex):
  return [v.numpy() for v in ex.variables]


def _expected_output_shape(cfg):
  if isinstance(cfg, models.GptConfig):
    return (cfg.batch, cfg.seq, cfg.vocab)
  return (cfg.batch, cfg.classes)


@pytest.mark.parametrize("name", models.NAMES)
def test_forward_is_finite_with_expected_shape(name):
  ex = _example(name, "untrained")
  (x,) = ex.make_inputs("forward", seed=1)
  out = ex.forward(x).numpy()
  assert out.shape == _expected_output_shape(ex.config)
  assert np.all(np.isfinite(out))
  assert np.std(out) > 0


@pytest.mark.parametrize("name", models.NAMES)
def test_inputs_match_signature_and_seed(name):
  ex = _example(name, "untrained")
  for kind in models.KINDS:
    arrays = ex.make_inputs(kind, seed=3)
    spec = ex.signature(kind)
    assert len(arrays) == len(spec)
    for a, s in zip(arrays, spec):
      assert s.shape.is_fully_defined()
      assert a.shape == tuple(s.shape) and a.dtype == s.dtype.as_numpy_dtype
    again = ex.make_inputs(kind, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, again))
  other = ex.make_inputs("forward", seed=4)[0]
  assert not np.array_equal(ex.make_inputs("forward", seed=3)[0], other)


@pytest.mark.parametrize("name", models.NAMES)
def test_same_seed_gives_same_weights(name):
  first = _weights(_example(name, "untrained"))
  second = _weights(models.build(name, "tiny", seed=0))
  assert all(np.array_equal(a, b) for a, b in zip(first, second))
  reseeded = _weights(models.build(name, "tiny", seed=1))
  assert any(not np.array_equal(a, b) for a, b in zip(first, reseeded))


@pytest.mark.parametrize("family", ["mlp", "gpt"])
def test_flavors_compute_the_same_function(family):
  # Same variable order and sizes -> same seeded weights in every library.
  outs = []
  for flavor in models.FLAVORS:
    ex = _example(f"{family}_{flavor}", "untrained")
    outs.append(ex.forward(*ex.make_inputs("forward", seed=2)).numpy())
  for out in outs[1:]:
    np.testing.assert_allclose(out, outs[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", models.NAMES)
def test_train_steps_lower_loss_and_change_weights(name):
  ex = _example(name, "trainee")
  inputs = ex.make_inputs("train", seed=1)
  before = _weights(ex)
  losses = [float(ex.train_step(*inputs)) for _ in range(3)]
  assert all(np.isfinite(losses))
  assert losses[-1] < losses[0]
  after = _weights(ex)
  assert all(not np.array_equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("name", models.NAMES)
def test_all_variables_are_what_the_train_step_captures(name):
  ex = _example(name, "trainee")
  captured = {id(v) for v in ex.concrete("train").variables}
  listed = [id(v) for v in ex.all_variables()]
  assert len(set(listed)) == len(listed)
  assert set(listed) == captured
  assert all(isinstance(v, tf.Variable) for v in ex.all_variables())
  names = ex.variable_names()
  assert len(names) == len(listed) and len(set(names)) == len(names)
  # Adam slots were created at build time: two per model variable.
  assert len(listed) >= 3 * len(ex.variables)


@pytest.mark.parametrize("name", models.NAMES)
@pytest.mark.parametrize("kind", models.KINDS)
def test_graph_shapes_are_static(name, kind):
  graph = _example(name, "trainee").concrete(kind).graph
  dynamic = []
  for op in graph.get_operations():
    # Known exceptions: int shape helpers in Keras 3 matmul gradients and
    # tf_keras Adam's dedup of sparse (embedding) gradients.
    if op.type == "BroadcastGradientArgs" or op.name.startswith("adam/"):
      continue
    dynamic += [t.name for t in op.outputs if not t.shape.is_fully_defined()]
  assert not dynamic


def test_matmul_op_types_per_library():
  ops = {n: {node.op for node in _graph_def(n, "train").node}
         for n in models.NAMES}
  assert "Einsum" in ops["gpt_tfkeras"]
  # Keras 3 lowers its EinsumDense projections to BatchMatMulV2 but keeps
  # the two attention einsums (QK^T and probs.V) as Einsum ops.
  assert "Einsum" in ops["gpt_keras3"]
  for name in ("gpt_raw", "gpt_keras3"):
    assert {"MatMul", "BatchMatMulV2"} <= ops[name], name
  assert "Einsum" not in ops["gpt_raw"]
  assert "ResourceGather" in ops["gpt_raw"]
  for name in ("mlp_raw", "mlp_keras3", "mlp_tfkeras"):
    assert "MatMul" in ops[name], name


@pytest.mark.parametrize("name", models.NAMES)
def test_train_graph_scopes(name):
  nodes = [n.name for n in _graph_def(name, "train").node]
  grads = [n for n in nodes if n.startswith("gradient_tape/")]
  assert grads
  unit = "block" if name.startswith("gpt") else "layer"
  for i in (0, 1):
    assert any(f"/{unit}_{i}" in n for n in nodes), (name, i)
    assert any(f"/{unit}_{i}" in n for n in grads), (name, i)
  updates = [n for n in _graph_def(name, "train").node
             if n.op in ("AssignSubVariableOp", "AssignAddVariableOp")]
  assert updates


@pytest.mark.parametrize("name", GPT_NAMES)
def test_gpt_forward_graph_has_attention_pieces(name):
  ops = [n.op for n in _graph_def(name, "forward").node]
  assert ops.count("Softmax") == 2  # one per block
  assert ops.count("Erfc") + ops.count("Erf") == 2  # exact gelu per block
  assert "SparseSoftmaxCrossEntropyWithLogits" not in ops


def test_unknown_names_are_user_errors():
  with pytest.raises(TfsplitError, match="unknown example model"):
    models.build("gpt_jax")
  with pytest.raises(TfsplitError, match="unknown model size"):
    models.build("gpt_raw", size="huge")
  with pytest.raises(TfsplitError, match="unknown function kind"):
    _example("mlp_raw", "untrained").concrete("eval")


def test_batch_size_override():
  ex = models.build("mlp_raw", "tiny", batch_size=8)
  assert [s.shape[0] for s in ex.train_signature] == [8, 8]
  assert ex.forward(*ex.make_inputs("forward")).shape[0] == 8
