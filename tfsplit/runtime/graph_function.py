"""Run a (rewritten) GraphDef as a TF2 callable on the caller's variables.

The graph is imported with `tf.compat.v1.wrap_function`, not re-traced in a
tf.function body: re-tracing would add automatic control dependencies that
order stateful ops across devices, and would deadlock collectives. Captured
variable placeholders are fed the handles of real tf.Variables, matched by
the variable name tfsplit recorded when it loaded the graph.
"""
import tensorflow as tf

from tfsplit.errors import TfsplitError
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.endpoints import graph_inputs, graph_outputs
from tfsplit.graph.ir import Graph


def variable_key(variable):
  """The name tfsplit records for a tf.Variable or Keras variable."""
  name = getattr(variable, "path", None) or variable.name
  return name[:-2] if name.endswith(":0") else name


def import_graph(graph_def, variables=(), inputs=None, outputs=None):
  """A ConcreteFunction running `graph_def` on `variables`.

  variables: tf.Variables (or Keras variables) whose names match the graph's
    captured-variable annotations, or a dict {recorded name: variable};
    extra ones are ignored.
  inputs / outputs: node or tensor names; default: the ones tfsplit marked
    when loading (the original function's arguments and results).
  """
  graph = Graph(graph_def)
  inputs = list(inputs) if inputs is not None else graph_inputs(graph)
  outputs = list(outputs) if outputs is not None else graph_outputs(graph)
  pairs = variables.items() if isinstance(variables, dict) else [
      (variable_key(v), v) for v in variables]
  by_key = {}
  for key, var in pairs:
    # Keras 3 variables wrap a tf.Variable in `.value`.
    by_key[key] = var if hasattr(var, "handle") else var.value
  captures = {}
  for info in variables_lib.find_variables(graph):
    if info.kind != "captured":
      continue
    if info.name not in by_key:
      raise TfsplitError(
          f"node '{info.node}' (op Placeholder) reads variable '{info.name}', "
          "which is not among the variables given; pass every variable the "
          "graph uses (model and optimizer variables)")
    captures[info.node + ":0"] = by_key[info.name]

  specs = []
  for name in inputs:
    node = graph.node(name.split(":")[0])
    shape = tf.TensorShape(node.attr["shape"].shape) if "shape" in node.attr else None
    specs.append(tf.TensorSpec(shape, tf.as_dtype(node.attr["dtype"].type), name=None))

  def tensor(name):
    return name if ":" in name else name + ":0"

  def body(*args):
    default_graph = tf.compat.v1.get_default_graph()
    input_map = {tensor(n): a for n, a in zip(inputs, args)}
    for placeholder, var in captures.items():
      input_map[placeholder] = default_graph.capture(var.handle)
    return tf.graph_util.import_graph_def(
        graph_def, input_map=input_map,
        return_elements=[tensor(o) for o in outputs], name="")

  return tf.compat.v1.wrap_function(body, specs)
