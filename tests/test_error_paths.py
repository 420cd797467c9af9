"""Every user-facing error path: the exact error type, or, on the command line,
exit code 2 with one stderr line naming what is at fault, no traceback and no
output file (nor a temp file) left behind."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from tfsplit.cli import run
from tfsplit.errors import PlanError, TfsplitError
from tfsplit.graph import load_graph, save_graph
from tfsplit.runtime import shards as shards_lib
from tfsplit.sharding import propagate as propagate_lib
from tfsplit.layout.mesh import Mesh
from tfsplit.passes import split_graph

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MLP = os.path.join(ROOT, "examples", "mlp_raw_train_tiny.pb")  # batch 4, 3 layers
_GRAPHS = {}


def _mlp():
  if "mlp" not in _GRAPHS:
    _GRAPHS["mlp"] = load_graph(MLP)
  return _GRAPHS["mlp"]


def _cli_error(tmp_path, capsys, args, *needles, command="rewrite"):
  """Runs `tfsplit COMMAND ARGS` (rewrite: into tmp_path/out.pb) expecting a
  user error; returns its one stderr line."""
  argv = [command] + [str(a) for a in args]
  if command == "rewrite":
    argv += ["-o", str(tmp_path / "out.pb")]
  before = sorted(os.listdir(tmp_path))
  code = run(["tfsplit"] + argv)
  out = capsys.readouterr()
  assert code == 2, out.out + out.err
  assert out.out == ""
  assert "Traceback" not in out.err
  lines = out.err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"tfsplit {command}: error: "), out.err
  for needle in needles:
    assert needle in lines[0], lines[0]
  assert sorted(os.listdir(tmp_path)) == before  # no output, no temp file
  return lines[0]


# --- annotations -------------------------------------------------------------------
def test_annotation_of_wrong_rank():
  with pytest.raises(PlanError) as e:
    split_graph(_mlp(), Mesh.parse("tp=2"), strategy="none",
                annotations={"mlp/layer_0/k*": ("tp",)})
  assert e.type is PlanError
  assert "annotation 'mlp/layer_0/k*' gives 1 dims for variable 'mlp/layer_0/kernel' " \
      "of rank 2" in str(e.value)


def test_annotation_of_wrong_rank_cli(tmp_path, capsys):
  _cli_error(tmp_path, capsys, [MLP, "--annotate", "mlp/layer_0/kernel=tp,-,-"],
             "gives 3 dims for variable 'mlp/layer_0/kernel' of rank 2")


def test_annotation_with_unknown_axis():
  with pytest.raises(PlanError) as e:
    split_graph(_mlp(), Mesh.parse("tp=2"), annotations={"mlp/layer_1/bias": ("xp",)})
  assert e.type is PlanError
  assert "names axis 'xp', not in mesh tp=2" in str(e.value)
  assert "mlp/layer_1/bias" in str(e.value)


def test_annotation_with_unknown_axis_cli(tmp_path, capsys):
  _cli_error(tmp_path, capsys, [MLP, "--mesh", "dp=2", "--annotate",
                                "mlp/layer_0/kernel=-,tp"],
             "annotation 'mlp/layer_0/kernel' names axis 'tp', not in mesh dp=2")


@pytest.mark.parametrize("text", ["mlp/layer_0/kernel", "=-,tp", "nonsense"])
def test_unreadable_annotation_cli(text, tmp_path, capsys):
  _cli_error(tmp_path, capsys, [MLP, "--annotate", text],
             f"cannot read --annotate '{text}'", "VARIABLE_GLOB=DIMS")


# --- strategy ----------------------------------------------------------------------------
@pytest.mark.parametrize("mesh", ["tp=2", "dp=2"])
def test_unknown_strategy(mesh):
  with pytest.raises(PlanError) as e:
    split_graph(_mlp(), Mesh.parse(mesh), strategy="bogus")
  assert e.type is PlanError
  assert "unknown strategy 'bogus'; use 'megatron' or 'none'" in str(e.value)


def test_unknown_strategy_cli(tmp_path, capsys):
  _cli_error(tmp_path, capsys, [MLP, "--strategy", "bogus"],
             "--strategy=bogus", "megatron|none")


# --- mesh axes ---------------------------------------------------------------------------
@pytest.mark.parametrize("mesh,axis", [("foo=2", "foo"), ("dp=2,pd=2", "pd")])
def test_unknown_mesh_axis_cli(mesh, axis, tmp_path, capsys):
  # A typo must not silently split tensors as if it were 'tp'.
  _cli_error(tmp_path, capsys, [MLP, "--mesh", mesh],
             f"unknown mesh axis '{axis}'", "dp, tp, pp")


def test_microbatch_axis_in_a_mesh_is_refused():
  with pytest.raises(PlanError, match="micro-batch axis the rewrite adds itself"):
    split_graph(_mlp(), Mesh.parse("dp=2,mb=2"))
  with pytest.raises(PlanError, match="unknown mesh axis 'model'"):
    split_graph(_mlp(), Mesh.parse("tp=2"), axis="model")


# --- plan inference ------------------------------------------------------------------------
def _chain_of_variables(n):
  """x @ w, times a0; a0 * a1; a1 * a2; ...: each a_i's sharding can only be
  read off once a_(i-1)'s is known, one variable per inference round."""
  w = tf.Variable(tf.ones([8, 8]), name="w")
  chain = [tf.Variable(tf.ones([8]) * (i + 2), name=f"a{i}") for i in range(n)]

  @tf.function(input_signature=[tf.TensorSpec([2, 8])])
  def f(x):
    outs = [tf.matmul(x, w) * chain[0]]
    for i in range(1, n):
      outs.append(chain[i - 1] * chain[i])
    return outs
  return load_graph(f)


