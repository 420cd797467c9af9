"""Optimizer-state sharding over the data axis (zero=1|2): exact training,
1/dp of the optimizer state per device, reduce-scatter + all-gather only."""
import collections
import json
import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import tensor_util

from tfsplit.cli import run as cli_run
from tfsplit.errors import PlanError
from tfsplit.graph import load_graph
from tfsplit.passes import split_graph
from tfsplit.runtime import shards as shards_lib
from tfsplit.runtime.graph_function import import_graph
from tfsplit.runtime.split_function import make_mesh
from tfsplit.sharding import buckets as buckets_lib
from tfsplit.sharding import zero as zero_lib

from _util import (TIMEOUT, check_training, example, gather_the_local_block, names,
                   training_report)

BATCH = 16
TRAIN = os.path.join(os.path.dirname(__file__), "..", "examples", "gpt_raw_train_tiny.pb")

# (model, mesh, micro-batches, stage, bucket_bytes or None for the default)
CASES = [
    ("gpt_raw", "dp=2", 1, 1, None),
    ("gpt_raw", "dp=4", 1, 2, None),
    ("gpt_raw", "dp=2", 4, 1, None),
    ("gpt_raw", "dp=2", 4, 2, None),
    ("gpt_raw", "dp=2", 2, 2, 0),          # buckets off
    ("gpt_raw", "dp=2,tp=2", 2, 1, None),
    ("gpt_keras3", "dp=2", 2, 2, None),
    ("gpt_tfkeras", "dp=2", 2, 1, None),
    ("gpt_raw", "dp=2,pp=2", 2, 1, None),   # with a pipeline
    ("gpt_raw", "dp=2,pp=2", 2, 2, None),
]
SLOW_CASES = [(name, mesh, m, stage, b)
              for name in ("gpt_raw", "gpt_keras3", "gpt_tfkeras", "mlp_keras3",
                           "mlp_tfkeras")
              for mesh in ("dp=2", "dp=4", "dp=2,tp=2")
              for m in (1, 4) for stage in (1, 2) for b in (None, 0)
              if (name, mesh, m, stage, b) not in CASES]


def _train(name, mesh, m, stage, bucket_bytes, size="tiny"):
  kwargs = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
  return check_training(example(name, size, batch_size=BATCH), mesh=mesh, microbatches=m,
                        zero=stage, **kwargs)


@pytest.mark.parametrize("name,mesh,m,stage,bucket_bytes", CASES)
def test_training_is_exact(name, mesh, m, stage, bucket_bytes):
  step = _train(name, mesh, m, stage, bucket_bytes)
  result = step.result
  assert result.count("reduce_scatter", "dp") > 0 and result.count("all_gather", "dp") > 0
  # tf_keras's sparse Adam (Unique) gathers the token ids, as without zero.
  assert all("(op Unique)" in f for f in result.fallbacks), result.fallbacks
  kept = {n: e[zero_lib.KEPT_KEY] for n, e in result.manifest.items()
          if zero_lib.KEPT_KEY in e}
  if name == "gpt_raw" and "tp" not in mesh:
    assert not kept
  for why in kept.values():  # only what the plan cannot split, said why
    assert "ResourceScatterAdd" in why or "no dimension" in why, kept


