"""The `megatron` preset: tensor parallelism found from the graph alone.

A *weight contraction* is a MatMul / BatchMatMul / Einsum with a trainable
variable of rank >= 2 as one operand (read directly or through Identity /
Cast / Reshape). Megatron pairs them: the first contraction of a pair is
split along its output features (column-parallel: MLP fc1, attention Q/K/V
by heads), the next weight contraction that consumes it is split along its
input features (row-parallel: MLP fc2, attention output projection), so the
activations between them stay split and only the pair's output needs an
all-reduce. Contractions that feed several others (a block's output feeds
the next block's Q, K and V) and those that feed none (the LM head) stay
replicated.
"""
import collections

from absl import logging

from tfsplit import constants
from tfsplit.errors import PlanError
from tfsplit.graph.fold import const_value
from tfsplit.graph.ir import Graph, parse_input
from tfsplit.layout.spec import KEEP, Constraint
from tfsplit.rules.matmul import _einsum_letters
from tfsplit.rules.shape import _groups
from tfsplit.sharding.gathers import VIEW_OPS

CONTRACTIONS = frozenset(["MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3",
                          "Einsum"])


def _operand_letters(node, shapes):
  """(letters per input, output letters) of a contraction node."""
  ins = [shapes.get(t) for t in node.input if not t.startswith("^")]
  if node.op == "MatMul":
    a = ["m", "k"] if not node.attr["transpose_a"].b else ["k", "m"]
    b = ["k", "n"] if not node.attr["transpose_b"].b else ["n", "k"]
    return [a, b], ["m", "n"]
  if node.op == "Einsum":
    return _einsum_letters(node.attr["equation"].s.decode(), [len(i.shape) for i in ins])
  ra, rb = len(ins[0].shape), len(ins[1].shape)
  nb = max(ra, rb) - 2
  batch = [f"b{i}" for i in range(nb)]
  a = batch[nb - (ra - 2):] + (["k", "m"] if node.attr["adj_x"].b else ["m", "k"])
  b = batch[nb - (rb - 2):] + (["n", "k"] if node.attr["adj_y"].b else ["k", "n"])
  return [a, b], batch + ["m", "n"]


def _trace_to_variable(graph, text, var_by_node):
  """(variable, [view node names]) if `text` is a view of a variable read."""
  chain = []
  name, _ = parse_input(text)
  while True:
    node = graph.node(name)
    if node.op == "ReadVariableOp":
      handle = parse_input(node.input[0])[0]
      return var_by_node.get(handle), chain
    if node.op not in VIEW_OPS:
      return None, chain
    chain.append(name)
    name = parse_input(node.input[0])[0]


def _map_dim_to_variable(graph, shapes, var, chain, operand_dim, operand_shape):
  """The variable dimension whose split splits `operand_dim` of the operand."""
  if tuple(operand_shape) == tuple(var.shape):
    return operand_dim
  for gi, gj in _groups(list(var.shape), list(operand_shape)):
    if operand_dim in gj:
      major_out = next((k for k in gj if operand_shape[k] != 1), None)
      major_in = next((k for k in gi if var.shape[k] != 1), None)
      if major_out == operand_dim and major_in is not None:
        return major_in
  return None


def find_weight_contractions(graph, shapes, variables, roles=None):
  """[(node name, operand index, VariableInfo, view chain)] in topological order."""
  var_by_node = {v.node: v for v in variables if v.trainable is not False}
  found = []
  for name in graph.topological_order():
    node = graph.node(name)
    if node.op not in CONTRACTIONS or constants.is_gradient_name(name):
      continue
    if roles is not None and roles.get(name) != constants.FORWARD:
      continue
    data = [t for t in node.input if not t.startswith("^")]
    for i, text in enumerate(data[:2]):
      var, chain = _trace_to_variable(graph, text, var_by_node)
      if var is not None and var.shape is not None and len(var.shape) >= 2:
        found.append((name, i, var, chain))
        break
  return found


def pair_contractions(graph, shapes, variables, roles):
  """(contractions, {contraction node: 'column' | 'row'}) of the preset."""
  contractions = find_weight_contractions(graph, shapes, variables, roles)
  by_node = {c[0]: c for c in contractions}
  # First weight contractions reached downstream of each contraction.
  reached = {}
  for name in by_node:
    seen, queue, hits = {name}, collections.deque([name]), []
    while queue:
      cur = queue.popleft()
      for consumer in graph.consumer_nodes(cur):
        c = consumer.name
        if c in seen or constants.is_gradient_name(c):
          continue
        if roles is not None and roles.get(c) != constants.FORWARD:
          continue
        seen.add(c)
        if c in by_node:
          hits.append(c)
        else:
          queue.append(c)
    reached[name] = hits
  kind = {}
  for name, _, _, _ in contractions:
    if name in kind:
      continue
    hits = reached[name]
    if len(hits) == 1 and kind.get(hits[0]) != "column":
      kind[name] = "column"
      kind[hits[0]] = "row"
  return contractions, kind


