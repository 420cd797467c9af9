"""What TensorFlow's gradient code left of static shapes, and the copy of
the graph that shape inference runs on during recovery. Gradient code folds
the static shapes it needs into constants (`gradient_tape/<scope>/Shape`, a
gather's dense shape, a `Shape` colocated with a read) and computes more from
them with integer arithmetic that Grappler does not evaluate; this module
finds those constants (hints for forward tensors, shapes of variables),
reads the shapes a graph written with `add_shapes=True` recorded, folds the
arithmetic once, and builds the inference copy (updates as NoOps, hints as
EnsureShape), so that the fixpoint only has to ask for shapes.
"""
import collections
import re

from absl import logging
from tensorflow.core.framework import graph_pb2
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import tensor_shape
from tensorflow.python.framework import tensor_util

from tfsplit.graph.ir import Graph, parse_input
from tfsplit.graph.recover_structure import FULL_VALUE_WRITERS, GRADIENT_PREFIX, output_dtype

_SHAPE_CONST = re.compile(r"^(?:gradient_tape|gradients(?:_\d+)?)/(.+)/Shape(?:_(\d+))?$")


# Ops whose gradient takes the static shapes of its inputs in input order
# (`Shape` of input 0, `Shape_1` of input 1, for its broadcasting reductions),
# so a `Shape_<k>` Const in its gradient's scope is input k's static shape.
_ORDERED_SHAPE_GRADIENTS = frozenset([
    "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Add", "AddV2", "Sub", "Mul",
    "RealDiv", "Div", "DivNoNan", "MulNoNan", "Maximum", "Minimum", "SquaredDifference",
    "Pow", "Xdivy", "Xlogy", "Xlog1py", "TruncateDiv", "FloorDiv", "FloorMod"])
# Ops whose gradient makes no shape constant of its own.
_NO_SHAPE_GRADIENT = frozenset([
    "ReadVariableOp", "Const", "Identity", "IdentityN", "Cast", "Placeholder", "NoOp",
    "Shape", "ShapeN", "Size", "Rank", "StopGradient", "Snapshot", "PreventGradient"])


def shape_constant_targets(graph):
  """[(forward op, input index, shape, ordered)] of gradient code's Shape constants.

  TF's gradient code folds the static shape of a forward tensor it needs
  into a Const `gradient_tape/<scope>/Shape` (`Shape_1`, ...), where <scope>
  is the name scope the forward op was made in (tf.gradients:
  `gradients/<op>_grad/Shape`), often dead (the shapes of a broadcasting
  op's operands when nothing broadcasts). The op is the one named <scope>
  (tf.matmul names its op after its own scope: `.../MatMul/Shape_1`), or
  else the only op directly in <scope> whose
  gradient makes shape constants, when that op is one whose gradient takes
  its inputs' shapes in input order (`.../einsum_2/Shape_1` of
  `.../einsum_2/Einsum`, the second operand: often a variable's read).
  `ordered`: the op is one of those (the constant is surely input k's).
  """
  children = None
  out = []
  for node in graph.nodes:
    if node.op != "Const":
      continue
    m = _SHAPE_CONST.match(node.name)
    if not m:
      continue
    index = int(m.group(2) or 0)
    if index > 1:
      continue
    shape = _int_vector(node)
    if shape is None:
      continue
    scope = m.group(1)
    forward = graph.get(scope)
    if forward is None and scope.endswith("_grad"):
      forward = graph.get(scope[:-len("_grad")])  # tf.gradients: '<op>_grad/Shape'
    if forward is None:
      if children is None:
        children = collections.defaultdict(list)
        for other in graph.nodes:
          parent, sep, _ = other.name.rpartition("/")
          if sep and other.op not in _NO_SHAPE_GRADIENT and \
              not GRADIENT_PREFIX.match(other.name):
            children[parent].append(other)
      found = children.get(scope, ())
      if len(found) != 1 or found[0].op not in _ORDERED_SHAPE_GRADIENTS:
        continue
      forward = found[0]
    data = [t for t in forward.input if not t.startswith("^")]
    if index < len(data):
      out.append((forward, data[index], shape, forward.op in _ORDERED_SHAPE_GRADIENTS))
  return out


