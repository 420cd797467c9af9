"""Micro-batches: the check that none needs another's activations, and their
order without a pipeline (micro-batch j+1 starts after j).

Micro-batch j+1's first ops that depend on a variable wait (same-device
control edges) for micro-batch j's contribution to every running gradient
sum, so one micro-batch's activations are freed before the next one's are
made. What depends on no variable (input slices, masks, position ids, a
loss's batch-wide token count) is left free to run first: it is small, and a
micro-batch's backward may need it from every micro-batch. A coupling through
activations is refused before ordering (`check_independence`, the
check_microbatch_independence pass), so the order cannot make a cycle.
"""
from tfsplit import constants
from tfsplit.errors import GraphValidationError, PlanError
from tfsplit.graph.endpoints import graph_outputs
from tfsplit.graph.ir import Graph, input_node, parse_input


def check_independence(graph, roles, variable_free, records, collectives, fallbacks, mesh):
  """Refuses a micro-batch whose work needs another micro-batch's activations
  (a batch statistic in training, a loss normalised by a sum over computed
  values, an op with no rule that keeps the batch split): micro-batching
  would then save no memory, or could not be ordered. What depends on no
  variable (masks, position ids, token counts) may be gathered over
  micro-batches: it is built from the inputs alone.

  The coupling is either direct (a micro-batch's op reads the whole or the
  sum over micro-batches of a computed tensor) or through ops that run once
  on the whole batch: the gathered tensor feeds a replicated op whose result
  flows back into every micro-batch's work. The message names the tensor,
  the micro-batch op that needs it, the whole-batch op between them and why
  it runs on the whole batch.

  graph: the original graph (graph.ir.Graph); roles: original node -> role;
  variable_free: the original nodes that depend on no variable; records:
  materialized node -> builder.NodeRecord; collectives: the resharder's
  CollectiveRecords; fallbacks: propagation's fallbacks (.node, .reason);
  mesh: the split's mesh, with its micro-batch axis."""
  mb = constants.MICROBATCH_AXIS
  if mesh.axes.get(mb, 1) <= 1:
    return
  per_microbatch = {r.source for r in records.values()
                    if not r.shared and r.device_id is not None}
  # A micro-batch's forward and backward ops; the step's outputs are made
  # whole after every micro-batch.
  work = {n for n in per_microbatch
          if roles.get(n) in (constants.FORWARD, constants.BACKWARD)}
  work -= set(graph_outputs(graph))
  fallback_of = {f.node: f for f in fallbacks}
  checked = set()
  for record in collectives:
    if record.kind not in ("local_concat", "local_sum") or record.axis != mb:
      continue
    source = input_node(record.tensor)
    if record.consumer == source or source in variable_free or \
        record.tensor in checked:
      continue  # the step's output, made whole after every micro-batch
    checked.add(record.tensor)
    whole = "sum" if record.kind == "local_sum" else "whole batch"
    coupled = _microbatch_work_after(graph, record.tensor, per_microbatch, work)
    if coupled is None:
      continue
    reader, first, last = coupled
    op = graph.node(reader).op
    first = first or reader
    first_op = graph.node(first).op
    if first in fallback_of:
      why = (f"{fallback_of[first].reason}: tfsplit cannot keep op {first_op} split "
             "along the batch")
      fix = (f"use microbatches=1 (data parallelism alone stays exact) until op "
             f"{first_op} has a batch rule")
    elif first == reader:
      raise PlanError(
          f"node '{reader}' (op {op}) needs the {whole} of '{record.tensor}' over all "
          f"{mesh.axes[mb]} micro-batches, which depends on the model's weights: "
          "each micro-batch would wait for every other one's activations (a batch "
          "statistic such as BatchNormalization in training, or a loss normalised by a "
          "sum of computed values); use microbatches=1 for this model, or make the "
          "statistic per micro-batch")
    else:
      why = "a statistic of the whole batch"
      fix = ("make the statistic per micro-batch (per example or per sequence, as a "
             "sequence-wise auxiliary loss is), or use microbatches=1")
    if first == reader:
      needs = "each micro-batch's copy of it needs every micro-batch's activations"
    else:
      through = "" if last == first else f" through '{last}' (op {graph.node(last).op})"
      needs = (f"each micro-batch's node '{reader}' (op {op}) needs its result{through}, "
               "so every micro-batch would wait for all the others' activations")
    raise PlanError(
        f"micro-batches are not independent: node '{first}' (op {first_op}) runs on "
        f"the whole batch ({why}) and reads the {whole} of '{record.tensor}' over all "
        f"{mesh.axes[mb]} micro-batches, which depends on the model's weights; "
        f"{needs}; {fix}")


def _microbatch_work_after(graph, tensor, per_microbatch, work):
  """(micro-batch op, first whole-batch op, last whole-batch op) of the
  first forward or backward op of a micro-batch that `tensor`'s gathered
  value reaches through ops that run once on the whole batch (the first
  reads the gathered value, the micro-batch op reads the last); the
  whole-batch ops are None where a micro-batch op reads the value itself.
  None if it reaches no micro-batch's work (only outputs and updates)."""
  name, port = parse_input(tensor)
  start = [c for c, _ in graph.consumers(name, port)]
  for consumer in start:
    if consumer in work:
      return consumer, None, None
  seen, stack = set(), [(c, c) for c in start if c not in per_microbatch]
  while stack:
    node, first = stack.pop()
    if node in seen:
      continue
    seen.add(node)
    for consumer, _ in graph.consumers(node):
      if consumer in per_microbatch:
        if consumer in work:
          return consumer, first, node
      elif consumer not in seen:
        stack.append((consumer, first))
  return None


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
    # check_independence refuses every coupling it can name
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
