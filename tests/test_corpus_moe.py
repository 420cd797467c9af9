"""Mixture-of-experts decoders of the corpus (examples/models/corpus.py):
`moe` (Mixtral-style: top-2 of 4 experts, every expert computing every token,
one-hot routing weights) and `switch` (top-2 with a capacity per expert,
GShard dispatch and combine einsums), both with a router balance loss, in
Keras 3 and tf_keras. Each trains exactly (3 steps: the loss, every copy of
every parameter and optimizer slot, every update) under data, tensor and
pipeline splits with micro-batches, and the top-k routing stays split (no
op that depends on a weight is replicated for want of a rule; tf_keras's
sparse Adam deduplicates token ids with Unique, which has no rule and reads
only the inputs).
"""
import numpy as np
import pytest
import tensorflow as tf

from tfsplit.graph import load_graph
from tfsplit.graph.gradients import rowwise_gradients
from tfsplit.graph.ir import Graph
from tfsplit.graph.layers import detect_layers
from tfsplit.graph.shapes import infer_shapes
from tfsplit.passes import split_graph
from tfsplit.runtime.split_function import make_mesh

from _util import check_training, example, names

BATCH = 16
MODELS = ("moe_keras3", "moe_tfkeras", "switch_keras3", "switch_tfkeras")
MESHES = (("dp=2", 2), ("dp=2,tp=2", 2), ("pp=2", 4), ("tp=2", 1))
# Run in CI: each family, flavor and mesh once; the rest is slow.
_CI = {("moe_keras3", "dp=2"), ("switch_tfkeras", "dp=2,tp=2"), ("moe_tfkeras", "pp=2"),
       ("switch_keras3", "tp=2")}
CASES = [pytest.param(name, mesh, m, id=f"{name}-{mesh}-m{m}",
                      marks=() if (name, mesh) in _CI else pytest.mark.slow)
         for name in MODELS for mesh, m in MESHES]


@pytest.mark.parametrize("name,mesh,m", CASES)
def test_moe_trains_exactly(name, mesh, m):
  step = check_training(example(name, batch_size=BATCH), seed=5, mesh=mesh, microbatches=m)
  free = detect_layers(_train_graph(name)).variable_free
  replicated = [f for f in step.result.fallbacks if f.node not in free]
  assert not replicated, replicated
  if "pp" in mesh:
    assert len(step.result.partition) == 2


def _train_graph(name):
  ex = example(name, batch_size=BATCH)
  return load_graph(ex.concrete("train"), variable_names=names(ex))


@pytest.mark.parametrize("name", ["moe_keras3", "switch_tfkeras"])
def test_blocks_router_and_stacked_experts(name):
  """Layer detection finds the 4 blocks, each owning its router and its
  three [experts, ...] matrices."""
  ex = example(name, batch_size=BATCH)
  cfg = ex.config
  report = detect_layers(_train_graph(name))
  blocks = [l for l in report.model_layers if l.block]
  assert len(blocks) == cfg.blocks, [l.name for l in report.model_layers]
  stacked = [p for p, v in zip(ex.variable_paths, ex.variables)
             if v.shape.rank == 3 and v.shape[0] == cfg.experts]
  assert len(stacked) == 3 * cfg.blocks, stacked


def test_topk_gradient_is_written_row_by_row():
  """TopKV2's gradient (a flat ScatterNd over the whole batch) becomes
  OneHot x gradient summed over k: no ScatterNd is left, nothing else
  changes, and the rewritten step computes the same loss and update."""
  graph_def = _train_graph("moe_keras3")
  graph = Graph(graph_def)
  scatters = [n.name for n in graph.nodes if n.op == "ScatterNd"]
  topks = [n.name for n in graph.nodes if n.op == "TopKV2"]
  assert len(scatters) == len(topks) == example("moe_keras3").config.blocks
  out, count = rowwise_gradients(graph, infer_shapes(graph))
  assert count == len(topks)
  ops = [n.op for n in out.node]
  assert "ScatterNd" not in ops and ops.count("TopKV2") == len(topks)
  # Outside the rewritten gradients every node is kept as it was.
  before = {n.name: n for n in graph_def.node}
  kept = [n for n in out.node if "/rowwise/" not in n.name and n.op != "Sum"]
  assert all(before[n.name] == n for n in kept)
  Graph(out).topological_order()
  # A split without the rewrite would replicate the scatter; with it, a
  # dp=2 split has no fallback at all.
  free = detect_layers(graph_def).variable_free
  assert not [f for f in split_graph(graph_def, make_mesh("dp=2")).fallbacks
              if f.node not in free]


def test_topk_gradient_rewrite_matches_tensorflow():
  """The row-wise form gives TensorFlow's own TopKV2 gradient, bit for bit,
  on a batch with ties and k = n."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal([3, 5, 6]).astype(np.float32)
  x[0, 0, :3] = 1.0  # ties
  dy = rng.standard_normal([3, 5, 6]).astype(np.float32)
  for k in (2, 6):
    @tf.function(input_signature=[tf.TensorSpec(x.shape, tf.float32)] * 2, autograph=False)
    def grad(x_, dy_):
      with tf.GradientTape() as tape:
        tape.watch(x_)
        values = tf.math.top_k(x_, k=k).values
      return tape.gradient(values, x_, output_gradients=dy_[..., :k])

    cf = grad.get_concrete_function()
    graph_def = cf.graph.as_graph_def()
    graph = Graph(graph_def)
    out, count = rowwise_gradients(graph, infer_shapes(graph))
    assert count == 1
    want = grad(x, dy).numpy()
    fetch = cf.outputs[0].name
    feeds = [t.name for t in cf.inputs]
    with tf.Graph().as_default():
      tf.graph_util.import_graph_def(out, name="")
      with tf.compat.v1.Session() as sess:
        got = sess.run(fetch, dict(zip(feeds, [x, dy])))
    np.testing.assert_array_equal(got, want)
    assert np.count_nonzero(want) == 3 * 5 * k
