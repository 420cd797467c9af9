"""Layer detection: forward ops, their gradient ops and their updates, per layer.

Roles come from the graph's structure, layers from name scopes:
- *forward*: data ancestors of the graph's outputs (the loss of a training
  step), minus gradient ops;
- *backward*: ops named `gradient_tape/<forward scope>/...` (TF2) or
  `gradients/<forward scope>/...` (TF1), plus unscoped ops fed only by them
  (e.g. the AddN that sums a weight's gradients) and a custom gradient's
  unscoped ops (tf.nn.silu's), which read activations and feed the backward;
- *update*: everything else: the optimizer's ops and variable writes.

Layers are found by structure: the model's repeated blocks are sibling
scopes, at any depth, with the same forward ops and parameter shapes (of all
such groups, the one holding the most parameters: `gpt/block_3`, or
`causal_lm/backbone/block_3` in a task model wrapping a backbone). Each block
is a layer; elsewhere a layer is the scope that branches off the blocks'
parent (the embedding, the final norm, a task model's head). Without repeated
blocks, layers are the scopes just below the common scope of all the ops that
read trainable variables in the forward pass (`functional_1/dense_1`).
Gradient ops belong to the layer of the forward scope they differentiate; a
variable belongs to the first layer that reads it in the forward pass (a tied
embedding read again by the head keeps one owner; the head is recorded as a
reader); an optimizer slot (Adam's moments) to the layer
of the gradient its update consumes; update ops to the layer of the variable
they write (or of all their consumers, when those agree).

Per layer we report parameters, optimizer state, forward/backward FLOPs and
the bytes of forward activations that the backward pass reads (what must be
kept, or recomputed, between forward and backward).
"""
import collections
import dataclasses
from typing import Dict, List

from tfsplit import constants
from tfsplit.constants import BACKWARD, FORWARD, ROLES, UPDATE
from tfsplit.graph import flops as flops_lib
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.endpoints import graph_outputs
from tfsplit.graph.ir import Graph, parse_input, without_gc

TOP_LAYER = "(top)"          # forward ops above the layer scopes (e.g. the loss)
OPTIMIZER_LAYER = "(optimizer)"  # update ops shared by all layers
_MAX_GRADIENT_SEARCH = 256
_NOT_ACTIVATIONS = frozenset(["Const", "ReadVariableOp", "VarHandleOp",
                              "Placeholder", "Shape", "ShapeN", "Size", "Rank"])
# On a forward op's copy made for the backward pass (memory/recompute.py): the
# original's name. The copy is a backward op of the original's layer.
RECOMPUTE_OF_ATTR = "_tfsplit_recompute_of"


@dataclasses.dataclass
class Layer:
  name: str
  index: int
  forward: List[str] = dataclasses.field(default_factory=list)
  backward: List[str] = dataclasses.field(default_factory=list)
  update: List[str] = dataclasses.field(default_factory=list)
  variables: List[str] = dataclasses.field(default_factory=list)  # trainable
  # Trainable variables owned by another layer that this one reads too (a
  # tied LM head reading the token embedding).
  shared_variables: List[str] = dataclasses.field(default_factory=list)
  block: bool = False   # one of the model's repeated blocks
  slots: List[str] = dataclasses.field(default_factory=list)      # optimizer state
  param_count: int = 0
  param_bytes: int = 0
  slot_bytes: int = 0
  forward_flops: int = 0
  backward_flops: int = 0
  activation_bytes: int = 0

  def as_dict(self):
    d = dataclasses.asdict(self)
    for key in ROLES:
      d[key + "_ops"] = len(d.pop(key))
    d["shared_variables"] = len(d["shared_variables"])
    return d


@dataclasses.dataclass
class LayerReport:
  layers: List[Layer]
  role: Dict[str, str]          # node -> forward/backward/update
  layer_of: Dict[str, str]      # node -> layer name
  variable_layer: Dict[str, str]  # variable handle node -> layer name
  depth: int
  # variable handle -> every layer that reads it in the forward pass, in order
  variable_readers: Dict[str, List[str]] = dataclasses.field(default_factory=dict)
  # Nodes whose values depend on no variable: the inputs and what is built
  # from them alone (masks, position ids, a loss's token count), constants.
  variable_free: frozenset = frozenset()

  def block_roles(self):
    """{node: role} of the nodes in micro-batch blocks (what schedules order
    and traces check): everything but what depends on no variable, which
    every micro-batch may need and which runs whenever its inputs allow."""
    return {n: r for n, r in self.role.items() if n not in self.variable_free}

  def layer(self, name):
    return next(l for l in self.layers if l.name == name)

  @property
  def model_layers(self):
    """Layers that hold trainable parameters (what pipelining cuts)."""
    return [l for l in self.layers if l.variables]


