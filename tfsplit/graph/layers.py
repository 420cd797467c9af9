"""Layer detection: forward ops, their gradient ops and their updates, per layer.

Roles come from the graph's structure (graph/layer_roles.py): *forward*, the
outputs' ancestors; *backward*, ops named `gradient_tape/<forward scope>/...`
(TF2) or `gradients/<forward scope>/...` (TF1) and what only computes
gradients; *update*, the optimizer's ops and variable writes.

Layers are name scopes, found by structure: the model's repeated blocks are
sibling scopes, at any depth, with the same forward ops and parameter shapes
(of all such groups, the one holding the most parameters: `gpt/block_3`, or
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
from tfsplit.graph.handles import BoundedWalk, handle_of, variables_used_by
from tfsplit.graph.ir import Graph, parse_input, without_gc
from tfsplit.graph.layer_roles import GraphFacts, find_roles
# Named here too for the code that marks recompute copies (memory/recompute.py).
from tfsplit.graph.layer_roles import RECOMPUTE_OF_ATTR  # pylint: disable=unused-import

TOP_LAYER = "(top)"          # forward ops above the layer scopes (e.g. the loss)
OPTIMIZER_LAYER = "(optimizer)"  # update ops shared by all layers
_MAX_GRADIENT_SEARCH = 256
_NOT_ACTIVATIONS = frozenset(["Const", "ReadVariableOp", "VarHandleOp",
                              "Placeholder", "Shape", "ShapeN", "Size", "Rank"])


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


@dataclasses.dataclass
class _Index(GraphFacts):
  """What the phases of detect_layers share: the graph's facts and the
  findings, set from what a phase returns or in place where its docstring
  says so."""
  role: Dict[str, str] = None
  stripped: Dict[str, str] = None   # node -> its name without gradient scope
  custom: set = None                # a custom gradient's unscoped ops
  scope_of: Dict[str, list] = None  # node -> its layer scope
  layers: Dict[str, Layer] = None   # layer name -> Layer, in order of creation
  layer_of: Dict[str, str] = None
  variable_layer: Dict[str, str] = None
  readers: Dict[str, List[str]] = None  # variable -> layers reading it forward


@without_gc
def detect_layers(graph, shapes=None, variables=None, depth=None, order=None):
  """LayerReport for a Graph (or GraphDef).

  shapes: a ShapeMap (for FLOPs and bytes; inferred if None).
  depth: force the scope depth of layers (default: found from the graph).
  """
  graph, variables, shapes = analysed(graph, variables, shapes)
  ix = _Index.of(graph, order or graph.topological_order(), variables)
  # 1. Roles.
  roles = find_roles(ix)
  ix.role, ix.stripped, ix.custom = roles.role, roles.stripped, roles.custom
  # 2. Layer scopes from forward reads of trainable variables.
  ix.scope_of = _scopes(ix)
  depth, blocks_scope, blocks = _layer_depth(ix, depth)
  layer_key = _LayerKeys(ix.scope_of, depth, blocks_scope)
  # 3. Forward layers, ordered by first forward op; variables' first readers.
  ix.layers, ix.layer_of = _forward_layers(ix, layer_key)
  ix.variable_layer, ix.readers = _forward_variable_layers(ix)
  # 4. Backward ops.
  _backward_layers(ix, layer_key)
  # 5. Variables with no forward read (optimizer slots).
  writes = [n for n in ix.order
            if ix.role[n] == UPDATE and constants.is_write_op(ix.op_of[n])]
  _slot_layers(ix, writes)
  # 6. Update ops.
  _update_layers(ix, writes)
  # 7. Membership and statistics.
  _add_ops(ix, shapes)
  _add_variables(ix)
  _add_activation_bytes(ix, shapes)
  return LayerReport(_ordered_layers(ix.layers, blocks), ix.role, ix.layer_of,
                     ix.variable_layer, depth, dict(ix.readers), _variable_free(ix))


def _is_trainable(ix, handle):
  """Whether `handle` is a variable's node and the variable trainable."""
  v = ix.var_nodes.get(handle)
  return v is not None and v.trainable is not False


