"""Floating-point operation counts of single ops, from static shapes.

Exact for the contractions that dominate a model (MatMul, BatchMatMul*,
Einsum, Conv2D); one op per output element for elementwise math; zero for ops
that only move or view data. The cost model turns these into time.
"""
from tfsplit.graph.ir import Graph

# Ops that do no arithmetic (views, copies, bookkeeping).
ZERO_FLOP_OPS = frozenset([
    "Const", "Placeholder", "PlaceholderWithDefault", "Identity", "IdentityN",
    "NoOp", "Reshape", "Squeeze", "ExpandDims", "Shape", "ShapeN", "Size",
    "Rank", "ReadVariableOp", "VarHandleOp", "AssignVariableOp", "StopGradient",
    "Transpose", "ConcatV2", "Pack", "Unpack", "Split", "SplitV", "Slice",
    "StridedSlice", "Gather", "GatherV2", "ResourceGather", "Tile", "Fill",
    "ZerosLike", "OnesLike", "BroadcastTo", "BroadcastGradientArgs", "Cast",
    "Range", "OneHot", "StridedSliceGrad", "Bitcast", "EnsureShape",
    "PreventGradient", "CheckNumerics", "Snapshot", "Pad", "PadV2",
    "UnsortedSegmentSum", "ScatterNd", "Where", "Select", "SelectV2"])
# Elementwise-like ops costing several flops per output element.
_PER_ELEMENT = {
    "Softmax": 5, "LogSoftmax": 5, "Erf": 8, "Tanh": 6, "Sigmoid": 4, "Exp": 4,
    "Log": 4, "Rsqrt": 2, "Sqrt": 2, "Pow": 4, "Gelu": 8,
    "SparseSoftmaxCrossEntropyWithLogits": 6, "SoftmaxCrossEntropyWithLogits": 6,
    "FusedBatchNormV3": 5, "FusedBatchNormGradV3": 8,
}


def _num(shape):
  n = 1
  for d in shape:
    n *= d
  return n


def _known(*infos):
  return all(i is not None and i.fully_defined for i in infos)


def _einsum_flops(equation, shapes):
  """2 * product of all index sizes (contraction), from the equation."""
  lhs = equation.replace(" ", "").split("->")[0]
  sizes = {}
  for term, shape in zip(lhs.split(","), shapes):
    if "..." in term:
      head, tail = term.split("...")
      n_ell = len(shape) - len(head) - len(tail)
      # Broadcast ellipsis dims align from the right.
      letters = list(head) + [f"#{n_ell - i}" for i in range(n_ell, 0, -1)] + list(tail)
    else:
      letters = list(term)
    for letter, dim in zip(letters, shape):
      sizes[letter] = max(sizes.get(letter, 1), dim)
  return 2 * _num(sizes.values())


def op_flops(node, shapes):
  """FLOPs of one NodeDef given a ShapeMap (0 when shapes are unknown)."""
  op = node.op
  if op in ZERO_FLOP_OPS:
    return 0
  inputs = [t for t in node.input if not t.startswith("^")]
  outs = shapes[node.name] if node.name in shapes else []
  out = outs[0] if outs else None
  if op == "MatMul" and len(inputs) >= 2:
    a = shapes.get(inputs[0])
    if not _known(a, out) or len(a.shape) != 2:
      return 0
    k = a.shape[0] if node.attr["transpose_a"].b else a.shape[1]
    return 2 * _num(out.shape) * k
  if op in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3") and len(inputs) >= 2:
    a = shapes.get(inputs[0])
    if not _known(a, out) or len(a.shape) < 2:
      return 0
    k = a.shape[-2] if node.attr["adj_x"].b else a.shape[-1]
    return 2 * _num(out.shape) * k
  if op == "Einsum":
    ins = [shapes.get(t) for t in inputs]
    if not _known(*ins):
      return 0
    equation = node.attr["equation"].s.decode()
    return _einsum_flops(equation, [i.shape for i in ins])
  if op in ("Conv2D", "Conv3D", "DepthwiseConv2dNative") and len(inputs) >= 2:
    w = shapes.get(inputs[1])
    if not _known(w, out):
      return 0
    window = _num(w.shape[:-1]) if op != "DepthwiseConv2dNative" else _num(w.shape[:-2])
    return 2 * _num(out.shape) * window
  if out is None or not _known(out):
    return 0
  if op in ("Sum", "Mean", "Max", "Min", "Prod", "AddN", "BiasAddGrad"):
    # One op per element read.
    total = 0
    for t in inputs[:1] if op != "AddN" else inputs:
      info = shapes.get(t)
      if _known(info):
        total += _num(info.shape)
    return total
  return _PER_ELEMENT.get(op, 1) * _num(out.shape)


def graph_flops(graph, shapes):
  """{node name: flops} for every node of a Graph or GraphDef."""
  if not isinstance(graph, Graph):
    graph = Graph(graph)
  return {node.name: op_flops(node, shapes) for node in graph.nodes}
