"""What a plainly written tf.function graph lost, recovered from the graph.

`tf.io.write_graph(concrete_fn.graph.as_graph_def(), ...)` keeps each captured
variable as `Placeholder(dtype=resource, shape=[])` named after its first
reading op (`gpt/block_0/mlp/fc1/MatMul/ReadVariableOp/resource`): no name,
no shape, no dtype; and nothing marks the function's inputs and outputs.
`recover(graph_def)` finds them again and writes them as the private attrs
tfsplit records when it loads a ConcreteFunction itself (variables.py), so
everything downstream works unchanged. `io.load_graph` calls it for graph
files with unannotated captures.

Dtypes come from the ops that read or write the handle (ReadVariableOp's
dtype, ...). Shapes are found by a fixpoint; each round runs TF's own shape
inference (Grappler's GraphProperties, as shapes.py) on a private copy of the
graph in which the variables known so far (fully or partly) are VarHandleOps
of that shape, and in which variable updates are NoOps (Grappler would
otherwise give an assigned value the shape of the variable it is assigned
to, which would make any guess about that variable look right). Sources, in
the order they are tried; the label is what `RecoveryReport.sources` counts:
- *recorded read shape*: a graph written with `as_graph_def(add_shapes=True)`
  keeps each op's static output shapes (`_output_shapes`); a ReadVariableOp's
  is its variable's shape;
- *gradient constant*: TF's gradient code folds a variable's static shape
  into constants: `gradient_tape/<ResourceGather>/Const` (the dense shape of
  the gather's IndexedSlices gradient), a `Shape*` Const colocated
  (`_class: loc:@<read>`) with a read whose gather it differentiates, and
  the `Shape` / `Shape_1` of the operands of an op whose gradient takes its
  operands' shapes in order (Einsum, BatchMatMul, broadcasting arithmetic),
  found by the gradient's name scope (the op named like it, or the only such
  op directly in it: `gradient_tape/.../einsum_2/Shape_1` is the second
  operand of `.../einsum_2/Einsum`), where that operand is a variable's read
  (an expert weight `edf` whose `f` nothing else fixes). Taken when it agrees
  with what the rules below find;
- *update*: the value an AssignVariableOp / AssignAdd / AssignSub writes has
  the variable's shape (TF checks it when the op runs); for ResourceApply*,
  so has the gradient; ResourceScatter* fix all but the first dimension;
- *written value*: the same check read backwards: a variable whose read is
  written unchanged (through Identity, Cast, unary elementwise ops, AddN, a
  product with a scalar) into a variable of known shape has that shape
  (tf_keras's SGD adds its momentum slot to the weight);
- *reader*: the op a read feeds fixes dimensions of the variable: MatMul and
  BatchMatMul (the contracted dimension from the other operand, the other
  one from the output), Einsum (each letter's size wherever it is known),
  BiasAdd (the channel dimension), ResourceGather / GatherV2 (all but the
  first dimension);
- two helpers make more tensors known to the inference: gradient code also
  leaves the static shapes of the forward tensors it differentiates as
  constants `gradient_tape/<scope>/Shape` (input 0 of the op found as
  above) and `.../Shape_1` (input 1); they become EnsureShape hints on those
  tensors, but
  only where the tensor's rank and known dimensions agree with the constant.
  And integer arithmetic on constants (the StridedSlice / ConcatV2 that
  gradient code applies to those shapes, which Grappler does not evaluate)
  is evaluated once by TensorFlow (without the constants' colocation with
  nodes it leaves out) and becomes constants in the copy;
- *operand* (when a round of the above learns nothing new): a variable that
  its update combines elementwise with other tensors (Adam's moments:
  m += (g - m) * (1 - beta1)) is conjectured to have the shape of one of
  those tensors, or of the one variable whose update reads it (an optimizer
  slot has its variable's shape), or to be a scalar; all unknown variables
  at once. A conjecture is kept only when the inference then gives every
  update of the variable a value of exactly that shape (as TF requires at
  run time), checked again with only the passing conjectures in place (one
  may have passed thanks to another one that failed); a conjecture an
  update contradicts is not tried again;
- *scalar operand*: a variable that is only read, and only ever combined
  with scalars (a learning rate), is a scalar; so is one only read whose
  reads reach, through elementwise ops, values written to variables of
  known shapes that leave it no dimension but 1 (SGD's learning rate times
  gradients of different shapes: it must broadcast into each); the graph
  cannot tell () from [1] there, and () is what optimizers make;
- *row slot*: a variable updated only row by row (ResourceScatter*, the
  optimizer slot of a variable with a sparse gradient) has the shape of the
  one variable whose update reads it, where the rows it is given agree
  (counted as *operand*).
At the end every update of every variable must write a value compatible
with the variable's shape; a variable that fails this is left unknown.

`variables_from` (a checkpoint prefix or SavedModel directory) adds the saved
variables (`--variables`): see `match_saved_variables` for the matching rule.
Variables still without a shape get a name and dtype but no shape attr; the
commands that need shapes refuse them in one line (`require_variable_shapes`).

Names (a heuristic; deterministic, unique):
- the *scope* of a variable is that of its first read in the forward pass
  (the read's name without its own last component, and without the op it
  was created for when that op exists: `.../fc1/MatMul/ReadVariableOp` ->
  `.../fc1`), without trailing scopes that name an op or a TF helper
  (`batchnorm`, `Tensordot`, `einsum`, `moments`, `embedding_lookup`, any
  registered op name); when every component of every forward scope ends in
  `_<n>` (Keras 3 re-enters its layer scopes: `gpt_1/block_0_1/mlp_1/...`),
  one `_<n>` is dropped from each;
- the last component is the variable's role, named as Keras names it:
  `kernel` (an operand of MatMul / BatchMatMul / Einsum / Conv, through
  Identity / Cast / Reshape), `embeddings` (the table of a gather, or added
  to a gather's output), `bias` (BiasAdd, or added to a contraction's
  output), `gamma` (multiplies), `beta` (added, in a scope whose other
  variable multiplies), else `variable`;
- a variable not read in the forward pass whose reads feed the update of
  exactly one trainable variable W is an optimizer slot of W, named
  `<its scope>/<W's name>/slot_<k>` (k in node order); an integer scalar that
  is updated is `<scope>/iteration`; anything else `<scope>/variable`;
- clashes get `_1`, `_2`, ... in node order (forward variables first).
Trainable: read in the forward pass and updated from a gradient (an update
depends, through data or control edges, on a `gradient_tape/` op).

Outputs: the Identity sinks with a control input from a NoOp (how a
tf.function graph with side effects returns its results: `Identity`,
`Identity_1`, ... after the NoOp that runs its stateful ops), failing that
(no side effects) the sinks named `Identity`, `Identity_<n>`; in the order
of their number. Inputs: the non-resource placeholders, in node order (a
plain graph cannot tell arguments from captured non-variable tensors).
Both are marked only when the graph has no marks.
"""
import collections
import dataclasses
import os
import re
from typing import List, Optional, Tuple

