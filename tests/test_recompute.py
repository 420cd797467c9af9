"""Recomputation (activation checkpointing): exact training alone and with
every parallelism, the rewrite's structure, the order it holds under TF's
Grappler in a real step, and its user errors."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tfsplit import constants
from tfsplit.cli import run
from tfsplit.errors import PlanError
from tfsplit.graph import load_graph, save_graph
from tfsplit.graph.fold import fold_and_expand
from tfsplit.graph.ir import Graph, parse_input
from tfsplit.graph.layers import RECOMPUTE_OF_ATTR
from tfsplit.memory import recompute as recompute_lib
from tfsplit.passes import split_graph
from tfsplit.passes.analysis import Analysis
from tfsplit.runtime.graph_function import import_graph, traced_call
from tfsplit.runtime.split_function import make_mesh
from tfsplit.sharding.builder import read_records

from _util import check_training, example, names

BATCH = 8   # divisible by dp=2 x 4 micro-batches
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _graph(name, size="tiny"):
  ex = example(name, size)
  return load_graph(ex.concrete("train"), variable_names=names(ex))


def _recomputed(graph_def, mode):
  """(Recomputed, Analysis of the folded original) of `graph_def` under `mode`."""
  analysis = Analysis(graph_def)
  analysis.replace(*fold_and_expand(analysis.graph, analysis.shapes))
  result = recompute_lib.recompute(analysis.graph, analysis.shapes, analysis.layers, mode,
                                   analysis.variables)
  return result, analysis


# --- exact training ------------------------------------------------------------------
@pytest.mark.parametrize("name,mode,mesh,m", [
    ("gpt_raw", "blocks", "dp=1", 1),
    ("gpt_raw", "blocks", "dp=2", 1),
    ("gpt_raw", "blocks", "tp=2", 1),
    ("gpt_raw", "blocks", "dp=1", 4),
    ("gpt_keras3", "blocks", "dp=1", 1),
    ("gpt_keras3", "blocks", "pp=2", 4),
    ("gpt_tfkeras", "blocks", "tp=2", 1),
    ("gpt_raw", "selective", "dp=2,tp=2", 1),
    ("gpt_tfkeras", "selective", "dp=1", 1),
    ("gpt_keras3", ["gpt_1/block_1_1", "gpt_1/block_0_1/mlp*"], "dp=1", 1),
])
def test_training_is_exact(name, mode, mesh, m):
  step = check_training(example(name, batch_size=BATCH), mesh=mesh, microbatches=m,
                        recompute=mode)
  assert step.result.config.recompute_mode is not None
  assert not recompute_lib.check(step.graph_def)


@pytest.mark.slow
@pytest.mark.parametrize("mesh,m", [("dp=1", 1), ("dp=2", 1), ("tp=2", 1), ("dp=1", 4),
                                    ("pp=2", 4), ("dp=2,tp=2", 1)])
@pytest.mark.parametrize("mode", ["blocks", "selective", "auto"])
@pytest.mark.parametrize("name", ["gpt_raw", "gpt_keras3", "gpt_tfkeras", "causallm_keras3",
                                  "llama_keras3", "bert_tfkeras", "vit_keras3",
                                  "llama_tfkeras"])
def test_training_is_exact_everywhere(name, mode, mesh, m):
  check_training(example(name, batch_size=BATCH), mesh=mesh, microbatches=m, recompute=mode)


# --- structure ------------------------------------------------------------------------
def test_blocks_copies_gates_and_consumers():
  graph_def = _graph("gpt_raw")
  result, before = _recomputed(graph_def, "blocks")
  blocks = [l.name for l in before.layers.layers if l.block]
  assert [s.name for s in result.segments] == blocks
  after = Analysis(result.graph_def)
  after.replace(result.graph_def, known_shapes=result.known_shapes)
  roles, layer_of = after.roles, after.layers.layer_of
  for copy, original in result.copies.items():
    assert copy == f"{original}/recompute"
    # A copy is a backward op of its original's layer (what later passes read).
    assert roles[copy] == "backward" and layer_of[copy] == before.layers.layer_of[original]
  assert not recompute_lib.check(result.graph_def, roles)
  for seg in result.segments:
    assert seg.roots and seg.gates and seg.tensors
    # The gate is the gradient arriving from the layers after the block.
    assert all(roles[g] == "backward" for g in seg.gates)
    # Only the block's input is kept: its backward reads none of its forward
    # activations, every one it read is read from a copy now.
    layer = before.layers.layer(seg.name)
    graph = after.graph
    for op in layer.backward:
      for src, port in graph.data_inputs(op):
        assert not (src in layer.forward and roles.get(src) == "forward" and
                    graph.node(src).op not in ("Const", "ReadVariableOp")), (op, src)
  # Kept activations: the blocks now keep (almost) nothing for the backward.
  was = {l.name: l.activation_bytes for l in before.layers.layers}
  now = {l.name: l.activation_bytes for l in after.layers.layers}
  assert sum(now[b] for b in blocks) < 0.1 * sum(was[b] for b in blocks)


def _ancestors(graph, names):
  """`names` and every node they read, data or control, transitively."""
  seen, stack = set(), list(names)
  while stack:
    n = stack.pop()
    if n not in seen:
      seen.add(n)
      stack.extend(parse_input(t)[0] for t in graph.node(n).input)
  return seen


@pytest.mark.parametrize("name", ["gpt_raw", "causallm_keras3"])
def test_later_backward_ends_before_the_copies_start(name):
  """Each block's copies wait for the whole backward of what comes after it
  (the next block; after the last, the final norm and the tied LM head): the
  weight gradients off the path of the block's own gradient too, which TF's
  executor otherwise defers to the end of the step while the activation-sized
  gradients they read stay alive."""
  result, before = _recomputed(_graph(name), "blocks")
  report = before.layers
  graph = Graph(result.graph_def)
  layers = report.layers
  blocks = [l for l in layers if l.block]
  later = [[l.name] for l in blocks[1:]] + [
      [l.name for l in layers if l.index > blocks[-1].index and l.backward]]
  assert later[-1], "no layer after the last block"
  for seg, after_it in zip(result.segments, later):
    waited = _ancestors(graph, seg.roots)
    due = [n for l in after_it for n in report.layer(l).backward
           if constants.is_gradient_name(n) and n not in report.variable_free]
    assert due and not [n for n in due if n not in waited], (seg.name, [
        n for n in due if n not in waited][:5])
    # Never an optimizer op: under dp one reads the all-reduced gradient.
    assert all(constants.is_gradient_name(d) for d in seg.drains)


@pytest.mark.parametrize("name", ["gpt_raw", "llama_keras3"])
def test_no_later_op_reads_a_recomputed_activation(name):
  """Once recomputed, a block's forward activations are read by forward ops,
  copies and the next block (its input) only: every other op that leads to a
  gradient reads the copies. tf.nn.silu's custom gradient (llama's
  SwiGLU) is unscoped ops reading the activation: they are backward ops of
  the block (graph/layers.py), so they read the copies too."""
  result, before = _recomputed(_graph(name), "blocks")
  graph, roles, layer_of = Graph(result.graph_def), before.layers.role, before.layers.layer_of
  blocks = {l.name for l in before.layers.layers if l.block}
  gradients = {n for n in graph.node_names() if constants.is_gradient_name(n)}

  def leads_to_a_gradient(start):
    seen, stack = set(), [start]
    while stack:
      n = stack.pop()
      if n in gradients:
        return True
      if n not in seen:
        seen.add(n)
        stack.extend(c for c, _ in graph.consumers(n))
    return False
  recomputed = set(result.copies.values())
  for original in recomputed:
    for consumer, _ in graph.consumers(original):
      if consumer in result.copies or roles.get(consumer) == "forward" or (
          layer_of.get(consumer) in blocks and layer_of[consumer] != layer_of[original]):
        continue  # a copy, the forward, a later block reading its input
      assert not leads_to_a_gradient(consumer), (original, consumer)


def test_check_fails_without_the_gate():
  result, _ = _recomputed(_graph("gpt_raw"), "blocks")
  ungated = _strip_gates(result.graph_def)
  problems = recompute_lib.check(ungated)
  assert len(problems) == len(result.copies)
  assert all("is not gated" in p for p in problems)


def test_selective_recomputes_the_attention_core_only():
  result, before = _recomputed(_graph("gpt_raw"), "selective")
  ops = {before.graph.node(o).op for o in result.copies.values()}
  assert "Softmax" in ops and ops <= {"BatchMatMulV2", "Mul", "SelectV2", "Softmax"}
  assert len(result.segments) == sum(l.block for l in before.layers.layers)
  # The matmul with the values is not recomputed; its gradient reads the
  # recomputed probabilities.
  assert not any(o.endswith("MatMul_1") for o in result.copies.values())


def test_auto_takes_sqrt_n_segments():
  result, before = _recomputed(_graph("gpt_raw", "small"), "auto")   # 4 blocks
  blocks = [l.name for l in before.layers.layers if l.block]
  assert len(blocks) == 4
  assert [s.layers for s in result.segments] == [tuple(blocks[:2]), tuple(blocks[2:])]
  # Each segment keeps its first block's input only: the second block's
  # input is recomputed with the first block.
  assert any(o.startswith(blocks[1] + "/") for o in result.copies.values())


@pytest.mark.slow
def test_auto_trains_exactly():
  check_training(example("gpt_raw", "small"), mesh="dp=1", recompute="auto")


def test_the_rewrite_is_deterministic():
  graph_def = _graph("gpt_raw")
  mesh = make_mesh("dp=1")
  a = split_graph(graph_def, mesh, recompute="blocks", microbatches=2)
  b = split_graph(graph_def, mesh, recompute="blocks", microbatches=2)
  assert a.graph_def.SerializeToString(deterministic=True) == \
      b.graph_def.SerializeToString(deterministic=True)
  assert not recompute_lib.check(a.graph_def)


def _blocks_with_random_ops():
  """Two repeated blocks with dropout (a RandomUniform draw from a constant
  shape) and a Multinomial draw from an activation: stateful random ops."""
  rng = np.random.RandomState(0)
  weights = [tf.Variable(rng.randn(8, 8).astype(np.float32) * 0.3, name=f"w{i}")
             for i in range(2)]

  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      h = x
      with tf.name_scope("net"):
        for i, w in enumerate(weights):
          with tf.name_scope(f"block_{i}"):
            a = tf.nn.relu(tf.matmul(h, w))
            pick = tf.one_hot(tf.random.categorical(a, 1)[:, 0], 8)
            h = h + tf.nn.dropout(a, rate=0.5) * pick
      loss = tf.reduce_mean(tf.square(h))
    for w, g in zip(weights, tape.gradient(loss, weights)):
      w.assign_sub(0.1 * g)
    return loss
  return load_graph(step, input_signature=[tf.TensorSpec([4, 8], tf.float32)])


def test_stateful_random_ops_are_kept_not_recomputed():
  result, before = _recomputed(_blocks_with_random_ops(), "blocks")
  graph = before.graph
  draws = [n.name for n in graph.nodes if n.op in ("RandomUniform", "Multinomial")]
  assert len(draws) == 4
  assert not any(graph.node(o).op in ("RandomUniform", "Multinomial")
                 for o in result.copies.values())
  # The draw from an activation is read, as it was, by the copies that
  # rebuild the mask from it: the backward pass sees the forward's draw.
  copies = [n for n in result.graph_def.node if n.name in result.copies]
  multinomial = {d for d in draws if graph.node(d).op == "Multinomial"}
  assert {d for d in multinomial for c in copies if d in c.input} == multinomial
  # Dropout's draw depends on no weight: its mask is kept, not recomputed.
  assert not any(graph.node(o).op == "GreaterEqual" for o in result.copies.values())
  assert not recompute_lib.check(result.graph_def)


# --- under Grappler, in a real step ------------------------------------------------------
def _strip_gates(graph_def):
  """`graph_def` with every copy's control inputs from non-copies removed."""
  out = type(graph_def)()
  out.CopyFrom(graph_def)
  copies = recompute_lib.copies_of(out)
  for node in out.node:
    if node.name in copies:
      kept = [t for t in node.input if not t.startswith("^") or t[1:] in copies]
      del node.input[:]
      node.input.extend(kept)
  return out


