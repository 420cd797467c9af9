"""Which backward ops compute weight gradients (the zero-bubble schedules' W).

A backward pass computes two kinds of gradients: with respect to a layer's
input, which the layers before it (and the stage before, in a pipeline)
wait for, and with respect to its weights, which only the optimizer's
update waits for. In a GraphDef they are separate ops: a MatMul's input
gradient is one MatMul, its weight gradient another. A backward op computes
weight gradients when every op that reads it, on its own device, does too
or is outside the forward and backward work (the update, or a running
gradient sum's reader after the last micro-batch).
"""


def weight_gradient_nodes(graph, candidates, in_blocks):
  """The nodes of `candidates` (backward ops) that compute weight gradients.

  graph: ir.Graph; in_blocks: the nodes of the forward and backward work
  (a consumer among them that is not itself a weight-gradient op makes a
  node an input-gradient op). A node read by an op on another device (a
  pipeline stage before it) or read by nothing stays out.
  """
  weights = set()
  for name in reversed(graph.topological_order()):
    if name not in candidates:
      continue
    device = graph.node(name).device
    control = set(graph.consumers(name, -1))
    readers = [c for c, i in graph.consumers(name) if (c, i) not in control]
    if readers and all(graph.node(c).device == device and
                       (c in weights or c not in in_blocks) for c in readers):
      weights.add(name)
  return weights