from absl import logging
from tensorflow.core.framework import graph_pb2
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import op_def_registry
from tensorflow.python.framework import tensor_shape
from tensorflow.python.framework import tensor_util

from tfsplit.errors import GraphValidationError, TfsplitError
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.ir import Graph, parse_input, without_gc

GRADIENT_PREFIX = re.compile(r"^(gradient_tape|gradients(?:_\d+)?)/")
_SHAPE_CONST = re.compile(r"^(?:gradient_tape|gradients(?:_\d+)?)/(.+)/Shape(?:_(\d+))?$")
_OUTPUT_NAME = re.compile(r"^Identity(?:_(\d+))?$")
_SUFFIX = re.compile(r"_\d+$")
_MAX_ROUNDS = 64
_MAX_CHAIN = 64           # nodes walked back from an update's value
_MAX_GRADIENT_SEARCH = 4096

_READ_OPS = frozenset(["ReadVariableOp", "ResourceGather", "ResourceGatherNd"])
_FULL_VALUE_WRITERS = frozenset(
    ["AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"])
# Shape-preserving ops a variable's value passes through unchanged in shape.
_SAME_SHAPE = frozenset([
    "Identity", "Cast", "StopGradient", "Snapshot", "PreventGradient", "Neg",
    "Square", "Sqrt", "Rsqrt", "Exp", "Log", "Log1p", "Abs", "Sign", "Reciprocal",
    "Relu", "Relu6", "Sigmoid", "Tanh", "Erf", "Erfc", "Floor", "Ceil", "Round",
    "Softplus", "Softsign", "Elu", "Selu", "ZerosLike", "OnesLike", "Inv"])
_BINARY = frozenset([
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "MulNoNan",
    "Maximum", "Minimum", "Pow", "SquaredDifference", "FloorDiv", "FloorMod",
    "TruncateDiv", "Xdivy", "Xlogy", "Xlog1py"])
_VIEWS = frozenset(["Identity", "Cast", "StopGradient", "Snapshot", "PreventGradient",
                    "Reshape", "ExpandDims", "Squeeze", "Transpose"])
_CONTRACTIONS = frozenset(["MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3",
                           "Einsum", "Conv1D", "Conv2D", "Conv3D",
                           "DepthwiseConv2dNative", "Conv2DBackpropInput"])
_GATHERS = frozenset(["GatherV2", "Gather", "ResourceGather"])
# Scopes TF's own Python helpers open inside a layer's scope.
_HELPER_SCOPES = frozenset(["batchnorm", "Tensordot", "tensordot", "einsum", "moments",
                            "embedding_lookup", "dropout", "normalize", "truediv"])

SOURCE_UPDATE = "update"
SOURCE_READER = "reader"
SOURCE_OPERAND = "operand"
SOURCE_SCALAR = "scalar operand"
SOURCE_CONSTANT = "gradient constant"
SOURCE_RECORDED = "recorded read shape"
SOURCE_WRITTEN = "written value"
SOURCE_SAVED = "--variables"


@dataclasses.dataclass
class Recovered:
  """One captured variable as recovered."""
  node: str
  name: str = ""
  dtype: Optional[int] = None
  shape: Optional[Tuple[Optional[int], ...]] = None  # partial while unknown
  source: Optional[str] = None   # what fixed the shape (None: not fixed)
  trainable: Optional[bool] = None
  scope: str = ""
  role: str = "variable"
  owner: Optional[str] = None    # an optimizer slot: its variable's node

  @property
  def known(self):
    return self.source is not None

  def shape_text(self):
    if self.shape is None:
      return "?"
    return "[" + ", ".join("?" if d is None else str(d) for d in self.shape) + "]"


@dataclasses.dataclass
class RecoveryReport:
  variables: List[Recovered]
  inputs: List[str]
  outputs: List[str]
  hints: int = 0                  # gradient shape constants used
  rounds: int = 0                 # shape-inference runs
  matched: int = 0                # variables matched to saved ones

  @property
  def missing(self):
    return [v for v in self.variables if not v.known or not v.dtype]

  @property
  def sources(self):
    return collections.Counter(v.source for v in self.variables if v.known)

  def summary(self):
    counts = ", ".join(f"{n} from {s}" for s, n in sorted(self.sources.items()))
    return (f"{len(self.variables)} captured variables ({counts or 'none known'}; "
            f"{len(self.missing)} unknown), {self.hints} gradient shape hints, "
            f"{self.rounds} inference rounds, outputs {self.outputs}")


def missing_shapes_message(label, missing, total):
  """One line naming the variables without a shape: the trained ones first
  (up to 6: the weights whose shapes are open; their slots follow them)."""
  missing = sorted(missing, key=lambda v: not v.trainable)  # stable: node order kept
  count = min(max(3, sum(bool(v.trainable) for v in missing)), 6)
  shown = ", ".join(v.name + (f" {v.shape_text()}" if v.shape is not None else "")
                    for v in missing[:count])
  more = f" and {len(missing) - count} more" if len(missing) > count else ""
  return (f"{label}: {len(missing)} of {total} captured variables have no shape the "
          f"graph determines ({shown}{more}); pass --variables PATH (a checkpoint or "
          "SavedModel holding them) to take shapes from there, write the graph with its "
          "shapes (concrete_fn.graph.as_graph_def(add_shapes=True)), or load it from its "
          "tf.function (tfsplit.graph.load_graph(concrete_fn)) so tfsplit records them")


# --- shapes --------------------------------------------------------------------------
def _merge(a, b):
  """The more specific of two partial shapes; raises ValueError on a conflict."""
  if a is None:
    return b
  if b is None:
    return a
  if len(a) != len(b):
    raise ValueError(f"rank {len(a)} vs {len(b)}")
  out = []
  for x, y in zip(a, b):
    if x is not None and y is not None and x != y:
      raise ValueError(f"{x} vs {y}")
    out.append(x if x is not None else y)
  return tuple(out)


