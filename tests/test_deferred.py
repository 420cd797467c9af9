"""tfsplit.deferred_init(): a model built inside holds no memory, a split of
its step makes each shard from the variable's initializer and trains exactly
like the same model built whole from the same seed (losses, every variable
of model and optimizer after 3 steps); reading a deferred value outside a
split is one line; a model built whole can hand its memory over to its
shards (split(release=True)); every worker makes only its own shards."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfsplit
from tfsplit.errors import PlanError
from tfsplit.runtime import compare
from tfsplit.runtime import deferred as deferred_lib
from tfsplit.runtime import workers

from models import seeded
from _util import TIMEOUT, close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "deferred_worker.py")
STEPS = 3


def _keras(flavor):
  if flavor == "keras3":
    import keras  # pylint: disable=import-outside-toplevel
    return keras
  import tf_keras  # pylint: disable=import-outside-toplevel
  return tf_keras


def _batches(gpt, reverse=False):
  batches = [gpt.inputs(100 + i) for i in range(STEPS)]
  return [tuple(x[::-1].copy() for x in b) for b in batches] if reverse else batches


def _reference(flavor, cfg=seeded.TINY):
  """The model built whole and trained unsplit, twice from the same seed (on
  the batches, and on them reversed: the spread the comparison allows):
  (start, losses, values after, reversed losses, reversed values after),
  values by variable name."""
  runs = []
  for reverse in (False, True):
    gpt = seeded.build(_keras(flavor), cfg, seed=0)
    start = {name: v.numpy().copy() for v, name in gpt.variable_names()}
    losses = [float(gpt.train_step(*b)) for b in _batches(gpt, reverse)]
    runs.append((start, losses, {name: v.numpy() for v, name in gpt.variable_names()}))
  (start, losses, after), (_, alt_losses, alt) = runs
  return start, losses, after, alt_losses, alt


def _deferred(flavor, cfg=seeded.TINY):
  with tfsplit.deferred_init():
    return seeded.build(_keras(flavor), cfg, seed=0)


def _check_against(step, reference, losses, shard_values=None):
  """The project's comparison: losses, every shard of every variable and
  its update, each within a tolerance of its own scale (the reversed-batch
  run's spread where that is the larger)."""
  start, want_losses, want, alt_losses, alt = reference
  comparisons = [compare.compare("output", f"step {i + 1} loss", np.asarray(g),
                                 np.asarray(w), compare.DEFAULT_RTOL, compare.noise(w, a))
                 for i, (g, w, a) in enumerate(zip(losses, want_losses, alt_losses))]
  manifest = step.runner.manifest
  held = {n: e for n, e in manifest.items() if e["shards"]}
  comparisons += compare.compare_variables(
      held, {n: start[n] for n in held}, {n: want[n] for n in held},
      shard_values if shard_values is not None else step.shard_values(),
      {n: alt[n] for n in held})
  compare.Report(comparisons, compare.DEFAULT_RTOL, True).assert_ok("deferred split:")
  return len(held)


@pytest.mark.parametrize("flavor,mesh,options", [
    ("keras3", "tp=2", {"split_embeddings": True}),
    pytest.param("tfkeras", "tp=2", {"split_embeddings": True}, marks=pytest.mark.slow),
    pytest.param("keras3", "dp=2", {"zero": 1}, marks=pytest.mark.slow)])
def test_deferred_split_trains_like_the_model_built_whole(flavor, mesh, options):
  reference = _reference(flavor)
  gpt = _deferred(flavor)
  deferred = [v for v in gpt.variables()
              if deferred_lib.record_of(_tf_variable(v)) is not None]
  # Every weight of the model holds no memory, nor any optimizer moment but
  # those under 64 KiB (tf_keras makes them from zeros tensors: a small one
  # stays real), the step counter and scalars.
  assert all(any(v is d for d in deferred) for v in gpt.model.variables)
  assert all(any(v is d for d in deferred) or
             int(np.prod(v.shape)) * 4 < deferred_lib._SMALL_BYTES  # pylint: disable=protected-access
             for v in gpt.variables())
  step = tfsplit.split(gpt.train_step, mesh=mesh, input_signature=gpt.signature,
                       variable_names=gpt.variable_names(), timeout_seconds=TIMEOUT,
                       **options)
  assert all(not _tf_variable(v).is_initialized() for v in deferred)
  losses = [float(step(*b)) for b in _batches(gpt)]
  assert _check_against(step, reference, losses) >= len(gpt.variables()) - 1
  if mesh == "tp=2":   # the tied embedding too is split, not replicated
    assert step.manifest["embed/embeddings"]["sharding"] == [None, "tp"] or \
        tuple(step.manifest["embed/embeddings"]["sharding"]) == (None, "tp")


def _tf_variable(var):
  inner = getattr(var, "value", None)
  return inner if isinstance(inner, tf.Variable) else var


def test_a_deferred_value_read_outside_a_split_is_one_line():
  gpt = _deferred("keras3")
  with pytest.raises(deferred_lib.DeferredValueError, match="variable 'embed/embeddings' "
                     "was made under tfsplit.deferred_init.* split a step over it"):
    gpt.embedding.embeddings.numpy()
  with pytest.raises(Exception, match="embed/embeddings' was made under"):
    gpt.model(gpt.inputs(0)[0])
  step = tfsplit.split(gpt.train_step, mesh="tp=2", input_signature=gpt.signature,
                       variable_names=gpt.variable_names(), timeout_seconds=TIMEOUT)
  with pytest.raises(PlanError, match="assign_back would make the model whole"):
    step.assign_back()


def test_slots_an_optimizer_makes_while_the_step_is_traced_are_deferred_too():
  keras = _keras("keras3")
  gpt = _deferred("keras3")
  gpt.optimizer = keras.optimizers.Adam(seeded.TINY.lr, name="adam")   # not built
  step = tfsplit.split(gpt.train_step, mesh="tp=2", input_signature=gpt.signature,
                       variable_names=gpt.variable_names(), timeout_seconds=TIMEOUT)
  slots = [v for v in gpt.optimizer.variables if len(v.shape) >= 1]
  assert slots and all(deferred_lib.record_of(_tf_variable(v)) is not None for v in slots)
  assert np.isfinite(float(step(*gpt.inputs(0))))
  # A model built whole next to it keeps its slots real.
  whole = seeded.build(keras, seed=1)
  whole.optimizer = keras.optimizers.Adam(seeded.TINY.lr, name="adam")
  tfsplit.split(whole.train_step, mesh="tp=2", input_signature=whole.signature,
                variable_names=whole.variable_names(), timeout_seconds=TIMEOUT)
  assert all(deferred_lib.record_of(_tf_variable(v)) is None for v in whole.optimizer.variables)


def test_stateful_initializers_draw_in_creation_order_even_past_unused_variables():
  """tf.random.normal without an op seed draws from the global seed's
  sequence: the deferred values equal the whole ones although a variable
  made between two used ones is never split."""
  def build():
    tf.random.set_seed(7)
    made = [tf.Variable(lambda s=s: tf.random.normal(s), shape=s, dtype=tf.float32,
                        name=f"w{i}") for i, s in enumerate([[8, 16], [4, 4], [16, 8]])]
    return made

  def step_of(w):
    @tf.function
    def step(x):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.nn.relu(x @ w[0]) @ w[2]))
      grads = tape.gradient(loss, [w[0], w[2]])
      w[0].assign_sub(0.1 * grads[0])
      w[2].assign_sub(0.1 * grads[1])
      return loss
    return step

  x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
  whole = build()
  want = [float(step_of(whole)(x)) for _ in range(STEPS)]
  with tfsplit.deferred_init():
    lazy = build()
  assert all(isinstance(v, deferred_lib.DeferredVariable) for v in lazy)
  step = tfsplit.split(step_of(lazy), mesh="tp=2", input_signature=[tf.TensorSpec([4, 8])])
  got = [float(step(x)) for _ in range(STEPS)]
  close(np.asarray(got), np.asarray(want), "losses")
  full = step.full_values()
  close(full["w0"], whole[0].numpy(), "w0")
  close(full["w2"], whole[2].numpy(), "w2")


