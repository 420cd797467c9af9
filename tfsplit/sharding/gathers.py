"""Gathers as graph edits: sharding constraints (layout/spec.py) that make a
tensor whole for some of its readers, and a second gather of the same
tensor for the backward pass.

A tensor the forward pass reads gathered (a sequence-split activation for
Megatron's column-parallel contractions, a weight split over the data axis
for FSDP) is often read by the backward pass too, directly or through a
forward view of it (a Cast to the compute dtype, Keras's Tensordot
reshape). One gather for both would keep the whole tensor alive from the
forward to the backward; `gather_again` gives the backward readers their
own gather instead, gated on their other inputs (the gradient arriving), and
copies the views in between for them, so the forward's gathered copy is
freed after its last forward reader:

    edits = GatherEdits(analysis.graph, analysis.shapes, analysis.roles)
    edits.constraints.append(Constraint(...))          # the forward's gather
    edits.gather_again(source, dims, forward_readers, "fsdp")
    graph_def, known_shapes = edits.graph_def(analysis.graph_def, "FSDP")
"""
import collections
import dataclasses

from tfsplit import constants
from tfsplit.errors import PlanError
from tfsplit.graph.ir import parse_input
from tfsplit.layout.spec import Constraint, insert_constraints

# Ops that only view their first input (what a gather of it may be read
# through).
VIEW_OPS = frozenset(["Identity", "Cast", "Reshape"])


def data_inputs(node):
  return [t for t in node.input if not t.startswith("^")]


def scope(name):
  return name.rpartition("/")[0] or name


class GatherEdits(object):
  """Constraints, copies of forward views for the backward, and the
  backward readers rewired to them; `graph_def` applies them all."""

  def __init__(self, graph, shapes, roles):
    self.graph, self.shapes, self.roles = graph, shapes, roles
    self.constraints, self.copies = [], []   # Constraint, (copy NodeDef, its shape)
    self.rewire = {}   # backward reader -> {forward view it read: its copy}
    # gather_again's constraint name -> the graph's backward nodes reading
    # it (directly or through the view copies made for them)
    self.backward_readers = {}

  def gather_again(self, source, dims, readers, label, ops=None):
    """A gather of `source` (port 0) to `dims` for the backward nodes (of
    `ops`, or any op) that read it or a forward view of it reached from
    `readers` (its forward readers), gated on their other data inputs; the
    views copied for them. Returns the constraint, or None where no backward
    node reads it so."""
    views = {source: None}   # node -> the node it is a view of
    queue = collections.deque()
    for reader in readers:
      if self.graph.node(reader).op in VIEW_OPS:
        views[reader] = source
        queue.append(reader)
    while queue:
      cur = queue.popleft()
      for c in self.graph.consumer_nodes(cur):
        if c.op in VIEW_OPS and self.roles.get(c.name) == constants.FORWARD and \
            c.name not in views:
          views[c.name] = cur
          queue.append(c.name)
    direct, after, copied = set(), set(), {}
    for view in views:
      for c in self.graph.consumer_nodes(view):
        if (ops is not None and c.op not in ops) or \
            self.roles.get(c.name) != constants.BACKWARD:
          continue
        data = [parse_input(t) for t in data_inputs(c)]
        if [s for s, _ in data].count(view) != 1:
          continue
        after.update(s for s, _ in data if s != view)
        if view == source:
          direct.add(c.name)
        else:
          copied.setdefault(view, []).append(c.name)
    if not direct and not copied:
      return None
    first = sorted(direct | {r for rs in copied.values() for r in rs})[0]
    for view, consumers in sorted(copied.items()):
      chain = [view]
      while views[chain[0]] != source:
        chain.insert(0, views[chain[0]])
      previous = None
      for name in chain:
        copy = self._copy(self.graph.node(name), f"{scope(first)}/{label}_{len(self.copies)}")
        if previous is None:
          direct.add(copy.name)   # reads the source: rewired to the gather
        else:
          copy.input[0] = previous
        previous = copy.name
      for consumer in consumers:
        self.rewire.setdefault(consumer, {})[view] = previous
    constraint = Constraint(f"{scope(first)}/{label}_gather", (source, 0), tuple(dims),
                            frozenset(direct), tuple(sorted(after)))
    self.constraints.append(constraint)
    self.backward_readers[constraint.name] = (
        {d for d in direct if d in self.graph} | {r for rs in copied.values() for r in rs})
    return constraint

  def ungate(self, constraints):
    """The backward gathers `constraints` (gather_again's) gated on nothing:
    each runs when its source exists (where an order of the backward, a
    zero-bubble schedule's, could wait on what a gate waits for)."""
    changed = {c.name: dataclasses.replace(c, after=()) for c in constraints}
    self.constraints[:] = [changed.get(c.name, c) for c in self.constraints]

  def gate_together(self, constraints):
    """Gates the backward gathers `constraints` (gather_again's) on what
    all of them wait for that none of their readers makes: the gradient
    reaching their layer. Each then starts with the first, so they are
    independent of each other and can travel as one collective; no gate
    depends on any of them, so no cycle is made. Returns the constraints
    as changed (the same where there is nothing to share)."""
    if len(constraints) < 2:
      return constraints
    readers = set().union(*(self.backward_readers[c.name] for c in constraints))
    made = set(readers)
    stack = list(readers)
    while stack:
      for c in self.graph.consumer_nodes(stack.pop()):
        if c.name not in made:
          made.add(c.name)
          stack.append(c.name)
    gate = tuple(sorted(set().union(*(c.after for c in constraints)) - made))
    if not gate:
      return constraints
    changed = {c.name: dataclasses.replace(c, after=gate) for c in constraints}
    self.constraints[:] = [changed.get(c.name, c) for c in self.constraints]
    return [changed[c.name] for c in constraints]

  def _copy(self, node, name):
    """A copy of forward view `node` for the backward, named `name`."""
    from tensorflow.core.framework import node_def_pb2  # pylint: disable=import-outside-toplevel
    copy = node_def_pb2.NodeDef()
    copy.CopyFrom(node)
    copy.name = name
    self.copies.append((copy, self.shapes[node.name]))
    return copy

  def graph_def(self, graph_def, what):
    """(GraphDef, known shapes): `graph_def` (the graph these edits were
    planned on) with the copies, the rewiring and the constraints; `what`
    names the feature in the error a taken name gives."""
    out = graph_def
    if self.copies:
      from tensorflow.core.framework import graph_pb2  # pylint: disable=import-outside-toplevel
      out = graph_pb2.GraphDef()
      out.CopyFrom(graph_def)
      taken = {n.name for n in out.node}
      for copy, _ in self.copies:
        if copy.name in taken:
          raise PlanError(f"node '{copy.name}': {what} needs this name for a copy of a "
                          "view in the backward pass, and the graph has it")
        taken.add(copy.name)
      out.node.extend(c for c, _ in self.copies)
      for node in out.node:
        renames = self.rewire.get(node.name)
        if renames:
          for i, text in enumerate(node.input):
            if not text.startswith("^") and parse_input(text)[0] in renames:
              node.input[i] = renames[parse_input(text)[0]]
    out, known = insert_constraints(out, self.graph, self.shapes, self.constraints)
    for copy, info in self.copies:
      known[copy.name] = info
    return out, known