def _copy_timing(graph_def, trace, copies=None):
  """(copies that ran, copies in the graph, first copy's start, last end of
  the original forward ops that have a copy), from the events of one step
  that trace() runs and traces. `copies`: {copy: original} (default: read
  from `graph_def`)."""
  events = trace()
  copies = copies or recompute_lib.copies_of(graph_def)
  records = read_records(graph_def)
  originals = set(copies.values())
  starts = [s for _, n, s, _ in events if n in copies]
  ends = [e for _, n, _, e in events
          if n not in copies and n in records and records[n].source in originals]
  assert starts and ends
  return len(starts), len(copies), min(starts), max(ends)


def test_copies_survive_grappler_and_run_in_the_backward():
  ex = example("gpt_raw")
  step = check_training(ex, mesh="dp=1", recompute="blocks", steps=1)
  inputs = [tf.constant(x) for x in ex.make_inputs("train", seed=3)]
  step(*inputs)
  ran, made, first_copy, last_forward = _copy_timing(step.graph_def,
                                                     lambda: step.trace(*inputs)[1])
  # Grappler (one round, as tfsplit.split runs a split step) neither merged
  # the copies into their originals nor ran them early: they start after
  # every original they copy has finished, in the backward pass.
  assert ran >= made // 2, (ran, made)
  assert first_copy >= last_forward, (first_copy, last_forward)
  # Without the gate the same graph runs its copies during the forward pass.
  ungated = _strip_gates(step.graph_def)
  ungated_ran, _, first_copy, last_forward = _run_and_time(ungated, step, inputs)
  assert first_copy < last_forward
  # The gate alone keeps Grappler's common-subexpression elimination from
  # merging the copies back: without their record attr as many copies run,
  # without the gate as well many fewer do.
  assert _run_and_time(_without_record(step.graph_def), step, inputs)[0] == ran
  assert _run_and_time(_without_record(ungated), step, inputs)[0] < ungated_ran * 0.75


