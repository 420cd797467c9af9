"""`tfsplit inspect GRAPH --mesh ...`: the ops a split over that mesh would
replicate (fallbacks), grouped per op type, before anything is rewritten; the
same ops `tfsplit rewrite` then reports; one line when there are none; a
mesh that does not fit is one error line and exit code 2."""
import json
import os
import re

import pytest
import tensorflow as tf

from tfsplit.cli import run
from tfsplit.graph import load_graph, save_graph

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MLP = os.path.join(ROOT, "examples", "mlp_raw_train_tiny.pb")   # batch 4, 3 layers
GPT_TFKERAS = os.path.join(ROOT, "examples", "gpt_tfkeras_train_tiny.pb")
NO_RULE = "no split rule for this op"


def _cli(args, capsys):
  code = run(["tfsplit"] + [str(a) for a in args])
  out = capsys.readouterr()
  return code, out.out, out.err


def _inspect_json(capsys, *args):
  code, out, err = _cli(["inspect", *args, "--format", "json"], capsys)
  assert code == 0, err
  return json.loads(out)


@pytest.fixture(scope="module")
def sizes_graph(tmp_path_factory):
  """A graph whose batch reaches two Unique and a Where: their output sizes
  depend on every value, so a split batch is gathered for them (intended)."""
  @tf.function(input_signature=[tf.TensorSpec([4, 8], tf.float32)])
  def f(x):
    ids = tf.reshape(tf.cast(x * 3.0, tf.int32), [-1])
    a, _ = tf.unique(ids)
    b, _ = tf.unique(ids + 1)
    where = tf.where(x > 0.0)
    return tf.reduce_sum(a) + tf.reduce_sum(b) + tf.cast(tf.reduce_sum(where), tf.int32)
  path = str(tmp_path_factory.mktemp("fallbacks") / "sizes.pb")
  save_graph(load_graph(f.get_concrete_function()), path)
  return path


def test_fallbacks_grouped_per_op_type(sizes_graph, capsys):
  report = _inspect_json(capsys, sizes_graph, "--mesh", "dp=2")
  assert report["fallbacks"] == {
      "mesh": "dp=2", "microbatches": 1, "strategy": "megatron", "count": 3,
      "by_op": [{"op": "Unique", "count": 2, "reasons": {NO_RULE: 2},
                 "nodes": ["Unique", "Unique_1"]},
                {"op": "Where", "count": 1, "reasons": {NO_RULE: 1}, "nodes": ["Where"]}]}
  assert report["ops"]["Unique"] == 2   # the rest of the report is still there
  code, table, err = _cli(["inspect", sizes_graph, "--mesh", "dp=2"], capsys)
  assert code == 0 and err == ""
  lines = table.splitlines()
  head = lines.index("fallbacks to replication over mesh dp=2: 3 ops (2 op types) "
                     "gather their split inputs")
  assert lines[head + 1].split() == ["op", "count", "reason", "nodes"]
  assert re.split(r"\s{2,}", lines[head + 3]) == ["Unique", "2", NO_RULE, "Unique, Unique_1"]
  assert re.split(r"\s{2,}", lines[head + 4]) == ["Where", "1", NO_RULE, "Where"]
  assert lines[-1].startswith("inspected in ")


def test_inspect_lists_what_rewrite_reports(tmp_path, capsys):
  """tf_keras's Adam deduplicates the embedding's sparse gradient rows with a
  Unique of the (batch-split) token ids."""
  report = _inspect_json(capsys, GPT_TFKERAS, "--mesh", "dp=2,tp=2")
  listed = {(n, g["op"]) for g in report["fallbacks"]["by_op"] for n in g["nodes"]}
  assert listed == {("adam/Unique", "Unique")}
  code, out, err = _cli(["rewrite", GPT_TFKERAS, "--mesh", "dp=2,tp=2", "-o",
                         tmp_path / "gpt.pb"], capsys)
  assert code == 0, err
  rewritten = set(re.findall(r"fallback: node '(.*)' \(op (\w+)\)", out))
  assert rewritten == listed


@pytest.mark.parametrize("args,where", [
    (["--mesh", "dp=2", "--microbatches", 2], "mesh dp=2, 2 micro-batches"),
    (["--mesh", "pp=2", "--microbatches", 2], "mesh pp=2, 2 micro-batches"),
    (["--mesh", "dp=2", "--stages", 2, "--microbatches", 2], "mesh pp=2,dp=2, 2 micro-batches"),
    (["--mesh", "tp=2", "--strategy", "none", "--annotate", "mlp/layer_0/kernel=-,tp"],
     "mesh tp=2"),
], ids=["dp-microbatches", "pp-microbatches", "stages-dp-microbatches", "annotate"])
def test_no_fallbacks_is_one_line(args, where, capsys):
  code, table, err = _cli(["inspect", MLP] + args, capsys)
  assert code == 0 and err == ""
  assert [l for l in table.splitlines() if l.startswith("fallbacks")] == [
      f"fallbacks to replication over {where}: none"]
  report = _inspect_json(capsys, MLP, *args)
  assert report["fallbacks"]["count"] == 0 and report["fallbacks"]["by_op"] == []


def test_without_mesh_nothing_is_split(capsys):
  code, table, _ = _cli(["inspect", MLP], capsys)
  assert code == 0 and "fallbacks" not in table
  assert "fallbacks" not in _inspect_json(capsys, MLP)


@pytest.mark.parametrize("args,needle", [
    (["--mesh", "tp=x"], "cannot read mesh 'tp=x'"),
    (["--mesh", "dp=3"], "input 'x': global batch 4 does not divide by dp=3 (= 3)"),
    (["--mesh", "dp=2", "--microbatches", 4], "does not divide by dp=2 x mb=4 (= 8)"),
    (["--mesh", "dp=2", "--microbatches", 0], "microbatches must be >= 1, got 0"),
    (["--mesh", "pp=2", "--stages", 2], "either as --stages or as pp= in --mesh"),
    (["--mesh", "dp=1", "--stages", 4], "4 stages but the graph has only 3 layers"),
    (["--mesh", "tp=2", "--annotate", "mlp/layer_0/kernel=tp,-,-"],
     "gives 3 dims for variable 'mlp/layer_0/kernel' of rank 2"),
    (["--microbatches", 2], "--microbatches needs --mesh"),
], ids=["unreadable", "batch", "microbatches", "microbatches-0", "pp-twice", "stages",
        "annotation", "no-mesh"])
def test_mesh_that_does_not_fit_is_one_line(args, needle, tmp_path, capsys):
  report = tmp_path / "report.json"
  code, out, err = _cli(["inspect", MLP, "-o", report] + args, capsys)
  assert code == 2 and out == ""
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("tfsplit inspect: error: "), err
  assert needle in lines[0]
  assert not report.exists()


def test_fallback_message_keeps_its_parts():
  """A fallback reads as its message and keeps node, op and reason apart,
  also through a copy or a pickle (a reason may itself hold '; ')."""
  import copy  # pylint: disable=import-outside-toplevel
  import pickle  # pylint: disable=import-outside-toplevel
  from tfsplit.sharding.propagate import Fallback  # pylint: disable=import-outside-toplevel
  fallback = Fallback("scope/op", "ReverseV2", "no split rule; axis 0 is split")
  assert fallback.startswith("node 'scope/op' (op ReverseV2): no split rule; axis 0")
  for again in (copy.deepcopy(fallback), pickle.loads(pickle.dumps(fallback))):
    assert again == fallback
    assert (again.node, again.op, again.reason) == (
        "scope/op", "ReverseV2", "no split rule; axis 0 is split")
