"""Elementwise ops with broadcasting, and their gradient helpers.

A dimension split in any input splits the output; inputs that broadcast along
it (size 1) stay replicated there. Partial sums may flow only through inputs
in which the op is linear: all inputs of a sum (Add, Sub, AddN) together, or
one input of a product (Mul, the numerator of RealDiv, the dy of ReluGrad).
"""
import dataclasses

from tfsplit.rules.base import Decision, divisible, register
from tfsplit.layout.spec import KEEP, Sharding, axis_parts, constraint_of, overlaps

UNARY = (
    "Relu", "Relu6", "Elu", "Selu", "Gelu", "Tanh", "Sigmoid", "Exp", "Log",
    "Log1p", "Sqrt", "Rsqrt", "Square", "Abs", "Sign", "Erf", "Erfc", "Floor",
    "Ceil", "Round", "Reciprocal", "Inv", "Softplus", "Softsign", "LogicalNot",
    "IsFinite", "IsNan", "Sin", "Cos", "Expm1", "Swish", "LeakyRelu")
# Unary ops that are linear: partial sums pass through.
LINEAR_UNARY = ("Identity", "Neg", "StopGradient", "PreventGradient", "Snapshot",
                "Cast", "CheckNumerics", "EnsureShape")
# Binary/n-ary sums: linear in all inputs at once.
SUMS = ("Add", "AddV2", "Sub", "AddN")
# Ops linear in exactly one (any) input, the others fixed.
PRODUCTS = {"Mul": None, "MulNoNan": None, "RealDiv": (0,), "Div": (0,),
            "DivNoNan": (0,), "TruncateDiv": (), "FloorDiv": (),
            "ReluGrad": (0,), "Relu6Grad": (0,), "EluGrad": (0,), "SeluGrad": (0,),
            "GeluGrad": (0,), "LeakyReluGrad": (0,), "SoftplusGrad": (0,),
            "TanhGrad": (1,), "SigmoidGrad": (1,), "RsqrtGrad": (1,),
            "SqrtGrad": (1,), "InvGrad": (1,), "ReciprocalGrad": (1,)}
_FLOAT_TYPES = (1, 2, 19, 14, 8, 18)  # float, double, half, bfloat16, complex64/128
NONLINEAR = ("Maximum", "Minimum", "Pow", "SquaredDifference", "Greater",
             "GreaterEqual", "Less", "LessEqual", "Equal", "NotEqual",
             "LogicalAnd", "LogicalOr", "SelectV2", "FloorMod", "Mod",
             "Atan2", "BiasAddV1")


def broadcast_decision(ctx, linear_inputs):
  """Decision for a broadcasting elementwise op.

  linear_inputs: 'all' (a sum), a tuple of input indices in which the op is
  linear one at a time (a product), or () (nonlinear).
  """
  out_shape = ctx.out_shape()
  out_rank = len(out_shape)
  ins = ctx.in_specs
  # 1. Output dims: the first input that splits a (non-broadcast) dim wins.
  out_dims = [None] * out_rank
  used = set()
  for spec, info in zip(ins, ctx.in_infos):
    if spec is None or info is None or info.shape is None:
      continue
    offset = out_rank - len(info.shape)
    for i, axis in spec.split_dims():
      o = i + offset
      finer = out_dims[o] is not None and _extends(axis, out_dims[o])
      if finer:
        # A finer split of the same dimension (the batch over dp*mb*ep where
        # another input has it over dp*mb): the coarser input is sliced
        # locally, free, rather than this one gathered.
        added = set(axis_parts(axis)) - set(axis_parts(out_dims[o]))
        if overlaps("*".join(added), used):
          continue
      elif overlaps(axis, used) or out_dims[o] is not None:
        continue
      if info.shape[i] == out_shape[o] and divisible(out_shape[o], ctx, axis):
        out_dims[o] = axis
        used.update(axis_parts(axis))
  # 2. Partial sums.
  partials = [s.partial if s is not None else frozenset() for s in ins]
  out_partial = frozenset()
  keep_partial = [False] * len(ins)
  nonempty = [p for p in partials if p]
  if nonempty:
    if linear_inputs == "all":
      if all(p == nonempty[0] for p in partials):
        out_partial = nonempty[0]
        keep_partial = [True] * len(ins)
    elif linear_inputs:
      allowed = range(len(ins)) if linear_inputs is None else linear_inputs
      candidates = [i for i in allowed if i < len(ins) and partials[i]]
      if len(nonempty) == 1 and candidates:
        out_partial = partials[candidates[0]]
        keep_partial[candidates[0]] = True
  # An output partial over an axis that also splits a dim is impossible.
  if any(overlaps(a, used) for a in out_partial):
    out_partial, keep_partial = frozenset(), [False] * len(ins)
  # 3. Required input shardings.
  required = []
  for k, (spec, info) in enumerate(zip(ins, ctx.in_infos)):
    if spec is None or info is None or info.shape is None:
      required.append(spec)
      continue
    offset = out_rank - len(info.shape)
    dims = []
    for i, size in enumerate(info.shape):
      o = i + offset
      dims.append(out_dims[o] if size == out_shape[o] else None)
    required.append(Sharding(tuple(dims), partials[k] if keep_partial[k] else frozenset()))
  return Decision(required, [Sharding(tuple(out_dims), out_partial)] * len(ctx.out_infos))