def _get_layer(layers, key):
  """The Layer named `key`, made (with the next index) if new."""
  if key not in layers:
    layers[key] = Layer(key, len(layers))
  return layers[key]


def _written_variable(ix, write):
  """The variable update op `write` writes (its handle input, through
  Identity), or None."""
  node = ix.nodes[write]
  return handle_of(ix.graph, node.input[0], ix.var_nodes) if node.input else None


# --- 2. layer scopes --------------------------------------------------------------
def _scopes(ix):
  """{node: the layer scope of its name without gradient scope}. Found per
  parent scope, not per node: the nodes of one parent share one list (which
  nothing edits)."""
  by_parent, scope_of = {}, {}
  for name in ix.order:
    base = ix.stripped[name]
    head, slash, _ = base.rpartition("/")
    scope = by_parent.get(head + slash)
    if scope is None:
      scope = by_parent[head + slash] = _layer_scope(ix.graph, base)
    scope_of[name] = scope
  return scope_of


def _trainable_reads(ix):
  """[(reader's scope, variable handle)] of the forward reads of trainable
  variables."""
  reads = []
  for name in ix.order:
    if ix.role[name] != FORWARD or ix.op_of[name] not in constants.VARIABLE_READ_OPS:
      continue
    node = ix.nodes[name]
    if node.input and _is_trainable(ix, parse_input(node.input[0])[0]):
      reads.append((ix.scope_of[name], parse_input(node.input[0])[0]))
  return reads


def _layer_depth(ix, depth):
  """(depth, the repeated blocks' parent scope or None, the blocks' scope
  names): `depth` if given, else one below the blocks' parent, else found
  from the common scope of the trainable variables' forward readers."""
  if depth is not None:
    return depth, None, ()
  param_reads = _trainable_reads(ix)
  blocks_scope, blocks = _repeated_blocks_scope(
      [(ix.scope_of[n], ix.op_of[n]) for n in ix.order if ix.role[n] == FORWARD],
      param_reads, ix.var_nodes)
  if blocks_scope is not None:
    return len(blocks_scope) + 1, blocks_scope, blocks
  reader_scopes = [s for s, _ in param_reads]
  depth = len(_common_prefix(reader_scopes)) + 1 if reader_scopes else 1
  if reader_scopes and all(len(s) < depth for s in reader_scopes):
    depth = max(1, depth - 1)
  return depth, None, blocks


class _LayerKeys(object):
  """Called with a node, the layer its scope falls in: with repeated
  blocks, under the blocks' parent its child; elsewhere the child of the
  deepest scope shared with that parent (a task model's head, a backbone's
  embedding); without, the scope cut at `depth`. Ops directly in an
  enclosing scope: that scope (TOP_LAYER for none)."""

  def __init__(self, scope_of, depth, blocks_scope):
    self._scope_of = scope_of
    self._depth = depth
    self._blocks_scope = blocks_scope
    # id(scope list) -> its key: the lists stay alive in scope_of.
    self._keys = {}

  def __call__(self, name):
    scope = self._scope_of[name]
    key = self._keys.get(id(scope))
    if key is None:
      key = self._keys[id(scope)] = self._scope_key(scope)
    return key

  def _scope_key(self, scope):
    if self._blocks_scope is not None:
      cut = len(_common_prefix([scope, self._blocks_scope])) + 1
    else:
      cut = self._depth
    if len(scope) >= cut:
      return "/".join(scope[:cut])
    return "/".join(scope) if scope else TOP_LAYER


# --- 3.-6. layers of forward, backward and update ops -----------------------------
def _forward_layers(ix, layer_key):
  """(layers in order of their first forward op, {forward op: layer})."""
  layers = collections.OrderedDict()
  layer_of = {}
  for name in ix.order:
    if ix.role[name] != FORWARD or name in ix.var_nodes:
      continue
    key = layer_key(name)
    if key == TOP_LAYER:
      # An unscoped op computed from a layer's output (a mixed-precision
      # model's cast of its logits to float32, a loss written without a
      # scope) runs after that layer, not with the graph's inputs: it joins
      # the latest layer it reads from.
      inside = [layers[layer_of[s]] for s, _ in ix.graph.data_inputs(name)
                if layer_of.get(s, TOP_LAYER) != TOP_LAYER]
      if inside:
        key = max(inside, key=lambda l: l.index).name
    _get_layer(layers, key)
    layer_of[name] = key
  return layers, layer_of


