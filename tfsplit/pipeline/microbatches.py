"""Micro-batch order without a pipeline: micro-batch j+1 starts after j.

Micro-batch j+1's first ops that depend on a variable wait (same-device
control edges) for micro-batch j's contribution to every running gradient
sum, so one micro-batch's activations are freed before the next one's are
made. What depends on no variable (input slices, masks, position ids, a
loss's batch-wide token count) is left free to run first: it is small, and a
micro-batch's backward may need it from every micro-batch. A coupling through
activations is refused before ordering (see passes/split.py), so the order
cannot make a cycle.
"""
from tfsplit import constants
from tfsplit.errors import GraphValidationError, PlanError
from tfsplit.graph.ir import Graph, parse_input


def order_microbatches(graph_def, sets, local_sums, mesh):
  """Adds the ordering edges to `graph_def` in place; returns how many.

  sets: schedules.micro_batch_sets of the graph ({(device id, j, chunk): {'F_in': ...}});
  local_sums: per running sum, {device id: that micro-batch's member}.
  """
  axis = constants.MICROBATCH_AXIS
  if mesh.axes.get(axis, 1) <= 1 or not local_sums:
    return 0
  nodes = {n.name: n for n in graph_def.node}
  added = 0
  for (d, j, _), blocks in sorted(sets.items()):
    if j == 0:
      continue
    prev = mesh.device_id({**mesh.coords(d), axis: j - 1})
    deps = sorted({parse_input(m[prev])[0] for m in local_sums if prev in m})
    for name in sorted(blocks["F_in"]):
      node = nodes[name]
      new = ["^" + t for t in deps if "^" + t not in node.input]
      node.input.extend(new)
      added += len(new)
  try:
    Graph(graph_def).topological_order()
  except GraphValidationError as e:
    # check_microbatch_independence refuses every coupling it can name
    # before this; a cycle left is tfsplit's own defect.
    raise PlanError(f"ordering the micro-batches would make a cycle ({str(e)[:200]}), "
                    "though no micro-batch was found to need another's activations: "
                    "a defect of tfsplit, please report it with the graph; "
                    "microbatches=1 runs this graph meanwhile") from None
  return added


def ordered_microbatches(graph_def, records, mesh):
  """Device ids (micro-batch > 0) with an op waiting, through a control input,
  for an op of the previous micro-batch on the same replica: what the order
  above makes of a graph, read back from its node records."""
  axis = constants.MICROBATCH_AXIS
  waiting = set()
  for node in graph_def.node:
    record = records.get(node.name)
    if record is None or record.device_id is None or mesh.coord(record.device_id, axis) == 0:
      continue
    d = record.device_id
    prev = mesh.device_id({**mesh.coords(d), axis: mesh.coord(d, axis) - 1})
    if any(t.startswith("^") and t[1:] in records and records[t[1:]].device_id == prev
           for t in node.input):
      waiting.add(d)
  return waiting
