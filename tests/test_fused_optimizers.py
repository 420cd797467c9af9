"""Training steps with fused optimizer ops (ResourceApplyAdam, ...), split.

A 2-layer MLP in raw TF (tf.Variables, tf.GradientTape, softmax
cross-entropy) updated by one fused `tf.raw_ops.ResourceApply*` op per
variable, with the optimizer slots created here as tf.Variables. Every op
registered in tfsplit/rules/variables.py gets a case. Each case splits the
step, runs 3 steps of the split and of the original from the same starting
values (3 different batches), and compares:

- the loss of every step (relative to the loss),
- every variable (model, slots, beta powers) at the end, relative to its
  own scale, on every device's shard (replicas included),
- every variable's update (after - before), per variable against its largest
  update and per shard against that shard's largest update: a 10% error in
  one shard's update fails (checked by test_update_check_catches_*).

Layouts: tp=2 and dp=2,tp=2 with annotations (w1 column-, w2 row-parallel,
b1 like w1's columns, every slot like its variable), dp=2 (all replicated),
and tp=2 with the megatron strategy and no annotations at all.
"""
import dataclasses
from typing import Dict, Tuple

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

import tfsplit
from tfsplit.errors import PlanError
from tfsplit.rules.base import RULES

TIMEOUT = 60
STEPS = 3
BATCH, D_IN, HIDDEN, CLASSES = 8, 8, 16, 4
LR = 0.05
LOSS_RTOL = 1e-5
VALUE_RTOL = 1e-4
# Updates against the largest update. Adam-like ops divide by sqrt(v) + eps,
# which amplifies the summation-order noise of small gradients (seen here: at
# most 3e-6 of the largest update); 0.1% still catches a 10% error in any
# one shard with a wide margin.
UPDATE_RTOL = 1e-3


@dataclasses.dataclass
class Opt:
  op: str
  slots: Dict[str, float]              # slot input name -> initial value
  hyper: Dict[str, float]              # scalar inputs (lr / alpha comes from the lr variable)
  powers: Tuple[str, ...] = ()         # beta powers: scalar variables decayed each step


OPTIMIZERS = {
    "sgd": Opt("ResourceApplyGradientDescent", {}, {}),
    "momentum": Opt("ResourceApplyMomentum", {"accum": 0.0}, {"momentum": 0.9}),
    "keras_momentum": Opt("ResourceApplyKerasMomentum", {"accum": 0.0}, {"momentum": 0.9}),
    "adagrad": Opt("ResourceApplyAdagrad", {"accum": 0.1}, {}),
    "adagrad_v2": Opt("ResourceApplyAdagradV2", {"accum": 0.1}, {"epsilon": 1e-7}),
    "rmsprop": Opt("ResourceApplyRMSProp", {"ms": 0.1, "mom": 0.0},
                   {"rho": 0.9, "momentum": 0.5, "epsilon": 1e-7}),
    "adam": Opt("ResourceApplyAdam", {"m": 0.0, "v": 0.0},
                {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7},
                ("beta1_power", "beta2_power")),
    "amsgrad": Opt("ResourceApplyAdamWithAmsgrad", {"m": 0.0, "v": 0.0, "vhat": 0.0},
                   {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7},
                   ("beta1_power", "beta2_power")),
    "adamax": Opt("ResourceApplyAdaMax", {"m": 0.0, "v": 0.0},
                  {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7}, ("beta1_power",)),
}
# Every fused update op with a split rule has a case.
assert {o.op for o in OPTIMIZERS.values()} == {
    op for op in RULES if op.startswith("ResourceApply")}

# (mesh, strategy, dims per model variable; the slots get their variable's dims).
TP = {"w1": (None, "tp"), "b1": ("tp",), "w2": ("tp", None), "b2": (None,)}
LAYOUTS = {
    "tp2": ("tp=2", "none", TP),
    "dp2": ("dp=2", "none", {}),
    "dp2tp2": ("dp=2,tp=2", "none", TP),
    # Nothing annotated: megatron picks the kernels w1 / w2, b1 is inferred
    # from its BiasAdd, and the slots follow their variables.
    "tp2-megatron": ("tp=2", "megatron", TP),
}


