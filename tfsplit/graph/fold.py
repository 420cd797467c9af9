"""Folding of static shape arithmetic into constants.

Real graphs compute shapes at run time (Shape -> StridedSlice -> Pack ->
Reshape, Prod(Shape) -> Cast -> RealDiv for a mean). After a split, such
computations would see *local* sizes and silently change meaning. When the
static shapes are known we evaluate them once, on the global graph, and
replace them by Const nodes holding the global values; the split rules then
derive local values explicitly from the sharding.
"""
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.core.framework import node_def_pb2
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import config_pb2
from tensorflow.core.protobuf import rewriter_config_pb2
from tensorflow.python.framework import op_def_registry
from tensorflow.python.framework import tensor_util

from tfsplit.graph import variables as variables_lib
from tfsplit.graph.ir import Graph, parse_input

_SHAPE_OPS = frozenset(["Shape", "Size", "Rank", "ShapeN"])
_REDUCED_FLOATS = frozenset([types_pb2.DT_BFLOAT16, types_pb2.DT_HALF])
# Handles have no numpy value to fold to (a loop's TensorList accumulators).
_HANDLE_TYPES = frozenset([types_pb2.DT_VARIANT, types_pb2.DT_RESOURCE])
_MAX_ELEMENTS = 4096
_SIZE_UNKNOWN_OK = frozenset(["BroadcastGradientArgs", "Where", "Unique", "Range"])  # never fold anything but small metadata tensors
# Control flow is never folded: a Merge of two constant branches is the
# value of the branch that ran, known at run time only.
_NEVER_FOLD = frozenset(["Placeholder", "PlaceholderWithDefault", "VarHandleOp",
                         "ReadVariableOp", "NoOp", "Const", "Identity", "IdentityN",
                         "Switch", "Merge", "Enter", "Exit", "NextIteration", "LoopCond"])


# The subgraph is run once: optimizing it first costs more than it saves.
_EVALUATE_CONFIG = config_pb2.ConfigProto(graph_options=config_pb2.GraphOptions(
    optimizer_options=config_pb2.OptimizerOptions(
        opt_level=config_pb2.OptimizerOptions.L0, do_constant_folding=False),
    rewrite_options=rewriter_config_pb2.RewriterConfig(disable_meta_optimizer=True)))


def _const_node(name, value, device=""):
  node = node_def_pb2.NodeDef()
  node.name = name
  node.op = "Const"
  node.device = device
  node.attr["dtype"].type = tf.as_dtype(value.dtype).as_datatype_enum
  node.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(value))
  return node


def const_value(node):
  """numpy value of a Const NodeDef."""
  return tensor_util.MakeNdarray(node.attr["value"].tensor)


def _is_stateful(op):
  op_def = op_def_registry.get(op)
  return op_def is None or op_def.is_stateful


def fold_static_shapes(graph_def, shapes):
  """GraphDef -> GraphDef with static shape computations replaced by Consts.

  Only nodes whose value depends on shapes and constants alone, whose outputs
  are small, and whose op is stateless are folded; names are kept, so
  consumers are untouched.
  """
  return _fold(Graph(graph_def), shapes, expand=False)[0]


