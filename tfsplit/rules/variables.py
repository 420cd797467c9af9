"""Variable reads and writes, gathers, segment reductions and the
optimizer's update ops.

A variable's sharding is fixed by the plan (every device holds its shard);
reads produce it, writes require their value in it, and the fused optimizer
ops (ResourceApplyAdam, ...) require every var-shaped input in it.
"""
from tfsplit.errors import PlanError
from tfsplit.rules.base import Decision, register
from tfsplit.layout.spec import Sharding, axis_parts, overlaps


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
  taken = {p for a in taken if a is not None for p in axis_parts(a)}
  return Sharding(tuple(None if a is not None and overlaps(a, taken) else a
                        for a in indices.dims))


@register("GatherV2")
def gather_v2(ctx):
  """The gathered dimension of params is whole; the indices' dimensions and
  the other params dimensions stay split. With batch_dims (a per-example
  gather: the last token of each row), the leading batch dimensions of params
  and indices are split alike."""
  params, indices = ctx.in_specs[0], ctx.in_specs[1]
  axis_value = ctx.const_inputs[2]
  if axis_value is None:
    return Decision([Sharding.replicated(params.rank), Sharding.replicated(indices.rank),
                     ctx.in_specs[2]], [Sharding.replicated(ctx.out_rank())],
                    fallback="gather axis is not constant")
  axis = int(axis_value) % params.rank
  nb = ctx.node.attr["batch_dims"].i
  nb = nb + indices.rank if nb < 0 else nb
  p_dims = list(params.dims)
  p_dims[axis] = None
  used = {p for a in params.partial for p in axis_parts(a)}
  batch = []
  for k in range(nb):
    a = p_dims[k] if p_dims[k] is not None else indices.dims[k]
    batch.append(None if a is not None and overlaps(a, used) else a)
    if a is not None:
      used.update(axis_parts(a))
  p_dims = batch + [None if a is not None and overlaps(a, used) else a for a in p_dims[nb:]]
  rest = _indices_spec(Sharding(indices.dims[nb:]), p_dims + list(params.partial))
  i_dims = batch + list(rest.dims)
  out = p_dims[:axis] + i_dims[nb:] + p_dims[axis + 1:]
  return Decision([Sharding(tuple(p_dims), params.partial), Sharding(tuple(i_dims)),
                   ctx.in_specs[2]], [Sharding(tuple(out), params.partial)])


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


@register("UnsortedSegmentMax", "UnsortedSegmentMin", "UnsortedSegmentProd",
          "SegmentSum", "SegmentMean", "SegmentMax", "SegmentMin", "SegmentProd")
def segment_reduction(ctx):
  """The data's dimensions past the ids' stay split; the ids' dimensions are
  gathered (a max of per-shard maxes is no partial sum, and sorted segment
  ids number the output rows). SegmentSum and SegmentMean are linear."""
  data = ctx.in_specs[0]
  r = ctx.rank(1)
  dims = (None,) * r + tuple(data.dims[r:])
  partial = data.partial if ctx.node.op in ("SegmentSum", "SegmentMean") else frozenset()
  req = [Sharding(dims, partial), Sharding.replicated(r)] + list(ctx.in_specs[2:])
  return Decision(req, [Sharding((None,) + dims[r:], partial)])
