"""What a plainly written tf.function graph lost, recovered from the graph.

`tf.io.write_graph(concrete_fn.graph.as_graph_def(), ...)` keeps each captured
variable as `Placeholder(dtype=resource, shape=[])` named after its first
reading op (`gpt/block_0/mlp/fc1/MatMul/ReadVariableOp/resource`): no name,
no shape, no dtype; and nothing marks the function's inputs and outputs.
`recover(graph_def)` finds them again and writes them as the private attrs
tfsplit records when it loads a ConcreteFunction itself (variables.py), so
everything downstream works unchanged. `io.load_graph` calls it for graph
files with unannotated captures.

This module holds the entry points and the report; the work is cut by job
into modules it imports (none of which imports it), so that each rule can be
read next to the few others it works with: recover_structure.py (who reads
and writes each captured variable; the function's outputs), recover_hints.py
(what gradient code left of static shapes; the copy of the graph TF's
inference runs on), recover_shapes.py (that inference, and what each use of
a variable says of its shape), recover_fixpoint.py (the order in which the
shape sources are tried), recover_names.py (names, roles, trainability) and
saved_variables.py (`--variables`).

Dtypes come from the ops that read or write the handle (ReadVariableOp's
dtype, ...). Shapes are found by a fixpoint over TF's own shape inference:
recover_fixpoint.py lists the sources in the order they are tried, each with
the label `RecoveryReport.sources` counts. Names are a heuristic
(recover_names.py).

`variables_from` (a checkpoint prefix or SavedModel directory) adds the saved
variables (`--variables`): see `saved_variables.match_saved_variables` for
the matching rule. Variables still without a shape get a name and dtype but
no shape attr; the commands that need shapes refuse them in one line
(`require_variable_shapes`).

Outputs: the Identity sinks with a control input from a NoOp (how a
tf.function graph with side effects returns its results: `Identity`,
`Identity_1`, ... after the NoOp that runs its stateful ops), failing that
(no side effects) the sinks named `Identity`, `Identity_<n>`; in the order
of their number. Inputs: the non-resource placeholders, in node order (a
plain graph cannot tell arguments from captured non-variable tensors).
Both are marked only when the graph has no marks.
"""
import collections
import dataclasses
from typing import List, Optional, Tuple

from absl import logging
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import tensor_shape

from tfsplit.errors import TfsplitError
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.ir import Graph, without_gc
from tfsplit.graph.recover_fixpoint import solve
from tfsplit.graph.recover_names import name_variables
from tfsplit.graph.recover_shapes import Inference
from tfsplit.graph.recover_structure import Structure, recover_outputs
from tfsplit.graph.saved_variables import match_saved_variables, read_saved_variables


@dataclasses.dataclass
class Recovered:
  """One captured variable as recovered."""
  node: str
  name: str = ""
  dtype: Optional[int] = None
  shape: Optional[Tuple[Optional[int], ...]] = None  # partial while unknown
  source: Optional[str] = None   # what fixed the shape (None: not fixed)
  trainable: Optional[bool] = None
  scope: str = ""
  role: str = "variable"
  owner: Optional[str] = None    # an optimizer slot: its variable's node

  @property
  def known(self):
    return self.source is not None

  def shape_text(self):
    if self.shape is None:
      return "?"
    return "[" + ", ".join("?" if d is None else str(d) for d in self.shape) + "]"


@dataclasses.dataclass
class RecoveryReport:
  variables: List[Recovered]
  inputs: List[str]
  outputs: List[str]
  hints: int = 0                  # gradient shape constants used
  rounds: int = 0                 # shape-inference runs
  matched: int = 0                # variables matched to saved ones

  @property
  def missing(self):
    return [v for v in self.variables if not v.known or not v.dtype]

  @property
  def sources(self):
    return collections.Counter(v.source for v in self.variables if v.known)

  def summary(self):
    counts = ", ".join(f"{n} from {s}" for s, n in sorted(self.sources.items()))
    return (f"{len(self.variables)} captured variables ({counts or 'none known'}; "
            f"{len(self.missing)} unknown), {self.hints} gradient shape hints, "
            f"{self.rounds} inference rounds, outputs {self.outputs}")


def missing_shapes_message(label, missing, total, variables_from=None):
  """One line naming the variables without a shape: the trained ones first
  (up to 6: the weights whose shapes are open; their slots follow them).
  With `variables_from` (the --variables given), what it holds instead."""
  missing = sorted(missing, key=lambda v: not v.trainable)  # stable: node order kept
  count = min(max(3, sum(bool(v.trainable) for v in missing)), 6)
  shown = ", ".join(v.name + (f" {v.shape_text()}" if v.shape is not None else "")
                    for v in missing[:count])
  more = f" and {len(missing) - count} more" if len(missing) > count else ""
  head = (f"{label}: {len(missing)} of {total} captured variables have no shape the "
          f"graph determines ({shown}{more})")
  fixes = ("write the graph with its shapes (concrete_fn.graph.as_graph_def("
           "add_shapes=True)), or load it from its tf.function "
           "(tfsplit.graph.load_graph(concrete_fn)) so tfsplit records them")
  if variables_from is None:
    return (f"{head}; pass --variables PATH (a checkpoint or SavedModel holding them) to "
            f"take shapes from there, {fixes}")
  saved = [v.name for v in read_saved_variables(variables_from)]
  held = ", ".join(f"'{n}'" for n in saved[:3]) + (" ..." if len(saved) > 3 else "")
  return (f"{head}; --variables {variables_from} holds {len(saved)} variables under other "
          f"names ({held or 'none'}), none of them these: save the same tf.function's "
          "variables by their names (tf.train.Checkpoint(**{var.name.split(':')[0]: var}), "
          f"or a SavedModel of the step), or {fixes}")