def test_variable_shardings_that_do_not_settle():
  """Constructed, not forced: a chain of as many variables as there are
  inference rounds is still changing in the last round."""
  rounds = propagate_lib._MAX_ROUNDS  # pylint: disable=protected-access
  graph_def = _chain_of_variables(rounds)
  with pytest.raises(PlanError) as e:
    split_graph(graph_def, Mesh.parse("tp=2"), strategy="none",
                annotations={"w": (None, "tp")})
  assert e.type is PlanError
  assert (f"variable shardings did not settle (still changing: a{rounds - 1}); "
          "annotate the variables") in str(e.value)
  # The advice works: annotated, the same graph splits.
  result = split_graph(graph_def, Mesh.parse("tp=2"), strategy="none",
                       annotations={"w": (None, "tp"), "a*": ("tp",)})
  chain = {f"a{i}": ("tp",) for i in range(rounds)}
  assert result.variable_specs == {"w": (None, "tp"), **chain}
  # One variable fewer settles by inference alone.
  result = split_graph(_chain_of_variables(rounds - 1), Mesh.parse("tp=2"),
                       strategy="none", annotations={"w": (None, "tp")})
  assert result.variable_specs == {"w": (None, "tp"),
                                   **{f"a{i}": ("tp",) for i in range(rounds - 1)}}


def _sandwich_train_step():
  """Layer 'outer' runs before AND after layer 'inner': on two stages, stage 0
  needs stage 1's forward to finish its own forward."""
  rng = np.random.RandomState(0)
  variables = [tf.Variable(rng.randn(8, n).astype(np.float32) * 0.3, name=name)
               for name, n in (("w_in", 8), ("w_mid", 8), ("w_out", 4))]
  w_in, w_mid, w_out = variables

  @tf.function(input_signature=[tf.TensorSpec([4, 8]), tf.TensorSpec([4], tf.int32)])
  def step(x, labels):
    with tf.GradientTape() as tape:
      with tf.name_scope("net/outer/"):
        h = tf.nn.relu(tf.matmul(x, w_in))
      with tf.name_scope("net/inner/"):
        h = tf.nn.relu(tf.matmul(h, w_mid))
      with tf.name_scope("net/outer/"):
        logits = tf.matmul(h, w_out)
      with tf.name_scope("loss/"):
        loss = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
    for v, g in zip(variables, tape.gradient(loss, variables)):
      v.assign_sub(0.1 * g)
    return loss
  return load_graph(step)