def _fold(graph, shapes, expand):
  """(GraphDef, {folded node: [output values]}, {expanded node: (IdentityN,
  output or None)}) of a tfsplit Graph folded (and with `expand`, its
  IdentityNs expanded: see _rebuild)."""
  order = graph.topological_order()
  foldable = set()
  controls = {}  # foldable node -> the control inputs its value waits for
  stateful = {}
  # node -> its op, read once; set before the node's consumers are reached
  # (loop back edges come from NextIteration, never a Const).
  op_of = {}
  for name in order:
    node = graph.node(name)
    op = op_of[name] = node.op
    if op in _NEVER_FOLD and not _passes_value(node, graph, foldable):
      continue
    if op not in stateful:
      stateful[op] = _is_stateful(op)
    if stateful[op]:
      continue
    outs = shapes[name] if name in shapes else []
    # Shape arithmetic whose result size is only known at run time (the
    # reduction axes from BroadcastGradientArgs) is small by nature.
    if not outs or (op not in _SIZE_UNKNOWN_OK and any(
        o.num_elements is None or o.num_elements > _MAX_ELEMENTS for o in outs)):
      continue
    # A 16-bit float stays computed at run time (its wider inputs folded):
    # folded, it would be stored rounded, and the graph raised to float32
    # to check a mixed-precision split (graph/precision.py) could not
    # recover the value the original computes.
    if any(o.dtype in _REDUCED_FLOATS or o.dtype in _HANDLE_TYPES for o in outs):
      continue
    data = graph.data_inputs(name)
    if op in _SHAPE_OPS:
      if all(shapes.tensor(s, p) is not None and shapes.tensor(s, p).fully_defined
             for s, p in data):
        foldable.add(name)
        controls[name] = set(graph.control_inputs(node))
      continue
    if data and all(s in foldable or op_of.get(s) == "Const" for s, _ in data):
      foldable.add(name)
      # A folded value waits for what its computation waited for: inside a
      # lowered conditional's branch that is the branch's pivot, which keeps
      # the constant dead in the branch not taken (a live one would reach
      # the branch's Merge).
      found = set(graph.control_inputs(node))
      for s, _ in data:
        found |= controls[s] if s in foldable else set(graph.control_inputs(graph.node(s)))
      controls[name] = found
  # Only fold what something non-foldable consumes (the frontier).
  targets = [n for n in order if n in foldable and any(
      c not in foldable for c, _ in graph.consumers(n))]
  if not targets:
    out, made = _rebuild(graph, (), {}, expand)
    return out, {}, made
  values = _evaluate(graph, targets, foldable, shapes)
  out, made = _rebuild(graph, foldable, values, expand, controls)
  return out, values, made


def _passes_value(node, graph, foldable):
  """An Identity that only forwards a constant or foldable value (a lowered
  branch's argument: a shape passed in); not a marked output or constraint."""
  if node.op != "Identity" or any(k.startswith("_tfsplit") for k in node.attr):
    return False
  data = graph.data_inputs(node.name)
  return len(data) == 1 and (data[0][0] in foldable or graph.node(data[0][0]).op == "Const")


# Reductions that return their input unchanged when the axes are empty.
_REDUCTIONS = frozenset(["Sum", "Mean", "Prod", "Max", "Min", "All", "Any"])


def _is_empty_vector(shape):
  return len(shape) == 1 and shape[0] == 0


def _rebuild(graph, foldable, values, expand, controls=None):
  """(GraphDef, {node: (IdentityN, output or None for its NoOp)}) of
  `graph` (a tfsplit Graph) with

  - each node of `values` ({folded node: [output values]}) a Const, or for
    several outputs (ShapeN) one Const per output, read directly by the
    consumers, and an IdentityN over them if some node waits on it; the
    rest of `foldable` dropped (interior of a folded computation);
  - each reduction whose axes are an empty constant an Identity: gradients
    reduce over the axes BroadcastGradientArgs gives, which fold to [] where
    nothing was broadcast, and the Sum is then a copy that every device
    would run each step (Grappler's constant folding drops it too);
  - the Consts dropped that had readers before and have none now (the
    leaves of folded shape arithmetic, the axes of reductions made
    Identity): TF would prune them before running the step, but the split
    would first copy each to every device. A Const nothing read before is
    kept (in a graph whose outputs are not marked, it is one), as is a
    marked output;
  - with `expand`, every IdentityN replaced by one Identity per output
    (`n/output_k`, read by the consumers of `n:k`) and a NoOp keeping the
    name `n` for control edges: kept whole, every consumer of any output
    would depend on all of them, which splitting cannot afford.

  Built in one pass over `graph`, from its consumer index: each node is
  copied once. Without anything to fold or expand, the GraphDef itself.
  """
  identity_ns = [n.name for n in graph.nodes if n.op == "IdentityN"] if expand else []
  if not values and not identity_ns:
    return graph.graph_def, {}
  return _Rebuilder(graph, foldable, values, expand, controls, identity_ns).build()


