"""An indexed, editable view of a GraphDef.

`Graph` keeps the NodeDef protos themselves (no copies per node) plus the
indexes that every pass needs: nodes by name, parsed inputs, consumers, a
topological order and unique-name generation. Edits go through its methods so
the indexes stay true; `to_graph_def()` gives the result back as a GraphDef
with a stable node order (original order, then added nodes in insertion order),
which keeps a pass's output byte-identical from run to run.
"""
import collections
import contextlib
import functools
import gc

from tensorflow.core.framework import graph_pb2

from tfsplit.errors import GraphValidationError

# Ops whose data input closes a loop in TF1-style control flow; the edge from
# them is ignored when ordering (the loop is legal there).
_LOOP_BACK_OPS = frozenset(["NextIteration", "RefNextIteration"])


@contextlib.contextmanager
def gc_paused():
  """Pauses Python's cyclic GC: passes allocate millions of small objects and
  never make cycles, and full collections over them grow with graph size."""
  was_enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if was_enabled:
      gc.enable()


def without_gc(fn):
  """Decorator form of gc_paused for whole passes."""
  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    with gc_paused():
      return fn(*args, **kwargs)
  return wrapper


def parse_input(text):
  """'^name' -> (name, -1); 'name:3' -> (name, 3); 'name' -> (name, 0)."""
  if text.startswith("^"):
    return text[1:], -1
  name, sep, port = text.rpartition(":")
  if sep and port.isdigit():
    return name, int(port)
  return text, 0


def input_node(text):
  """The node an input string reads: '^name', 'name:3' and 'name' -> 'name'."""
  return parse_input(text)[0]


def _parse_every(inputs):
  """[(name, port)] of input strings `inputs`, control inputs with port -1."""
  out = []
  for text in inputs:
    if text[:1] == "^":
      out.append((text[1:], -1))
    elif ":" in text:
      out.append(parse_input(text))
    else:
      out.append((text, 0))
  return out


def inputs_come_first(graph_def):
  """Whether every input of every node of `graph_def` names an earlier node
  and no name repeats: then the graph is acyclic and its node order a
  topological one (False says nothing: Graph and its topological_order
  decide, loop back edges allowed)."""
  seen = set()
  add = seen.add
  for node in graph_def.node:
    for text in node.input:
      if text[:1] == "^":
        text = text[1:]
      elif ":" in text:
        text = parse_input(text)[0]
      if text not in seen:
        return False
    if node.name in seen:
      return False  # defined twice: Graph says so
    add(node.name)
  return True


def tensor_name(node_name, port=0):
  """The input string for output `port` of `node_name` ('n' for port 0)."""
  return node_name if port == 0 else f"{node_name}:{port}"


def control_input(node_name):
  return "^" + node_name


def element_count(shape):
  """Elements of a fully known shape, else None."""
  if shape is None or any(d is None or d < 0 for d in shape):
    return None
  n = 1
  for d in shape:
    n *= d
  return n


def delete_nodes(graph_def, names):
  """Deletes the nodes named in the set `names` from `graph_def`, in place.
  Each run of neighbours goes in one
  slice, from the last run back: no other NodeDef is copied (rebuilding the
  node list copies every node kept), and the nodes after a run move once
  per run, not once per node (a split's constants sit in runs of
  neighbours)."""
  delete_positions(graph_def, [i for i, node in enumerate(graph_def.node)
                               if node.name in names])


def delete_positions(graph_def, positions):
  """Deletes the nodes at the ascending `positions` of `graph_def`, in place
  (see delete_nodes)."""
  runs = []
  for i in positions:
    if runs and runs[-1][1] == i:
      runs[-1][1] = i + 1
    else:
      runs.append([i, i + 1])
  for start, stop in reversed(runs):
    del graph_def.node[start:stop]