def _compatible(a, b):
  try:
    _merge(a, b)
    return True
  except ValueError:
    return False


def _full(shape):
  return shape is not None and all(d is not None for d in shape)


class _Inference(object):
  """TF's shape inference on the graph, with variable shapes and hints."""

  def __init__(self, graph):
    self.graph = graph
    self.shape_targets = _shape_constant_targets(graph)
    self.hint_candidates = _gradient_shape_constants(graph, self.shape_targets)  # tensor -> shape
    self.folded = _fold_shape_arithmetic(graph)  # node -> TensorProto
    self.hints = {}        # tensor -> shape, in use
    self.shapes = None     # ShapeMap of the last run
    self.runs = 0
    self._copy = None      # the graph inference runs on
    self._hint_nodes = {}  # tensor -> its EnsureShape node in _copy

  def run(self, var_shapes):
    from tfsplit.graph import shapes as shapes_lib  # pylint: disable=import-outside-toplevel
    if self._copy is None:
      self._copy, self._hint_nodes = _inference_graph(self.graph, self.hints, self.folded)
    self.runs += 1
    try:
      by_node = shapes_lib._run_inference(self._copy, var_shapes)  # pylint: disable=protected-access
    except GraphValidationError:
      if not self.hints:
        raise
      logging.info("shape inference failed with gradient shape hints; dropping them")
      self.hints, self.hint_candidates, self._copy = {}, {}, None
      return self.run(var_shapes)
    self.shapes = shapes_lib.ShapeMap(by_node)
    return self.shapes

  def shape(self, text):
    """Partial shape of tensor `text` (after its hint, if any), or None."""
    name, port = parse_input(text)
    key = f"{name}:{port}"
    hint = self._hint_nodes.get(key)
    info = self.shapes.get(hint) if hint else self.shapes.get(key)
    return None if info is None else info.shape

  def add_hints(self):
    """Starts using the hints whose tensor now has a compatible shape."""
    added = 0
    for tensor, shape in list(self.hint_candidates.items()):
      current = self.shape(tensor)
      if current is None or len(current) != len(shape):
        continue
      del self.hint_candidates[tensor]
      if _full(current) or not _compatible(current, shape):
        continue
      self.hints[tensor] = shape
      added += 1
    if added:
      self._copy = None
    return added


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


def _shape_constant_targets(graph):
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


def _gradient_shape_constants(graph, targets=None):
  """{forward tensor: shape} from gradient code's folded Shape constants."""
  found = {}
  for _, text, shape, _ in (_shape_constant_targets(graph) if targets is None else targets):
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


def _variable_shape_constants(graph, st, targets=None):
  """{handle: shape} from constants TF's gradient code made of a variable's shape.

  - ResourceGather's gradient folds the variable's static shape into
    `gradient_tape/<gather>/Const` (the params shape of its IndexedSlices);
  - GatherV2's (and others') gradient computes `Shape` of the read it
    differentiates colocated with it: a Const with `_class: loc:@<read>`;
  - an op whose gradient takes its operands' shapes in order (Einsum,
    BatchMatMul, broadcasting arithmetic: `_shape_constant_targets`) leaves
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
  for _, text, shape, ordered in (_shape_constant_targets(graph) if targets is None else targets):
    src, port = parse_input(text)
    if ordered and port == 0 and src in reads and graph.node(src).op == "ReadVariableOp":
      found[reads[src]].append(shape)
  return {h: shapes[0] for h, shapes in found.items() if len(set(shapes)) == 1}


def _recorded_shapes(st):
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
  return node.op in _FULL_VALUE_WRITERS or node.op.startswith(
      ("ResourceApply", "ResourceSparseApply", "ResourceScatter"))


def _inference_graph(graph, hints, folded):
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
    dtype = _output_dtype(graph, src, port)
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
    node.attr["T"].type = _output_dtype(graph, src, port)
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


def _fold_shape_arithmetic(graph):
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
    if _output_dtype(graph, name, 0) not in (types_pb2.DT_INT32, types_pb2.DT_INT64):
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


def _output_dtype(graph, name, port):
  """Dtype of output `port` of node `name`, from its attrs (common cases)."""
  node = graph.node(name)
  op_def = op_def_registry.get(node.op)
  if op_def is None or port >= len(op_def.output_arg):
    return None
  arg = op_def.output_arg[port] if len(op_def.output_arg) > 1 else op_def.output_arg[0]
  if arg.type:
    return arg.type
  if arg.type_attr and arg.type_attr in node.attr:
    return node.attr[arg.type_attr].type
  if arg.type_list_attr and arg.type_list_attr in node.attr:
    types = node.attr[arg.type_list_attr].list.type
    return types[port] if port < len(types) else None
  return None


# --- graph structure -------------------------------------------------------------------
class _Structure(object):
  """Reads, writers and forward ops of the captured variables."""

  def __init__(self, graph, handles):
    self.graph = graph
    self.reads = collections.defaultdict(list)    # handle -> [read node]
    self.writers = collections.defaultdict(list)  # handle -> [(node, value input)]
    self.appliers = collections.defaultdict(list)  # handle -> [ResourceApply* node]
    self.scatters = collections.defaultdict(list)  # handle -> [ResourceScatter* node]
    self.users = collections.defaultdict(list)    # handle -> [node using it at input 0]
    self._readers = None
    for handle in handles:
      for node in graph.consumer_nodes(handle):
        data = [t for t in node.input if not t.startswith("^")]
        if data and parse_input(data[0])[0] == handle:
          self.users[handle].append(node)
          if node.op in _READ_OPS:
            self.reads[handle].append(node)
          elif node.op in _FULL_VALUE_WRITERS and len(data) > 1:
            self.writers[handle].append((node, data[1]))
          elif node.op.startswith("ResourceScatter") and len(data) > 2:
            self.scatters[handle].append(node)
        if node.op.startswith(("ResourceApply", "ResourceSparseApply")):
          if any(parse_input(t)[0] == handle for t in data):
            self.appliers[handle].append(node)

  def updated(self, handle):
    """Whether anything writes the variable."""
    return bool(self.writers[handle] or self.appliers[handle] or self.scatters[handle])

  def update_readers(self):
    """{handle: {handles whose updates read it}} (an optimizer slot: one).

    The walk back from an update stops at gradient ops: what a gradient
    reads is the model's forward pass, not the optimizer's state (and
    walking it for every variable would be quadratic in the graph).
    """
    if self._readers is not None:
      return self._readers
    readers = collections.defaultdict(set)
    for handle in self.users:
      roots = [parse_input(value)[0] for _, value in self.writers[handle]]
      for node in self.appliers[handle] + self.scatters[handle]:
        roots.extend(parse_input(t)[0] for t in node.input[1:] if not t.startswith("^"))
      seen, stack = set(), roots
      while stack:
        name = stack.pop()
        if name in seen:
          continue
        seen.add(name)
        node = self.graph.node(name)
        if node.op in _READ_OPS:
          src = parse_input(node.input[0])[0]
          if src != handle and src in self.users:
            readers[src].add(handle)
        elif name != handle and name in self.users:
          readers[name].add(handle)  # a slot handle given to ResourceApply*
        elif not GRADIENT_PREFIX.match(name):
          stack.extend(src for src, _ in self.graph.data_inputs(name) if src not in seen)
    self._readers = readers
    return readers

  def view_consumers(self, read, views=_SAME_SHAPE):
    """[(consumer, input index, tensor)] of a read, through `views`."""
    out, stack, seen = [], [read.name], set()
    while stack:
      name = stack.pop()
      if name in seen:
        continue
      seen.add(name)
      for consumer, index in self.graph.consumers(name, 0):
        node = self.graph.node(consumer)
        if node.op in views and index == 0:
          stack.append(consumer)
        else:
          out.append((node, index, name))
    return out


def _recover_outputs(graph):
  """The function's results: see the module doc."""
  noops = {n.name for n in graph.nodes if n.op == "NoOp"}
  sinks = [n for n in graph.nodes if not graph.consumers(n.name) and
           n.op in ("Identity", "IdentityN")]
  after_noop = [n for n in sinks if any(c in noops for c in Graph.control_inputs(n))]
  named = [n for n in sinks if _OUTPUT_NAME.match(n.name)]

  def number(node):
    m = _OUTPUT_NAME.match(node.name)
    return int(m.group(1) or 0) if m else -1
  return [n.name for n in sorted(after_noop or named, key=number)]


