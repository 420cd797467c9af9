"""Variable handles through the graph: which variable a handle input names,
which ops use a variable, which variables an update computes from; and the
bounded breadth-first walk that searches up from an update share.

A resource handle reaches its users from the variable's node directly or
through ops that pass it on unchanged: an Identity (a lowered conditional's
branch argument) and an IdentityN (output k is input k; the split's first
pass, graph/fold.py, expands each into Identities). The walks follow the ops
a caller names in `through`, Identity alone by default.
"""
import collections

from tfsplit import constants
from tfsplit.graph.ir import Graph, parse_input

IDENTITY = frozenset(["Identity"])
IDENTITY_AND_N = frozenset(["Identity", "IdentityN"])


class BoundedWalk(object):
  """A breadth-first walk that visits each item once and at most `limit`
  items in all: iterating yields the next unvisited item; `follow` queues
  more behind those already queued.

      walk = BoundedWalk(starts, limit)
      for item in walk:
        walk.follow(next_items(item))
  """

  def __init__(self, starts, limit):
    self._queue = collections.deque(starts)
    self._seen = set()
    self._limit = limit

  def __iter__(self):
    while self._queue and len(self._seen) < self._limit:
      item = self._queue.popleft()
      if item in self._seen:
        continue
      self._seen.add(item)
      yield item

  def follow(self, items):
    """Queues `items` to visit after those already queued."""
    self._queue.extend(items)


def handle_of(graph, tensor, var_nodes, through=IDENTITY):
  """The variable node whose handle the tensor `tensor` (an input string:
  'node' or 'node:k') carries, walked back through ops in `through`; None
  when it comes from anything else."""
  name, port = parse_input(tensor)
  while name not in var_nodes:
    node = graph.get(name)
    if node is None or node.op not in through:
      return None
    index = port if node.op == "IdentityN" else 0
    if not 0 <= index < len(node.input):
      return None
    name, port = parse_input(node.input[index])
  return name


def handle_users(graph, var_nodes, through=IDENTITY):
  """{variable node: [NodeDefs taking its handle as a data input]}, the
  handle followed through ops in `through` (which are not users
  themselves)."""
  users = collections.defaultdict(list)
  for node in graph.nodes:
    if node.op in through or not node.input or node.name in var_nodes:
      continue
    for text in node.input:
      if text.startswith("^"):
        continue
      handle = handle_of(graph, text, var_nodes, through)
      if handle is not None:
        users[handle].append(node)
  return users


def variables_read_by(graph, op, var_nodes, roles, limit):
  """Variable nodes whose values op `op` computes from within the update:
  the variables that read ops (a ReadVariableOp) read, through Identity,
  found up from `op` through the ops of role UPDATE it reads (at most
  `limit` ops visited)."""
  found = set()
  walk = BoundedWalk([op], limit)
  for name in walk:
    node = graph.node(name)
    if node.op in constants.VARIABLE_READ_OPS and node.input:
      handle = handle_of(graph, node.input[0], var_nodes)
      if handle is not None:
        found.add(handle)
      continue
    walk.follow(src for src, _ in graph.data_inputs(name)
                if roles.get(src) == constants.UPDATE and src not in var_nodes)
  return found


def variables_used_by(graph, op, var_nodes, roles, limit):
  """Variable nodes whose handles op `op`, or an op of role UPDATE above it,
  takes as a data input, through Identity: what it reads (Adam's moments in
  the weight's step), what a fused op updates with its variable
  (ResourceApplyAdam's slots) and what `op` writes. The walk goes up through
  every op of role UPDATE, read ops included (at most `limit` ops
  visited)."""
  found = set()
  walk = BoundedWalk([op], limit)
  for name in walk:
    for src, _ in graph.data_inputs(name):
      handle = handle_of(graph, src, var_nodes)
      if handle is not None:
        found.add(handle)
      elif roles.get(src) == constants.UPDATE:
        walk.follow([src])
  return found


def gathers_as_reads(graph_def, graph, handles):
  """(GraphDef, the number rewritten): `graph_def` (indexed as `graph`) with
  each ResourceGather of a variable in `handles` written as a ReadVariableOp
  of the variable and a GatherV2 of the value, under the gather's name (the
  same rows, the same gradient), so a variable split where the gather has
  no rule for it is read whole by the gather alone."""
  from tensorflow.core.framework import attr_value_pb2, graph_pb2, types_pb2  # pylint: disable=import-outside-toplevel
  from tensorflow.python.framework import tensor_util  # pylint: disable=import-outside-toplevel
  var_nodes = set(handles)
  targets = [n.name for n in graph.nodes if n.op == "ResourceGather" and n.input and
             handle_of(graph, n.input[0], var_nodes) is not None]
  if not targets:
    return graph_def, 0
  out = graph_pb2.GraphDef()
  out.CopyFrom(graph_def)
  edited = Graph(out)

  def of_type(dtype):
    return attr_value_pb2.AttrValue(type=dtype)

  for name in targets:
    node = edited.node(name)
    dtype, batch_dims = node.attr["dtype"].type, node.attr["batch_dims"].i
    tindices, device = node.attr["Tindices"].type, node.device
    read = edited.add_node(edited.unique_name(f"{name}/read"), "ReadVariableOp",
                           [node.input[0]], {"dtype": of_type(dtype)}, device).name
    axis = edited.add_node(edited.unique_name(f"{name}/axis"), "Const", (), {
        "dtype": of_type(types_pb2.DT_INT32),
        "value": attr_value_pb2.AttrValue(tensor=tensor_util.make_tensor_proto(
            batch_dims, types_pb2.DT_INT32))}, device).name
    edited.set_inputs(name, [read, node.input[1], axis] +
                      [t for t in node.input if t.startswith("^")])
    node.op = "GatherV2"
    for key in [k for k in node.attr if not k.startswith("_")]:
      del node.attr[key]
    for key, dt in (("Tparams", dtype), ("Tindices", tindices), ("Taxis", types_pb2.DT_INT32)):
      node.attr[key].type = dt
    node.attr["batch_dims"].i = batch_dims
  return out, len(targets)
