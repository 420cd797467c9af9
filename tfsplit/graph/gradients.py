"""Gradients TensorFlow writes in a form no split rule can keep split,
rewritten before the split into an equivalent form that can.

TopKV2's registered gradient flattens the whole input into one vector and
scatters into it: the top-k indices [..., k] become flat positions (each row's
indices plus row * n, a Range over every row of the batch), the incoming
gradient is reshaped to [-1], and one ScatterNd into [prod(input shape)] is
reshaped back. Every row is independent, but the flat positions are global
offsets computed from the global number of rows: a batch split cannot keep
the scatter split, so it is gathered whole (replicated), and under
micro-batches every micro-batch's backward then waits for every other one's
router (a mixture-of-experts decoder's top-k routing).

The same gradient row by row is

    d_input[..., j] = sum_i one_hot(indices, n)[..., i, j] * d_values[..., i]

(OneHot, ExpandDims, Mul, Sum over the k axis), made of ops whose rules keep
every leading dimension split. It is exact: top-k indices are distinct
within a row, so each output element is one incoming value or zero (and
ScatterNd, like the sum, adds duplicates).
"""
import numpy as np
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.framework import graph_pb2
from tensorflow.core.framework import node_def_pb2
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import dtypes
from tensorflow.python.framework import tensor_util

from tfsplit.graph.ir import Graph, parse_input

# Leaves the flat positions of a TopKV2 gradient may be computed from besides
# the indices themselves: shape metadata and constants.
_SHAPE_LEAVES = frozenset(["Const", "Shape", "Size", "Rank", "ShapeN"])


def rowwise_gradients(graph, shapes):
  """(GraphDef, number of gradients rewritten) of `graph` (a tfsplit Graph)
  with every flattened TopKV2 gradient written row by row; the GraphDef is
  `graph`'s own when nothing matched. `shapes`: infer_shapes of the graph."""
  found = []
  for node in graph.nodes:
    if node.op == "ScatterNd":
      match = _topk_gradient(graph, shapes, node)
      if match is not None:
        found.append(match)
  if not found:
    return graph.graph_def, 0
  # Each replaced Reshape's new nodes, its replacement last (same name).
  rowwise = {reshape.name: _rowwise_nodes(reshape, topk, values_grad, shapes)
             for _, topk, values_grad, reshapes in found for reshape in reshapes}
  out = graph_pb2.GraphDef()
  out.versions.CopyFrom(graph.graph_def.versions)
  out.library.CopyFrom(graph.graph_def.library)
  for node in graph.graph_def.node:
    out.node.extend(rowwise.get(node.name, [node]))  # new inputs before their reader
  new = Graph(out)
  new.remove_nodes(_dead_ancestors(new, [scatter.name for scatter, _, _, _ in found]))
  return new.graph_def, len(found)


def _topk_gradient(graph, shapes, scatter):
  """(scatter, TopKV2 node, values-gradient tensor, [Reshape nodes back to
  the input's shape]) if `scatter` is the flat scatter of a TopKV2 gradient."""
  indices_src = parse_input(scatter.input[0])[0]
  updates = graph.get(parse_input(scatter.input[1])[0])
  if updates is None or updates.op != "Reshape":
    return None
  topks = set()
  stack, seen = [(indices_src, 0)], set()
  while stack:
    name, port = stack.pop()
    node = graph.get(name)
    if node is None:
      return None
    if node.op == "TopKV2":
      if port != 1:
        return None  # the positions read the top-k values, not indices
      topks.add(name)
      continue
    if name in seen or node.op in _SHAPE_LEAVES:
      continue
    seen.add(name)
    inputs = graph.data_inputs(name)
    if not inputs:
      return None  # the positions read something other than shapes
    stack.extend(inputs)
  if len(topks) != 1:
    return None
  topk = graph.node(topks.pop())
  values_grad = updates.input[0]
  grad_info = _info(shapes, values_grad)
  value_info = _info(shapes, f"{topk.name}:0")
  input_info = _info(shapes, topk.input[0])
  if None in (grad_info, value_info, input_info) or not input_info.fully_defined or \
      grad_info.shape != value_info.shape or grad_info.dtype != input_info.dtype:
    return None
  reshapes = [graph.node(c) for c, _ in graph.consumers(scatter.name)]
  if not reshapes or any(r.op != "Reshape" or _info(shapes, r.name) is None or
                         _info(shapes, r.name).shape != input_info.shape for r in reshapes):
    return None
  return scatter, topk, values_grad, reshapes


def _info(shapes, tensor):
  return shapes.get(tensor)


def _rowwise_nodes(reshape, topk, values_grad, shapes):
  """NodeDefs computing `reshape`'s value row by row; the last one takes
  `reshape`'s name (its consumers are unchanged)."""
  info = _info(shapes, topk.input[0])
  dtype, depth = info.dtype, info.shape[-1]
  index_type = topk.attr["index_type"].type if "index_type" in topk.attr else types_pb2.DT_INT32
  base, device = f"{reshape.name}/rowwise", reshape.device
  nodes = []

  def add(name, op, inputs, **attrs):
    node = node_def_pb2.NodeDef(name=name, op=op, input=inputs, device=device)
    for key, value in attrs.items():
      node.attr[key].CopyFrom(value)
    nodes.append(node)
    return name

  def const(name, value, dt):
    return add(name, "Const", [], dtype=attr_value_pb2.AttrValue(type=dt),
               value=attr_value_pb2.AttrValue(tensor=tensor_util.make_tensor_proto(
                   np.asarray(value, dtype=dtypes.as_dtype(dt).as_numpy_dtype))))

  t = attr_value_pb2.AttrValue(type=dtype)
  i32 = attr_value_pb2.AttrValue(type=types_pb2.DT_INT32)
  one_hot = add(f"{base}/one_hot", "OneHot",
                [f"{topk.name}:1", const(f"{base}/depth", depth, types_pb2.DT_INT32),
                 const(f"{base}/on", 1, dtype), const(f"{base}/off", 0, dtype)],
                T=t, TI=attr_value_pb2.AttrValue(type=index_type),
                axis=attr_value_pb2.AttrValue(i=-1))
  expanded = add(f"{base}/expand", "ExpandDims",
                 [values_grad, const(f"{base}/expand/dim", -1, types_pb2.DT_INT32)],
                 T=t, Tdim=i32)
  product = add(f"{base}/mul", "Mul", [one_hot, expanded], T=t)
  add(reshape.name, "Sum", [product, const(f"{base}/k_axis", -2, types_pb2.DT_INT32)],
      T=t, Tidx=i32, keep_dims=attr_value_pb2.AttrValue(b=False))
  nodes[-1].input.extend(i for i in reshape.input if i.startswith("^"))
  return nodes


def _dead_ancestors(graph, roots):
  """`roots` and what only they read, transitively (nodes that no kept node
  reads); TopKV2 and anything stateful stay."""
  dead, stack = set(), list(roots)
  while stack:
    name = stack.pop()
    if name in dead or name not in graph:
      continue
    if any(c not in dead for c, _ in graph.consumers(name)):
      continue
    node = graph.node(name)
    if name not in roots and node.op in ("TopKV2", "Placeholder", "ReadVariableOp"):
      continue
    dead.add(name)
    stack.extend(parse_input(i)[0] for i in node.input)
  return dead