def _reader_shape(st, inf, var, read):
  """Partial shape of `var` from the ops `read` feeds (None: nothing learnt)."""
  shape = var.shape
  rank = None if shape is None else len(shape)

  def learn(found):
    nonlocal shape
    if found is not None:
      shape = _merge(shape, found)

  if read.op in ("ResourceGather",):
    out, idx = inf.shape(read.name), inf.shape(read.input[1])
    if out is not None and idx is not None and read.attr["batch_dims"].i == 0:
      learn((None,) + tuple(out[len(idx):]))
    return shape
  if read.op != "ReadVariableOp":
    return shape
  for node, index, tensor in st.view_consumers(read):
    data = [t for t in node.input if not t.startswith("^")]
    out = inf.shape(node.name)
    if node.op == "MatMul" and index in (0, 1):
      # a [m, k] x b [k, n] -> [m, n], either operand possibly transposed.
      other = inf.shape(data[1 - index])
      ta, tb = node.attr["transpose_a"].b, node.attr["transpose_b"].b
      k = None
      if other is not None and len(other) == 2:
        if index == 0:
          k = other[1] if tb else other[0]
        else:
          k = other[0] if ta else other[1]
      o = None if out is None or len(out) != 2 else out[index]
      if index == 0:
        learn((k, o) if ta else (o, k))
      else:
        learn((o, k) if tb else (k, o))
    elif node.op in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3") and index in (0, 1):
      other = inf.shape(data[1 - index])
      if rank is None and other is not None and out is not None and len(other) == len(out):
        rank = len(other)
      if rank is None or rank < 2:
        continue
      adj = node.attr["adj_x" if index == 0 else "adj_y"].b
      other_adj = node.attr["adj_y" if index == 0 else "adj_x"].b
      k = None
      if other is not None and len(other) >= 2:
        if index == 0:
          k = other[-1] if other_adj else other[-2]
        else:
          k = other[-2] if other_adj else other[-1]
      o = None if out is None or len(out) < 2 else out[-2 if index == 0 else -1]
      if index == 0:
        last_two = (k, o) if adj else (o, k)
      else:
        last_two = (o, k) if adj else (k, o)
      learn((None,) * (rank - 2) + last_two)
    elif node.op == "Einsum":
      learn(_einsum_shape(node, index, [inf.shape(t) for t in data], out))
    elif node.op == "BiasAdd" and index == 1:
      value = inf.shape(data[0])
      if value is not None and value:
        nchw = node.attr["data_format"].s == b"NCHW"
        learn((value[1] if nchw and len(value) > 2 else value[-1],))
    elif node.op in ("GatherV2", "Gather") and index == 0:
      idx = inf.shape(data[1])
      axis = _const_int(st.graph, data[2]) if node.op == "GatherV2" else 0
      if axis == 0 and out is not None and idx is not None and (
          node.op == "Gather" or node.attr["batch_dims"].i == 0):
        learn((None,) + tuple(out[len(idx):]))
  return shape


def _einsum_shape(node, index, ins, out):
  equation = node.attr["equation"].s.decode()
  if "..." in equation or "->" not in equation:
    return None
  lhs, rhs = equation.replace(" ", "").split("->")
  terms = lhs.split(",")
  if index >= len(terms):
    return None
  sizes = {}
  for term, shape in list(zip(terms, ins)) + [(rhs, out)]:
    if shape is None or len(shape) != len(term):
      continue
    for letter, d in zip(term, shape):
      if d is not None:
        sizes.setdefault(letter, d)
  mine = ins[index]
  base = (None,) * len(terms[index])
  found = tuple(sizes.get(letter) for letter in terms[index])
  if mine is not None and len(mine) == len(base):
    return _merge(mine, found)
  return found


def _const_int(graph, text):
  node = graph.get(parse_input(text)[0]) if hasattr(graph, "get") else None
  if node is None or node.op != "Const":
    return None
  try:
    value = tensor_util.MakeNdarray(node.attr["value"].tensor)
  except (TypeError, ValueError):
    return None
  return int(value) if value.ndim == 0 else None


def _scatter_shape(st, inf, var):
  """Partial shape of `var` from ResourceScatter* ops writing rows of it."""
  shape = None
  for node in st.users[var.node]:
    if not node.op.startswith("ResourceScatter") or node.op.endswith("NdUpdate"):
      continue
    data = [t for t in node.input if not t.startswith("^")]
    idx, updates = inf.shape(data[1]), inf.shape(data[2])
    if idx is not None and updates is not None and len(updates) >= len(idx):
      shape = _merge(shape, (None,) + tuple(updates[len(idx):]))
  return shape