def _forward_variable_layers(ix):
  """({variable: the layer of its first forward read}, {variable: every
  layer reading it forward, in order}): a tied weight has more readers,
  which receive its value."""
  variable_layer = {}
  readers = collections.defaultdict(list)
  for name in ix.order:
    if ix.role[name] != FORWARD or ix.op_of[name] not in constants.VARIABLE_READ_OPS:
      continue
    node = ix.nodes[name]
    if node.input:
      src = parse_input(node.input[0])[0]
      if src in ix.var_nodes:
        layer = ix.layer_of[name]
        variable_layer.setdefault(src, layer)
        if layer not in readers[src]:
          readers[src].append(layer)
  return variable_layer, readers


def _backward_layers(ix, layer_key):
  """Sets in ix.layer_of the layer of each backward op: that of the forward
  scope it differentiates; an unscoped one's (a top-level AddN), the layer
  of its backward inputs; a custom gradient's op, that of its inputs."""
  role, layer_of = ix.role, ix.layer_of
  for name in ix.order:
    if role[name] != BACKWARD:
      continue
    key = layer_key(name)
    if key not in ix.layers:
      keys = [layer_of.get(s) for s, _ in ix.graph.data_inputs(name)
              if role.get(s) == BACKWARD and s in layer_of]
      key = keys[0] if keys else TOP_LAYER
    elif name in ix.custom:
      keys = [layer_of[s] for s in ix.sources[name] if s in layer_of and
              role.get(s) in (BACKWARD, FORWARD) and layer_of[s] != TOP_LAYER]
      key = keys[0] if keys else key
    _get_layer(ix.layers, key)
    layer_of[name] = key


def _slot_layers(ix, writes):
  """Sets in ix.variable_layer the layer of the variables with no forward
  read (optimizer slots): that of the one weight whose update (of `writes`)
  uses them, so a tied embedding's moments follow the embedding, not the
  head whose gradient op sums the two contributions; state many updates
  use (the step counter) is the optimizer's. Else the layer of the gradient
  that reaches the slot's update."""
  variable_layer = ix.variable_layer
  slot_owners = collections.defaultdict(set)
  for name in writes:
    handle = _written_variable(ix, name)
    if handle in variable_layer and _is_trainable(ix, handle):
      used = variables_used_by(ix.graph, name, ix.var_nodes, ix.role,
                               _MAX_GRADIENT_SEARCH)
      for slot in used - {handle}:
        if slot not in variable_layer:
          slot_owners[slot].add(handle)
  for slot, owners in slot_owners.items():
    if len(owners) == 1:
      variable_layer[slot] = variable_layer[next(iter(owners))]
  for name in writes:
    handle = _written_variable(ix, name)
    if handle in ix.var_nodes and handle not in variable_layer:
      key = _nearest_backward_layer(ix, name)
      if key is not None:
        variable_layer[handle] = key


def _nearest_backward_layer(ix, write):
  """The layer of the first backward op found up from update op `write`
  through update ops, or None. It walks tensors, not nodes: an IdentityN
  (Keras passes all gradients through one) forwards output k from input k
  only. The gradient sits a few ops above a slot update; the bound keeps
  this linear on graphs where a write has no gradient above it (counters)."""
  walk = BoundedWalk([parse_input(t) for t in ix.nodes[write].input
                      if not t.startswith("^")], _MAX_GRADIENT_SEARCH)
  for src, port in walk:
    node = ix.graph.node(src)
    if ix.role.get(src) == BACKWARD and node.op != "IdentityN":
      return ix.layer_of.get(src)
    if node.op == "IdentityN":
      data = [t for t in node.input if not t.startswith("^")]
      if port < len(data):
        walk.follow([parse_input(data[port])])
    elif ix.role.get(src) == UPDATE:
      walk.follow(parse_input(t) for t in node.input if not t.startswith("^"))
  return None


