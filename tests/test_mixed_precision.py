"""Mixed-precision training steps: split, verified to their precision.

A Keras 3 causal LM under `mixed_bfloat16` (bf16 compute, float32 weights
and Adam) and under `mixed_float16` with its LossScaleOptimizer is split and
`verify`-ed: both graphs raised to float32 must agree as any float32 split
does, and the graphs as they are must stay, shard by shard, within the
precision's own spread from float32 (graph/precision.py, runtime/verify.py).
A shard whose step is 10% too large fails.
"""
import numpy as np
import pytest
from tensorflow.core.framework import graph_pb2
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import tensor_util

from tfsplit.graph import load_graph
from tfsplit.graph import precision as precision_lib
from tfsplit.graph import variables as variables_lib
from tfsplit.layout.mesh import Mesh
from tfsplit.passes import split_graph
from tfsplit.runtime import compare
from tfsplit.runtime.verify import verify

from _util import TIMEOUT, example, names

KERNEL = "causallm/backbone/block_0/mlp/fc1/kernel"
_GRAPHS = {}


def _graph(name, precision):
  key = (name, precision)
  if key not in _GRAPHS:
    import models  # pylint: disable=import-outside-toplevel
    ex = models.build(name, "tiny", seed=0, precision=precision)
    _GRAPHS[key] = load_graph(ex.concrete("train"), variable_names=names(ex))
  return _GRAPHS[key]


def _split(graph_def, mesh_text, microbatches=1, **options):
  axes = Mesh.parse(mesh_text).axes
  size = int(np.prod(list(axes.values())))
  mesh = Mesh(axes, [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(size)])
  result = split_graph(graph_def, mesh, timeout_seconds=TIMEOUT, microbatches=microbatches,
                       **options)
  return result.graph_def, {"variables": result.manifest, "outputs": result.output_copies,
                            "devices": mesh.devices}


def _reduced_types(graph_def):
  found = set()
  for node in graph_def.node:
    for value in node.attr.values():
      found.update(t for t in precision_lib._types(value)  # pylint: disable=protected-access
                   if t in precision_lib.REDUCED)
  return found


def test_precision_is_found_and_raised():
  bf16 = _graph("causallm_keras3", "mixed_bfloat16")
  assert precision_lib.compute_precision(bf16) == "bfloat16"
  assert precision_lib.compute_precision(_graph("causallm_keras3", "mixed_float16")) == \
      "float16"
  assert precision_lib.compute_precision(_graph("causallm_keras3", None)) == "float32"
  raised = precision_lib.promoted(bf16)
  assert _reduced_types(bf16) and not _reduced_types(raised)
  assert precision_lib.compute_precision(raised) == "float32"
  # The input is left as it was.
  assert precision_lib.compute_precision(bf16) == "bfloat16"


def test_raised_split_reads_other_instance_keys():
  """TF keeps a collective key's dtype for the process: the raised graph's
  collectives read keys of their own, the same on every member."""
  rewritten, _ = _split(_graph("causallm_keras3", "mixed_bfloat16"), "tp=2")
  raised = precision_lib.promoted(rewritten)

  def keys(graph_def):
    nodes = {n.name: n for n in graph_def.node}
    out = {}
    for n in graph_def.node:
      if n.op == "CollectiveReduceV2":
        const = nodes[n.input[3]]
        out[n.name] = int(tensor_util.MakeNdarray(const.attr["value"].tensor))
    return out

  before, after = keys(rewritten), keys(raised)
  assert before and set(before) == set(after)
  assert not set(before.values()) & set(after.values())
  # Members that shared a key still share one.
  pairs = {}
  for name, key in before.items():
    pairs.setdefault(key, set()).add(after[name])
  assert all(len(v) == 1 for v in pairs.values())


def _check(report, context):
  report.assert_ok(context)
  kinds = {c.what.split(":", 1)[0] for c in report.comparisons}
  assert kinds == {"float32", report.precision}, kinds
  assert any("RMS" in c.note for c in report.comparisons)


@pytest.mark.parametrize("mesh", ["tp=2", "dp=2"])
def test_bf16_split_is_exact_to_its_precision(mesh):
  original = _graph("causallm_keras3", "mixed_bfloat16")
  rewritten, manifest = _split(original, mesh)
  report = verify(original, rewritten, manifest, steps=3)
  assert report.precision == "bfloat16"
  _check(report, mesh)
  assert "in bfloat16, each shard's RMS update error" in report.table()