def _redirects(graph, values, identity_ns):
  """({input text: node now holding that output}, {folded output Const:
  its value}): the texts that name an output of a folded ShapeN (now one
  Const per output) or of an IdentityN being expanded (now one Identity
  per output)."""
  redirect, folded_outputs = {}, {}
  for name, outs in values.items():
    if len(outs) > 1:
      consts = [f"{name}/folded_{i}" for i in range(len(outs))]
      for i, const in enumerate(consts):
        redirect[f"{name}:{i}"] = const
        folded_outputs[const] = outs[i]
      redirect[name] = consts[0]
  for name in identity_ns:
    count = min(len(graph.data_inputs(name)), len(graph.node(name).attr["T"].list.type))
    for k in range(count):
      redirect[f"{name}:{k}"] = f"{name}/output_{k}"
    if count:
      redirect[name] = f"{name}/output_0"
  return redirect, folded_outputs


class _Rebuilder(object):
  """One _rebuild pass: what is folded and how the inputs that named the
  outputs it replaces are redirected, and the GraphDef it writes (with
  `made`, the Identity and NoOp nodes of each expanded IdentityN)."""

  def __init__(self, graph, foldable, values, expand, controls, identity_ns):
    self.graph = graph
    self.foldable = foldable
    self.values = values
    self.expand = expand
    self.controls = controls or {}
    self.redirect, self.folded_outputs = _redirects(graph, values, identity_ns)
    # The consumers of a redirected output: only their inputs are rewritten.
    self.redirected = {c for name in list(values) + identity_ns if name in self.redirect
                       for c, _ in graph.consumers(name)}
    self.identities = {}  # reduction over empty axes -> whether it becomes an Identity
    self.out = graph_pb2.GraphDef()
    self.out.versions.CopyFrom(graph.graph_def.versions)
    self.out.library.CopyFrom(graph.graph_def.library)
    self.made = {}

  def build(self):
    """(GraphDef, made): every node of the graph copied, folded or
    expanded in its order."""
    for name, node in zip(self.graph.node_names(), self.graph.nodes):
      outs = self.values.get(name)
      if outs is not None:
        self.add_folded(name, node, outs)
      elif name not in self.foldable:   # else interior of a folded computation
        self.add_kept(name, node)
    return self.out, self.made

  def input_texts(self, name, node):
    """The input texts of `node` with redirected outputs renamed."""
    texts = list(node.input)
    if name in self.redirected:
      texts = [self.redirect.get(t, t) for t in texts]
    return texts

  def is_empty_const(self, name):
    """Whether `name` is an empty vector Const in the output."""
    outs = self.values.get(name)
    if outs is not None:
      return len(outs) == 1 and _is_empty_vector(outs[0].shape)
    if name in self.folded_outputs:
      return _is_empty_vector(self.folded_outputs[name].shape)
    node = self.graph.get(name)
    if node is None or node.op != "Const" or node.input or name in self.foldable:
      return False
    return _is_empty_vector([d.size for d in node.attr["value"].tensor.tensor_shape.dim])

  def becomes_identity(self, name, node):
    """Whether `node` is a reduction over an empty constant of axes."""
    found = self.identities.get(name)
    if found is None:
      found = False
      if self.values and node.op in _REDUCTIONS and len(node.input) >= 2:
        axes = node.input[1]
        if name in self.redirected:
          axes = self.redirect.get(axes, axes)
        if axes.endswith(":0"):
          axes = axes[:-2]
        found = self.is_empty_const(axes)
      self.identities[name] = found
    return found

  def orphaned(self, name):
    """Whether `name` had readers before and has none now."""
    readers = self.graph.consumers(name)
    return bool(readers) and all(
        c in self.foldable or (index == 1 and self.becomes_identity(c, self.graph.node(c)))
        for c, index in readers)

  def waits_for(self, name):
    """The control inputs of a folded constant, on nodes still there."""
    return ["^" + c for c in sorted(self.controls.get(name, ()))
            if c not in self.foldable or c in self.values]

  def add_identity_n(self, name, device, data, waits, types):
    """An IdentityN `name` over `data` (after `waits`, control inputs), or
    with `expand` one Identity per output and a NoOp keeping the name."""
    if not self.expand:
      ident = self.out.node.add(name=name, op="IdentityN", device=device,
                                input=data + waits)
      ident.attr["T"].list.type.extend(types)
      return
    outs = []
    for k, (text, dtype) in enumerate(zip(data, types)):
      ident = self.out.node.add(name=f"{name}/output_{k}", op="Identity", device=device,
                                input=[text] + waits)
      ident.attr["T"].type = dtype
      outs.append(ident.name)
      self.made[ident.name] = (name, k)
    self.out.node.add(name=name, op="NoOp", device=device, input=["^" + o for o in outs])
    self.made[name] = (name, None)

  def add_folded(self, name, node, outs):
    """The Const of a folded node, unless nothing reads it now; for several
    outputs (ShapeN) one Const per output, and an IdentityN over them only
    if some node waits on this one (nothing else reads it)."""
    if len(outs) == 1:
      if not self.orphaned(name):
        const = self.out.node.add()
        const.CopyFrom(_const_node(name, outs[0], node.device))
        const.input.extend(self.waits_for(name))
      return
    consts = []
    for i, v in enumerate(outs):
      const = _const_node(f"{name}/folded_{i}", v, node.device)
      const.input.extend(self.waits_for(name))
      if not self.orphaned(const.name):
        self.out.node.add().CopyFrom(const)
      consts.append(const.name)
    if self.graph.consumers(name, -1):
      self.add_identity_n(name, node.device, consts, [],
                          [tf.as_dtype(v.dtype).as_datatype_enum for v in outs])

  def add_kept(self, name, node):
    """A node not folded: an expanded IdentityN, nothing for an orphaned
    Const, else a copy with its redirected inputs renamed (an Identity for
    a reduction over empty axes)."""
    op = node.op
    if op == "IdentityN" and self.expand:
      texts = self.input_texts(name, node)
      self.add_identity_n(name, node.device, [t for t in texts if not t.startswith("^")],
                          [t for t in texts if t.startswith("^")], node.attr["T"].list.type)
      return
    if op == "Const" and self.values and variables_lib.OUTPUT_INDEX_ATTR not in node.attr \
        and self.orphaned(name):
      return
    new = self.out.node.add()
    new.CopyFrom(node)
    if name in self.redirected:
      texts = self.input_texts(name, node)
      for i, text in enumerate(texts):
        if text != new.input[i]:
          new.input[i] = text
    if self.values and self.becomes_identity(name, node):
      _make_identity(new, node.attr["T"].type)


