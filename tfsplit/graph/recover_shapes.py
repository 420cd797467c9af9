"""Shape inference over the recovery's copy of the graph (`Inference`), and
what each use of a captured variable says of its shape: the ops a read
feeds, the values its updates write, the rows scattered into it, the tensors
it is combined with, and what the updates of variables of known shape
require of the reads they write. Partial shapes are tuples with None for an
unknown dimension (`merge`, `compatible`, `full`); the rules here only read
the inference, and the order in which they are applied is
recover_fixpoint.py's, so that each rule can be read on its own.
"""
import collections

from absl import logging
from tensorflow.python.framework import tensor_util

from tfsplit.errors import GraphValidationError
from tfsplit.graph.ir import parse_input
from tfsplit.graph.recover_hints import (fold_shape_arithmetic, gradient_shape_constants,
                                         inference_graph, shape_constant_targets)
from tfsplit.graph.recover_structure import SAME_SHAPE

# What fixed a variable's shape (`Recovered.source`; RecoveryReport.sources
# counts them): recover_fixpoint.py's doc says what each means.
SOURCE_UPDATE = "update"
SOURCE_READER = "reader"
SOURCE_OPERAND = "operand"
SOURCE_SCALAR = "scalar operand"
SOURCE_CONSTANT = "gradient constant"
SOURCE_RECORDED = "recorded read shape"
SOURCE_WRITTEN = "written value"
SOURCE_SAVED = "--variables"

_MAX_CHAIN = 64           # nodes walked back from an update's value
_BINARY = frozenset([
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "MulNoNan",
    "Maximum", "Minimum", "Pow", "SquaredDifference", "FloorDiv", "FloorMod",
    "TruncateDiv", "Xdivy", "Xlogy", "Xlog1py"])


def merge(a, b):
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


def compatible(a, b):
  try:
    merge(a, b)
    return True
  except ValueError:
    return False


def full(shape):
  return shape is not None and all(d is not None for d in shape)


class Inference(object):
  """TF's shape inference on the graph, with variable shapes and hints."""

  def __init__(self, graph):
    self.graph = graph
    self.shape_targets = shape_constant_targets(graph)
    self.hint_candidates = gradient_shape_constants(graph, self.shape_targets)  # tensor -> shape
    self.folded = fold_shape_arithmetic(graph)  # node -> TensorProto
    self.hints = {}        # tensor -> shape, in use
    self.shapes = None     # ShapeMap of the last run
    self.runs = 0
    self._copy = None      # the graph inference runs on
    self._hint_nodes = {}  # tensor -> its EnsureShape node in _copy

  def run(self, var_shapes):
    from tfsplit.graph import shapes as shapes_lib  # pylint: disable=import-outside-toplevel
    if self._copy is None:
      self._copy, self._hint_nodes = inference_graph(self.graph, self.hints, self.folded)
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
      if full(current) or not compatible(current, shape):
        continue
      self.hints[tensor] = shape
      added += 1
    if added:
      self._copy = None
    return added


def reader_shape(st, inf, var, read):
  """Partial shape of `var` from the ops `read` feeds (None: nothing learnt)."""
  shape = var.shape
  rank = None if shape is None else len(shape)

  def learn(found):
    nonlocal shape
    if found is not None:
      shape = merge(shape, found)

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
    return merge(mine, found)
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


def scatter_shape(st, inf, var):
  """Partial shape of `var` from ResourceScatter* ops writing rows of it."""
  shape = None
  for node in st.users[var.node]:
    if not node.op.startswith("ResourceScatter") or node.op.endswith("NdUpdate"):
      continue
    data = [t for t in node.input if not t.startswith("^")]
    idx, updates = inf.shape(data[1]), inf.shape(data[2])
    if idx is not None and updates is not None and len(updates) >= len(idx):
      shape = merge(shape, (None,) + tuple(updates[len(idx):]))
  return shape


def update_shapes(st, inf, var):
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


def operand_candidates(st, inf, var, owner_shape=None):
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
    if full(shape):
      chain.append(shape)
      continue
    if node.op in _BINARY or node.op in SAME_SHAPE or node.op == "AddN":
      queue.extend(t for t in node.input if not t.startswith("^"))
  for read in st.reads[var.node]:
    if read.op != "ReadVariableOp":
      continue
    for node, index, _ in st.view_consumers(read):
      if node.op in _BINARY and index in (0, 1):
        other = inf.shape(node.input[1 - index])
        if full(other):
          reads.append(other)
  out = []
  owner = [owner_shape] if owner_shape is not None else []
  for shape in owner + sorted(chain, key=lambda s: -len(s)) + sorted(
      reads, key=lambda s: -len(s)) + [()]:
    if shape not in out and compatible(var.shape, shape):
      out.append(shape)
  return out, reads


def requirements(st, inf, by_node):
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
            elif full(v.shape):
              bounds[handle].append(v.shape)
        elif node.op in SAME_SHAPE and data:
          stack.append((data[0], is_exact))
        elif node.op == "AddN":
          stack.extend((t, is_exact) for t in data)
        elif node.op in _BINARY and len(data) == 2:
          for i in (0, 1):
            scalar_partner = inf.shape(data[1 - i]) == ()
            if (is_exact and scalar_partner) or full(v.shape):
              stack.append((data[i], is_exact and scalar_partner))
  return exact, bounds
