"""Ops that move or view data: Reshape, Transpose, ExpandDims, Squeeze,
ConcatV2, Pack, Unpack, Split, SplitV, Slice, StridedSlice(Grad), Pad, PadV2,
MirrorPad, Tile, BroadcastTo, Fill, Const, Placeholder.

These carry global sizes in constant inputs (a Reshape target, Slice sizes,
BroadcastTo shapes); `localize` rewrites them to each device's local sizes.
All are linear, so partial sums pass through.
"""
import numpy as np

from tfsplit.rules.base import Decision, divisible, fallback, register
from tfsplit.layout.spec import Sharding, axis_parts, overlaps


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
    # contiguous blocks, which maps onto the major dim on the other side;
    # splits of its minor dims (a sequence split over tp under the batch's
    # over micro-batches) are gathered first, the major one kept.
    if d == major_in and major_out is not None and \
        divisible(out_shape[major_out], ctx, axis):
      out_dims[major_out] = axis
      gathered = split[1:]
    else:
      gathered = split
    for k, _ in gathered:
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


def _merged_dims(specs, skip=None):
  """Per dimension, the axis of the first input that splits it (each axis
  once), except dimension `skip`. An input replicated where another is split
  is sliced locally, which is free; gathering the split one is not (a class
  token concatenated in front of batch-split patches)."""
  dims, used = [None] * specs[0].rank, set()
  for spec in specs:
    for i, axis in spec.split_dims():
      if i != skip and dims[i] is None and not overlaps(axis, used):
        dims[i] = axis
        used.update(axis_parts(axis))
  return dims


def _common_partial(specs):
  first = specs[0].partial
  return first if all(s.partial == first for s in specs) else frozenset()


@register("ConcatV2")
def concat(ctx):
  n = len(ctx.in_specs) - 1
  axis = int(_const_int(ctx, n)) % ctx.out_rank()
  dims = tuple(_merged_dims(ctx.in_specs[:n], skip=axis))
  partial = _common_partial(ctx.in_specs[:n])
  req = [Sharding(dims, partial)] * n + [ctx.in_specs[n]]
  return Decision(req, [Sharding(dims, partial)])


@register("Pack")
def pack(ctx):
  axis = ctx.node.attr["axis"].i % ctx.out_rank()
  dims = _merged_dims(ctx.in_specs)
  partial = _common_partial(ctx.in_specs)
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


def _strided_entries(attrs, n, shape, begin, end, strides):
  """StridedSlice's dense spec: one (input dim, output dim, whole, sparse index)
  per entry; input dim None for a new axis, output dim None for a shrunk one.

  `whole` is True where the entry takes its input dimension entirely, in
  order (the only entries that may stay split). begin/end/strides may be None
  (not constant); a masked begin or end needs no value.
  """
  masks = {k: attrs[k].i for k in ("begin_mask", "end_mask", "ellipsis_mask",
                                   "new_axis_mask", "shrink_axis_mask")}

  def bit(mask, i):
    return bool(masks[mask] >> i & 1)
  explicit = sum(1 for i in range(n) if not bit("ellipsis_mask", i) and
                 not bit("new_axis_mask", i))
  entries, d, o, ellipsis = [], 0, 0, False
  for i in range(n):
    if bit("ellipsis_mask", i) and not ellipsis:
      ellipsis = True
      for _ in range(len(shape) - explicit):
        entries.append((d, o, True, None))
        d, o = d + 1, o + 1
    elif bit("ellipsis_mask", i) or bit("new_axis_mask", i):
      entries.append((None, o, False, i))
      o += 1
    elif bit("shrink_axis_mask", i):
      entries.append((d, None, False, i))
      d += 1
    else:
      entries.append((d, o, strides is not None and int(strides[i]) == 1 and
                      _from_start(bit("begin_mask", i), begin, i, shape[d]) and
                      _to_end(bit("end_mask", i), end, i, shape[d]), i))
      d, o = d + 1, o + 1
  while d < len(shape):   # an implicit ellipsis at the end
    entries.append((d, o, True, None))
    d, o = d + 1, o + 1
  return entries


def _from_start(masked, begin, i, size):
  if masked:
    return True
  if begin is None or (begin[i] < 0 and size is None):
    return False
  return (begin[i] + size if begin[i] < 0 else begin[i]) <= 0


