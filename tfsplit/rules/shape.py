"""Ops that move or view data: Reshape, Transpose, ExpandDims, Squeeze,
ConcatV2, Pack, Unpack, Split, SplitV, Slice, StridedSlice, Tile, BroadcastTo,
Fill, Const, Placeholder.

These carry global sizes in constant inputs (a Reshape target, Slice sizes,
BroadcastTo shapes); `localize` rewrites them to each device's local sizes.
All are linear, so partial sums pass through.
"""
import numpy as np

from tfsplit.rules.base import Decision, divisible, register
from tfsplit.sharding.spec import Sharding


def _const_int(ctx, i):
  value = ctx.const_inputs[i]
  return None if value is None else np.asarray(value).astype(np.int64)


def _replace_shape_input(index, out_index=0):
  """localize: input `index` becomes the local shape of output `out_index`."""
  def localize(lctx):
    lctx.const_input(index, np.asarray(lctx.local_out_shape(out_index),
                                       lctx.input_dtype(index)))
  return localize


def _groups(in_shape, out_shape):
  """Pairs (in_dims, out_dims) of dimension groups with equal products."""
  groups, i, j = [], 0, 0
  while i < len(in_shape) or j < len(out_shape):
    gi, gj = [], []
    pi = pj = 1
    while True:
      if pi == pj and gi and gj:
        break
      if (pi <= pj and i < len(in_shape)) or j >= len(out_shape):
        if i >= len(in_shape):
          break
        pi *= in_shape[i]
        gi.append(i)
        i += 1
      else:
        pj *= out_shape[j]
        gj.append(j)
        j += 1
    # Trailing size-1 dims join the current group.
    while i < len(in_shape) and in_shape[i] == 1 and j >= len(out_shape):
      gi.append(i)
      i += 1
    while j < len(out_shape) and out_shape[j] == 1 and i >= len(in_shape):
      gj.append(j)
      j += 1
    groups.append((gi, gj))
  return groups


@register("Reshape")
def reshape(ctx):
  spec = ctx.in_specs[0]
  in_shape, out_shape = ctx.in_shape(0), ctx.out_shape()
  out_dims = [None] * len(out_shape)
  in_dims = list(spec.dims)
  for gi, gj in _groups(list(in_shape), list(out_shape)):
    split = [(d, spec.dims[d]) for d in gi if spec.dims[d] is not None]
    if not split:
      continue
    d, axis = split[0]
    major_in = next((k for k in gi if in_shape[k] != 1), None)
    major_out = next((k for k in gj if out_shape[k] != 1), None)
    # Splitting the major dim of a group = splitting its linear range into
    # contiguous blocks, which maps onto the major dim on the other side.
    if len(split) == 1 and d == major_in and major_out is not None and \
        divisible(out_shape[major_out], ctx, axis):
      out_dims[major_out] = axis
    else:
      for k, _ in split:
        in_dims[k] = None
  req = [Sharding(tuple(in_dims), spec.partial), ctx.in_specs[1]]
  return Decision(req, [Sharding(tuple(out_dims), spec.partial)],
                  localize=_replace_shape_input(1))


@register("Transpose")
def transpose(ctx):
  perm = _const_int(ctx, 1)
  spec = ctx.in_specs[0]
  if perm is None:
    return Decision([Sharding.replicated(spec.rank), ctx.in_specs[1]],
                    [Sharding.replicated(spec.rank)], fallback="permutation is not constant")
  return Decision(list(ctx.in_specs),
                  [Sharding(tuple(spec.dims[p] for p in perm), spec.partial)])


@register("ExpandDims")
def expand_dims(ctx):
  spec = ctx.in_specs[0]
  dim = int(_const_int(ctx, 1)) % ctx.out_rank()
  dims = list(spec.dims)
  dims.insert(dim, None)
  return Decision(list(ctx.in_specs), [Sharding(tuple(dims), spec.partial)])


@register("Squeeze")
def squeeze(ctx):
  spec = ctx.in_specs[0]
  shape = ctx.in_shape(0)
  squeeze_dims = [int(d) % len(shape) for d in ctx.node.attr["squeeze_dims"].list.i]
  if not squeeze_dims:
    squeeze_dims = [i for i, s in enumerate(shape) if s == 1]
  dims = [a for i, a in enumerate(spec.dims) if i not in squeeze_dims]
  return Decision([spec], [Sharding(tuple(dims), spec.partial)])


@register("ConcatV2")
def concat(ctx):
  n = len(ctx.in_specs) - 1
  rank = ctx.out_rank()
  axis = int(_const_int(ctx, n)) % rank
  first = ctx.in_specs[0]
  dims = list(first.dims)
  dims[axis] = None
  partial = first.partial if all(s.partial == first.partial for s in ctx.in_specs[:n]) \
      else frozenset()
  req = [Sharding(tuple(dims), partial)] * n + [ctx.in_specs[n]]
  return Decision(req, [Sharding(tuple(dims), partial)])


@register("Pack")
def pack(ctx):
  axis = ctx.node.attr["axis"].i % ctx.out_rank()
  first = ctx.in_specs[0]
  partial = first.partial if all(s.partial == first.partial for s in ctx.in_specs) \
      else frozenset()
  dims = list(first.dims)
  out = list(dims)
  out.insert(axis, None)
  return Decision([Sharding(tuple(dims), partial)] * len(ctx.in_specs),
                  [Sharding(tuple(out), partial)])


