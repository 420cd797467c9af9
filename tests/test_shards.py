"""Shard manifests: full values <-> shards, and starting from a checkpoint."""
import numpy as np
import pytest
import tensorflow as tf

import tfsplit
from tfsplit.errors import TfsplitError
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
  w = tf.Variable(np.random.RandomState(0).randn(4, 8).astype(np.float32), name="w")
  v = tf.Variable(np.random.RandomState(1).randn(8, 2).astype(np.float32), name="v")

  @tf.function
  def f(x):
    return tf.matmul(tf.nn.relu(tf.matmul(x, w)), v)
  saved = {"w": w.numpy().copy(), "v": v.numpy().copy()}
  path = tf.train.Checkpoint(w=w, v=v).save(str(tmp_path / "ckpt"))
  step = tfsplit.split(f, mesh="tp=2", input_signature=[tf.TensorSpec([3, 4])],
                       timeout_seconds=60)
  values = shards_lib.full_values_from_checkpoint(path, ["w", "v"])
  for name, value in values.items():
    np.testing.assert_array_equal(value, saved[name])
  for name, value in shards_lib.shard_values(step.manifest, values).items():
    step.variables[name].assign(value)
  x = np.ones([3, 4], np.float32)
  np.testing.assert_allclose(step(tf.constant(x)).numpy(), f(x).numpy(), rtol=1e-5)