def _update_layers(ix, writes):
  """Sets in ix.layer_of the layer of each update op: a write's is that of
  the variable it writes; another's that of all its update consumers when
  they agree, else the optimizer's. Then every node left is TOP_LAYER's."""
  role, layer_of = ix.role, ix.layer_of
  for name in writes:
    layer_of[name] = ix.variable_layer.get(_written_variable(ix, name), OPTIMIZER_LAYER)
  for name in reversed(ix.order):
    if role[name] != UPDATE or name in layer_of:
      continue
    keys = {layer_of.get(c) for c, _ in ix.graph.consumers(name) if role.get(c) == UPDATE}
    keys.discard(None)
    if name in ix.var_nodes:
      keys = {ix.variable_layer.get(name, OPTIMIZER_LAYER)}
    layer_of[name] = keys.pop() if len(keys) == 1 else OPTIMIZER_LAYER
  for name in ix.order:
    layer_of.setdefault(name, TOP_LAYER)
    _get_layer(ix.layers, layer_of[name])


# --- 7. membership and statistics -------------------------------------------------
def _add_ops(ix, shapes):
  """Lists each op (not the variables) under its layer's role, and adds its
  FLOPs to the layer's forward or backward count."""
  for name in ix.order:
    if name in ix.var_nodes:
      continue
    role = ix.role[name]
    layer = ix.layers[ix.layer_of[name]]
    getattr(layer, role).append(name)
    f = 0 if ix.op_of[name] in flops_lib.ZERO_FLOP_OPS else \
        flops_lib.op_flops(ix.nodes[name], shapes)
    if role == FORWARD:
      layer.forward_flops += f
    elif role == BACKWARD:
      layer.backward_flops += f


def _add_variables(ix):
  """Lists each variable under its layer (ix.layer_of set to it): a
  trainable one read forward as a parameter (and as shared by its other
  readers), any other as optimizer state."""
  for handle, var in ix.var_nodes.items():
    key = ix.variable_layer.get(handle, OPTIMIZER_LAYER)
    ix.layer_of[handle] = key
    layer = _get_layer(ix.layers, key)
    is_param = handle in ix.variable_layer and var.trainable is not False and \
        ix.role[handle] == FORWARD
    if is_param:
      for other in ix.readers[handle][1:]:
        ix.layers[other].shared_variables.append(handle)
      layer.variables.append(handle)
      layer.param_count += var.num_elements or 0
      layer.param_bytes += var.num_bytes or 0
    else:
      layer.slots.append(handle)
      layer.slot_bytes += var.num_bytes or 0


def _add_activation_bytes(ix, shapes):
  """Adds to each layer the bytes of its forward outputs that backward ops
  read (what is kept between the passes), each tensor once."""
  kept = set()
  for name in ix.order:
    if ix.role[name] != BACKWARD:
      continue
    for src, port in ix.graph.data_inputs(name):
      if ix.role.get(src) == FORWARD and src not in ix.var_nodes and \
          ix.op_of[src] not in _NOT_ACTIVATIONS:
        kept.add((src, port))
  for src, port in sorted(kept):
    info = shapes.get(f"{src}:{port}")
    if info is not None and info.num_bytes:
      ix.layers[ix.layer_of[src]].activation_bytes += info.num_bytes


def _ordered_layers(layers, blocks):
  """The layers in order of creation, the top and optimizer layers with no
  forward op last, renumbered; the blocks marked."""
  ordered = sorted(layers.values(), key=lambda l: (
      l.name in (TOP_LAYER, OPTIMIZER_LAYER) and not l.forward, l.index))
  for i, layer in enumerate(ordered):
    layer.index = i
    layer.block = layer.name in blocks
  return ordered


def _variable_free(ix):
  """The nodes whose values depend on no variable."""
  depends = set()
  for name in ix.order:
    if name in ix.var_nodes or any(src in depends for src in ix.sources[name]):
      depends.add(name)
  return frozenset(ix.order) - depends