@pytest.mark.slow
@pytest.mark.parametrize("name,precision,mesh,microbatches", [
    ("causallm_keras3", "mixed_bfloat16", "dp=2,tp=2", 1),
    ("causallm_keras3", "mixed_bfloat16", "pp=2", 4),
    ("bert_keras3", "mixed_bfloat16", "tp=2", 1),
    ("bert_keras3", "mixed_bfloat16", "dp=2,tp=2", 1),
    ("causallm_keras3", "mixed_float16", "dp=2", 1),
    ("llama_keras3", "mixed_bfloat16", "tp=2", 1),
    ("llama_tfkeras", "mixed_bfloat16", "dp=2,tp=2", 1),
    ("causallm_tfkeras", "mixed_bfloat16", "tp=2", 1),
    ("bert_tfkeras", "mixed_float16", "dp=2", 1),
    ("vit_keras3", "mixed_bfloat16", "tp=2", 1),
    ("moe_keras3", "mixed_bfloat16", "tp=2", 1),
    ("moe_keras3", "mixed_bfloat16", "dp=2", 2),
    ("switch_tfkeras", "mixed_bfloat16", "dp=2", 1),
    ("switch_keras3", "mixed_float16", "dp=2", 1),
])
def test_mixed_precision_meshes(name, precision, mesh, microbatches):
  original = _graph(name, precision)
  rewritten, manifest = _split(original, mesh, microbatches)
  _check(verify(original, rewritten, manifest, steps=3), f"{name} {precision} {mesh}")


@pytest.mark.parametrize("precision,mesh,options", [
    ("mixed_bfloat16", "tp=2", {"recompute": "blocks"}),
    ("mixed_bfloat16", "dp=2", {"zero": 1}),
    pytest.param("mixed_bfloat16", "dp=2,tp=2", {"zero": 2, "recompute": "selective"},
                 marks=pytest.mark.slow),
    pytest.param("mixed_bfloat16", "tp=2", {"offload": "optimizer", "offload_device":
                 "/job:localhost/replica:0/task:0/device:CPU:3"}, marks=pytest.mark.slow),
    pytest.param("mixed_float16", "dp=2", {"zero": 1}, marks=pytest.mark.slow),
    pytest.param("mixed_bfloat16", "dp=2", {"zero": 3}, marks=pytest.mark.slow),
    pytest.param("mixed_float16", "dp=2,tp=2", {"zero": 3}, marks=pytest.mark.slow),
    pytest.param("mixed_float16", "tp=2", {"recompute": "blocks"}, marks=pytest.mark.slow),
])
def test_memory_options_under_mixed_precision(precision, mesh, options):
  """Recompute, optimizer-state sharding and offload on a 16-bit step: the
  recomputed forward is bf16 as the original, ZeRO's slots float32."""
  original = _graph("causallm_keras3", precision)
  rewritten, manifest = _split(original, mesh, **options)
  _check(verify(original, rewritten, manifest, steps=3), f"{precision} {mesh} {options}")


