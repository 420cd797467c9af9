"""The role of each op of a training step, the first phase of layer
detection (graph/layers.py): forward, backward or update.

- *forward*: data ancestors of the graph's outputs (the loss of a training
  step), minus gradient ops;
- *backward*: ops in a gradient scope, plus unscoped ops fed only by them
  (e.g. the AddN that sums a weight's gradients) and a custom gradient's
  unscoped ops (tf.nn.silu's), which read activations and feed the backward;
- *update*: everything else: the optimizer's ops and variable writes.
"""
import dataclasses
from typing import Dict, List

from tfsplit import constants
from tfsplit.constants import BACKWARD, FORWARD, UPDATE
from tfsplit.graph.endpoints import graph_outputs
from tfsplit.graph.ir import Graph

# On a forward op's copy made for the backward pass (memory/recompute.py): the
# original's name. The copy is a backward op of the original's layer.
RECOMPUTE_OF_ATTR = "_tfsplit_recompute_of"
# What the gradient tape creates in its scope for the forward pass to fill: a
# loop's TensorList accumulators (the forward While keeps each iteration's
# values in them for its gradient loop). Reading one leaves a forward op
# forward: else the loop, and all after it, counted as backward.
_TAPE_ACCUMULATORS = frozenset(["EmptyTensorList"])


@dataclasses.dataclass
class GraphFacts:
  """What layer detection reads per node many times, looked up once: each
  proto field read makes a new Python object."""
  graph: Graph
  order: List[str]
  var_nodes: Dict[str, object]   # variable handle node -> its variable
  nodes: Dict[str, object]       # node -> NodeDef
  op_of: Dict[str, str]          # node -> op type
  sources: Dict[str, List[str]]  # node -> the nodes it reads data from

  @classmethod
  def of(cls, graph, order, variables):
    """The facts of `graph` (a tfsplit Graph) over its nodes `order` (a
    subclass's own fields left at their defaults)."""
    nodes = {name: graph.node(name) for name in order}
    return cls(graph=graph, order=order, var_nodes={v.node: v for v in variables},
               nodes=nodes, op_of={name: node.op for name, node in nodes.items()},
               sources={name: [src for src, _ in graph.data_inputs(name)]
                        for name in order})


@dataclasses.dataclass
class Roles:
  """What find_roles finds."""
  role: Dict[str, str]      # node -> FORWARD, BACKWARD or UPDATE
  stripped: Dict[str, str]  # node -> its name without gradient scope
  custom: set               # a custom gradient's unscoped ops (backward)


def find_roles(facts):
  """Roles of every node of `facts` (GraphFacts)."""
  stripped, role = _gradient_roles(facts)
  constant = _constant_nodes(facts, role)
  _forward_and_update_roles(facts, role, constant)
  custom = _custom_gradient_ops(facts, role, constant)
  return Roles(role, stripped, custom)


def _strip_grad(name):
  """(`name` without its gradient scope, whether it had one)."""
  m = constants.gradient_scope_match(name)
  return (name[m.end():], True) if m else (name, False)


def _gradient_roles(facts):
  """({node: its name without gradient scope}, {node: BACKWARD} for the
  nodes in a gradient scope). A recompute copy is a gradient op named by
  its original."""
  stripped, role = {}, {}
  for name in facts.order:
    base, is_grad = _strip_grad(name)
    attr = facts.nodes[name].attr
    if RECOMPUTE_OF_ATTR in attr:
      base, is_grad = _strip_grad(attr[RECOMPUTE_OF_ATTR].s.decode())[0], True
    stripped[name] = base
    if is_grad:
      role[name] = BACKWARD
  return stripped, role


def _constant_nodes(facts, role):
  """Constants and arithmetic on constants only, of the nodes `role` has no
  role for yet. They carry no role of their own, so a gradient op taking one
  (the index bound of an UnsortedSegmentSum densifying an embedding
  gradient) stays a gradient op."""
  constant = set()
  for name in facts.order:
    if name in role:
      continue
    data_in = facts.sources[name]
    if (facts.op_of[name] == "Const" or data_in and all(s in constant for s in data_in)) \
        and not facts.nodes[name].input[len(data_in):]:
      constant.add(name)
  return constant


def _forward_and_update_roles(facts, role, constant):
  """Sets in `role` the role of every node it has none for: forward for the
  outputs' ancestors that read no gradient, backward for an op computed from
  gradients (and forward values and constants) only (the AddN summing one
  weight's gradients), update for the rest. Variable handles are
  bookkeeping: forward when the outputs need them."""
  forward_set = facts.graph.data_ancestors(graph_outputs(facts.graph))
  for name in facts.order:
    if name in role:
      continue
    op = facts.op_of[name]
    data_in = facts.sources[name]
    if name in forward_set and not any(role.get(s) == BACKWARD and
                                       facts.op_of[s] not in _TAPE_ACCUMULATORS
                                       for s in data_in):
      role[name] = FORWARD
    elif data_in and not constants.is_write_op(op) and op != "IdentityN" and any(
        role.get(s) == BACKWARD for s in data_in) and all(
            role.get(s) in (BACKWARD, FORWARD) or s in constant for s in data_in):
      role[name] = BACKWARD
    else:
      role[name] = UPDATE
  for name in facts.var_nodes:
    role[name] = FORWARD if name in forward_set else UPDATE


def _custom_gradient_ops(facts, role, constant):
  """A custom gradient's ops (tf.nn.silu's Sigmoid(x), Square(x), ...),
  made backward in `role`. They take no gradient scope and read forward
  activations, so the roles so far make them updates: what computes from
  activations, gradients and constants only and feeds the backward is part
  of it."""
  op_of = facts.op_of
  custom = set()
  for name in facts.order:
    data_in = facts.sources[name]
    if role[name] == UPDATE and data_in and name not in facts.var_nodes and \
        not constants.is_write_op(op_of[name]) and op_of[name] != "IdentityN" and \
        op_of[name] not in constants.VARIABLE_READ_OPS and all(
            role.get(s) in (FORWARD, BACKWARD) or s in constant or s in custom
            for s in data_in):
      custom.add(name)
  for name in reversed(facts.order):
    if name in custom and any(
        role.get(c) == BACKWARD and not facts.nodes[c].input[i].startswith("^")
        for c, i in facts.graph.consumers(name)):
      role[name] = BACKWARD
    else:
      custom.discard(name)
  return custom