def gradient_shape_constants(graph, targets=None):
  """{forward tensor: shape} from gradient code's folded Shape constants."""
  found = {}
  for _, text, shape, _ in (shape_constant_targets(graph) if targets is None else targets):
    src, port = parse_input(text)
    key = f"{src}:{port}"
    if key in found and found[key] != shape:
      found[key] = None  # two constants disagree: use neither
    else:
      found[key] = shape
  return {k: v for k, v in found.items() if v is not None}


def _int_vector(node):
  """The value of an int32/int64 1-D Const node with no negative entry, or None."""
  if node.op != "Const":
    return None
  tensor = node.attr["value"].tensor
  if tensor.dtype not in (types_pb2.DT_INT32, types_pb2.DT_INT64):
    return None
  try:
    value = tensor_util.MakeNdarray(tensor)
  except (TypeError, ValueError):
    return None
  if value.ndim != 1 or (value < 0).any():
    return None
  return tuple(int(d) for d in value)


def variable_shape_constants(graph, st, targets=None):
  """{handle: shape} from constants TF's gradient code made of a variable's shape.

  - ResourceGather's gradient folds the variable's static shape into
    `gradient_tape/<gather>/Const` (the params shape of its IndexedSlices);
  - GatherV2's (and others') gradient computes `Shape` of the read it
    differentiates colocated with it: a Const with `_class: loc:@<read>`;
  - an op whose gradient takes its operands' shapes in order (Einsum,
    BatchMatMul, broadcasting arithmetic: `shape_constant_targets`) leaves
    the shape of an operand that is a variable's read (an expert weight in
    `einsum('becd,edf->becf', x, w)`, whose `f` nothing else in the graph
    fixes).
  Constants that disagree about one variable give it none.
  """
  found = collections.defaultdict(list)
  reads = {}
  for handle, nodes in st.reads.items():
    for read in nodes:
      reads[read.name] = handle
  for node in graph.nodes:
    value = _int_vector(node)
    if value is None:
      continue
    m = _SHAPE_CONST.match(node.name) or re.match(
        r"^(?:gradient_tape|gradients(?:_\d+)?)/(.+)/Const$", node.name)
    if m and m.group(1) in reads and graph.node(m.group(1)).op == "ResourceGather":
      found[reads[m.group(1)]].append(value)
    for loc in node.attr["_class"].list.s if "_class" in node.attr else ():
      target = loc.decode().partition("loc:@")[2]
      if target in reads and graph.node(target).op == "ReadVariableOp" and \
          node.name.rsplit("/", 1)[-1].startswith("Shape"):
        found[reads[target]].append(value)
  for _, text, shape, ordered in (shape_constant_targets(graph) if targets is None else targets):
    src, port = parse_input(text)
    if ordered and port == 0 and src in reads and graph.node(src).op == "ReadVariableOp":
      found[reads[src]].append(shape)
  return {h: shapes[0] for h, shapes in found.items() if len(set(shapes)) == 1}


def recorded_shapes(st):
  """{handle: shape} from its reads' `_output_shapes` (a graph written with
  `as_graph_def(add_shapes=True)` records each op's static output shapes: a
  ReadVariableOp's is its variable's), where they are full and agree."""
  found = {}
  for handle, reads in st.reads.items():
    shapes = set()
    for read in reads:
      if read.op == "ReadVariableOp" and "_output_shapes" in read.attr and \
          len(read.attr["_output_shapes"].list.shape) == 1:
        shape = tensor_shape.TensorShape(read.attr["_output_shapes"].list.shape[0])
        if shape.is_fully_defined():
          shapes.add(tuple(shape.as_list()))
    if len(shapes) == 1:
      found[handle] = shapes.pop()
  return found


def _is_writer(node):
  return node.op in FULL_VALUE_WRITERS or node.op.startswith(
      ("ResourceApply", "ResourceSparseApply", "ResourceScatter"))


