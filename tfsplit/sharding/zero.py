"""Optimizer-state sharding over the data axis (ZeRO stages 1 and 2).

    plan = plan_zero(analysis, propagation, mesh, stage=1)
    graph_def, known_shapes = constrain_gradients(analysis, plan)

Expressed as shardings, GSPMD-style, so propagation and reshard do the work:
- each optimizer slot (a variable the update of exactly one weight reads
  that the forward pass does not: Adam's moments) is split over the data
  axis along one more dimension than the weight (the first one free of
  other splits that divides by the axis size, dimension 0 if it can);
- the weight's gradient (a partial sum over the data axis, as the first
  propagation says) gets a sharding constraint (layout/spec.py) asking
  for the slot's sharding, so it is reduce-scattered straight into the
  slots' blocks and every update op (m, v, the step) runs on 1/dp of the
  elements;
- the weight stays as it was (replicated over the data axis): the update,
  computed in blocks, is all-gathered where it is assigned to it.
Reshard picks those collectives (sharding/reshard.py); gradient buckets pack
them (sharding/buckets.py).

Stage 2 (gradients sharded too) differs only with micro-batches: each
micro-batch's gradient is reduce-scattered as soon as it exists and the
running sum over micro-batches holds the block (1/dp of the accumulator
memory, m reduce-scatters per step); stage 1 sums the whole local gradient
over the micro-batches and reduce-scatters once per step.

What stays whole over the data axis, and says why (`ZeroPlan.kept`): a slot
with no free dimension that divides by the axis size (no padding: blocks
stay equal, as every sharding here), one touched by an op with no rule for a
split variable (a sparse update's ResourceScatterAdd, a fused
ResourceApplyAdam updating it with its weight), and scalars (step counters).

Stage 3 (FSDP) splits the trainable weights themselves over the data axis,
each along the first dimension free of other splits that divides by it
(dimension 0 where it can: the gather is then a plain concatenation), and
their slots the same way, so the update runs on the block and the weight is
assigned in place. Each read of a weight is constrained, for its forward
readers, to the weight's sharding without the data axis (an all-gather);
its backward readers get their own gather, gated on the gradient arriving
(sharding/gathers.py), so a whole weight lives from its gather to its last
reader in one pass, not from the forward to the backward. The gradient is
reduce-scattered into the block as in stages 1-2. With `prefetch` p (and no
micro-batches or pipeline, whose blocks the gates would tie together), the
forward gather of the weights of layer i waits for the forward readers of
layer i-1-p's gathered weights: layer i+1's gather runs while layer i
computes (p=1), and about p+2 layers' weights are whole at once.
What stays whole (`ZeroPlan.weights_kept`, reported): a weight read by an op
with no rule for a split variable (ResourceGather), a scalar, one with no
free dimension that divides.
"""
import collections
import dataclasses
from typing import Dict, Tuple

import numpy as np
from absl import logging

from tfsplit import constants
from tfsplit.graph.handles import (BoundedWalk, handle_of, handle_users,
                                   variables_read_by)
from tfsplit.graph.ir import parse_input
from tfsplit.layout.spec import Constraint, axis_parts, join_parts
from tfsplit.sharding.gathers import GatherEdits

# Ops a split slot may meet (each has a rule for a split variable).
_SLOT_OPS = frozenset(["ReadVariableOp", "AssignVariableOp", "AssignAddVariableOp",
                       "AssignSubVariableOp"])
# Bound on the walks up from an update: to a slot's gradient, to the variables
# an update reads.
_MAX_SEARCH = 512
SLOT_OF_KEY = "optimizer_slot_of"   # manifest: slot variable -> its weight
KEPT_KEY = "zero_kept"              # manifest: why a slot (or a weight at stage 3)
                                    # is whole over the data axis
WEIGHT_KEY = "zero_weight"          # manifest: a weight stage 3 considered
# 16-bit dtypes a weight is cast to for compute: DT_HALF, which
# CollectiveGatherV2 takes, and DT_BFLOAT16, which it does not.
HALF, BFLOAT16 = 19, 14
# Ops that read a weight split over the data axis at stage 3 (each has a rule
# for a split variable): reads, constrained whole for the forward and
# backward, and the update's writes.
_WEIGHT_OPS = _SLOT_OPS