def _raw_bf16_step():
  """A two-layer MLP step written in raw TF that casts to bfloat16 by hand:
  float32 weights, bf16 matmuls, the loss and plain SGD in float32."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  w1 = tf.Variable(rng.standard_normal((32, 64)).astype(np.float32) * 0.1, name="w1")
  b1 = tf.Variable(np.zeros(64, np.float32), name="b1")
  w2 = tf.Variable(rng.standard_normal((64, 16)).astype(np.float32) * 0.1, name="w2")
  variables = [w1, b1, w2]

  @tf.function(input_signature=[tf.TensorSpec([16, 32], tf.float32),
                                tf.TensorSpec([16], tf.int32)], autograph=False)
  def step(x, labels):
    with tf.GradientTape() as tape:
      h = tf.matmul(tf.cast(x, tf.bfloat16), tf.cast(w1, tf.bfloat16)) + \
          tf.cast(b1, tf.bfloat16)
      h = tf.nn.gelu(h)
      logits = tf.matmul(h, tf.cast(w2, tf.bfloat16))
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=labels, logits=tf.cast(logits, tf.float32)))
    for v, g in zip(variables, tape.gradient(loss, variables)):
      v.assign_sub(0.1 * g)
    return loss

  return load_graph(step.get_concrete_function(),
                    variable_names=[(v, v.name.split(":")[0]) for v in variables])


@pytest.mark.parametrize("mesh", ["tp=2", "dp=2,tp=2"])
def test_raw_tf_step_cast_to_bf16_by_hand(mesh):
  original = _raw_bf16_step()
  assert precision_lib.compute_precision(original) == "bfloat16"
  rewritten, manifest = _split(original, mesh)
  assert any(any(e["sharding"]) for e in manifest["variables"].values())
  _check(verify(original, rewritten, manifest, steps=3), mesh)


def _scale_step(graph_def, manifest, variable):
  """Device 0's step of `variable` 10% too large (its Adam update x 1.1)."""
  broken = graph_pb2.GraphDef()
  broken.CopyFrom(graph_def)
  shard = manifest["variables"][variable]["shards"][0]["name"]
  handles = {n.name for n in broken.node if variables_lib.VAR_NAME_ATTR in n.attr and
             n.attr[variables_lib.VAR_NAME_ATTR].s.decode() == shard}
  (update,) = [n for n in broken.node if n.op.startswith(("Assign", "ResourceApply"))
               and n.input[0] in handles]
  const = broken.node.add(name="mutation/scale", op="Const", device=update.device)
  const.attr["dtype"].type = types_pb2.DT_FLOAT
  const.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(np.float32(1.1)))
  mul = broken.node.add(name="mutation/scaled", op="Mul", device=update.device,
                        input=[update.input[1], const.name])
  mul.attr["T"].type = types_pb2.DT_FLOAT
  update.input[1] = mul.name
  return broken


def test_a_shard_ten_percent_wrong_fails_in_both_precisions():
  original = _graph("causallm_keras3", "mixed_bfloat16")
  rewritten, manifest = _split(original, "tp=2")
  report = verify(original, _scale_step(rewritten, manifest, KERNEL), manifest, steps=3)
  assert not report.ok and "MISMATCH" in report.table()
  failed = {c.what.split(":", 1)[0] for c in report.failures if KERNEL in c.what}
  # Found by the float32 check and by the RMS check in bfloat16 alone.
  assert failed == {"float32", "bfloat16"}, report.table()
  rms = [c for c in report.failures if c.what.startswith("bfloat16") and "RMS" in c.note]
  assert rms and all(KERNEL in c.what and "CPU:0" in c.what for c in rms)


def test_rms_comparison_tells_rounding_from_a_wrong_shard():
  rng = np.random.default_rng(0)
  start = rng.standard_normal((64, 32)).astype(np.float32)
  update = 1e-3 * rng.standard_normal((64, 32))
  want = start + update
  spread = 2e-3 * np.abs(update).mean() * rng.standard_normal((64, 32))
  rounded = want + spread
  assert compare.compare_rms("w", rounded, want, start, spread).ok
  wrong = start + 1.1 * update
  assert not compare.compare_rms("w", wrong, want, start, spread).ok
  with pytest.raises(ValueError, match="float32 reference"):
    compare.compare_variables(None, {"w": start}, {"w": want}, {"w": rounded},
                              precision="bfloat16")


@pytest.mark.parametrize("name,mesh,microbatches", [
    ("causallm_keras3", "tp=2", 1),
    pytest.param("causallm_keras3", "dp=2,tp=2", 1, marks=pytest.mark.slow),
    pytest.param("causallm_keras3", "pp=2", 4, marks=pytest.mark.slow),
    pytest.param("bert_tfkeras", "tp=2", 1, marks=pytest.mark.slow),
    pytest.param("llama_keras3", "dp=2,tp=2", 1, marks=pytest.mark.slow),
])
def test_loss_scale_optimizer_splits_inside_its_conditional(name, mesh, microbatches):
  """The update under LossScaleOptimizer runs inside a functional If (apply
  when every gradient is finite); lowered to Switch/Merge, its branches are
  split like the rest, the predicate global."""
  original = _graph(name, "mixed_float16")
  assert not any(n.op in ("If", "StatelessIf") for n in original.node)
  assert any(n.op == "Switch" for n in original.node)
  rewritten, manifest = _split(original, mesh, microbatches)
  _check(verify(original, rewritten, manifest, steps=3), f"{name} {mesh}")


