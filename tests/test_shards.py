"""Shard manifests: full values <-> shards, and starting from a checkpoint."""
import numpy as np
import pytest
import tensorflow as tf

import tfsplit
from tfsplit.errors import DivergedCopiesError, PlanError, TfsplitError
from tfsplit.runtime import shards as shards_lib


def _manifest():
  return {"w": {"dtype": "float32", "shape": [4, 6], "sharding": [None, "tp"], "shards": [
      {"name": "w/shard_0", "device": "/device:CPU:0", "device_id": 0, "offsets": [0, 0],
       "shape": [4, 3]},
      {"name": "w/shard_1", "device": "/device:CPU:1", "device_id": 1, "offsets": [0, 3],
       "shape": [4, 3]}]}}


def test_shards_round_trip():
  full = {"w": np.arange(24, dtype=np.float32).reshape(4, 6)}
  parts = shards_lib.shard_values(_manifest(), full)
  np.testing.assert_array_equal(parts["w/shard_1"], full["w"][:, 3:])
  back = shards_lib.full_values(_manifest(), parts)
  np.testing.assert_array_equal(back["w"], full["w"])
  with pytest.raises(TfsplitError, match="shape"):
    shards_lib.shard_values(_manifest(), {"w": np.zeros([6, 4], np.float32)})
  with pytest.raises(TfsplitError, match="no value for variable 'w'"):
    shards_lib.shard_values(_manifest(), {})


def test_split_function_starts_from_a_checkpoint(tmp_path):
  """Shards restored from a checkpoint hold the checkpoint's values, not the
  values the variables had when the function was split."""
  w = tf.Variable(np.random.RandomState(0).randn(4, 8).astype(np.float32), name="w")
  v = tf.Variable(np.random.RandomState(1).randn(8, 2).astype(np.float32), name="v")

  @tf.function
  def f(x):
    return tf.matmul(tf.nn.relu(tf.matmul(x, w)), v)
  saved = {"w": w.numpy().copy(), "v": v.numpy().copy()}
  path = tf.train.Checkpoint(w=w, v=v).save(str(tmp_path / "ckpt"))
  x = np.random.RandomState(2).randn(3, 4).astype(np.float32)
  want = f(x).numpy()
  # The model moves on after the checkpoint; the split starts from these values.
  w.assign(saved["w"] * 2 + 1)
  v.assign(-saved["v"])
  step = tfsplit.split(f, mesh="tp=2", input_signature=[tf.TensorSpec([3, 4])],
                       timeout_seconds=60)
  assert step.manifest["w"]["sharding"] == [None, "tp"]  # w really is split
  moved = step(tf.constant(x)).numpy()
  assert np.abs(moved - want).max() > 1.0  # the shards do not hold the checkpoint yet
  values = shards_lib.full_values_from_checkpoint(path, ["w", "v"])
  for name, value in values.items():
    np.testing.assert_array_equal(value, saved[name])
  for name, value in shards_lib.shard_values(step.manifest, values).items():
    step.variables[name].assign(value)
  np.testing.assert_allclose(step(tf.constant(x)).numpy(), want, rtol=1e-6,
                             atol=1e-6 * np.abs(want).max())
  for name, value in step.full_values().items():
    np.testing.assert_array_equal(value, saved[name])


def test_divergent_copies_are_refused():
  """full_values never lets one copy of a replicated variable win silently."""
  manifest = {"b": {"dtype": "float32", "shape": [3], "sharding": [None], "shards": [
      {"name": f"b/shard_{d}", "device": f"/device:CPU:{d}", "device_id": d,
       "offsets": [0], "shape": [3]} for d in range(2)]}}
  same = {"b/shard_0": np.ones(3, np.float32), "b/shard_1": np.ones(3, np.float32)}
  np.testing.assert_array_equal(shards_lib.full_values(manifest, same)["b"], np.ones(3))
  diverged = dict(same, **{"b/shard_1": np.array([1, 1, 1.01], np.float32)})
  with pytest.raises(DivergedCopiesError, match=r"variable 'b on /device:CPU:1 vs "
                     r"/device:CPU:0': the copies differ"):
    shards_lib.full_values(manifest, diverged)


def test_shard_variables_on_their_devices():
  full = {"w": np.arange(24, dtype=np.float32).reshape(4, 6)}
  made = shards_lib.create_shard_variables(_manifest(), full)
  assert list(made) == ["w/shard_0", "w/shard_1"]
  for shard in _manifest()["w"]["shards"]:
    var = made[shard["name"]]
    assert var.device.endswith(shard["device"].split("/")[-1])
    np.testing.assert_array_equal(var.numpy(), full["w"][:, 3 * shard["device_id"]:][:, :3])


def test_a_step_sharing_shards_split_another_way_says_both_layouts():
  """A second split over the first one's shards (evaluation, a smaller last
  batch) that would cut a variable differently is one line giving both
  layouts, not a claim about input shapes."""

  def manifest(dims, offsets):
    return {"dense/kernel": {"sharding": list(dims), "shards": [
        {"name": f"dense/kernel/shard_{i}", "device": f"/device:CPU:{i}",
         "offsets": list(o), "shape": [4, 2] if dims[1] else [2, 4]}
        for i, o in enumerate(offsets)]}}

  train = manifest([None, "tp"], [[0, 0], [0, 2]])
  shards_lib.check_same_layout(train, train)
  evaluation = manifest(["tp", None], [[0, 0], [2, 0]])
  with pytest.raises(PlanError) as error:
    shards_lib.check_same_layout(evaluation, train)
  message = str(error.value)
  assert "\n" not in message and "'dense/kernel'" in message
  assert "shape [2, 4] at [0, 0] on /device:CPU:0 here, shape [4, 2] at [0, 0]" in message
  assert "sharding ['tp', None] here, [None, 'tp'] there" in message, message