def split_all_reduces(graph, shapes, variables, roles, variable_free):
  """{contraction node the preset splits: all-reduces per step its split
  adds (0, 1)}, as the rewrite emits them.

  A row-parallel contraction's partial output is all-reduced forward. The
  gradient of a column-parallel contraction's input is partial on each
  device and all-reduced backward when that input has a gradient (it
  depends on a variable). Contractions that read one tensor (through views:
  Q, K and V of a pre-norm block) and are its only readers have their
  gradients summed while partial: one all-reduce for all. Where the tensor
  has other readers (the residual of a post-norm block), its gradient adds
  replicated terms to the partial ones, and each is all-reduced first.
  """
  contractions, kind = pair_contractions(graph, shapes, variables, roles)
  count, readers = dict.fromkeys(kind, 0), collections.defaultdict(list)
  for name, operand, _, _ in contractions:
    if kind.get(name) == "row":
      count[name] = 1
    elif kind.get(name) == "column":
      data = [t for t in graph.node(name).input if not t.startswith("^")]
      if len(data) > 1:
        source = _view_source(graph, parse_input(data[1 - operand])[0])
        if source not in variable_free:
          readers[source].append(name)
  for source, columns in readers.items():
    if _only_read_by(graph, source, set(columns), roles):
      count[columns[0]] = 1
    else:
      for name in columns:
        count[name] = 1
  return count


def _view_source(graph, name):
  """The node `name` is a view of (through Identity / Cast / Reshape)."""
  while graph.node(name).op in VIEW_OPS:
    name = parse_input(graph.node(name).input[0])[0]
  return name


def _only_read_by(graph, source, targets, roles):
  """Whether the forward readers of `source`, through views, are `targets`."""
  stack = [source]
  while stack:
    for consumer in graph.consumer_nodes(stack.pop()):
      c = consumer.name
      if c in targets or constants.is_gradient_name(c) or (
          roles is not None and roles.get(c) != constants.FORWARD):
        continue
      if consumer.op not in VIEW_OPS:
        return False
      stack.append(c)
  return True


def megatron_plan(graph, shapes, variables, axis=constants.TENSOR_AXIS, mesh=None, roles=None,
                  embeddings=True):
  """{variable handle node: dims tuple} for the megatron preset; with
  `embeddings`, embedding tables too (embedding_tables)."""
  if not isinstance(graph, Graph):
    graph = Graph(graph)
  contractions, kind = pair_contractions(graph, shapes, variables, roles)
  n = mesh.axes[axis] if mesh is not None else None
  plan = {}
  for name, operand, var, chain in contractions:
    if name not in kind or var.node in plan:
      continue
    node = graph.node(name)
    if var.shape is None or None in var.shape or any(
        i is None or i.shape is None
        for i in (shapes.get(t) for t in node.input if not t.startswith("^"))):
      continue  # a variable or an operand of unknown shape: not split
    letters, out_letters = _operand_letters(node, shapes)
    op_letters = letters[operand]
    if kind[name] == "column":
      dims = [i for i, l in enumerate(op_letters) if l in out_letters]
    else:
      dims = [i for i, l in enumerate(op_letters) if l not in out_letters]
    operand_shape = shapes.get([t for t in node.input if not t.startswith("^")][operand]).shape
    dims = [d for d in dims if operand_shape[d] != 1]
    if not dims:
      continue
    var_dim = _map_dim_to_variable(graph, shapes, var, chain, dims[0], operand_shape)
    if var_dim is None:
      logging.warning("megatron: cannot map the split of '%s' back to variable '%s'; "
                      "left replicated", name, var.name)
      continue
    if n is not None and var.shape[var_dim] % n:
      raise PlanError(
          f"node '{name}' (op {node.op}): variable '{var.name}' dimension {var_dim} "
          f"(size {var.shape[var_dim]}, the {'heads/output features' if kind[name] == 'column' else 'input features'}) "
          f"does not divide by {axis}={n}; use a {axis} size that divides "
          f"{var.shape[var_dim]}")
    dims_spec = [None] * len(var.shape)
    dims_spec[var_dim] = axis
    plan[var.node] = tuple(dims_spec)
    logging.info("megatron: %s '%s' (%s) splits variable '%s' dim %d", kind[name],
                 name, node.op, var.name, var_dim)
  for var, gathers in embedding_tables(graph, variables) if embeddings else ():
    if var.node not in plan and (n is None or var.shape[1] % n == 0) and \
        _gathers_collect(shapes, gathers) and not _scattered(graph, var) and \
        not _cast_for_compute(graph, var):
      plan[var.node] = (None, axis)
      logging.info("megatron: embedding table '%s' split along its hidden dimension",
                   var.name)
  return plan


