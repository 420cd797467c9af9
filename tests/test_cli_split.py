"""`tfsplit rewrite` and `tfsplit verify` end to end on a bundled example."""
import json
import os
import re

from tensorflow.python.framework import tensor_util

from tfsplit.cli import run
from tfsplit.graph import load_graph, save_graph

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
TRAIN = os.path.join(EXAMPLES, "gpt_raw_train_tiny.pb")


def _cli(args, capsys):
  code = run(["tfsplit"] + args)
  out = capsys.readouterr()
  return code, out.out, out.err


def test_rewrite_then_verify(tmp_path, capsys):
  out = tmp_path / "gpt_tp2.pb"
  code, stdout, _ = _cli(["rewrite", TRAIN, "-o", str(out), "--mesh", "tp=2",
                          "--collective-timeout", "60"], capsys)
  assert code == 0, stdout
  assert "8 all-reduce, 0 micro-batch sums, 0 all-gather" in stdout
  manifest = json.loads((tmp_path / "gpt_tp2.manifest.json").read_text())
  assert manifest["mesh"] == {"tp": 2}
  q = manifest["variables"]["gpt/block_0/attn/q/kernel"]
  assert q["sharding"] == [None, "tp"] and q["shards"][1]["offsets"] == [0, 16]
  code, stdout, _ = _cli(["verify", TRAIN, str(out), "--steps", "3"], capsys)
  assert code == 0, stdout
  assert stdout.strip().splitlines()[-1].startswith("OK")


def test_verify_detects_a_wrong_graph(tmp_path, capsys):
  """A rewritten graph that computes something else exits 1."""
  graph_def = load_graph(TRAIN)
  softmax = next(n for n in graph_def.node if n.op == "Softmax")
  softmax.op = "Sigmoid"  # same signature, different numbers
  bad = tmp_path / "bad.pb"
  save_graph(graph_def, bad)
  code, stdout, _ = _cli(["verify", TRAIN, str(bad)], capsys)
  assert code == 1, stdout
  assert "MISMATCH" in stdout


def test_rewrite_bad_mesh_writes_nothing(tmp_path, capsys):
  out = tmp_path / "x.pb"
  code, _, err = _cli(["rewrite", TRAIN, "-o", str(out), "--mesh", "tp=3"], capsys)
  assert code == 2
  assert "does not divide by tp=3" in err and len(err.strip().splitlines()) == 1
  assert not out.exists() and not (tmp_path / "x.manifest.json").exists()
  code, _, err = _cli(["rewrite", TRAIN, "-o", str(out), "--mesh", "tp"], capsys)
  assert code == 2 and "name=size" in err


def test_rewrite_data_parallel_microbatched(tmp_path, capsys):
  """--mesh dp=2 --microbatches 2: two replicas, each with the whole model, each
  taking a quarter-batch micro-batch slice of the inputs twice, gradients
  summed over micro-batches in the graph; and exact."""
  out = tmp_path / "gpt_dp2_m2.pb"
  code, stdout, _ = _cli(["rewrite", TRAIN, "-o", str(out), "--mesh", "dp=2",
                          "--microbatches", "2", "--collective-timeout", "60"], capsys)
  assert code == 0, stdout
  manifest = json.loads((tmp_path / "gpt_dp2_m2.manifest.json").read_text())
  assert manifest["mesh"] == {"dp": 2} and manifest["microbatches"] == 2
  for name, entry in manifest["variables"].items():
    assert not any(entry["sharding"]), name
    assert [s["device"][-5:] for s in entry["shards"]] == ["CPU:0", "CPU:1"], name
    assert all(s["shape"] == entry["shape"] for s in entry["shards"]), name
  graph_def = load_graph(str(out))
  original = load_graph(TRAIN)
  batch = next(n for n in original.node if n.name == "tokens").attr["shape"].shape.dim[0].size
  nodes = {n.name: n for n in graph_def.node}
  slices = sorted(n for n in nodes if re.fullmatch(r"tokens/shard_\d", n))
  assert len(slices) == 4  # 2 replicas x 2 micro-batches
  for name in slices:
    size = nodes[nodes[name].input[2]].attr["value"].tensor
    assert nodes[name].op == "Slice"
    assert tensor_util.MakeNdarray(size)[0] == batch // 4
  assert {nodes[s].device[-5:] for s in slices} == {"CPU:0", "CPU:1"}
  assert int(re.search(r"(\d+) micro-batch sums", stdout).group(1)) > 0
  code, stdout, _ = _cli(["verify", TRAIN, str(out), "--steps", "2"], capsys)
  assert code == 0, stdout