def test_cyclic_pipeline_schedule(tmp_path, capsys):
  """Constructed, not forced: 1f1b makes stage 0's backward 0 wait for its
  forward 1, which needs stage 1's forward 1, which 1f1b puts after stage
  1's backward 0, which needs stage 0's backward 0."""
  graph_def = _sandwich_train_step()
  mesh = Mesh.parse("pp=2")
  with pytest.raises(PlanError) as e:
    split_graph(graph_def, mesh, microbatches=2, schedule="1f1b")
  assert e.type is PlanError
  msg = str(e.value)
  assert msg.startswith("the 1f1b schedule would make the graph cyclic (the graph has a "
                        "cycle through node ")
  assert "pipeline_barrier/" in msg and msg.endswith("try another schedule or partition")
  # GPipe orders the same blocks without a cycle, as the message suggests.
  assert split_graph(graph_def, mesh, microbatches=2,
                     schedule="gpipe").partition == [["net/outer"], ["net/inner"]]
  # The command line: one line, nothing written.
  source = tmp_path / "sandwich.pb"
  save_graph(graph_def, source)
  _cli_error(tmp_path, capsys, [source, "--mesh", "dp=1", "--stages", 2,
                                "--microbatches", 2, "--schedule", "1f1b"],
             "the 1f1b schedule would make the graph cyclic")


# --- run time ------------------------------------------------------------------------------
_TIMEOUT_SCRIPT = textwrap.dedent("""
    import json, os, time
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    from tfsplit.graph import load_graph
    from tfsplit.runtime import shards
    from tfsplit.runtime.graph_function import import_graph
    from tfsplit.layout.mesh import Mesh
    from tfsplit.passes import split_graph

    w = tf.Variable(np.arange(32, dtype=np.float32).reshape(8, 4), name="w")

    @tf.function(input_signature=[tf.TensorSpec([2, 8])])
    def f(x):
      return tf.matmul(x, w)
    result = split_graph(load_graph(f), Mesh.parse("tp=2"), strategy="none",
                         annotations={"w": ("tp", None)}, timeout_seconds=1.0)
    reduces = [n for n in result.graph_def.node if n.op == "CollectiveReduceV2"]
    shard_vars = shards.create_shard_variables(result.manifest, {"w": w.numpy()})
    # Fetch device 0's member only: device 1's is pruned and never arrives.
    fn = import_graph(result.graph_def, shard_vars, outputs=[reduces[0].name])
    report = {"members": [[n.name, n.device, n.attr["timeout_seconds"].f] for n in reduces]}
    start = time.perf_counter()
    try:
      fn(tf.ones([2, 8]))
      report["error"] = None
    except Exception as e:  # pylint: disable=broad-except
      report["error"] = type(e).__name__
      report["message"] = str(e)
    report["seconds"] = time.perf_counter() - start
    print("REPORT " + json.dumps(report))
""")


def test_collective_timeout_when_a_member_never_arrives(tmp_path):
  """A split graph's all-reduce whose peer is never run fails after the
  graph's timeout_seconds with TF's DeadlineExceededError, not a hang.

  In a child process: after a collective times out TF aborts every later
  collective of the process ("Restart your program to reset")."""
  script = tmp_path / "timeout.py"
  script.write_text(_TIMEOUT_SCRIPT)
  proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                        text=True, timeout=120, check=False)
  line = next((l for l in proc.stdout.splitlines() if l.startswith("REPORT ")), None)
  assert line is not None, proc.stdout + proc.stderr
  report = json.loads(line[len("REPORT "):])
  assert len(report["members"]) == 2
  assert {m[2] for m in report["members"]} == {1.0}  # timeout_seconds reached the ops
  assert report["error"] == "DeadlineExceededError", report
  assert "Collective has timed out waiting for other workers" in report["message"]
  assert report["members"][0][0] in report["message"]  # names the waiting member
  assert 0.9 <= report["seconds"] < 10, report["seconds"]


def test_checkpoint_without_the_variable(tmp_path):
  w = tf.Variable(np.ones([2, 3], np.float32), name="w")
  path = tf.train.Checkpoint(w=w).save(str(tmp_path / "ckpt"))
  np.testing.assert_array_equal(shards_lib.full_values_from_checkpoint(path, ["w"])["w"],
                                w.numpy())
  with pytest.raises(TfsplitError) as e:
    shards_lib.full_values_from_checkpoint(path, ["w", "mlp/layer_0/kernel"])
  assert e.type is TfsplitError
  assert str(e.value) == f"checkpoint {path} has no variable 'mlp/layer_0/kernel'"


