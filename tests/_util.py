"""Helpers shared by the tests that train split graphs against the original."""
import numpy as np
import tensorflow as tf

import tfsplit
from tfsplit.runtime import compare
from tfsplit.runtime.verify import batch_size_of, reverse_batch

import models  # examples/models (see conftest.py)

# Collectives fail after this long instead of hanging a test run.
TIMEOUT = 60.0
_CACHE = {}


def example(name, size="tiny", batch_size=None, **config):
  """One built example per (name, size, batch, config) for the whole test session."""
  key = (name, size, batch_size, tuple(sorted(config.items())))
  if key not in _CACHE:
    _CACHE[key] = models.build(name, size=size, seed=0, batch_size=batch_size, **config)
  return _CACHE[key]


def names(ex):
  """[(variable, unique name)] for load_graph / tfsplit.split."""
  return list(zip(ex.all_variables(), ex.variable_names()))


def close(got, want, what, rtol=compare.DEFAULT_RTOL):
  """got == want (same shape) within rtol of want's own scale."""
  c = compare.compare("value", what, got, want, rtol)
  assert c.ok, (f"{what}: error {c.max_abs:.3e} > tolerance {c.tolerance:.3e} "
                f"(scale {c.scale:.3e}) {c.note}")


def _train(ex, inputs, steps):
  """[loss per step], {name: value after} of the example's own step."""
  losses = [np.asarray(ex.train_step(*[tf.constant(x) for x in inputs])) for _ in range(steps)]
  return losses, {n: v.numpy().copy() for v, n in names(ex)}


def reference_run(ex, inputs, steps):
  """The original step run twice from the same start, on the batch and on
  the batch reversed: (start, (losses, values), (losses, values) reversed).
  The example's variables are left at their start values."""
  variables = ex.all_variables()
  start_values = [v.numpy().copy() for v in variables]
  start = {n: v.numpy().copy() for v, n in names(ex)}
  try:
    want = _train(ex, inputs, steps)
    for v, s in zip(variables, start_values):
      v.assign(s)
    alt = _train(ex, reverse_batch(inputs, batch_size_of(inputs)), steps)
  finally:
    for v, s in zip(variables, start_values):
      v.assign(s)
  return start, want, alt


def training_report(step, ex, inputs, steps, rtol=compare.DEFAULT_RTOL,
                    update_rtol=compare.DEFAULT_UPDATE_RTOL):
  """compare.Report of `steps` steps of split step `step` against the example:
  losses, every shard of every variable, and every update."""
  start, (want_losses, want), (alt_losses, alt) = reference_run(ex, inputs, steps)
  use_noise = compare.typical_noise_is_small(
      [(want[k], alt[k]) for k in want] + list(zip(want_losses, alt_losses)))
  if not use_noise:
    alt_losses, alt = [None] * steps, None
  got_losses = [np.asarray(step(*[tf.constant(x) for x in inputs])) for _ in range(steps)]
  comparisons = [compare.compare("output", f"step {i + 1} loss", g, w, rtol,
                                 compare.noise(w, a))
                 for i, (g, w, a) in enumerate(zip(got_losses, want_losses, alt_losses))]
  comparisons += compare.compare_variables(step.manifest, start, want, step.shard_values(),
                                           alt, rtol, update_rtol)
  return compare.Report(comparisons, rtol, use_noise, update_rtol), (start, want, alt)


def check_training(ex, steps=3, seed=11, **split_kwargs):
  """Splits ex.train_step, runs `steps` steps of both and compares the losses,
  every copy of every variable and every update; checks assign_back; leaves
  the example's variables as they were; returns the split step."""
  variables = ex.all_variables()
  start = [v.numpy().copy() for v in variables]
  try:
    step = tfsplit.split(ex.train_step, input_signature=ex.train_signature,
                         variable_names=names(ex), timeout_seconds=TIMEOUT, **split_kwargs)
    inputs = ex.make_inputs("train", seed=seed)
    report, (before, want, alt) = training_report(step, ex, inputs, steps)
    report.assert_ok(str(split_kwargs))
    # assign_back puts the split run's trained values into the model: they
    # match the reference's trained values, which differ from the start.
    step.assign_back()
    compare.Report(compare.compare_variables(
        None, before, want, {n: v.numpy() for v, n in names(ex)}, alt),
                   compare.DEFAULT_RTOL).assert_ok("after assign_back:")
    assert any(np.abs(v.numpy() - before[n]).max() > 0 for v, n in names(ex)
               if v.trainable), "nothing was trained"
    return step
  finally:
    for v, s in zip(variables, start):
      v.assign(s)


def gather_the_local_block(graph_def, gathers):
  """Breaks `gathers` (CollectiveGatherV2 NodeDefs of `graph_def`, every
  member of each instance, so nothing waits for a missing peer): each
  becomes the concatenation of its own block with itself, what a device
  would hold if it never received the others' blocks."""
  from tensorflow.python.framework import tensor_util  # pylint: disable=import-outside-toplevel
  for node in gathers:
    axis = graph_def.node.add(name=node.name + "/axis", op="Const", device=node.device)
    axis.attr["dtype"].type = tf.int32.as_datatype_enum
    axis.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(0, tf.int32))
    data, dtype = node.input[0], node.attr["T"].type
    node.op = "ConcatV2"
    for attr in list(node.attr):
      if not attr.startswith("_"):
        del node.attr[attr]
    node.attr["T"].type = dtype
    node.attr["N"].i = 2
    node.attr["Tidx"].type = tf.int32.as_datatype_enum
    del node.input[:]
    node.input.extend([data, data, axis.name])
