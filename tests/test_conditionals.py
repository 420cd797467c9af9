"""Functional conditionals over split variables.

`tf.cond` in a step is a functional If (StatelessIf when its branches have no
side effects). Loading lowers it to Switch and Merge as TF does before it
runs a graph (graph/functions.py), so its branches are split like the rest:
the branch not taken is dead on every device, the predicate is computed from
the whole tensors it reads.
"""
import numpy as np
import pytest
import tensorflow as tf

from tfsplit.graph import load_graph
from tfsplit.layout.mesh import Mesh
from tfsplit.passes import split_graph
from tfsplit.runtime.graph_function import import_graph
from tfsplit.runtime.verify import verify

from _util import TIMEOUT


def _step():
  """A raw-TF step with both kinds of cond: gradient clipping by global norm
  (a StatelessIf with a value out) and, on even steps, SGD; on odd steps a
  halved SGD step that also counts in `odd_steps` (an If updating variables
  in both branches, returning the learning rate it used)."""
  rng = np.random.default_rng(0)
  w1 = tf.Variable(rng.standard_normal((32, 64)).astype(np.float32) * 0.3, name="w1")
  w2 = tf.Variable(rng.standard_normal((64, 16)).astype(np.float32) * 0.3, name="w2")
  step_count = tf.Variable(0, dtype=tf.int64, name="step_count")
  odd_steps = tf.Variable(0.0, name="odd_steps")
  variables = [w1, w2]

  @tf.function(input_signature=[tf.TensorSpec([16, 32], tf.float32),
                                tf.TensorSpec([16], tf.int32)], autograph=False)
  def step(x, labels):
    with tf.GradientTape() as tape:
      logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=labels, logits=logits))
    grads = tape.gradient(loss, variables)
    norm = tf.linalg.global_norm(grads)
    clip = tf.cond(norm > 1.0, lambda: 1.0 / norm, lambda: tf.constant(1.0))
    grads = [g * clip for g in grads]

    def even():
      for v, g in zip(variables, grads):
        v.assign_sub(0.1 * g)
      return tf.constant(0.1)

    def odd():
      for v, g in zip(variables, grads):
        v.assign_sub(0.05 * g)
      odd_steps.assign_add(1.0)
      return tf.constant(0.05)

    lr = tf.cond(tf.equal(step_count % 2, 0), even, odd)
    with tf.control_dependencies([lr]):
      step_count.assign_add(1)
    return loss, lr, norm

  names = [(v, v.name.split(":")[0]) for v in variables + [step_count, odd_steps]]
  return step, names


def _graph():
  step, names = _step()
  return load_graph(step.get_concrete_function(), variable_names=names), step, names


def test_conds_are_lowered_to_switch_and_merge():
  graph_def, _, _ = _graph()
  ops = {n.op for n in graph_def.node}
  assert not ops & {"If", "StatelessIf"}
  assert {"Switch", "Merge"} <= ops
  assert not graph_def.library.function


def test_lowered_graph_runs_as_the_tf_function():
  """Three steps of the loaded graph against the tf.function itself, each
  from the same start: outputs and every variable, both branches taken."""
  graph_def, step, names = _graph()
  start = [v.numpy() for v, _ in names]
  rng = np.random.default_rng(1)
  inputs = [tf.constant(rng.standard_normal((16, 32)).astype(np.float32) * 3),
            tf.constant(rng.integers(0, 16, 16).astype(np.int32))]
  want = []
  for _ in range(3):
    want.append(([o.numpy() for o in step(*inputs)], [v.numpy() for v, _ in names]))
  for (v, _), value in zip(names, start):
    v.assign(value)
  fn = import_graph(graph_def, {name: v for v, name in names})
  for k, (w_out, w_vars) in enumerate(want):
    got = [o.numpy() for o in fn(*inputs)]
    for g, w in zip(got, w_out):
      np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=f"step {k + 1}")
    for (v, name), w in zip(names, w_vars):
      np.testing.assert_allclose(v.numpy(), w, rtol=1e-6, atol=1e-7,
                                 err_msg=f"step {k + 1} {name}")
  assert float(want[-1][1][3]) == 1.0  # the odd branch ran once, the even twice
  assert [float(o[1]) for o, _ in want] == pytest.approx([0.1, 0.05, 0.1])


@pytest.mark.parametrize("mesh", ["tp=2", "dp=2", "dp=2,tp=2"])
def test_conds_over_split_variables_train_exactly(mesh):
  graph_def, _, _ = _graph()
  axes = Mesh.parse(mesh).axes
  size = int(np.prod(list(axes.values())))
  devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(size)]
  result = split_graph(graph_def, Mesh(axes, devices), timeout_seconds=TIMEOUT)
  if "tp" in mesh:
    assert any(any(e["sharding"]) for e in result.manifest.values())
  assert sum(n.op == "Switch" for n in result.graph_def.node) >= 2 * size
  report = verify(graph_def, result.graph_def,
                  {"variables": result.manifest, "outputs": result.output_copies,
                   "devices": devices}, steps=3, every_step=True)
  report.assert_ok(mesh)


def test_folded_constants_in_a_branch_wait_for_its_pivot():
  """Shape folding keeps a branch's constants dead in the branch not taken:
  a folded value carries the control inputs its computation had (the
  pivot), and a Merge of two constant branches is never folded."""
  from tfsplit.graph import Graph  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.fold import fold_and_expand  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.shapes import infer_shapes  # pylint: disable=import-outside-toplevel
  graph_def, _, _ = _graph()
  graph = Graph(graph_def)
  folded, _ = fold_and_expand(graph, infer_shapes(graph))
  merges = {n.name for n in graph_def.node if n.op == "Merge"}
  assert merges and merges == {n.name for n in folded.node if n.op == "Merge"}
  branch_consts = [n for n in folded.node if n.op == "Const"
                   and ("/then/" in n.name or "/else/" in n.name)]
  assert branch_consts
  for node in branch_consts:
    assert any(t.startswith("^") and "/pivot_" in t for t in node.input), node


def _while_step():
  w = tf.Variable(np.eye(8, dtype=np.float32) + 0.1, name="loop_w")

  @tf.function(input_signature=[tf.TensorSpec([4, 8], tf.float32)], autograph=False)
  def step(x):
    with tf.GradientTape() as tape:
      h = tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.matmul(h, w)), [0, x])[1]
      loss = tf.reduce_sum(h * h)
    w.assign_sub(0.01 * tape.gradient(loss, [w])[0])
    return loss

  return load_graph(step.get_concrete_function(), variable_names=[(w, "loop_w")])


def test_a_while_loop_runs_whole_and_a_split_variable_in_it_is_refused():
  """A loop stays one node (its gradient's TensorList accumulators are not
  folded): over dp the batch is gathered for it and the step is exact; a
  variable split by annotation that the loop reads is refused by name."""
  from tfsplit.errors import UnsupportedOpError  # pylint: disable=import-outside-toplevel
  graph_def = _while_step()
  devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2)]
  result = split_graph(graph_def, Mesh({"dp": 2}, devices), timeout_seconds=TIMEOUT)
  assert any("'while' (op While)" in f for f in result.fallbacks), result.fallbacks
  verify(graph_def, result.graph_def, {"variables": result.manifest,
                                       "outputs": result.output_copies, "devices": devices},
         steps=3).assert_ok("dp=2")
  with pytest.raises(UnsupportedOpError, match=r"'while' \(op While\)"):
    split_graph(graph_def, Mesh({"tp": 2}, devices), timeout_seconds=TIMEOUT,
                annotations={"loop_w": (None, "tp")})