def inference_graph(graph, hints, folded):
  """(Graph, {tensor: hint node}): `graph` for inference, copied.

  Variable updates become NoOps (same inputs, as control edges): Grappler
  unifies an assigned value's shape with the variable's, which would make
  the value of an update agree with whatever shape is conjectured for its
  variable. Hinted tensors pass through EnsureShape; folded shape
  arithmetic becomes constants.
  """
  graph_def = graph_pb2.GraphDef()
  graph_def.versions.CopyFrom(graph.versions)
  graph_def.library.CopyFrom(graph.library)
  names = set(graph.node_names())
  hint_nodes, by_tensor = {}, {}
  for tensor, shape in hints.items():
    src, port = parse_input(tensor)
    dtype = output_dtype(graph, src, port)
    if dtype is None:
      continue
    name = f"{src}/_tfsplit_shape_hint_{port}"
    while name in names:
      name += "_"
    names.add(name)
    hint_nodes[tensor] = name
    by_tensor[(src, port)] = name
  for original in graph.nodes:
    node = graph_def.node.add()
    if _is_writer(original):
      node.name, node.op = original.name, "NoOp"
      for src in dict.fromkeys(parse_input(t)[0] for t in original.input):
        node.input.append("^" + src)
      continue
    if original.name in folded:
      node.name, node.op = original.name, "Const"
      node.attr["dtype"].type = folded[original.name].dtype
      node.attr["value"].tensor.CopyFrom(folded[original.name])
      continue
    node.CopyFrom(original)
    for i, text in enumerate(node.input):
      if not text.startswith("^"):
        hint = by_tensor.get(parse_input(text))
        if hint:
          node.input[i] = hint
  for tensor, name in hint_nodes.items():
    src, port = parse_input(tensor)
    node = graph_def.node.add()
    node.name, node.op = name, "EnsureShape"
    node.input.append(src if port == 0 else f"{src}:{port}")
    node.attr["T"].type = output_dtype(graph, src, port)
    node.attr["shape"].shape.CopyFrom(tensor_shape.TensorShape(hints[tensor]).as_proto())
  return Graph(graph_def), hint_nodes


# Integer ops that gradient code uses to compute shapes from constants.
_SHAPE_ARITHMETIC = frozenset([
    "StridedSlice", "ConcatV2", "Concat", "ExpandDims", "Pack", "Reshape", "Cast",
    "Identity", "Squeeze", "Slice", "GatherV2", "Add", "AddV2", "Sub", "Mul",
    "FloorDiv", "FloorMod", "Maximum", "Minimum", "Prod", "Sum", "Range", "Fill",
    "Size", "Shape", "Rank", "Neg", "BroadcastArgs", "Tile", "Transpose",
    "InvertPermutation"])
_MAX_FOLDED_ELEMENTS = 1024


def fold_shape_arithmetic(graph):
  """{node: TensorProto} of integer ops computed from constants alone.

  Grappler's shape inference reads the value of a Reshape's shape or an
  UnsortedSegmentSum's num_segments only when it is (almost) a constant;
  gradient code computes them from constants with StridedSlice, ConcatV2...
  (the variable's static shape, folded at trace time). Those are evaluated
  here, once, by TensorFlow.
  """
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  const = {}
  for name in graph.topological_order():
    node = graph.node(name)
    if node.op == "Const":
      const[name] = True
      continue
    if node.op not in _SHAPE_ARITHMETIC or not node.input:
      continue
    data = [parse_input(t) for t in node.input if not t.startswith("^")]
    if not data or not all(src in const and port == 0 for src, port in data):
      continue
    if output_dtype(graph, name, 0) not in (types_pb2.DT_INT32, types_pb2.DT_INT64):
      continue
    const[name] = False
  targets = [n for n, is_const in const.items() if not is_const]
  if not targets:
    return {}
  needed, stack = set(), list(targets)
  while stack:  # the constants the targets are computed from, not every one
    name = stack.pop()
    if name not in needed:
      needed.add(name)
      stack.extend(parse_input(t)[0] for t in graph.node(name).input if not t.startswith("^"))
  sub = graph_pb2.GraphDef()
  sub.versions.CopyFrom(graph.versions)
  for name in const:
    if name not in needed:
      continue
    node = sub.node.add()
    node.CopyFrom(graph.node(name))
    del node.input[:]
    node.input.extend(t for t in graph.node(name).input if not t.startswith("^"))
    node.device = ""
    if "_class" in node.attr:  # colocation with nodes the copy leaves out
      del node.attr["_class"]
  try:
    with tf.Graph().as_default() as g:
      tf.graph_util.import_graph_def(sub, name="")
      with tf.compat.v1.Session(graph=g) as session:
        values = session.run([t + ":0" for t in targets])
  except (tf.errors.OpError, ValueError, TypeError) as e:
    logging.info("not folding shape arithmetic: %s", str(e).splitlines()[0])
    return {}
  return {name: tensor_util.make_tensor_proto(value) for name, value in zip(targets, values)
          if value.size <= _MAX_FOLDED_ELEMENTS}
