"""Sharding propagation: one decision per op, from seeds to the whole graph.

Seeds are the shardings of variables (from a strategy or annotations) and of
graph inputs. Ops are visited in topological order; each op's rule (tfsplit.
rules) sees the shardings its inputs arrive with and decides what it needs
and what it produces. Where an op needs its inputs whole, the decision says
so and the engine logs the fallback, naming the op that forced it (a silent
gather is the most common complaint about automatic sharding).
"""
import dataclasses
import os
from typing import Dict, List

from absl import logging
from tensorflow.core.framework import types_pb2

from tfsplit import constants
from tfsplit import rules as rules_lib
from tfsplit.errors import PlanError, UnsupportedOpError
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.fold import const_value
from tfsplit.graph.handles import IDENTITY_AND_N, handle_of
from tfsplit.graph.ir import parse_input
from tfsplit.rules.base import Decision, OpContext, fallback
from tfsplit.layout.spec import Sharding, constraint_of

_MAX_CONST_ELEMENTS = 1024
# Rounds of two-way propagation before shardings count as unsettled.
_MAX_ROUNDS = 6
# Set to 1 (the tests do) to let an exception inside a split rule propagate.
STRICT_RULES_ENV = "TFSPLIT_STRICT_RULES"
# Ops that pass a resource handle through unchanged.
_HANDLE_PASSTHROUGH = IDENTITY_AND_N
# Ops through which a variable's read is still that weight's value.
_WEIGHT_VIEWS = frozenset(["Identity", "Cast", "Reshape", "Snapshot"])
# Kinds of _StaticInputs rows the forward sweep treats apart.
_VARIABLE, _PASSTHROUGH, _PLACEHOLDER = "variable", "passthrough", "placeholder"


@dataclasses.dataclass
class Propagation:
  decisions: Dict[str, Decision]
  outputs: Dict[str, List[Sharding]]      # node -> sharding per output
  handle_source: Dict[str, str]           # node -> variable handle node it forwards
  variable_specs: Dict[str, Sharding]     # variable handle node -> sharding
  fallbacks: List["Fallback"]  # in the order ops were decided
  order: List[str]
  # (node, port) -> the partial sharding it is produced in; consumers see it
  # reduced (one all-reduce right after the producer, shared by all).
  reduced_at_source: Dict[tuple, Sharding] = dataclasses.field(default_factory=dict)

  def spec(self, text):
    name, port = parse_input(text)
    return self.outputs[name][port]


def _is_resource(info):
  return info is not None and info.dtype == types_pb2.DT_RESOURCE


class Fallback(str):
  """One op replicated for want of a split rule, as the message users read
  ("node 'n' (op Op): reason; its split inputs are gathered ..."), with its
  node, op and reason apart for reports that group them."""

  def __new__(cls, node, op, reason):
    text = (f"node '{node}' (op {op}): {reason}; its split inputs are gathered to "
            "full tensors (replicated)")
    self = super().__new__(cls, text)
    self.node, self.op, self.reason = node, op, reason
    return self

  def __getnewargs__(self):  # copies and pickles rebuild it from its parts
    return (self.node, self.op, self.reason)


def propagate(graph, shapes, mesh, variable_specs, input_specs=None, variables=(),
              explicit=None):
  """Propagation of shardings over `graph` (a tfsplit Graph), both ways.

  Each round sweeps forward (every op's rule decides its outputs from the
  shardings its inputs arrive in, and what it needs of them), then backward,
  from consumers to producers:
  - a partial sum that some consumer needs whole is reduced right at its
    producer (else it is reduced once for that consumer and again for every
    linear consumer that carried it on: a LayerNorm's beta gradient next to
    its input gradient), so each partial sum is reduced exactly once;
  - a variable the plan left open (a bias, an optimizer slot; not in
    `explicit`) takes the sharding its users ask of it;
  and the open slots of a fused optimizer op follow their variable.
  Rounds repeat until nothing changes.
  """
  specs, explicit = dict(variable_specs), dict(explicit or {})
  following = [(v, slot) for v, slot in _fused_slots(graph, variables)
               if slot not in explicit]
  reduce_at_source = set()
  static = _StaticInputs(graph, shapes)
  memo = {}  # node -> (input shardings, handle shardings, decision, fallback message)
  for _ in range(_MAX_ROUNDS):
    for var, slot in following:
      specs[slot] = specs[var]
    prop = _propagate_once(static, mesh, specs, input_specs or {}, reduce_at_source, memo)
    needed = _partials_needed_whole(static, prop) - reduce_at_source
    inferred = infer_variable_specs(static, prop, variables, explicit)
    changed = {h: d for h, d in inferred.items() if specs[h].dims != tuple(d)}
    if not needed and not changed:
      return prop
    reduce_at_source |= needed
    for handle, dims in changed.items():
      specs[handle] = Sharding(tuple(dims))
      explicit[handle] = dims
  names = {v.node: v.name for v in variables}
  unsettled = ", ".join(sorted(names.get(h, h) for h in changed)[:3]) or "partial sums"
  raise PlanError(f"variable shardings did not settle (still changing: {unsettled}); "
                  "annotate the variables")