def _to_end(masked, end, i, size):
  if masked:
    return True
  if end is None or size is None:
    return False
  return (end[i] + size if end[i] < 0 else end[i]) >= size


def _local_end(end, entries, out_dims, index):
  """localize: StridedSlice(Grad)'s `end` (input `index`) with the global
  size of each split whole dimension replaced by the local size (a run-time
  end can only be masked there, so it is left as it is)."""
  def localize(lctx):
    if end is None:
      return
    local = list(end)
    for _, o, _, i in entries:
      if i is not None and o is not None and out_dims[o] is not None:
        local[i] = lctx.local_out_shape(0)[o]
    lctx.const_input(index, np.asarray(local, lctx.input_dtype(index)))
  return localize


@register("StridedSlice")
def strided_slice(ctx):
  """Dimensions taken whole (ellipsis, new axes, full ranges) keep their split;
  a split dimension that is shrunk, cut or strided is gathered first."""
  spec = ctx.in_specs[0]
  begin, end, strides = _const_int(ctx, 1), _const_int(ctx, 2), _const_int(ctx, 3)
  if ctx.in_shape(1)[0] is None:
    return fallback(ctx, "the number of slice bounds is unknown")
  entries = _strided_entries(ctx.node.attr, ctx.in_shape(1)[0], ctx.in_shape(0),
                             begin, end, strides)
  in_dims, out_dims = list(spec.dims), [None] * ctx.out_rank()
  for d, o, whole, _ in entries:
    if d is None or spec.dims[d] is None:
      continue
    if whole:
      out_dims[o] = spec.dims[d]
    else:
      in_dims[d] = None
  req = [Sharding(tuple(in_dims), spec.partial)] + list(ctx.in_specs[1:])
  return Decision(req, [Sharding(tuple(out_dims), spec.partial)],
                  localize=_local_end(end, entries, out_dims, 2))


@register("StridedSliceGrad")
def strided_slice_grad(ctx):
  """The gradient of a StridedSlice scatters dy into zeros of the input's
  shape: dy's dimensions that are whole in the slice keep their split in the
  output; the others are gathered first. Linear in dy."""
  dy = ctx.in_specs[4]
  begin, end, strides = _const_int(ctx, 1), _const_int(ctx, 2), _const_int(ctx, 3)
  if ctx.in_shape(1)[0] is None:
    return fallback(ctx, "the number of slice bounds is unknown")
  entries = _strided_entries(ctx.node.attr, ctx.in_shape(1)[0], ctx.out_shape(),
                             begin, end, strides)
  dy_dims, out_dims = list(dy.dims), [None] * ctx.out_rank()
  for d, o, whole, _ in entries:
    if o is None or dy.dims[o] is None:
      continue
    if whole and d is not None:
      out_dims[d] = dy.dims[o]
    else:
      dy_dims[o] = None
  req = list(ctx.in_specs[:4]) + [Sharding(tuple(dy_dims), dy.partial)]
  shape_input = _replace_shape_input(0)
  end_input = _local_end(end, [(o, d, w, i) for d, o, w, i in entries], out_dims, 2)

  def localize(lctx):
    shape_input(lctx)
    end_input(lctx)
  return Decision(req, [Sharding(tuple(out_dims), dy.partial)], localize=localize)


@register("Pad", "PadV2", "MirrorPad")
def pad(ctx):
  """A split dimension stays split only where it is not padded (like a
  whole-dimension Slice): padding shifts the blocks, so a padded split
  dimension is gathered first. Paddings of the other dimensions hold as
  they are on every device."""
  spec = ctx.in_specs[0]
  paddings = _const_int(ctx, 1)
  if paddings is None:
    return fallback(ctx, "paddings are not constant")
  paddings = paddings.reshape(-1, 2)
  dims = tuple(a if a is not None and not paddings[i].any() else None
               for i, a in enumerate(spec.dims))
  partial = spec.partial
  req = [None, ctx.in_specs[1]]
  if ctx.node.op == "PadV2":
    value = ctx.const_inputs[2]
    # A nonzero pad value would be added once per partial sum.
    if value is None or np.any(np.asarray(value) != 0):
      partial = frozenset()
    req.append(ctx.in_specs[2].without_partial())
  req[0] = Sharding(dims, partial)
  return Decision(req, [Sharding(dims, partial)])


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
