"""Dropping the state updates a traced step makes to variables it does not own.

A Keras training step traced whole also updates the loss container's `Mean`
metrics (tf_keras always, Keras 3 for several outputs). Those updates belong
to the Keras loop, which keeps them on its own device; split with the step,
they would become shard variables nobody reads. `drop_variable_writes`
removes every op writing such a variable, then whatever only those ops
needed (their reads, their arithmetic, the variable's handle), and nothing
else: a node that had no consumer before stays.
"""
from tfsplit.constants import is_write_op
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.ir import Graph, input_node


def drop_variable_writes(graph_def, names):
  """(GraphDef without the writes to the captured variables named in `names`
  and what only they needed, [those of them dropped]). Outputs are never
  removed."""
  graph = Graph(graph_def)
  dropped_vars = {}
  for node in graph.nodes:
    if variables_lib.VAR_NAME_ATTR in node.attr:
      name = node.attr[variables_lib.VAR_NAME_ATTR].s.decode()
      if name in names:
        dropped_vars[node.name] = name
  writers = [n.name for n in graph.nodes if is_write_op(n.op) and n.input
             and input_node(n.input[0]) in dropped_vars]
  if not writers:
    return graph_def, []
  removed = set()
  frontier = list(writers)
  while frontier:
    name = frontier.pop()
    if name in removed:
      continue
    node = graph.node(name)
    removed.add(name)
    for text in node.input:
      source = input_node(text)
      if source in removed or source not in graph:
        continue
      upstream = graph.node(source)
      if variables_lib.OUTPUT_INDEX_ATTR in upstream.attr:
        continue
      # Orphaned by the removal: every consumer it had is gone now.
      if all(c in removed for c, _ in graph.consumers(source)):
        frontier.append(source)
  for node in graph.nodes:
    if node.name in removed:
      continue
    kept = [t for t in node.input if not (t.startswith("^") and t[1:] in removed)]
    if len(kept) != len(node.input):
      del node.input[:]
      node.input.extend(kept)
  graph.remove_nodes(removed)
  names = sorted({v for k, v in dropped_vars.items() if k in removed})
  return graph.to_graph_def(), names