def test_release_hands_a_whole_model_over_to_its_shards():
  # Width 128: the MLP kernels are 256 KiB; a variable under 64 KiB (a norm's
  # scale, the step counter) is kept, emptying it would save nothing.
  gpt = seeded.build(_keras("keras3"), seeded.TINY._replace(width=128), seed=0)
  kernel = _tf_variable(gpt.model.get_layer("block0_up").kernel)
  gamma = _tf_variable(gpt.model.get_layer("block0_ln1").gamma)
  start = kernel.numpy().copy()
  step = tfsplit.split(gpt.train_step, mesh="tp=2", input_signature=gpt.signature,
                       variable_names=gpt.variable_names(), timeout_seconds=TIMEOUT,
                       release=True)
  # Its memory is the shards' now: it holds an empty tensor and says so.
  with pytest.raises(deferred_lib.DeferredValueError, match="'block0_up/kernel' was "
                     "released to the shards of a split"):
    kernel.numpy()
  assert gamma.numpy().shape == (128,)
  assert not step.deferred
  close(step.full_values()["block0_up/kernel"], start, "kernel")
  step(*gpt.inputs(1))
  step.assign_back()                     # fills the originals again
  close(kernel.numpy(), step.full_values()["block0_up/kernel"], "kernel after")


def test_tfsplit_keras_fit_on_a_deferred_model_keeps_its_weights_in_the_shards():
  keras = _keras("keras3")
  tokens = np.random.default_rng(0).integers(0, 96, (8, 8)).astype(np.int32)
  labels = np.random.default_rng(1).integers(0, 96, (8, 8)).astype(np.int32)

  def build():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,), dtype="int32"),
                              keras.layers.Embedding(96, 32),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(96)])
    return model

  def compiled(model):
    model.compile(keras.optimizers.Adam(1e-2),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model

  want = compiled(build()).fit(tokens, labels, batch_size=4, epochs=2, shuffle=False,
                     verbose=0).history["loss"]
  with tfsplit.deferred_init():
    model = build()
  split_model = compiled(tfsplit.keras.split(model, mesh="tp=2", timeout_seconds=TIMEOUT))
  got = split_model.fit(tokens, labels, batch_size=4, epochs=2, shuffle=False,
                        verbose=0).history["loss"]
  close(np.asarray(got), np.asarray(want), "fit losses")
  assert not _tf_variable(model.layers[1].kernel).is_initialized()
  with pytest.raises(PlanError, match="assign_back would make the model whole"):
    split_model.get_weights()


def _rss_report(args, tmp_path):
  out = tmp_path / "report.json"
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [ROOT, os.path.join(ROOT, "examples"), os.environ.get("PYTHONPATH", "")]),
             TF_CPP_MIN_LOG_LEVEL="2")
  subprocess.run([sys.executable, WORKER, "--out", str(out), *args], env=env, check=True,
                 timeout=300, capture_output=True)
  return json.loads(out.read_text())


