"""Fully sharded data parallelism (zero=3): the trainable weights split over
dp with their optimizer slots, each read gathered whole for its forward
readers and again, gated on the gradient, for its backward readers; the
gradients reduce-scattered into the blocks. Exact training, 1/dp of the
weights and slots per device, gathers ordered layer by layer."""
import collections
import json
import os

import numpy as np
import pytest
import tensorflow as tf

import tfsplit
from tfsplit.cli import run as cli_run
from tfsplit.errors import PlanError
from tfsplit.graph import load_graph
from tfsplit.passes import split_graph
from tfsplit.runtime.graph_function import import_graph
from tfsplit.runtime.split_function import make_mesh
from tfsplit.sharding import zero as zero_lib

from _util import (TIMEOUT, check_training, example, gather_the_local_block, names,
                   training_report)

BATCH = 16
TRAIN = os.path.join(os.path.dirname(__file__), "..", "examples", "gpt_raw_train_tiny.pb")

# (model, mesh, micro-batches)
CASES = [
    ("gpt_raw", "dp=2", 1),
    ("gpt_raw", "dp=2,tp=2", 1),     # biases split over tp*dp
    ("llama_keras3", "dp=2", 1),     # RMSNorm, rotary, GQA, gated MLP
]
SLOW_CASES = [
    ("gpt_raw", "dp=4", 1),
    ("gpt_raw", "dp=2", 4),
    ("gpt_raw", "dp=2,pp=2", 4),
    ("gpt_keras3", "dp=4", 1),
    ("gpt_tfkeras", "dp=2", 2),
    ("causallm_keras3", "dp=4", 1),  # tied embeddings
    ("llama_tfkeras", "dp=2,tp=2", 1),
    ("bert_tfkeras", "dp=2", 1),     # sparse Adam on the tables
    ("bert_keras3", "dp=4", 1),
    ("llama_keras3", "dp=2,pp=2", 4),
    ("moe_keras3", "dp=2,ep=2", 1),   # experts over ep, every weight over dp
]


def _train(name, mesh, m):
  return check_training(example(name, batch_size=BATCH), mesh=mesh, microbatches=m, zero=3)


def _check_split(step, name):
  result = step.result
  assert result.count("reduce_scatter", "dp") > 0 and result.count("all_gather", "dp") > 0
  weights = {n: e for n, e in result.manifest.items() if zero_lib.WEIGHT_KEY in e}
  assert weights
  # Every weight is split over dp; tf_keras's sparse Adam keeps the tables'
  # slots whole (ResourceScatterAdd), and says so.
  assert not [n for n, e in weights.items() if zero_lib.KEPT_KEY in e], weights
  for n, e in weights.items():
    assert any(d and "dp" in d.split("*") for d in e["sharding"]), (n, e["sharding"])
  kept = [e[zero_lib.KEPT_KEY] for e in result.manifest.values() if zero_lib.KEPT_KEY in e]
  assert all("ResourceScatterAdd" in why for why in kept), kept
  if "tfkeras" not in name:
    assert not kept


@pytest.mark.parametrize("name,mesh,m", CASES)
def test_training_is_exact(name, mesh, m):
  _check_split(_train(name, mesh, m), name)


@pytest.mark.slow
@pytest.mark.parametrize("name,mesh,m", SLOW_CASES)
def test_training_is_exact_more_models_and_meshes(name, mesh, m):
  _check_split(_train(name, mesh, m), name)


@pytest.mark.parametrize("name,mesh,options", [
    ("gpt_raw", "dp=2", {"recompute": "blocks"}),
    pytest.param("gpt_keras3", "dp=2,tp=2", {"recompute": "selective", "microbatches": 2},
                 marks=pytest.mark.slow),
])
def test_combines_with_recomputation(name, mesh, options):
  """Recomputed forward ops read the weights in the backward: through the
  backward's gathers."""
  step = check_training(example(name, batch_size=BATCH), mesh=mesh, zero=3, **options)
  _check_split(step, name)


