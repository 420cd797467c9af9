"""What one op of a GraphDef does, whatever machine runs it: a NodeCost per
node with its FLOPs (tfsplit.graph.flops: exact for MatMul, BatchMatMul,
Einsum and convolutions, per element for elementwise math), the bytes it
reads and writes (from the ShapeMap; views such as Reshape or ReadVariableOp
move nothing) and, for collectives and _Send/_Recv, the kind of
communication, its bytes and its group size; with the op's form (op_form)
and the signature a calibration table keys a measured time by. It counts and
never prices, so the cost model (op_cost), the measured table (cost_table),
calibration and the graph simulation share one reading of each node."""
import dataclasses

from tfsplit.cost import collectives
from tfsplit.graph.flops import op_flops

# Ops whose outputs alias an input buffer (or a variable): no bytes move and
# nothing is allocated.
VIEW_OPS = frozenset([
    "Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
    "ReadVariableOp", "EnsureShape", "PreventGradient", "CheckNumerics",
    "Bitcast", "Snapshot"])
# Ops that produce no tensor work at run time (their outputs are static or
# bookkeeping): only the per-op overhead is charged.
METADATA_OPS = frozenset([
    "Const", "Placeholder", "PlaceholderWithDefault", "VarHandleOp", "NoOp",
    "Shape", "ShapeN", "Size", "Rank", "BroadcastGradientArgs", "_Arg",
    "_Retval"])
# Ops whose output may take over an input's buffer when that input has no
# other reader (TF's forward_input_or_allocate_output): cwise math, BiasAdd,
# Relu and friends, AddN.
FORWARDING_OPS = frozenset([
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum",
    "Minimum", "SquaredDifference", "Pow", "Neg", "Square", "Sqrt", "Rsqrt",
    "Exp", "Log", "Log1p", "Tanh", "Sigmoid", "Erf", "Erfc", "Abs", "Sign",
    "Reciprocal", "Relu", "Relu6", "Elu", "Selu", "Gelu", "ReluGrad",
    "TanhGrad", "SigmoidGrad", "RsqrtGrad", "SqrtGrad", "BiasAdd", "AddN",
    "Softmax", "LogSoftmax", "SelectV2", "Select", "ZerosLike", "OnesLike",
    "FloorMod", "FloorDiv", "Floor", "Ceil", "Round", "Cos", "Sin"])
# Attrs that change an op's work for the same shapes; part of the signature.
_SIGNATURE_ATTRS = ("transpose_a", "transpose_b", "adj_x", "adj_y", "equation",
                    "data_format", "strides", "padding", "axis", "perm")


@dataclasses.dataclass(frozen=True)
class NodeCost:
  """What one node does: arithmetic, memory traffic, communication."""
  name: str
  op: str
  flops: int = 0
  bytes_read: int = 0
  bytes_written: int = 0
  dtype: str = "float32"
  comm: str = None          # a value of collectives.OP_COLLECTIVE, or None
  comm_bytes: int = 0
  group_size: int = 1
  form: str = ""            # see op_form: '' or the form its line is fitted for

  @property
  def bytes_moved(self):
    return self.bytes_read + self.bytes_written

  @property
  def line(self):
    """The key of its fitted line in a CostTable: 'op' or 'op:form'."""
    return f"{self.op}:{self.form}" if self.form else self.op


def _tensor_bytes(shapes, text):
  info = shapes.get(text)
  if info is None:
    return 0
  return info.num_bytes or 0


def _out_bytes(shapes, name):
  if name not in shapes:
    return 0
  return sum(i.num_bytes or 0 for i in shapes[name])


def _dtype_name(node, shapes):
  for key in ("T", "dtype"):
    if key in node.attr and node.attr[key].type:
      from tensorflow.python.framework import dtypes  # pylint: disable=import-outside-toplevel
      return dtypes.as_dtype(node.attr[key].type).name
  outs = shapes[node.name] if node.name in shapes else []
  for info in outs:
    if info.dtype:
      return info.dtype_name
  return "float32"


def _itemsize(dtype):
  return {"float64": 8, "int64": 8, "complex64": 8, "float16": 2,
          "bfloat16": 2, "int16": 2, "int8": 1, "uint8": 1,
          "bool": 1}.get(dtype, 4)


def const_int(graph, text):
  """The integer value of a scalar Const feeding `text`, or None."""
  if graph is None:
    return None
  node = graph.get(text.lstrip("^").split(":")[0])
  while node is not None and node.op == "Identity" and node.input:
    node = graph.get(node.input[0].split(":")[0])
  if node is None or node.op != "Const":
    return None
  tensor = node.attr["value"].tensor
  if tensor.int_val:
    return int(tensor.int_val[0])
  if tensor.int64_val:
    return int(tensor.int64_val[0])
  if tensor.tensor_content:
    import numpy as np  # pylint: disable=import-outside-toplevel
    dtype = np.int64 if tensor.dtype == 9 else np.int32
    values = np.frombuffer(tensor.tensor_content, dtype=dtype)
    return int(values[0]) if values.size else None
  return None


def group_size(node, graph=None):
  """Members of a collective: its group_size attr (V1) or input 1 (V2+)."""
  if "group_size" in node.attr:
    return max(1, node.attr["group_size"].i)
  data = [t for t in node.input if not t.startswith("^")]
  if len(data) > 1:
    value = const_int(graph, data[1])
    if value:
      return value
  return 1


