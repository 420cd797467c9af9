"""Helpers shared by the tests that train split graphs against the original."""
import numpy as np
import tensorflow as tf

import tfsplit
from tfsplit import models

# Collectives fail after this long instead of hanging a test run.
TIMEOUT = 60.0
_CACHE = {}


def example(name, size="tiny", batch_size=None):
  """One built example per (name, size, batch) for the whole test session."""
  key = (name, size, batch_size)
  if key not in _CACHE:
    _CACHE[key] = models.build(name, size=size, seed=0, batch_size=batch_size)
  return _CACHE[key]


def names(ex):
  """[(variable, unique name)] for load_graph / tfsplit.split."""
  return list(zip(ex.all_variables(), ex.variable_names()))


def close(got, want, what):
  """Relative error against the tensor's scale (at least 1: Adam moves every
  weight by about the learning rate, whatever its size)."""
  got, want = np.asarray(got), np.asarray(want)
  err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1.0) if want.size else 0
  assert err <= 1e-4, f"{what}: relative error {err:.2e}"


def check_training(ex, steps=3, seed=11, **split_kwargs):
  """Splits ex.train_step, runs `steps` steps of both, compares the losses and
  every variable; restores the example's variables; returns the split step."""
  variables = ex.all_variables()
  start = [v.numpy().copy() for v in variables]
  try:
    step = tfsplit.split(ex.train_step, input_signature=ex.train_signature,
                         variable_names=names(ex), timeout_seconds=TIMEOUT, **split_kwargs)
    inputs = [tf.constant(x) for x in ex.make_inputs("train", seed=seed)]
    got = [float(step(*inputs)) for _ in range(steps)]
    want = [float(ex.train_step(*inputs)) for _ in range(steps)]
    for g, w in zip(got, want):
      close(g, w, "loss")
    full = step.full_values()
    for v, n in names(ex):
      close(full[n], v.numpy(), n)
    return step
  finally:
    for v, s in zip(variables, start):
      v.assign(s)
