"""Table-driven coverage of every registered split rule (tfsplit.rules.RULES).

One row per op type in RULES. A row builds a small tf.function whose op
inputs are computed from tf.Variables; the variables are annotated with
shardings drawn by a seeded generator (each dimension split over a mesh axis
where it divides, or replicated), and the split function's outputs are
compared with the original's: float outputs within 1e-5 of the output's own
scale, integer and boolean outputs exactly. Rows that write variables also
compare the variables' final values.

Each row's function holds several independent *copies* of the op, one per
variant (shapes, axes, attrs) plus "partial" copies in which the float inputs
come from a MatMul whose contracted dimension is split (the op then receives
a partial sum). Each copy has its own variables, so one split exercises
several shardings at once and every tf.function is traced once.

Variable values are multiples of 1/4 with small magnitude, so sums of their
products are exact in float32 whatever the summation order: a split graph
computes linear parts bit-exactly and comparisons / Floor / ArgMax on them
cannot flip on rounding.

Fallbacks (ops forced to replicate their split inputs) are checked against
the row's documented `fallbacks`; a rule raising internally always fails the
test (conftest sets TFSPLIT_STRICT_RULES; the "internal error" fallback is
rejected as well). The op under test must appear in the split graph.

`python tests/test_rules.py` breaks four rules in memory and checks that the
harness notices each (run by the slow test_harness_catches_broken_rules).
"""
import collections
import dataclasses
import re
import zlib
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

import tfsplit
from tfsplit.errors import PlanError
from tfsplit.rules.base import RULES

R = tf.raw_ops
TIMEOUT = 60
MESH = "tp=2"
MULTI_MESHES = ("tp=4", "dp=2,tp=2")
CONTRACT = 4          # contracted size of the MatMul producing partial inputs


# --- the table ----------------------------------------------------------------

@dataclasses.dataclass
class In:
  """One op input: its shape and value kind.

  kind: any (k/4, |k| <= 8), pos (k/4, 2 <= k <= 8), distinct (all values
  different), int / ipos (int32), bool, idx:N (int32 in [0, N)), sorted:N
  (rank 1: every int32 in [0, N), ascending), var / var_pos (the tf.Variable
  itself is passed to the body, any / pos values)."""
  shape: Tuple[int, ...]
  kind: str = "any"

  @property
  def floating(self):
    return self.kind in ("any", "pos", "distinct")