def _run_and_time(graph_def, step, inputs):
  """_copy_timing of `graph_def` (a variant of step's graph) run on step's variables."""
  fn = import_graph(graph_def, step.variables)
  fn(*inputs)
  return _copy_timing(graph_def, lambda: traced_call(fn, inputs, graph_def)[1],
                      recompute_lib.copies_of(step.graph_def))


def _without_record(graph_def):
  out = type(graph_def)()
  out.CopyFrom(graph_def)
  names_of_copies = set(recompute_lib.copies_of(graph_def))
  for node in out.node:
    if node.name in names_of_copies:
      del node.attr[RECOMPUTE_OF_ATTR]
  return out


@pytest.mark.slow
def test_benchmark_blocks_saves_memory():
  """tools/bench_recompute.py on the small raw GPT: blocks keeps at least
  2.5x less activation memory than no recomputation, same graph, same run."""
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, "tools", "bench_recompute.py"), "--models",
       "gpt_raw", "--modes", "blocks,selective", "--rounds", "3"],
      capture_output=True, text=True, check=True).stdout
  found = re.search(r"recompute=blocks: activation memory ([0-9.]+) kept, ([0-9.]+)x less, "
                    r"step time ([0-9.]+)x", out)
  assert found, out
  assert float(found.group(2)) >= 2.5, out
  assert "recompute=selective: activation memory" in out


