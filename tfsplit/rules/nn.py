"""Neural-net ops: Softmax, LogSoftmax, BiasAdd, BiasAddGrad, the softmax
cross-entropy ops.

Softmax-like ops normalise over the last dimension, which must therefore be
whole on each device; every other dimension may stay split.
"""
from tfsplit.rules.base import Decision, register
from tfsplit.sharding.spec import Sharding


def _last_dim_whole(spec):
  return Sharding(spec.dims[:-1] + (None,))


@register("Softmax", "LogSoftmax")
def softmax(ctx):
  req = _last_dim_whole(ctx.in_specs[0])
  return Decision([req], [req])


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
