"""Every example graph survives load -> save -> load and computes the same thing."""
import numpy as np
import pytest
import tensorflow as tf

from tfsplit.graph import Graph, load_graph, save_graph
from tfsplit.graph.layers import BACKWARD, FORWARD, OPTIMIZER_LAYER, detect_layers
from tfsplit.graph.variables import find_variables
from tfsplit.runtime.graph_function import import_graph

import models  # examples/models (see conftest.py)

NAMES = ["mlp_raw", "gpt_raw", "mlp_keras3", "gpt_keras3", "mlp_tfkeras", "gpt_tfkeras"]
_CACHE = {}


def _example(name):
  if name not in _CACHE:
    _CACHE[name] = models.build(name, size="tiny", seed=0)
  return _CACHE[name]


def _load(ex, kind):
  return load_graph(ex.concrete(kind), variable_names=list(
      zip(ex.all_variables(), ex.variable_names())))


def _snapshot(variables):
  return [v.numpy().copy() for v in variables]


def _restore(variables, values):
  for v, x in zip(variables, values):
    v.assign(x)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", ["forward", "train"])
def test_round_trip_is_identical_and_exact(name, kind, tmp_path):
  ex = _example(name)
  graph_def = _load(ex, kind)
  path = tmp_path / "g.pb"
  save_graph(graph_def, path)
  reloaded = load_graph(str(path))
  assert reloaded == graph_def
  save_graph(reloaded, tmp_path / "g2.pb")
  assert path.read_bytes() == (tmp_path / "g2.pb").read_bytes()

  variables = ex.all_variables()
  start = _snapshot(variables)
  inputs = [tf.constant(x) for x in ex.make_inputs(kind, seed=3)]
  fn = ex.function(kind)
  steps = 3 if kind == "train" else 1
  expected = [np.asarray(fn(*inputs)) for _ in range(steps)]
  expected_vars = _snapshot(variables)

  _restore(variables, start)
  imported = import_graph(reloaded, dict(zip(ex.variable_names(), variables)))
  got = [imported(*inputs)[0].numpy() for _ in range(steps)]
  for e, g in zip(expected, got):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
  for e, v in zip(expected_vars, variables):
    np.testing.assert_allclose(v.numpy(), e, rtol=1e-5, atol=1e-6)
  _restore(variables, start)


@pytest.mark.parametrize("name", ["gpt_raw", "gpt_keras3", "gpt_tfkeras"])
def test_layer_detection_on_gpt(name):
  ex = _example(name)
  graph = Graph(_load(ex, "train"))
  variables = find_variables(graph)
  report = detect_layers(graph, variables=variables)
  names = [l.name for l in report.model_layers]
  # One layer per transformer block, in order, between embedding and head.
  blocks = [n for n in names if "block_" in n.split("/")[-1]]
  assert len(blocks) == ex.config.blocks, names
  for i, block in enumerate(blocks):
    assert block.split("/")[-1].startswith(f"block_{i}")
  assert names.index(blocks[0]) > 0 and names.index(blocks[-1]) < len(names) - 1

  # Every contraction, forward and gradient, belongs to a layer with weights.
  model_layers = set(names)
  for node in graph.nodes:
    if node.op in ("MatMul", "BatchMatMulV2", "Einsum"):
      assert report.role[node.name] in (FORWARD, BACKWARD), node.name
      assert report.layer_of[node.name] in model_layers, (node.name, report.layer_of[node.name])
      if report.role[node.name] == BACKWARD:
        assert node.name.startswith("gradient_tape/")

  # Every variable's update lands in that variable's layer; block variables
  # (and their Adam moments) in their own block.
  by_node = {v.node: v for v in variables}
  for node in graph.nodes:
    if not node.op.startswith(("Assign", "ResourceApply", "ResourceScatter")):
      continue
    var = by_node[node.input[0].split(":")[0]]
    layer = report.layer_of[node.name]
    if var.num_elements == 1 and var.trainable is False:
      continue  # step counter / learning rate: shared optimizer state
    assert layer == report.variable_layer[var.node], (node.name, var.name)
    assert layer != OPTIMIZER_LAYER
  for layer in report.model_layers:
    assert layer.slot_bytes == 2 * layer.param_bytes  # Adam: m and v per weight
    assert layer.forward_flops > 0 and layer.backward_flops > 0
    if "block_" in layer.name:
      # Backward of a dense block costs about twice its forward.
      assert 1.5 * layer.forward_flops < layer.backward_flops < 3 * layer.forward_flops
      assert layer.activation_bytes > 0
  params = sum(l.param_count for l in report.layers)
  assert params == sum(int(np.prod(v.shape)) for v in ex.variables)
