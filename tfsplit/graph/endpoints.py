"""A graph's inputs and outputs, in the order of the function it came from.

tfsplit's loader marks them (INPUT_INDEX_ATTR / OUTPUT_INDEX_ATTR, also for
plain graphs whose endpoints graph/recover.py found); unmarked graphs fall back
to their non-variable placeholders and their data-producing sinks.
"""
from tfsplit import constants
from tfsplit.graph import variables as variables_lib


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