def _finite_checks(graph_def, device_id):
  """{IsFinite node: the all-reduce of its count} on device `device_id`: the
  checks of split gradients, whose counts are summed over the shards."""
  nodes = {n.name: n for n in graph_def.node}
  found = {}
  for node in graph_def.node:
    if node.op == "CollectiveReduceV2" and node.device.endswith(f"CPU:{device_id}"):
      source = node
      for _ in range(4):
        source = nodes[source.input[0].split(":")[0]]
        if source.op == "IsFinite":
          found[source.name] = node.name
          break
  return found


def _inf_on_one_shard(graph_def, device_id):
  """`graph_def` with an inf in what the finite check of a split gradient
  reads on device `device_id` alone (its update reads the gradient as it is)."""
  broken = graph_pb2.GraphDef()
  broken.CopyFrom(graph_def)
  name = sorted(_finite_checks(broken, device_id))[0]
  check = next(n for n in broken.node if n.name == name)
  const = broken.node.add(name="mutation/inf", op="Const", device=check.device)
  const.attr["dtype"].type = check.attr["T"].type
  const.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(
      np.float32(np.inf), dtype=check.attr["T"].type))
  mul = broken.node.add(name="mutation/overflow", op="Mul", device=check.device,
                        input=[check.input[0], const.name])
  mul.attr["T"].type = check.attr["T"].type
  check.input[0] = mul.name
  return broken


def _one_step(graph_def, manifest, values, inputs):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import shards as shards_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime.graph_function import import_graph  # pylint: disable=import-outside-toplevel
  variables = shards_lib.create_shard_variables(manifest, values)
  import_graph(graph_def, variables)(*[tf.constant(x) for x in inputs])
  return {k: v.numpy() for k, v in variables.items()}


def test_an_inf_in_one_shard_skips_the_step_on_every_device():
  """At tp=2 an overflow in one device's shard of one gradient skips the
  update on both devices and halves the scale on both: the predicate is the
  global finite check (each shard's count of non-finite values, summed over
  the shards: graph/counted_reductions.py). Checked against a graph whose
  device 0 reads its own shards' counts only, which then updates alone."""
  from tfsplit.graph import Graph  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import seeds  # pylint: disable=import-outside-toplevel
  original = _graph("causallm_keras3", "mixed_float16")
  rewritten, manifest = _split(original, "tp=2")
  values = seeds.seeded_variable_values(Graph(original), 0)
  inputs = seeds.seeded_inputs(Graph(original), 0)
  manifest = manifest["variables"]
  scale = next(n for n in manifest if n.endswith("dynamic_scale"))
  kernel = manifest[KERNEL]["shards"]

  def changed(after):
    return [s["device"][-5:] for s in kernel
            if not np.array_equal(after[s["name"]], values[KERNEL][
                tuple(slice(o, o + n) for o, n in zip(s["offsets"], s["shape"]))])]

  ran = _one_step(rewritten, manifest, values, inputs)
  assert changed(ran) == ["CPU:0", "CPU:1"]
  broken = _inf_on_one_shard(rewritten, 1)
  skipped = _one_step(broken, manifest, values, inputs)
  assert changed(skipped) == []
  assert [skipped[s["name"]] for s in manifest[scale]["shards"]] == \
      [values[scale] / 2] * len(manifest[scale]["shards"])
  # A local predicate on device 0 (its own shards' counts, not their sums)
  # lets device 0 step while device 1 skips: what the test would catch.
  local = graph_pb2.GraphDef()
  local.CopyFrom(broken)
  summed = set(_finite_checks(local, 0).values())
  nodes = {n.name: n for n in local.node}
  for node in local.node:
    if node.op == "Equal" and node.input[0] in summed:
      # The all-reduce still runs (device 1 waits for it), unread.
      node.input.append("^" + node.input[0])
      node.input[0] = nodes[node.input[0]].input[0]
  assert changed(_one_step(local, manifest, values, inputs)) == ["CPU:0"]


def test_examples_take_the_precision_of_their_policy():
  ex = example("causallm_keras3")
  assert all(v.dtype.name == "float32" for v in ex.variables)
  import models  # pylint: disable=import-outside-toplevel
  with pytest.raises(TypeError, match="corpus"):
    models.build("gpt_raw", "tiny", precision="mixed_bfloat16")


