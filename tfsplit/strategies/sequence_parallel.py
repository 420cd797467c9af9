"""Sequence parallelism (Korthikanti et al., 2022) in the megatron preset's
tensor-parallel regions, as sharding constraints (layout/spec.py).

Between a row-parallel contraction (attention's output projection, an MLP's
fc2) and the next column-parallel ones (the next Q/K/V, fc1) run the
residual add, the norm, dropout and bias adds. Without sequence parallelism
every tp rank runs them on the whole tensor; here they run on 1/tp of the
tokens:
- the row-parallel output (a partial sum over tp; through the views that
  give it back its [batch, sequence, ...] shape) is constrained to a split
  of its sequence dimension (dimension 1; 0 for [tokens, features]) over
  tp: the reshard reduce-scatters it where it all-reduced before;
- the tensor the column-parallel contractions read (the norm's output) is
  constrained, for them alone, to its whole sequence: an all-gather;
- the weight-gradient contractions that read that tensor in the backward
  pass read their own all-gather of it, gated on their output gradient, so
  the step keeps only the 1/tp split for the backward (Megatron's gather
  again in the backward); a view in between (Keras's Tensordot reshape) is
  copied for them;
- the output gradient the row-parallel contraction's backward reads (its
  weight gradient and its input gradient) is all-gathered once for both.
Everything else, the norm's partial parameter gradients over tp included,
is propagation and the reshard's (sharding/propagate.py, reshard.py).
"""
import collections

from absl import logging

from tfsplit import constants
from tfsplit.errors import PlanError
from tfsplit.graph.ir import parse_input
from tfsplit.layout.spec import Constraint, axis_parts, join_parts
from tfsplit.sharding.gathers import VIEW_OPS, GatherEdits, data_inputs, scope
from tfsplit.strategies.megatron import CONTRACTIONS, pair_contractions

# What keeps a row-parallel output's values (so its sequence split) and
# what a column-parallel operand is read through.
_SHAPE_VIEWS = frozenset(["Reshape", "Identity"])


def activation_bytes(s, b, h, a, t, sequence_parallel):
  """Bytes one transformer layer keeps for its backward at tensor-parallel
  size t, 16-bit activations and 1-byte dropout masks (Korthikanti et al.,
  Table 2): s*b*h*(10 + 24/t + 5as/(ht)) without sequence parallelism,
  s*b*h*(34/t + 5as/(ht)) with it."""
  attention = 5 * a * s / (h * t)
  if sequence_parallel:
    return s * b * h * (34 / t + attention)
  return s * b * h * (10 + 24 / t + attention)


def sequence_dim(rank):
  """The dimension split over tp: the sequence of [batch, sequence, ...];
  the tokens of [tokens, features]."""
  return 1 if rank >= 3 else 0


def _spec(propagation, name, port=0):
  """The sharding tensor (name, port) is consumed in (reduced at its
  producer, where the propagation did that)."""
  spec = propagation.reduced_at_source.get((name, port))
  return spec if spec is not None else propagation.outputs[name][port]


def _view_tail(graph, roles, name, role=constants.FORWARD):
  """The last node of the chain of views (Reshape, Identity) that alone
  read `name` in pass `role`, or `name`."""
  while True:
    readers = [c for c in graph.consumer_nodes(name) if roles.get(c.name) == role]
    if len(readers) != 1 or readers[0].op not in _SHAPE_VIEWS or \
        parse_input(readers[0].input[0])[0] != name:
      return name
    name = readers[0].name


def _operand_path(graph, text):
  """[node names] from the source of operand `text` down through views to
  `text`'s node, the source first (Megatron's Identity / Cast / Reshape)."""
  path = [parse_input(text)[0]]
  while graph.node(path[0]).op in VIEW_OPS:
    path.insert(0, parse_input(graph.node(path[0]).input[0])[0])
  return path