# --- errors ------------------------------------------------------------------------------
def _no_blocks_graph():
  rng = np.random.RandomState(0)
  w1 = tf.Variable(rng.randn(8, 16).astype(np.float32), name="w1")
  w2 = tf.Variable(rng.randn(16, 4).astype(np.float32), name="w2")

  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      with tf.name_scope("net"):
        with tf.name_scope("fc1"):
          h = tf.nn.relu(tf.matmul(x, w1))
        with tf.name_scope("fc2"):
          y = tf.matmul(h, w2)
      loss = tf.reduce_mean(tf.square(y))
    g1, g2 = tape.gradient(loss, [w1, w2])
    w1.assign_sub(0.1 * g1)
    w2.assign_sub(0.1 * g2)
    return loss
  return load_graph(step, input_signature=[tf.TensorSpec([4, 8], tf.float32)])


@pytest.mark.parametrize("mode", ["blocks", "auto", "selective"])
def test_no_blocks_is_one_plan_error(mode):
  with pytest.raises(PlanError) as e:
    split_graph(_no_blocks_graph(), make_mesh("dp=1"), recompute=mode)
  assert f"recompute='{mode}' needs the model's repeated blocks" in str(e.value)
  assert "name the blocks' scopes instead" in str(e.value)
  # Scopes work where no block is found.
  result = split_graph(_no_blocks_graph(), make_mesh("dp=1"), recompute="net/fc1,net/fc2")
  assert recompute_lib.copies_of(result.graph_def)


