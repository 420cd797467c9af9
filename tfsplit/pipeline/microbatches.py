"""Micro-batch order without a pipeline: micro-batch j+1 starts after j.

Micro-batch j+1's input slices wait (same-device control edges) for
micro-batch j's contribution to every running gradient sum, so one
micro-batch's activations are freed before the next one's are made. A
gradient contribution that itself needs every micro-batch (a batch statistic)
would make that a cycle: then micro-batches stay unordered, with a warning.
"""
from absl import logging

from tfsplit import constants
from tfsplit.errors import GraphValidationError
from tfsplit.graph.ir import Graph, parse_input


def order_microbatches(graph_def, input_slices, local_sums, mesh):
  """Adds the ordering edges to `graph_def` in place; returns how many.

  input_slices: [(device id, slice node)] of the graph's inputs;
  local_sums: per running sum, {device id: that micro-batch's member}.
  """
  axis = constants.MICROBATCH_AXIS
  if mesh.axes.get(axis, 1) <= 1 or not local_sums:
    return 0
  nodes = {n.name: n for n in graph_def.node}
  added = []
  for d, slice_name in input_slices:
    j = mesh.coord(d, axis)
    if j == 0:
      continue
    prev = mesh.device_id({**mesh.coords(d), axis: j - 1})
    deps = sorted({parse_input(m[prev])[0] for m in local_sums if prev in m})
    node = nodes[slice_name]
    added.append((node, len(node.input)))
    node.input.extend("^" + t for t in deps)
  try:
    Graph(graph_def).topological_order()
  except GraphValidationError as e:
    logging.warning("micro-batches left unordered (ordering would make a cycle: %s)",
                    str(e)[:200])
    for node, n in added:
      del node.input[n:]
    return 0
  return sum(len(node.input) - n for node, n in added)