@pytest.mark.parametrize("schedule", ["zb-h1", pytest.param("zb-h2", marks=pytest.mark.slow)])
def test_zero_bubble_schedules_run_the_backward_gathers_ungated(schedule):
  """A zero-bubble schedule orders weight gradients after input gradients;
  a gate on the gradient reaching a layer could close a cycle with it, so
  the backward gathers run ungated there. The split is acyclic and exact."""
  graph_def = load_graph(os.path.join(os.path.dirname(TRAIN), "gpt_raw_train_small.pb"))
  result = split_graph(graph_def, make_mesh("pp=2,dp=2"), microbatches=4, schedule=schedule,
                       zero=3, timeout_seconds=TIMEOUT)
  from tfsplit.runtime.verify import verify  # pylint: disable=import-outside-toplevel
  manifest = {"variables": result.manifest, "outputs": result.output_copies,
              "devices": result.mesh.devices}
  verify(graph_def, result.graph_def, manifest, steps=2).assert_ok(schedule)


# --- what each device holds --------------------------------------------------------
def test_each_device_holds_a_quarter_of_the_weights_and_slots():
  ex = example("gpt_raw", batch_size=BATCH)
  graph_def = load_graph(ex.concrete("train"), variable_names=names(ex))
  result = split_graph(graph_def, make_mesh("dp=4"), zero=3)
  for key in (zero_lib.WEIGHT_KEY, zero_lib.SLOT_OF_KEY):
    held, plain = zero_lib.optimizer_state_bytes(result.manifest, {"dp": 4}, key=key)
    assert len(held) == 4 and all(held[d] * 4 == plain[d] for d in held), (key, held, plain)
  # The weights as the variables give them: every one, a quarter each.
  total = sum(int(np.prod(v.shape)) * v.dtype.size for v, _ in names(ex) if v.trainable)
  held, _ = zero_lib.optimizer_state_bytes(result.manifest, {"dp": 4}, key=zero_lib.WEIGHT_KEY)
  assert all(b * 4 == total for b in held.values()), (held, total)
  lines = zero_lib.summary(result.manifest, {"dp": 4}, 3)
  assert any(line.startswith("  weights (zero=3 over dp)") and "0 of 37 weights kept whole"
             in line for line in lines), lines


# --- the gathers' order ------------------------------------------------------------
def _ancestors(nodes, start):
  seen, stack = set(), [start]
  while stack:
    for text in nodes[stack.pop()].input:
      src = text.lstrip("^").split(":")[0]
      if src not in seen:
        seen.add(src)
        stack.append(src)
  return seen


def _gathers(result, prefix):
  """The all-gathers on device 0 that the FSDP constraints named under
  `prefix` read (named after the constraint's gate, or the weight's read;
  in a layer's bucket, the Reshape of its piece under that name)."""
  nodes = {n.name: n for n in result.graph_def.node}
  device = result.mesh.devices[0]
  out = []
  for node in result.graph_def.node:
    if node.device == device and node.name.startswith(prefix) and \
        node.name.endswith("/fsdp_gather/shard_0"):
      src = nodes[node.input[0].split(":")[0]]
      # Its own collective, or its piece of its layer's bucket.
      assert src.op in ("CollectiveGatherV2", "Reshape"), (node.name, src.op)
      out.append(src.name)
  return out


def _forward_gathers(result, block):
  """The all-gathers of block `block`'s weights for its forward, on device 0."""
  return _gathers(result, f"gpt/block_{block}/")


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_layers_gather_runs_while_the_layer_before_computes(prefetch):
  """zero_prefetch=1: block 1's weight gathers wait for the embedding's
  compute, not for block 0's, so they run while block 0 computes; with 0
  they wait for block 0's."""
  result = split_graph(load_graph(TRAIN), make_mesh("dp=2"), zero=3, zero_prefetch=prefetch)
  nodes = {n.name: n for n in result.graph_def.node}

  def compute(ancestors, scope):
    return {a for a in ancestors if a.startswith(scope) and nodes[a].op in
            ("MatMul", "BatchMatMulV2", "GatherV2", "AddV2", "Mul")}

  blocks = sorted({int(n.split("/")[1].split("_")[1]) for n in nodes
                   if n.startswith("gpt/block_")})
  assert blocks == [0, 1]
  for block in blocks[1:]:
    gathers = _forward_gathers(result, block)
    assert gathers
    for gather in gathers:
      ancestors = _ancestors(nodes, gather)
      before = compute(ancestors, f"gpt/block_{block - 1}/")
      if prefetch:
        assert not before, (gather, sorted(before)[:3])
        earlier = "gpt/embed/" if block == 1 else f"gpt/block_{block - 2}/"
        assert compute(ancestors, earlier), gather
      else:
        assert before, gather


