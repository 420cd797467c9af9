"""Cluster specs, hardware presets and the alpha-beta collective model."""
import json
import math

import pytest

from tfsplit.cost import cluster as cluster_lib
from tfsplit.cost import collectives
from tfsplit.cost.cluster import ClusterSpec, Link
from tfsplit.errors import ClusterSpecError

PRESETS = ["a100-40gb", "a100-80gb", "cpu-host", "h100-80gb", "h200-141gb",
           "v100-16gb", "v100-32gb"]


def test_all_presets_are_bundled_and_load():
  assert cluster_lib.preset_names() == PRESETS
  for name in PRESETS:
    c = cluster_lib.from_preset(name)
    dev = c.device(0)
    assert dev.memory_bytes > 0 and dev.memory_bandwidth > 0
    assert dev.flops("float32") > 0
    assert c.link(0, 0) is cluster_lib.LOCAL


@pytest.mark.parametrize("name,memory,bf16", [
    ("v100-16gb", 16e9, 15.7e12),       # no bf16 tensor cores: fp32 rate
    ("v100-32gb", 32e9, 15.7e12),
    ("a100-40gb", 40e9, 312e12),
    ("a100-80gb", 80e9, 312e12),
    ("h100-80gb", 80e9, 989.4e12),
    ("h200-141gb", 141e9, 989.4e12),
])
def test_preset_published_numbers(name, memory, bf16):
  dev = cluster_lib.from_preset(name).device(0)
  assert dev.memory_bytes == memory
  assert dev.flops("bfloat16") == bf16


def test_unknown_dtype_and_preset_say_what_exists():
  dev = cluster_lib.from_preset("h100-80gb").device(0)
  with pytest.raises(ClusterSpecError, match="known: .*float32"):
    dev.flops("int64")
  with pytest.raises(ClusterSpecError, match="h100-80gb"):
    cluster_lib.from_preset("h100")


def test_from_preset_fills_hosts():
  c = cluster_lib.from_preset("h100-80gb", 16)
  assert len(c) == 16 and len(c.hosts) == 2
  assert c.device(8).host == "host1"
  partial = cluster_lib.from_preset("a100-40gb", 12)
  assert len(partial.hosts) == 2
  # The 4 devices of the second host share its 200 GB/s network.
  assert partial.network_share("host1") == pytest.approx(50e9)
  assert partial.network_share("host0") == pytest.approx(25e9)
  custom = cluster_lib.from_preset("v100-16gb", 8, devices_per_host=4)
  assert len(custom.hosts) == 2


def test_links_within_and_between_hosts():
  c = cluster_lib.from_preset("h100-80gb", 16)
  assert c.link(0, 1) == Link(450e9, 2e-6)             # NVLink
  assert c.link(0, 8) == Link(50e9, 5e-6)              # one NIC of eight
  assert c.group_link(range(8)) == Link(450e9, 2e-6)
  # A ring over both hosts uses all eight NICs: 8 x 50 GB/s < NVLink.
  assert c.group_link(range(16)) == Link(400e9, 5e-6)
  assert c.group_link([0, 8]) == Link(50e9, 5e-6)
  assert c.group_link([3]) is cluster_lib.LOCAL


def test_save_load_round_trip(tmp_path):
  c = cluster_lib.from_preset("a100-80gb", 10)
  path = tmp_path / "cluster.json"
  c.save(str(path))
  again = ClusterSpec.load(str(path))
  assert again.to_json() == c.to_json()
  assert [p.name for p in tmp_path.iterdir()] == ["cluster.json"]
  assert ClusterSpec.load("cpu-host").device(0).kind == "CPU-2xXeon8380"


def test_sizes_in_json_may_be_strings(tmp_path):
  spec = {"name": "two", "hosts": [
      {"name": "h", "intra_host_link": {"bandwidth": 1e9, "latency": 0},
       "inter_host_link": {"bandwidth": 1e9}}],
          "devices": [{"name": f"d{i}", "host": "h", "memory_bytes": "16GiB",
                       "memory_bandwidth": 1e11,
                       "peak_flops": {"float32": 1e12}} for i in range(2)]}
  path = tmp_path / "c.json"
  path.write_text(json.dumps(spec))
  c = ClusterSpec.load(str(path))
  assert c.device(1).memory_bytes == 16 * 2**30