@dataclasses.dataclass
class V:
  """A variant: the op's inputs and a parameter the body uses (axis, attrs);
  ties: {input: input whose sharding it copies}; ns: {input: dims never split}."""
  ins: List[In]
  p: object = None
  ties: Dict[int, int] = dataclasses.field(default_factory=dict)
  ns: Dict[int, Tuple[int, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Row:
  op: str
  variants: List[V] = dataclasses.field(default_factory=list)
  body: Optional[Callable] = None      # body(p, *inputs) -> tensor or list
  partial: bool = True                 # add partial-sum copies of float inputs
  multi: bool = False                  # also run on MULTI_MESHES
  # Legitimate refusals: {op: text its fallback message must contain}.
  fallbacks: Dict[str, str] = dataclasses.field(default_factory=dict)
  skip: Optional[str] = None           # why the op is not run here
  absent: Optional[str] = None         # why the op is not in the split graph
  ties: Dict[int, int] = dataclasses.field(default_factory=dict)  # input -> same as
  no_split: Dict[int, Tuple[int, ...]] = dataclasses.field(default_factory=dict)
  writes: bool = False                 # compare variable values afterwards


def I(*shape, kind="any"):
  return In(tuple(shape), kind)


def raw(op, **attrs):
  """body(p, *xs) calling tf.raw_ops.<op> with xs bound to its inputs in order."""
  names = [a.name for a in op_def_registry.get(op).input_arg]
  return lambda p, *xs: getattr(R, op)(**dict(zip(names, xs)), **attrs)


SHAPES_1 = [V([I(4, 8)]), V([I(8)]), V([I(2, 4, 8)])]
SHAPES_2 = [V([I(4, 8), I(4, 8)]), V([I(4, 8), I(8)]), V([I(4, 1), I(1, 8)]),
            V([I(2, 4, 8), I(4, 1)])]


def kinds(variants, *ks):
  """variants with input i's kind set to ks[i] (None: unchanged)."""
  out = []
  for v in variants:
    ins = [In(x.shape, k or x.kind) for x, k in zip(v.ins, ks + (None,) * len(v.ins))]
    out.append(V(ins, v.p, v.ties, v.ns))
  return out


ROWS: List[Row] = []


def row(op, variants=None, body=None, **kw):
  ROWS.append(Row(op, variants or [], body, **kw))


# Elementwise unary (rules/elementwise.py: UNARY, nonlinear).
_POS = {"Log", "Log1p", "Sqrt", "Rsqrt", "Reciprocal", "Inv"}
for _op in ("Relu", "Relu6", "Elu", "Selu", "Tanh", "Sigmoid", "Exp", "Log", "Log1p",
            "Sqrt", "Rsqrt", "Square", "Abs", "Sign", "Erf", "Erfc", "Floor", "Ceil",
            "Round", "Reciprocal", "Inv", "Softplus", "Softsign", "IsFinite", "IsNan",
            "Sin", "Cos", "Expm1", "LeakyRelu"):
  row(_op, kinds(SHAPES_1, "pos" if _op in _POS else None), raw(_op),
      multi=_op in ("Tanh", "Sigmoid", "Relu", "Log"))
# Bool tensors cannot be gathered (CollectiveGatherV2 has no bool kernel: a
# materializer limitation, see test_bool_gather_is_unsupported), so bool
# inputs are sharded such that no rule needs them gathered (ties / ns), and
# the harness casts bool outputs to int32 before they are gathered.
row("LogicalNot", kinds(SHAPES_1, "bool"), raw("LogicalNot"))
for _op in ("Gelu", "Swish"):
  row(_op, skip="not a registered TensorFlow op in TF 2.21 (no OpDef): tf.nn.gelu "
      "lowers to Erfc/Tanh/Pow/Mul and tf.nn.silu to Sigmoid/Mul, all covered here")

# Linear unary: partial sums pass through.
for _op in ("Neg", "StopGradient", "PreventGradient", "Snapshot"):
  row(_op, SHAPES_1, raw(_op), multi=_op == "Neg")
row("Identity", SHAPES_1, lambda p, x: tf.identity(x * 1.0), multi=True)
row("CheckNumerics", SHAPES_1, raw("CheckNumerics", message="bad"))
row("EnsureShape", SHAPES_1, lambda p, x: tf.ensure_shape(x, x.shape))
# Cast: float->double is linear, float->int and int->float are not.
row("Cast", [V([I(4, 8)], tf.float64), V([I(4, 8)], tf.int32), V([I(8)], tf.float16),
             V([I(2, 4, 8, kind="int")], tf.float32)],
    lambda p, x: tf.cast(x, p), multi=True)

# Sums: linear in all inputs together.
for _op in ("Add", "AddV2", "Sub"):
  row(_op, SHAPES_2, raw(_op), multi=_op == "AddV2")
row("AddN", [V([I(4, 8)] * 3), V([I(8)] * 2), V([I(2, 4, 8)] * 2)],
    lambda p, *xs: tf.add_n(list(xs)), multi=True)

# Products: linear in one input at a time.
row("Mul", SHAPES_2 + [V([I(4, 8, kind="int"), I(8, kind="int")])], raw("Mul"),
    multi=True)
row("MulNoNan", SHAPES_2, raw("MulNoNan"))
row("RealDiv", kinds(SHAPES_2, None, "pos"), raw("RealDiv"), multi=True)
# Integer division truncates: not linear in the numerator (y replicated so a
# partial numerator reaches the rule as it is).
row("Div", kinds(SHAPES_2, None, "pos") +
    [V([I(4, 8, kind="int"), I(8, kind="ipos")], ns={1: (0,)})], raw("Div"))
row("DivNoNan", kinds(SHAPES_2, None, "any"), raw("DivNoNan"))   # y == 0 -> 0
row("TruncateDiv", kinds(SHAPES_2, None, "pos") +
    [V([I(4, 8, kind="int"), I(8, kind="ipos")])], raw("TruncateDiv"))
row("FloorDiv", kinds(SHAPES_2, None, "pos") +
    [V([I(4, 8, kind="int"), I(4, 8, kind="ipos")])], raw("FloorDiv"))
_GRAD2 = [V([I(4, 8), I(4, 8)]), V([I(2, 4, 8), I(2, 4, 8)])]
for _op in ("ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "SoftplusGrad",
            "TanhGrad", "SigmoidGrad", "InvGrad", "ReciprocalGrad"):
  row(_op, _GRAD2, raw(_op), multi=_op in ("ReluGrad", "TanhGrad"))
row("LeakyReluGrad", _GRAD2, raw("LeakyReluGrad", alpha=0.3))
for _op in ("RsqrtGrad", "SqrtGrad"):
  row(_op, kinds(_GRAD2, "pos"), raw(_op))
row("GeluGrad", skip="not a registered TensorFlow op in TF 2.21 (no OpDef): the "
    "gradient of tf.nn.gelu is built from ordinary elementwise ops")

# Nonlinear binary ops.
for _op in ("Maximum", "Minimum", "SquaredDifference", "Greater", "GreaterEqual",
            "Less", "LessEqual", "Equal", "NotEqual", "Atan2"):
  row(_op, SHAPES_2, raw(_op), multi=_op in ("Maximum", "Greater"))
row("Pow", kinds(SHAPES_2, "pos"), raw("Pow"))
for _op in ("FloorMod", "Mod"):
  row(_op, kinds(SHAPES_2, None, "pos") + [V([I(4, 8, kind="int"), I(8, kind="ipos")])],
      raw(_op))
_B = "bool"
for _op in ("LogicalAnd", "LogicalOr"):
  row(_op, [V([I(4, 8, kind=_B), I(4, 8, kind=_B)], ties={1: 0}),
            V([I(4, 8, kind=_B), I(8, kind=_B)], ns={1: (0,)}),
            V([I(4, 1, kind=_B), I(1, 8, kind=_B)], ns={1: (1,)}),
            V([I(2, 4, 8, kind=_B), I(4, 8, kind=_B)], ns={1: (0, 1)})], raw(_op))
# Select's rank-1 condition picks along dimension 0 (it does not broadcast).
row("Select", [V([I(4, 8, kind=_B), I(4, 8), I(4, 8)]),
               V([I(4, kind=_B), I(4, 8), I(4, 8)]),
               V([I(8, kind=_B), I(8, 8), I(8, 8)]),
               V([I(2, kind=_B), I(2, 4, 8), I(2, 4, 8)]),
               V([I(8, kind=_B), I(8), I(8)])],
    lambda p, c, t, e: R.Select(condition=c, x=t, y=e), multi=True)
row("SelectV2", [V([I(4, 8, kind="bool"), I(4, 8), I(4, 8)]),
                 V([I(8, kind="bool"), I(4, 8), I(1, 8)]),
                 V([I(4, 1, kind="bool"), I(8), I(4, 8)])],
    lambda p, c, t, e: R.SelectV2(condition=c, t=t, e=e))
row("BiasAddV1", [V([I(4, 8), I(8)]), V([I(2, 4, 8), I(8)])], raw("BiasAddV1"))

# Like-ops and IdentityN.
for _op in ("ZerosLike", "OnesLike"):
  row(_op, SHAPES_1 + [V([I(4, 8, kind="int")])],
      lambda p, x, _op=_op: getattr(R, _op)(x=x) + tf.ones_like(x) * 0, multi=True)
row("IdentityN", [V([I(4, 8), I(8)]), V([I(2, 4, 8), I(4, 8)])],
    lambda p, *xs: tf.identity_n(list(xs)),
    absent="fold.expand_identity_n replaces every IdentityN by one Identity per "
    "output before propagation, so the rule never runs; outputs are still compared")


# Contractions.
def _matmul(p, a, b):
  return R.MatMul(a=a, b=b, transpose_a=p[0], transpose_b=p[1])


row("MatMul", [V([I(4, 8), I(8, 4)], (False, False)), V([I(8, 4), I(8, 4)], (True, False)),
               V([I(4, 8), I(4, 8)], (False, True)), V([I(8, 4), I(4, 8)], (True, True))],
    _matmul, multi=True)
_BMM = [V([I(2, 4, 8), I(2, 8, 4)], (False, False)), V([I(2, 4, 8), I(8, 4)], (False, False)),
        V([I(2, 8, 4), I(1, 4, 8)], (True, True)), V([I(4, 8), I(2, 8, 4)], (False, False)),
        V([I(2, 2, 4, 4), I(2, 4, 4)], (False, True))]
row("BatchMatMulV2", _BMM, lambda p, a, b: R.BatchMatMulV2(x=a, y=b, adj_x=p[0], adj_y=p[1]),
    multi=True)
row("BatchMatMulV3", _BMM, lambda p, a, b: R.BatchMatMulV3(
    x=a, y=b, Tout=tf.float32, adj_x=p[0], adj_y=p[1]))
row("BatchMatMul", [V([I(2, 4, 8), I(2, 8, 4)], (False, False)),
                    V([I(2, 8, 4), I(2, 4, 8)], (True, True))],
    lambda p, a, b: R.BatchMatMul(x=a, y=b, adj_x=p[0], adj_y=p[1]))
row("Einsum", [V([I(4, 8), I(8, 4)], "ij,jk->ik"), V([I(2, 4, 8), I(2, 8, 4)], "bij,bjk->bik"),
               V([I(2, 4, 8), I(8, 4)], "bij,jk->bik"), V([I(2, 4, 8), I(8, 4)], "...j,jk->...k"),
               V([I(4, 8), I(4, 8)], "ij,ij->i"), V([I(4, 8), I(8, 2)], "ij,jk->k"),
               V([I(2, 4, 8), I(4, 8)], "bij,ij->bj")],
    lambda p, a, b: tf.einsum(p, a, b), multi=True)


# Reductions: variants are (axes, keep_dims).
def _runtime_int(x, value):
  """`value` as an int32 tensor that is not a constant (computed from x)."""
  return tf.constant(value, tf.int32) + tf.cast(tf.reduce_sum(x * 0), tf.int32)


def _reduce(op):
  def body(p, x):
    axes = tf.constant(p[0], tf.int32) if p[0] != "runtime" else _runtime_int(x, [1])
    return getattr(R, op)(input=x, axis=axes, keep_dims=p[1])
  return body


# Reduction axes computed at run time (the output keeps its rank, not its
# shape): the rule replicates.
_RUNTIME_AXES = "reduction axes are not constant"


_RED = [V([I(4, 8)], ([1], False)), V([I(4, 8)], ([0], True)), V([I(2, 4, 8)], ([0, 1], False)),
        V([I(2, 4, 8)], ([-1], True)), V([I(8)], ([0], False))]
for _op in ("Sum", "Mean"):
  row(_op, _RED + [V([I(4, 8, kind="int")], ([1], False)), V([I(4, 8, kind="int")], ([0], False))]
      + ([V([I(4, 8)], ("runtime", True))] if _op == "Sum" else []),
      _reduce(_op), multi=True, fallbacks={"Sum": _RUNTIME_AXES} if _op == "Sum" else {})
for _op in ("Max", "Min", "EuclideanNorm"):
  row(_op, _RED + ([V([I(4, 8)], ("runtime", True))] if _op == "Max" else []),
      _reduce(_op), multi=_op == "Max",
      fallbacks={"Max": _RUNTIME_AXES} if _op == "Max" else {})
row("Prod", kinds(_RED, "pos"), _reduce("Prod"))
# All / Any are written as counts before the split (graph/counted_reductions.py):
# a reduced bool dimension may be split, its counts summed.
for _op in ("All", "Any"):
  row(_op, kinds(_RED, "bool"), _reduce(_op), multi=_op == "All",
      absent="written as a count (Sum of a Cast) before the split")
for _op in ("ArgMax", "ArgMin"):
  row(_op, [V([I(4, 8, kind="distinct")], 1), V([I(4, 8, kind="distinct")], 0),
            V([I(2, 4, 8, kind="distinct")], -1), V([I(2, 4, 8, kind="distinct")], 1)],
      lambda p, x, _op=_op: getattr(R, _op)(input=x, dimension=p), multi=_op == "ArgMax")


# Scans: variants are (axis, exclusive, reverse); the scanned dimension is
# gathered (position ids: a cumsum of the padding mask over the sequence).
def _scan(op):
  def body(p, x):
    axis = tf.constant(p[0], tf.int32) if p[0] != "runtime" else _runtime_int(x, 1)
    return getattr(R, op)(x=x, axis=axis, exclusive=p[1], reverse=p[2])
  return body


_SCAN = [V([I(4, 8)], (1, False, False)), V([I(4, 8)], (0, True, False)),
         V([I(2, 4, 8)], (-1, False, True)), V([I(2, 4, 8)], (1, True, True))]
row("Cumsum", _SCAN + [V([I(4, 8, kind="int")], (1, False, False)),
                       V([I(4, 8)], ("runtime", False, False))],
    _scan("Cumsum"), multi=True, fallbacks={"Cumsum": "scan axis is not constant"})
row("Cumprod", kinds(_SCAN, "pos"), _scan("Cumprod"))
# (an exclusive one starts at -inf, which the comparison cannot take)
row("CumulativeLogsumexp", [V(v.ins, (v.p[0], False, v.p[2])) for v in _SCAN],
    _scan("CumulativeLogsumexp"))


# Shape ops.
row("Reshape", [V([I(4, 8)], [32]), V([I(4, 8)], [2, 2, 8]), V([I(2, 4, 8)], [8, 8]),
                V([I(4, 8)], [4, 2, 4]), V([I(4, 8)], [4, 1, 8]), V([I(4, 1, 8)], [32]),
                V([I(2, 4, 8)], [2, 32]), V([I(8, 4)], [4, 8])],
    lambda p, x: tf.reshape(x, p), multi=True)
row("Transpose", [V([I(4, 8)], [1, 0]), V([I(2, 4, 8)], [2, 0, 1]), V([I(2, 4, 8)], [0, 2, 1]),
                  V([I(4, 8)], "runtime")],
    lambda p, x: tf.transpose(x, p if p != "runtime" else _runtime_int(x, [1, 0])),
    multi=True, fallbacks={"Transpose": "permutation is not constant"})
row("ExpandDims", [V([I(4, 8)], 0), V([I(4, 8)], -1), V([I(4, 8)], 1), V([I(8)], -1)],
    lambda p, x: tf.expand_dims(x, p))
row("Squeeze", [V([I(4, 1, 8)], [1]), V([I(1, 8)], []), V([I(4, 8, 1)], [-1])],
    lambda p, x: tf.squeeze(x, p))
# A replicated input takes the split of another (a class token in front of
# batch-split patches): the ns variants keep input 0 replicated.
row("ConcatV2", [V([I(4, 8), I(4, 8)], 0), V([I(4, 8), I(4, 4), I(4, 8)], 1),
                 V([I(2, 4, 8), I(2, 4, 8)], -1), V([I(2, 4, 8), I(2, 4, 8)], 1),
                 V([I(4, 8), I(4, 8)], 1, ns={0: (0, 1)}),
                 V([I(2, 1, 8), I(2, 4, 8)], 1, ns={0: (0, 1, 2)})],
    lambda p, *xs: tf.concat(list(xs), p), multi=True)
row("Pack", [V([I(4, 8), I(4, 8)], 0), V([I(4, 8), I(4, 8), I(4, 8)], 1),
             V([I(8), I(8)], -1), V([I(4, 8), I(4, 8)], 0, ns={0: (0, 1)})],
    lambda p, *xs: tf.stack(list(xs), p), multi=True)
row("Unpack", [V([I(2, 8)], 0), V([I(4, 2)], 1), V([I(2, 4, 8)], 0), V([I(4, 2, 8)], 1)],
    lambda p, x: tf.unstack(x, axis=p))
row("Split", [V([I(4, 8)], 1), V([I(4, 8)], 0), V([I(2, 4, 8)], -1)],
    lambda p, x: tf.split(x, 2, axis=p), multi=True)
row("SplitV", [V([I(4, 8)], ([3, 5], 1)), V([I(4, 8)], ([1, 3], 0)),
               V([I(2, 4, 8)], ([2, -1], -1))],
    lambda p, x: tf.split(x, p[0], axis=p[1]))
row("Slice", [V([I(4, 8)], ([1, 0], [2, -1])), V([I(4, 8)], ([0, 2], [4, 4])),
              V([I(4, 8)], ([0, 0], [-1, 8])), V([I(2, 4, 8)], ([0, 1, 0], [2, 2, -1]))],
    lambda p, x: tf.slice(x, p[0], p[1]), multi=True)
# (input shape, slice): dimensions taken whole keep their split.
_SS = [
    ((4, 8), lambda x: x[1:3, :]),
    ((4, 8), lambda x: x[:, 2:6]),
    ((4, 8), lambda x: x[0]),                  # shrink_axis_mask
    ((4, 8), lambda x: x[::2, 1:]),            # stride 2: gathered
    ((4, 8), lambda x: x[:, :]),
    ((4, 8), lambda x: x[0:4, 0:8]),           # whole, with an explicit end
    ((4, 8), lambda x: x[..., 1:]),            # ellipsis
    ((4, 8), lambda x: x[-4:, :100]),          # negative begin, end past the size
    ((4, 8), lambda x: x[:, -1]),              # shrink at a negative index
    ((4, 8), lambda x: x[:, None, 2:]),        # new axis
    ((2, 4, 8), lambda x: x[1:3, :]),
    ((2, 4, 8), lambda x: x[..., None, :4]),   # ellipsis, then a new axis
    ((2, 4, 8), lambda x: x[None, :, 1, ...]),  # new axis, shrink, ellipsis
    ((4, 8), lambda x: x[:, _runtime_int(x, 1)]),  # run-time begin and end
]
row("StridedSlice", [V([I(*shape)], k) for k, (shape, _) in enumerate(_SS)],
    lambda p, x: _SS[p][1](x), multi=True)


def _slice_grad(p, x, dy):
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = _SS[p][1](x)
  return tape.gradient(y, x, output_gradients=dy)


# dy takes the slice's output shape; x only gives the shape.
row("StridedSliceGrad", [
    V([I(*shape), I(*fn(tf.zeros(shape)).shape)], k) for k, (shape, fn) in enumerate(_SS)],
    _slice_grad, multi=True)

def _pad_body(op):
  def body(p, x):
    if p == "tape":   # the gradient of a Slice is a Pad
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.slice(x, [1, 0], [2, -1])
        loss = tf.reduce_sum(y * y)
      return tape.gradient(loss, x)
    paddings, value = p
    paddings = tf.constant(paddings) if paddings != "runtime" else \
        _runtime_int(x, [[1, 0], [0, 0]])
    if op == "Pad":
      return R.Pad(input=x, paddings=paddings)
    if op == "PadV2":
      return R.PadV2(input=x, paddings=paddings, constant_values=tf.constant(value))
    return R.MirrorPad(input=x, paddings=paddings, mode=value)
  return body


# A split dimension stays split only where it is not padded.
_PAD = [V([I(4, 8)], [[1, 2], [0, 0]]), V([I(4, 8)], [[0, 0], [2, 1]]),
        V([I(4, 8)], [[0, 0], [0, 0]]), V([I(2, 4, 8)], [[0, 0], [1, 0], [0, 2]])]
row("Pad", [V(v.ins, (v.p, None)) for v in _PAD] + [V([I(4, 8)], "tape"),
                                                    V([I(4, 8)], ("runtime", None))],
    _pad_body("Pad"), multi=True, fallbacks={"Pad": "paddings are not constant"})
# PadV2 is linear (partial sums pass) only with a zero pad value (the
# partial copy is of the first variant).
row("PadV2", [V(_PAD[1].ins, (_PAD[1].p, 1.5)), V(_PAD[0].ins, (_PAD[0].p, 0.0)),
              V(_PAD[2].ins, (_PAD[2].p, -1.0)), V(_PAD[3].ins, (_PAD[3].p, 0.0)),
              V(_PAD[0].ins, (_PAD[0].p, 2.0))], _pad_body("PadV2"), multi=True)
row("MirrorPad", [V(_PAD[0].ins, (_PAD[0].p, "REFLECT")),
                  V(_PAD[1].ins, (_PAD[1].p, "SYMMETRIC")),
                  V(_PAD[3].ins, (_PAD[3].p, "REFLECT"))], _pad_body("MirrorPad"))
row("Tile", [V([I(4, 8)], [1, 2]), V([I(4, 8)], [2, 1]), V([I(2, 4, 8)], [1, 1, 2])],
    lambda p, x: tf.tile(x, p))
row("BroadcastTo", [V([I(1, 8)], [4, 8]), V([I(8)], [4, 8]), V([I(4, 1)], [4, 8]),
                    V([I(4, 8)], [2, 4, 8]), V([I(4, 8)], [4, 8])],
    lambda p, x: tf.broadcast_to(x, p), multi=True)
row("Fill", [V([I(8)], [4, 8]), V([I(4, 8)], [2, 4])],
    lambda p, x: R.Fill(dims=tf.constant(p), value=tf.reduce_sum(x)) * 1.0)
# Range with constant inputs is folded into a Const (fold_static_shapes); a
# run-time start (here a partial sum) reaches the rule.
row("Range", [V([I(8)]), V([I(4, 8)])],
    lambda p, x: tf.range(tf.reduce_sum(x * 0.0), 4.0) * 2.0)
row("PlaceholderWithDefault", SHAPES_1,
    lambda p, x: R.PlaceholderWithDefault(input=x, shape=x.shape) * 1.0)
row("Const", skip="implicit: every row's axes/shapes/perm are Const inputs")
row("Placeholder", skip="implicit: every captured variable handle is a Placeholder in "
    "the loaded graph (graph inputs are covered by tests/test_data_parallel.py)")
row("NoOp", skip="implicit: no outputs, control edges only (the write rows' "
    "functions end in one)")


# Neural-net ops.
row("Softmax", [V([I(4, 8)]), V([I(2, 4, 8)]), V([I(8)])], raw("Softmax"), multi=True)
# Values distinct: the top k (and their order) cannot tie.
row("TopKV2", [V([I(4, 8, kind="distinct")], 3), V([I(2, 4, 8, kind="distinct")], 2),
               V([I(8, kind="distinct")], 8)],
    lambda p, x: list(tf.math.top_k(x, k=p)), multi=True)
row("LogSoftmax", [V([I(4, 8)]), V([I(2, 4, 8)])], raw("LogSoftmax"), multi=True)
row("BiasAdd", [V([I(4, 8), I(8)], "NHWC"), V([I(2, 4, 8), I(8)], "NHWC"),
                V([I(2, 4, 2, 2), I(4)], "NCHW")],
    lambda p, x, b: tf.nn.bias_add(x, b, data_format=p), multi=True)


def _bias_add_grad(p, x):
  if p == "tape":   # BiasAddGrad reached through a GradientTape
    b = tf.zeros([x.shape[-1]])
    with tf.GradientTape() as tape:
      tape.watch(b)
      y = tf.nn.bias_add(x, b)
      loss = tf.reduce_sum(y * y)
    return tape.gradient(loss, b)
  return R.BiasAddGrad(out_backprop=x, data_format=p)


row("BiasAddGrad", [V([I(4, 8)], "NHWC"), V([I(2, 4, 8)], "NHWC"), V([I(4, 8)], "tape"),
                    V([I(2, 4, 2, 2)], "NCHW")], _bias_add_grad, multi=True)
row("SparseSoftmaxCrossEntropyWithLogits",
    [V([I(4, 8), I(4, kind="idx:8")]), V([I(8, 4), I(8, kind="idx:4")])],
    lambda p, x, y: list(R.SparseSoftmaxCrossEntropyWithLogits(features=x, labels=y)),
    multi=True)
row("SoftmaxCrossEntropyWithLogits",
    [V([I(4, 8), I(4, 8, kind="pos")]), V([I(8, 4), I(8, 4, kind="pos")])],
    lambda p, x, y: list(R.SoftmaxCrossEntropyWithLogits(features=x, labels=y)),
    multi=True)
# One-hot labels: variants are (depth, axis); on/off values from inputs too.
row("OneHot", [V([I(4, kind="idx:8")], (8, -1)), V([I(4, 2, kind="idx:4")], (4, 0)),
               V([I(4, 2, kind="idx:4")], (4, 1)),
               V([I(8, kind="idx:4"), I(), I()], (4, -1))],
    lambda p, i, *on_off: tf.one_hot(i, p[0], *(on_off or (1.5, -0.5)), axis=p[1]),
    multi=True)
# Causal masks: variants are (num_lower, num_upper).
row("MatrixBandPart", [V([I(2, 4, 4)], (-1, 0)), V([I(4, 8)], (1, 2)),
                       V([I(2, 2, 4, 4)], (0, -1))],
    lambda p, x: tf.linalg.band_part(x, p[0], p[1]), multi=True)



# 2-D convolutions: p = (sizes of the shape input, stride, padding, format).
def _conv(op):
  def body(p, a, b):
    sizes, stride, padding, fmt = p
    strides = [1, stride, stride, 1] if fmt == "NHWC" else [1, 1, stride, stride]
    kw = dict(strides=strides, padding=padding, data_format=fmt)
    if op == "Conv2D":
      return R.Conv2D(input=a, filter=b, **kw)
    if op == "Conv2DBackpropFilter":
      return R.Conv2DBackpropFilter(input=a, filter_sizes=tf.constant(sizes),
                                    out_backprop=b, **kw)
    return R.Conv2DBackpropInput(input_sizes=tf.constant(sizes), filter=a, out_backprop=b,
                                 **kw)
  return body


# The batch and the channels may stay split; the window's dimensions are
# gathered (the last variant of each splits nothing but them). A grouped
# convolution (image channels 4, filter channels 2) keeps its channels whole.
_SPATIAL = (0, 3)   # NHWC dims other than the window's
row("Conv2D", [V([I(2, 4, 4, 4), I(3, 3, 4, 8)], (None, 1, "SAME", "NHWC")),
               V([I(4, 4, 4, 2), I(2, 2, 2, 4)], (None, 2, "VALID", "NHWC")),
               V([I(2, 4, 4, 4), I(1, 1, 2, 4)], (None, 1, "SAME", "NHWC")),
               V([I(2, 4, 4, 4), I(3, 3, 4, 8)], (None, 1, "SAME", "NHWC"),
                 ns={0: _SPATIAL})],
    _conv("Conv2D"), multi=True)


def _grouped_conv_gradients_run():
  """Whether this machine's CPU kernels of Conv2DBackpropFilter and
  Conv2DBackpropInput take a grouped convolution. TF 2.21's run them
  through oneDNN where it is on; on a CPU where it is not (seen on an AMD
  EPYC) the unsplit op itself fails ('filter_size does not have enough
  elements'), and there is nothing to compare a split with."""
  x, dy, kw = tf.zeros([1, 2, 2, 4]), tf.zeros([1, 2, 2, 4]), dict(strides=[1, 1, 1, 1],
                                                                   padding="SAME")
  try:
    R.Conv2DBackpropFilter(input=x, filter_sizes=tf.constant([1, 1, 2, 4]),
                           out_backprop=dy, **kw)
    R.Conv2DBackpropInput(input_sizes=tf.constant([1, 2, 2, 4]),
                          filter=tf.zeros([1, 1, 2, 4]), out_backprop=dy, **kw)
  except tf.errors.InvalidArgumentError:
    return False
  return True


# Grouped (image channels 4, filter channels 2): only where the kernels take it.
_GROUPED = _grouped_conv_gradients_run()
row("Conv2DBackpropFilter",
    [V([I(2, 4, 4, 4), I(2, 4, 4, 8)], ([3, 3, 4, 8], 1, "SAME", "NHWC")),
     V([I(4, 4, 4, 2), I(4, 2, 2, 4)], ([2, 2, 2, 4], 2, "VALID", "NHWC"))] +
    [V([I(2, 4, 4, 4), I(2, 4, 4, 4)], ([1, 1, 2, 4], 1, "SAME", "NHWC"))] * _GROUPED +
    [V([I(2, 4, 4, 4), I(2, 4, 4, 8)], ([3, 3, 4, 8], 1, "SAME", "NHWC"),
       ns={0: _SPATIAL, 1: _SPATIAL})],
    _conv("Conv2DBackpropFilter"), multi=True)
row("Conv2DBackpropInput",
    [V([I(3, 3, 4, 8), I(2, 4, 4, 8)], ([2, 4, 4, 4], 1, "SAME", "NHWC")),
     V([I(2, 2, 2, 4), I(4, 2, 2, 4)], ([4, 4, 4, 2], 2, "VALID", "NHWC"))] +
    [V([I(1, 1, 2, 4), I(2, 4, 4, 4)], ([2, 4, 4, 4], 1, "SAME", "NHWC"))] * _GROUPED +
    [V([I(3, 3, 4, 8), I(2, 4, 4, 8)], ([2, 4, 4, 4], 1, "SAME", "NHWC"),
       ns={0: (2, 3), 1: _SPATIAL})],
    _conv("Conv2DBackpropInput"))

# Gathers and segment sums.
# Variants are (axis, batch_dims): with batch_dims, params and indices are
# split alike along their leading dimensions.
row("GatherV2", [V([I(8, 4), I(4, kind="idx:8")], (0, 0)),
                 V([I(4, 8), I(4, kind="idx:8")], (1, 0)),
                 V([I(8, 4), I(2, 2, kind="idx:8")], (0, 0)),
                 V([I(2, 8, 4), I(4, kind="idx:8")], (1, 0)),
                 V([I(4, 8), I(4, 2, kind="idx:8")], (1, 1)),
                 V([I(4, 8, 2), I(4, 2, kind="idx:8")], (1, -1)),
                 V([I(2, 4, 8), I(2, 4, 2, kind="idx:8")], (2, 2)),
                 V([I(4, 2, 8), I(4, 2, kind="idx:8")], (2, 1))],
    lambda p, x, i: tf.gather(x, i, axis=p[0], batch_dims=p[1]), multi=True)
row("ResourceGather", [V([I(8, 4, kind="var"), I(4, kind="idx:8")]),
                       V([I(8, 4, kind="var"), I(2, 2, kind="idx:8")])],
    lambda p, v, i: tf.gather(v, i) * 1.0, no_split={0: (0,)}, multi=True)
row("UnsortedSegmentSum", [V([I(4, 8), I(4, kind="idx:3")], 3),
                           V([I(4, 2, 4), I(4, 2, kind="idx:4")], 4),
                           V([I(4, 8), I(4, 8, kind="idx:2")], 2)],
    lambda p, x, i: tf.math.unsorted_segment_sum(x, i, p), multi=True)
# Other segment reductions: the ids' dimensions are gathered, the rest stays
# split. Sorted segment ids (kind sorted:N) number the output rows.
_USEG = [V([I(4, 8), I(4, kind="idx:3")], 3), V([I(4, 2, 4), I(4, 2, kind="idx:4")], 4)]
for _op in ("UnsortedSegmentMax", "UnsortedSegmentMin", "UnsortedSegmentProd"):
  row(_op, _USEG, lambda p, x, i, _op=_op: getattr(R, _op)(
      data=x, segment_ids=i, num_segments=p))
for _op in ("SegmentSum", "SegmentMean", "SegmentMax", "SegmentMin", "SegmentProd"):
  row(_op, [V([I(4, 8), I(4, kind="sorted:3")]), V([I(8, 2, 4), I(8, kind="sorted:4")])],
      lambda p, x, i, _op=_op: getattr(R, _op)(data=x, segment_ids=i),
      multi=_op == "SegmentSum")


# Variables.
row("ReadVariableOp", [V([I(4, 8, kind="var")]), V([I(2, 4, 8, kind="var")])],
    lambda p, v: v.read_value(), multi=True)
for _op, _m in (("AssignVariableOp", "assign"), ("AssignAddVariableOp", "assign_add"),
                ("AssignSubVariableOp", "assign_sub")):
  row(_op, [V([I(4, 8, kind="var"), I(4, 8)]), V([I(2, 4, 8, kind="var"), I(2, 4, 8)])],
      lambda p, v, x, _m=_m: _assign(v, _m, x),
      writes=True, multi=_op == "AssignVariableOp")


def _assign(v, method, x):
  getattr(v, method)(x, read_value=False)
  return v.read_value()


# Fused optimizer updates: (slot count, scalar hyper-parameters).
_APPLY = {
    "ResourceApplyGradientDescent": (0, dict(alpha=0.1)),
    "ResourceApplyMomentum": (1, dict(lr=0.1, momentum=0.9)),
    "ResourceApplyKerasMomentum": (1, dict(lr=0.1, momentum=0.9)),
    "ResourceApplyAdagrad": (1, dict(lr=0.1)),
    "ResourceApplyAdagradV2": (1, dict(lr=0.1, epsilon=1e-7)),
    "ResourceApplyAdam": (2, dict(beta1_power=0.9, beta2_power=0.999, lr=0.1, beta1=0.9,
                                  beta2=0.999, epsilon=1e-7)),
    "ResourceApplyAdamWithAmsgrad": (3, dict(beta1_power=0.9, beta2_power=0.999, lr=0.1,
                                             beta1=0.9, beta2=0.999, epsilon=1e-7)),
    "ResourceApplyAdaMax": (2, dict(beta1_power=0.9, lr=0.1, beta1=0.9, beta2=0.999,
                                    epsilon=1e-7)),
    "ResourceApplyRMSProp": (2, dict(lr=0.1, rho=0.9, momentum=0.5, epsilon=1e-7)),
}


def _apply_body(op):
  nslots, hyper = _APPLY[op]
  op_def = op_def_registry.get(op)
  handles = [a.name for a in op_def.input_arg if a.type == tf.resource.as_datatype_enum]

  def body(p, *xs):
    variables, grad = xs[:-1], xs[-1]
    kwargs = {n: v.handle for n, v in zip(handles, variables)}
    kwargs.update({k: tf.constant(val, tf.float32) for k, val in hyper.items()})
    kwargs["grad" if "grad" in [a.name for a in op_def.input_arg] else "delta"] = grad
    getattr(R, op)(**kwargs)
    # Reading every variable also makes the function know the slots as variables.
    return [v.read_value() for v in variables]
  return body


for _op, (_n, _) in _APPLY.items():
  _var = [I(4, 8, kind="var")] + [I(4, 8, kind="var_pos")] * _n
  _var3 = [I(2, 4, 8, kind="var")] + [I(2, 4, 8, kind="var_pos")] * _n
  row(_op, [V(_var + [I(4, 8)]), V(_var3 + [I(2, 4, 8)]), V([I(8, kind="var")] +
                                                            [I(8, kind="var_pos")] * _n +
                                                            [I(8)])],
      _apply_body(_op), ties={k: 0 for k in range(1, _n + 1)}, writes=True,
      multi=_op in ("ResourceApplyAdam", "ResourceApplyMomentum"))

TABLE: Dict[str, Row] = {r.op: r for r in ROWS}
assert len(TABLE) == len(ROWS), "duplicate rows"
# Collection-time check: the table covers exactly the registered rules.
assert set(TABLE) == set(RULES), (
    f"rules without a row: {sorted(set(RULES) - set(TABLE))}; "
    f"rows without a rule: {sorted(set(TABLE) - set(RULES))}")
for _r in ROWS:
  if _r.skip and "no OpDef" in _r.skip:
    assert op_def_registry.get(_r.op) is None, f"{_r.op} is a TF op now: give it a row"
RUN = [r for r in ROWS if r.skip is None]


# --- the harness --------------------------------------------------------------

def _values(rng, spec):
  shape, kind = spec.shape, spec.kind
  if kind in ("any", "var"):
    return (rng.integers(-8, 9, shape) / 4).astype(np.float32)
  if kind in ("pos", "var_pos"):
    return (rng.integers(2, 9, shape) / 4).astype(np.float32)
  if kind == "distinct":
    n = int(np.prod(shape))
    return ((rng.permutation(n) - n // 2) / 4).reshape(shape).astype(np.float32)
  if kind == "int":
    return rng.integers(-20, 21, shape).astype(np.int32)
  if kind == "ipos":
    return rng.integers(1, 6, shape).astype(np.int32)
  if kind == "bool":
    return rng.random(shape) < 0.5
  if kind.startswith("idx:"):
    return rng.integers(0, int(kind[4:]), shape).astype(np.int32)
  if kind.startswith("sorted:"):   # every id in [0, N) at least once, ascending
    n = int(kind[7:])
    return np.sort(np.concatenate([np.arange(n), rng.integers(0, n, shape[0] - n)])
                   ).astype(np.int32)
  raise ValueError(kind)


@dataclasses.dataclass
class _Var:
  var: tf.Variable
  name: str
  init: np.ndarray
  role: str                    # plain / a / b (partial: a @ b, b's dim 0 contracted)
  group: Tuple[int, int]       # (copy, input)


class Built(object):
  """A row's tf.function over its copies, built once."""

  def __init__(self, r):
    self.row = r
    rng = np.random.default_rng(zlib.crc32(r.op.encode()))
    self.vars: List[_Var] = []
    self.copies = [(v, ()) for v in r.variants]   # (variant, partial inputs)

    def summable(v):   # inputs that may come from a split contraction
      return [i for i, x in enumerate(v.ins)
              if x.floating or (x.kind == "int" and r.op in _INT_PARTIAL)]
    if r.partial:
      # Partial copies: all summable inputs of variant 0, the first one of
      # variant 1, and the first input of every integer variant.
      plan = [(r.variants[0], "all"), (r.variants[1 % len(r.variants)], "first")]
      plan += [(v, "int") for v in r.variants if v.ins and v.ins[0].kind == "int"]
      for v, which in plan:
        idx = summable(v)
        if which == "int":
          idx = idx[:1]
        if which == "first":
          if len(idx) < 2:
            continue   # the same as "all"
          idx = idx[:1]
        if idx:
          self.copies.append((v, tuple(idx)))
    self.inputs = []
    for c, (v, part) in enumerate(self.copies):
      per = []
      for i, spec in enumerate(v.ins):
        base = f"rule_{r.op}_c{c}_x{i}"
        if i in part:
          rows = int(np.prod(spec.shape[:-1])) if spec.shape else 1
          cols = spec.shape[-1] if spec.shape else 1
          kind = "int" if spec.kind == "int" else ("pos" if spec.kind == "pos" else "any")
          a = _values(rng, In((rows, CONTRACT), kind))
          b = _values(rng, In((CONTRACT, cols), kind))
          if kind == "int":
            a, b = a % 4, b % 4
          per.append([self._var(base + "_a", a, "a", (c, i)),
                      self._var(base + "_b", b, "b", (c, i))])
        else:
          per.append([self._var(base, _values(rng, spec), "plain", (c, i))])
      self.inputs.append(per)

    def fn():
      outs = []
      for (v, part), per in zip(self.copies, self.inputs):
        xs = []
        for i, (spec, vs) in enumerate(zip(v.ins, per)):
          if spec.kind.startswith("var"):
            xs.append(vs[0].var)
          elif i in part:
            prod = tf.matmul(vs[0].var, vs[1].var)
            xs.append(tf.reshape(prod, spec.shape))
          else:
            xs.append(tf.identity(vs[0].var.read_value()))
        out = r.body(v.p, *xs)
        for t in (out if isinstance(out, (list, tuple)) else [out]):
          outs.append(tf.cast(t, tf.int32) if t.dtype == tf.bool else t)
      return outs
    self.fn = tf.function(fn, autograph=False)

  def _var(self, name, value, role, group):
    v = _Var(tf.Variable(value, name=name), name, value, role, group)
    self.vars.append(v)
    return v

  def reset(self):
    for v in self.vars:
      v.var.assign(v.init)

  def annotations(self, mesh, seed):
    """{variable name: dims}: each dim split over a random unused axis that
    divides it, or replicated; partial inputs contract a split dimension."""
    axes = dict((a.split("=")[0], int(a.split("=")[1])) for a in mesh.split(","))
    rng = np.random.default_rng(zlib.crc32(f"{self.row.op}/{mesh}/{seed}".encode()))
    out = {}
    by_group = {}
    for v in self.vars:
      by_group.setdefault(v.group, []).append(v)

    def pick(size, used):
      choices = [None] + [a for a, n in axes.items() if a not in used and size % n == 0]
      weights = np.array([1.0] + [2.0] * (len(choices) - 1))
      return choices[rng.choice(len(choices), p=weights / weights.sum())]

    for (c, i), vs in sorted(by_group.items()):
      if vs[0].role == "plain":
        used, dims = set(), []
        for d, size in enumerate(vs[0].init.shape):
          ns = self.row.no_split.get(i, ()) + self.copies[c][0].ns.get(i, ())
          a = None if d in ns else pick(size, used)
          used.add(a)
          dims.append(a)
        out[vs[0].name] = tuple(dims)
      else:
        a_var, b_var = vs
        contract = list(axes)[rng.integers(len(axes))]
        rows, cols = a_var.init.shape[0], b_var.init.shape[1]
        out[a_var.name] = (pick(rows, {contract}), contract)
        out[b_var.name] = (contract, pick(cols, {contract}))
    for c, (v, part) in enumerate(self.copies):
      for i, j in {**self.row.ties, **v.ties}.items():
        if i not in part and j not in part:
          out[f"rule_{self.row.op}_c{c}_x{i}"] = out[f"rule_{self.row.op}_c{c}_x{j}"]
    return {k: tuple(d) for k, d in out.items()}


_INT_PARTIAL = {"Mul", "RealDiv", "Div", "TruncateDiv", "FloorDiv", "FloorMod", "Mod",
                "Sum", "Mean", "Cast", "ZerosLike", "OnesLike"}
_BUILT = {}
# Fallbacks met so far: {row op: {(op, reason)}} (for debugging a run).
SEEN_FALLBACKS = collections.defaultdict(set)


def built(r):
  if r.op not in _BUILT:
    _BUILT[r.op] = Built(r)
  return _BUILT[r.op]


def _close(got, want, what):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
  assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
  if want.dtype.kind in "fc":
    scale = max(float(np.max(np.abs(want))) if want.size else 0.0, 1e-6)
    err = float(np.max(np.abs(got.astype(np.float64) - want))) if want.size else 0.0
    tol = 1e-5 if want.dtype != np.float16 else 1e-3
    assert err <= tol * scale, f"{what}: max error {err:.3e} vs scale {scale:.3e}"
  else:
    np.testing.assert_array_equal(got, want, err_msg=what)


def check(r, mesh, seed):
  """Splits row `r`'s function with seeded annotations over `mesh`, compares
  outputs (and written variables); returns the SplitFunction."""
  b = built(r)
  ann = b.annotations(mesh, seed)
  b.reset()
  try:
    step = tfsplit.split(b.fn, mesh=mesh, strategy="none", annotations=ann,
                         timeout_seconds=TIMEOUT)
    got = step()
    got = list(got) if isinstance(got, (list, tuple)) else [got]
    want = b.fn()
    assert len(got) == len(want)
    where = f"{r.op} on {mesh}, seed {seed}, annotations {ann}"
    for k, (g, w) in enumerate(zip(got, want)):
      _close(g.numpy(), w.numpy(), f"{where}: output {k}")
    if r.writes:
      full = step.full_values()
      for v in b.vars:
        _close(full[v.name], v.var.numpy(), f"{where}: variable {v.name}")
    ops = {n.op for n in step.graph_def.node}
    if r.absent is None:
      assert r.op in ops, f"{r.op} not in the split graph ({sorted(ops)})"
    for msg in step.result.fallbacks:
      assert "internal error" not in msg, f"{where}: {msg}"
      op = re.search(r"\(op (\w+)\)", msg).group(1)
      assert op in r.fallbacks and r.fallbacks[op] in msg, (
          f"{where}: undocumented fallback: {msg}")
      SEEN_FALLBACKS[r.op].add((op, msg.split(": ", 1)[1].split(";")[0]))
    return step
  finally:
    b.reset()


@pytest.mark.parametrize("r", RUN, ids=[r.op for r in RUN])
def test_rule(r):
  check(r, MESH, seed=0)


# Each multi row runs on one of the bigger meshes (alternating); the slow
# sweep runs every row on all of them.
MULTI = [(r, MULTI_MESHES[k % 2]) for k, r in enumerate(x for x in RUN if x.multi)]


@pytest.mark.parametrize("r,mesh", MULTI, ids=[f"{r.op}-{m}" for r, m in MULTI])
def test_rule_multi_axis(r, mesh):
  check(r, mesh, seed=1)


SWEEP = [(r, m) for r in RUN for m in (MESH,) + MULTI_MESHES]


@pytest.mark.slow
@pytest.mark.parametrize("r,mesh", SWEEP, ids=[f"{r.op}-{m}" for r, m in SWEEP])
def test_rule_sweep(r, mesh):
  for seed in range(2, 8):
    check(r, mesh, seed)


def test_resource_gather_refuses_vocab_split():
  """A gather from a table split along its vocabulary is refused, not wrong."""
  b = built(TABLE["ResourceGather"])
  ann = b.annotations(MESH, 0)
  ann["rule_ResourceGather_c0_x0"] = ("tp", None)
  with pytest.raises(PlanError, match="vocabulary"):
    tfsplit.split(b.fn, mesh=MESH, strategy="none", annotations=ann,
                  timeout_seconds=TIMEOUT)


def test_bool_tensors_are_gathered_as_integers():
  """Collectives have no bool kernel: a split bool tensor is gathered as int32."""
  mask = tf.Variable(np.arange(32).reshape(4, 8) % 3 > 0, name="rule_bool_mask")

  @tf.function
  def f():
    return tf.cast(tf.reshape(tf.logical_not(mask), [32]), tf.int32)
  step = tfsplit.split(f, mesh=MESH, strategy="none",
                       annotations={"rule_bool_mask": (None, "tp")}, timeout_seconds=TIMEOUT)
  np.testing.assert_array_equal(step().numpy(), f().numpy())
  assert any(n.op == "CollectiveGatherV2" and n.attr["T"].type == tf.int32.as_datatype_enum
             for n in step.graph_def.node)


# --- the harness checks itself ----------------------------------------------

def _broken_rules():
  """{op: a wrong rule}: each claims a sharding its op does not produce."""
  from tfsplit.rules.base import Decision  # pylint: disable=import-outside-toplevel
  from tfsplit.layout.spec import Sharding  # pylint: disable=import-outside-toplevel
  good = dict(RULES)

  def softmax_keeps_split(ctx):           # normalises each block on its own
    s = ctx.in_specs[0].without_partial()
    return Decision([s], [s])

  def sum_forgets_partial(ctx):           # a sum over a split dim is not complete
    d = good["Sum"](ctx)
    d.outputs = [o.without_partial() for o in d.outputs]
    return d

  def transpose_unpermuted(ctx):          # the split stays on the input's dims
    d = good["Transpose"](ctx)
    d.outputs = [Sharding(ctx.in_specs[0].dims, ctx.in_specs[0].partial)]
    return d

  def bias_add_grad_no_partial(ctx):      # summing over split rows is not partial
    spec = ctx.in_specs[0]
    return Decision([spec], [Sharding((spec.dims[-1],), spec.partial)])
  return {"Softmax": softmax_keeps_split, "Sum": sum_forgets_partial,
          "Transpose": transpose_unpermuted, "BiasAddGrad": bias_add_grad_no_partial}


def self_check():
  """Runs each row with a broken rule; returns the ops whose break went unseen.

  Run in its own process: a broken rule can leave TF's collective executor
  aborted, and the same plan split with another rule reuses collective keys."""
  missed = []
  for op, bad in _broken_rules().items():
    good = RULES[op]
    RULES[op] = bad
    try:
      check(TABLE[op], MESH, seed=0)
      missed.append(op)
    except Exception:  # pylint: disable=broad-except
      pass
    finally:
      RULES[op] = good
  return missed


@pytest.mark.slow
def test_harness_catches_broken_rules():
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  here = os.path.dirname(os.path.abspath(__file__))
  proc = subprocess.run([sys.executable, os.path.join(here, "test_rules.py")],
                        capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert "caught: BiasAddGrad, Softmax, Sum, Transpose" in proc.stdout


if __name__ == "__main__":
  # python tests/test_rules.py: the harness self-check (see self_check).
  import sys as _sys
  _sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
  import conftest  # noqa: F401  pylint: disable=unused-import,wrong-import-position
  _missed = self_check()
  print("caught:", ", ".join(sorted(set(_broken_rules()) - set(_missed))))
  _sys.exit(1 if _missed else 0)