@pytest.mark.slow
@pytest.mark.parametrize("name,mesh,m,stage,bucket_bytes", SLOW_CASES)
def test_training_is_exact_full_matrix(name, mesh, m, stage, bucket_bytes):
  _train(name, mesh, m, stage, bucket_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("mesh", ["dp=4", "dp=2,tp=2"])
def test_training_is_exact_small_gpt(mesh, stage):
  _train("gpt_raw", mesh, 2, stage, None, size="small")


# --- what each device holds and sends ----------------------------------------------
def _int(nodes, text):
  return int(tensor_util.MakeNdarray(nodes[text.split(":")[0]].attr["value"].tensor))


def _dp_collectives(result, device_id):
  """[(op, bytes sent by the device)] of its collectives over 'dp', from the
  split graph alone: ring all-reduce 2(n-1)/n of its input, reduce-scatter
  (an all-to-all of the whole local gradient on CPUs) (n-1)/n of its input,
  all-gather (n-1) times its block."""
  from tfsplit.graph import infer_shapes  # pylint: disable=import-outside-toplevel
  nodes = {n.name: n for n in result.graph_def.node}
  shapes = infer_shapes(result.graph_def)
  dp_groups = {len(g) for g in result.mesh.groups("dp")}
  n = result.mesh.axes["dp"]
  out = []
  for node in result.graph_def.node:
    if not node.op.startswith("Collective") or \
        result.mesh.devices.index(node.device) != device_id:
      continue
    if _int(nodes, node.input[1]) not in dp_groups:
      continue
    info = shapes.get(node.input[0])
    elements = _elements(nodes, shapes, node.input[0])
    size = elements * np.dtype(tf.as_dtype(info.dtype).as_numpy_dtype).itemsize
    sent = {"CollectiveReduceV2": 2 * (n - 1) / n * size,
            "CollectiveAllToAllV2": (n - 1) / n * size,
            "CollectiveReduceScatterV2": (n - 1) / n * size,
            "CollectiveGatherV2": (n - 1) * size}[node.op]
    out.append((node.op, sent, elements))
  return out


def _elements(nodes, shapes, text):
  """Elements of a tensor: static inference knows nothing past a collective,
  so Reshapes to constant shapes and concatenations are read too."""
  info = shapes.get(text)
  if info is not None and info.num_elements is not None:
    return info.num_elements
  node = nodes[text.split(":")[0]]
  if node.op == "Reshape":
    shape = tensor_util.MakeNdarray(nodes[node.input[1].split(":")[0]].attr["value"].tensor)
    if (shape >= 0).all():
      return int(np.prod(shape))
  if node.op in ("Transpose", "Identity"):
    return _elements(nodes, shapes, node.input[0])
  if node.op == "ConcatV2":
    return sum(_elements(nodes, shapes, t) for t in node.input[:node.attr["N"].i])
  raise AssertionError(f"size of {text} ({node.op}) unknown")


def _slot_bytes_by_device(manifest, variables, slots):
  """{device id: bytes of the optimizer slots' shard variables placed on it}."""
  by_device = collections.Counter()
  for name in slots:
    for shard in manifest[name]["shards"]:
      var = variables[shard["name"]]
      assert var.device.endswith(f"CPU:{shard['device_id']}"), (var.device, shard)
      by_device[shard["device_id"]] += int(np.prod(var.shape)) * var.dtype.size
  return by_device


def test_dp4_holds_a_quarter_of_the_optimizer_state_and_sends_no_more():
  ex = example("gpt_raw", batch_size=BATCH)
  step = check_training(ex, mesh="dp=4", zero=1)
  result = step.result
  slots = [n for n, e in result.manifest.items() if zero_lib.SLOT_OF_KEY in e]
  # Adam's two moments per weight; nothing kept whole (every one divides by 4).
  assert len(slots) == 2 * len(ex.variables)
  assert not [n for n in slots if zero_lib.KEPT_KEY in result.manifest[n]]
  held = _slot_bytes_by_device(result.manifest, step.variables, slots)
  plain_result = split_graph(load_graph(ex.concrete("train"), variable_names=names(ex)),
                             make_mesh("dp=4"))
  plain = collections.Counter()
  for name in slots:
    size = np.dtype(plain_result.manifest[name]["dtype"]).itemsize
    for shard in plain_result.manifest[name]["shards"]:
      plain[shard["device_id"]] += int(np.prod(shard["shape"])) * size
  assert len(held) == 4 and set(held) == set(plain)
  for device in held:
    assert held[device] * 4 == plain[device], (device, held[device], plain[device])
  # The manifest's own count says the same.
  mine, without = zero_lib.optimizer_state_bytes(result.manifest, {"dp": 4})
  assert all(mine[d] * 4 == without[d] for d in mine)

  # Over dp: reduce-scatters and all-gathers, plus the loss (one scalar
  # all-reduce, as in plain dp); no more bytes than plain dp's all-reduces.
  for d in range(4):
    zero_ops = _dp_collectives(result, d)
    plain_ops = _dp_collectives(plain_result, d)
    kinds = collections.Counter(op for op, _, elements in zero_ops if elements > 1)
    assert set(kinds) == {"CollectiveAllToAllV2", "CollectiveGatherV2"}, kinds
    assert [e for op, _, e in zero_ops if op == "CollectiveReduceV2"] == [1]
    assert {op for op, _, _ in plain_ops} == {"CollectiveReduceV2"}
    zero_bytes, plain_bytes = (sum(b for _, b, _ in ops) for ops in (zero_ops, plain_ops))
    assert zero_bytes <= plain_bytes, (zero_bytes, plain_bytes)
    assert zero_bytes > 0.95 * plain_bytes  # the same traffic, split in two halves
  # Default buckets: one reduce-scatter and one all-gather per device.
  assert kinds == {"CollectiveAllToAllV2": 1, "CollectiveGatherV2": 1}, kinds
  packed = {c.kind: len(c.members) for c in result.collectives
            if c.kind in (buckets_lib.REDUCE_SCATTER_BUCKET, buckets_lib.ALL_GATHER_BUCKET)}
  assert packed[buckets_lib.REDUCE_SCATTER_BUCKET] >= len(ex.variables)
  assert packed[buckets_lib.ALL_GATHER_BUCKET] == len(ex.variables)


def test_stage_2_keeps_only_the_block_of_each_micro_batch_sum():
  """Stage 1 sums the whole local gradient over micro-batches, then
  reduce-scatters once; stage 2 reduce-scatters each micro-batch and the
  running sums add blocks of 1/dp of the gradient."""
  ex = example("gpt_raw", batch_size=BATCH)
  graph_def = load_graph(ex.concrete("train"), variable_names=names(ex))
  kernel = "gpt/block_0/mlp/fc1/kernel"
  full = int(np.prod(next(v.shape for v, n in names(ex) if n == kernel)))
  sums, scatters = {}, {}
  for stage in (1, 2):
    result = split_graph(graph_def, make_mesh("dp=2"), microbatches=4, zero=stage,
                         bucket_bytes=0)
    from tfsplit.graph import infer_shapes  # pylint: disable=import-outside-toplevel
    shapes = infer_shapes(result.graph_def)
    sizes = set()
    for node in result.graph_def.node:
      record = result.records.get(node.name)
      if node.op == "AddV2" and "/sum_mb/" in node.name and record is not None and \
          "fc1/MatMul" in record.source and record.source.startswith("gradient_tape") \
          and "block_0" in record.source:
        sizes.add(shapes.get(node.name).num_elements)
    sums[stage] = sizes
    scatters[stage] = sum(n.op == "CollectiveAllToAllV2" and n.device == result.mesh.devices[0]
                          for n in result.graph_def.node)
  assert sums[1] == {full} and sums[2] == {full // 2}, sums
  # Per device: one reduce-scatter per gradient per step, or per micro-batch.
  assert scatters[2] == 4 * scatters[1] and scatters[1] >= len(ex.variables), scatters


def test_gpu_graph_uses_nccl_reduce_scatter_and_is_deterministic():
  """On GPUs the reduce-scatter is CollectiveReduceScatterV2 (NCCL), one
  bucket of it and one of all-gathers per device; the graph imports into TF,
  and the same split twice is the same bytes."""
  from tfsplit.runtime import placement  # pylint: disable=import-outside-toplevel
  graph_def = load_graph(TRAIN)
  gpus = placement.device_names("gpu", 2)
  results = [split_graph(graph_def, placement.make_mesh("dp=2", devices=gpus), zero=1)
             for _ in range(2)]
  a, b = (r.graph_def.SerializeToString(deterministic=True) for r in results)
  assert a == b
  ops = collections.Counter((n.op, n.device[-5:]) for n in results[0].graph_def.node
                            if n.op.startswith("Collective"))
  assert ops == {("CollectiveReduceScatterV2", "GPU:0"): 1,
                 ("CollectiveReduceScatterV2", "GPU:1"): 1,
                 ("CollectiveGatherV2", "GPU:0"): 1, ("CollectiveGatherV2", "GPU:1"): 1,
                 ("CollectiveReduceV2", "GPU:0"): 1, ("CollectiveReduceV2", "GPU:1"): 1}, ops
  with tf.Graph().as_default():
    tf.graph_util.import_graph_def(results[0].graph_def, name="")


# --- the check fails when the split is wrong -----------------------------------------
def test_skipping_the_all_gather_fails_the_exactness_check():
  """Each replica applies its own block of the update to every block of the
  weight (the all-gather replaced by n copies of the local block): the
  comparison with the plain run must fail."""
  ex = example("gpt_raw", batch_size=BATCH)
  variables = ex.all_variables()
  start = [v.numpy().copy() for v in variables]
  try:
    import tfsplit  # pylint: disable=import-outside-toplevel
    step = tfsplit.split(ex.train_step, mesh="dp=2", input_signature=ex.train_signature,
                         variable_names=names(ex), timeout_seconds=TIMEOUT, zero=1,
                         bucket_bytes=0)
    graph_def = step.graph_def.__class__()
    graph_def.CopyFrom(step.graph_def)
    gathers = [n for n in graph_def.node if n.op == "CollectiveGatherV2"]
    assert len(gathers) == 2 * len(ex.variables)
    gather_the_local_block(graph_def, gathers)
    step.runner._fn = import_graph(graph_def, step.variables)  # pylint: disable=protected-access
    report, _ = training_report(step, ex, ex.make_inputs("train", seed=11), 2)
    assert not report.ok
    assert any(c.kind == "value" and "kernel" in c.what for c in report.failures)
  finally:
    for v, s in zip(variables, start):
      v.assign(s)


def test_checkpoint_conversion_knows_where_each_slot_block_lives():
  """Full values -> shard variables -> full values, with slots split over dp:
  each replica holds its own block, and the blocks make the whole again."""
  ex = example("gpt_raw", batch_size=BATCH)
  result = split_graph(load_graph(ex.concrete("train"), variable_names=names(ex)),
                       make_mesh("dp=4"), zero=1)
  rng = np.random.default_rng(0)
  full = {n: rng.standard_normal(e["shape"]).astype(e["dtype"])
          for n, e in result.manifest.items()}
  values = shards_lib.shard_values(result.manifest, full)
  slot = "adam/gpt_block_0_mlp_fc1_kernel_0_momentum"
  entry = result.manifest[slot]
  assert entry[zero_lib.SLOT_OF_KEY] == "gpt/block_0/mlp/fc1/kernel"
  assert entry["sharding"] == ["dp", None]
  offsets = sorted(s["offsets"][0] for s in entry["shards"])
  rows = entry["shape"][0] // 4
  assert offsets == [0, rows, 2 * rows, 3 * rows]
  for shard in entry["shards"]:
    o = shard["offsets"][0]
    np.testing.assert_array_equal(values[shard["name"]], full[slot][o:o + rows])
  back = shards_lib.full_values(result.manifest, values)
  for name in full:
    np.testing.assert_array_equal(back[name], full[name])
  assert json.loads(result.manifest_json())["zero"] == 1


# --- bad input -----------------------------------------------------------------------
@pytest.mark.parametrize("mesh,stage,match", [
    ("tp=2", 1, r"zero=1 shards optimizer state over the data axis, but mesh tp=2 has no "
                r"'dp' axis of 2 or more; add one"),
    ("dp=1,tp=2", 2, r"mesh dp=1,tp=2 has no 'dp' axis of 2 or more"),
    ("dp=2", 4, r"zero must be 0, 1, 2 or 3 .*got 4"),
    ("dp=2", True, r"zero must be 0, 1, 2 or 3 .*got True"),
    ("dp=2", "1", r"zero must be 0, 1, 2 or 3 .*got '1'"),
])
def test_bad_zero_is_one_line(mesh, stage, match):
  graph_def = load_graph(TRAIN)
  with pytest.raises(PlanError, match=match) as info:
    split_graph(graph_def, make_mesh(mesh), zero=stage)
  assert "\n" not in str(info.value)


def _cli(args, capsys):
  code = cli_run(["tfsplit"] + args)
  out = capsys.readouterr()
  return code, out.out, out.err


def test_rewrite_flag_summary_and_verify(tmp_path, capsys):
  out = tmp_path / "gpt_zero.pb"
  code, stdout, err = _cli(["rewrite", TRAIN, "-o", str(out), "--mesh", "dp=2",
                            "--zero", "1", "--collective-timeout", "60"], capsys)
  assert code == 0, err
  assert "optimizer state (zero=1 over dp=2):" in stdout and "(0.50x)" in stdout, stdout
  assert "0 of 74 slots kept whole" in stdout, stdout
  manifest = json.loads((tmp_path / "gpt_zero.manifest.json").read_text())
  assert manifest["zero"] == 1
  code, stdout, _ = _cli(["verify", TRAIN, str(out), "--steps", "3"], capsys)
  assert code == 0, stdout
  assert stdout.strip().splitlines()[-1].startswith("OK")
  code, stdout, err = _cli(["rewrite", TRAIN, "-o", str(tmp_path / "x.pb"), "--mesh",
                            "tp=2", "--zero", "2"], capsys)
  assert code == 2 and len(err.strip().splitlines()) == 1, err
  assert "no 'dp' axis of 2 or more" in err and not (tmp_path / "x.pb").exists()
