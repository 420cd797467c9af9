"""Gradient buckets: exact training with few data-parallel all-reduces."""
import collections
import math

import numpy as np
import pytest
from tensorflow.python.framework import tensor_util

from tfsplit.errors import PlanError
from tfsplit.graph import load_graph
from tfsplit.passes import split_graph
from tfsplit.passes.config import DEFAULT_BUCKET_BYTES
from tfsplit.runtime.split_function import make_mesh
from tfsplit.sharding import buckets as buckets_lib

from _util import check_training, example, names

BATCH = 16
SMALL = 64 * 1024   # forces several buckets on the tiny models (~75 KB of gradients)
# Besides the buckets: the loss's all-reduce, and a bucket cut short by a dtype
# or by a tensor that did not fit.
SLACK = 2


def _int(nodes, text):
  return int(tensor_util.MakeNdarray(nodes[text.split(":")[0]].attr["value"].tensor))


def _reduces(result, axis="dp"):
  """{device id: CollectiveReduceV2 nodes over `axis`}, from the graph alone."""
  nodes = {n.name: n for n in result.graph_def.node}
  by_instance = collections.defaultdict(list)
  for n in result.graph_def.node:
    if n.op == "CollectiveReduceV2":
      key = (_int(nodes, n.input[2]), _int(nodes, n.input[3]))
      by_instance[key].append((result.records[n.name].device_id, n))
  groups = {tuple(g) for g in result.mesh.groups(axis)}
  out = collections.defaultdict(list)
  for members in by_instance.values():
    if tuple(sorted(d for d, _ in members)) in groups:
      for d, n in members:
        out[d].append(n)
  return out


def _gradient_bytes(result, device_id):
  """Bytes of the trainable variables' shards on a device (its gradients)."""
  total = 0
  for entry in result.manifest.values():
    if entry["trainable"] is False:
      continue
    size = np.dtype(entry["dtype"]).itemsize
    total += sum(int(np.prod(s["shape"])) * size for s in entry["shards"]
                 if s["device_id"] == device_id)
  return total


def _check_buckets(result, bucket_bytes):
  """Every device of a group packs the same tensors in the same order, and
  issues at most ceil(gradient bytes / bucket size) + SLACK dp all-reduces."""
  reduces = _reduces(result)
  assert reduces
  for d, nodes in reduces.items():
    limit = math.ceil(_gradient_bytes(result, d) / bucket_bytes) + SLACK
    assert len(nodes) <= limit, (d, len(nodes), limit)
  records = [c for c in result.collectives if c.kind == buckets_lib.BUCKET]
  assert records
  nodes = {n.name: n for n in result.graph_def.node}
  for record in records:
    assert record.local_bytes <= bucket_bytes
    order = {}
    for d in record.devices:
      concat = nodes[f"{record.tensor}/shard_{d}/concat"]
      flats = [t for t in concat.input if nodes[t].op == "Reshape"]
      order[d] = [result.records[t].source for t in flats]
    assert len({tuple(o) for o in order.values()}) == 1, order
    assert [t.split(":")[0] for t in record.members] == order[record.devices[0]]
  return reduces


# Exact training with the default bucket size runs in test_data_parallel.py
# (buckets are on by default); these force several buckets per device.
@pytest.mark.parametrize("name,mesh,m", [
    ("gpt_raw", "dp=2", 2),
    ("gpt_raw", "dp=2,tp=2", 1),
    ("gpt_keras3", "dp=2", 1),
])
def test_training_with_small_buckets(name, mesh, m):
  step = check_training(example(name, batch_size=BATCH), steps=2, mesh=mesh,
                        microbatches=m, bucket_bytes=SMALL)
  result = step.result
  reduces = _check_buckets(result, SMALL)
  assert all(len(n) > 2 for n in reduces.values())
  if m > 1:
    # Reduced once per step, after the last micro-batch's running sum: only
    # the first micro-batch's copy of each device holds a dp all-reduce, and
    # each bucket member is the running sum after the last micro-batch.
    assert all(result.mesh.coord(d, "mb") == 0 for d in reduces)
    nodes = {n.name: n for n in result.graph_def.node}
    for record in result.collectives:
      if record.kind == buckets_lib.BUCKET:
        concat = nodes[f"{record.tensor}/shard_{record.devices[0]}/concat"]
        for flat in concat.input[:-1]:
          summed = nodes[flat].input[0].split(":")[0]
          assert nodes[summed].op == "AddV2", summed
          assert result.mesh.coord(result.records[summed].device_id, "mb") == m - 1


