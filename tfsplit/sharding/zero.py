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
"""
import collections
import dataclasses
from typing import Dict, Tuple

import numpy as np

from tfsplit import constants
from tfsplit.graph.handles import (BoundedWalk, handle_of, handle_users,
                                   variables_read_by)
from tfsplit.graph.ir import parse_input
from tfsplit.layout.spec import Constraint, insert_constraints

# Ops a split slot may meet (each has a rule for a split variable).
_SLOT_OPS = frozenset(["ReadVariableOp", "AssignVariableOp", "AssignAddVariableOp",
                       "AssignSubVariableOp"])
# Bound on the walks up from an update: to a slot's gradient, to the variables
# an update reads.
_MAX_SEARCH = 512
SLOT_OF_KEY = "optimizer_slot_of"   # manifest: slot variable -> its weight
KEPT_KEY = "zero_kept"              # manifest: why a slot is whole over the data axis


@dataclasses.dataclass
class ZeroPlan:
  stage: int
  axis: str
  slot_of: Dict[str, str]                  # slot handle -> weight handle
  dims: Dict[str, tuple]                   # slot handle -> its dims (with the axis)
  kept: Dict[str, str]                     # slot handle -> why it stays whole
  gradients: Dict[Tuple[str, int], tuple]  # gradient tensor -> dims it is scattered into


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
  """ZeroPlan splitting the slots over `axis`, from the propagation of
  shardings without it."""
  graph = analysis.graph
  var_nodes = {v.node: v for v in analysis.variables}
  variable_specs = propagation.variable_specs
  n = mesh.axes[axis]
  slot_of = optimizer_slots(analysis)
  users = handle_users(graph, set(var_nodes))
  dims, kept = {}, {}
  for slot in sorted(slot_of):
    var = var_nodes[slot]
    shape = tuple(var.shape or ())
    base = tuple(variable_specs[slot].dims) if slot in variable_specs else \
        (None,) * len(shape)
    other = sorted({node.op for node in users[slot]} - _SLOT_OPS)
    if not shape:
      kept[slot] = "a scalar"
    elif other:
      kept[slot] = f"updated by {', '.join(other)}, which has no rule for a split variable"
    elif axis in base:
      kept[slot] = f"already split over {axis}"
    else:
      free = [i for i, (size, a) in enumerate(zip(shape, base))
              if a is None and size is not None and size % n == 0 and size >= n]
      if free:
        new = list(base)
        new[free[0]] = axis
        dims[slot] = tuple(new)
      else:
        kept[slot] = (f"no dimension of {list(shape)} free of other splits divides by "
                      f"{axis}={n}")
  return ZeroPlan(stage, axis, slot_of, dims, kept,
                  _gradient_constraints(analysis, propagation, mesh, axis, dims, var_nodes,
                                        users))


def constrain_gradients(analysis, plan):
  """(GraphDef, known shapes) of the analysis' graph with a sharding
  constraint after each gradient of `plan.gradients`: an Identity its
  consumers read instead, named after the gradient (its scope, so its role
  and layer, are the gradient's)."""
  return insert_constraints(analysis.graph_def, analysis.graph, analysis.shapes, [
      Constraint(f"{src}/zero_shard" + (f"_{port}" if port else ""), (src, port), dims)
      for (src, port), dims in sorted(plan.gradients.items())])


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


def optimizer_state_bytes(manifest, axes, axis=constants.DATA_AXIS):
  """({device id: bytes of optimizer slots it holds}, the same without the
  split over `axis`: plain data parallelism), from a manifest whose slots
  are marked (annotate_manifest)."""
  held, plain = collections.Counter(), collections.Counter()
  for entry in manifest.values():
    if SLOT_OF_KEY not in entry:
      continue
    size = np.dtype(entry["dtype"]).itemsize
    whole = [a if a != axis else None for a in entry["sharding"]]
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
           f"({most / max(plain_most, 1):.2f}x); {len(kept)} of "
           f"{sum(SLOT_OF_KEY in e for e in manifest.values())} slots kept whole"]
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