def _make_identity(new, dtype):
  """Turn `new`, a reduction, into an Identity of its input (keeping its
  control inputs and its private attrs)."""
  inputs = [new.input[0]] + [t for t in new.input[2:] if t.startswith("^")]
  new.op = "Identity"
  del new.input[:]
  new.input.extend(inputs)
  for key in [k for k in new.attr if not k.startswith("_")]:
    del new.attr[key]
  new.attr["T"].type = dtype


def fold_and_expand(graph, shapes):
  """(GraphDef, known shapes) of what the split's first pass makes of
  `graph` (a tfsplit Graph): static shape arithmetic folded
  (fold_static_shapes), then every IdentityN expanded (expand_identity_n).

  The known shapes, {node: [TensorInfo per output]}, are those of `shapes`
  carried over to the new graph, and the folded constants' own: exact where
  fully defined, since folding only adds constants (shapes.infer_shapes'
  `known` completes the rest).
  """
  out, values, expanded = _fold(graph, shapes, expand=True)
  known = {}
  for node in out.node:
    name = node.name
    if name in expanded:
      source, port = expanded[name]
      if port is None:
        known[name] = []  # the NoOp that keeps an IdentityN's name
        continue
      folded_values = values.get(source)
      if folded_values is not None:  # an output of a folded ShapeN
        known[name] = [_value_info(folded_values[port])]
      elif source in shapes and port < len(shapes[source]):
        known[name] = [shapes[source][port]]
      continue
    if name in values and len(values[name]) == 1:
      known[name] = [_value_info(values[name][0])]
    elif name in shapes:
      known[name] = shapes[name]
  for name, outs in values.items():
    if len(outs) > 1:
      for i, v in enumerate(outs):
        known[f"{name}/folded_{i}"] = [_value_info(v)]
  return out, known


def _value_info(value):
  from tfsplit.graph.shapes import TensorInfo  # pylint: disable=import-outside-toplevel
  return TensorInfo(tf.as_dtype(value.dtype).as_datatype_enum,
                    tuple(int(d) for d in value.shape))