def embedding_tables(graph, variables):
  """[(variable, [gather node])] of the trainable [vocabulary, hidden]
  variables whose rows are gathered (ResourceGather of the handle, or
  GatherV2 along axis 0 of a read). Split along the hidden dimension, each
  device gathers its columns of every row, so the table (and a tied LM head
  reading it) is never held whole by every device; the vocabulary dimension
  a gather cannot split (rules/variables.py)."""
  tables = []
  for var in variables:
    if var.trainable is False or var.shape is None or len(var.shape) != 2 or \
        None in var.shape:
      continue
    stack, seen, gathers = [var.node], set(), []
    while stack:
      name = stack.pop()
      for consumer, index in graph.consumers(name, port=0):
        node = graph.node(consumer)
        if consumer in seen or index != 0:
          continue
        seen.add(consumer)
        if node.op in ("Identity", "ReadVariableOp"):
          stack.append(consumer)
        elif (node.op == "ResourceGather" and node.attr["batch_dims"].i == 0) or (
            node.op == "GatherV2" and _is_axis_zero(graph, node)):
          gathers.append(consumer)
    if gathers:
      tables.append((var, gathers))
  return tables


def embedding_constraints(graph, shapes, variables, plan, axis):
  """Sharding constraints that make each gather of an embedding table the
  plan splits along its hidden dimension (embedding_tables) whole again
  right away (one all-gather of the looked-up rows over the tensor axis), so
  the residual stream after it is replicated over it as the rest of the
  preset expects; its other dimensions keep their split (the batch over dp)."""
  found = []
  for var, gathers in embedding_tables(graph, variables):
    if plan.get(var.node) != (None, axis):
      continue
    for name in gathers:
      info = shapes.tensor(name, 0)
      if info is not None and info.shape is not None:
        found.append(Constraint(f"{name}/embedding_gather", (name, 0),
                                (KEEP,) * (len(info.shape) - 1) + (None,)))
  return found


# What a CollectiveGatherV2 takes on every device type (not bfloat16 on CPU).
_GATHERABLE = frozenset([1, 2, 3, 9, 19])   # float, double, int32, int64, half


def _gathers_collect(shapes, gathers):
  """Whether every lookup's rows can be all-gathered (their dtype)."""
  for name in gathers:
    info = shapes.tensor(name, 0)
    if info is None or info.dtype not in _GATHERABLE:
      logging.info("megatron: '%s' gathers a dtype a collective cannot; its table "
                   "stays replicated", name)
      return False
  return True


def _scattered(graph, var):
  """Whether a sparse update writes the table's rows (ResourceScatter*,
  ResourceSparseApply*): those have no split rule along the hidden dimension."""
  for consumer, _ in graph.consumers(var.node):
    op = graph.node(consumer).op
    if op.startswith("ResourceScatter") or op.startswith("ResourceSparseApply"):
      return True
  return False


def _cast_for_compute(graph, var):
  """Whether a read of the table is cast to a dtype a collective cannot
  gather (mixed bfloat16 on CPU): its split would move such a tensor."""
  stack, seen = [var.node], set()
  while stack:
    for consumer, _ in graph.consumers(stack.pop(), port=0):
      node = graph.node(consumer)
      if consumer in seen:
        continue
      seen.add(consumer)
      if node.op in ("Identity", "ReadVariableOp"):
        stack.append(consumer)
      elif node.op == "Cast" and node.attr["DstT"].type not in _GATHERABLE:
        return True
  return False


def _is_axis_zero(graph, node):
  axis = graph.node(parse_input(node.input[2])[0]) if len(node.input) > 2 else None
  if axis is None or axis.op != "Const" or node.attr["batch_dims"].i != 0:
    return False
  return int(const_value(axis)) == 0