def _strip_grad(name):
  m = constants.gradient_scope_match(name)
  return (name[m.end():], True) if m else (name, False)


def _scope(name):
  return name.split("/")[:-1]


def _layer_scope(graph, name):
  """The name scope `name` belongs to, as a list; a scope that is itself a
  node's name (`dense/MatMul/ReadVariableOp`, made by the op's own name scope)
  is that node's scope."""
  scope = _scope(name)
  while scope and "/".join(scope) in graph:
    scope = scope[:-1]
  return scope


def _repeated_blocks_scope(forward_ops, param_reads, var_nodes):
  """(The scope whose children include the model's repeated blocks, the
  blocks' scope names), or (None, ()).

  A block is a child scope holding parameters; blocks repeat when siblings
  have the same signature (forward op types and parameter shapes). Of all
  such groups, at any depth, the one covering the most parameters wins: the
  transformer blocks of a backbone nested in a task model, not the two
  LayerNorms inside one block.
  """
  ops = collections.defaultdict(collections.Counter)   # scope tuple -> op counts
  params = collections.defaultdict(list)               # scope tuple -> [(shape, size)]
  # Counted per (scope, op) first: a block's ops share a few scopes.
  for (scope, op), count in collections.Counter(
      (tuple(scope), op) for scope, op in forward_ops).items():
    for i in range(1, len(scope) + 1):
      ops[scope[:i]][op] += count
  for scope, handle in param_reads:
    var = var_nodes[handle]
    for i in range(1, len(scope) + 1):
      params[tuple(scope[:i])].append((handle, tuple(var.shape or ()),
                                       var.num_elements or 0))
  groups = collections.defaultdict(list)  # (parent, signature) -> [child]
  for child, reads in params.items():
    unique = sorted(set(reads))
    signature = (tuple(sorted(ops[child].items())), tuple(sorted(r[1] for r in unique)))
    groups[(child[:-1], signature)].append((child, sum(r[2] for r in unique)))
  best, best_score = (None, ()), None
  for (parent, _), members in groups.items():
    if len(members) < 2:
      continue
    score = (sum(size for _, size in members), len(members), len(parent))
    if best_score is None or score > best_score:
      best, best_score = (list(parent), tuple("/".join(c) for c, _ in members)), score
  return best


def _common_prefix(paths):
  if not paths:
    return []
  prefix = list(paths[0])
  for path in paths[1:]:
    i = 0
    while i < len(prefix) and i < len(path) and prefix[i] == path[i]:
      i += 1
    prefix = prefix[:i]
  return prefix


def analysed(graph, variables=None, shapes=None):
  """(Graph, variables, ShapeMap) of a Graph or GraphDef, finding the
  variables and inferring the shapes a caller did not pass. The shape import
  is lazy: it loads TensorFlow, which callers that pass shapes never need."""
  if not isinstance(graph, Graph):
    graph = Graph(graph)
  if variables is None:
    variables = variables_lib.find_variables(graph)
  if shapes is None:
    from tfsplit.graph.shapes import infer_shapes  # pylint: disable=import-outside-toplevel
    shapes = infer_shapes(graph, variables)
  return graph, variables, shapes