class Model(object):
  """MLP variables, their slots for one optimizer, and the fused train step."""

  def __init__(self, name, seed=0):
    self.opt = opt = OPTIMIZERS[name]
    rng = np.random.default_rng(seed)
    shapes = {"w1": (D_IN, HIDDEN), "b1": (HIDDEN,), "w2": (HIDDEN, CLASSES),
              "b2": (CLASSES,)}
    self.params = {n: tf.Variable((rng.standard_normal(s) * 0.5).astype(np.float32),
                                  name=f"{name}_{n}") for n, s in shapes.items()}
    self.slots = {n: {s: tf.Variable(np.full(shapes[n], init, np.float32),
                                     name=f"{name}_{n}/{s}")
                      for s, init in opt.slots.items()} for n in shapes}
    self.lr = tf.Variable(LR, name=f"{name}_lr")
    self.powers = {p: tf.Variable(opt.hyper["beta1" if "1" in p else "beta2"],
                                  name=f"{name}_{p}") for p in opt.powers}
    self.prefix = name
    op_def = op_def_registry.get(opt.op)
    self.arg_names = [a.name for a in op_def.input_arg]
    self.start = {k: v.numpy().copy() for k, v in self.all_variables().items()}
    data = np.random.default_rng(seed + 1)
    self.batches = [(data.standard_normal((BATCH, D_IN)).astype(np.float32),
                     data.integers(0, CLASSES, BATCH).astype(np.int32))
                    for _ in range(STEPS)]
    self.step = tf.function(self._step, autograph=False)
    self.signature = [tf.TensorSpec([BATCH, D_IN]), tf.TensorSpec([BATCH], tf.int32)]

  def all_variables(self):
    out = {}
    for n, p in self.params.items():
      out[f"{self.prefix}_{n}"] = p
      for s, v in self.slots[n].items():
        out[f"{self.prefix}_{n}/{s}"] = v
    out[f"{self.prefix}_lr"] = self.lr
    for p, v in self.powers.items():
      out[f"{self.prefix}_{p}"] = v
    return out

  def _step(self, x, y):
    p = self.params
    with tf.GradientTape() as tape:
      h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, p["w1"]), p["b1"]))
      logits = tf.nn.bias_add(tf.matmul(h, p["w2"]), p["b2"])
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
    grads = tape.gradient(loss, list(p.values()))
    graph = tf.compat.v1.get_default_graph()
    lr = self.lr.read_value()
    powers = {k: v.read_value() for k, v in self.powers.items()}
    for (n, var), grad in zip(p.items(), grads):
      kwargs = {"var": var.handle}
      for s, slot in self.slots[n].items():
        # The fused op takes only handles: tell the function these are
        # variables (tfsplit binds captured variables by name).
        graph.watch_variable(slot)
        kwargs[s] = slot.handle
      kwargs.update({k: tf.constant(v, tf.float32) for k, v in self.opt.hyper.items()
                     if k in self.arg_names})
      kwargs.update(powers)
      kwargs["alpha" if "alpha" in self.arg_names else "lr"] = lr
      kwargs["delta" if "delta" in self.arg_names else "grad"] = grad
      getattr(tf.raw_ops, self.opt.op)(**kwargs)
    for k, v in self.powers.items():
      v.assign(powers[k] * self.opt.hyper["beta1" if "1" in k else "beta2"])
    return loss

  def restore(self):
    for k, v in self.all_variables().items():
      v.assign(self.start[k])

  def annotations(self, dims_by_param):
    out = {}
    for n, dims in dims_by_param.items():
      out[f"{self.prefix}_{n}"] = dims
      for s in self.slots[n]:
        out[f"{self.prefix}_{n}/{s}"] = dims
    return out


_MODELS = {}


def model(name):
  if name not in _MODELS:
    _MODELS[name] = Model(name)
  return _MODELS[name]


@dataclasses.dataclass
class Run:
  losses: list
  after: Dict[str, np.ndarray]          # full values
  shards: Dict[str, list]               # variable -> [(device, offsets, value)]


def run_split(m, layout):
  mesh, strategy, dims = LAYOUTS[layout]
  m.restore()
  try:
    step = tfsplit.split(m.step, mesh=mesh, strategy=strategy,
                         input_signature=m.signature, timeout_seconds=TIMEOUT,
                         annotations=None if strategy == "megatron" else m.annotations(dims))
    if strategy == "megatron":   # the plan it found is the one annotated elsewhere
      want = {f"{m.prefix}_{n}": d for n, d in dims.items() if any(d)}
      assert step.result.variable_specs == {**want, **{
          f"{m.prefix}_{n}/{s}": d for n, d in dims.items() if any(d) for s in m.slots[n]}}
    assert not step.result.fallbacks, step.result.fallbacks
    assert any(n.op == m.opt.op for n in step.graph_def.node)
    losses = [float(step(tf.constant(x), tf.constant(y))) for x, y in m.batches]
    shard_values = {k: v.numpy() for k, v in step.variables.items()}
    shards = {name: [(s["device"], tuple(s["offsets"]), shard_values[s["name"]])
                     for s in entry["shards"]] for name, entry in step.manifest.items()}
    return Run(losses, step.full_values(), shards)
  finally:
    m.restore()