def _einsum_form(equation):
  """'dense' for an einsum with no batch label (one in both inputs and the
  output): TF runs it as reshapes and one MatMul, as a dense layer over
  heads is written. A batched einsum (attention's) transposes its inputs to
  a batched matmul: a large fixed time per call."""
  inputs, _, output = equation.replace(" ", "").partition("->")
  parts = inputs.split(",")
  if len(parts) != 2 or not output:
    return ""
  batch = set(parts[0]) & set(parts[1]) & set(output)
  return "" if batch - {"."} or "..." in output else "dense"


def op_form(node, shapes, data):
  """The form of an op type whose cost per call differs by more than its
  sizes: an einsum without batch labels ('dense'), a batched matmul of a
  matrix by a batch of them ('broadcast': one MatMul over the rows, as
  Keras' Dense on a sequence writes it), a transpose of more than two
  dimensions ('nd': attention's head split and merge; Eigen's generic
  shuffle costs several times a matrix transpose); '' otherwise. data: the node's data inputs."""
  if node.op == "Einsum" and "equation" in node.attr:
    return _einsum_form(node.attr["equation"].s.decode(errors="replace"))
  if node.op == "Transpose":
    info = shapes.get(data[0]) if data else None
    if info is not None and info.shape is not None and len(info.shape) > 2:
      return "nd"
  if node.op in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
    for t in data[:2]:
      info = shapes.get(t)
      if info is not None and info.shape is not None and len(info.shape) == 2:
        return "broadcast"
  return ""


def node_cost(node, shapes, graph=None):
  """NodeCost of one NodeDef; `graph` (a tfsplit Graph) resolves group sizes."""
  op = node.op
  data = [t for t in node.input if not t.startswith("^")]
  written = _out_bytes(shapes, node.name)
  dtype = _dtype_name(node, shapes)
  kind = collectives.OP_COLLECTIVE.get(op)
  if kind is not None:
    if op in ("_Recv", "_HostRecv"):
      nbytes = written
    elif kind in ("all_gather",):
      nbytes = written
    else:
      nbytes = _tensor_bytes(shapes, data[0]) if data else 0
    size = 2 if kind == "send_recv" else group_size(node, graph)
    return NodeCost(node.name, op, 0, nbytes if data else 0, written, dtype,
                    kind, nbytes, size)
  if op in VIEW_OPS or op in METADATA_OPS:
    return NodeCost(node.name, op, 0, 0, 0, dtype)
  flops = op_flops(node, shapes)
  if op.startswith(("ResourceApply", "ResourceSparseApply")):
    # Reads every state tensor and the gradient, writes the state back.
    grad = _tensor_bytes(shapes, data[-1]) if data else 0
    states = sum(1 for t in data if (shapes.get(t) is not None and
                                     shapes.get(t).dtype == 20))  # DT_RESOURCE
    elements = grad // _itemsize(dtype)
    return NodeCost(node.name, op, 5 * max(states, 1) * elements,
                    (states + 1) * grad, states * grad, dtype)
  if op in ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"):
    value = _tensor_bytes(shapes, data[1]) if len(data) > 1 else 0
    reads = value if op == "AssignVariableOp" else 2 * value
    adds = 0 if op == "AssignVariableOp" else value // _itemsize(dtype)
    return NodeCost(node.name, op, adds, reads, value, dtype)
  read = 0
  for t in data:
    info = shapes.get(t)
    if info is not None and info.dtype != 20:
      read += info.num_bytes or 0
  if op in ("ResourceGather", "Gather", "GatherV2"):
    # Only the gathered rows are read, not the whole table.
    read = written + (_tensor_bytes(shapes, data[1]) if len(data) > 1 else 0)
  return NodeCost(node.name, op, flops, read, written, dtype,
                  form=op_form(node, shapes, data))


def _shape_text(info):
  if info is None or info.shape is None:
    return "?"
  return "[" + ",".join("?" if d is None else str(d) for d in info.shape) + "]"


def signature(node, shapes):
  """'op|dtype|input shapes|output shapes|attrs': the key of a measured cost.

  Two nodes with the same signature do the same work, so one measurement
  serves both (the layers of a model repeat their signatures).
  """
  ins = []
  for t in node.input:
    if t.startswith("^"):
      continue
    info = shapes.get(t)
    ins.append(_shape_text(info))
  outs = [_shape_text(i) for i in (shapes[node.name] if node.name in shapes
                                   else [])]
  attrs = []
  for key in _SIGNATURE_ATTRS:
    if key in node.attr:
      value = node.attr[key]
      which = value.WhichOneof("value")
      if which == "b":
        attrs.append(f"{key}={int(value.b)}")
      elif which == "s":
        attrs.append(f"{key}={value.s.decode(errors='replace')}")
      elif which == "i":
        attrs.append(f"{key}={value.i}")
      elif which == "list":
        attrs.append(f"{key}={list(value.list.i)}")
  dtype = _dtype_name(node, shapes)
  return "|".join([node.op, dtype, ",".join(ins), ",".join(outs),
                   ",".join(attrs)])
