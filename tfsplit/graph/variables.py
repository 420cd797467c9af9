"""Variables of a graph: VarHandleOp nodes and captured resource placeholders.

A tf.function graph reads its variables through `Placeholder(dtype=resource)`
nodes (its captures), which carry neither the variable's name, nor its shape,
nor its dtype. When tfsplit loads a ConcreteFunction it records these on the
placeholder as private attrs (below), so the information survives a round
trip through a .pb file. For placeholders without them (a graph.pb written by
someone else) graph/recover.py recovers them when the file is loaded; failing
that, dtype and shape come from the ops that use the handle.
"""
import dataclasses
from typing import Optional, Tuple

from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import dtypes
from tensorflow.python.framework import tensor_shape

from tfsplit.graph.ir import element_count, input_node, without_gc

# Private attrs (leading underscore: TF ignores them when running the graph).
VAR_NAME_ATTR = "_tfsplit_var_name"
VAR_SHAPE_ATTR = "_tfsplit_var_shape"
VAR_DTYPE_ATTR = "_tfsplit_var_dtype"
VAR_TRAINABLE_ATTR = "_tfsplit_var_trainable"
INPUT_INDEX_ATTR = "_tfsplit_input_index"
OUTPUT_INDEX_ATTR = "_tfsplit_output_index"

# Ops that read or write a variable through its handle (input 0) and carry the
# variable's dtype in the attr named here.
_HANDLE_DTYPE_ATTR = {
    "ReadVariableOp": "dtype",
    "AssignVariableOp": "dtype",
    "AssignAddVariableOp": "dtype",
    "AssignSubVariableOp": "dtype",
    "ResourceGather": "dtype",
    "ResourceScatterAdd": "dtype",
    "ResourceScatterUpdate": "dtype",
}
# Ops whose input 1 has the full shape of the variable they write.
_FULL_VALUE_WRITERS = frozenset(
    ["AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"])


@dataclasses.dataclass
class VariableInfo:
  """One variable as the graph sees it."""
  node: str                 # the handle node (VarHandleOp or Placeholder)
  name: str                 # the user's variable name ('dense/kernel')
  dtype: Optional[int]      # DataType enum, None if unknown
  shape: Optional[Tuple[int, ...]]  # static shape, None if unknown
  kind: str                 # 'VarHandleOp' or 'captured'
  trainable: Optional[bool] = None

  @property
  def dtype_name(self):
    return dtypes.as_dtype(self.dtype).name if self.dtype else "unknown"

  @property
  def num_elements(self):
    return element_count(self.shape)

  @property
  def num_bytes(self):
    n = self.num_elements
    if n is None or not self.dtype:
      return None
    return n * dtypes.as_dtype(self.dtype).size


def is_variable_node(node):
  op = node.op  # read once: each read of a proto field makes a new string
  if op in ("VarHandleOp", "VariableV2", "Variable"):
    return True
  return op == "Placeholder" and node.attr["dtype"].type == types_pb2.DT_RESOURCE


def annotate_captured_variable(node, variable, name=None):
  """Records a tf.Variable's name, shape, dtype on its capture placeholder."""
  name = name or getattr(variable, "path", None) or variable.name
  if name.endswith(":0"):
    name = name[:-2]
  node.attr[VAR_NAME_ATTR].s = name.encode()
  node.attr[VAR_SHAPE_ATTR].shape.CopyFrom(variable.shape.as_proto())
  node.attr[VAR_DTYPE_ATTR].type = dtypes.as_dtype(variable.dtype).as_datatype_enum
  node.attr[VAR_TRAINABLE_ATTR].b = bool(getattr(variable, "trainable", True))


def _shape_tuple(shape_proto):
  """TensorShape(shape_proto).as_list() as a tuple (None: unknown rank),
  read from the proto directly (TensorShape costs more than the read)."""
  if shape_proto.unknown_rank:
    return None
  dims = [d.size for d in shape_proto.dim]
  if any(d < -1 for d in dims):
    tensor_shape.TensorShape(shape_proto)  # raises TF's error for the size
  return tuple(None if d == -1 else d for d in dims)


@without_gc
def find_variables(graph):
  """[VariableInfo] for every variable of `graph` (a tfsplit Graph), in node order.

  Shape and dtype come from the node's attrs (VarHandleOp, or tfsplit's
  annotation on a capture); failing that, dtype comes from the ops that use
  the handle. Shapes still unknown are filled in by shapes.infer_shapes.
  """
  found = []
  for node in graph.nodes:
    if not is_variable_node(node):
      continue
    if node.op == "VarHandleOp":
      name = node.attr["shared_name"].s.decode() or node.name
      info = VariableInfo(node.name, name, node.attr["dtype"].type,
                          _shape_tuple(node.attr["shape"].shape), "VarHandleOp")
    elif node.op in ("VariableV2", "Variable"):
      info = VariableInfo(node.name, node.name, node.attr["dtype"].type,
                          _shape_tuple(node.attr["shape"].shape), node.op)
    elif VAR_SHAPE_ATTR in node.attr:
      info = VariableInfo(node.name, node.attr[VAR_NAME_ATTR].s.decode(),
                          node.attr[VAR_DTYPE_ATTR].type,
                          _shape_tuple(node.attr[VAR_SHAPE_ATTR].shape),
                          "captured", node.attr[VAR_TRAINABLE_ATTR].b
                          if VAR_TRAINABLE_ATTR in node.attr else None)
    else:
      # No shape recorded (graph/recover.py found none): keep what it did find.
      attrs = node.attr
      info = VariableInfo(
          node.name,
          attrs[VAR_NAME_ATTR].s.decode() if VAR_NAME_ATTR in attrs else node.name,
          attrs[VAR_DTYPE_ATTR].type if VAR_DTYPE_ATTR in attrs
          else _dtype_from_users(graph, node),
          None, "captured",
          attrs[VAR_TRAINABLE_ATTR].b if VAR_TRAINABLE_ATTR in attrs else None)
    found.append(info)
  return found


def _dtype_from_users(graph, node):
  for consumer in graph.consumer_nodes(node.name):
    attr = _HANDLE_DTYPE_ATTR.get(consumer.op)
    if attr and consumer.input and input_node(consumer.input[0]) == node.name:
      return consumer.attr[attr].type
    if consumer.op.startswith("ResourceApply") and "T" in consumer.attr:
      return consumer.attr["T"].type
  return None


def shape_from_writers(graph, node_name, shapes):
  """The variable's shape as seen by the ops that assign it a full value."""
  for consumer in graph.consumer_nodes(node_name):
    if consumer.op in _FULL_VALUE_WRITERS and input_node(consumer.input[0]) == node_name:
      src = consumer.input[1]
      info = shapes.get(src)
      if info is not None and info.shape is not None:
        return info.shape
    if consumer.op.startswith("ResourceApply"):
      # ResourceApply*(var, accum..., lr..., grad): grad has the var's shape.
      for text in reversed(consumer.input):
        if text.startswith("^"):
          continue
        info = shapes.get(text)
        if info is not None and info.shape is not None and len(info.shape) > 0:
          return info.shape
        break
  return None


def make_shape_attr(shape):
  value = attr_value_pb2.AttrValue()
  value.shape.CopyFrom(tensor_shape.TensorShape(shape).as_proto())
  return value