def test_the_backward_gathers_again_after_the_gradient_arrives():
  """A weight's forward gather is read by forward nodes only; its backward
  readers read their own gather, which waits for the gradient."""
  result = split_graph(load_graph(TRAIN), make_mesh("dp=2"), zero=3)
  nodes = {n.name: n for n in result.graph_def.node}
  readers = collections.defaultdict(set)
  for node in result.graph_def.node:
    for text in node.input:
      readers[text.lstrip("^").split(":")[0]].add(node.name)
  backward = _gathers(result, "gradient_tape/")
  forward = _gathers(result, "gpt/")
  assert backward and forward
  for gather in forward:
    assert not any(r.startswith("gradient_tape/") for r in _reach(readers, gather)), gather
  for name in backward:
    assert any(a.startswith(("gradient_tape/", "AddN")) for a in _ancestors(nodes, name)), name
  # One collective per layer and pass: each layer's forward gathers share
  # their gate, its backward ones the gradient reaching the layer, and each
  # set travels as one bucket (5 layers hold weights: embed, 2 blocks,
  # ln_f, head; the head's tied table is the embedding's).
  device = result.mesh.devices[0]
  gathers = [n for n in result.graph_def.node
             if n.op == "CollectiveGatherV2" and n.device == device]
  assert len(gathers) <= 2 * 5, [n.name for n in gathers]


def _reach(readers, start, views=("Identity", "Cast", "Reshape")):
  """The nodes reading `start`'s value (through the constraint's Identity)."""
  out, stack = set(), [start]
  while stack:
    for r in readers[stack.pop()]:
      if r not in out:
        out.add(r)
        if "/fsdp_gather" in r and not r.endswith("/after"):
          stack.append(r)
  return out


# --- the check fails when the split is wrong ---------------------------------------
def test_a_forward_gather_of_the_local_block_fails_the_exactness_check():
  """Each replica reads its own block twice instead of the gathered weight
  (the forward's all-gathers replaced by a concatenation of the local block
  with itself): the comparison with the plain run must fail."""
  ex = example("gpt_raw", batch_size=BATCH)
  variables = ex.all_variables()
  start = [v.numpy().copy() for v in variables]
  try:
    step = tfsplit.split(ex.train_step, mesh="dp=2", input_signature=ex.train_signature,
                         variable_names=names(ex), timeout_seconds=TIMEOUT, zero=3)
    graph_def = step.graph_def.__class__()
    graph_def.CopyFrom(step.graph_def)
    gathers = [n for n in graph_def.node if n.op == "CollectiveGatherV2" and
               "/fsdp_gather" in n.name and not n.name.startswith("gradient_tape/")]
    assert gathers
    gather_the_local_block(graph_def, gathers)
    step.runner._fn = import_graph(graph_def, step.variables)  # pylint: disable=protected-access
    report, _ = training_report(step, ex, ex.make_inputs("train", seed=11), 2)
    assert not report.ok
    assert any(c.kind == "loss" or "kernel" in c.what for c in report.failures)
  finally:
    for v, s in zip(variables, start):
      v.assign(s)


# --- options and the command line ----------------------------------------------------
@pytest.mark.parametrize("value", [-1, True, "1"])
def test_bad_prefetch_is_one_line(value):
  with pytest.raises(PlanError, match=r"zero_prefetch must be a non-negative integer") as info:
    split_graph(load_graph(TRAIN), make_mesh("dp=2"), zero=3, zero_prefetch=value)
  assert "\n" not in str(info.value)


def test_rewrite_flag_summary_and_verify(tmp_path, capsys):
  out = tmp_path / "gpt_fsdp.pb"
  code = cli_run(["tfsplit", "rewrite", TRAIN, "-o", str(out), "--mesh", "dp=2", "--zero",
                  "3", "--zero-prefetch", "2", "--collective-timeout", "60"])
  stdout = capsys.readouterr().out
  assert code == 0, stdout
  assert "weights (zero=3 over dp): " in stdout and "0 of 37 weights kept whole" in stdout
  assert "dp=2 splits the batch and 111 variables (weights and optimizer state)" in stdout
  manifest = json.loads((tmp_path / "gpt_fsdp.manifest.json").read_text())
  assert manifest["zero"] == 3
  code = cli_run(["tfsplit", "verify", TRAIN, str(out), "--steps", "3"])
  assert code == 0
  assert capsys.readouterr().out.strip().splitlines()[-1].startswith("OK")