def _evaluate(graph, targets, foldable, shapes):
  """Values of `targets`, computed in a private graph from constants only."""
  g = graph_pb2.GraphDef()
  g.versions.CopyFrom(graph.versions)
  # What the targets are computed from: folded shape ops become constants
  # here, so what they read (activations, variables) is left out.
  needed, stack = set(), list(targets)
  while stack:
    name = stack.pop()
    if name in needed:
      continue
    needed.add(name)
    if name in foldable and graph.node(name).op in _SHAPE_OPS:
      continue
    stack.extend(src for src, _ in graph.data_inputs(name) if src not in needed)
  # Identical computations (every block's shape arithmetic repeats the
  # others') are made once: the first node of each becomes the one `g` has,
  # and its copies read their values from it.
  canon, seen = {}, {}

  def add(new, data):
    inputs = []
    for src, port in data:
      src = canon[src]
      inputs.append(src if port == 0 else f"{src}:{port}")
    attr = new.attr
    key = (new.op, tuple(inputs), tuple((k, attr[k].SerializeToString(deterministic=True))
                                        for k in sorted(attr)))
    first = seen.get(key)
    if first is not None:
      canon[new.name] = first
      return
    seen[key] = canon[new.name] = new.name
    del new.input[:]
    new.input.extend(inputs)
    g.node.add().CopyFrom(new)

  for name in graph.topological_order():
    if name not in needed:
      continue
    node = graph.node(name)
    if node.op in _SHAPE_OPS and name in foldable:
      data = [parse_input(t) for t in node.input if not t.startswith("^")]
      out_type = tf.as_dtype(node.attr["out_type"].type) if "out_type" in node.attr else tf.int32
      if node.op == "ShapeN":
        vals = [np.array(shapes.get(f"{s}:{p}").shape, out_type.as_numpy_dtype)
                for s, p in data]
        # Pack the N shapes into separate consts behind an IdentityN.
        names = []
        for i, v in enumerate(vals):
          c = _const_node(f"{name}/_fold_{i}", v)
          g.node.add().CopyFrom(c)
          names.append(c.name)
        ident = g.node.add(name=name, op="IdentityN", input=names)
        ident.attr["T"].list.type.extend(
            [tf.as_dtype(v.dtype).as_datatype_enum for v in vals])
        canon[name] = name
        continue
      info = shapes.get(f"{data[0][0]}:{data[0][1]}")
      if node.op == "Shape":
        value = np.array(info.shape, out_type.as_numpy_dtype)
      elif node.op == "Size":
        value = np.array(int(np.prod(info.shape)), out_type.as_numpy_dtype)
      else:
        value = np.array(len(info.shape), np.int32)
      add(_const_node(name, value), ())
      continue
    new = node_def_pb2.NodeDef()
    new.CopyFrom(node)
    new.device = ""
    if "_class" in new.attr:
      del new.attr["_class"]  # colocation with nodes not in this subgraph
    add(new, graph.data_inputs(name))
  try:
    with tf.Graph().as_default() as tmp:
      tf.graph_util.import_graph_def(g, name="")
      fetches = {}
      for name in targets:
        op = tmp.get_operation_by_name(canon[name])
        fetches[name] = list(op.outputs)
      with tf.compat.v1.Session(graph=tmp, config=_EVALUATE_CONFIG) as sess:
        result = sess.run(fetches)
  except (tf.errors.OpError, ValueError) as e:
    # Shapes that static inference let through but the shape arithmetic
    # refuses (the graph would fail the same way when run).
    from tfsplit.graph import tf_messages  # pylint: disable=import-outside-toplevel
    raise tf_messages.tf_error(e, graph.graph_def, "TensorFlow could not evaluate "
                                "its static shape arithmetic") from None
  return {k: [np.asarray(v) for v in vals] for k, vals in result.items()}


def expand_identity_n(graph_def):
  """GraphDef -> GraphDef with every IdentityN replaced by one Identity per output.

  IdentityN only groups tensors (Keras passes all gradients through one);
  kept whole, every consumer of any of its outputs would depend on all of
  them, which splitting cannot afford. Consumers of `n:k` read `n/output_k`;
  a NoOp keeps the name `n` for control edges.
  """
  return _rebuild(Graph(graph_def), (), {}, expand=True)[0]