def test_rewrite_and_verify_a_bf16_graph_file(tmp_path, capsys):
  """`tfsplit rewrite` says what dtype its collectives move: at tp=2 the
  split activations travel as bf16, at dp=2 the float32 gradients as
  float32; `tfsplit verify` checks both precisions."""
  from tfsplit.cli import run  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import save_graph  # pylint: disable=import-outside-toplevel
  source = tmp_path / "causallm_bf16.pb"
  save_graph(_graph("causallm_keras3", "mixed_bfloat16"), str(source))
  lines = {}
  for mesh in ("tp=2", "dp=2"):
    out = tmp_path / f"split_{mesh[:2]}.pb"
    assert run(["tfsplit", "rewrite", str(source), "-o", str(out), "--mesh", mesh,
                "--collective-timeout", "60"]) == 0
    lines[mesh] = next(line for line in capsys.readouterr().out.splitlines()
                       if "collective tensors:" in line)
  assert "MB bfloat16" in lines["tp=2"], lines
  assert "MB float32" in lines["dp=2"] and "bfloat16" not in lines["dp=2"], lines
  assert run(["tfsplit", "verify", str(source), str(tmp_path / "split_tp.pb"),
              "--steps", "2"]) == 0
  stdout = capsys.readouterr().out
  assert "in bfloat16, each shard's RMS update error" in stdout
  assert stdout.strip().splitlines()[-1].startswith("OK")


def test_loss_scale_drop_skips_the_step_on_every_replica():
  """mixed_float16 under LossScaleOptimizer at dp=2: a scale that overflows
  float16 skips the update on every replica and halves the scale on every
  replica, as the unsplit step does."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import models  # pylint: disable=import-outside-toplevel
  import tfsplit  # pylint: disable=import-outside-toplevel
  ex = models.build("causallm_keras3", "tiny", seed=0, precision="mixed_float16")
  scale = next(v for v in ex.optimizer.variables if v.path.endswith("dynamic_scale"))
  scale.assign(2.0 ** 40)
  start = {n: v.numpy().copy() for v, n in names(ex)}
  step = tfsplit.split(ex.train_step, input_signature=ex.train_signature,
                       variable_names=names(ex), timeout_seconds=TIMEOUT, mesh="dp=2")
  inputs = [tf.constant(x) for x in ex.make_inputs("train", seed=11)]
  split_loss = float(step(*inputs))
  values = step.shard_values()
  scale_name = next(n for v, n in names(ex) if v is scale or n.endswith("dynamic_scale"))
  scales = [values[s["name"]] for s in step.manifest[scale_name]["shards"]]
  assert len(scales) == 2 and all(s == 2.0 ** 39 for s in scales), scales
  for name, entry in step.manifest.items():
    if "backbone" in name and "adam" not in name:
      for shard in entry["shards"]:
        np.testing.assert_array_equal(values[shard["name"]], start[name], err_msg=name)
  want_loss = float(ex.train_step(*inputs))
  assert scale.numpy() == 2.0 ** 39
  np.testing.assert_allclose(split_loss, want_loss, rtol=1e-3)


@pytest.mark.slow  # 33 s; the fp32 estimates run in CI (test_graph_cost.py)
@pytest.mark.parametrize("spec", ["causallm_keras3:small:mixed_bfloat16"])
def test_memory_estimate_of_a_bf16_step_within_15_percent_of_allocator_peak(spec):
  """The graph's memory simulation counts each tensor in its own dtype:
  2-byte activations, float32 weights and Adam slots."""
  import bench_estimate  # pylint: disable=import-outside-toplevel
  r = bench_estimate.run_one(spec, with_time=False)
  fp32 = bench_estimate.run_one(spec.rsplit(":", 1)[0], with_time=False)
  assert r["estimated_peak"] == pytest.approx(r["measured_peak"], rel=0.15), r
  # The bf16 step needs less than the float32 one, in the estimate as on the allocator.
  assert r["measured_peak"] < fp32["measured_peak"] and \
      r["estimated_peak"] < fp32["estimated_peak"], (r, fp32)


def test_logical_reductions_as_counts_are_exact():
  """All / Any over every axis, some axes, keep_dims, written as counts,
  give what TF's own ops give (graph/counted_reductions.py)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.counted_reductions import counted_logical_reductions  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime.graph_function import import_graph  # pylint: disable=import-outside-toplevel

  @tf.function(input_signature=[tf.TensorSpec([4, 6, 8], tf.float32)])
  def checks(x):
    finite = tf.math.is_finite(x)
    return (tf.reduce_all(finite), tf.reduce_any(x > 2.0), tf.reduce_all(finite, axis=[0, 2]),
            tf.reduce_any(x > 1.0, axis=1, keepdims=True))

  graph_def = load_graph(checks.get_concrete_function())
  counted, n = counted_logical_reductions(graph_def)
  assert n == 4 and not {"All", "Any"} & {node.op for node in counted.node}
  rng = np.random.default_rng(0)
  for case in range(4):
    x = rng.standard_normal((4, 6, 8)).astype(np.float32)
    if case % 2:
      x[rng.integers(4), rng.integers(6), rng.integers(8)] = np.inf
    if case == 3:
      x[:] = -np.inf
    want = [o.numpy() for o in checks(tf.constant(x))]
    got = [o.numpy() for o in import_graph(counted)(tf.constant(x))]
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)