def test_checkpoint_that_does_not_exist(tmp_path):
  with pytest.raises(TfsplitError, match=r"nope/ckpt: cannot read the checkpoint"):
    shards_lib.full_values_from_checkpoint(str(tmp_path / "nope" / "ckpt"), ["w"])


# --- verify inputs -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mlp_tp2(tmp_path_factory):
  out = tmp_path_factory.mktemp("tp2") / "mlp_tp2.pb"
  assert run(["tfsplit", "rewrite", MLP, "-o", str(out), "--mesh", "tp=2",
              "--collective-timeout", "60"]) == 0
  return out


@pytest.mark.parametrize("content,needle", [
    ("{\"variables\": {", "cannot read the shard manifest"),
    ("[1, 2]", "not a shard manifest"),
])
def test_unreadable_manifest(content, needle, mlp_tp2, tmp_path, capsys):
  capsys.readouterr()
  manifest = tmp_path / "broken.json"
  manifest.write_text(content)
  _cli_error(tmp_path, capsys, [MLP, mlp_tp2, "--manifest", manifest],
             str(manifest), needle, command="verify")


def test_missing_manifest_file(mlp_tp2, tmp_path, capsys):
  capsys.readouterr()
  _cli_error(tmp_path, capsys, [MLP, mlp_tp2, "--manifest", tmp_path / "nope.json"],
             "nope.json", "cannot read the shard manifest", command="verify")


def test_verify_against_another_graph(mlp_tp2, tmp_path, capsys):
  """A manifest whose variables are not the original's is refused by name."""
  capsys.readouterr()
  other = os.path.join(ROOT, "examples", "gpt_raw_train_tiny.pb")
  _cli_error(tmp_path, capsys, [other, mlp_tp2], "does not describe the original graph's "
             "variables", "adam/mlp_layer_0", command="verify")


def test_verify_with_the_files_swapped(mlp_tp2, tmp_path, capsys):
  """The split graph given as the original: refused before anything runs
  (it used to wait for collectives until the timeout)."""
  capsys.readouterr()
  _cli_error(tmp_path, capsys, [mlp_tp2, MLP], f"ORIGINAL '{mlp_tp2}' is a graph written "
             "by tfsplit rewrite", "the arguments look swapped", command="verify")


def test_verify_with_another_splits_manifest(mlp_tp2, tmp_path, capsys):
  other = tmp_path / "dp2" / "mlp_dp2.pb"
  other.parent.mkdir()
  assert run(["tfsplit", "rewrite", MLP, "-o", str(other), "--mesh", "dp=2"]) == 0
  capsys.readouterr()
  _cli_error(tmp_path, capsys, [MLP, mlp_tp2, "--manifest", other.with_suffix(
      ".manifest.json")], f"the manifest does not describe REWRITTEN '{mlp_tp2}'", "shard '",
             "--manifest", command="verify")
  # A split graph whose manifest is nowhere: the same kind of line.
  lonely = tmp_path / "lonely.pb"
  lonely.write_bytes(mlp_tp2.read_bytes())
  _cli_error(tmp_path, capsys, [MLP, lonely], "is a split graph but no shard manifest",
             command="verify")


def test_verify_of_a_collective_that_never_completes_is_bounded(tmp_path):
  """A member of one all-reduce moved to another instance key: the other
  member waits, the rewrite's collective timeout fires, and verify says so
  in one line (exit 2, not 1: no numbers were compared)."""
  from tensorflow.python.framework import tensor_util  # pylint: disable=import-outside-toplevel
  out = tmp_path / "mlp_tp2.pb"
  assert run(["tfsplit", "rewrite", MLP, "-o", str(out), "--mesh", "tp=2",
              "--collective-timeout", "2"]) == 0
  graph_def = load_graph(str(out))
  nodes = {n.name: n for n in graph_def.node}
  member = next(n for n in graph_def.node
                if n.op == "CollectiveReduceV2" and n.device.endswith("CPU:1"))
  key = nodes[member.input[3]]
  key.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(987654321, tf.int32))
  save_graph(graph_def, str(out))
  # In a process of its own: an aborted collective leaves TF's collective
  # executor of the process unusable for later tests.
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             TF_CPP_MIN_LOG_LEVEL="3")
  done = subprocess.run([sys.executable, "-m", "tfsplit.cli", "verify", MLP, str(out)],
                        capture_output=True, text=True, timeout=120, env=env, check=False)
  lines = [l for l in done.stderr.splitlines() if l.startswith("tfsplit verify: ")]
  assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stderr[-2000:])
  assert len(lines) == 1 and "a collective waited past its timeout" in lines[0], done.stderr
  assert "Traceback" not in done.stderr


