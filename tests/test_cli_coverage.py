"""`tfsplit inspect`, `rewrite` and `verify`: each flag checked by what it does.

Every test reads the command's outputs (the report, the rewritten GraphDef,
its manifest) and compares them with values computed here independently
(from the example model zoo or a direct parse of the GraphDef bytes), so a
flag that is parsed but ignored, or a number that is computed wrongly, fails.
"""
import collections
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.framework import tensor_util

from tfsplit.cli import run
from tfsplit.graph import Graph, find_variables, load_graph, save_graph
from tfsplit.report import human_count

import models  # examples/models (see conftest.py)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
EXAMPLES = os.path.join(ROOT, "examples")
GPT = os.path.join(EXAMPLES, "gpt_raw_train_tiny.pb")
MLP = os.path.join(EXAMPLES, "mlp_raw_train_tiny.pb")
CPU = "/job:localhost/replica:0/task:0/device:CPU:{}".format
_MODELS = {}


def _cli(args, capsys):
  code = run(["tfsplit"] + [str(a) for a in args])
  out = capsys.readouterr()
  return code, out.out, out.err


def _model(name):
  if name not in _MODELS:
    _MODELS[name] = models.build(name, size="tiny", seed=0)
  return _MODELS[name]


def _raw_graph_def(path):
  """The file's GraphDef as stored: parsed here, not through tfsplit."""
  graph_def = graph_pb2.GraphDef()
  with open(path, "rb") as f:
    graph_def.ParseFromString(f.read())
  return graph_def


def _rewrite(tmp_path, capsys, name, args, source=GPT):
  out = tmp_path / f"{name}.pb"
  code, stdout, err = _cli(["rewrite", source, "-o", out, "--collective-timeout", "60"]
                           + args, capsys)
  assert code == 0, err
  manifest = json.loads((tmp_path / f"{name}.manifest.json").read_text())
  return out, stdout, manifest


def _verify_ok(original, rewritten, capsys, *extra):
  code, stdout, err = _cli(["verify", original, rewritten] + list(extra), capsys)
  assert code == 0, stdout + err
  assert "MISMATCH" not in stdout
  return stdout


def _const(nodes, name):
  return tensor_util.MakeNdarray(nodes[name.split(":")[0]].attr["value"].tensor)


def _split_variables(manifest):
  return {k for k, e in manifest["variables"].items() if any(e["sharding"])}


# --- inspect --------------------------------------------------------------------
def _expected_matmuls(ex):
  """MatMul ops of one training step, from the architecture alone."""
  cfg = ex.config
  if ex.name.startswith("mlp"):
    # forward x @ W per layer; backward dW per layer and dx for all but the first
    return 3 * cfg.layers - 1
  # q, k, v, o, fc1, fc2 per block: forward + dW + dx each; the LM head the
  # same; the embedding is a gather (no MatMul); attention is BatchMatMulV2.
  return 3 * 6 * cfg.blocks + 3


@pytest.mark.parametrize("name", ["mlp_raw", "gpt_raw"])
def test_inspect_numbers_match_the_model(name, tmp_path, capsys):
  path = os.path.join(EXAMPLES, f"{name}_train_tiny.pb")
  ex = _model(name)
  code, out, err = _cli(["inspect", path, "--format", "json"], capsys)
  assert code == 0, err
  report = json.loads(out)
  totals = report["totals"]

  # Parameters: the model's (trainable) variables, summed here.
  sizes = {p: int(np.prod(v.shape)) for p, v in zip(ex.variable_paths, ex.variables)}
  params = sum(sizes.values())
  assert totals["param_count"] == params
  assert totals["param_bytes"] == 4 * params  # float32
  # Optimizer state: every other variable (Adam slots, step, learning rate).
  state = sum(int(np.prod(v.shape)) * v.dtype.size for v in ex.all_variables()
              if not v.trainable)
  assert totals["optimizer_state_bytes"] == state
  # Layers with parameters: one per 'family/layer' scope of the variables.
  by_scope = collections.Counter()
  for p, n in sizes.items():
    by_scope["/".join(p.split("/")[:2])] += n
  assert totals["model_layers"] == len(by_scope)
  assert {l["name"]: l["param_count"] for l in report["layers"] if l["param_count"]} == \
      dict(by_scope)

  # The op histogram against the GraphDef itself, and MatMuls against theory.
  raw = _raw_graph_def(path)
  assert totals["nodes"] == len(raw.node)
  assert report["ops"] == dict(collections.Counter(n.op for n in raw.node))
  assert report["ops"]["MatMul"] == _expected_matmuls(ex)

  # Variables: names, shapes, trainability as the model has them.
  got = {v["name"]: (v["shape"], v["trainable"]) for v in report["variables"]}
  want = {n: (list(v.shape), bool(v.trainable))
          for n, v in zip(ex.variable_names(), ex.all_variables())}
  assert got == want
  assert totals["variables"] == len(want)

  # The table shows the same numbers.
  code, table, err = _cli(["inspect", path], capsys)
  assert code == 0, err
  lines = table.splitlines()
  assert f"{len(raw.node)} nodes, {len(want)} variables, {len(by_scope)} layers with " \
      "parameters" in table
  assert any(re.fullmatch(rf"MatMul\s+{report['ops']['MatMul']}", l.strip()) for l in lines)
  total_row = next(l for l in lines if l.split()[:1] == ["total"])
  assert human_count(params) in total_row
  for scope, n in by_scope.items():
    row = next(l for l in lines if re.match(rf"\d+\s+{re.escape(scope)}\s", l))
    assert re.split(r"\s{2,}", row.strip())[2] == human_count(n), row  # params column
  kernel = next(p for p in sizes if p.endswith("kernel"))
  row = next(l for l in lines if l.startswith(kernel + " "))
  assert re.split(r"\s{2,}", row.strip())[1:2] == [str(want[kernel][0])], row
  assert "yes" in row.split(), row

  # --output writes the same report to a file and nothing to stdout.
  dest = tmp_path / "report.json"
  code, out, err = _cli(["inspect", path, "--format", "json", "--output", dest], capsys)
  assert code == 0 and out == "", err
  written = json.loads(dest.read_text())
  written["totals"].pop("seconds")
  report["totals"].pop("seconds")
  assert written == report


