"""The graph estimate against TF's allocator on steps rewritten by the memory
passes (tools/bench_estimate.py --passes: one process per measurement).

Each test also checks the estimate of the same mesh without the pass against
the same measurement, and requires it to miss by more than the tolerance: a
comparison the pass-blind figure would pass too could not tell whether the
estimator sees the pass.
"""
import pytest

import bench_estimate  # tools/, on sys.path (see conftest.py)

TOLERANCE = 0.15
# Two logical devices on one allocator: their interleaving moves the peak.
SHARED_TOLERANCE = 0.25


def test_recompute_blocks_estimate_within_15_percent_of_allocator_peak():
  # dp=1: one device, so the allocator's peak is that device's. The small
  # GPT's activations are ~70% of its peak, and blocks recomputation keeps
  # about half of them: the peak moves by ~30%, twice the tolerance.
  r = bench_estimate.run_one("gpt_raw:small", with_time=False,
                             pass_name="recompute")
  assert r["estimated_peak"] == pytest.approx(r["measured_peak"],
                                              rel=TOLERANCE), r
  assert r["estimated_without_pass"] > (1 + TOLERANCE) * r["measured_peak"], r
  # The estimate follows TF's executor's order, not the graph's: the
  # executor leaves gradient reductions it queued under the backward chain
  # for later. Each block's recomputation now waits for the later blocks'
  # (memory/recompute.py: drains), so the orders differ less than they did
  # (graph order 0.93 of the measured peak, was 0.80-0.90), but the
  # executor's is still the closer one.
  assert abs(r["estimated_peak"] - r["measured_peak"]) < \
      abs(r["estimated_graph_order"] - r["measured_peak"]), r


def test_zero1_estimate_within_15_percent_of_allocator_peak_and_state():
  # dp=2 on two logical CPU devices of one process, which share one
  # allocator: the measured peak is the sum over both devices, compared with
  # the simulated peak of that sum. It moves with how the two devices'
  # forward passes interleave on the threads: at the default batch 8 it is
  # 10.2 or 12.2 MB by process. At batch 2 (one sequence per replica), in
  # six processes of 15 steps, most steps peaked at 8.1-8.3 MB and some at
  # 8.7 or 9.1-9.8 MB; the lowest step of a process was 8.1-8.3 MB in five
  # and 8.7 in one, and the median step of one process was in the 9.1 MB
  # mode, 17% above the estimate (7.6 MB), which is of the interleaving with
  # the least overlap: it is compared with the lowest step's peak. Under a
  # loaded machine (the suite on two cores) every step of a process can fall
  # in the upper modes: the lowest of 15 steps was 9.04 MB (19% above) in one
  # fresh-clone run. The estimate sums both devices' simulated peaks as if
  # they coincided (7.6 MB), and stays below every measured step; the shared
  # allocator adds the collectives' own buffers, which the simulation does
  # not see. So the peak is held to the interleaving's spread (25%), and the
  # pass is proven by the state below, which is exact.
  r = bench_estimate.run_one("gpt_raw:small", with_time=False,
                             pass_name="zero", batch=2)
  assert r["estimated_peak"] == pytest.approx(min(r["measured_peaks"]),
                                              rel=SHARED_TOLERANCE), r
  # Sharding the slots over dp=2 saves 1.9 of 5.6 MB of state, about as
  # much as the reduce-scatter and all-gather buffers it adds to the peak:
  # the state is where the pass shows, and it is exact (the shard variables
  # the step created from its manifest).
  assert r["estimated_state"] == pytest.approx(r["state"], rel=TOLERANCE), r
  assert r["estimated_state_without_pass"] > (1 + TOLERANCE) * r["state"], r
  # Each device holds half the slots: the per-device estimates are balanced.
  low, high = sorted(r["device_peaks"])
  assert high < 1.1 * low, r


def test_offload_estimate_within_15_percent_of_allocator_peak_and_state():
  # offload='optimizer' over dp=1 on CPU:1 with its host CPU:0: two logical
  # devices of one process on one allocator, so the measured peak is their
  # sum, compared with the simulated peak of that sum. Moving the slots to
  # the host changes their device, not the allocator: the shared peak is the
  # same with or without the pass, and the pass shows in the state per
  # device, exact from the manifest's shards.
  r = bench_estimate.run_one("gpt_raw:small", with_time=False,
                             pass_name="offload")
  assert r["estimated_peak"] == pytest.approx(r["measured_peak"],
                                              rel=TOLERANCE), r
  # The devices as the manifest places the shards: CPU:0 the host, CPU:1
  # the mesh device.
  shards = r["device_state"]
  host, device = sorted(shards)
  assert host.endswith("CPU:0") and device.endswith("CPU:1"), shards
  est = {d: r["estimated_device_state"].get(d, 0) for d in shards}
  # The host holds the slots and only them; the mesh device the weights
  # (and the step counter), no slot.
  assert shards[host]["slots"] > 0 and shards[host]["weights"] == 0, shards
  assert shards[device]["slots"] == 0 and shards[device]["weights"] > 0, shards
  assert est[host] == shards[host]["slots"], (est, shards)
  assert est[device] == shards[device]["weights"], (est, shards)
  # The estimator's per-device static memory says the same: the host's state
  # is all optimizer state, the mesh device's parameters are all its state
  # but the step counter's few bytes.
  memory = {m["device"]: m for m in r["memory"]}
  assert memory[host]["parameters"] == 0, memory
  assert memory[host]["optimizer_state"] == est[host], memory
  assert memory[device]["parameters"] + memory[device]["optimizer_state"] == \
      est[device], memory
  assert memory[device]["optimizer_state"] < 0.01 * est[host], memory
  # Without the pass, the one mesh device holds it all: the per-device
  # comparison above is what tells the pass from none.
  assert r["estimated_device_state_without_pass"] == {
      device: r["state"]}, r["estimated_device_state_without_pass"]