class _StaticInputs(object):
  """What every round reads per node and never changes: the topological
  order, data inputs, static shapes, small constant inputs, variables."""

  def __init__(self, graph, shapes):
    self.graph = graph
    self.order = graph.topological_order()
    self.var_nodes = {n.name for n in graph.nodes if variables_lib.is_variable_node(n)}
    consts = {}  # Const node -> its value (read-only), parsed once
    # serialized TensorProto -> its value: every block repeats the same small
    # constants (axes, shapes), and parsing one costs more than its bytes.
    by_proto = {}
    # node -> its op, read once; set before its consumers are reached (only
    # loop back edges, from NextIteration, come from later nodes).
    op_of = {}

    def const_input(src, info):
      if op_of.get(src) == "Const" and info is not None and \
          info.num_elements is not None and info.num_elements <= _MAX_CONST_ELEMENTS:
        if src not in consts:
          key = graph.node(src).attr["value"].tensor.SerializeToString(deterministic=True)
          value = by_proto.get(key)
          if value is None:
            value = by_proto[key] = const_value(graph.node(src))
            value.setflags(write=False)  # shared by every rule that reads it
          consts[src] = value
        return consts[src]
      return None

    # Nodes whose output is a variable's value (OpContext.weight_inputs).
    self.weight_values = set()
    # (name, node, kind, data, in_infos, out_infos, const_inputs, resource,
    # weight inputs); kind: _VARIABLE, _PASSTHROUGH (forwards a handle),
    # _PLACEHOLDER or None.
    self.rows = []
    # Read by every round's checks: (name, data inputs, is an assign) of each
    # op, and which of them are not sharding constraints.
    self.ops, self.unconstrained = [], []
    # ReadVariableOp -> the node its handle input names.
    self.read_handles = {}
    get = shapes.tensor
    nodes = graph.node
    for name in self.order:
      node = nodes(name)
      op = op_of[name] = node.op
      out_infos = shapes[name] if name in shapes else []
      if name in self.var_nodes:
        self.rows.append((name, node, _VARIABLE, (), (), out_infos, (), (), ()))
        continue
      data = graph.data_inputs(name)
      in_infos = tuple(get(src, port) for src, port in data)
      resource = tuple(_is_resource(info) for info in in_infos)
      kind = None
      if op in _HANDLE_PASSTHROUGH and data and all(resource):
        kind = _PASSTHROUGH
      elif op == "Placeholder":
        kind = _PLACEHOLDER
      weights = tuple(src in self.weight_values for src, _ in data)
      if op == "ReadVariableOp" or (op in _WEIGHT_VIEWS and weights and weights[0]):
        self.weight_values.add(name)
      self.rows.append((name, node, kind, data, in_infos, out_infos,
                        tuple(const_input(src, info) for (src, _), info in
                              zip(data, in_infos)),
                        resource, weights))
      self.ops.append((name, data, op in constants.ASSIGN_OPS))
      if data and (op != "Identity" or constraint_of(node) is None):
        self.unconstrained.append((name, data))
      if op == "ReadVariableOp":
        self.read_handles[name] = parse_input(node.input[0])[0]


def _partials_needed_whole(static, prop):
  """(node, port) of partial tensors some consumer requires non-partial (a
  sharding constraint reduces what it reads straight into its own sharding,
  a reduce-scatter: it needs nothing reduced before)."""
  needed = set()
  outputs, decisions = prop.outputs, prop.decisions
  for name, data in static.unconstrained:
    decision = decisions.get(name)
    if decision is None:
      continue
    for (src, port), want in zip(data, decision.inputs):
      if want is None:
        continue
      src_specs = outputs[src]
      have = src_specs[port] if port < len(src_specs) else None
      if have is not None and have.partial and have.partial - want.partial:
        needed.add((src, port))
  return needed


def _propagate_once(static, mesh, variable_specs, input_specs, reduce_at_source, memo):
  """One forward sweep. A rule decides from what its op's inputs arrive in
  (all else about the op is fixed), so an op whose inputs arrive as in the
  last round keeps its decision (`memo`) instead of asking the rule again."""
  var_nodes = static.var_nodes
  outputs, decisions, handle_source, fallbacks, reduced = {}, {}, {}, [], {}
  for name in var_nodes:
    handle_source[name] = name
  for name, node, kind, data, in_infos, out_infos, const_inputs, resource, weights \
      in static.rows:
    if kind is _VARIABLE:
      outputs[name] = [None]
      continue
    in_specs, handle_specs = [], []
    for (src, port), is_resource in zip(data, resource):
      src_specs = outputs[src]
      spec = src_specs[port] if port < len(src_specs) else None
      if is_resource or spec is None:
        in_specs.append(None)
        source = handle_source.get(src)
        handle_specs.append(variable_specs.get(source) if source else None)
      else:
        in_specs.append(spec)
        handle_specs.append(None)
    if kind is _PASSTHROUGH:
      handle_source[name] = handle_source.get(data[0][0])
      outputs[name] = [None] * max(1, len(out_infos))
      continue
    if kind is _PLACEHOLDER and name in input_specs:
      decision = Decision([], [input_specs[name]])
    else:
      key = (tuple(in_specs), tuple(handle_specs))
      known = memo.get(name)
      if known is not None and known[0] == key:
        decision, message = known[1], known[2]
        if message is not None:
          fallbacks.append(message)
      else:
        ctx = OpContext(node, mesh, in_specs, list(in_infos), out_infos,
                        list(const_inputs), handle_specs, weights)
        count = len(fallbacks)
        decision = _decide(ctx, fallbacks)
        memo[name] = (key, decision, fallbacks[-1] if len(fallbacks) > count else None)
    decisions[name] = decision
    outs = list(decision.outputs)
    outputs[name] = outs
    if reduce_at_source:
      for port, spec in enumerate(outs):
        if spec is not None and spec.partial and (name, port) in reduce_at_source:
          reduced[(name, port)] = spec
          outs[port] = spec.without_partial()
  return Propagation(decisions, outputs, handle_source, dict(variable_specs),
                     fallbacks, static.order, reduced)


