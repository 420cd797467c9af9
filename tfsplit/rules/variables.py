"""Variable reads and writes, gathers and the optimizer's update ops.

A variable's sharding is fixed by the plan (every device holds its shard);
reads produce it, writes require their value in it, and the fused optimizer
ops (ResourceApplyAdam, ...) require every var-shaped input in it.
"""
from tfsplit.errors import PlanError
from tfsplit.rules.base import Decision, register
from tfsplit.sharding.spec import Sharding


@register("ReadVariableOp")
def read_variable(ctx):
  return Decision([None], [ctx.handle_specs[0]])


@register("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")
def assign(ctx):
  return Decision([None, ctx.handle_specs[0]], [])


@register("ResourceGather")
def resource_gather(ctx):
  var = ctx.handle_specs[0]
  if var.dims and var.dims[0] is not None:
    raise PlanError(
        f"node '{ctx.node.name}' (op ResourceGather): the embedding table is split "
        "along its vocabulary (dimension 0), which a gather cannot read locally; "
        "split it along the hidden dimension or leave it replicated")
  indices = _indices_spec(ctx.in_specs[1], var.dims[1:])
  return Decision([None, indices], [Sharding(indices.dims + var.dims[1:])])


def _indices_spec(indices, taken):
  """Indices without partial sums and without splits over an axis that already
  splits the (non-gathered) params dimensions (one axis, one dimension)."""
  taken = {a for a in taken if a is not None}
  return Sharding(tuple(None if a in taken else a for a in indices.dims))


@register("GatherV2")
def gather_v2(ctx):
  params, indices = ctx.in_specs[0], ctx.in_specs[1]
  axis_value = ctx.const_inputs[2]
  batch_dims = ctx.node.attr["batch_dims"].i
  if axis_value is None or batch_dims:
    return Decision([Sharding.replicated(params.rank), Sharding.replicated(indices.rank),
                     ctx.in_specs[2]], [Sharding.replicated(ctx.out_rank())],
                    fallback="gather axis is not constant or batch_dims != 0")
  axis = int(axis_value) % params.rank
  p_dims = list(params.dims)
  p_dims[axis] = None
  indices = _indices_spec(indices, p_dims + list(params.partial))
  out = p_dims[:axis] + list(indices.dims) + p_dims[axis + 1:]
  return Decision([Sharding(tuple(p_dims), params.partial), indices, ctx.in_specs[2]],
                  [Sharding(tuple(out), params.partial)])


@register("ResourceApplyAdam", "ResourceApplyGradientDescent", "ResourceApplyMomentum",
          "ResourceApplyKerasMomentum", "ResourceApplyAdagrad", "ResourceApplyAdagradV2",
          "ResourceApplyRMSProp", "ResourceApplyAdamWithAmsgrad", "ResourceApplyAdaMax")
def resource_apply(ctx):
  var_specs = [s for s in ctx.handle_specs if s is not None]
  spec = var_specs[0]
  if any(s != spec for s in var_specs):
    raise PlanError(
        f"node '{ctx.node.name}' (op {ctx.node.op}): the variable and its optimizer "
        "slots are sharded differently; shard slots exactly like their variable")
  req = []
  for s, info in zip(ctx.in_specs, ctx.in_infos):
    if s is None:
      req.append(None)  # a handle
    elif info.shape is not None and len(info.shape) == spec.rank and spec.rank > 0:
      req.append(spec)
    else:
      req.append(s.without_partial().with_dims((None,) * s.rank))
  return Decision(req, [])


@register("UnsortedSegmentSum")
def unsorted_segment_sum(ctx):
  """Sparse gradients of embeddings: summing per shard of the ids, then over
  shards, is the same sum, so a split of the ids' dimensions leaves a partial."""
  data, ids = ctx.in_specs[0], ctx.in_specs[1].without_partial()
  r = ids.rank
  dims = list(data.dims)
  partial = set(data.partial)
  for i in range(r):
    if dims[i] is not None and ids.dims[i] == dims[i]:
      partial.add(dims[i])
    else:
      dims[i] = None
  req_ids = Sharding(tuple(dims[:r]))
  out = (None,) + tuple(dims[r:])
  if partial & set(out):
    return Decision([Sharding.replicated(data.rank), Sharding.replicated(r), ctx.in_specs[2]],
                    [Sharding.replicated(len(out))], fallback="partial and split on one axis")
  return Decision([Sharding(tuple(dims), data.partial), req_ids, ctx.in_specs[2]],
                  [Sharding(out, frozenset(partial))])
