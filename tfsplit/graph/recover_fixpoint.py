"""The fixpoint that finds the captured variables' shapes: the sources of a
shape tried in a fixed order, round after round, until nothing new is
learnt, then every update checked against its variable. It owns that order
and the conjectures (an operand's shape, a scalar) and leaves the rules to
recover_shapes.py and the constants gradient code left to recover_hints.py,
so that the order of the sources reads in one place.

Each round runs TF's own shape inference (Grappler's GraphProperties, as
shapes.py) on a private copy of the graph in which the variables known so
far (fully or partly) are VarHandleOps of that shape, and in which variable
updates are NoOps (Grappler would otherwise give an assigned value the shape
of the variable it is assigned to, which would make any guess about that
variable look right). Sources, in the order they are tried; the label is
what `RecoveryReport.sources` counts:
- *recorded read shape*: a graph written with `as_graph_def(add_shapes=True)`
  keeps each op's static output shapes (`_output_shapes`); a ReadVariableOp's
  is its variable's shape;
- *gradient constant*: TF's gradient code folds a variable's static shape
  into constants: `gradient_tape/<ResourceGather>/Const` (the dense shape of
  the gather's IndexedSlices gradient), a `Shape*` Const colocated
  (`_class: loc:@<read>`) with a read whose gather it differentiates, and
  the `Shape` / `Shape_1` of the operands of an op whose gradient takes its
  operands' shapes in order (Einsum, BatchMatMul, broadcasting arithmetic),
  found by the gradient's name scope (the op named like it, or the only such
  op directly in it: `gradient_tape/.../einsum_2/Shape_1` is the second
  operand of `.../einsum_2/Einsum`), where that operand is a variable's read
  (an expert weight `edf` whose `f` nothing else fixes). Taken when it agrees
  with what the rules below find;
- *update*: the value an AssignVariableOp / AssignAdd / AssignSub writes has
  the variable's shape (TF checks it when the op runs); for ResourceApply*,
  so has the gradient; ResourceScatter* fix all but the first dimension;
- *written value*: the same check read backwards: a variable whose read is
  written unchanged (through Identity, Cast, unary elementwise ops, AddN, a
  product with a scalar) into a variable of known shape has that shape
  (tf_keras's SGD adds its momentum slot to the weight);
- *reader*: the op a read feeds fixes dimensions of the variable: MatMul and
  BatchMatMul (the contracted dimension from the other operand, the other
  one from the output), Einsum (each letter's size wherever it is known),
  BiasAdd (the channel dimension), ResourceGather / GatherV2 (all but the
  first dimension);
- two helpers make more tensors known to the inference: gradient code also
  leaves the static shapes of the forward tensors it differentiates as
  constants `gradient_tape/<scope>/Shape` (input 0 of the op found as
  above) and `.../Shape_1` (input 1); they become EnsureShape hints on those
  tensors, but
  only where the tensor's rank and known dimensions agree with the constant.
  And integer arithmetic on constants (the StridedSlice / ConcatV2 that
  gradient code applies to those shapes, which Grappler does not evaluate)
  is evaluated once by TensorFlow (without the constants' colocation with
  nodes it leaves out) and becomes constants in the copy;
- *operand* (when a round of the above learns nothing new): a variable that
  its update combines elementwise with other tensors (Adam's moments:
  m += (g - m) * (1 - beta1)) is conjectured to have the shape of one of
  those tensors, or of the one variable whose update reads it (an optimizer
  slot has its variable's shape), or to be a scalar; all unknown variables
  at once. A conjecture is kept only when the inference then gives every
  update of the variable a value of exactly that shape (as TF requires at
  run time), checked again with only the passing conjectures in place (one
  may have passed thanks to another one that failed); a conjecture an
  update contradicts is not tried again;
- *scalar operand*: a variable that is only read, and only ever combined
  with scalars (a learning rate), is a scalar; so is one only read whose
  reads reach, through elementwise ops, values written to variables of
  known shapes that leave it no dimension but 1 (SGD's learning rate times
  gradients of different shapes: it must broadcast into each); the graph
  cannot tell () from [1] there, and () is what optimizers make;
- *row slot*: a variable updated only row by row (ResourceScatter*, the
  optimizer slot of a variable with a sparse gradient) has the shape of the
  one variable whose update reads it, where the rows it is given agree
  (counted as *operand*).
At the end every update of every variable must write a value compatible
with the variable's shape; a variable that fails this is left unknown.
"""
import collections

from absl import logging

from tfsplit.errors import GraphValidationError
from tfsplit.graph.recover_hints import recorded_shapes, variable_shape_constants
from tfsplit.graph.recover_shapes import (SOURCE_CONSTANT, SOURCE_OPERAND, SOURCE_READER,
                                          SOURCE_RECORDED, SOURCE_SCALAR, SOURCE_UPDATE,
                                          SOURCE_WRITTEN, compatible, full, merge,
                                          operand_candidates, reader_shape, requirements,
                                          scatter_shape, update_shapes)

_MAX_ROUNDS = 64


def _only_unit_fits(bounds):
  """Whether only shapes of size-1 dimensions broadcast into every shape of
  `bounds` (full shapes): then the variable is taken to be a scalar."""
  if not bounds:
    return False
  for d in range(1, min(len(b) for b in bounds) + 1):
    sizes = {b[-d] for b in bounds}
    if len(sizes) == 1 and 1 not in sizes:
      return False  # that dimension could be the common size
  return True


