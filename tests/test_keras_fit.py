"""Keras fit() on a split model (tfsplit.keras) against plain fit().

Each case trains a corpus model (a task model wrapping a backbone with a tied
LM head, Keras 3 or tf_keras) for 2 epochs with plain `fit` and with
`tfsplit.keras.split(model, mesh=...).fit`, from the same weights on the same
batches, and compares the per-epoch history (loss, metric, validation) at
1e-4 and every copy of every variable (weights and optimizer slots) and its
update after training, with the rounding noise of a second plain run on
reversed batches as the noise floor (tfsplit.runtime.compare).
"""
import os
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

import tfsplit.keras
from tfsplit.errors import PlanError, TfsplitError
from tfsplit.keras.flavors import flavor_of
from tfsplit.keras import model as keras_model
from tfsplit.keras.model import named_variables
from tfsplit.runtime import compare

import models  # examples/models (see conftest.py)

TIMEOUT = 60.0
EXAMPLES, BATCH, EPOCHS = 32, 16, 2


def _keras(name):
  if name.endswith("_keras3"):
    import keras  # pylint: disable=import-outside-toplevel
    return keras
  import tf_keras  # pylint: disable=import-outside-toplevel
  return tf_keras


def _text(cfg, n, seed):
  rng = np.random.default_rng(seed)
  seq = rng.integers(0, cfg.vocab, [n, cfg.seq + 1], dtype=np.int32)
  return seq[:, :-1].copy(), seq[:, 1:].copy()


def _dataset(arrays, reverse=False):
  ds = tf.data.Dataset.from_tensor_slices(arrays).batch(BATCH, drop_remainder=True)
  if reverse:  # the same batches, rows reversed: only reduction order changes
    ds = ds.map(lambda x, y: (tf.reverse(x, [0]), tf.reverse(y, [0])))
  return ds


def _compile(target, K, steps_per_execution=1):
  target.compile(optimizer=K.optimizers.Adam(1e-3),
                 loss=K.losses.SparseCategoricalCrossentropy(from_logits=True),
                 metrics=[K.metrics.SparseCategoricalAccuracy(name="acc")],
                 steps_per_execution=steps_per_execution)


def _fit(name, split=None, reverse=False, epochs=EPOCHS, callbacks=(), steps_per_execution=1):
  """(history, {name: value} of every variable after fit, start values,
  the model fit ran on) for a fresh corpus model."""
  K = _keras(name)
  ex = models.build(name, size="tiny", seed=0)
  train = _text(ex.config, EXAMPLES, seed=1)
  val = _text(ex.config, EXAMPLES // 2, seed=2)
  target = (tfsplit.keras.split(ex.model, timeout_seconds=TIMEOUT, **split) if split
            else ex.model)
  _compile(target, K, steps_per_execution)
  flavor = flavor_of(target)
  flavor.build_optimizer(target)
  start = {n: v.numpy().copy() for n, v in named_variables(flavor, target)}
  history = target.fit(_dataset(train, reverse), epochs=epochs, verbose=0,
                       validation_data=_dataset(val), callbacks=list(callbacks))
  after = {n: v.numpy().copy() for n, v in named_variables(flavor, target)}
  return history.history, after, start, target


def _by_position(names, values):
  """The plain run's values under the split run's variable names (a second
  optimizer instance has another name prefix; the order is the same)."""
  assert len(names) == len(values)
  return dict(zip(names, values))


_REFERENCES = {}


def _reference(name, **kwargs):
  """Plain fit, and plain fit on reversed batches (the noise floor); kept
  for the session, several tests compare against the same one."""
  key = (name, tuple(sorted(kwargs.items())))
  if key not in _REFERENCES:
    want_hist, want, _, _ = _fit(name, **kwargs)
    alt_hist, alt, _, _ = _fit(name, reverse=True, **kwargs)
    _REFERENCES[key] = want_hist, want, alt_hist, alt
  return _REFERENCES[key]


def _report(split_model, start, want, alt, got_hist, want_hist, alt_hist):
  names = [n for n, _ in named_variables(flavor_of(split_model), split_model)]
  want = _by_position(names, list(want.values()))
  alt = _by_position(names, list(alt.values()))
  comparisons = []
  for key, values in want_hist.items():
    assert key in got_hist, f"history has no '{key}': {sorted(got_hist)}"
    assert len(got_hist[key]) == len(values), (key, got_hist[key], values)
    for epoch, (g, w, a) in enumerate(zip(got_hist[key], values, alt_hist[key])):
      comparisons.append(compare.compare("output", f"epoch {epoch + 1} {key}", g, w,
                                         noise_abs=compare.noise(w, a)))
  step = split_model.split_step
  comparisons += compare.compare_variables(
      step.manifest, {n: start[n] for n in step.manifest},
      {n: want[n] for n in step.manifest}, step.shard_values(),
      {n: alt[n] for n in step.manifest})
  return compare.Report(comparisons, compare.DEFAULT_RTOL, True)


def check_fit(name, split, steps_per_execution=1):
  want_hist, want, alt_hist, alt = _reference(name, steps_per_execution=steps_per_execution)
  got_hist, got, start, split_model = _fit(name, split,
                                           steps_per_execution=steps_per_execution)
  _report(split_model, start, want, alt, got_hist, want_hist, alt_hist).assert_ok(str(split))
  # fit returned with the trained weights in the wrapped (plain) model.
  assembled = split_model.split_step.full_values()
  for key, value in got.items():
    assert np.array_equal(value, assembled[key]), key
  return split_model, want_hist


MESHES = {
    "dp2": dict(mesh="dp=2"),
    "tp2": dict(mesh="tp=2"),
    "dp2tp2_m2": dict(mesh="dp=2,tp=2", microbatches=2),
    "pp2_m4": dict(mesh="pp=2", microbatches=4),
    "dp2_zero3": dict(mesh="dp=2", zero=3),
}
CI_CASES = [("causallm_keras3", "dp2_zero3"), ("causallm_tfkeras", "pp2_m4")]
ALL_CASES = [(n, m) for n in ("causallm_keras3", "causallm_tfkeras") for m in MESHES]


@pytest.mark.parametrize("name,mesh", [
    pytest.param(n, m, marks=() if (n, m) in CI_CASES else pytest.mark.slow)
    for n, m in ALL_CASES])
def test_fit_matches_plain_fit(name, mesh):
  check_fit(name, MESHES[mesh])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["causallm_keras3", "causallm_tfkeras"])