@pytest.mark.parametrize("mutate,needle", [
    (lambda s: s.pop("devices"), "missing field 'devices'"),
    (lambda s: s["devices"][0].update(host="nowhere"), "not under 'hosts'"),
    (lambda s: s["devices"][1].update(name=s["devices"][0]["name"]),
     "used twice"),
    (lambda s: s["devices"][0].update(memory_bytes="lots"), "memory_bytes"),
    (lambda s: s["hosts"][0]["intra_host_link"].update(bandwidth=-1),
     "positive number"),
    (lambda s: s["devices"][0].update(peak_flops={}), "peak_flops is empty"),
])
def test_bad_specs_name_the_problem(tmp_path, mutate, needle):
  spec = cluster_lib.from_preset("h100-80gb", 2).to_json()
  mutate(spec)
  path = tmp_path / "bad.json"
  path.write_text(json.dumps(spec))
  with pytest.raises(ClusterSpecError, match=needle):
    ClusterSpec.load(str(path))


def test_missing_and_non_json_files(tmp_path):
  with pytest.raises(ClusterSpecError, match="does not exist.*presets"):
    ClusterSpec.load(str(tmp_path / "nope.json"))
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(ClusterSpecError, match="JSON"):
    ClusterSpec.load(str(bad))


# --- collectives --------------------------------------------------------------
LINK = Link(bandwidth=100e9, latency=10e-6)
M = 1e9


def test_alpha_beta_formulas():
  n = 4
  assert collectives.ring_all_reduce(n, M, LINK) == pytest.approx(
      2 * 3 * 10e-6 + 2 * 3 / 4 * M / 100e9)
  assert collectives.ring_all_gather(n, M, LINK) == pytest.approx(
      3 * 10e-6 + 3 / 4 * M / 100e9)
  assert collectives.ring_reduce_scatter(n, M, LINK) == pytest.approx(
      3 * 10e-6 + 3 / 4 * M / 100e9)
  assert collectives.pairwise_all_to_all(n, M, LINK) == pytest.approx(
      3 * 10e-6 + 3 / 4 * M / 100e9)
  assert collectives.pipelined_broadcast(n, M, LINK) == pytest.approx(
      3 * 10e-6 + M / 100e9)
  # All-reduce is reduce-scatter followed by all-gather.
  assert collectives.ring_all_reduce(n, M, LINK) == pytest.approx(
      collectives.ring_reduce_scatter(n, M, LINK) +
      collectives.ring_all_gather(n, M, LINK))
  for fn in (collectives.ring_all_reduce, collectives.ring_all_gather,
             collectives.pipelined_broadcast):
    assert fn(1, M, LINK) == 0.0


def test_collectives_over_a_cluster_use_the_slowest_link():
  c = cluster_lib.from_preset("h100-80gb", 16)
  one_host = list(range(8))
  assert collectives.all_reduce_time(c, one_host, M) == pytest.approx(
      2 * 7 * 2e-6 + 2 * 7 / 8 * M / 450e9)
  both = list(range(16))
  assert collectives.all_reduce_time(c, both, M) == pytest.approx(
      2 * 15 * 5e-6 + 2 * 15 / 16 * M / 400e9)
  assert collectives.all_gather_time(c, [0, 8], M) == pytest.approx(
      5e-6 + 0.5 * M / 50e9)
  assert collectives.reduce_scatter_time(c, one_host, M) == pytest.approx(
      7 * 2e-6 + 7 / 8 * M / 450e9)
  assert collectives.broadcast_time(c, one_host, M) == pytest.approx(
      7 * 2e-6 + M / 450e9)
  assert collectives.send_recv_time(c, 0, 1, M) == pytest.approx(
      2e-6 + M / 450e9)
  assert collectives.send_recv_time(c, 0, 9, M) == pytest.approx(
      5e-6 + M / 50e9)
  assert collectives.send_recv_time(c, 3, 3, M) == 0.0
  assert collectives.all_reduce_time(c, [5], M) == 0.0


def test_all_to_all_across_hosts_is_bound_by_each_members_nic():
  c = cluster_lib.from_preset("h100-80gb", 16)
  assert collectives.all_to_all_time(c, range(8), M) == pytest.approx(
      7 * 2e-6 + 7 / 8 * M / 450e9)
  # Half of each member's bytes leave the host, through its own 50 GB/s.
  assert collectives.all_to_all_time(c, range(16), M) == pytest.approx(
      15 * 5e-6 + 8 / 16 * M / 50e9)


def test_collective_time_dispatch():
  c = cluster_lib.from_preset("a100-80gb", 8)
  assert set(collectives.OP_COLLECTIVE.values()) == {
      "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
      "send_recv"}
  for op, kind in collectives.OP_COLLECTIVE.items():
    group = (0, 1) if kind == "send_recv" else range(8)
    t = collectives.collective_time(kind, c, group, M)
    assert math.isfinite(t) and t > 0, op
  assert collectives.collective_time("all_reduce", c, range(8), M) == \
      collectives.all_reduce_time(c, range(8), M)
  with pytest.raises(Exception, match="unknown collective 'allreduce'"):
    collectives.collective_time("allreduce", c, range(8), M)
