"""Training graphs written the plain TF way can be rewritten and verified.

`tf.io.write_graph(cf.graph.as_graph_def(), ...)` keeps each captured variable
as a bare `Placeholder(dtype=resource)`: no name, shape or dtype, and nothing
marks the function's inputs and outputs. tfsplit recovers them when it loads
the file (tfsplit/graph/recover.py), or takes them from --variables.
"""
import json

import pytest
import tensorflow as tf

import _util
from tfsplit.cli import run
from tfsplit.graph import Graph, find_variables, load_graph
from tfsplit.graph.endpoints import graph_inputs, graph_outputs

FLAVOURS = ["gpt_raw", "gpt_keras3", "gpt_tfkeras"]


def _cli(args, capsys):
  code = run(["tfsplit"] + [str(a) for a in args])
  out = capsys.readouterr()
  return code, out.out, out.err


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
  """{flavour: (example, ConcreteFunction, path of its plain train.pb)}."""
  out = {}
  for name in FLAVOURS:
    ex = _util.example(name)
    cf = ex.concrete("train")
    directory = tmp_path_factory.mktemp(name)
    tf.io.write_graph(cf.graph.as_graph_def(), str(directory), "train.pb", as_text=False)
    out[name] = (ex, cf, directory / "train.pb")
  return out


def _true_variables(ex, cf):
  """{capture placeholder: (shape, dtype, name, trainable)} of the function."""
  by_handle = {}
  for var, name in zip(ex.all_variables(), ex.variable_names()):
    tf_var = var if hasattr(var, "handle") else var.value  # Keras 3 wraps one
    by_handle[id(tf_var.handle)] = (tuple(tf_var.shape.as_list()),
                                    tf_var.dtype.as_datatype_enum, name, tf_var.trainable)
  return {internal.op.name: by_handle[id(external)] for external, internal in cf.graph.captures
          if id(external) in by_handle}


@pytest.mark.parametrize("name", FLAVOURS)
def test_recovered_variables_are_the_functions(plain, name):
  ex, cf, path = plain[name]
  graph_def = load_graph(str(path))
  graph = Graph(graph_def)
  variables = find_variables(graph)
  truth = _true_variables(ex, cf)
  assert len(variables) == len(truth) == len(ex.all_variables())
  for v in variables:
    shape, dtype, true_name, trainable = truth[v.node]
    assert (v.shape, v.dtype, v.trainable) == (shape, dtype, trainable), (v, true_name)
  # Names: unique, the same on every load (verify loads the file again), and
  # Keras's layer-scope names for kernels and biases.
  names = [v.name for v in variables]
  assert len(set(names)) == len(names)
  assert names == [v.name for v in find_variables(Graph(load_graph(str(path))))]
  recovered = {v.node: v.name for v in variables}
  for node, (_, _, true_name, _) in truth.items():
    if true_name.endswith(("/kernel", "/bias")) and not true_name.startswith("adam"):
      assert recovered[node] == true_name
  # The function's result and arguments.
  assert graph_outputs(graph) == ["Identity"]
  assert graph_inputs(graph) == ["tokens", "labels"]


@pytest.mark.parametrize("name", FLAVOURS)
def test_rewrite_then_verify(plain, name, tmp_path, capsys):
  _, _, path = plain[name]
  out = tmp_path / "tp2.pb"
  code, stdout, err = _cli(["rewrite", path, "-o", out, "--mesh", "tp=2",
                            "--collective-timeout", "60"], capsys)
  assert code == 0, stdout + err
  assert "shape unknown" not in err
  manifest = json.loads((tmp_path / "tp2.manifest.json").read_text())
  sharding = {k: v["sharding"] for k, v in manifest["variables"].items()}
  for block in ("block_0", "block_1"):
    assert sharding[f"gpt/{block}/mlp/fc1/kernel"] == [None, "tp"]  # column-parallel
    assert sharding[f"gpt/{block}/mlp/fc2/kernel"] == ["tp", None]  # row-parallel
  code, stdout, err = _cli(["verify", path, out, "--steps", "3"], capsys)
  assert code == 0, stdout + err
  assert stdout.strip().splitlines()[-1].startswith("OK")


def test_variables_from_a_checkpoint(plain, tmp_path, capsys):
  """--variables: the checkpoint's names (and shapes) for the raw model, whose
  token/position tables and Adam slots the graph alone names generically."""
  ex, cf, path = plain["gpt_raw"]
  prefix = tf.train.Checkpoint(variables=ex.variables, optimizer=ex.optimizer).save(
      str(tmp_path / "ckpt" / "model"))
  out = tmp_path / "tp2.pb"
  code, stdout, err = _cli(["rewrite", path, "-o", out, "--mesh", "tp=2",
                            "--variables", prefix], capsys)
  assert code == 0, stdout + err
  manifest = json.loads((tmp_path / "tp2.manifest.json").read_text())["variables"]
  truth = {name: shape for shape, _, name, _ in _true_variables(ex, cf).values()}
  assert {k: tuple(v["shape"]) for k, v in manifest.items()} == truth
  assert manifest["gpt/embed/tok"]["shape"] == [64, 32]


@pytest.fixture(scope="module")
def unrecoverable(tmp_path_factory):
  """A plain graph that reads a [3, 5] variable only as the second operand of
  a MatMul whose result is summed: nothing in it says 5. And a checkpoint."""
  directory = tmp_path_factory.mktemp("readonly")
  w = tf.Variable(tf.reshape(tf.range(15, dtype=tf.float32), [3, 5]), name="w")

  @tf.function(input_signature=[tf.TensorSpec([2, 3], tf.float32)])
  def f(x):
    return tf.reduce_sum(tf.matmul(x, w))
  tf.io.write_graph(f.get_concrete_function().graph.as_graph_def(), str(directory), "f.pb",
                    as_text=False)
  prefix = tf.train.Checkpoint(w=w).save(str(directory / "ckpt" / "w"))
  return directory / "f.pb", prefix


def test_unrecoverable_shapes_are_one_line(unrecoverable, tmp_path, capsys):
  path, prefix = unrecoverable
  out = tmp_path / "out.pb"
  code, stdout, err = _cli(["rewrite", path, "-o", out, "--mesh", "tp=2"], capsys)
  assert code == 2, stdout + err
  lines = [l for l in err.splitlines() if l.strip()]
  assert len(lines) == 1, err
  assert "1 of 1 captured variables have no shape" in lines[0]
  assert "(kernel)" in lines[0] and "--variables PATH" in lines[0]
  assert "tf.function" in lines[0]
  assert not out.exists() and not (tmp_path / "out.manifest.json").exists()
  code, _, err = _cli(["verify", path, path], capsys)
  assert code == 2 and len(err.strip().splitlines()) == 1, err
  # inspect still reports the graph, with one note instead of a warning per variable.
  code, stdout, err = _cli(["inspect", path], capsys)
  assert code == 0 and len(err.strip().splitlines()) == 1 and "note: 1 of 1" in err, err

  # With the checkpoint: its shape and name, and the rewrite verifies.
  code, stdout, err = _cli(["inspect", path, "--variables", prefix, "--format", "json"], capsys)
  assert code == 0, err
  (var,) = json.loads(stdout)["variables"]
  assert (var["name"], var["shape"], var["dtype"]) == ("w", [3, 5], "float32")
  code, stdout, err = _cli(["rewrite", path, "-o", out, "--mesh", "tp=2",
                            "--variables", prefix], capsys)
  assert code == 0, stdout + err
  code, stdout, err = _cli(["verify", path, out, "--variables", prefix], capsys)
  assert code == 0, stdout + err