def test_finite_check_moves_one_count_per_split_gradient():
  """At tp=2 the loss-scale optimizer's finite check all-reduces one float32
  count per split gradient instead of all-gathering its mask."""
  original = _graph("causallm_keras3", "mixed_float16")
  mesh = Mesh({"tp": 2}, [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2)])
  result = split_graph(original, mesh, timeout_seconds=TIMEOUT)
  assert not [c for c in result.collectives if c.kind == "all_gather"]
  counts = [c for c in result.collectives if c.tensor.endswith("/count")]
  assert counts and all(c.num_elements == 1 and c.dtype == types_pb2.DT_FLOAT
                        for c in counts)


def test_stage_boundary_bytes_halve_in_bf16():
  """What crosses pipeline stages travels in the graph's dtype: a bf16
  step's activations and their gradients move half the float32 step's
  bytes (`tfsplit rewrite` prints the line)."""
  from tfsplit.runtime.rewrite import stage_boundary_bytes  # pylint: disable=import-outside-toplevel
  floats = {}
  for precision in (None, "mixed_bfloat16"):
    original = _graph("causallm_keras3", precision)
    mesh = Mesh({"pp": 2}, [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2)])
    result = split_graph(original, mesh, timeout_seconds=TIMEOUT, microbatches=2)
    count, by_dtype = stage_boundary_bytes(original, result.stage_of)
    assert count > 0
    floats[precision] = {d: mb for d, mb in by_dtype if "float" in d}
  assert set(floats[None]) == {"float32"}
  bf16 = floats["mixed_bfloat16"]
  assert bf16["bfloat16"] / sum(bf16.values()) > 0.99, bf16
  assert sum(bf16.values()) == pytest.approx(floats[None]["float32"] / 2, rel=0.01)


def test_loss_scaled_pipeline_keeps_each_slot_on_its_weights_stage():
  """Under the loss-scale optimizer the updates run in the conditional's
  branch, reading each slot through the branch's argument: the slots still
  live and update on their weight's stage, so a step sends no optimizer
  state across stages (only activations, their gradients and the finite
  check's scalars)."""
  from tfsplit.runtime.rewrite import stage_boundary_bytes  # pylint: disable=import-outside-toplevel
  original = _graph("causallm_keras3", "mixed_float16")
  rewritten, manifest = _split(original, "pp=2", microbatches=2)
  variables = manifest["variables"]
  checked = 0
  for name, entry in variables.items():
    for kind in ("momentum", "velocity"):
      slot = "adam/" + name.replace("/", "_") + "_" + kind
      if slot in variables:
        assert [s["device"] for s in variables[slot]["shards"]] == \
            [s["device"] for s in entry["shards"]], slot
        checked += 1
  assert checked > 20
  mesh = Mesh({"pp": 2}, [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2)])
  result = split_graph(original, mesh, timeout_seconds=TIMEOUT, microbatches=2)
  by_dtype = dict(stage_boundary_bytes(original, result.stage_of)[1])
  # Every Adam slot of the second stage crossing would be 0.3 MB of float32.
  assert by_dtype["float32"] < by_dtype["float16"], by_dtype


