"""Neural-net ops: Softmax, LogSoftmax, TopKV2, BiasAdd, BiasAddGrad, the softmax
cross-entropy ops, Conv2D and its gradients, and the label and mask ops
OneHot and MatrixBandPart.

Softmax-like ops normalise over the last dimension, which must therefore be
whole on each device; every other dimension may stay split.
"""
import dataclasses

from tfsplit.rules.base import Decision, register
from tfsplit.rules.matmul import contraction_decision
from tfsplit.rules.shape import _replace_shape_input
from tfsplit.layout.spec import Sharding


def _last_dim_whole(spec):
  return Sharding(spec.dims[:-1] + (None,))


@register("Softmax", "LogSoftmax")
def softmax(ctx):
  req = _last_dim_whole(ctx.in_specs[0])
  return Decision([req], [req])


@register("TopKV2")
def top_k(ctx):
  """The k largest of the last dimension (whole on each device), with their
  indices; every leading dimension stays split. Not linear: a partial sum is
  reduced first."""
  req = _last_dim_whole(ctx.in_specs[0].without_partial())
  return Decision([req, ctx.in_specs[1].without_partial()], [req, req])


@register("BiasAdd")
def bias_add(ctx):
  value = ctx.in_specs[0]
  nchw = ctx.node.attr["data_format"].s == b"NCHW"
  channel = 1 if nchw else value.rank - 1
  # Adding a bias to a partial sum would add it n times: reduce first.
  req_value = value.without_partial()
  req_bias = Sharding((value.dims[channel],))
  return Decision([req_value, req_bias], [req_value])


@register("BiasAddGrad")
def bias_add_grad(ctx):
  spec = ctx.in_specs[0]
  nchw = ctx.node.attr["data_format"].s == b"NCHW"
  channel = 1 if nchw else spec.rank - 1
  partial = set(spec.partial)
  for i, axis in spec.split_dims():
    if i != channel:
      partial.add(axis)  # summing over a split dimension
  return Decision([spec], [Sharding((spec.dims[channel],), frozenset(partial))])


@register("SparseSoftmaxCrossEntropyWithLogits")
def sparse_xent(ctx):
  logits = _last_dim_whole(ctx.in_specs[0])
  labels = Sharding(logits.dims[:-1])
  return Decision([logits, labels], [labels, logits])


@register("SoftmaxCrossEntropyWithLogits")
def xent(ctx):
  logits = _last_dim_whole(ctx.in_specs[0])
  return Decision([logits, logits], [Sharding(logits.dims[:-1]), logits])


def _conv_letters(ctx, image_shape, filter_shape):
  """Letters of (image, filter) of a 2-D convolution: the batch 'b', input
  channels 'c', output channels 'o'; spatial dimensions (None) stay whole,
  since windows cross block borders. A grouped convolution (image channels !=
  filter input channels) keeps its channels whole too."""
  nchw = ctx.node.attr["data_format"].s.startswith(b"NC")
  channel = 1 if nchw else 3
  grouped = image_shape[channel] != filter_shape[2]
  c, o = (None, None) if grouped else ("c", "o")
  image = ["b", c, None, None] if nchw else ["b", None, None, c]
  out = ["b", o, None, None] if nchw else ["b", None, None, o]
  return image, [None, None, c, o], out


def _sub(ctx, keep):
  """ctx restricted to the data inputs `keep` (not the shape input)."""
  return dataclasses.replace(ctx, in_specs=[ctx.in_specs[i] for i in keep],
                             in_infos=[ctx.in_infos[i] for i in keep])


@register("Conv2D")
def conv2d(ctx):
  """A contraction over the input channels and the window: the batch and the
  output channels may stay split, split input channels leave a partial sum."""
  image, filt, out = _conv_letters(ctx, ctx.in_shape(0), ctx.in_shape(1))
  return contraction_decision(ctx, [image, filt], out)


@register("Conv2DBackpropFilter")
def conv2d_backprop_filter(ctx):
  """(input, filter_sizes, dy) -> the filter's gradient: a contraction over the
  batch (a split batch leaves a partial sum, as for a MatMul's weights)."""
  image, filt, out = _conv_letters(ctx, ctx.in_shape(0), ctx.out_shape())
  decision = contraction_decision(_sub(ctx, (0, 2)), [image, out], filt)
  decision.inputs.insert(1, ctx.in_specs[1])
  decision.localize = _replace_shape_input(1)
  return decision


@register("Conv2DBackpropInput")
def conv2d_backprop_input(ctx):
  """(input_sizes, filter, dy) -> the input's gradient: a contraction over the
  output channels and the window."""
  image, filt, out = _conv_letters(ctx, ctx.out_shape(), ctx.in_shape(1))
  decision = contraction_decision(_sub(ctx, (1, 2)), [filt, out], image)
  decision.inputs.insert(0, ctx.in_specs[0])
  decision.localize = _replace_shape_input(0)
  return decision


@register("OneHot")
def one_hot(ctx):
  """One-hot labels keep the indices' split; the new depth dimension is whole."""
  indices = ctx.in_specs[0].without_partial()
  axis = ctx.node.attr["axis"].i
  axis = axis % ctx.out_rank() if axis >= 0 else ctx.out_rank() - 1
  dims = list(indices.dims)
  dims.insert(axis, None)
  req = [indices] + [s.without_partial() for s in ctx.in_specs[1:]]
  return Decision(req, [Sharding(tuple(dims))])


@register("MatrixBandPart")
def matrix_band_part(ctx):
  """A band of the last two dimensions (a causal mask): they are whole on
  each device, the leading (batch, head) dimensions stay split. Linear."""
  spec = ctx.in_specs[0]
  dims = spec.dims[:-2] + (None, None)
  req = Sharding(dims, spec.partial)
  return Decision([req] + [s.without_partial() for s in ctx.in_specs[1:]], [req])