def _fixpoint(graph, st, inf, variables):
  """Fills in var.shape / var.source as far as the graph determines them."""
  tried = collections.defaultdict(set)
  constants = variable_shape_constants(graph, st, inf.shape_targets)
  recorded = recorded_shapes(st)
  owners = st.update_readers()
  by_node = {v.node: v for v in variables}

  def var_shapes(extra=None):
    out = {}
    for v in variables:
      shape = (extra or {}).get(v.node, v.shape)
      if shape is not None and v.dtype:
        out[v.node] = (v.dtype, shape)
    return out

  inf.run(var_shapes())
  known = 0
  for _ in range(_MAX_ROUNDS):
    progress = False
    now_known = sum(v.known for v in variables)
    if now_known != known:
      # A rejection may have come from another wrong conjecture: with more
      # variables known, every candidate gets another chance.
      tried.clear()
      known = now_known
    # Direct rules.
    exact, bounds = requirements(st, inf, by_node)
    for v in variables:
      if v.known:
        continue
      before = v.shape
      if v.node in recorded:
        v.shape, v.source = recorded[v.node], SOURCE_RECORDED
        progress = True
        continue
      try:
        for read in st.reads[v.node]:
          v.shape = reader_shape(st, inf, v, read)
        for value in update_shapes(st, inf, v):
          v.shape = merge(v.shape, value)
        v.shape = merge(v.shape, scatter_shape(st, inf, v))
        for shape in exact.get(v.node, ()):
          v.shape = merge(v.shape, shape)
      except ValueError:
        v.shape = before  # contradicting evidence: leave it to the others
      constant = constants.get(v.node)
      if constant is not None and compatible(v.shape, constant):
        v.shape, v.source = constant, SOURCE_CONSTANT
        progress = True
        continue
      if constant is not None:
        logging.info("gradient shape constant %s of variable '%s' contradicts %s; not used",
                     constant, v.node, v.shape_text())
      if full(v.shape):
        updates = update_shapes(st, inf, v)
        if any(full(u) and u == v.shape for u in updates):
          v.source = SOURCE_UPDATE
        elif v.shape in exact.get(v.node, ()):
          v.source = SOURCE_WRITTEN
        else:
          v.source = SOURCE_READER
        progress = True
      elif (not st.updated(v.node) and
            compatible(v.shape, ()) and _only_unit_fits(bounds.get(v.node))):
        v.shape, v.source = (), SOURCE_SCALAR
        progress = True
      elif v.shape != before:
        progress = True
    if inf.add_hints():
      progress = True
    if progress:
      inf.run(var_shapes())
      continue
    # Conjectures, all unknown variables at once, checked by their updates.
    conjecture = {}
    for v in variables:
      if v.known or not v.dtype:
        continue
      owner = by_node.get(next(iter(owners[v.node]))) if len(owners[v.node]) == 1 else None
      candidates, read_partners = operand_candidates(
          st, inf, v, owner.shape if owner is not None and owner.known else None)
      if not st.writers[v.node] and not st.appliers[v.node]:
        if st.scatters[v.node]:
          # Updated row by row only (the optimizer slot of a variable with a
          # sparse gradient): the shape of the one variable whose update
          # reads it, where the rows it is given agree with that.
          shape = owner.shape if owner is not None and owner.known else None
          if shape is not None and v.shape is not None and len(v.shape) == len(shape) and \
              compatible(v.shape, shape):
            v.shape, v.source = shape, SOURCE_OPERAND
            progress = True
          continue
        if read_partners and all(s == () for s in read_partners) and compatible(v.shape, ()):
          v.shape, v.source = (), SOURCE_SCALAR
          progress = True
        continue
      for shape in candidates:
        if shape not in tried[v.node]:
          conjecture[v.node] = shape
          break
    if progress:
      inf.run(var_shapes())
      continue
    if not conjecture:
      break
    inf.run(var_shapes(conjecture))
    passed = {}
    for node, shape in conjecture.items():
      values = update_shapes(st, inf, by_node[node])
      if values and all(full(s) and s == shape for s in values):
        passed[node] = shape
      elif any(s is not None and not compatible(s, shape) for s in values):
        tried[node].add(shape)  # its updates write another shape
        progress = True
    # A conjecture may only have passed thanks to another one that failed
    # (Adam's update of w reads its moments): check again with only the
    # passing ones in place, until they all pass.
    while passed and len(passed) < len(conjecture):
      conjecture = passed
      inf.run(var_shapes(conjecture))
      passed = {node: shape for node, shape in conjecture.items()
                if all(full(s) and s == shape
                       for s in update_shapes(st, inf, by_node[node]))}
    for node, shape in passed.items():
      by_node[node].shape, by_node[node].source = shape, SOURCE_OPERAND
      progress = True
    inf.run(var_shapes())
    if not progress:
      break
  _check_updates(st, inf, variables)


def solve(graph, st, inf, variables):
  """_fixpoint, leaving shapes unknown if TF's shape inference fails."""
  known = {v.node: (v.shape, v.source) for v in variables if v.known}
  try:
    _fixpoint(graph, st, inf, variables)
  except GraphValidationError as e:
    logging.info("shape recovery stopped: %s", e)
    for v in variables:
      v.shape, v.source = known.get(v.node, (None, None))


def _check_updates(st, inf, variables):
  """Every update must write a value of its variable's shape."""
  for v in variables:
    if not v.known:
      continue
    for value in update_shapes(st, inf, v):
      if value is not None and not compatible(value, v.shape):
        logging.info("recovered shape %s of variable '%s' disagrees with an update "
                     "writing %s; leaving it unknown", v.shape, v.node, value)
        v.source = None
        break