def _update_shapes(st, inf, var):
  """[partial shape] of the values that the updates of `var` write."""
  found = []
  for _, value in st.writers[var.node]:
    found.append(inf.shape(value))
  for node in st.appliers[var.node]:
    data = [t for t in node.input if not t.startswith("^")]
    if parse_input(data[0])[0] != var.node:
      continue  # the variable is a slot of this op: see its main variable
    found.append(inf.shape(data[-1]) if not node.op.startswith("ResourceSparse") else None)
  return found


def _operand_candidates(st, inf, var, owner_shape=None):
  """Shapes `var` may have: those of what its updates / reads combine it with.

  owner_shape: the shape of the one variable whose update reads `var` (an
  optimizer slot has its variable's shape), tried first.
  """
  chain, reads = [], []
  seen = set()
  own = {r.name for r in st.reads[var.node]}
  queue = collections.deque(value for _, value in st.writers[var.node])
  while queue and len(seen) < _MAX_CHAIN:
    text = queue.popleft()
    src, port = parse_input(text)
    if (src, port) in seen:
      continue
    seen.add((src, port))
    node = st.graph.node(src)
    if src in own:
      continue
    shape = inf.shape(text)
    if _full(shape):
      chain.append(shape)
      continue
    if node.op in _BINARY or node.op in _SAME_SHAPE or node.op == "AddN":
      queue.extend(t for t in node.input if not t.startswith("^"))
  for read in st.reads[var.node]:
    if read.op != "ReadVariableOp":
      continue
    for node, index, _ in st.view_consumers(read):
      if node.op in _BINARY and index in (0, 1):
        other = inf.shape(node.input[1 - index])
        if _full(other):
          reads.append(other)
  out = []
  owner = [owner_shape] if owner_shape is not None else []
  for shape in owner + sorted(chain, key=lambda s: -len(s)) + sorted(
      reads, key=lambda s: -len(s)) + [()]:
    if shape not in out and _compatible(var.shape, shape):
      out.append(shape)
  return out, reads


def _requirements(st, inf, by_node):
  """What the updates of variables of known shape require of what they read.

  TF checks that an update writes a value of its variable's shape. Walking
  back from that value through ops that keep shapes (Identity, Cast, unary
  elementwise, AddN) the requirement stays exact; through a broadcasting
  binary op each operand only has to broadcast into it (exact again where
  the other operand is a scalar). Returns ({handle: [shape]}: a read of the
  variable is written unchanged, so it has that shape (tf_keras SGD: w +=
  its momentum slot); {handle: [full shape]}: its read broadcasts into each
  (SGD's learning rate times a gradient)).
  """
  exact, bounds = collections.defaultdict(list), collections.defaultdict(list)
  for v in by_node.values():
    if v.shape is None:
      continue
    for _, value in st.writers[v.node]:
      stack, seen = [(value, True)], set()
      while stack and len(seen) < _MAX_CHAIN:
        text, is_exact = stack.pop()
        src, port = parse_input(text)
        if (src, port, is_exact) in seen:
          continue
        seen.add((src, port, is_exact))
        node = st.graph.node(src)
        data = [t for t in node.input if not t.startswith("^")]
        if node.op == "ReadVariableOp" and data:
          handle = parse_input(data[0])[0]
          if handle != v.node and handle in by_node:
            if is_exact:
              exact[handle].append(v.shape)
            elif _full(v.shape):
              bounds[handle].append(v.shape)
        elif node.op in _SAME_SHAPE and data:
          stack.append((data[0], is_exact))
        elif node.op == "AddN":
          stack.extend((t, is_exact) for t in data)
        elif node.op in _BINARY and len(data) == 2:
          for i in (0, 1):
            scalar_partner = inf.shape(data[1 - i]) == ()
            if (is_exact and scalar_partner) or _full(v.shape):
              stack.append((data[i], is_exact and scalar_partner))
  return exact, bounds


def _only_unit_fits(bounds):
  """Whether only shapes of size-1 dimensions broadcast into every shape of
  `bounds` (full shapes): then the variable is taken to be a scalar."""
  if not bounds:
    return False
  for d in range(1, min(len(b) for b in bounds) + 1):
    sizes = {b[-d] for b in bounds}
    if len(sizes) == 1 and 1 not in sizes:
      return False  # that dimension could be the common size
  return True