def needs_recovery(graph_def):
  """Whether `graph_def` has captured variables tfsplit did not annotate."""
  return any(n.op == "Placeholder" and n.attr["dtype"].type == types_pb2.DT_RESOURCE and
             variables_lib.VAR_SHAPE_ATTR not in n.attr and
             variables_lib.VAR_NAME_ATTR not in n.attr for n in graph_def.node)


@without_gc
def recover(graph_def, variables_from=None):
  """Annotates `graph_def` in place (see the module doc); a RecoveryReport.

  Only unannotated captures are touched; inputs and outputs are marked only
  when nothing is marked yet. Variables whose shape stays unknown get a name
  and dtype but no shape (`missing` in the report).
  """
  graph = Graph(graph_def)
  marked_out = any(variables_lib.OUTPUT_INDEX_ATTR in n.attr for n in graph.nodes)
  outputs = (sorted(((n.attr[variables_lib.OUTPUT_INDEX_ATTR].i, n.name) for n in graph.nodes
                     if variables_lib.OUTPUT_INDEX_ATTR in n.attr))
             if marked_out else None)
  outputs = [n for _, n in outputs] if outputs is not None else recover_outputs(graph)
  inputs = []
  if not marked_out and outputs:
    for index, name in enumerate(outputs):
      graph.node(name).attr[variables_lib.OUTPUT_INDEX_ATTR].i = index
    if not any(variables_lib.INPUT_INDEX_ATTR in n.attr for n in graph.nodes):
      inputs = [n.name for n in graph.nodes if n.op == "Placeholder" and
                not variables_lib.is_variable_node(n)]
      for index, name in enumerate(inputs):
        graph.node(name).attr[variables_lib.INPUT_INDEX_ATTR].i = index

  handles = [n.name for n in graph.nodes if n.op == "Placeholder" and
             n.attr["dtype"].type == types_pb2.DT_RESOURCE and
             variables_lib.VAR_SHAPE_ATTR not in n.attr and
             variables_lib.VAR_NAME_ATTR not in n.attr]
  report = RecoveryReport([], inputs, outputs)
  if not handles:
    return report
  st = Structure(graph, handles)
  variables = [Recovered(h, dtype=variables_lib._dtype_from_users(graph, graph.node(h)))  # pylint: disable=protected-access
               for h in handles]
  inf = Inference(graph)
  solve(graph, st, inf, variables)
  name_variables(graph, st, variables, outputs)
  if variables_from is not None:
    saved = read_saved_variables(variables_from)
    report.matched = match_saved_variables(variables, saved)
    if report.matched and any(not v.known for v in variables):
      solve(graph, st, inf, variables)  # saved shapes may determine others
  report.variables = variables
  report.hints = len(inf.hints)
  report.rounds = inf.runs
  for v in variables:
    node = graph.node(v.node)
    node.attr[variables_lib.VAR_NAME_ATTR].s = v.name.encode()
    if v.dtype:
      node.attr[variables_lib.VAR_DTYPE_ATTR].type = v.dtype
    if v.trainable is not None:
      node.attr[variables_lib.VAR_TRAINABLE_ATTR].b = v.trainable
    if v.known and v.dtype:
      node.attr[variables_lib.VAR_SHAPE_ATTR].shape.CopyFrom(
          tensor_shape.TensorShape(v.shape).as_proto())
  logging.info("recovered %s", report.summary())
  return report


def require_variable_shapes(graph_def, label="graph", variables_from=None):
  """Raises TfsplitError (one line) if a captured variable has no known
  shape; `variables_from`: the --variables the shapes were looked for in."""
  missing, total = [], 0
  for node in graph_def.node:
    if not variables_lib.is_variable_node(node) or node.op != "Placeholder":
      continue
    total += 1
    if variables_lib.VAR_SHAPE_ATTR not in node.attr or \
        variables_lib.VAR_DTYPE_ATTR not in node.attr:
      name = (node.attr[variables_lib.VAR_NAME_ATTR].s.decode()
              if variables_lib.VAR_NAME_ATTR in node.attr else node.name)
      missing.append(Recovered(node.name, name=name, trainable=(
          node.attr[variables_lib.VAR_TRAINABLE_ATTR].b
          if variables_lib.VAR_TRAINABLE_ATTR in node.attr else None)))
  if missing:
    raise TfsplitError(missing_shapes_message(label, missing, total, variables_from))