@dataclasses.dataclass
class ZeroPlan:
  stage: int
  axis: str
  slot_of: Dict[str, str]                  # slot handle -> weight handle
  dims: Dict[str, tuple]                   # slot handle -> its dims (with the axis)
  kept: Dict[str, str]                     # slot handle -> why it stays whole
  gradients: Dict[Tuple[str, int], tuple]  # gradient tensor -> dims it is scattered into
  # Stage 3: weight handle -> its dims (with the axis), and as it is read
  # (without it); a weight that stays whole -> why.
  weights: Dict[str, tuple] = dataclasses.field(default_factory=dict)
  weight_base: Dict[str, tuple] = dataclasses.field(default_factory=dict)
  weights_kept: Dict[str, str] = dataclasses.field(default_factory=dict)
  # Stage 3: weight handle -> the layer that reads it first (the layers of
  # the graph as planned: the gathers' constraints change how later
  # analyses group them).
  weight_layer: Dict[str, str] = dataclasses.field(default_factory=dict)


def optimizer_slots(analysis):
  """{slot handle: weight handle}: variables the forward pass does not read
  and the update of exactly one trainable weight reads."""
  graph, roles = analysis.graph, analysis.roles
  var_nodes = {v.node for v in analysis.variables}
  params = {h for layer in analysis.layers.layers for h in layer.variables}
  owners = collections.defaultdict(set)
  for name in graph.topological_order():
    node = graph.node(name)
    if roles.get(name) != constants.UPDATE or not constants.is_write_op(node.op) or \
        not node.input:
      continue
    weight = handle_of(graph, node.input[0], var_nodes)
    if weight not in params:
      continue
    for slot in variables_read_by(graph, name, var_nodes, roles, _MAX_SEARCH) - {weight}:
      if slot not in params and roles.get(slot) != constants.FORWARD:
        owners[slot].add(weight)
  return {slot: next(iter(w)) for slot, w in owners.items() if len(w) == 1}


def plan_zero(analysis, propagation, mesh, stage, axis=constants.DATA_AXIS):
  """ZeroPlan splitting the slots (and at stage 3 the trainable weights)
  over `axis`, from the propagation of shardings without it."""
  graph = analysis.graph
  var_nodes = {v.node: v for v in analysis.variables}
  variable_specs = propagation.variable_specs
  n = mesh.axes[axis]
  slot_of = optimizer_slots(analysis)
  users = handle_users(graph, set(var_nodes))

  def base_of(handle):
    shape = tuple(var_nodes[handle].shape or ())
    return tuple(variable_specs[handle].dims) if handle in variable_specs else \
        (None,) * len(shape)

  weights, weights_kept = {}, {}
  if stage >= 3:
    params = sorted({h for layer in analysis.layers.layers for h in layer.variables})
    for weight in params:
      dims, why = _split_over(tuple(var_nodes[weight].shape or ()), base_of(weight),
                              sorted({u.op for u in users[weight]} - _WEIGHT_OPS), axis, n,
                              mesh)
      if dims is None:
        weights_kept[weight] = why
      else:
        weights[weight] = dims
  dims, kept = {}, {}
  for slot in sorted(slot_of):
    other = sorted({u.op for u in users[slot]} - _SLOT_OPS)
    if slot_of[slot] in weights and not other and \
        tuple(var_nodes[slot].shape or ()) == tuple(var_nodes[slot_of[slot]].shape or ()):
      dims[slot] = weights[slot_of[slot]]   # the update runs on the weight's block
      continue
    new, why = _split_over(tuple(var_nodes[slot].shape or ()), base_of(slot), other, axis,
                           n, mesh if stage >= 3 else None)
    if new is None:
      kept[slot] = why
    else:
      dims[slot] = new
  scattered = dict(dims)
  scattered.update(weights)
  return ZeroPlan(stage, axis, slot_of, dims, kept,
                  _gradient_constraints(analysis, propagation, mesh, axis, scattered,
                                        var_nodes, users),
                  weights, {w: base_of(w) for w in weights}, weights_kept,
                  {w: (analysis.layers.variable_readers.get(w) or [w])[0] for w in weights})