def _decide(ctx, fallbacks):
  node = ctx.node
  split_handles = [s for s in ctx.handle_specs if s is not None and not s.is_replicated]
  rule = rules_lib.RULES.get(node.op)
  if rule is None:
    if split_handles:
      raise UnsupportedOpError(
          f"node '{node.name}' (op {node.op}) uses a split variable and tfsplit has no "
          "split rule for this op; leave that variable replicated (annotate it) or "
          "add a rule for the op in tfsplit/rules/")
    decision = fallback(ctx, "no split rule for this op")
  elif any(i is None or i.shape is None for i, s in zip(ctx.in_infos, ctx.in_specs)
           if s is not None) or any(o is None or o.shape is None for o in ctx.out_infos):
    decision = fallback(ctx, "static shapes unknown")
  else:
    try:
      decision = rule(ctx)
    except PlanError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      # A rule that raises is a tfsplit bug: tests (TFSPLIT_STRICT_RULES=1)
      # fail on it; in production it is logged as an internal error and the
      # op replicated, which is always correct.
      if os.environ.get(STRICT_RULES_ENV) == "1":
        raise
      logging.error("internal error in the split rule of node '%s' (op %s): %r; the op "
                    "is replicated instead, please report this", node.name, node.op, e)
      if split_handles:
        raise UnsupportedOpError(
            f"node '{node.name}' (op {node.op}): split rule failed ({e}) on a split "
            "variable; leave the variable replicated") from None
      decision = fallback(ctx, f"internal error in its split rule: {e}")
  arriving_split = any(s is not None and not s.is_replicated for s in ctx.in_specs)
  if decision.fallback and arriving_split:
    msg = Fallback(node.name, node.op, decision.fallback)
    # Reported with the result (SplitResult.fallbacks, rewrite's summary); a
    # warning here would put lines on stderr before a later one-line error.
    logging.info("fallback to replication: %s", msg)
    fallbacks.append(msg)
  return decision




def infer_variable_specs(static, prop, variables, explicit):
  """Shardings for variables the plan left open, read off the ops using them.

  A bias added to a column-split activation is required split by its
  BiasAdd; an Adam moment is updated with a split gradient. Adopting that
  sharding keeps the variable local instead of gathering its updates.
  `static`: the graph's _StaticInputs.
  """
  candidates = {v.node: set() for v in variables if v.node not in explicit and v.shape}
  if not candidates:
    return {}
  handle_source, outputs, decisions = prop.handle_source, prop.outputs, prop.decisions
  read_handles = static.read_handles
  read_of = {}  # ReadVariableOp -> the handle node behind it
  for name, data, is_assign in static.ops:
    decision = decisions.get(name)
    if decision is None:
      continue
    wanted = decision.inputs
    for j, (src, port) in enumerate(data):
      if src in read_of:
        handle = read_of[src]
      else:
        raw = read_handles.get(src)
        handle = read_of[src] = handle_source.get(raw) if raw is not None else None
      if handle is not None and handle in candidates and j < len(wanted) and wanted[j]:
        candidates[handle].add(wanted[j].dims)
      if is_assign and j == 1:
        handle = handle_source.get(data[0][0])
        value = outputs[src][port]
        if handle in candidates and value is not None:
          candidates[handle].add(value.dims)
  found = {}
  for handle, dims_set in candidates.items():
    split = {d for d in dims_set if any(a is not None for a in d)}
    if len(split) == 1:
      found[handle] = split.pop()
  return found


def _fused_slots(graph, variables):
  """[(variable handle, slot handle)] of the fused optimizer ops
  (ResourceApplyAdam, ...), which update slots with their variable's sharding."""
  handles = {v.node for v in variables}
  pairs = []
  for node in graph.nodes:
    if node.op.startswith("ResourceApply"):
      inputs = [handle_of(graph, t, handles, _HANDLE_PASSTHROUGH)
                for t in node.input if not t.startswith("^")]
      pairs += [(inputs[0], slot) for slot in inputs[1:] if inputs[0] and slot]
  return pairs