def test_steps_per_execution(name):
  check_fit(name, MESHES["tp2"], steps_per_execution=2)


@pytest.mark.slow
def test_a_broken_step_fails_the_check():
  """The comparison catches one wrong shard: the split run's tp shard of one
  kernel nudged by 1e-3 of its size after the first epoch."""
  name = "causallm_keras3"
  want_hist, want, alt_hist, alt = _reference(name)
  K = _keras(name)

  class Nudge(K.callbacks.Callback):

    def on_epoch_end(self, epoch, logs=None):
      if epoch == 0:
        step = self.model.split_step
        entry = next(e for n, e in step.manifest.items() if n.endswith("kernel")
                     and len({tuple(s["offsets"]) for s in e["shards"]}) > 1)
        shard = step.variables[entry["shards"][1]["name"]]
        shard.assign(shard * (1 + 1e-3))

  got_hist, _, start, split_model = _fit(name, MESHES["tp2"], callbacks=[Nudge()])
  report = _report(split_model, start, want, alt, got_hist, want_hist, alt_hist)
  assert not report.ok, "a nudged shard passed the comparison"


def _callbacks(K, directory, tag):
  return [
      K.callbacks.ModelCheckpoint(
          os.path.join(directory, f"{tag}-best" + (".weights.h5" if K.__name__ == "keras"
                                                    else ".h5")),
          monitor="val_loss", save_best_only=True, save_weights_only=True),
      # Stops after the second epoch: no epoch improves the loss by 10.
      K.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=1),
      K.callbacks.LearningRateScheduler(lambda epoch, lr: 1e-3 * 0.5 ** epoch),
  ]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["causallm_keras3", "causallm_tfkeras"])
