"""The comparison behind verify and the tests, on hand-made tensors."""
import numpy as np

from tfsplit.runtime import compare


def test_scale_is_the_tensors_own_not_one():
  want = np.full([4], 1e-3, np.float32)
  assert compare.compare("value", "w", want * 1.01, want).ok is False  # 1% of a small tensor
  assert compare.compare("value", "w", want * (1 + 1e-6), want).ok


def test_shapes_must_match():
  c = compare.compare("value", "w", np.zeros([2, 3]), np.zeros([3, 2]))
  assert not c.ok and "shape [2, 3], expected [3, 2]" in c.note


def test_nan_and_integers():
  assert not compare.compare("output", "x", np.array([np.nan]), np.array([1.0])).ok
  assert compare.compare("value", "step", np.array(3), np.array(3)).ok
  assert not compare.compare("value", "step", np.array(4), np.array(3)).ok


def test_zero_must_stay_zero():
  assert not compare.compare("value", "z", np.array([1e-20], np.float32),
                             np.zeros([1], np.float32)).ok


def test_update_check_sees_a_wrong_step_the_value_check_cannot():
  """Adam moves a weight of size 1 by ~1e-4: a 10% wrong step is 1e-5 of the
  weight (inside rtol) but 10% of the update."""
  start = {"w": np.ones([8], np.float32)}
  want = {"w": start["w"] - 1e-4}
  got = {"w/shard_0": start["w"] - 1.1e-4}
  manifest = {"w": {"shape": [8], "shards": [
      {"name": "w/shard_0", "device": "CPU:0", "offsets": [0], "shape": [8]}]}}
  by_kind = {c.kind: c for c in compare.compare_variables(manifest, start, want, got)}
  assert by_kind["value"].ok
  assert not by_kind["update"].ok and abs(by_kind["update"].rel - 0.1) < 1e-2


def test_every_copy_is_checked_and_the_divergent_one_named():
  start = {"b": np.zeros([4], np.float32)}
  want = {"b": np.full([4], 0.5, np.float32)}
  manifest = {"b": {"shape": [4], "shards": [
      {"name": f"b/shard_{d}", "device": f"CPU:{d}", "offsets": [0], "shape": [4]}
      for d in range(3)]}}
  got = {"b/shard_0": want["b"], "b/shard_1": want["b"], "b/shard_2": start["b"]}
  report = compare.Report(compare.compare_variables(manifest, start, want, got), 1e-4)
  assert not report.ok
  assert {c.what for c in report.failures if c.kind == "value"} == {"b on CPU:2"}
  assert report.first_divergent_copy().what == "b on CPU:2 vs CPU:0"


def test_noise_widens_only_that_tensor():
  want = np.array([1e-6, -1e-6], np.float32)      # pure rounding noise
  alt = np.array([-2e-6, 3e-6], np.float32)
  c = compare.compare("value", "k_bias", want * -1, want, noise_abs=compare.noise(want, alt))
  assert c.ok
  assert not compare.compare("value", "k_bias", want * -1, want).ok


def test_a_tensor_that_is_rounding_noise_stays_within_ten_times_its_size():
  # Adam's second moment of an identically zero gradient (an attention key
  # bias) is the noise squared: the reversed batch moved it by half its size,
  # a tp=2 split by five times it.
  want = np.array([1.9e-20, 4e-21], np.float32)
  alt = np.array([9.6e-21, 8e-21], np.float32)
  got = want + np.float32(9.9e-20)
  noise = compare.noise(want, alt)
  assert compare.compare("value", "k_bias velocity", got, want, noise_abs=noise).ok
  # Break check: a value far above what the noise can reach still fails...
  assert not compare.compare("value", "k_bias velocity", want * 200, want,
                             noise_abs=noise).ok
  # ...and a tensor the reference reproduces (signal) is held to its own scale.
  signal = np.array([1.0, -0.5], np.float32)
  assert not compare.compare("value", "kernel", signal * 1.01, signal, noise_abs=1e-6).ok
  # The same through compare_variables (value, update and copies of each shard).
  start = {"v": np.zeros([2], np.float32)}
  manifest = {"v": {"shape": [2], "shards": [
      {"name": f"v/shard_{d}", "device": f"CPU:{d}", "offsets": [0], "shape": [2]}
      for d in range(2)]}}

  def report(factor):
    shards = {f"v/shard_{d}": got * factor for d in range(2)}
    return compare.Report(compare.compare_variables(manifest, start, {"v": want}, shards,
                                                    {"v": alt}), 1e-4)
  assert report(1).ok
  assert not report(20).ok


def test_batch_order_dependent_graphs_get_no_noise_term():
  pairs = [(np.ones(4), np.ones(4) * 2)] * 3      # reversed batch changed everything
  assert not compare.typical_noise_is_small(pairs)
  pairs = [(np.ones(4), np.ones(4) * (1 + 1e-7))] * 3
  assert compare.typical_noise_is_small(pairs)