# --- rewrite ----------------------------------------------------------------------
def _input_slices(graph_def, placeholder):
  """{device: [(begin row, rows)]} of the Slice nodes reading `placeholder`."""
  nodes = {n.name: n for n in graph_def.node}
  out = collections.defaultdict(list)
  for n in graph_def.node:
    if n.op == "Slice" and n.input[0] == placeholder:
      begin, size = _const(nodes, n.input[1]), _const(nodes, n.input[2])
      out[n.device].append((int(begin[0]), int(size[0])))
  return {d: sorted(v) for d, v in out.items()}


@pytest.mark.parametrize("m", [1, 2])
def test_rewrite_data_parallel_and_microbatches(m, tmp_path, capsys):
  out, stdout, manifest = _rewrite(tmp_path, capsys, f"dp2_m{m}",
                                   ["--mesh", "dp=2", "--microbatches", m])
  ex = _model("gpt_raw")
  batch = ex.config.batch
  assert manifest["mesh"] == {"dp": 2} and manifest["microbatches"] == m
  # Every variable replicated: one full copy on each of the two devices.
  assert set(manifest["variables"]) == set(ex.variable_names())
  for name, entry in manifest["variables"].items():
    assert entry["sharding"] == [None] * len(entry["shape"]), name
    assert sorted(s["device"] for s in entry["shards"]) == [CPU(0), CPU(1)], name
    for s in entry["shards"]:
      assert s["shape"] == entry["shape"] and not any(s["offsets"]), name

  graph_def = load_graph(out)
  # The batch is cut: each device reads its half, in m micro-batch slices.
  for placeholder in ("tokens", "labels"):
    slices = _input_slices(graph_def, placeholder)
    per = batch // (2 * m)
    assert slices == {CPU(d): [(d * batch // 2 + j * per, per) for j in range(m)]
                      for d in (0, 1)}, placeholder
  # Gradients: micro-batches summed locally (a running sum per device), then
  # all-reduced over the two replicas, packed into one bucket per device
  # (besides the loss's own all-reduce).
  sums = collections.Counter(n.device for n in graph_def.node
                             if n.op == "AddV2" and "/sum_mb/" in n.name)
  reduces = [n for n in graph_def.node if n.op == "CollectiveReduceV2"]
  n_params = len(ex.variables)
  if m == 1:
    assert not sums and " 0 micro-batch sums" in stdout
  else:
    count = int(re.search(r"(\d+) micro-batch sums", stdout).group(1))
    assert count >= n_params
    assert sums == {CPU(0): count * (m - 1), CPU(1): count * (m - 1)}
  assert collections.Counter(n.device for n in reduces) == {CPU(0): 2, CPU(1): 2}
  packed = re.search(r"gradient buckets: (\d+) all-reduces over dp packed into 1 bucket",
                     stdout)
  assert packed and int(packed.group(1)) >= n_params, stdout
  if m == 1:  # dp=2 with 2 micro-batches is verified by test_cli_split
    _verify_ok(GPT, out, capsys)


def _stage_of_variable(name, stage_layers):
  """Stage of a parameter, or of the Adam slot of one (named after it)."""
  for stage, layers in enumerate(stage_layers):
    for layer in layers:
      if name.startswith(layer + "/") or name.startswith(
          "adam/" + layer.replace("/", "_") + "_"):
        return stage
  return None


@pytest.mark.parametrize("ranges,stages", [
    ("0:1,1:5", [["gpt/embed"], ["gpt/block_0", "gpt/block_1", "gpt/ln_f", "gpt/head"]]),
    ("0:4,4:5", [["gpt/embed", "gpt/block_0", "gpt/block_1", "gpt/ln_f"], ["gpt/head"]]),
])
def test_rewrite_pipeline_layer_ranges(ranges, stages, tmp_path, capsys):
  out, stdout, manifest = _rewrite(
      tmp_path, capsys, "pp2", ["--mesh", "dp=1", "--stages", 2, "--microbatches", 2,
                                "--layers", ranges])
  assert f"pipeline: 2 stages {stages}" in stdout
  assert manifest["mesh"] == {"pp": 2, "dp": 1}
  placed = 0
  for name, entry in manifest["variables"].items():
    stage = _stage_of_variable(name, stages)
    if stage is None:
      continue  # the optimizer's step and learning rate
    assert [s["device"] for s in entry["shards"]] == [CPU(stage)], name
    placed += 1
  assert placed == len(manifest["variables"]) - 2
  # The layers' compute runs on their stage's device too.
  graph_def = load_graph(out)
  for stage, layers in enumerate(stages):
    for layer in layers:
      matmuls = {n.device for n in graph_def.node
                 if n.op in ("MatMul", "BatchMatMulV2") and n.name.startswith(layer + "/")}
      if layer.startswith(("gpt/block_", "gpt/head")):
        assert matmuls == {CPU(stage)}, (layer, matmuls)
      else:  # the embedding (a gather) and the final LayerNorm
        assert matmuls in (set(), {CPU(stage)}), (layer, matmuls)
  if ranges == "0:4,4:5":  # test_cli_split verifies the default partition
    _verify_ok(GPT, out, capsys)


def test_rewrite_strategy_none_and_annotate(tmp_path, capsys):
  # Without annotations, 'none' splits nothing: everything replicated, no collective.
  out, stdout, manifest = _rewrite(tmp_path, capsys, "none", ["--mesh", "tp=2",
                                                              "--strategy", "none"])
  assert not _split_variables(manifest)
  assert "0 all-reduce" in stdout
  for entry in manifest["variables"].values():
    assert [s["shape"] for s in entry["shards"]] == [entry["shape"]] * 2
  assert not any(n.op.startswith("Collective") for n in load_graph(out).node)

  # One annotation: that variable split as asked; only its own MLP (the
  # second kernel and bias follow from it, and the Adam slots of the three)
  # is split, nothing in attention or in the other block.
  target = "gpt/block_0/mlp/fc1/kernel"
  out, stdout, manifest = _rewrite(tmp_path, capsys, "annotated",
                                   ["--mesh", "tp=2", "--strategy", "none",
                                    "--annotate", f"{target}=-,tp"])
  entry = manifest["variables"][target]
  assert entry["sharding"] == [None, "tp"]
  assert [(s["device"], s["offsets"], s["shape"]) for s in entry["shards"]] == [
      (CPU(0), [0, 0], [32, 64]), (CPU(1), [0, 64], [32, 64])]
  split = _split_variables(manifest)
  assert target in split
  assert all("block_0/mlp" in n or "block_0_mlp" in n for n in split), split
  # The graph's shard placeholders carry the local shape.
  graph = Graph(load_graph(out))
  local = [(list(v.shape), graph.node(v.node).device) for v in find_variables(graph)
           if v.name.startswith(target + "/shard_")]
  assert sorted(local) == [([32, 64], CPU(0)), ([32, 64], CPU(1))]
  _verify_ok(GPT, out, capsys)


# --- SavedModel signatures ------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
  """A SavedModel with two signatures of different inputs and variables."""
  path = str(tmp_path_factory.mktemp("sm") / "model")
  module = tf.Module()
  module.w = tf.Variable(np.random.RandomState(0).randn(8, 16).astype(np.float32), name="w")
  module.v = tf.Variable(np.random.RandomState(1).randn(16, 4).astype(np.float32), name="v")

  @tf.function(input_signature=[tf.TensorSpec([4, 8], name="x")])
  def serve_x(x):
    return {"y": tf.matmul(tf.nn.relu(tf.matmul(x, module.w)), module.v)}

  @tf.function(input_signature=[tf.TensorSpec([6, 8], name="z")])
  def serve_z(z):
    return {"y": tf.matmul(z, module.w)}
  module.serve_x, module.serve_z = serve_x, serve_z
  tf.saved_model.save(module, path, signatures={
      "serve_x": serve_x.get_concrete_function(), "serve_z": serve_z.get_concrete_function()})
  return path


def _inputs(graph_def):
  return {n.name: tf.TensorShape(n.attr["shape"].shape).as_list() for n in graph_def.node
          if n.op == "Placeholder" and n.attr["dtype"].type != tf.resource.as_datatype_enum}


def test_rewrite_signature(saved_model, tmp_path, capsys):
  # serve_z (not the default, which is the first in order: serve_x).
  out, _, manifest = _rewrite(tmp_path, capsys, "z", [
      "--signature", "serve_z", "--mesh", "tp=2", "--strategy", "none",
      "--annotate", "w=-,tp"], source=saved_model)
  assert _inputs(load_graph(out)) == {"z": [6, 8]}
  assert set(manifest["variables"]) == {"w"}
  assert [s["shape"] for s in manifest["variables"]["w"]["shards"]] == [[8, 8], [8, 8]]
  _verify_ok(saved_model, out, capsys, "--signature", "serve_z")
  # serve_x: its own input and both variables.
  out, _, manifest = _rewrite(tmp_path, capsys, "x", [
      "--signature", "serve_x", "--mesh", "tp=2", "--strategy", "none",
      "--annotate", "w=-,tp"], source=saved_model)
  assert _inputs(load_graph(out)) == {"x": [4, 8]}
  assert set(manifest["variables"]) == {"w", "v"}
  _verify_ok(saved_model, out, capsys, "--signature", "serve_x")
  # inspect reads the chosen signature too.
  code, report, err = _cli(["inspect", saved_model, "--signature", "serve_z", "--format",
                            "json"], capsys)
  assert code == 0, err
  assert [v["name"] for v in json.loads(report)["variables"]] == ["w"]
  # A signature the SavedModel does not have: one line naming it, no output.
  code, stdout, err = _cli(["rewrite", saved_model, "-o", tmp_path / "bad.pb",
                            "--signature", "serve_q"], capsys)
  assert code == 2 and stdout == ""
  assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
  assert "no signature 'serve_q'" in err and "serve_x, serve_z" in err
  assert not (tmp_path / "bad.pb").exists() and not (tmp_path / "bad.manifest.json").exists()


def test_verify_savedmodel_in_a_fresh_process(saved_model, tmp_path, capsys):
  """`tfsplit verify SAVEDMODEL REWRITTEN` as a user runs it: loading the
  SavedModel starts TF, so the logical devices must be set up before."""
  out, _, _ = _rewrite(tmp_path, capsys, "z", [
      "--signature", "serve_z", "--mesh", "tp=2", "--strategy", "none",
      "--annotate", "w=-,tp"], source=saved_model)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run([sys.executable, "-m", "tfsplit.cli", "verify", saved_model,
                         str(out), "--signature", "serve_z"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "MISMATCH" not in proc.stdout


# --- verify catches a wrong sharded graph ---------------------------------------------
def test_verify_detects_one_wrong_shard(tmp_path, capsys):
  """tp=2, then device 1's Adam step on its half of one split weight halved
  (what a wrong per-shard learning rate does): exit 1 and MISMATCH."""
  out, _, manifest = _rewrite(tmp_path, capsys, "tp2", ["--mesh", "tp=2"])
  target = "gpt/block_0/mlp/fc1/kernel"
  assert manifest["variables"][target]["sharding"] == [None, "tp"]
  graph_def = load_graph(out)
  graph = Graph(graph_def)
  handle = next(v.node for v in find_variables(graph) if v.name == target + "/shard_1")
  update = next(n for n in graph_def.node
                if n.op == "AssignSubVariableOp" and n.input[0] == handle)
  assert update.device == CPU(1)
  half = graph_def.node.add(name="corrupt/half", op="Const", device=CPU(1))
  half.attr["dtype"].type = tf.float32.as_datatype_enum
  half.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(np.float32(0.5)))
  scaled = graph_def.node.add(name="corrupt/scaled", op="Mul", device=CPU(1),
                              input=[update.input[1], half.name])
  scaled.attr["T"].type = tf.float32.as_datatype_enum
  update.input[1] = scaled.name
  save_graph(graph_def, out)  # beside its manifest
  code, stdout, err = _cli(["verify", GPT, out, "--steps", "1"], capsys)
  assert code == 1, stdout + err
  assert "MISMATCH" in stdout
  assert any(target in l and "MISMATCH" in l for l in stdout.splitlines()), stdout