def _split_over(shape, base, other_ops, axis, n, mesh=None):
  """(dims of a variable of `shape` sharded `base`, also split over `axis`
  (size n) on its first free dimension that divides, None) or (None, why
  it stays whole); `other_ops` read it with no rule for a split variable.
  With `mesh` (stage 3), a dimension already split may be split over
  `axis` too."""
  if not shape:
    return None, "a scalar"
  if other_ops:
    return None, f"updated by {', '.join(other_ops)}, which has no rule for a split variable" \
        if all(o.startswith(("ResourceApply", "ResourceSparseApply", "ResourceScatter"))
               for o in other_ops) else \
        f"read by {', '.join(other_ops)}, which has no rule for a split variable"
  if axis in base:
    return None, f"already split over {axis}"
  free = [i for i, (size, a) in enumerate(zip(shape, base))
          if a is None and size is not None and size % n == 0 and size >= n]
  new = list(base)
  if free:
    new[free[0]] = axis
    return tuple(new), None
  if mesh is not None:
    # The same dimension split further (a tp-split bias: 'tp*dp'), where
    # its block divides.
    for i, (size, a) in enumerate(zip(shape, base)):
      if a is not None and size is not None and size % (mesh.size_of(a) * n) == 0:
        new[i] = join_parts(axis_parts(a) + [axis])
        return tuple(new), None
  return None, f"no dimension of {list(shape)} free of other splits divides by {axis}={n}"


def constrain_gradients(analysis, plan, prefetch=None, gated=True, compute_dtypes=()):
  """(GraphDef, known shapes) of the analysis' graph with a sharding
  constraint after each gradient of `plan.gradients`: an Identity its
  consumers read instead, named after the gradient (its scope, so its role
  and layer, are the gradient's); at stage 3 also the gathers of each split
  weight's reads, for the forward (gated `prefetch` layers ahead, None: not
  gated) and again for the backward (a layer's all gated on the gradient
  reaching it; not `gated`: when the step starts). A read that the forward
  reads only through casts to one of `compute_dtypes` (DataType enums: the
  16-bit dtypes of mixed precision the devices' collectives gather) is
  gathered after each cast, in that dtype: half the bytes."""
  edits = GatherEdits(analysis.graph, analysis.shapes, analysis.roles)
  edits.constraints.extend(
      Constraint(f"{src}/zero_shard" + (f"_{port}" if port else ""), (src, port), dims)
      for (src, port), dims in sorted(plan.gradients.items()))
  if plan.weights:
    _weight_gathers(analysis, plan, edits, prefetch, gated, compute_dtypes)
  return edits.graph_def(analysis.graph_def, f"zero={plan.stage}")


def _weight_gathers(analysis, plan, edits, prefetch, gated, compute_dtypes=()):
  """Adds to `edits` the forward and backward gathers of every read of the
  weights `plan` splits (stage 3), or of its casts to `compute_dtypes`."""
  graph, roles = analysis.graph, analysis.roles
  var_nodes = {v.node for v in analysis.variables}
  reads = collections.defaultdict(list)   # weight -> [(read, its forward readers)]
  bfloat16 = set()   # weights cast to bfloat16 alone, gathered in float32
  for node in graph.nodes:
    if node.op not in constants.VARIABLE_READ_OPS or not node.input:
      continue
    weight = handle_of(graph, node.input[0], var_nodes)
    if weight not in plan.weights:
      continue
    forward = frozenset(c.name for c in graph.consumer_nodes(node.name)
                        if roles.get(c.name) not in (constants.BACKWARD, constants.UPDATE))
    casts = [graph.node(c) for c in sorted(forward)]
    if compute_dtypes and casts and all(c.op == "Cast" and c.attr["DstT"].type == BFLOAT16
                                        for c in casts):
      bfloat16.add(weight)
    if casts and all(c.op == "Cast" and c.attr["DstT"].type in compute_dtypes
                     for c in casts):
      # Each cast runs on the block; its 16-bit output is what travels.
      for cast in casts:
        readers = frozenset(c.name for c in graph.consumer_nodes(cast.name)
                            if roles.get(c.name) not in (constants.BACKWARD,
                                                         constants.UPDATE))
        if readers:
          reads[weight].append((cast.name, readers))
    elif forward:
      reads[weight].append((node.name, forward))
  if bfloat16:
    logging.warning("zero_gather_compute_dtype: %d weights cast to bfloat16 are gathered in "
                    "float32 (TF's CollectiveGatherV2 takes no bfloat16); casts to float16 "
                    "are gathered in float16", len(bfloat16))
  gates = _prefetch_gates(analysis, reads, prefetch) if prefetch is not None else {}
  backward = collections.defaultdict(list)   # layer -> its backward gathers
  for weight in sorted(reads):
    base = plan.weight_base[weight]
    for read, forward in reads[weight]:
      edits.constraints.append(Constraint(f"{read}/fsdp_gather", (read, 0), base, forward,
                                          gates.get(weight, ())))
      again = edits.gather_again(read, base, forward, "fsdp")
      if again is not None:
        backward[plan.weight_layer[weight]].append(again)
  # A layer's backward gathers all start when its gradient arrives: one
  # bucket each (sharding/buckets.py), as FSDP gathers a unit.
  for layer in sorted(backward):
    edits.gate_together(backward[layer]) if gated else edits.ungate(backward[layer])


