"""Checkpoints by slices (runtime/checkpoint.py, runtime/slices.py): a
split's checkpoint is TF's own format, each variable stored as blocks of its
full tensor; plain TF reads every full value; a step on any other mesh (and
the unsplit model) restores it, each shard read as its slice, and trains on
exactly as an uninterrupted run; a restoring process reads only the blocks
its shards need; bad checkpoints are one line and change nothing."""
import os

import numpy as np
import pytest
import tensorflow as tf

import tfsplit
from tfsplit.runtime import checkpoint
from tfsplit.runtime import slices

from models import seeded
from _util import TIMEOUT, close

STEPS, SAVED_AT = 4, 2
# Wide enough that the bytes a restore reads are the blocks, not the index.
CFG = seeded.TINY._replace(vocab=2000, width=64)


def _keras():
  import keras  # pylint: disable=import-outside-toplevel
  return keras


def _batches(gpt):
  return [gpt.inputs(100 + i) for i in range(STEPS)]


def _values(gpt):
  return {name: v.numpy().copy() for v, name in gpt.variable_names()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(checkpoint dir, the saving split's full values, the uninterrupted
  unsplit run's losses): a dp=2,tp=2 split with zero=1 (Adam) trained
  SAVED_AT steps and saved."""
  whole = seeded.build(_keras(), CFG, seed=0)
  losses = [float(whole.train_step(*b)) for b in _batches(whole)]
  gpt = seeded.build(_keras(), CFG, seed=0)
  step = tfsplit.split(gpt.train_step, mesh="dp=2,tp=2", zero=1, split_embeddings=True,
                       input_signature=gpt.signature, variable_names=gpt.variable_names(),
                       timeout_seconds=TIMEOUT)
  for b in _batches(gpt)[:SAVED_AT]:
    step(*b)
  directory = str(tmp_path_factory.mktemp("ck"))
  path = step.save(directory, SAVED_AT)
  # Something is really split: a weight over tp, a moment over dp (ZeRO).
  assert any("tp" in e["sharding"] for e in step.manifest.values())
  assert any("dp" in e["sharding"] for e in step.manifest.values())
  return directory, path, step.full_values(), losses


def test_plain_tf_reads_every_full_value(saved):
  directory, path, full, _ = saved
  assert sorted(os.listdir(path))[0] == "manifest.json"
  reader = tf.train.load_checkpoint(directory)    # TF's own checkpoint state names it
  assert tf.train.latest_checkpoint(directory) == os.path.join(path, checkpoint.PREFIX)
  stored = reader.get_variable_to_shape_map()
  assert set(stored) == set(full)
  for name, value in full.items():
    np.testing.assert_array_equal(reader.get_tensor(name), value, err_msg=name)


@pytest.mark.parametrize("mesh,options", [
    ("tp=4", {"split_embeddings": True}), ("pp=2", {}), ("dp=2", {}), ("dp=2", {"zero": 3}),
    pytest.param("dp=2,tp=2", {"zero": 1, "split_embeddings": True},
                 marks=pytest.mark.slow)])
def test_restore_on_another_mesh_resumes_exactly(saved, mesh, options):
  directory, _, full, want_losses = saved
  gpt = seeded.build(_keras(), CFG, seed=1)   # other values: the checkpoint's must win
  step = tfsplit.split(gpt.train_step, mesh=mesh, input_signature=gpt.signature,
                       variable_names=gpt.variable_names(), timeout_seconds=TIMEOUT,
                       **options)
  assert step.restore(directory) == SAVED_AT
  for name, value in step.full_values().items():
    np.testing.assert_array_equal(value, full[name], err_msg=name)
  losses = [float(step(*b)) for b in _batches(gpt)[SAVED_AT:]]
  for i, (got, want) in enumerate(zip(losses, want_losses[SAVED_AT:])):
    close(np.asarray(got), np.asarray(want), f"{mesh} step {SAVED_AT + i + 1} loss")


def test_a_fully_sharded_split_saves_each_block_once(saved, tmp_path):
  """zero=3: every weight and moment is split over dp; the checkpoint holds
  each block once, and plain TF reads the full values back."""
  directory, _, _, _ = saved
  gpt = seeded.build(_keras(), CFG, seed=1)
  step = tfsplit.split(gpt.train_step, mesh="dp=2", zero=3, input_signature=gpt.signature,
                       variable_names=gpt.variable_names(), timeout_seconds=TIMEOUT)
  step.restore(directory)
  step(*_batches(gpt)[SAVED_AT])
  path = step.save(str(tmp_path), SAVED_AT + 1)
  full = step.full_values()
  reader = tf.train.load_checkpoint(str(tmp_path))
  for name, value in full.items():
    np.testing.assert_array_equal(reader.get_tensor(name), value, err_msg=name)
  stored = sum(v.nbytes for v in full.values())
  data = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
             if ".data-" in f)
  assert data < 1.05 * stored, (data, stored)


def test_the_unsplit_model_loads_it_and_resumes_exactly(saved):
  directory, _, full, want_losses = saved
  gpt = seeded.build(_keras(), CFG, seed=1)
  assert tfsplit.load_into(gpt.variable_names(), directory) == SAVED_AT
  for name, value in _values(gpt).items():
    np.testing.assert_array_equal(value, full[name], err_msg=name)
  losses = [float(gpt.train_step(*b)) for b in _batches(gpt)[SAVED_AT:]]
  for i, (got, want) in enumerate(zip(losses, want_losses[SAVED_AT:])):
    close(np.asarray(got), np.asarray(want), f"unsplit step {SAVED_AT + i + 1} loss")


def _bytes_read():
  with open("/proc/self/io", encoding="utf-8") as f:
    return next(int(l.split()[1]) for l in f if l.startswith("rchar:"))


class _Wide(object):
  """Four 1024 x 1024 Keras 3 Dense kernels and Adam (64 MiB of state): the
  blocks a restore reads are large next to the reader's 1 MiB buffer."""

  def __init__(self):
    keras = _keras()
    keras.utils.set_random_seed(0)
    inputs = keras.Input((1024,))
    x = inputs
    for i in range(4):
      x = keras.layers.Dense(1024, use_bias=False, activation="relu" if i < 3 else None,
                             name=f"layer{i}")(x)
    self.model = keras.Model(inputs, x)
    self.optimizer = keras.optimizers.Adam(1e-3)
    self.optimizer.build(self.model.trainable_variables)
    self.signature = [tf.TensorSpec([8, 1024], tf.float32)] * 2

    @tf.function
    def step(x, y):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(self.model(x) - y))
      variables = self.model.trainable_variables
      self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
      return loss

    self.step = step
    self.names = [(v, v.path) for v in self.model.variables + self.optimizer.variables]

  def split(self, mesh, **options):
    return tfsplit.split(self.step, mesh=mesh, input_signature=self.signature,
                         variable_names=self.names, timeout_seconds=TIMEOUT, **options)


def test_a_process_reads_only_its_shards_blocks(tmp_path):
  """The shards of one pipeline stage (what its worker holds) restored from
  a dp=2,tp=2 checkpoint with zero=1: the bytes read are that stage's share
  of the state, plus at most 10% (the bundle's index, small variables)."""
  wide = _Wide()
  x = np.random.default_rng(0).normal(size=(8, 1024)).astype(np.float32)
  source = wide.split("dp=2,tp=2", zero=1)
  source(x, x)
  directory = str(tmp_path / "ck")
  source.save(directory, 1)
  step = wide.split("pp=2")
  last = step.mesh.devices[-1]
  held = {}
  for name, entry in step.manifest.items():
    mine = [s for s in entry["shards"] if s["device"] == last]
    if mine:
      held[name] = dict(entry, shards=mine)
  share = sum(int(np.prod(s["shape"])) * np.dtype(held[n]["dtype"]).itemsize
              for n, blocks in slices.blocks(held).items() for s in blocks)
  total = sum(int(np.prod(e["shape"])) * np.dtype(e["dtype"]).itemsize
              for e in step.manifest.values())
  assert 0.4 * total < share < 0.6 * total
  meta, values = checkpoint.load(directory)
  before = _bytes_read()
  got = {}
  for chunk in checkpoint.chunks(meta, values, step.manifest, held):
    got.update(chunk)
  read = _bytes_read() - before
  assert set(got) == {s["name"] for e in held.values() for s in e["shards"]}
  assert share <= read <= 1.1 * share, (read, share, total)
  full = source.full_values()
  for name, entry in held.items():
    for shard in entry["shards"]:
      np.testing.assert_array_equal(got[shard["name"]], full[name], err_msg=name)


def test_slice_strings_are_tfs():
  assert slices.spec([4, 6], [0, 0], [4, 6]) == ""
  assert slices.spec([], [], []) == ""
  assert slices.spec([4, 6], [2, 0], [2, 6]) == "4 6 2,2:-"
  assert slices.spec([4, 6], [0, 3], [4, 3]) == "4 6 -:3,3"


def test_bad_checkpoints_are_one_line_and_change_nothing(saved, tmp_path):
  directory, path, _, _ = saved
  gpt = seeded.build(_keras(), CFG, seed=1)
  before = _values(gpt)
  # A model with one variable the checkpoint lacks, or of another shape.
  named = gpt.variable_names()
  extra = tf.Variable(np.zeros([3], np.float32))
  with pytest.raises(checkpoint.CheckpointError, match="has no variable 'extra/bias'"):
    tfsplit.load_into(named + [(extra, "extra/bias")], directory)
  wrong = [(tf.Variable(np.zeros([5, 5], np.float32)) if n == "final_ln/gamma" else v, n)
           for v, n in named]
  with pytest.raises(checkpoint.CheckpointError, match=r"'final_ln/gamma' has shape \[64\]"):
    tfsplit.load_into(wrong, directory)
  for name, value in _values(gpt).items():
    np.testing.assert_array_equal(value, before[name])
  # A truncated data file: restoring names the variable it cannot read.
  broken = tmp_path / "broken"
  os.makedirs(broken)
  for f in os.listdir(path):
    data = open(os.path.join(path, f), "rb").read()
    with open(broken / f, "wb") as out:
      out.write(data[:len(data) // 3] if ".data-" in f else data)
  step = tfsplit.split(gpt.train_step, mesh="tp=2", input_signature=gpt.signature,
                       variable_names=gpt.variable_names(), timeout_seconds=TIMEOUT)
  kept = step.shard_values()
  with pytest.raises(checkpoint.CheckpointError) as error:
    step.restore(str(broken))
  assert "\n" not in str(error.value) and "is incomplete" in str(error.value) and \
      "nothing was restored" in str(error.value)
  for name, value in step.shard_values().items():
    np.testing.assert_array_equal(value, kept[name], err_msg=name)
  with pytest.raises(checkpoint.CheckpointError, match="no checkpoint in"):
    step.restore(str(tmp_path / "nothing"))


# --- starting from pretrained weights, by slices ---------------------------------------------

@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """A model saved by plain Keras and TF before any step: (its .weights.h5,
  its tf.train.Checkpoint prefix, its values, the loss of its first step)."""
  root = tmp_path_factory.mktemp("pretrained")
  gpt = seeded.build(_keras(), CFG, seed=0)
  h5 = str(root / "gpt.weights.h5")
  gpt.model.save_weights(h5)
  prefix = tf.train.Checkpoint(model=gpt.model).write(str(root / "ckpt"))
  values = {name: v.numpy().copy() for v, name in gpt.variable_names()
            if v.trainable}
  loss = float(gpt.train_step(*_batches(gpt)[0]))
  return h5, prefix, values, loss


@pytest.mark.parametrize("source", ["h5", "checkpoint"])
def test_a_deferred_split_starts_from_plain_keras_and_tf_weights(pretrained, source):
  """Built under deferred_init (nothing whole), split at tp=2 from the file:
  every weight is the file's, the first loss the plain model's."""
  h5, prefix, values, want = pretrained
  with tfsplit.deferred_init():
    gpt = seeded.build(_keras(), CFG, seed=1)
  step = tfsplit.split(gpt.train_step, mesh="tp=2", split_embeddings=True,
                       input_signature=gpt.signature, variable_names=gpt.variable_names(),
                       timeout_seconds=TIMEOUT, weights=h5 if source == "h5" else prefix,
                       weights_model=gpt.model)
  assert step.deferred and step.manifest["embed/embeddings"]["sharding"][1] == "tp"
  full = step.full_values()
  for name, value in values.items():
    np.testing.assert_array_equal(full[name], value, err_msg=name)
  close(np.asarray(float(step(*_batches(gpt)[0]))), np.asarray(want), "first loss")


def test_weights_of_another_model_are_one_line(pretrained, tmp_path):
  h5, prefix, _, _ = pretrained
  other = seeded.build(_keras(), CFG._replace(width=32), seed=0)
  with pytest.raises(tfsplit.TfsplitError, match=r"has shape \[2000, 64\] in .* but "
                     r"\[2000, 32\] in the model"):
    tfsplit.split(other.train_step, mesh="tp=2", input_signature=other.signature,
                  variable_names=other.variable_names(), weights=prefix)
  deeper = seeded.build(_keras(), CFG._replace(blocks=3), seed=0)
  with pytest.raises(tfsplit.TfsplitError, match="holds no value for variable 'block2_"):
    tfsplit.split(deeper.train_step, mesh="tp=2", input_signature=deeper.signature,
                  variable_names=deeper.variable_names(), weights=h5,
                  weights_model=deeper.model)
  broken = tmp_path / "broken.weights.h5"
  broken.write_bytes(open(h5, "rb").read()[:1000])
  with pytest.raises(tfsplit.TfsplitError, match="cannot read the weights file"):
    tfsplit.split(other.train_step, mesh="tp=2", input_signature=other.signature,
                  variable_names=other.variable_names(), weights=str(broken))


def test_keras_split_fits_from_a_weights_file(tmp_path):
  """tfsplit.keras.split(model, weights=...) of a model built under
  deferred_init trains like the plain model loaded from the same file."""
  keras = _keras()

  def build(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, activation="relu", name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(hidden))

  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 16)).astype(np.float32)
  y = rng.normal(size=(32, 4)).astype(np.float32)
  h5 = str(tmp_path / "mlp.weights.h5")
  build(0).save_weights(h5)
  plain = build(1)
  plain.load_weights(h5)
  plain.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
  want = plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
  with tfsplit.deferred_init():
    model = build(2)
  split_model = tfsplit.keras.split(model, mesh="tp=2", weights=h5, timeout_seconds=TIMEOUT)
  split_model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
  got = split_model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
  assert split_model.split_step.manifest["hidden/kernel"]["sharding"] == [None, "tp"]
  for epoch, (g, w) in enumerate(zip(got, want)):
    close(np.asarray(g), np.asarray(w), f"epoch {epoch + 1} loss")


def test_an_asynchronous_save_writes_the_values_of_its_step(tmp_path, monkeypatch):
  """save(asynchronous=True) takes the values when called; the step that
  runs while the thread writes (held back here until it has) changes none
  of what is written, and the next save waits for it."""
  gpt = seeded.build(_keras(), CFG, seed=0)
  step = tfsplit.split(gpt.train_step, mesh="dp=2,tp=2", zero=1,
                       input_signature=gpt.signature, variable_names=gpt.variable_names(),
                       timeout_seconds=TIMEOUT)
  batches = _batches(gpt)
  step(*batches[0])
  before = step.full_values()
  started = []
  write = slices.write

  def held_back(*args, **kwargs):
    import time  # pylint: disable=import-outside-toplevel
    started.append(True)
    time.sleep(1.0)    # the next step runs meanwhile
    return write(*args, **kwargs)

  monkeypatch.setattr(slices, "write", held_back)
  pending = step.save(str(tmp_path), 1, asynchronous=True)
  step(*batches[1])
  assert started and not pending.done()
  after = step.full_values()
  assert any(not np.array_equal(after[n], before[n]) for n in before)
  path = step.save(str(tmp_path), 2)       # waits for the first one
  assert pending.done() and pending.wait().endswith("ckpt-00000001")
  first = tf.train.load_checkpoint(os.path.join(os.path.dirname(path), "ckpt-00000001",
                                                checkpoint.PREFIX))
  for name, value in before.items():
    np.testing.assert_array_equal(first.get_tensor(name), value, err_msg=name)
  second = tf.train.load_checkpoint(str(tmp_path))
  for name, value in after.items():
    np.testing.assert_array_equal(second.get_tensor(name), value, err_msg=name)


def test_keras_split_with_release_holds_the_model_once(tmp_path):
  """tfsplit.keras.split(model, release=True) of a model built whole: its
  variables are emptied into the shards at the split (reading one then is
  one line), fit trains like plain fit, and get_weights fills them again."""
  keras = _keras()

  def build():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))     # a 64 x 256 kernel: 64 KiB, worth emptying
    hidden = keras.layers.Dense(256, activation="relu", name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(hidden))

  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 64)).astype(np.float32)
  y = rng.normal(size=(32, 4)).astype(np.float32)
  plain = build()
  plain.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
  want = plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
  model = build()
  split_model = tfsplit.keras.split(model, mesh="tp=2", release=True, timeout_seconds=TIMEOUT)
  split_model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
  got = split_model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history["loss"]
  # Not pulled back at the epoch's end nor when fit returned: held once.
  from tfsplit.runtime import deferred  # pylint: disable=import-outside-toplevel
  with pytest.raises(Exception, match="was released to the shards"):
    model.get_layer("hidden").kernel.numpy()
  split_model.get_weights()     # asked: filled again
  assert model.get_layer("hidden").kernel.numpy().shape == (64, 256)
  got += split_model.fit(x, y, batch_size=8, epochs=1, shuffle=False,
                         verbose=0).history["loss"]
  with pytest.raises(deferred.DeferredValueError):   # emptied again by training
    model.get_layer("hidden").kernel.value.numpy()
  for epoch, (g, w) in enumerate(zip(got, want)):
    close(np.asarray(g), np.asarray(w), f"epoch {epoch + 1} loss")
  for g, w in zip(split_model.get_weights(), plain.get_weights()):
    close(g, w, "weight after fit")


