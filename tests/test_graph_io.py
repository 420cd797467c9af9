"""Loading, saving and validating graphs; bad input through the CLI."""
import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tfsplit.cli import run
from tfsplit.errors import GraphLoadError, GraphValidationError
from tfsplit.graph import Graph, find_variables, infer_shapes, load_graph, save_graph
from tfsplit.graph.validate import validate_graph_def
from tfsplit.runtime.graph_function import import_graph


def _small_graph_def():
  @tf.function
  def f(x):
    with tf.name_scope("block"):
      y = tf.matmul(x, tf.ones([3, 2]))
    return tf.nn.relu(y) + 1.0
  return load_graph(f, input_signature=[tf.TensorSpec([4, 3])])


def _cli(args, capsys):
  code = run(["tfsplit"] + args)
  captured = capsys.readouterr()
  return code, captured.out, captured.err


# --- bad input: one line on stderr naming the problem, exit 2, no output -----
def _assert_one_line_error(code, err, *needles):
  assert code == 2
  lines = [l for l in err.splitlines() if l.strip()]
  assert len(lines) == 1, err
  assert "Traceback" not in err
  for needle in needles:
    assert needle in lines[0], lines[0]


def test_missing_file(tmp_path, capsys):
  out = tmp_path / "report.txt"
  code, _, err = _cli(["inspect", str(tmp_path / "nope.pb"), "--output", str(out)], capsys)
  _assert_one_line_error(code, err, "nope.pb", "no such file")
  assert not out.exists()


def test_empty_file(tmp_path, capsys):
  path = tmp_path / "empty.pb"
  path.write_bytes(b"")
  code, _, err = _cli(["inspect", str(path)], capsys)
  _assert_one_line_error(code, err, "empty.pb", "empty")