def run_reference(m, lr_factor=1.0):
  m.restore()
  try:
    m.lr.assign(LR * lr_factor)
    losses = [float(m.step(tf.constant(x), tf.constant(y))) for x, y in m.batches]
    return Run(losses, {k: v.numpy().copy() for k, v in m.all_variables().items()}, {})
  finally:
    m.restore()


def _slices(offsets, shape):
  return tuple(slice(o, o + s) for o, s in zip(offsets, shape))


def compare(m, got, want):
  """Asserts `got` (a split run) matches `want` (the reference); see module doc."""
  for k, (g, w) in enumerate(zip(got.losses, want.losses)):
    assert abs(g - w) <= LOSS_RTOL * max(abs(w), 1e-6), f"loss of step {k}: {g} vs {w}"
  assert set(got.after) == set(want.after), (sorted(got.after), sorted(want.after))
  for name, w in want.after.items():
    start = m.start[name]
    g = got.after[name]
    assert g.shape == w.shape, f"{name}: shape {g.shape} vs {w.shape}"
    scale = max(np.max(np.abs(w)), 1e-6)
    err = np.max(np.abs(g - w))
    assert err <= VALUE_RTOL * scale, f"{name}: value error {err:.3e}, scale {scale:.3e}"
    want_update = w - start
    largest = np.max(np.abs(want_update))
    err = np.max(np.abs((g - start) - want_update))
    assert err <= UPDATE_RTOL * max(largest, 1e-12), (
        f"{name}: update error {err:.3e} vs largest update {largest:.3e}")
    # Every device's copy, each against its own largest update.
    for device, offsets, value in got.shards.get(name, ()):
      sl = _slices(offsets, value.shape)
      wu = want_update[sl]
      err = np.max(np.abs((value - start[sl]) - wu)) if wu.size else 0.0
      largest = np.max(np.abs(wu)) if wu.size else 0.0
      assert err <= UPDATE_RTOL * max(largest, 1e-12), (
          f"{name} on {device} (offsets {offsets}): update error {err:.3e} vs "
          f"largest update {largest:.3e}")


CASES = [(o, lay) for o in OPTIMIZERS for lay in ("tp2", "dp2tp2")] + [
    (o, lay) for o in ("sgd", "momentum", "adam") for lay in ("dp2", "tp2-megatron")]


@pytest.mark.parametrize("opt,layout", CASES, ids=[f"{o}-{l}" for o, l in CASES])
def test_fused_optimizer_training(opt, layout):
  m = model(opt)
  compare(m, run_split(m, layout), run_reference(m))


def test_check_catches_lr_times_1_1():
  """A reference trained with 1.1 x the learning rate must not pass."""
  m = model("adam")
  got = run_split(m, "tp2")
  compare(m, got, run_reference(m))
  bad = run_reference(m, lr_factor=1.1)
  with pytest.raises(AssertionError, match="loss of step 1"):
    compare(m, got, bad)
  # Without the losses, the variables alone give it away.
  with pytest.raises(AssertionError, match="value error|update error"):
    compare(m, Run(bad.losses, got.after, got.shards), bad)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_update_check_catches_one_wrong_shard(opt):
  """10% more update on any one shard of any variable is caught."""
  m = model(opt)
  got = run_split(m, "dp2tp2")
  compare(m, got, run_reference(m))
  want = run_reference(m)
  tried = 0
  for name, shards in got.shards.items():
    for k, (device, offsets, value) in enumerate(shards):
      start = m.start[name][_slices(offsets, value.shape)]
      if not np.any(value != start):
        continue   # nothing to scale (e.g. the lr)
      bad = dict(got.shards)
      bad[name] = list(shards)
      bad[name][k] = (device, offsets, start + 1.1 * (value - start))
      with pytest.raises(AssertionError, match="update error"):
        compare(m, Run(got.losses, got.after, bad), want)
      tried += 1
  assert tried >= 8


def test_slots_sharded_unlike_their_variable_are_refused():
  m = model("momentum")
  ann = m.annotations(TP)
  ann[f"{m.prefix}_w1/accum"] = ("tp", None)
  with pytest.raises(PlanError, match="sharded differently"):
    tfsplit.split(m.step, mesh="tp=2", strategy="none", input_signature=m.signature,
                  annotations=ann, timeout_seconds=TIMEOUT)