def test_selective_without_softmax_is_one_plan_error():
  with pytest.raises(PlanError, match="no block of this graph has a Softmax op"):
    split_graph(_blocks_with_random_ops(), make_mesh("dp=1"), recompute="selective")


@pytest.mark.parametrize("value,needle", [
    ("blokcs", "unknown recompute mode 'blokcs'; choose none, blocks, selective or auto"),
    (3, "recompute must be none, blocks, selective, auto or a list of name scopes"),
    (["gpt/block_0", ""], "recompute scopes must be non-empty strings"),
])
def test_bad_modes(value, needle):
  with pytest.raises(PlanError) as e:
    split_graph(_graph("gpt_raw"), make_mesh("dp=1"), recompute=value)
  assert needle in str(e.value)


def test_scope_matching_nothing():
  with pytest.raises(PlanError) as e:
    split_graph(_graph("gpt_raw"), make_mesh("dp=1"), recompute="gpt/block_9,gpt/block_0")
  assert str(e.value).startswith("recompute scope 'gpt/block_9' matches no forward op")


def test_none_changes_nothing():
  graph_def = _graph("gpt_raw")
  mesh = make_mesh("dp=2")
  plain = split_graph(graph_def, mesh)
  for value in (None, "none", ""):
    assert split_graph(graph_def, mesh, recompute=value).graph_def == plain.graph_def


def _cli(tmp_path, capsys, *args):
  code = run(["tfsplit", "rewrite"] + [str(a) for a in args])
  out = capsys.readouterr()
  return code, out.out, out.err


def test_cli_flag_and_errors(tmp_path, capsys):
  source = tmp_path / "plain.pb"
  save_graph(_no_blocks_graph(), str(source))
  for value, needle in [("blocks", "needs the model's repeated blocks"),
                        ("blokcs", "unknown recompute mode 'blokcs'"),
                        ("net/nothing", "recompute scope 'net/nothing' matches no forward op")]:
    code, out, err = _cli(tmp_path, capsys, source, "-o", tmp_path / "out.pb", "--mesh",
                          "dp=1", "--recompute", value)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("tfsplit rewrite: error: ") and needle in lines[0], lines[0]
    assert not os.path.exists(tmp_path / "out.pb")
  gpt = tmp_path / "gpt.pb"
  save_graph(_graph("gpt_raw"), str(gpt))
  code, out, err = _cli(tmp_path, capsys, gpt, "-o", tmp_path / "out.pb", "--mesh", "dp=2",
                        "--recompute", "blocks")
  assert code == 0, err
  assert "recompute (blocks): 94 forward ops recomputed in the backward pass (188 copies " \
      "over the devices)" in out
  assert recompute_lib.copies_of(load_graph(str(tmp_path / "out.pb")))
