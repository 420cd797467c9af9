"""A graph's inputs and outputs, in the order of the function it came from.

tfsplit's loader marks them (INPUT_INDEX_ATTR / OUTPUT_INDEX_ATTR, also for
plain graphs whose endpoints graph/recover.py found); unmarked graphs fall back
to their non-variable placeholders and their data-producing sinks.
"""
from tfsplit import constants
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.ir import Graph


def _marked(graph, attr):
  marked = [(n.attr[attr].i, n.name) for n in graph.nodes if attr in n.attr]
  return [name for _, name in sorted(marked)]


def graph_inputs(graph):
  """Input placeholder names, in the order the original function took them."""
  return _marked(graph, variables_lib.INPUT_INDEX_ATTR) or [
      n.name for n in graph.nodes
      if n.op == "Placeholder" and not variables_lib.is_variable_node(n)]


def graph_outputs(graph):
  """Output node names, in the order the original function returned them."""
  return _marked(graph, variables_lib.OUTPUT_INDEX_ATTR) or [
      n.name for n in graph.nodes
      if not graph.consumers(n.name) and n.op != "NoOp" and not constants.is_write_op(n.op)]


def unknown_input_dims(graph):
  """Inputs with an unknown dimension: [(name, shape)], the shape a list
  with None where unknown, or None for an unknown rank."""
  out = []
  for name in graph_inputs(graph):
    shape = graph.node(name).attr["shape"].shape
    if shape.unknown_rank:
      out.append((name, None))
      continue
    dims = [d.size if d.size >= 0 else None for d in shape.dim]
    if None in dims:
      out.append((name, dims))
  return out


def unbound_batch_inputs(graph):
  """Inputs whose leading (batch) dimension is unknown: [(name, shape)],
  the shape a list with None where unknown (a rank-0 or unknown-rank input
  has no batch dimension to bind)."""
  out = []
  for name in graph_inputs(graph):
    shape = graph.node(name).attr["shape"].shape
    if shape.unknown_rank or not shape.dim:
      continue
    dims = [d.size if d.size >= 0 else None for d in shape.dim]
    if dims[0] is None:
      out.append((name, dims))
  return out


def bind_batch(graph_def, batch_size):
  """A copy of `graph_def` whose inputs with an unknown batch dimension
  take `batch_size` examples: the shapes the graph runs with, so every
  later pass sees static sizes."""
  unbound = {name for name, _ in unbound_batch_inputs(Graph(graph_def))}
  out = type(graph_def)()
  out.CopyFrom(graph_def)
  for node in out.node:
    if node.name in unbound:
      node.attr["shape"].shape.dim[0].size = int(batch_size)
  return out