def test_planner_prices_a_bf16_step_in_its_own_dtypes():
  """The planner's profile of a bf16 step: float32 weights and Adam slots
  as in the float32 step, half the bytes at each stage cut (the top-level
  cast of the logits to float32 runs with the last layer, not before the
  first), and per-device memory that tracks the rewritten graph's simulated
  peak as closely as the float32 step's does."""
  from tfsplit import plan as plan_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.commands.plan_cmd import simulate_top  # pylint: disable=import-outside-toplevel
  from tfsplit.plan import costing as costing_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.plan import space  # pylint: disable=import-outside-toplevel
  spec = plan_lib.cluster_for("h100-80gb", 2)
  profiles, ratios = {}, {}
  for precision in (None, "mixed_bfloat16"):
    graph_def = _graph("causallm_keras3", precision)
    profile = plan_lib.profile_graph(graph_def, 2, spec)
    costing = costing_lib.Costing(profile, spec)
    half = costing.n // 2
    estimates = [costing.evaluate(space.Candidate(1, 1, 1), [(0, costing.n)]),
                 costing.evaluate(space.Candidate(1, 1, 2, microbatches=2),
                                  [(0, half), (half, costing.n)])]
    simulated = simulate_top(graph_def, estimates, spec, profile)
    profiles[precision] = profile
    ratios[precision] = [e.memory / s["simulated_memory"] for e, s in zip(estimates, simulated)]
  fp32, bf16 = profiles[None], profiles["mixed_bfloat16"]
  assert [(r.params, r.slots) for r in bf16.layers] == [(r.params, r.slots) for r in fp32.layers]
  assert sum(r.activations for r in bf16.layers) < 0.8 * sum(r.activations for r in fp32.layers)
  assert sum(bf16.cuts) == pytest.approx(sum(fp32.cuts) / 2, rel=0.1), (bf16.cuts, fp32.cuts)
  for got, want in zip(ratios["mixed_bfloat16"], ratios[None]):
    assert 0.5 < got < 2 and got == pytest.approx(want, rel=0.15), ratios


def _lowered_split(original, mesh_text, **options):
  from tfsplit.passes import manifest as manifest_lib  # pylint: disable=import-outside-toplevel
  axes = Mesh.parse(mesh_text).axes
  mesh = Mesh(axes, [f"/job:localhost/replica:0/task:0/device:CPU:{i}"
                     for i in range(int(np.prod(list(axes.values()))))])
  result = split_graph(original, mesh, timeout_seconds=TIMEOUT, **options)
  return result, manifest_lib.build(result)


def _gradient_bytes(result):
  from tfsplit.runtime.rewrite import _bytes_by_dtype  # pylint: disable=import-outside-toplevel
  return {kind: dict(by) for kind, by in _bytes_by_dtype(result.collectives)}


@pytest.mark.parametrize("mesh,options", [
    ("dp=2", {}),
    pytest.param("dp=2", {"zero": 1}, marks=pytest.mark.slow),
    pytest.param("dp=2", {"microbatches": 2, "bucket_bytes": 0}, marks=pytest.mark.slow),
])
def test_gradients_reduced_in_bf16_move_half_the_bytes(mesh, options):
  """gradient_reduce_dtype='bfloat16': the float32 gradients of a float32
  step cross dp in bfloat16, half the bytes (buckets and single tensors,
  all-reduce or ZeRO's reduce-scatter), the weights' all-gathers stay
  float32. Raised to float32 the split is exact; as it is, each update is
  held to the spread of the original with its gradients rounded once, and a
  shard 10% wrong still fails both checks."""
  original = _graph("causallm_keras3", None)
  exact, _ = _lowered_split(original, mesh, **options)
  result, manifest = _lowered_split(original, mesh, gradient_reduce_dtype="bfloat16",
                                    **options)
  kind = "reduce_scatter" if options.get("zero") else "all_reduce"
  want, got = _gradient_bytes(exact), _gradient_bytes(result)
  assert got[kind]["bfloat16"] == pytest.approx(want[kind]["float32"] / 2, rel=1e-3)
  assert got.get("all_gather") == want.get("all_gather")
  lowered = [n for n in result.graph_def.node if n.op.startswith("Collective")
             and n.attr["T"].type == types_pb2.DT_BFLOAT16]
  assert lowered and _reduced_types(original) == set()
  tensors = manifest["gradient_reduce"]["tensors"]
  assert len(tensors) == sum(c.kind == kind for c in result.collectives) - \
      sum(c.kind == kind and c.dtype == types_pb2.DT_FLOAT for c in result.collectives)
  report = verify(original, result.graph_def, manifest, steps=3)
  assert report.ok, report.table()
  assert report.precision == "bfloat16"
  assert {c.what.split(":", 1)[0] for c in report.comparisons} == {"float32", "bfloat16"}
  if options:
    return
  broken = verify(original, _scale_step(result.graph_def, manifest, KERNEL), manifest,
                  steps=3)
  failed = {c.what.split(":", 1)[0] for c in broken.failures if KERNEL in c.what}
  assert failed == {"float32", "bfloat16"}, broken.table()