def test_rewrite_pipeline_verify_and_trace(tmp_path, capsys):
  out = tmp_path / "gpt_pp2.pb"
  code, stdout, _ = _cli(["rewrite", TRAIN, "-o", str(out), "--mesh", "dp=1", "--stages",
                          "2", "--microbatches", "4", "--schedule", "1f1b",
                          "--collective-timeout", "60"], capsys)
  assert code == 0, stdout
  assert "pipeline: 2 stages" in stdout
  code, stdout, _ = _cli(["verify", TRAIN, str(out), "--steps", "2"], capsys)
  assert code == 0, stdout
  trace = tmp_path / "trace.json"
  code, stdout, _ = _cli(["trace", str(out), "-o", str(trace)], capsys)
  assert code == 0, stdout
  events = json.loads(trace.read_text())["traceEvents"]
  kinds = {e.get("cat") for e in events}
  assert {"F", "B"} <= kinds
  code, _, err = _cli(["rewrite", TRAIN, "-o", str(tmp_path / "x.pb"), "--stages", "2",
                       "--schedule", "zigzag"], capsys)
  assert code == 2 and "zigzag" in err


def test_rewrite_reports_lean_ops_per_device(tmp_path, capsys):
  """The summary counts each device's ops against the original's: a tensor-
  and data-parallel split adds almost nothing per device beyond constants
  (collectives and bucket packing), and folded shape arithmetic leaves no
  IdentityN / NoOp behind on any device."""
  keras = os.path.join(EXAMPLES, "gpt_keras3_train_tiny.pb")  # Keras: BroadcastGradientArgs
  out = tmp_path / "gpt.pb"
  code, stdout, _ = _cli(["rewrite", keras, "-o", str(out), "--mesh", "dp=2,tp=2"], capsys)
  assert code == 0, stdout
  line = next(l for l in stdout.splitlines() if "ops per device" in l)
  match = re.search(r"ops per device: (\d+)(?:-(\d+))? of the original's (\d+) .*"
                    r"without constants (\d+)(?:-(\d+))? of (\d+) \(([\d.]+)x\)", line)
  assert match, line
  original = load_graph(keras)
  rewritten = load_graph(str(out))
  per_device = {}
  for n in rewritten.node:
    if n.device and n.op != "Const":
      per_device[n.device] = per_device.get(n.device, 0) + 1
  assert len(per_device) == 4
  assert int(match.group(6)) == sum(1 for n in original.node if n.op != "Const")
  assert max(per_device.values()) == int(match.group(5) or match.group(4))
  assert max(per_device.values()) <= 1.05 * int(match.group(6)), line
  # (Reductions over folded empty axes become Identity: not counted here.)
  original_ids = sum(1 for n in original.node if n.op in ("IdentityN", "NoOp"))
  device0 = min(per_device)
  ids = sum(1 for n in rewritten.node
            if n.device == device0 and n.op in ("IdentityN", "NoOp"))
  assert ids <= original_ids + 1, (ids, original_ids)
  sums = sum(1 for n in rewritten.node if n.device == device0 and n.op == "Sum")
  original_sums = sum(1 for n in original.node if n.op == "Sum")
  assert sums < original_sums, (sums, original_sums)  # no-op gradient Sums are gone
  # No device carries a constant nothing reads (a global shape or size that
  # a local one replaced, a leaf of folded shape arithmetic), unless the
  # original carried it unread too.
  read = {t.lstrip("^").partition(":")[0] for n in rewritten.node for t in n.input}
  unread_before = {n.name for n in original.node if n.op == "Const"} - {
      t.lstrip("^").partition(":")[0] for n in original.node for t in n.input}
  unread = [n.name for n in rewritten.node if n.op == "Const" and n.name not in read
            and n.attr["_tfsplit_source"].s.decode() not in unread_before]
  assert not unread, unread[:5]