def test_callbacks_and_checkpoint_into_plain_model(name, tmp_path):
  """ModelCheckpoint + EarlyStopping + LearningRateScheduler + validation_data:
  the same history as plain fit (the schedule's learning rates reach the split
  step), and the best checkpoint written during split training loads into a
  plain model and evaluates the same."""
  K = _keras(name)
  want_hist, want, _, plain = _fit(name, epochs=4,
                                   callbacks=_callbacks(K, tmp_path, "plain"))
  got_hist, got, _, split_model = _fit(name, MESHES["tp2"], epochs=4,
                                       callbacks=_callbacks(K, tmp_path, "split"))
  assert len(want_hist["loss"]) == 2, want_hist  # EarlyStopping stopped both
  for key, values in want_hist.items():
    for g, w in zip(got_hist[key], values):
      assert compare.compare("output", key, g, w).ok, (key, got_hist[key], values)
  del plain, want, got
  ex = models.build(name, size="tiny", seed=0)
  fresh = ex.model
  _compile(fresh, K)
  suffix = ".weights.h5" if K.__name__ == "keras" else ".h5"
  fresh.load_weights(str(tmp_path / f"split-best{suffix}"))
  val = _dataset(_text(ex.config, EXAMPLES // 2, seed=2))
  loaded = fresh.evaluate(val, verbose=0, return_dict=True)
  # save_best_only kept the epoch of the lowest val_loss: the plain model
  # evaluates those weights to that epoch's validation figures.
  best = int(np.argmin(got_hist["val_loss"]))
  for key in ("loss", "acc"):
    want_value = got_hist["val_" + key][best]
    assert compare.compare("output", key, loaded[key], want_value).ok, (
        key, loaded, best, got_hist)
  # And the split model evaluates its final weights as the last epoch did.
  final = split_model.evaluate(val, verbose=0, return_dict=True)
  assert compare.compare("output", "loss", final["loss"], got_hist["val_loss"][-1]).ok


@pytest.mark.slow
def test_set_weights_reaches_the_split_step():
  """Weights set through the split model (or loaded) are what the next fit
  trains from: the model's variables are pushed into the shards."""
  name = "causallm_keras3"
  _, _, _, split_model = _fit(name, MESHES["tp2"], epochs=1)
  zeros = [np.zeros_like(w) for w in split_model.get_weights()]
  split_model.set_weights(zeros)
  ex = models.build(name, size="tiny", seed=0)
  split_model.fit(_dataset(_text(ex.config, BATCH, seed=3)), epochs=1, verbose=0)
  full = split_model.split_step.full_values()
  # Adam's first steps move each weight by about the learning rate: from
  # zero, every trained weight stays within a few steps of it.
  kernel = next(k for k in full if k.endswith("kernel"))
  assert np.abs(full[kernel]).max() < 0.05, np.abs(full[kernel]).max()


def test_batch_that_does_not_divide_is_one_line():
  name = "causallm_keras3"
  K = _keras(name)
  ex = models.build(name, size="tiny", seed=0)
  split_model = tfsplit.keras.split(ex.model, mesh="dp=2", microbatches=4)
  _compile(split_model, K)
  x, y = _text(ex.config, 12, seed=1)
  with pytest.raises(PlanError) as error:
    split_model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(12), epochs=1,
                    verbose=0)
  message = str(error.value)
  assert "\n" not in message
  assert "12 examples" in message and "dp=2 x microbatches=4" in message
  assert "multiples of 8" in message and "drop_remainder=True" in message
  # Refused from the dataset's own batch op, before anything was split.
  assert split_model.split_step is None


def test_dataset_whose_last_batch_does_not_divide_is_refused_before_training():
  """A tf.data dataset of 19 examples batched by 16 ends in a batch of 3:
  refused before the first batch (read from its batch op and the length of
  what it batches, without reading the data); a dataset whose last batch
  cannot be told that way (a filter before the batch op) is one warning,
  and one batched with drop_remainder=True trains."""
  name = "causallm_keras3"
  K = _keras(name)
  ex = models.build(name, size="tiny", seed=0)
  split_model = tfsplit.keras.split(ex.model, mesh="dp=2", timeout_seconds=TIMEOUT)
  _compile(split_model, K)
  x, y = _text(ex.config, 19, seed=1)
  examples = tf.data.Dataset.from_tensor_slices((x, y))
  with pytest.raises(PlanError) as error:
    split_model.fit(examples.shuffle(4, seed=0).batch(16).prefetch(1), epochs=1, verbose=0)
  message = str(error.value)
  assert "\n" not in message and "19 examples by 16 (the last of 3)" in message, message
  assert "a batch of 3 examples" in message and "drop_remainder=True" in message
  assert split_model.split_step is None
  with mock.patch.object(keras_model.logging, "warning") as warning:
    split_model._check_batches(examples.filter(lambda a, b: True).batch(16), None)  # pylint: disable=protected-access
  (text, *args), _ = warning.call_args
  assert "last batch is not known" in text and "drop_remainder=True" in text % tuple(args)
  split_model.fit(examples.batch(16, drop_remainder=True), epochs=1, verbose=0)
  assert split_model.split_step is not None


@pytest.mark.slow
def test_numpy_inputs_with_a_smaller_last_batch():
  """fit(x, y, batch_size=16) on 40 examples, the Keras default for numpy
  data: the last batch of 8 gets its own split over the same shards, and the
  history and weights match plain fit's."""
  name = "causallm_keras3"
  K = _keras(name)
  ex = models.build(name, size="tiny", seed=0)
  x, y = _text(ex.config, 40, seed=1)
  runs = {}
  for split in (False, True):
    model = models.build(name, size="tiny", seed=0).model
    target = tfsplit.keras.split(model, mesh="dp=2", timeout_seconds=TIMEOUT) if split \
        else model
    _compile(target, K)
    history = target.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    runs[split] = history.history, model.get_weights(), target
  (want_hist, want, _), (got_hist, got, split_model) = runs[False], runs[True]
  assert len(split_model._tfsplit.kinds["train"].steps) == 2  # pylint: disable=protected-access
  for key, values in want_hist.items():
    for g, w in zip(got_hist[key], values):
      assert compare.compare("output", key, g, w).ok, (key, got_hist[key], values)
  worst = max(compare.compare("value", "w", g, w).rel for g, w in zip(got, want)
              if np.abs(w).max() > 1e-3)
  assert worst < 1e-4, worst


def test_last_batch_that_does_not_divide_is_one_line():
  name = "causallm_keras3"
  K = _keras(name)
  ex = models.build(name, size="tiny", seed=0)
  split_model = tfsplit.keras.split(ex.model, mesh="dp=2")
  _compile(split_model, K)
  x, y = _text(ex.config, 19, seed=1)
  with pytest.raises(PlanError) as error:
    split_model.fit(x, y, batch_size=16, epochs=1, verbose=0)
  message = str(error.value)
  assert "\n" not in message and "a batch of 3 examples" in message, message
  assert "drop_remainder=True" in message
  # Refused before the first batch: nothing was traced, split or trained.
  assert split_model.split_step is None


def test_layer_the_split_refuses_is_named_by_its_keras_name():
  """A batch statistic under micro-batching (BatchNormalization in training
  couples micro-batches): the error names the Keras layer."""
  import keras  # pylint: disable=import-outside-toplevel
  inputs = keras.Input([8])
  h = keras.layers.Dense(16, name="proj")(inputs)
  h = keras.layers.BatchNormalization(name="batch_stats")(h)
  model = keras.Model(inputs, keras.layers.Dense(4, name="head")(h))
  split_model = tfsplit.keras.split(model, mesh="dp=2", microbatches=2)
  split_model.compile(optimizer="adam", loss="mse")
  x = np.ones([8, 8], np.float32)
  y = np.ones([8, 4], np.float32)
  with pytest.raises(TfsplitError) as error:
    split_model.fit(x, y, batch_size=8, epochs=1, verbose=0)
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith("Keras layer '") and "batch_stats" in message, message


def test_not_a_keras_model_is_one_line():
  with pytest.raises(PlanError) as error:
    tfsplit.keras.split(tf.Module(), mesh="dp=2")
  assert "keras.Model or tf_keras.Model" in str(error.value)


def _two_input_model(K, seed=0):
  """A functional model fed a dict of two inputs (features and a mask)."""
  init = K.initializers.GlorotUniform(seed=seed)
  features = K.Input([8], name="features")
  mask = K.Input([8], name="mask")
  h = K.layers.Dense(16, activation="relu", kernel_initializer=init, name="proj")(features)
  h = K.layers.Dense(8, kernel_initializer=init, name="mix")(h)
  h = K.layers.Multiply(name="masked")([h, mask])
  out = K.layers.Dense(4, kernel_initializer=init, name="head")(h)
  return K.Model({"features": features, "mask": mask}, out)


@pytest.mark.parametrize("flavor", ["keras3", pytest.param("tfkeras", marks=pytest.mark.slow)])
def test_dict_inputs_save_and_load_model(flavor, tmp_path):
  """A two-input functional model trained with dp=2, m=2: the same history
  as plain fit; split_model.save writes the plain model, which loads with
  Keras' own load_model and predicts what the split model predicts; the
  split model's evaluate and predict run split and match the plain ones."""
  K = _keras(f"x_{flavor}")
  rng = np.random.default_rng(0)
  x = {"features": rng.standard_normal([32, 8]).astype(np.float32),
       "mask": (rng.random([32, 8]) > 0.3).astype(np.float32)}
  y = rng.standard_normal([32, 4]).astype(np.float32)
  runs = {}
  for split in (False, True):
    model = _two_input_model(K)
    target = tfsplit.keras.split(model, mesh="dp=2", microbatches=2,
                                 timeout_seconds=TIMEOUT) if split else model
    target.compile(optimizer=K.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    runs[split] = target.fit(x, y, batch_size=16, epochs=2, verbose=0,
                             shuffle=False).history, target
  (want_hist, _), (got_hist, split_model) = runs[False], runs[True]
  for key, values in want_hist.items():
    for g, w in zip(got_hist[key], values):
      assert compare.compare("output", key, g, w).ok, (key, got_hist[key], values)
  path = str(tmp_path / ("model.keras" if flavor == "keras3" else "model.h5"))
  split_model.save(path)
  loaded = K.models.load_model(path, compile=False)
  assert type(loaded).__name__ != type(split_model).__name__
  want = runs[False][1].predict(x, verbose=0, batch_size=16)
  for got in (loaded.predict(x, verbose=0, batch_size=16),
              split_model.predict(x, verbose=0, batch_size=16)):
    assert compare.compare("output", "predictions", got, want).ok
  # Evaluation and prediction ran split, on the training step's shards.
  kinds = split_model._tfsplit.kinds  # pylint: disable=protected-access
  assert len(kinds["predict"].steps) == 1 and not split_model._tfsplit.plain  # pylint: disable=protected-access
  want_eval = runs[False][1].evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
  got_eval = split_model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
  assert len(kinds["test"].steps) == 1
  for key, value in want_eval.items():
    assert compare.compare("output", key, got_eval[key], value).ok, (got_eval, want_eval)


@pytest.mark.slow
def test_plan_auto():
  """plan="auto": the planner picks the mesh from the step traced at the
  first batch; the history and every shard match plain fit, and the split
  model reports the plan it trains with."""
  name = "causallm_keras3"
  want_hist, want, alt_hist, alt = _reference(name)
  got_hist, _, start, split_model = _fit(
      name, dict(plan="auto", devices=4, device_memory="1GB"))
  _report(split_model, start, want, alt, got_hist, want_hist, alt_hist).assert_ok("plan=auto")
  plan = split_model.split_step.plan
  assert plan is not None and plan.options()["mesh"] == ",".join(
      f"{k}={v}" for k, v in split_model.split_step.mesh.axes.items())


@pytest.mark.slow
def test_fit_across_two_worker_processes(tmp_path):
  """dp=2 over 2 worker processes (TF gRPC servers on 127.0.0.1, driven by
  this process): the same history and weights as plain fit; the workers are
  stopped whatever happens."""
  from tfsplit.runtime import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import workers  # pylint: disable=import-outside-toplevel
  name = "causallm_keras3"
  want_hist, want, alt_hist, alt = _reference(name)
  group, spec = workers.start_workers(2, 1, timeout=120, logdir=str(tmp_path))
  try:
    cluster = cluster_lib.resolve(spec)
    got_hist, _, start, split_model = _fit(name, dict(mesh="dp=2", cluster=cluster))
    assert split_model.split_step.cluster is not None
    _report(split_model, start, want, alt, got_hist, want_hist, alt_hist).assert_ok(
        "dp=2 on 2 workers")
  finally:
    group.stop()


@pytest.mark.slow
def test_replicated_ops_are_reported_by_keras_layer(caplog):
  """An op with no split rule (tf.unique over the data-split batch) runs
  replicated, exactly; fit says so once, naming the Keras layer."""
  import keras  # pylint: disable=import-outside-toplevel

  def build():
    init = keras.initializers.GlorotUniform(seed=1)
    inputs = keras.Input([8])
    h = keras.layers.Dense(16, kernel_initializer=init, name="proj")(inputs)
    distinct = keras.layers.Lambda(
        lambda t: tf.cast(tf.size(tf.unique(tf.reshape(tf.cast(t * 3.0, tf.int32), [-1]))[0]),
                          tf.float32) * tf.ones_like(t[:, :1]), name="distinct")(inputs)
    h = keras.layers.Concatenate(name="join")([h, distinct * 0.01])
    return keras.Model(inputs, keras.layers.Dense(4, kernel_initializer=init, name="head")(h))

  rng = np.random.default_rng(0)
  x = rng.standard_normal([16, 8]).astype(np.float32)
  y = rng.standard_normal([16, 4]).astype(np.float32)
  histories = []
  for split in (False, True):
    model = build()
    target = tfsplit.keras.split(model, mesh="dp=2", timeout_seconds=TIMEOUT) if split \
        else model
    target.compile(optimizer="adam", loss="mse")
    with caplog.at_level("WARNING"):
      histories.append(target.fit(x, y, batch_size=8, epochs=2, verbose=0,
                                  shuffle=False).history)
  for g, w in zip(histories[1]["loss"], histories[0]["loss"]):
    assert compare.compare("output", "loss", g, w).ok, histories
  warnings = [r.getMessage() for r in caplog.records if "replicated instead of split" in r.getMessage()]
  assert len(warnings) == 1 and "'distinct'" in warnings[0], warnings
  assert "op Unique" in warnings[0], warnings


@pytest.mark.parametrize("flavor", ["keras3", pytest.param("tfkeras", marks=pytest.mark.slow)])
def test_on_batch_methods(flavor):
  """train_on_batch, test_on_batch and predict_on_batch run split (each
  kind once) and give what the plain model gives."""
  K = _keras(f"x_{flavor}")
  rng = np.random.default_rng(0)
  x = {"features": rng.standard_normal([16, 8]).astype(np.float32),
       "mask": (rng.random([16, 8]) > 0.3).astype(np.float32)}
  y = rng.standard_normal([16, 4]).astype(np.float32)
  runs = []
  for split in (False, True):
    model = _two_input_model(K)
    target = tfsplit.keras.split(model, mesh="dp=2", timeout_seconds=TIMEOUT) if split \
        else model
    target.compile(optimizer=K.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    logs = [target.train_on_batch(x, y, return_dict=True) for _ in range(2)]
    logs.append(target.test_on_batch(x, y, return_dict=True))
    runs.append((logs, np.asarray(target.predict_on_batch(x)), target))
  (want_logs, want_pred, _), (got_logs, got_pred, split_model) = runs
  for want, got in zip(want_logs, got_logs):
    for key, value in want.items():
      assert compare.compare("output", key, got[key], value).ok, (got, want)
  assert compare.compare("output", "predictions", got_pred, want_pred).ok
  kinds = split_model._tfsplit.kinds  # pylint: disable=protected-access
  assert [len(kinds[k].steps) for k in ("train", "test", "predict")] == [1, 1, 1]


@pytest.mark.parametrize("flavor", ["keras", "tf_keras"])
def test_task_models_compile_defaults_are_kept(flavor):
  """A task model whose compile() adds its default loss and metric (as
  model libraries' task classes do): compiled through the split model, fit
  reports that metric and trains as the plain model does."""
  import importlib  # pylint: disable=import-outside-toplevel
  K = importlib.import_module(flavor)

  class Task(K.Model):

    def __init__(self):
      inputs = K.Input((8,))
      super().__init__(inputs, K.layers.Dense(4)(K.layers.Dense(16)(inputs)))

    def compile(self, optimizer="sgd", loss="auto", metrics="auto", **kwargs):  # pylint: disable=arguments-differ
      if loss == "auto":
        loss = K.losses.SparseCategoricalCrossentropy(from_logits=True)
      if metrics == "auto":
        metrics = [K.metrics.SparseCategoricalAccuracy(name="task_accuracy")]
      super().compile(optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)

  rng = np.random.RandomState(0)
  x, y = rng.normal(size=(16, 8)).astype(np.float32), (np.arange(16) % 4).astype(np.int32)
  histories = []
  for split in (False, True):
    K.utils.set_random_seed(3)
    task = Task()
    target = tfsplit.keras.split(task, mesh="dp=2") if split else task
    target.compile(optimizer=K.optimizers.SGD(0.1))
    histories.append(target.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                                verbose=0).history)
  want, got = histories
  assert "task_accuracy" in got and set(got) == set(want), (got, want)
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
