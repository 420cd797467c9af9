"""Who reads and who writes each captured variable of a plain graph, and
the function's outputs: `Structure` indexes, once per recovery, each
handle's reads, full-value writers, ResourceApply* and ResourceScatter* ops
(with the op sets that tell them apart), so that the shape rules, the hints
and the naming walk those lists instead of searching the graph; it sits at
the bottom of graph/recover*.py because all of them read it.
"""
import collections
import re

from tensorflow.python.framework import op_def_registry

from tfsplit.graph.ir import Graph, parse_input

GRADIENT_PREFIX = re.compile(r"^(gradient_tape|gradients(?:_\d+)?)/")
_OUTPUT_NAME = re.compile(r"^Identity(?:_(\d+))?$")

_READ_OPS = frozenset(["ReadVariableOp", "ResourceGather", "ResourceGatherNd"])
FULL_VALUE_WRITERS = frozenset(
    ["AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"])
# Shape-preserving ops a variable's value passes through unchanged in shape.
SAME_SHAPE = frozenset([
    "Identity", "Cast", "StopGradient", "Snapshot", "PreventGradient", "Neg",
    "Square", "Sqrt", "Rsqrt", "Exp", "Log", "Log1p", "Abs", "Sign", "Reciprocal",
    "Relu", "Relu6", "Sigmoid", "Tanh", "Erf", "Erfc", "Floor", "Ceil", "Round",
    "Softplus", "Softsign", "Elu", "Selu", "ZerosLike", "OnesLike", "Inv"])


def output_dtype(graph, name, port):
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


class Structure(object):
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
          elif node.op in FULL_VALUE_WRITERS and len(data) > 1:
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

  def view_consumers(self, read, views=SAME_SHAPE):
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


def recover_outputs(graph):
  """The function's results: see graph/recover.py's module doc."""
  noops = {n.name for n in graph.nodes if n.op == "NoOp"}
  sinks = [n for n in graph.nodes if not graph.consumers(n.name) and
           n.op in ("Identity", "IdentityN")]
  after_noop = [n for n in sinks if any(c in noops for c in Graph.control_inputs(n))]
  named = [n for n in sinks if _OUTPUT_NAME.match(n.name)]

  def number(node):
    m = _OUTPUT_NAME.match(node.name)
    return int(m.group(1) or 0) if m else -1
  return [n.name for n in sorted(after_noop or named, key=number)]