class Graph(object):
  """Indexed view over a GraphDef; the GraphDef's NodeDefs are shared."""

  @without_gc
  def __init__(self, graph_def):
    self._graph_def = graph_def
    self.library = graph_def.library
    self.versions = graph_def.versions
    self._nodes = {node.name: node for node in graph_def.node}
    if len(self._nodes) != len(graph_def.node):
      seen = set()
      for node in graph_def.node:
        if node.name in seen:
          raise GraphValidationError(
              f"node '{node.name}' (op {node.op}) is defined twice; node names "
              "must be unique in a GraphDef")
        seen.add(node.name)
    self._invalidate()
    self._used_names = None

  def _invalidate(self):
    """Drops what edits make stale."""
    self._consumers = None  # built lazily: name -> list of (consumer, index, port)
    self._data_inputs = None  # built lazily: name -> ((source, port), ...)
    # Built lazily: name -> ((source, port), ...) of every input, control ones
    # with port -1; the indexes above and the order derive from it, so each
    # input string is read from its proto and parsed once per graph.
    self._inputs = None
    self._node_list = None
    self._order = None      # cached topological order

  # --- reading ---------------------------------------------------------------
  def __contains__(self, name):
    return name in self._nodes

  def __len__(self):
    return len(self._nodes)

  def node(self, name):
    try:
      return self._nodes[name]
    except KeyError:
      raise GraphValidationError(f"no node named '{name}' in the graph") from None

  def get(self, name):
    return self._nodes.get(name)

  @property
  def nodes(self):
    """NodeDefs in stable order."""
    if self._node_list is None:
      self._node_list = list(self._nodes.values())
    return list(self._node_list)

  def node_names(self):
    return list(self._nodes)

  @staticmethod
  def inputs(node):
    """[(source_name, port)] of the data inputs of `node`."""
    return [parse_input(s) for s in node.input if not s.startswith("^")]

  @staticmethod
  def control_inputs(node):
    return [s[1:] for s in node.input if s.startswith("^")]

  def data_inputs(self, name):
    """((source_name, port), ...) of the data inputs of node `name`, parsed
    once per graph (every pass reads them many times)."""
    if self._data_inputs is None:
      self._data_inputs = self._parse_all()
    return self._data_inputs[name]

  @without_gc
  def _every_input(self):
    if self._inputs is None:
      self._inputs = {n: tuple(_parse_every(node.input)) for n, node in self._nodes.items()}
    return self._inputs

  @without_gc
  def _parse_all(self):
    return {n: tuple(p for p in ins if p[1] >= 0) if ins else ins
            for n, ins in self._every_input().items()}

  @without_gc
  def _build_consumers(self):
    consumers = collections.defaultdict(list)
    for name, ins in self._every_input().items():
      for index, (src, port) in enumerate(ins):
        consumers[src].append((name, index, port))
    self._consumers = consumers

  def consumers(self, name, port=None):
    """[(consumer_name, input_index)] reading node `name`.

    port=None: every consumer, data and control; port=k: data consumers of
    output k; port=-1: control consumers only.
    """
    if self._consumers is None:
      self._build_consumers()
    found = self._consumers.get(name, ())
    if port is None:
      return [(consumer, index) for consumer, index, _ in found]
    return [(consumer, index) for consumer, index, p in found if p == port]

  def has_consumers(self, name):
    """Whether any node reads `name` (data or control)."""
    if self._consumers is None:
      self._build_consumers()
    return bool(self._consumers.get(name))

  def consumer_nodes(self, name):
    """Distinct consumer NodeDefs of `name` (data or control), stable order."""
    if self._consumers is None:
      self._build_consumers()
    seen = {}
    for consumer, _, _ in self._consumers.get(name, ()):
      seen[consumer] = None
    return [self._nodes[c] for c in seen]

  # --- checks and order ------------------------------------------------------
  def dangling_inputs(self):
    """[(node, input_text)] whose source node does not exist."""
    bad = []
    for node in self._nodes.values():
      for text in node.input:
        if parse_input(text)[0] not in self._nodes:
          bad.append((node, text))
    return bad

  def data_ancestors(self, roots):
    """Names of `roots` and every node they read data from, transitively."""
    seen, stack = set(), list(roots)
    for name in stack:  # raises for a missing node, as node() does
      self.node(name)
    while stack:
      name = stack.pop()
      if name in seen:
        continue
      seen.add(name)
      for src, _ in self.data_inputs(name):
        if src not in seen:
          if src not in self._nodes:
            self.node(src)
          stack.append(src)
    return seen

  def topological_order(self):
    """Names in an order where every input comes first (Kahn's algorithm).

    Ties keep the original node order, so the result is deterministic.
    Raises GraphValidationError naming a node on a cycle. Cached until the
    graph is edited through this object.
    """
    if self._order is None:
      self._order = self._compute_order()
    return list(self._order)

  @without_gc
  def _compute_order(self):
    """Kahn's order, the smallest node index first among the ready nodes,
    in one scan in node order: a node whose inputs are all out when its turn
    comes goes then; one waiting for a later node goes as soon as its last
    input is out (before any later node), where smallest-first Kahn puts it.
    Graphs in order (a traced function has one late edge, a split none) pay
    one look-up per input, not the edge lists and a heap operation per node."""
    import heapq  # pylint: disable=import-outside-toplevel
    nodes = self._nodes
    names = list(nodes)
    index = {name: i for i, name in enumerate(names)}
    loop_back = {i for i, node in enumerate(nodes.values()) if node.op in _LOOP_BACK_OPS}
    every = self._every_input()
    out = [False] * len(names)
    order = []
    missing = {}   # waiting node -> inputs not out yet
    waiters = {}   # node -> nodes waiting for it (once per edge)
    ready = []     # heap of waiting nodes whose inputs are all out

    def emit(i):
      out[i] = True
      order.append(i)
      for waiter in waiters.pop(i, ()):
        missing[waiter] -= 1
        if not missing[waiter]:
          del missing[waiter]
          heapq.heappush(ready, waiter)

    for i, name in enumerate(names):
      while ready:   # waiting nodes come before node i: their index is smaller
        emit(heapq.heappop(ready))
      count = 0
      for k, (src, _) in enumerate(every[name]):
        j = index.get(src)
        if j is None:
          node = nodes[name]
          raise GraphValidationError(
              f"node '{name}' (op {node.op}) reads '{node.input[k]}', but no node "
              f"'{src}' exists; the graph is incomplete or was cut badly")
        if out[j] or j in loop_back:
          continue
        waiters.setdefault(j, []).append(i)
        count += 1
      if count:
        missing[i] = count
      else:
        emit(i)
    while ready:
      emit(heapq.heappop(ready))
    if len(order) != len(names):
      stuck = [names[i] for i in sorted(missing)]
      cycle = self._find_cycle(set(stuck))
      raise GraphValidationError(
          f"the graph has a cycle through node '{cycle[0]}' (op "
          f"{self._nodes[cycle[0]].op}): {' -> '.join(cycle)}; a GraphDef "
          "must be acyclic (except TF1 while loops through NextIteration)")
    return [names[i] for i in order]

  def _find_cycle(self, stuck):
    """A cycle among `stuck` nodes, as a list of names (for error messages)."""
    start = min(stuck, key=list(self._nodes).index)
    path, on_path = [], {}
    node = start
    while node not in on_path:
      on_path[node] = len(path)
      path.append(node)
      node = next(src for src, _ in (parse_input(t) for t in self._nodes[node].input)
                  if src in stuck and self._nodes[src].op not in _LOOP_BACK_OPS)
    return path[on_path[node]:] + [node]

  # --- editing ---------------------------------------------------------------
  def unique_name(self, base):
    """`base`, or `base_1`, `base_2`, ... whichever is not taken yet."""
    if self._used_names is None:
      self._used_names = set(self._nodes)
    name, i = base, 0
    while name in self._used_names or name in self._nodes:
      i += 1
      name = f"{base}_{i}"
    self._used_names.add(name)
    return name

  def add_node(self, name, op, inputs=(), attrs=None, device=None):
    """Adds a node named `name` (must be free; see unique_name)."""
    if name in self._nodes:
      raise GraphValidationError(f"cannot add node '{name}' (op {op}): the name is taken")
    self._order = None
    self._node_list = None
    node = self._graph_def.node.add()
    node.name = name
    node.op = op
    node.input.extend(inputs)
    for key, value in (attrs or {}).items():
      node.attr[key].CopyFrom(value)
    if device:
      node.device = device
    self._nodes[name] = node
    if self._used_names is not None:
      self._used_names.add(name)
    parsed = tuple(_parse_every(node.input))
    if self._consumers is not None:
      for index, (src, port) in enumerate(parsed):
        self._consumers[src].append((name, index, port))
    if self._inputs is not None:
      self._inputs[name] = parsed
    if self._data_inputs is not None:
      self._data_inputs[name] = tuple(p for p in parsed if p[1] >= 0)
    return node

  def add_node_def(self, node_def):
    """Adds a copy of `node_def` (its name must be free)."""
    node = self.add_node(node_def.name, node_def.op, node_def.input, None,
                         node_def.device)
    for key in node_def.attr:
      node.attr[key].CopyFrom(node_def.attr[key])
    return node

  def set_inputs(self, name, inputs):
    node = self._nodes[name]
    del node.input[:]
    node.input.extend(inputs)
    self._invalidate()

  def replace_input(self, name, index, new_text):
    self._nodes[name].input[index] = new_text
    self._invalidate()

  def rewire(self, old_tensor, new_tensor, exclude=()):
    """Makes every data consumer of `old_tensor` (but `exclude`) read `new_tensor`."""
    src, port = parse_input(old_tensor)
    for consumer, index in self.consumers(src, port):
      if consumer not in exclude:
        self._nodes[consumer].input[index] = new_tensor
    self._invalidate()

  def remove_nodes(self, names):
    """Removes nodes; callers must have rewired their consumers first."""
    names = set(names)
    if not names:
      return
    delete_nodes(self._graph_def, names)
    for name in names:
      self._nodes.pop(name, None)
    self._invalidate()

  def to_graph_def(self):
    """A new GraphDef: nodes in stable order, library and versions kept."""
    out = graph_pb2.GraphDef()
    out.versions.CopyFrom(self._graph_def.versions)
    out.library.CopyFrom(self._graph_def.library)
    out.node.extend(self._nodes.values())
    return out

  @property
  def graph_def(self):
    """The underlying GraphDef (edited in place by this object)."""
    return self._graph_def