def _fixpoint(graph, st, inf, variables):
  """Fills in var.shape / var.source as far as the graph determines them."""
  tried = collections.defaultdict(set)
  constants = _variable_shape_constants(graph, st, inf.shape_targets)
  recorded = _recorded_shapes(st)
  owners = st.update_readers()
  by_node = {v.node: v for v in variables}

  def var_shapes(extra=None):
    out = {}
    for v in variables:
      shape = (extra or {}).get(v.node, v.shape)
      if shape is not None and v.dtype:
        out[v.node] = (v.dtype, shape)
    return out

  inf.run(var_shapes())
  known = 0
  for _ in range(_MAX_ROUNDS):
    progress = False
    now_known = sum(v.known for v in variables)
    if now_known != known:
      # A rejection may have come from another wrong conjecture: with more
      # variables known, every candidate gets another chance.
      tried.clear()
      known = now_known
    # Direct rules.
    exact, bounds = _requirements(st, inf, by_node)
    for v in variables:
      if v.known:
        continue
      before = v.shape
      if v.node in recorded:
        v.shape, v.source = recorded[v.node], SOURCE_RECORDED
        progress = True
        continue
      try:
        for read in st.reads[v.node]:
          v.shape = _reader_shape(st, inf, v, read)
        for value in _update_shapes(st, inf, v):
          v.shape = _merge(v.shape, value)
        v.shape = _merge(v.shape, _scatter_shape(st, inf, v))
        for shape in exact.get(v.node, ()):
          v.shape = _merge(v.shape, shape)
      except ValueError:
        v.shape = before  # contradicting evidence: leave it to the others
      constant = constants.get(v.node)
      if constant is not None and _compatible(v.shape, constant):
        v.shape, v.source = constant, SOURCE_CONSTANT
        progress = True
        continue
      if constant is not None:
        logging.info("gradient shape constant %s of variable '%s' contradicts %s; not used",
                     constant, v.node, v.shape_text())
      if _full(v.shape):
        updates = _update_shapes(st, inf, v)
        if any(_full(u) and u == v.shape for u in updates):
          v.source = SOURCE_UPDATE
        elif v.shape in exact.get(v.node, ()):
          v.source = SOURCE_WRITTEN
        else:
          v.source = SOURCE_READER
        progress = True
      elif (not st.updated(v.node) and
            _compatible(v.shape, ()) and _only_unit_fits(bounds.get(v.node))):
        v.shape, v.source = (), SOURCE_SCALAR
        progress = True
      elif v.shape != before:
        progress = True
    if inf.add_hints():
      progress = True
    if progress:
      inf.run(var_shapes())
      continue
    # Conjectures, all unknown variables at once, checked by their updates.
    conjecture = {}
    for v in variables:
      if v.known or not v.dtype:
        continue
      owner = by_node.get(next(iter(owners[v.node]))) if len(owners[v.node]) == 1 else None
      candidates, read_partners = _operand_candidates(
          st, inf, v, owner.shape if owner is not None and owner.known else None)
      if not st.writers[v.node] and not st.appliers[v.node]:
        if st.scatters[v.node]:
          # Updated row by row only (the optimizer slot of a variable with a
          # sparse gradient): the shape of the one variable whose update
          # reads it, where the rows it is given agree with that.
          shape = owner.shape if owner is not None and owner.known else None
          if shape is not None and v.shape is not None and len(v.shape) == len(shape) and \
              _compatible(v.shape, shape):
            v.shape, v.source = shape, SOURCE_OPERAND
            progress = True
          continue
        if read_partners and all(s == () for s in read_partners) and _compatible(v.shape, ()):
          v.shape, v.source = (), SOURCE_SCALAR
          progress = True
        continue
      for shape in candidates:
        if shape not in tried[v.node]:
          conjecture[v.node] = shape
          break
    if progress:
      inf.run(var_shapes())
      continue
    if not conjecture:
      break
    inf.run(var_shapes(conjecture))
    passed = {}
    for node, shape in conjecture.items():
      values = _update_shapes(st, inf, by_node[node])
      if values and all(_full(s) and s == shape for s in values):
        passed[node] = shape
      elif any(s is not None and not _compatible(s, shape) for s in values):
        tried[node].add(shape)  # its updates write another shape
        progress = True
    # A conjecture may only have passed thanks to another one that failed
    # (Adam's update of w reads its moments): check again with only the
    # passing ones in place, until they all pass.
    while passed and len(passed) < len(conjecture):
      conjecture = passed
      inf.run(var_shapes(conjecture))
      passed = {node: shape for node, shape in conjecture.items()
                if all(_full(s) and s == shape
                       for s in _update_shapes(st, inf, by_node[node]))}
    for node, shape in passed.items():
      by_node[node].shape, by_node[node].source = shape, SOURCE_OPERAND
      progress = True
    inf.run(var_shapes())
    if not progress:
      break
  _check_updates(st, inf, variables)


def _solve(graph, st, inf, variables):
  """_fixpoint, leaving shapes unknown if TF's shape inference fails."""
  known = {v.node: (v.shape, v.source) for v in variables if v.known}
  try:
    _fixpoint(graph, st, inf, variables)
  except GraphValidationError as e:
    logging.info("shape recovery stopped: %s", e)
    for v in variables:
      v.shape, v.source = known.get(v.node, (None, None))


def _check_updates(st, inf, variables):
  """Every update must write a value of its variable's shape."""
  for v in variables:
    if not v.known:
      continue
    for value in _update_shapes(st, inf, v):
      if value is not None and not _compatible(value, v.shape):
        logging.info("recovered shape %s of variable '%s' disagrees with an update "
                     "writing %s; leaving it unknown", v.shape, v.node, value)
        v.source = None
        break


# --- names -----------------------------------------------------------------------------
def _is_op_scope(component):
  base = _SUFFIX.sub("", component)
  if base in _HELPER_SCOPES:
    return True
  return any(op_def_registry.get(c) is not None
             for c in {base, base[:1].upper() + base[1:]} if c)


def _read_scope(graph, read):
  parts = read.name.split("/")[:-1]
  if read.op == "ReadVariableOp" and parts and "/".join(parts) in graph:
    parts = parts[:-1]  # the op the read was made for: '.../fc1/MatMul/ReadVariableOp'
  while parts and _is_op_scope(parts[-1]):
    parts = parts[:-1]
  return parts


def _role(st, read):
  """(priority, role) of one forward read: lower priority wins."""
  if read.op in ("ResourceGather", "ResourceGatherNd"):
    return 0, "embeddings"
  best = (9, "variable")
  for node, index, _ in st.view_consumers(read, _VIEWS):
    if node.op in _GATHERS and index == 0:
      found = (0, "embeddings")
    elif node.op in _CONTRACTIONS:
      found = (1, "kernel")
    elif node.op == "BiasAdd" and index == 1:
      found = (2, "bias")
    elif (node.op in ("Add", "AddV2") and index in (0, 1)) or (
        node.op == "Sub" and index == 0):
      other = _producer_kind(st.graph, node.input[1 - index])
      found = {"gather": (0, "embeddings"), "contraction": (2, "bias")}.get(other, (4, "add"))
    elif node.op == "Mul":
      found = (3, "gamma")
    else:
      continue
    best = min(best, found)
  return best


def _producer_kind(graph, text):
  name = parse_input(text)[0]
  for _ in range(8):
    node = graph.node(name)
    if node.op in _GATHERS or node.op == "ResourceGather":
      return "gather"
    if node.op in _CONTRACTIONS:
      return "contraction"
    if node.op not in _VIEWS and node.op != "BiasAdd":
      return None
    name = parse_input(node.input[0])[0]
  return None