def test_gradient_reduce_dtype_needs_a_data_axis_and_a_known_dtype():
  from tfsplit.errors import PlanError  # pylint: disable=import-outside-toplevel
  original = _graph("causallm_keras3", None)
  with pytest.raises(PlanError, match="no 'dp' axis"):
    _lowered_split(original, "tp=2", gradient_reduce_dtype="bfloat16")
  with pytest.raises(PlanError, match="unknown gradient reduce dtype 'int8'"):
    _lowered_split(original, "dp=2", gradient_reduce_dtype="int8")


@pytest.mark.slow  # the API form runs in CI (test_gradients_reduced_in_bf16_move_half_the_bytes)
def test_rewrite_reduces_gradients_in_bf16_on_request(tmp_path, capsys):
  """`tfsplit rewrite --gradient-reduce-dtype bfloat16` says the gradients
  travel in bfloat16 and the manifest records it, so `tfsplit verify` holds
  the step to bfloat16's spread; without dp it is refused in one line."""
  from tfsplit.cli import run  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import save_graph  # pylint: disable=import-outside-toplevel
  source, out = tmp_path / "causallm.pb", tmp_path / "split.pb"
  save_graph(_graph("causallm_keras3", None), str(source))
  assert run(["tfsplit", "rewrite", str(source), "-o", str(out), "--mesh", "dp=2",
              "--gradient-reduce-dtype", "bfloat16", "--collective-timeout", "60"]) == 0
  line = next(l for l in capsys.readouterr().out.splitlines() if "collective tensors:" in l)
  assert "MB bfloat16" in line, line
  assert run(["tfsplit", "verify", str(source), str(out), "--steps", "2"]) == 0
  stdout = capsys.readouterr().out
  assert "in bfloat16, each shard's RMS update error" in stdout
  assert stdout.strip().splitlines()[-1].startswith("OK")
  refused = tmp_path / "refused.pb"
  assert run(["tfsplit", "rewrite", str(source), "-o", str(refused), "--mesh", "tp=2",
              "--gradient-reduce-dtype", "bfloat16"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "no 'dp' axis" in err[0] and not refused.exists()


def test_fsdp_gathers_16_bit_weights_in_16_bits_on_request():
  """zero=3 with zero_gather_compute_dtype: each weight the forward reads
  only cast to float16 is cast on its block and gathered in float16 (every
  weight gather of the Keras 3 model's kernels), exact to its precision;
  bfloat16, which CollectiveGatherV2 does not take, is gathered in float32
  (a GPU graph that imports into TF)."""
  import collections  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import placement  # pylint: disable=import-outside-toplevel
  original = _graph("causallm_keras3", "mixed_float16")
  dtypes = {}
  for option in (False, True):
    rewritten, manifest = _split(original, "dp=2", zero=3, zero_gather_compute_dtype=option)
    dtypes[option] = collections.Counter(
        n.attr["T"].type for n in rewritten.node
        if n.op == "CollectiveGatherV2" and n.device.endswith("CPU:0"))
    _check(verify(original, rewritten, manifest, steps=3), f"gather in compute dtype {option}")
  assert 19 not in dtypes[False] and dtypes[True][19] > 0, dtypes   # DT_HALF
  # bfloat16 (which CollectiveGatherV2 does not take) stays gathered in float32.
  bf16 = _graph("causallm_keras3", "mixed_bfloat16")
  gpus = placement.device_names("gpu", 2)
  result = split_graph(bf16, placement.make_mesh("dp=2", devices=gpus), zero=3,
                       zero_gather_compute_dtype=True)
  assert {n.attr["T"].type for n in result.graph_def.node
          if n.op == "CollectiveGatherV2"} <= {1, 3}     # float32, int32
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  with tf.Graph().as_default():
    tf.graph_util.import_graph_def(result.graph_def, name="")