def test_mesh_larger_than_the_devices(tmp_path, capsys):
  """Rewriting for 8 devices works anywhere; verifying it in a process that
  already runs TF on 4 is a one-line error."""
  out = tmp_path / "tp8" / "mlp_tp8.pb"
  out.parent.mkdir()
  assert run(["tfsplit", "rewrite", MLP, "-o", str(out), "--mesh", "tp=8"]) == 0
  capsys.readouterr()
  _cli_error(tmp_path, capsys, [MLP, out], "the graph needs 8 CPU devices but TensorFlow "
             "is already running with 4", command="verify")


# --- batch and micro-batches ---------------------------------------------------------------
@pytest.mark.parametrize("m", [0, -1])
def test_microbatches_below_one(m):
  with pytest.raises(PlanError) as e:
    split_graph(_mlp(), Mesh.parse("dp=2"), microbatches=m)
  assert e.type is PlanError
  assert str(e.value) == f"microbatches must be >= 1, got {m}"


def test_microbatches_below_one_cli(tmp_path, capsys):
  _cli_error(tmp_path, capsys, [MLP, "--mesh", "dp=2", "--microbatches", 0],
             "microbatches must be >= 1, got 0")


@pytest.mark.parametrize("args,needle", [
    (["--mesh", "dp=3"], "input 'x': global batch 4 does not divide by dp=3 (= 3)"),
    (["--mesh", "dp=2", "--microbatches", 4],
     "input 'x': global batch 4 does not divide by dp=2 x mb=4 (= 8)"),
])
def test_batch_not_divisible_cli(args, needle, tmp_path, capsys):
  _cli_error(tmp_path, capsys, [MLP] + args, needle)


# --- pipeline flags --------------------------------------------------------------------------
@pytest.mark.parametrize("args,needle", [
    (["--stages", 2, "--layers", "0:x,1:3"], "cannot read --layers '0:x,1:3'"),
    (["--stages", 2, "--layers", "0:1,2:3"], "are not contiguous"),
    (["--stages", 2, "--layers", "0:1,1:2"], "cover layers 0..2, but there are 3"),
    (["--stages", 2, "--layers", "0:3"], "1 layer ranges given for 2 stages"),
    (["--stages", 4], "4 stages but the graph has only 3 layers with parameters"),
    (["--stages", 2, "--mesh", "pp=2"], "either as --stages or as pp= in --mesh"),
])
def test_bad_pipeline_flags_cli(args, needle, tmp_path, capsys):
  _cli_error(tmp_path, capsys, [MLP, "--microbatches", 2] + args, needle)


# --- tfsplit.split given the wrong thing --------------------------------------------------
def test_split_of_a_keras_model_points_to_tfsplit_keras():
  import keras  # pylint: disable=import-outside-toplevel
  import tfsplit  # pylint: disable=import-outside-toplevel
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  with pytest.raises(PlanError, match=r"Keras model: train it split with "
                     r"tfsplit.keras.split\(model, mesh=...\)"):
    tfsplit.split(model, mesh="dp=2")


def test_split_of_a_function_without_a_signature_says_what_to_give():
  import tfsplit  # pylint: disable=import-outside-toplevel
  w = tf.Variable(tf.ones([4, 2]))

  @tf.function
  def step(x):
    return tf.matmul(x, w)

  with pytest.raises(PlanError, match=r"pass input_signature=\[tf.TensorSpec"):
    tfsplit.split(step, mesh="dp=2")
  with pytest.raises(PlanError, match="not function; decorate the training step"):
    tfsplit.split(lambda x: x, mesh="dp=2")


def test_graph_without_variables_is_refused(tmp_path, capsys):
  """Nothing to split or train: one line, no output (it used to 'split' at dp=2)."""
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [4, 3], name="x")
    tf.identity(x * 2.0, name="y")
  path = tmp_path / "stateless.pb"
  save_graph(graph.as_graph_def(), str(path))
  capsys.readouterr()
  _cli_error(tmp_path, capsys, [path, "--mesh", "dp=2"], "the graph has no variables")