@without_gc
def detect_layers(graph, shapes=None, variables=None, depth=None, order=None):
  """LayerReport for a Graph (or GraphDef).

  shapes: a ShapeMap (for FLOPs and bytes; inferred if None).
  depth: force the scope depth of layers (default: found from the graph).
  """
  graph, variables, shapes = analysed(graph, variables, shapes)
  order = order or graph.topological_order()
  var_nodes = {v.node: v for v in variables}
  # NodeDefs and op types looked up once: the loops below read them per node
  # many times, and each proto field read makes a new Python object.
  nodes = {name: graph.node(name) for name in order}
  op_of = {name: node.op for name, node in nodes.items()}

  # 1. Roles.
  stripped = {}
  role = {}
  for name in order:
    base, is_grad = _strip_grad(name)
    attr = nodes[name].attr
    if RECOMPUTE_OF_ATTR in attr:
      base, is_grad = _strip_grad(attr[RECOMPUTE_OF_ATTR].s.decode())[0], True
    stripped[name] = base
    if is_grad:
      role[name] = BACKWARD
  forward_set = graph.data_ancestors(graph_outputs(graph))
  # The nodes each node reads data from, listed once for the loops below.
  sources = {name: [src for src, _ in graph.data_inputs(name)] for name in order}
  # Constants and arithmetic on constants only: they carry no role of their
  # own, so a gradient op taking one (the index bound of an UnsortedSegmentSum
  # densifying an embedding gradient) stays a gradient op.
  constant = set()
  for name in order:
    if name in role:
      continue
    data_in = sources[name]
    if (op_of[name] == "Const" or data_in and all(s in constant for s in data_in)) \
        and not nodes[name].input[len(data_in):]:
      constant.add(name)
  for name in order:
    if name in role:
      continue
    op = op_of[name]
    data_in = sources[name]
    if name in forward_set and not any(role.get(s) == BACKWARD for s in data_in):
      role[name] = FORWARD
    elif data_in and not constants.is_write_op(op) and op != "IdentityN" and any(
        role.get(s) == BACKWARD for s in data_in) and all(
            role.get(s) in (BACKWARD, FORWARD) or s in constant for s in data_in):
      role[name] = BACKWARD  # e.g. the AddN summing one weight's gradients
    else:
      role[name] = UPDATE
  for name in var_nodes:  # handles are bookkeeping, not compute
    role[name] = FORWARD if name in forward_set else UPDATE
  # A custom gradient's ops (tf.nn.silu's Sigmoid(x), Square(x), ...) take no
  # gradient scope and read forward activations, so the rules above make them
  # updates: what computes from activations, gradients and constants only
  # and feeds the backward is part of it.
  custom = set()
  for name in order:
    data_in = sources[name]
    if role[name] == UPDATE and data_in and name not in var_nodes and \
        not constants.is_write_op(op_of[name]) and op_of[name] != "IdentityN" and \
        op_of[name] not in constants.VARIABLE_READ_OPS and all(
            role.get(s) in (FORWARD, BACKWARD) or s in constant or s in custom
            for s in data_in):
      custom.add(name)
  for name in reversed(order):
    if name in custom and any(role.get(c) == BACKWARD and not nodes[c].input[i].startswith("^")
                              for c, i in graph.consumers(name)):
      role[name] = BACKWARD
    else:
      custom.discard(name)

  # 2. Layer scopes from forward reads of trainable variables.
  def is_trainable_handle(src):
    v = var_nodes.get(src)
    return v is not None and v.trainable is not False
  # Per parent scope, not per node: a scope's ops share the answer (a list
  # that nothing below edits).
  layer_scopes = {}

  def layer_scope(name):
    head, slash, _ = name.rpartition("/")
    parent = head + slash
    scope = layer_scopes.get(parent)
    if scope is None:
      scope = layer_scopes[parent] = _layer_scope(graph, name)
    return scope
  scope_of = {name: layer_scope(stripped[name]) for name in order}
  param_reads = []  # (reader's scope, variable handle)
  for name in order:
    if role[name] != FORWARD or op_of[name] not in constants.VARIABLE_READ_OPS:
      continue
    node = nodes[name]
    if node.input and is_trainable_handle(parse_input(node.input[0])[0]):
      param_reads.append((scope_of[name], parse_input(node.input[0])[0]))
  blocks_scope, blocks = None, ()
  if depth is None:
    blocks_scope, blocks = _repeated_blocks_scope(
        [(scope_of[n], op_of[n]) for n in order if role[n] == FORWARD],
        param_reads, var_nodes)
    if blocks_scope is not None:
      depth = len(blocks_scope) + 1
    else:
      reader_scopes = [s for s, _ in param_reads]
      depth = len(_common_prefix(reader_scopes)) + 1 if reader_scopes else 1
      if reader_scopes and all(len(s) < depth for s in reader_scopes):
        depth = max(1, depth - 1)

  # id(scope list) -> its layer key: the nodes of one parent scope share one
  # list (layer_scope), alive in scope_of while this runs.
  keys_of_scope = {}

  def layer_key(name):
    scope = scope_of[name]
    key = keys_of_scope.get(id(scope))
    if key is None:
      key = keys_of_scope[id(scope)] = scope_layer_key(scope)
    return key

  def scope_layer_key(scope):
    if blocks_scope is not None:
      # Under the blocks' parent: its child; elsewhere: the child of the
      # deepest scope shared with that parent (a task model's head, a
      # backbone's embedding); ops directly in an enclosing scope: that scope.
      shared = len(_common_prefix([scope, blocks_scope]))
      if len(scope) > shared:
        return "/".join(scope[:shared + 1])
      return "/".join(scope) if scope else TOP_LAYER
    if len(scope) >= depth:
      return "/".join(scope[:depth])
    return "/".join(scope) if scope else TOP_LAYER

  # 3. Forward layers, ordered by first forward op.
  layers = collections.OrderedDict()
  layer_of = {}
  for name in order:
    if role[name] == FORWARD and name not in var_nodes:
      key = layer_key(name)
      if key == TOP_LAYER:
        # An unscoped op computed from a layer's output (a mixed-precision
        # model's cast of its logits to float32, a loss written without a
        # scope) runs after that layer, not with the graph's inputs: it
        # joins the latest layer it reads from.
        inside = [layers[layer_of[s]] for s, _ in graph.data_inputs(name)
                  if layer_of.get(s, TOP_LAYER) != TOP_LAYER]
        if inside:
          key = max(inside, key=lambda l: l.index).name
      layers.setdefault(key, Layer(key, len(layers)))
      layer_of[name] = key

  def get_layer(key):
    if key not in layers:
      layers[key] = Layer(key, len(layers))
    return layers[key]

  # Variables: the layer of their first forward read (a tied weight has more
  # readers; they receive its value).
  variable_layer = {}
  readers = collections.defaultdict(list)
  for name in order:
    if role[name] != FORWARD or op_of[name] not in constants.VARIABLE_READ_OPS:
      continue
    node = nodes[name]
    if node.input:
      src = parse_input(node.input[0])[0]
      if src in var_nodes:
        variable_layer.setdefault(src, layer_of[name])
        if layer_of[name] not in readers[src]:
          readers[src].append(layer_of[name])

  # 4. Backward ops: the layer of the forward scope they differentiate.
  for name in order:
    if role[name] != BACKWARD:
      continue
    key = layer_key(name)
    if key not in layers:
      # Unscoped gradient op (e.g. a top-level AddN): layer of its inputs.
      keys = [layer_of.get(s) for s, _ in graph.data_inputs(name)
              if role.get(s) == BACKWARD and s in layer_of]
      key = keys[0] if keys else TOP_LAYER
    elif name in custom:
      # A custom gradient's op: the layer it differentiates, of its inputs.
      keys = [layer_of[s] for s in sources[name] if s in layer_of and
              role.get(s) in (BACKWARD, FORWARD) and layer_of[s] != TOP_LAYER]
      key = keys[0] if keys else key
    get_layer(key)
    layer_of[name] = key

  # 5. Variables with no forward read (optimizer slots): the layer of the one
  # weight whose update reads them, else of the gradient that reaches their
  # update.
  def nearest_backward_layer(start):
    # Walks tensors, not nodes: an IdentityN (Keras passes all gradients
    # through one) forwards output k from input k only.
    # The gradient sits a few ops above a slot update; the bound keeps this
    # linear on graphs where a write has no gradient above it (counters).
    seen = set()
    queue = collections.deque(
        parse_input(t) for t in graph.node(start).input if not t.startswith("^"))
    while queue and len(seen) < _MAX_GRADIENT_SEARCH:
      src, port = queue.popleft()
      if (src, port) in seen:
        continue
      seen.add((src, port))
      node = graph.node(src)
      if role.get(src) == BACKWARD and node.op != "IdentityN":
        return layer_of.get(src)
      if node.op == "IdentityN":
        data = [t for t in node.input if not t.startswith("^")]
        if port < len(data):
          queue.append(parse_input(data[port]))
      elif role.get(src) == UPDATE:
        queue.extend(parse_input(t) for t in node.input if not t.startswith("^"))
    return None

  # A variable's handle passed on by an Identity (a lowered conditional's
  # branch argument) is the variable: its reads and writes are the variable's.
  handle_of = {}
  for name in order:
    data = sources[name]
    if op_of[name] == "Identity" and len(data) == 1:
      src = data[0]
      if src in var_nodes or src in handle_of:
        handle_of[name] = handle_of.get(src, src)

  def written_handle(write):
    node = graph.node(write)
    handle = parse_input(node.input[0])[0] if node.input else None
    return handle_of.get(handle, handle)

  def slots_read_by(write):
    # Variables an update reads (Adam's moments in the weight's step) or takes
    # as inputs (a fused ResourceApplyAdam), up through update ops only.
    found, seen = set(), set()
    queue = collections.deque([write])
    while queue and len(seen) < _MAX_GRADIENT_SEARCH:
      name = queue.popleft()
      if name in seen:
        continue
      seen.add(name)
      for src, _ in graph.data_inputs(name):
        src = handle_of.get(src, src)
        if src in var_nodes:
          found.add(src)
        elif role.get(src) == UPDATE:
          queue.append(src)
    return found

  writes = [n for n in order if role[n] == UPDATE and constants.is_write_op(op_of[n])]
  # A slot belongs to the one weight whose update reads it (so a tied
  # embedding's moments follow the embedding, not the head whose gradient op
  # sums the two contributions); state read by many updates (the step
  # counter) is the optimizer's.
  slot_owners = collections.defaultdict(set)
  for name in writes:
    handle = written_handle(name)
    if handle in variable_layer and is_trainable_handle(handle):
      for slot in slots_read_by(name) - {handle}:
        if slot not in variable_layer:
          slot_owners[slot].add(handle)
  for slot, owners in slot_owners.items():
    if len(owners) == 1:
      variable_layer[slot] = variable_layer[next(iter(owners))]
  for name in writes:
    handle = written_handle(name)
    if handle in var_nodes and handle not in variable_layer:
      key = nearest_backward_layer(name)
      if key is not None:
        variable_layer[handle] = key

  # 6. Update ops: the layer of the variable written; others follow consumers.
  for name in writes:
    layer_of[name] = variable_layer.get(written_handle(name), OPTIMIZER_LAYER)
  for name in reversed(order):
    if role[name] != UPDATE or name in layer_of:
      continue
    keys = {layer_of.get(c) for c, _ in graph.consumers(name) if role.get(c) == UPDATE}
    keys.discard(None)
    if name in var_nodes:
      keys = {variable_layer.get(name, OPTIMIZER_LAYER)}
    layer_of[name] = keys.pop() if len(keys) == 1 else OPTIMIZER_LAYER
  for name in order:
    layer_of.setdefault(name, TOP_LAYER)
    get_layer(layer_of[name])

  # 7. Membership and statistics.
  for name in order:
    if name in var_nodes:
      continue
    layer = layers[layer_of[name]]
    getattr(layer, role[name]).append(name)
    f = 0 if op_of[name] in flops_lib.ZERO_FLOP_OPS else flops_lib.op_flops(nodes[name], shapes)
    if role[name] == FORWARD:
      layer.forward_flops += f
    elif role[name] == BACKWARD:
      layer.backward_flops += f
  for handle, var in var_nodes.items():
    key = variable_layer.get(handle, OPTIMIZER_LAYER)
    layer_of[handle] = key
    layer = get_layer(key)
    is_param = handle in variable_layer and var.trainable is not False and \
        role[handle] == FORWARD
    if is_param:
      for other in readers[handle][1:]:
        layers[other].shared_variables.append(handle)
      layer.variables.append(handle)
      layer.param_count += var.num_elements or 0
      layer.param_bytes += var.num_bytes or 0
    else:
      layer.slots.append(handle)
      layer.slot_bytes += var.num_bytes or 0
  kept = set()
  for name in order:
    if role[name] != BACKWARD:
      continue
    for src, port in graph.data_inputs(name):
      if role.get(src) == FORWARD and src not in var_nodes and \
          op_of[src] not in _NOT_ACTIVATIONS:
        kept.add((src, port))
  for src, port in sorted(kept):
    info = shapes.get(f"{src}:{port}")
    if info is not None and info.num_bytes:
      layers[layer_of[src]].activation_bytes += info.num_bytes

  ordered = sorted(layers.values(), key=lambda l: (
      l.name in (TOP_LAYER, OPTIMIZER_LAYER) and not l.forward, l.index))
  for i, layer in enumerate(ordered):
    layer.index = i
    layer.block = layer.name in blocks
  depends = set()
  for name in order:
    if name in var_nodes or any(src in depends for src in sources[name]):
      depends.add(name)
  variable_free = frozenset(order) - depends
  return LayerReport(ordered, role, layer_of, variable_layer, depth, dict(readers),
                     variable_free)
