"""Folding of static shape arithmetic and IdentityN expansion (graph/fold.py),
built in one pass: what each node becomes, and the shapes carried over."""
import tensorflow as tf

from tfsplit.graph import Graph, variables as variables_lib
from tfsplit.graph.fold import expand_identity_n, fold_and_expand, fold_static_shapes
from tfsplit.graph.shapes import infer_shapes


def _graph_def():
  """x -> ShapeN (one output read, one waited on), a Sum over empty axes,
  an IdentityN read at its second output, a Const marked as an output."""
  g = tf.Graph()
  with g.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
    shapes = tf.raw_ops.ShapeN(input=[x, tf.transpose(x, name="xt")], name="shapes")
    flat = tf.reshape(x, shapes[1], name="flat")
    with tf.control_dependencies([shapes[0].op]):
      after = tf.identity(flat, name="after")
    axes = tf.constant([], tf.int32, name="axes")
    total = tf.raw_ops.Sum(input=after, axis=axes, name="total")
    both = tf.raw_ops.IdentityN(input=[x, total], name="both")
    tf.identity(both[1], name="loss")
    tf.constant(1.0, name="marked")
  graph_def = g.as_graph_def()
  for node in graph_def.node:
    if node.name in ("loss", "marked"):
      node.attr[variables_lib.OUTPUT_INDEX_ATTR].i = 0 if node.name == "loss" else 1
  return graph_def


def _nodes(graph_def):
  return {n.name: n for n in graph_def.node}


def test_fold_and_expand():
  graph_def = _graph_def()
  graph = Graph(graph_def)
  out, known = fold_and_expand(graph, infer_shapes(graph))
  nodes = _nodes(out)
  # The ShapeN: one Const per output; its readers read them directly.
  assert nodes["shapes/folded_0"].op == nodes["shapes/folded_1"].op == "Const"
  assert list(nodes["flat"].input) == ["x", "shapes/folded_1"]
  # Waited on: its IdentityN kept, expanded like every IdentityN.
  assert nodes["shapes"].op == "NoOp"
  assert list(nodes["shapes"].input) == ["^shapes/output_0", "^shapes/output_1"]
  assert list(nodes["shapes/output_1"].input) == ["shapes/folded_1"]
  assert list(nodes["after"].input) == ["flat", "^shapes"]
  # A Sum over no axes is a copy; its axes, read by nothing now, are dropped.
  assert nodes["total"].op == "Identity" and list(nodes["total"].input) == ["after"]
  assert "axes" not in nodes and "marked" in nodes
  # The IdentityN: one Identity per output, read in place of `both:1`.
  assert list(nodes["both/output_1"].input) == ["total"]
  assert list(nodes["loss"].input) == ["both/output_1"]
  assert nodes["both"].op == "NoOp"
  assert "IdentityN" not in {n.op for n in out.node}
  assert [n.name for n in out.node] == [
      "x", "xt/perm", "xt", "shapes/folded_0", "shapes/folded_1", "shapes/output_0",
      "shapes/output_1", "shapes", "flat", "after", "total", "both/output_0",
      "both/output_1", "both", "loss", "marked"]
  assert known["shapes/output_1"][0].shape == (2,)
  assert known["both/output_1"][0].shape == (3, 2)  # x reshaped as its transpose
  assert known["shapes"] == []
  Graph(out).topological_order()  # nothing dangles


def test_fold_alone_and_expand_alone():
  graph_def = _graph_def()
  graph = Graph(graph_def)
  folded = _nodes(fold_static_shapes(graph_def, infer_shapes(graph)))
  assert folded["shapes"].op == "IdentityN"
  assert list(folded["shapes"].input) == ["shapes/folded_0", "shapes/folded_1"]
  assert folded["both"].op == "IdentityN" and list(folded["loss"].input) == ["both:1"]
  assert folded["total"].op == "Identity" and "axes" not in folded
  expanded = _nodes(expand_identity_n(graph_def))
  assert expanded["shapes"].op == "ShapeN" and expanded["total"].op == "Sum"
  assert "axes" in expanded and list(expanded["loss"].input) == ["both/output_1"]