def test_a_deferred_build_holds_no_memory_and_its_split_one_model(tmp_path):
  """Resident memory, in a process of its own: building a model of 144 MB of
  weights and Adam moments under deferred_init() grows it by a few MB; split
  at tp=2 and trained one step it holds at most its shards' 1x of the state
  beyond what the unsplit step needs; built whole and released, the same."""
  lazy = _rss_report(["--deferred", "--mesh", "tp=2", "--preset", "wide"], tmp_path)
  whole = _rss_report(["--mesh", "tp=2", "--preset", "wide"], tmp_path)
  unsplit = _rss_report(["--preset", "wide"], tmp_path)
  state = unsplit["state"]
  assert lazy["after_build"] - lazy["base"] < 0.1 * state, lazy
  assert whole["after_build"] - whole["base"] > 0.9 * state, whole
  growth = {k: r["peak"] - r["base"] for k, r in
            (("lazy", lazy), ("whole", whole), ("unsplit", unsplit))}
  assert growth["lazy"] < 1.25 * growth["unsplit"], growth
  assert growth["whole"] < 1.4 * growth["unsplit"], growth


def test_each_worker_makes_only_its_own_shards(tmp_path):
  """pp=2 over two worker processes (each runs the script): every worker's
  shards are its stage's alone, and equal the whole model's after 3 steps."""
  reference = _reference("keras3")
  spec = workers.cluster_spec(workers.free_ports(2))
  procs = []
  for task in range(2):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
        [ROOT, os.path.join(ROOT, "examples"), os.environ.get("PYTHONPATH", "")]),
               TF_CONFIG=workers.tf_config(spec, 1, "CPU", task))
    procs.append(subprocess.Popen(
        [sys.executable, WORKER, "--deferred", "--mesh", "pp=2", "--steps", str(STEPS),
         "--out", str(tmp_path / f"task{task}.json"), "--values"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True))
  try:
    for p in procs:
      _, err = p.communicate(timeout=300)
      assert p.returncode == 0, err[-3000:]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, 9)
  held = set()
  for task in range(2):
    report = json.loads((tmp_path / f"task{task}.json").read_text())
    assert 0.2 < report["share"] < 0.8, report["share"]
    step = _Held(report["manifest"])
    values = {name: np.asarray(v, np.float32) for name, v in report["values"].items()}
    held.update(n for n, e in report["manifest"].items() if e["shards"])
    _check_against(step, reference, report["losses"], values)
  assert len(held) >= len(reference[0]) - 3, (len(held), len(reference[0]))


class _Held(object):
  """What _check_against reads of a split step, from a worker's report."""

  def __init__(self, manifest):
    self.runner = type("Runner", (), {"manifest": manifest})()