def _prefetch_gates(analysis, reads, prefetch):
  """{weight: forward nodes its forward gather waits for}. A weight's uses
  are the first nodes its reads reach that also compute from the step's
  inputs (through views of the weight alone, a tied head's Transpose), its
  position the earliest of them in topological order; weights are grouped
  by the layer that first reads them and the groups ordered by position.
  The gather of group j waits for the uses of group j - 1 - `prefetch`
  that come before group j's position: none of those can depend on the
  gather, so the gate adds no cycle."""
  graph, roles = analysis.graph, analysis.roles
  order = graph.topological_order()
  index = {name: i for i, name in enumerate(order)}
  from_inputs = set()
  for name in order:
    node = graph.node(name)
    if node.op == "Placeholder" or any(s in from_inputs for s, _ in graph.data_inputs(name)):
      from_inputs.add(name)
  uses = {}
  for weight, weight_reads in reads.items():
    found = set()
    walk = BoundedWalk([r for _, forward in weight_reads for r in forward], _MAX_SEARCH)
    for name in walk:
      if name in from_inputs:
        found.add(name)
      elif roles.get(name) == constants.FORWARD:
        walk.follow(c.name for c in graph.consumer_nodes(name))
    if found:
      uses[weight] = found
  layers = analysis.layers
  groups = collections.defaultdict(set)   # first reading layer -> its weights
  for weight in uses:
    readers = layers.variable_readers.get(weight) or [None]
    groups[readers[0]].add(weight)
  position = {layer: min(index[u] for w in ws for u in uses[w])
              for layer, ws in groups.items()}
  ordered = sorted(groups, key=lambda layer: position[layer])
  gates = {}
  for j, layer in enumerate(ordered):
    if j - 1 - prefetch < 0:
      continue
    earlier = ordered[j - 1 - prefetch]
    gate = tuple(sorted(u for w in groups[earlier] for u in uses[w]
                        if index[u] < position[layer]))
    if gate:
      gates.update((weight, gate) for weight in groups[layer])
  return gates


def weight_gather_labels(analysis, plan, records, axis=constants.DATA_AXIS):
  """{consumer: label} of the all-gathers over `axis` among `records` (the
  reshard's) that make a weight of `plan.weights` whole (stage 3): the
  constraint reading it, labelled by its pass and layer, so that gradient
  buckets can pack one layer's gathers of one pass together."""
  if not plan.weights:
    return {}
  graph, roles = analysis.graph, analysis.roles
  var_nodes = {v.node for v in analysis.variables}
  out = {}
  for record in records:
    if record.kind != "all_gather" or record.axis != axis:
      continue
    node = graph.get(parse_input(record.tensor)[0])
    while node is not None and node.op in ("Identity", "Cast") and node.input:
      node = graph.get(parse_input(node.input[0])[0])
    if node is None or node.op not in constants.VARIABLE_READ_OPS:
      continue
    weight = handle_of(graph, node.input[0], var_nodes)
    if weight not in plan.weights:
      continue
    out[record.consumer] = f"{roles.get(record.consumer)}/{plan.weight_layer[weight]}"
  return out


def annotate_manifest(manifest, plan, variables):
  """Marks each optimizer slot's manifest entry with its weight, and a slot
  kept whole over the data axis with why."""
  names = {v.node: v.name for v in variables}
  for slot, weight in plan.slot_of.items():
    entry = manifest.get(names.get(slot))
    if entry is None:
      continue
    entry[SLOT_OF_KEY] = names.get(weight, weight)
    if slot in plan.kept:
      entry[KEPT_KEY] = plan.kept[slot]
  for weight in set(plan.weights) | set(plan.weights_kept):
    entry = manifest.get(names.get(weight))
    if entry is None:
      continue
    entry[WEIGHT_KEY] = True
    if weight in plan.weights_kept:
      entry[KEPT_KEY] = plan.weights_kept[weight]


