"""Reductions: Sum, Mean, Max, Min, Prod, All, Any, EuclideanNorm; scans:
Cumsum, Cumprod, CumulativeLogsumexp.

Summing over a split dimension leaves a partial sum over its axis (no
communication yet). A Mean over a split dimension is a local mean of 1/n of
the elements; it is scaled by 1/n so the partial sum is the global mean.
Max/Min/Prod over a split dimension need the whole dimension (gathered).
A scan needs its scanned dimension whole; the others stay split.
"""
import numpy as np

from tfsplit.rules.base import Decision, fallback, register
from tfsplit.layout.spec import Sharding

LINEAR_REDUCTIONS = ("Sum", "Mean")
_FLOAT_TYPES = (1, 2, 19, 14, 8, 18)  # float, double, half, bfloat16, complex64/128
OTHER_REDUCTIONS = ("Max", "Min", "Prod", "All", "Any", "EuclideanNorm", "ArgMax",
                    "ArgMin")


def _axes(ctx):
  value = ctx.const_inputs[1]
  if value is None:
    return None
  rank = ctx.rank(0)
  return sorted({int(a) % rank for a in np.atleast_1d(value)})


@register(*(LINEAR_REDUCTIONS + OTHER_REDUCTIONS))
def reduction(ctx):
  op = ctx.node.op
  spec = ctx.in_specs[0]
  axes = _axes(ctx)
  rank = ctx.rank(0)
  if axes is None:  # reduction indices computed at run time
    req = Sharding.replicated(rank)
    return Decision([req, ctx.in_specs[1]], [Sharding.replicated(ctx.out_rank())],
                    fallback="reduction axes are not constant")
  keep = ctx.node.attr["keep_dims"].b if op not in ("ArgMax", "ArgMin") else False
  # An integer Mean truncates: neither a local mean of a block nor a mean of a
  # partial sum adds up to the global mean.
  linear = op in LINEAR_REDUCTIONS and not (
      op == "Mean" and ctx.node.attr["T"].type not in _FLOAT_TYPES)
  in_dims = list(spec.dims)
  partial = set(spec.partial) if linear else set()
  scaled = 1
  for a in axes:
    axis = in_dims[a]
    if axis is None:
      continue
    if linear:
      partial.add(axis)
      if op == "Mean":
        scaled *= ctx.axis_size(axis)
    else:
      in_dims[a] = None  # gather the reduced dimension first
  out_dims = [None if a in axes else in_dims[a] for a in range(rank)] if keep else \
      [in_dims[a] for a in range(rank) if a not in axes]
  required = [Sharding(tuple(in_dims), spec.partial if linear else frozenset()),
              ctx.in_specs[1]]
  decision = Decision(required, [Sharding(tuple(out_dims), frozenset(partial))])
  if scaled > 1:
    decision.localize = lambda lctx, n=scaled: lctx.scale_output(1.0 / n)
  return decision


@register("Cumsum", "Cumprod", "CumulativeLogsumexp")
def scan(ctx):
  """Position ids from a padding mask (cumsum over the sequence): the batch
  stays split. Only Cumsum is linear (partial sums pass through)."""
  spec = ctx.in_specs[0]
  axis = ctx.const_inputs[1]
  if axis is None:
    return fallback(ctx, "scan axis is not constant")
  axis = int(axis) % spec.rank
  dims = list(spec.dims)
  dims[axis] = None
  partial = spec.partial if ctx.node.op == "Cumsum" else frozenset()
  out = Sharding(tuple(dims), partial)
  return Decision([out, ctx.in_specs[1]], [out])