@pytest.mark.parametrize("kind", ["h5", "checkpoint"])
def test_a_tf_keras_model_starts_from_its_h5_or_checkpoint(tmp_path, kind):
  """tf_keras: model.save_weights('m.h5') (layer/weight names) or a
  tf.train.Checkpoint; the deferred split's first loss is the plain one."""
  import tf_keras  # pylint: disable=import-outside-toplevel
  gpt = seeded.build(tf_keras, seeded.TINY, seed=0)
  if kind == "h5":
    path = str(tmp_path / "m.h5")
    gpt.model.save_weights(path)
  else:
    path = tf.train.Checkpoint(model=gpt.model).write(str(tmp_path / "ck"))
  want = float(gpt.train_step(*gpt.inputs(100)))
  with tfsplit.deferred_init():
    other = seeded.build(tf_keras, seeded.TINY, seed=1)
  step = tfsplit.split(other.train_step, mesh="tp=2", input_signature=other.signature,
                       variable_names=other.variable_names(), timeout_seconds=TIMEOUT,
                       weights=path, weights_model=other.model)
  close(np.asarray(float(step(*other.inputs(100)))), np.asarray(want), "first loss")
  if kind == "h5":
    keras3_layout = str(tmp_path / "m.weights.h5")
    gpt.model.save_weights(keras3_layout)
    with pytest.raises(tfsplit.TfsplitError, match="matched by name only: save it as"):
      tfsplit.split(other.train_step, mesh="tp=2", input_signature=other.signature,
                    variable_names=other.variable_names(), weights=keras3_layout,
                    weights_model=other.model)


def test_a_split_starts_from_another_splits_checkpoint_folder(saved):
  """weights= one checkpoint's folder (ckpt-*) or the folder of all of them:
  every variable (the optimizer's too) starts from it."""
  directory, path, full, _ = saved
  for source in (path, directory):
    gpt = seeded.build(_keras(), CFG, seed=1)
    step = tfsplit.split(gpt.train_step, mesh="tp=2", input_signature=gpt.signature,
                         variable_names=gpt.variable_names(), timeout_seconds=TIMEOUT,
                         weights=source)
    for name, value in step.full_values().items():
      np.testing.assert_array_equal(value, full[name], err_msg=name)