def _extends(axis, coarser):
  """Whether compound `axis` is `coarser` with more minor parts."""
  mine, theirs = axis_parts(axis), axis_parts(coarser)
  return len(mine) > len(theirs) and mine[:len(theirs)] == theirs


@register(*UNARY)
def unary(ctx):
  return broadcast_decision(ctx, ())


def _local_shape_attr(lctx):
  """EnsureShape checks its input against the global shape in its attr; each
  device checks its block against the block's shape (unknown dims stay)."""
  local = lctx.local_out_shape(0)
  for dim, size in zip(lctx.node.attr["shape"].shape.dim, local):
    if dim.size >= 0:
      dim.size = size


@register(*LINEAR_UNARY)
def linear_unary(ctx):
  constraint = constraint_of(ctx.node)
  if constraint is not None:
    # A sharding constraint: its input is resharded into what it asks for
    # (a KEEP dimension: as its input has it).
    arrives = ctx.in_specs[0]
    constraint = Sharding(tuple(a if d == KEEP else d
                                for d, a in zip(constraint.dims, arrives.dims)))
    return Decision([constraint], [constraint])
  if ctx.node.op == "Cast":
    # Casting to an integer type is not linear.
    src, dst = ctx.node.attr["SrcT"].type, ctx.node.attr["DstT"].type
    if dst not in (1, 2, 19, 14) or src not in (1, 2, 19, 14):
      return broadcast_decision(ctx, ())
  decision = broadcast_decision(ctx, "all")
  if ctx.node.op == "EnsureShape":
    decision.localize = _local_shape_attr
  return decision


@register(*SUMS)
def sums(ctx):
  return broadcast_decision(ctx, "all")


@register(*PRODUCTS)
def products(ctx):
  linear = PRODUCTS[ctx.node.op]
  if ctx.node.op in ("Div", "RealDiv") and ctx.node.attr["T"].type not in _FLOAT_TYPES:
    linear = ()  # integer division truncates: not linear in the numerator
  return broadcast_decision(ctx, linear)


@register(*NONLINEAR)
def nonlinear(ctx):
  return broadcast_decision(ctx, ())


@register("Select")
def select(ctx):
  """Select(cond, t, e): a rank-1 `cond` with rank-k t/e picks along dimension
  0 (it does not broadcast against the last dimension): decide as if it had
  shape [n, 1, ..., 1]."""
  cond, spec, rank = ctx.in_infos[0], ctx.in_specs[0], ctx.out_rank()
  if len(cond.shape) != 1 or rank == 1:
    return broadcast_decision(ctx, ())
  pad = (1,) * (rank - 1)
  padded = dataclasses.replace(
      ctx, in_infos=[dataclasses.replace(cond, shape=tuple(cond.shape) + pad)]
      + list(ctx.in_infos[1:]),
      in_specs=[Sharding(spec.dims + (None,) * (rank - 1), spec.partial)]
      + list(ctx.in_specs[1:]))
  decision = broadcast_decision(padded, ())
  req = decision.inputs[0]
  decision.inputs[0] = Sharding(req.dims[:1], req.partial)
  return decision


@register("ZerosLike", "OnesLike")
def like(ctx):
  spec = ctx.in_specs[0]
  return Decision([spec], [spec.without_partial()])


@register("IdentityN")
def identity_n(ctx):
  return Decision(list(ctx.in_specs), list(ctx.in_specs))