def _graph(name):
  ex = example(name, batch_size=BATCH)
  return ex, load_graph(ex.concrete("train"), variable_names=names(ex))


def test_bucket_size_zero_keeps_one_all_reduce_per_gradient():
  ex, graph_def = _graph("gpt_raw")
  result = split_graph(graph_def, make_mesh("dp=2"), bucket_bytes=0)
  assert not [c for c in result.collectives if c.kind == buckets_lib.BUCKET]
  assert not [n for n in result.graph_def.node if n.name.startswith("gradient_buckets/")]
  per_tensor = result.count("all_reduce", "dp")
  assert per_tensor > len(ex.variables)
  assert {d: len(n) for d, n in _reduces(result).items()} == {0: per_tensor,
                                                                 1: per_tensor}


def test_default_is_one_bucket_per_device():
  """dp=2,tp=2 with micro-batches: per device one bucket and the loss."""
  _, graph_def = _graph("gpt_keras3")
  result = split_graph(graph_def, make_mesh("dp=2,tp=2"), microbatches=2)
  reduces = _check_buckets(result, DEFAULT_BUCKET_BYTES)
  assert len(reduces) == 4
  assert all(len(n) == 2 for n in reduces.values()), {d: len(n) for d, n in
                                                      reduces.items()}
  # Megatron's tp all-reduces (2 forward, 2 backward per block and
  # micro-batch) are left alone.
  tp = _reduces(result, "tp")
  assert len(tp) == 8 and all(len(n) == 4 * 2 for n in tp.values()), tp


def test_pipeline_and_data_parallel_buckets_per_stage():
  """pp=2,dp=2: each stage's dp group packs its own stage's gradients."""
  _, graph_def = _graph("gpt_raw")
  result = split_graph(graph_def, make_mesh("pp=2,dp=2"), microbatches=2)
  reduces = _check_buckets(result, DEFAULT_BUCKET_BYTES)
  assert len(reduces) == 4
  # One bucket per device, plus the loss on the last stage.
  assert sorted(len(n) for n in reduces.values()) == [1, 1, 2, 2], reduces
  records = [c for c in result.collectives if c.kind == buckets_lib.BUCKET]
  assert len(records) == 2
  assert not set(records[0].members) & set(records[1].members)


def test_bucket_bytes_is_checked():
  _, graph_def = _graph("gpt_raw")
  with pytest.raises(PlanError, match="bucket_bytes must be a non-negative integer"):
    split_graph(graph_def, make_mesh("dp=2"), bucket_bytes=-1)


class _Fake(object):
  def __init__(self, name, size, position, dtype=1):
    self.tensor, self.bytes, self.position, self.key = name, size, (position, 0), 0
    self.attrs = (dtype,)


def test_pack_caps_orders_and_separates_dtypes():
  fakes = [_Fake("c", 40, 3), _Fake("a", 40, 1), _Fake("b", 40, 2), _Fake("h", 8, 4, dtype=2),
           _Fake("d", 200, 5), _Fake("e", 10, 6), _Fake("f", 10, 7), _Fake("g", 8, 8, dtype=2)]
  got = [[i.tensor for i in b] for b in buckets_lib.pack(fakes, 100)]
  # a, b fill a bucket; c starts the next; d (over the cap) stays alone and
  # closes c's; e, f share one; h, g (another dtype) another.
  assert got == [["a", "b"], ["e", "f"], ["h", "g"]], got