def _name_variables(graph, st, variables, outputs):
  forward = graph.data_ancestors(outputs) if outputs else set()
  forward_reads = {v.node: [r for r in st.reads[v.node] if r.name in forward and
                            not GRADIENT_PREFIX.match(r.name)] for v in variables}
  # Scopes.
  scopes = {}
  for v in variables:
    reads = forward_reads[v.node] or st.reads[v.node] or [n for n in st.users[v.node]]
    scopes[v.node] = _read_scope(graph, reads[0]) if reads else v.node.split("/")[:-1]
  model_scopes = [scopes[v.node] for v in variables if forward_reads[v.node]]
  if model_scopes and all(_SUFFIX.search(c) for s in model_scopes for c in s) and any(
      model_scopes):
    for v in variables:
      if forward_reads[v.node]:
        scopes[v.node] = [_SUFFIX.sub("", c) for c in scopes[v.node]]
  # Roles and trainability of forward variables.
  for v in variables:
    v.scope = "/".join(scopes[v.node])
    if forward_reads[v.node]:
      v.role = min(_role(st, r) for r in forward_reads[v.node])[1]
      v.trainable = _updated_from_gradient(graph, st, v) if forward else None
    else:
      v.trainable = False if forward else None
  multiplied = {v.scope for v in variables if v.role == "gamma"}
  for v in variables:
    if v.role == "add":
      v.role = "beta" if v.scope in multiplied else "bias"
  # Forward variables first, then the others (slots are named after theirs).
  used, taken = set(), collections.Counter()

  def unique(base):
    name = base
    while name in used:
      taken[base] += 1
      name = f"{base}_{taken[base]}"
    used.add(name)
    return name

  for v in variables:
    if forward_reads[v.node]:
      v.name = unique(_join(v.scope, v.role))
  by_node = {v.node: v for v in variables}
  readers = st.update_readers()
  slot_count = collections.Counter()
  for v in variables:
    if forward_reads[v.node]:
      continue
    owners = [o for o in readers.get(v.node, ()) if by_node[o].trainable]
    if len(owners) == 1:
      v.owner = owners[0]
      k = slot_count[v.owner]
      slot_count[v.owner] += 1
      v.name = unique(_join(v.scope, by_node[v.owner].name, f"slot_{k}"))
      v.role = "slot"
    elif (v.dtype in (types_pb2.DT_INT32, types_pb2.DT_INT64) and v.shape == () and
          st.writers[v.node]):
      v.name = unique(_join(v.scope, "iteration"))
      v.role = "iteration"
    else:
      v.name = unique(_join(v.scope, "variable"))


def _join(*parts):
  return "/".join(p for p in parts if p)


def _updated_from_gradient(graph, st, var):
  """Whether an update of `var` depends on a gradient op (data or control)."""
  roots = [w.name for w, _ in st.writers[var.node]] + [
      n.name for n in st.appliers[var.node] + st.scatters[var.node]]
  if not roots:
    return False
  seen, queue = set(), collections.deque(roots)
  while queue and len(seen) < _MAX_GRADIENT_SEARCH:
    name = queue.popleft()
    if name in seen:
      continue
    seen.add(name)
    if GRADIENT_PREFIX.match(name):
      return True
    queue.extend(parse_input(t)[0] for t in graph.node(name).input)
  return False


# --- saved variables -------------------------------------------------------------------
@dataclasses.dataclass
class SavedVariable:
  name: str
  key: str
  shape: Tuple[int, ...]
  dtype: int
  named: bool = True   # False: `name` is an object path, not the variable's name