# --- memory: the simulation of the split graph ---------------------------------------
def _deep_mlp_graph(layers=12, width=256, batch=4):
  """A chain of weight-heavy layers (a 256 KiB kernel each, tiny
  activations) trained by SGD: what FSDP's window is for."""
  weights = [tf.Variable(tf.random.stateless_normal([width, width], [i, 0], stddev=0.05),
                         name=f"layer_{i}/kernel") for i in range(layers)]

  @tf.function(input_signature=[tf.TensorSpec([batch, width])])
  def train(x):
    with tf.GradientTape() as tape:
      h = x
      for i, w in enumerate(weights):
        with tf.name_scope(f"layer_{i}"):
          h = tf.nn.relu(tf.matmul(h, w))
      loss = tf.reduce_mean(h * h)
    for w, g in zip(weights, tape.gradient(loss, weights)):
      w.assign_sub(0.1 * g)
    return loss

  return load_graph(train.get_concrete_function(),
                    variable_names=[(w, w.name.split(":")[0]) for w in weights])


def test_the_simulated_step_holds_a_few_whole_layers_not_the_model():
  """Per device: half the weights between steps; during the step, with
  each gradient reduce-scattered as it is made (bucket_bytes=0), the
  transient peak stays within four layers' weights (the gathers' window
  plus the layer's whole gradient), where zero=1 holds every whole weight
  and gradient. Default buckets hold up to bucket_bytes of whole gradients
  until their last member exists (here: all of them)."""
  from tfsplit.cost import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.cost import graph_sim  # pylint: disable=import-outside-toplevel
  graph_def = _deep_mlp_graph()
  layer = 256 * 256 * 4
  cluster = cluster_lib.from_preset("cpu-host", 2)

  def memory(**kwargs):
    result = split_graph(graph_def, make_mesh("dp=2"), **kwargs)
    return graph_sim.simulate_graph(result.graph_def, cluster).memory[0]

  zero1 = memory(zero=1)
  fsdp = memory(zero=3, bucket_bytes=0)
  bucketed = memory(zero=3)
  assert zero1.parameters == 12 * layer and fsdp.parameters == 6 * layer
  assert fsdp.transient_peak < 4 * layer < 12 * layer < zero1.transient_peak, (
      fsdp.transient_peak, zero1.transient_peak)
  assert bucketed.transient_peak > 11 * layer
  assert fsdp.peak < 0.4 * zero1.peak, (fsdp.peak, zero1.peak)


def test_a_traced_step_gathers_the_next_block_while_a_block_computes():
  """In a real step's trace (Grappler on), block 1's forward gather starts
  before block 0's last forward op ends, on every device."""
  from tfsplit.runtime import session as session_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import trace as trace_lib  # pylint: disable=import-outside-toplevel
  ex = example("gpt_raw", batch_size=BATCH)
  graph_def = load_graph(ex.concrete("train"), variable_names=names(ex))
  result = split_graph(graph_def, make_mesh("dp=2"), zero=3, timeout_seconds=TIMEOUT)
  nodes = {n.name: n for n in result.graph_def.node}
  runner = session_lib.SessionRunner(
      result.graph_def, session_lib.seeded_values(result.graph_def, result.manifest))
  runner.run(ex.make_inputs("train", seed=1))   # warm
  _, metadata = runner.run(ex.make_inputs("train", seed=1), trace=True)
  events = trace_lib.op_events(metadata)
  for d, device in enumerate(result.mesh.devices):
    gathers = {a for n in nodes if n.startswith("gpt/block_1/") and
               n.endswith(f"/fsdp_gather/shard_{d}")
               for a in _ancestors(nodes, n) | {n}
               if nodes[a].op == "CollectiveGatherV2"}
    gathers -= {a for n in nodes if n.startswith("gpt/block_0/") and
                n.endswith(f"/fsdp_gather/shard_{d}") for a in _ancestors(nodes, n)}
    assert gathers, d
    starts = [start for _, name, start, _ in events if name in gathers]
    ends = [end for dev, name, _, end in events
            if name.startswith("gpt/block_0/") and name.endswith(f"shard_{d}") and
            nodes.get(name) is not None and nodes[name].op in ("MatMul", "BatchMatMulV2")]
    assert starts and ends, (d, len(starts), len(ends))
    assert min(starts) < max(ends), (device, min(starts), max(ends))