def optimizer_state_bytes(manifest, axes, axis=constants.DATA_AXIS, key=SLOT_OF_KEY):
  """({device id: bytes of optimizer slots it holds}, the same without the
  split over `axis`: plain data parallelism), from a manifest whose slots
  are marked (annotate_manifest); with key=WEIGHT_KEY the same of the
  weights stage 3 considered."""
  held, plain = collections.Counter(), collections.Counter()
  for entry in manifest.values():
    if key not in entry:
      continue
    size = np.dtype(entry["dtype"]).itemsize
    whole = [join_parts([p for p in axis_parts(a) if p != axis]) if a else None
             for a in entry["sharding"]]
    local = [s // _size(axes, a) for s, a in zip(entry["shape"], whole)]
    for shard in entry["shards"]:
      held[shard["device_id"]] += int(np.prod(shard["shape"], dtype=np.int64)) * size
      plain[shard["device_id"]] += int(np.prod(local, dtype=np.int64)) * size
  return dict(held), dict(plain)


def summary(manifest, axes, stage, axis=constants.DATA_AXIS):
  """Lines for rewrite's summary: optimizer-state bytes per device against
  plain data parallelism, and the slots kept whole."""
  held, plain = optimizer_state_bytes(manifest, axes, axis)
  if not held:
    return [f"  optimizer state (zero={stage}): no optimizer slots found"]
  most, plain_most = max(held.values()), max(plain.values())
  kept = {name: e[KEPT_KEY] for name, e in manifest.items() if KEPT_KEY in e}
  lines = [f"  optimizer state (zero={stage} over {axis}={axes.get(axis, 1)}): "
           f"{_mib(most)} per device, {_mib(plain_most)} with plain data parallelism "
           f"({most / max(plain_most, 1):.2f}x); "
           f"{sum(SLOT_OF_KEY in e and KEPT_KEY in e for e in manifest.values())} of "
           f"{sum(SLOT_OF_KEY in e for e in manifest.values())} slots kept whole"]
  weights, plain_weights = optimizer_state_bytes(manifest, axes, axis, WEIGHT_KEY)
  if weights:
    lines.append(f"  weights (zero=3 over {axis}): {_mib(max(weights.values()))} per device "
                 f"between steps, {_mib(max(plain_weights.values()))} with plain data "
                 f"parallelism; {sum(WEIGHT_KEY in e and KEPT_KEY in e for e in manifest.values())}"
                 f" of {sum(WEIGHT_KEY in e for e in manifest.values())} weights kept whole")
  lines += [f"  kept whole: '{name}': {why}" for name, why in sorted(kept.items())]
  return lines


# --- helpers ---------------------------------------------------------------------
def _size(axes, axis):
  if axis is None:
    return 1
  size = 1
  for part in axis.split("*"):
    size *= axes.get(part, 1)
  return size


def _mib(n):
  return f"{n / 2**20:.2f} MiB"


def _gradient_constraints(analysis, propagation, mesh, axis, dims, var_nodes, users):
  """{gradient tensor: dims}: for each split slot, the partial sums over
  `axis` its update reads (the weight's gradient as backward or the
  optimizer makes it: a sum of a tied weight's two gradients, a densified
  sparse gradient) with the slot's shape, found from its writes up through
  what is not partial (the first propagation's shardings)."""
  graph, shapes = analysis.graph, analysis.shapes

  def partial_over_axis(src, port):
    spec = propagation.reduced_at_source.get((src, port))
    if spec is None:
      outs = propagation.outputs.get(src) or []
      spec = outs[port] if port < len(outs) else None
    return spec is not None and any(axis in mesh.axis_parts(a) for a in spec.partial)

  found = collections.defaultdict(set)
  for slot, slot_dims in sorted(dims.items()):
    shape = tuple(var_nodes[slot].shape)
    for write in users[slot]:
      if write.op not in constants.ASSIGN_OPS or len(write.input) < 2:
        continue
      walk = BoundedWalk([parse_input(write.input[1])], _MAX_SEARCH)
      for src, port in walk:
        node = graph.node(src)
        if partial_over_axis(src, port):
          info = shapes.tensor(src, port)
          if info is not None and info.shape is not None and tuple(info.shape) == shape:
            found[(src, port)].add(slot_dims)
          continue
        if src in var_nodes or node.op in constants.VARIABLE_READ_OPS or \
            node.op == "Const" or analysis.roles.get(src) == constants.FORWARD:
          continue
        walk.follow(graph.data_inputs(src))
  return {t: next(iter(d)) for t, d in found.items() if len(d) == 1}
