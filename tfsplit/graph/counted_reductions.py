"""`All` and `Any` written as counts, before the split, so they stay split.

A logical reduction over a split dimension has no partial form: its rule
gathers the whole input first. The finite check of a mixed-precision step
(`All(IsFinite(gradient))` per gradient, under a loss-scale optimizer) then
all-gathers a mask as large as every split gradient, as int32: at tp=2 a
causal LM's check moved more bytes than its activations' all-reduces.

As counts they are sums, which a split leaves partial and all-reduces once
reduced (a scalar per gradient):

    All(x, axes) == Equal(Sum(Cast(LogicalNot(x), float32), axes), 0)
    Any(x, axes) == Greater(Sum(Cast(x, float32), axes), 0)

Exact: the terms are 0 or 1, so a float32 sum of them is 0 exactly when
every term is 0 and at least 1 otherwise, however it rounds.
"""
import numpy as np
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.framework import graph_pb2
from tensorflow.core.framework import node_def_pb2
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import tensor_util

LOGICAL_REDUCTIONS = ("All", "Any")


def _node(name, op, inputs, device, **attrs):
  node = node_def_pb2.NodeDef(name=name, op=op, input=inputs, device=device)
  for key, value in attrs.items():
    node.attr[key].CopyFrom(value)
  return node


def _counted(node, taken):
  """The nodes computing `node` (an All or Any) as a count, its own name last."""
  def fresh(suffix):
    name, i = f"{node.name}/{suffix}", 0
    while name in taken:
      i += 1
      name = f"{node.name}/{suffix}_{i}"
    taken.add(name)
    return name

  data = [t for t in node.input if not t.startswith("^")]
  controls = [t for t in node.input if t.startswith("^")]
  device = node.device
  f32 = attr_value_pb2.AttrValue(type=types_pb2.DT_FLOAT)
  out = []
  terms = data[0]
  if node.op == "All":
    out.append(_node(fresh("negated"), "LogicalNot", [terms] + controls, device))
    terms, controls = out[-1].name, []
  out.append(_node(fresh("terms"), "Cast", [terms] + controls, device,
                   SrcT=attr_value_pb2.AttrValue(type=types_pb2.DT_BOOL), DstT=f32,
                   Truncate=attr_value_pb2.AttrValue(b=False)))
  out.append(_node(fresh("count"), "Sum", [out[-1].name, data[1]], device, T=f32,
                   Tidx=node.attr["Tidx"], keep_dims=node.attr["keep_dims"]))
  zero = _node(fresh("zero"), "Const", [], device, dtype=f32,
               value=attr_value_pb2.AttrValue(
                   tensor=tensor_util.make_tensor_proto(np.float32(0))))
  out.append(zero)
  out.append(_node(node.name, "Equal" if node.op == "All" else "Greater",
                   [out[-2].name, zero.name], device, T=f32))
  if node.op == "All":
    out[-1].attr["incompatible_shape_error"].b = True
  return out


def counted_logical_reductions(graph_def):
  """(GraphDef, number rewritten): every All / Any of `graph_def` as a count;
  `graph_def` itself when it has none."""
  found = [n for n in graph_def.node if n.op in LOGICAL_REDUCTIONS]
  if not found:
    return graph_def, 0
  taken = {n.name for n in graph_def.node}
  out = graph_pb2.GraphDef()
  out.versions.CopyFrom(graph_def.versions)
  out.library.CopyFrom(graph_def.library)
  for node in graph_def.node:
    out.node.extend(_counted(node, taken) if node.op in LOGICAL_REDUCTIONS else [node])
  return out, len(found)