def read_saved_variables(path):
  """[SavedVariable] of a checkpoint prefix or SavedModel directory."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tensorflow.core.protobuf import trackable_object_graph_pb2  # pylint: disable=import-outside-toplevel
  path = os.fspath(path)
  prefix = path
  if os.path.isdir(path):
    if os.path.exists(os.path.join(path, "saved_model.pb")):
      prefix = os.path.join(path, "variables", "variables")
    else:
      found = tf.train.latest_checkpoint(path)
      if found is None:
        raise TfsplitError(f"--variables {path}: a directory that is neither a SavedModel "
                           "nor holds a checkpoint")
      prefix = found
  try:
    reader = tf.train.load_checkpoint(prefix)
  except (tf.errors.OpError, ValueError) as e:
    raise TfsplitError(f"--variables {path}: cannot read the checkpoint "
                       f"({str(e).splitlines()[0][:200]})") from None
  shapes = reader.get_variable_to_shape_map()
  dtypes = reader.get_variable_to_dtype_map()
  full_names = {}
  if "_CHECKPOINTABLE_OBJECT_GRAPH" in shapes:
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    for node in graph.nodes:
      for attr in node.attributes:
        if attr.full_name:
          full_names[attr.checkpoint_key] = attr.full_name
  out = []
  for key in sorted(shapes, key=_natural_key):
    if key == "_CHECKPOINTABLE_OBJECT_GRAPH" or key.startswith("save_counter/"):
      continue
    if "/.ATTRIBUTES/" in key and not key.endswith("/.ATTRIBUTES/VARIABLE_VALUE"):
      continue
    name = full_names.get(key) or key.replace("/.ATTRIBUTES/VARIABLE_VALUE", "")
    if name.endswith(":0"):
      name = name[:-2]
    out.append(SavedVariable(name, key, tuple(shapes[key]), dtypes[key].as_datatype_enum,
                             key in full_names or "/.ATTRIBUTES/" not in key))
  counts = collections.Counter(v.name for v in out)
  for v in out:  # names several variables share (Keras 3: 'gpt/kernel') say nothing
    if counts[v.name] > 1:
      v.name, v.named = v.key.replace("/.ATTRIBUTES/VARIABLE_VALUE", ""), False
  return out


def _natural_key(text):
  return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def _flat(name):
  return re.sub(r"[/:.]", "_", name)


def match_saved_variables(variables, saved):
  """Pairs graph variables with saved ones; returns the number matched.

  The rule, in order, each step over the still unmatched variables:
  1. same name (the recovered one) and dtype, compatible shape;
  2. same scope (the saved name without its last part equals the recovered
     scope), same dtype, compatible shape, and only one such saved variable
     (or only one whose last part is the recovered role, or only one of
     exactly the recovered shape);
  3. optimizer slots: saved variables whose name, '/' read as '_', ends with
     the name of the slot's own variable (as matched, else as recovered),
     optionally followed by '_<n>' and '_<word>' (Keras: 'm/<var>',
     'adam/<var>_momentum'), same dtype and compatible shape, in saved order
     (checkpoint keys in natural order; Adam's m before v, as in the graph);
  4. what is left: a saved variable that is the only one compatible (dtype and
     shape) with one graph variable, itself the only compatible graph variable.
  A match gives the variable the saved shape, and the saved name unless the
  checkpoint only has an object path for it ('model/head/_kernel', when
  several variables share one name, as Keras 3's do); a variable left
  unmatched keeps what the graph gave it.
  """
  free = list(saved)
  pairs = {}

  def ok(v, s):
    return (not v.dtype or v.dtype == s.dtype) and _compatible(v.shape, s.shape)

  def take(v, s):
    pairs[v.node] = s
    free.remove(s)

  for v in variables:  # 1
    s = next((s for s in free if s.name == v.name and ok(v, s)), None)
    if s is not None:
      take(v, s)
  for v in variables:  # 2
    if v.node in pairs or v.role in ("slot",):
      continue
    same = [s for s in free if s.name.rpartition("/")[0] == v.scope and ok(v, s)]
    if len(same) > 1:
      same = [s for s in same if s.name.rpartition("/")[2] == v.role] or same
    if len(same) > 1 and _full(v.shape):
      same = [s for s in same if s.shape == v.shape]
    if len(same) == 1:
      take(v, same[0])
  by_node = {v.node: v for v in variables}
  for v in variables:  # 3
    if v.node in pairs or v.owner is None:
      continue
    owner = by_node[v.owner]
    owner_name = pairs[owner.node].name if owner.node in pairs else owner.name
    pattern = re.compile(r"(^|_)" + re.escape(_flat(owner_name)) + r"(_\d+)?(_[A-Za-z]+)?$")
    same = [s for s in free if pattern.search(_flat(s.name)) and ok(v, s)]
    if same:
      take(v, same[0])
  changed = True
  while changed:  # 4
    changed = False
    rest = [v for v in variables if v.node not in pairs]
    for v in rest:
      fits = [s for s in free if ok(v, s)]
      if len(fits) == 1 and [w for w in rest if ok(w, fits[0])] == [v]:
        take(v, fits[0])
        changed = True
        break
  used = {v.name for v in variables if v.node not in pairs}
  for v in variables:
    s = pairs.get(v.node)
    if s is None:
      continue
    if not v.known:
      v.source = SOURCE_SAVED
    v.shape, v.dtype = tuple(s.shape), v.dtype or s.dtype
    if s.named and s.name not in used:
      v.name = s.name  # an object path ('model/head/_kernel') says less than ours
    used.add(v.name)
  seen = collections.Counter()
  for v in variables:  # a kept name may equal a saved one taken by another
    seen[v.name] += 1
    if seen[v.name] > 1:
      k = seen[v.name] - 1
      while f"{v.name}_{k}" in used:
        k += 1
      v.name = f"{v.name}_{k}"
      used.add(v.name)
  return len(pairs)


# --- entry points ----------------------------------------------------------------------
def needs_recovery(graph_def):
  """Whether `graph_def` has captured variables tfsplit did not annotate."""
  return any(n.op == "Placeholder" and n.attr["dtype"].type == types_pb2.DT_RESOURCE and
             variables_lib.VAR_SHAPE_ATTR not in n.attr and
             variables_lib.VAR_NAME_ATTR not in n.attr for n in graph_def.node)


@without_gc
def recover(graph_def, variables_from=None):
  """Annotates `graph_def` in place (see the module doc); a RecoveryReport.

  Only unannotated captures are touched; inputs and outputs are marked only
  when nothing is marked yet. Variables whose shape stays unknown get a name
  and dtype but no shape (`missing` in the report).
  """
  graph = Graph(graph_def)
  marked_out = any(variables_lib.OUTPUT_INDEX_ATTR in n.attr for n in graph.nodes)
  outputs = (sorted(((n.attr[variables_lib.OUTPUT_INDEX_ATTR].i, n.name) for n in graph.nodes
                     if variables_lib.OUTPUT_INDEX_ATTR in n.attr))
             if marked_out else None)
  outputs = [n for _, n in outputs] if outputs is not None else _recover_outputs(graph)
  inputs = []
  if not marked_out and outputs:
    for index, name in enumerate(outputs):
      graph.node(name).attr[variables_lib.OUTPUT_INDEX_ATTR].i = index
    if not any(variables_lib.INPUT_INDEX_ATTR in n.attr for n in graph.nodes):
      inputs = [n.name for n in graph.nodes if n.op == "Placeholder" and
                not variables_lib.is_variable_node(n)]
      for index, name in enumerate(inputs):
        graph.node(name).attr[variables_lib.INPUT_INDEX_ATTR].i = index

  handles = [n.name for n in graph.nodes if n.op == "Placeholder" and
             n.attr["dtype"].type == types_pb2.DT_RESOURCE and
             variables_lib.VAR_SHAPE_ATTR not in n.attr and
             variables_lib.VAR_NAME_ATTR not in n.attr]
  report = RecoveryReport([], inputs, outputs)
  if not handles:
    return report
  st = _Structure(graph, handles)
  variables = [Recovered(h, dtype=variables_lib._dtype_from_users(graph, graph.node(h)))  # pylint: disable=protected-access
               for h in handles]
  inf = _Inference(graph)
  _solve(graph, st, inf, variables)
  _name_variables(graph, st, variables, outputs)
  if variables_from is not None:
    saved = read_saved_variables(variables_from)
    report.matched = match_saved_variables(variables, saved)
    if report.matched and any(not v.known for v in variables):
      _solve(graph, st, inf, variables)  # saved shapes may determine others
  report.variables = variables
  report.hints = len(inf.hints)
  report.rounds = inf.runs
  for v in variables:
    node = graph.node(v.node)
    node.attr[variables_lib.VAR_NAME_ATTR].s = v.name.encode()
    if v.dtype:
      node.attr[variables_lib.VAR_DTYPE_ATTR].type = v.dtype
    if v.trainable is not None:
      node.attr[variables_lib.VAR_TRAINABLE_ATTR].b = v.trainable
    if v.known and v.dtype:
      node.attr[variables_lib.VAR_SHAPE_ATTR].shape.CopyFrom(
          tensor_shape.TensorShape(v.shape).as_proto())
  logging.info("recovered %s", report.summary())
  return report


def require_variable_shapes(graph_def, label="graph"):
  """Raises TfsplitError (one line) if a captured variable has no known shape."""
  missing, total = [], 0
  for node in graph_def.node:
    if not variables_lib.is_variable_node(node) or node.op != "Placeholder":
      continue
    total += 1
    if variables_lib.VAR_SHAPE_ATTR not in node.attr or \
        variables_lib.VAR_DTYPE_ATTR not in node.attr:
      name = (node.attr[variables_lib.VAR_NAME_ATTR].s.decode()
              if variables_lib.VAR_NAME_ATTR in node.attr else node.name)
      missing.append(Recovered(node.name, name=name, trainable=(
          node.attr[variables_lib.VAR_TRAINABLE_ATTR].b
          if variables_lib.VAR_TRAINABLE_ATTR in node.attr else None)))
  if missing:
    raise TfsplitError(missing_shapes_message(label, missing, total))