@register("Unpack")
def unpack(ctx):
  spec = ctx.in_specs[0]
  axis = ctx.node.attr["axis"].i % spec.rank
  dims = list(spec.dims)
  dims[axis] = None
  out = [a for i, a in enumerate(dims) if i != axis]
  return Decision([Sharding(tuple(dims), spec.partial)],
                  [Sharding(tuple(out), spec.partial)] * len(ctx.out_infos))


@register("Split")
def split(ctx):
  spec = ctx.in_specs[1]
  axis = int(_const_int(ctx, 0)) % spec.rank
  dims = list(spec.dims)
  dims[axis] = None
  s = Sharding(tuple(dims), spec.partial)
  return Decision([ctx.in_specs[0], s], [s] * len(ctx.out_infos))


@register("SplitV")
def split_v(ctx):
  spec = ctx.in_specs[0]
  axis = int(_const_int(ctx, 2)) % spec.rank
  dims = list(spec.dims)
  dims[axis] = None
  s = Sharding(tuple(dims), spec.partial)
  return Decision([s, ctx.in_specs[1], ctx.in_specs[2]], [s] * len(ctx.out_infos))


def _slice_like(ctx, begin, size_or_end, is_end):
  spec = ctx.in_specs[0]
  shape = ctx.in_shape(0)
  dims = list(spec.dims)
  for i, axis in spec.split_dims():
    full = begin is not None and size_or_end is not None and begin[i] == 0 and (
        (size_or_end[i] in (-1, shape[i])) if not is_end else size_or_end[i] >= shape[i])
    if not full:
      dims[i] = None
  req = [Sharding(tuple(dims), spec.partial)] + list(ctx.in_specs[1:])
  return req, Sharding(tuple(dims), spec.partial)


def _local_extent(extent, out):
  """localize: input 2 (Slice's size, StridedSlice's end) with each split
  dimension's global extent replaced by the local size (only whole-dimension
  slices keep a split, so they start at 0)."""
  def localize(lctx):
    if extent is None:
      return
    local = list(extent)
    for i, axis in enumerate(out.dims):
      if axis is not None:
        local[i] = lctx.local_out_shape(0)[i]
    lctx.const_input(2, np.asarray(local, lctx.input_dtype(2)))
  return localize


@register("Slice")
def slice_(ctx):
  begin, size = _const_int(ctx, 1), _const_int(ctx, 2)
  req, out = _slice_like(ctx, begin, size, False)
  return Decision(req, [out], localize=_local_extent(size, out))


@register("StridedSlice")
def strided_slice(ctx):
  attrs = ctx.node.attr
  begin, end, strides = _const_int(ctx, 1), _const_int(ctx, 2), _const_int(ctx, 3)
  simple = (attrs["ellipsis_mask"].i == 0 and attrs["new_axis_mask"].i == 0 and
            attrs["shrink_axis_mask"].i == 0 and begin is not None and end is not None
            and strides is not None and all(strides == 1) and
            len(begin) == ctx.rank(0))
  spec = ctx.in_specs[0]
  if not simple:
    req = [Sharding(tuple([None] * spec.rank), spec.partial)] + list(ctx.in_specs[1:])
    return Decision(req, [Sharding(tuple([None] * ctx.out_rank()), spec.partial)])
  shape = ctx.in_shape(0)
  b = [0 if attrs["begin_mask"].i >> i & 1 else begin[i] for i in range(len(begin))]
  e = [shape[i] if attrs["end_mask"].i >> i & 1 else end[i] for i in range(len(end))]
  req, out = _slice_like(ctx, b, e, True)
  return Decision(req, [out], localize=_local_extent(end, out))


@register("Tile")
def tile(ctx):
  spec = ctx.in_specs[0]
  multiples = _const_int(ctx, 1)
  dims = [a if multiples is not None and multiples[i] == 1 else None
          for i, a in enumerate(spec.dims)]
  s = Sharding(tuple(dims), spec.partial)
  return Decision([s, ctx.in_specs[1]], [s])


@register("BroadcastTo")
def broadcast_to(ctx):
  spec = ctx.in_specs[0]
  in_shape, out_shape = ctx.in_shape(0), ctx.out_shape()
  offset = len(out_shape) - len(in_shape)
  dims_in, dims_out = list(spec.dims), [None] * len(out_shape)
  for i, axis in spec.split_dims():
    if in_shape[i] == out_shape[i + offset]:
      dims_out[i + offset] = axis
    else:
      dims_in[i] = None
  return Decision([Sharding(tuple(dims_in), spec.partial), ctx.in_specs[1]],
                  [Sharding(tuple(dims_out), spec.partial)],
                  localize=_replace_shape_input(1))


@register("Fill")
def fill(ctx):
  return Decision([ctx.in_specs[0], ctx.in_specs[1].without_partial()],
                  [Sharding.replicated(ctx.out_rank())])


@register("Const", "Placeholder", "PlaceholderWithDefault", "Range", "NoOp")
def source(ctx):
  # Outputs are replicated, so inputs (PlaceholderWithDefault's default) must be.
  ins = [None if s is None else Sharding.replicated(s.rank) for s in ctx.in_specs]
  outs = [Sharding.replicated(len(o.shape)) if o is not None and o.shape is not None
          else None for o in ctx.out_infos]
  return Decision(ins, outs)