def test_truncated_file(tmp_path, capsys):
  data = _small_graph_def().SerializeToString()
  path = tmp_path / "cut.pb"
  path.write_bytes(data[: len(data) // 2])
  out = tmp_path / "report.txt"
  code, _, err = _cli(["inspect", str(path), "--output", str(out)], capsys)
  _assert_one_line_error(code, err, "cut.pb")
  assert not out.exists()


def test_corrupt_file(tmp_path, capsys):
  path = tmp_path / "noise.pb"
  path.write_bytes(np.random.RandomState(0).bytes(4096))
  code, _, err = _cli(["inspect", str(path)], capsys)
  _assert_one_line_error(code, err, "noise.pb")


def test_text_syntax_error(tmp_path, capsys):
  path = tmp_path / "bad.pbtxt"
  path.write_text('node { name: "a" op: "Const" \n  attr { key: }\n')
  code, _, err = _cli(["inspect", str(path)], capsys)
  _assert_one_line_error(code, err, "bad.pbtxt", "text GraphDef")


def test_dangling_input(tmp_path, capsys):
  graph_def = _small_graph_def()
  graph_def.node[-1].input.append("ghost_node:0")
  path = tmp_path / "dangling.pb"
  save_graph(graph_def, path)
  code, _, err = _cli(["inspect", str(path)], capsys)
  _assert_one_line_error(code, err, graph_def.node[-1].name, "ghost_node")


def test_cycle(tmp_path, capsys):
  graph_def = graph_pb2.GraphDef()
  for name, src in (("a", "c"), ("b", "a"), ("c", "b")):
    node = graph_def.node.add(name=name, op="Identity", input=[src])
    node.attr["T"].type = tf.float32.as_datatype_enum
  path = tmp_path / "cycle.pb"
  save_graph(graph_def, path)
  code, _, err = _cli(["inspect", str(path)], capsys)
  _assert_one_line_error(code, err, "cycle", "'a'")


def _chain(reads):
  """GraphDef of Identity nodes in the given order: (name, [inputs])."""
  graph_def = graph_pb2.GraphDef()
  node = graph_def.node.add(name="x", op="Placeholder")
  node.attr["dtype"].type = tf.float32.as_datatype_enum
  for name, inputs in reads:
    node = graph_def.node.add(name=name, op="Identity", input=inputs)
    node.attr["T"].type = tf.float32.as_datatype_enum
  return graph_def


@pytest.mark.parametrize("reads, cycle", [
    # Out of GraphDef order, but acyclic (a traced function waits on a later NoOp).
    ([("a", ["x", "^c"]), ("b", ["x"]), ("c", ["b"])], False),
    ([("a", ["d"]), ("b", ["a"]), ("c", ["x"]), ("d", ["c"])], False),
    # Cycles entered at their first node, far from it, and a node reading itself.
    ([("a", ["x", "^d"]), ("b", ["a"]), ("c", ["b"]), ("d", ["c"])], True),
    ([("a", ["x"]), ("b", ["a", "^d"]), ("c", ["b"]), ("d", ["c"]), ("e", ["d"])], True),
    ([("a", ["x", "^a"])], True),
])
def test_out_of_order_inputs(reads, cycle):
  graph_def = _chain(reads)
  if not cycle:
    validate_graph_def(graph_def, import_check=False)
    return
  with pytest.raises(GraphValidationError, match="cycle through node"):
    validate_graph_def(graph_def, import_check=False)


def _kahn_smallest_first(graph_def):
  """Node names in Kahn's order taking the smallest node index among the
  ready ones (NextIteration's edges aside), or None on a cycle."""
  import heapq  # pylint: disable=import-outside-toplevel
  index = {n.name: i for i, n in enumerate(graph_def.node)}
  pending, children = [0] * len(index), [[] for _ in index]
  for i, node in enumerate(graph_def.node):
    for text in node.input:
      j = index[text.lstrip("^").split(":")[0]]
      if graph_def.node[j].op != "NextIteration":
        children[j].append(i)
        pending[i] += 1
  ready, order = [i for i, c in enumerate(pending) if not c], []
  while ready:
    i = heapq.heappop(ready)
    order.append(graph_def.node[i].name)
    for child in children[i]:
      pending[child] -= 1
      if not pending[child]:
        heapq.heappush(ready, child)
  return order if len(order) == len(index) else None


def test_topological_order_is_smallest_first_kahn():
  """On random graphs, most in order, some not, some cyclic: the order is
  Kahn's taking the smallest index first, and a cycle is an error."""
  rng = np.random.default_rng(0)
  checked = {"in order": 0, "reordered": 0, "cyclic": 0}
  for _ in range(300):
    n = int(rng.integers(1, 30))
    rank = rng.permutation(n)
    graph_def = graph_pb2.GraphDef()
    for i in range(n):
      graph_def.node.add(name=f"n{rank[i]}",
                         op="NextIteration" if rng.random() < 0.05 else "Identity")
    for i, node in enumerate(graph_def.node):
      for j in rng.integers(0, n, size=int(rng.integers(0, 4))):
        if rank[j] < rank[i] or rng.random() < 0.02:  # a DAG by rank, rarely a cycle
          node.input.append(("^" if rng.random() < 0.3 else "") + graph_def.node[j].name)
    want = _kahn_smallest_first(graph_def)
    if want is None:
      checked["cyclic"] += 1
      with pytest.raises(GraphValidationError, match="cycle through node"):
        Graph(graph_def).topological_order()
      continue
    checked["in order" if want == [x.name for x in graph_def.node] else "reordered"] += 1
    assert Graph(graph_def).topological_order() == want
  assert min(checked.values()) > 10, checked


def test_unknown_op(tmp_path, capsys):
  graph_def = _small_graph_def()
  graph_def.node[1].op = "MyFancyCustomOp"
  path = tmp_path / "custom.pb"
  save_graph(graph_def, path)
  code, _, err = _cli(["inspect", str(path)], capsys)
  _assert_one_line_error(code, err, graph_def.node[1].name, "MyFancyCustomOp")


def test_duplicate_node_name():
  graph_def = _small_graph_def()
  graph_def.node.add().CopyFrom(graph_def.node[0])
  with pytest.raises(GraphValidationError, match="defined twice"):
    load_graph(graph_def)


def test_not_a_graph_object():
  with pytest.raises(GraphLoadError, match="cannot load a graph from int"):
    load_graph(42)


def test_save_is_atomic(tmp_path, monkeypatch):
  path = tmp_path / "g.pb"
  save_graph(_small_graph_def(), path)
  before = path.read_bytes()

  def boom(*_):
    raise OSError("disk full")
  monkeypatch.setattr(os, "replace", boom)
  with pytest.raises(OSError):
    save_graph(graph_pb2.GraphDef(), path)
  assert path.read_bytes() == before
  assert [p.name for p in tmp_path.iterdir()] == ["g.pb"]  # no temp file left


# --- formats -------------------------------------------------------------------
def test_text_and_binary_round_trip(tmp_path):
  graph_def = _small_graph_def()
  save_graph(graph_def, tmp_path / "g.pbtxt")
  save_graph(graph_def, tmp_path / "g.pb")
  assert load_graph(str(tmp_path / "g.pbtxt")) == graph_def
  assert load_graph(str(tmp_path / "g.pb")) == graph_def
  # Saving is deterministic: same graph, same bytes.
  save_graph(load_graph(str(tmp_path / "g.pb")), tmp_path / "g2.pb")
  assert (tmp_path / "g.pb").read_bytes() == (tmp_path / "g2.pb").read_bytes()


def test_saved_model_signature(tmp_path):
  module = tf.Module()
  module.w = tf.Variable(np.arange(6, dtype=np.float32).reshape(3, 2), name="w")

  @tf.function(input_signature=[tf.TensorSpec([4, 3])])
  def serve(x):
    return {"y": tf.matmul(x, module.w)}
  module.serve = serve
  tf.saved_model.save(module, str(tmp_path / "sm"), signatures={"serving_default": serve})
  graph_def = load_graph(str(tmp_path / "sm"))
  graph = Graph(graph_def)
  assert not [n for n in graph.nodes if n.op.endswith("PartitionedCall")]
  variables = find_variables(graph)
  assert [(v.shape, v.dtype_name) for v in variables] == [((3, 2), "float32")]
  with pytest.raises(GraphLoadError, match="no signature 'nope'"):
    load_graph(str(tmp_path / "sm"), signature="nope")


# --- function inlining -------------------------------------------------------------
def test_inlining_keeps_results_and_side_effects():
  v = tf.Variable(1.0, name="counter")

  @tf.function(experimental_attributes={"_noinline": True})
  def inner(a):
    v.assign_add(1.0)
    return tf.nn.relu(a) * 2.0, a + 1.0

  @tf.function
  def outer(a):
    b, c = inner(a)
    return b + c

  fn = outer.get_concrete_function(tf.TensorSpec([3]))
  raw = fn.graph.as_graph_def()
  assert any(n.op.endswith("PartitionedCall") for n in raw.node)
  flat = load_graph(fn)
  assert not any(n.op.endswith("PartitionedCall") for n in flat.node)
  assert len(flat.library.function) == 0
  x = tf.constant([-1.0, 0.5, 2.0])
  expected = outer(x).numpy()
  v.assign(1.0)
  imported = import_graph(flat, [v])
  np.testing.assert_allclose(imported(x)[0].numpy(), expected)
  assert v.numpy() == 2.0  # the assignment inside the inlined body ran


def test_shapes_of_captured_variables():
  v = tf.Variable(tf.zeros([5, 7]), name="kernel")

  @tf.function
  def f(x):
    return tf.matmul(x, v)
  graph = Graph(load_graph(f, input_signature=[tf.TensorSpec([2, 5])]))
  shapes = infer_shapes(graph)
  assert shapes["MatMul"][0].shape == (2, 7)
  reads = [n.name for n in graph.nodes if n.op == "ReadVariableOp"]
  assert shapes[reads[0]][0].shape == (5, 7)
  (info,) = find_variables(graph)
  assert (info.name, info.shape, info.num_bytes) == ("kernel", (5, 7), 140)


def test_variable_shape_recovered_without_annotation():
  v = tf.Variable(tf.zeros([4, 3]), name="kernel")

  @tf.function
  def f(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.matmul(x, v))
    v.assign_sub(0.1 * tape.gradient(loss, v))
    return loss
  fn = f.get_concrete_function(tf.TensorSpec([2, 4]))
  graph = Graph(load_graph(fn.graph.as_graph_def()))  # no tfsplit annotations
  variables = find_variables(graph)
  infer_shapes(graph, variables)
  assert variables[0].shape == (4, 3) and variables[0].dtype_name == "float32"


# --- the Graph index ---------------------------------------------------------------
def test_graph_index_edits():
  graph = Graph(_small_graph_def())
  order = graph.topological_order()
  position = {n: i for i, n in enumerate(order)}
  for name in order:
    for src, _ in Graph.inputs(graph.node(name)):
      assert position[src] < position[name]
  matmul = next(n for n in graph.nodes if n.op == "MatMul")
  consumers = graph.consumers(matmul.name, 0)
  assert consumers
  name = graph.unique_name(matmul.name)
  assert name != matmul.name and name not in graph
  ident = graph.add_node(name, "Identity", [matmul.name],
                         {"T": matmul.attr["T"]})
  graph.rewire(matmul.name, ident.name, exclude={ident.name})
  for consumer, index in consumers:
    assert graph.node(consumer).input[index] == ident.name
  graph.topological_order()
  out = graph.to_graph_def()
  assert out.node[-1].name == name