class SequenceParallel(object):
  """The constraints (and view copies) of one graph's sequence parallelism."""

  def __init__(self, analysis, propagation, mesh, axis):
    self.analysis, self.prop, self.mesh, self.axis = analysis, propagation, mesh, axis
    self.graph, self.shapes, self.roles = analysis.graph, analysis.shapes, analysis.roles
    self.edits = GatherEdits(self.graph, self.shapes, self.roles)
    self.constraints, self.copies = self.edits.constraints, self.edits.copies
    self.scattered, self.gathered = [], []   # tensors (node names) constrained
    contractions, kind = pair_contractions(self.graph, self.shapes, analysis.variables,
                                           self.roles)
    self.operand = {name: op for name, op, _, _ in contractions}
    readers = collections.defaultdict(set)   # source -> its forward readers
    columns = collections.defaultdict(list)  # source -> the columns reading it
    for name, _, _, _ in contractions:
      # Column-parallel contractions read their input whole over tp; so do
      # the weight contractions the preset keeps replicated (an LM head:
      # else its logits, vocabulary-wide, are split over the sequence).
      if kind.get(name) in ("column", None):
        data = data_inputs(self.graph.node(name))
        if len(data) < 2:
          continue
        path = _operand_path(self.graph, data[1 - self.operand[name]]) + [name]
        readers[path[0]].add(path[1])
        if kind.get(name) == "column":
          columns[path[0]].append(name)
    # The residual stream: what column-parallel contractions read. A row-
    # parallel output of another shape (a classifier's logits after a
    # pooler) stays all-reduced, and so does the gradient of a column
    # input off the stream (the pooler's [batch, features]).
    stream = {self._shape(source) for source in columns}
    for name, _, _, _ in contractions:
      if kind.get(name) == "row" and axis in self._partial_parts(name) and \
          self._shape(_view_tail(self.graph, self.roles, name)) in stream:
        self._scatter(name)
    stream = {self._shape(t) for t in self.scattered}
    for source in sorted(readers):
      if self._gather(source, readers[source]) and columns[source] and \
          self._shape(source) in stream:
        self._scatter_input_gradient(source, columns[source])

  def _shape(self, name):
    info = self.shapes.tensor(name, 0)
    return None if info is None or info.shape is None else tuple(info.shape)

  def _with_sequence_axis(self, name, port=0):
    """(dims, d): `name`'s dims (the first propagation's) with sequence
    dimension d also split over the axis, after the splits it has."""
    dims = list(_spec(self.prop, name, port).dims)
    d = sequence_dim(len(dims))
    dims[d] = join_parts((axis_parts(dims[d]) if dims[d] else []) + [self.axis])
    return tuple(dims), d

  def _sequence_split(self, name, port=0):
    """`name`'s dims with its sequence dimension also split over the axis,
    or None where it is already or its size does not divide."""
    info = self.shapes.tensor(name, port)
    if info is None or info.shape is None or None in info.shape:
      return None
    if self.axis in axis_parts(_spec(self.prop, name, port).dims[sequence_dim(len(info.shape))]
                               or ""):
      return None
    dims, d = self._with_sequence_axis(name, port)
    return dims if info.shape[d] % self.mesh.size_of(dims[d]) == 0 else None

  def _scatter_input_gradient(self, source, columns):
    """Reduce-scatter, over the sequence, of the gradient the column-parallel
    contractions `columns` give their input `source` (partial over tp): one
    for their sum where only it reads them (Q, K and V of a pre-norm
    block), else one each."""
    grads = []
    for column in columns:
      node = self.graph.node(column)
      weight = parse_input(data_inputs(node)[self.operand[column]])[0]
      for c in self.graph.consumer_nodes(weight):
        if c.op in CONTRACTIONS and self.roles.get(c.name) == constants.BACKWARD and \
            self.axis in self._partial_parts(c.name):
          grads.append(_view_tail(self.graph, self.roles, c.name, constants.BACKWARD))
    if not grads:
      return
    readers = {tuple(sorted(r.name for r in self.graph.consumer_nodes(g))) for g in grads}
    if len(readers) == 1 and len(next(iter(readers))) == 1:
      total = self.graph.node(next(iter(readers))[0])
      if total.op in ("AddN", "AddV2", "Add") and \
          sorted(s for s, _ in self.graph.data_inputs(total.name)) == sorted(grads):
        grads = [total.name]
    for grad in grads:
      dims = self._sequence_split(grad)
      if dims is not None and self.shapes.tensor(grad, 0).shape == \
          self.shapes.tensor(source, 0).shape:
        self.constraints.append(Constraint(f"{grad}/sequence_scatter", (grad, 0), dims))

  def _partial_parts(self, name):
    return {p for a in _spec(self.prop, name).partial for p in axis_parts(a)}

  def _scatter(self, row):
    """Reduce-scatter of row-parallel `row`'s output over the sequence, and
    one all-gather of the output gradient its backward reads."""
    tail = _view_tail(self.graph, self.roles, row)
    info = self.shapes.tensor(tail, 0)
    node = self.graph.node(row)
    if info is None or info.shape is None or None in info.shape:
      raise PlanError(f"node '{row}' (op {node.op}): sequence parallelism splits its "
                      "output over the sequence, whose size is not known; give the graph "
                      "static shapes or drop sequence_parallel (--sequence-parallel)")
    dims, d = self._with_sequence_axis(tail)
    n = self.mesh.size_of(dims[d])
    if info.shape[d] % n:
      raise PlanError(
          f"node '{row}' (op {node.op}): sequence parallelism splits dimension {d} "
          f"(size {info.shape[d]}) of its output over {dims[d]}={n}, which does not "
          f"divide it; use a sequence length that divides by {n}, a smaller tp, or drop "
          "sequence_parallel (--sequence-parallel)")
    self.constraints.append(Constraint(f"{tail}/sequence_scatter", (tail, 0), dims))
    self.scattered.append(tail)
    # The row's backward contractions (its weight gradient, its input
    # gradient) read the gradient of its output: gather it once for both.
    data = data_inputs(node)
    inputs = {parse_input(t) for t in data}
    grads, readers = set(), set()
    for src, _ in inputs:
      for consumer in self.graph.consumer_nodes(src):
        if consumer.op not in CONTRACTIONS or \
            self.roles.get(consumer.name) != constants.BACKWARD:
          continue
        cdata = [parse_input(t) for t in data_inputs(consumer)]
        others = [t for t in cdata if t not in inputs]
        if len(others) == 1 and len(cdata) == 2:
          grads.add(others[0])
          readers.add(consumer.name)
    if len(grads) == 1:
      (gsrc, gport), = grads
      spec = _spec(self.prop, gsrc, gport)
      if not spec.partial and self.axis not in {p for a in spec.axes_used
                                                for p in axis_parts(a)}:
        self.constraints.append(Constraint(
            f"{scope(sorted(readers)[0])}/sequence_gather", (gsrc, gport), spec.dims,
            frozenset(readers)))

  def _gather(self, source, readers):
    """All-gather of `source` over the sequence for the column-parallel
    contractions (their first readers: `readers`), and one for the weight
    gradients that read it (or a view of it) in the backward; False where
    the preset does not read it whole over the axis (nothing added)."""
    spec = _spec(self.prop, source)
    if spec.partial or self.axis in {p for a in spec.axes_used for p in axis_parts(a)}:
      return False  # not what the preset reads whole over tp: left as propagation has it
    self.constraints.append(Constraint(f"{source}/sequence_gather", (source, 0), spec.dims,
                                       frozenset(readers)))
    self.gathered.append(source)
    # The weight-gradient contractions reading it (or a forward view of it)
    # in the backward: their own gather, gated on their output gradient.
    self.edits.gather_again(source, spec.dims, readers, "sequence", ops=CONTRACTIONS)
    return True

  def graph_def(self):
    """(GraphDef, known shapes) with the constraints and view copies."""
    graph_def, known = self.edits.graph_def(self.analysis.graph_def, "sequence parallelism")
    logging.info("sequence parallelism: %d reduce-scatters, %d all-gathers (%d for the "
                 "backward), %d views copied", len(self.scattered), len(self.gathered),
                 sum(c.readers is not None and c.after != () for c in self.constraints),
                 len(self.copies))
    return graph_def, known
