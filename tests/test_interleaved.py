"""Interleaved 1F1B (Megatron-LM's virtual pipeline stages): the layers cut
into S * v model chunks, chunk c on stage c % S. Exact training against the
unsplit step, the schedule's order against Megatron's, a real step's trace
against that order, and the simulated bubble against (S - 1) / (v m + S - 1)."""
import itertools
import json
import os

import pytest
import tensorflow as tf

import tfsplit
from tfsplit.cost import pipeline_sim
from tfsplit.cli import run
from tfsplit.errors import PlanError
from tfsplit.graph import Graph, load_graph
from tfsplit.graph.layers import detect_layers
from tfsplit.passes import split_graph
from tfsplit.pipeline import schedules
from tfsplit.pipeline.schedules import Interleaved
from tfsplit.runtime import trace as trace_lib
from tfsplit.runtime.split_function import make_mesh

from _util import TIMEOUT, check_training, example, names

BATCH = 16


def _blocks(text):
  """'F0.0 B1.1' -> [('F', 0, 0), ('B', 1, 1)] (kind, micro-batch, chunk)."""
  return [(b[0], int(b[1:].split(".")[0]), int(b.split(".")[1])) for b in text.split()]


# Written out from Megatron-LM's forward_backward_pipelining_with_interleaving:
# forwards in groups of S micro-batches per chunk, warm-up
# 2 (S - s - 1) + (v - 1) S, then one forward and one backward (chunks reversed).
MEGATRON_ORDERS = {
    (2, 4, 2): {
        0: "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 "
           "B2.1 B3.1 B2.0 B3.0",
        1: "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 "
           "B2.0 B3.0",
    },
    (2, 2, 3): {  # m = S: stage 0's warm-up is every forward
        0: "F0.0 F1.0 F0.1 F1.1 F0.2 F1.2 B0.2 B1.2 B0.1 B1.1 B0.0 B1.0",
        1: "F0.0 F1.0 F0.1 F1.1 F0.2 B0.2 F1.2 B1.2 B0.1 B1.1 B0.0 B1.0",
    },
    (4, 8, 2): {
        0: "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 F4.0 F5.0 "
           "F6.0 B0.1 F7.0 B1.1 F4.1 B2.1 F5.1 B3.1 F6.1 B0.0 F7.1 B1.0 "
           "B2.0 B3.0 B4.1 B5.1 B6.1 B7.1 B4.0 B5.0 B6.0 B7.0",
        3: "F0.0 F1.0 F2.0 F3.0 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 F4.0 B0.0 "
           "F5.0 B1.0 F6.0 B2.0 F7.0 B3.0 F4.1 B4.1 F5.1 B5.1 F6.1 B6.1 F7.1 B7.1 "
           "B4.0 B5.0 B6.0 B7.0",
    },
}


@pytest.mark.parametrize("stages,m,v", sorted(MEGATRON_ORDERS))
def test_order_is_megatrons(stages, m, v):
  for stage, text in MEGATRON_ORDERS[(stages, m, v)].items():
    assert Interleaved(v).order(stage, stages, m) == _blocks(text), stage


def _runs(orders, stages, v):
  """Whether every stage can run its order: a step of the whole pipeline
  with each stage doing its next block once its inputs exist."""
  done, pos = set(), [0] * stages
  while any(p < len(o) for p, o in zip(pos, orders)):
    progressed = False
    for s in range(stages):
      if pos[s] == len(orders[s]):
        continue
      kind, j, k = orders[s][pos[s]]
      c = k * stages + s
      need = [("F", j, c - 1)] if kind == "F" and c else []
      if kind == "B":
        need = [("F", j, c)] + ([("B", j, c + 1)] if c < stages * v - 1 else [])
      if all(n in done for n in need):
        done.add((kind, j, c))
        pos[s] += 1
        progressed = True
    if not progressed:
      return False
  return True


@pytest.mark.parametrize("stages,v", [(2, 2), (2, 3), (3, 2), (4, 2), (4, 4)])
def test_order_runs_every_block_once_and_never_deadlocks(stages, v):
  for m in (stages, 2 * stages, 3 * stages):
    sched = Interleaved(v)
    orders = [sched.order(s, stages, m) for s in range(stages)]
    for s, seq in enumerate(orders):
      assert sorted(seq) == sorted(itertools.product("BF", range(m), range(v)))
      warmup = sched.warmup(s, stages, m)
      assert [b[0] for b in seq[:warmup]] == ["F"] * warmup
      # Chunk activations alive at most: the warm-up's plus one.
      live = peak = 0
      for kind, _, _ in seq:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
      assert peak == pipeline_sim.theoretical_peak_activations(
          "interleaved", stages, m, v)[s]
    assert _runs(orders, stages, v)
    assert not _runs([list(reversed(o)) for o in orders], stages, v)  # the check bites


def test_schedule_and_option_errors():
  with pytest.raises(PlanError, match="multiple of the 2 pipeline stages, got 3; use "
                     "microbatches=2 or 4"):
    Interleaved(2).order(0, 2, 3)
  with pytest.raises(PlanError, match="virtual_stages >= 2"):
    schedules.get_schedule("interleaved", 1)
  with pytest.raises(PlanError, match="use schedule='interleaved' or virtual_stages=1"):
    schedules.get_schedule("1f1b", 2)
  ex = example("gpt_raw", batch_size=BATCH)
  graph_def = load_graph(ex.concrete("train"), variable_names=names(ex))
  mesh = make_mesh("pp=2")
  cases = [
      (dict(schedule="interleaved"), "pass virtual_stages=2"),
      (dict(virtual_stages=2), "needs the interleaved schedule, not '1f1b'"),
      (dict(schedule="interleaved", virtual_stages=2, microbatches=3),
       "use microbatches=2 or 4"),
      # gpt_raw has 5 layers: 2 x 3 chunks is too many.
      (dict(schedule="interleaved", virtual_stages=3),
       "need 6 model chunks but the graph has only 5 layers .*use at most 2 virtual"),
      (dict(schedule="interleaved", virtual_stages=2, layer_ranges=[(0, 2), (2, 5)]),
       "2 layer ranges given for 4 model chunks"),
  ]
  for kwargs, message in cases:
    kwargs.setdefault("microbatches", 4)
    with pytest.raises(PlanError, match=message) as e:
      split_graph(graph_def, mesh, **kwargs)
    assert "\n" not in str(e.value)
  with pytest.raises(PlanError, match="no 'pp' axis"):
    split_graph(graph_def, make_mesh("dp=2"), microbatches=4, schedule="interleaved",
                virtual_stages=2)


def _chunk_devices(result, stages):
  """{model chunk: pp coordinates of the devices its nodes run on}."""
  from tfsplit.sharding.builder import read_records  # pylint: disable=import-outside-toplevel
  seen = {}
  for record in read_records(result.graph_def).values():
    chunk = result.stage_of[record.source]
    seen.setdefault(chunk, set()).add(result.mesh.coord(record.device_id, "pp"))
  return seen


def test_gpt_raw_trains_exactly():
  step = check_training(example("gpt_raw", batch_size=BATCH), seed=13, mesh="pp=2",
                        microbatches=4, schedule="interleaved", virtual_stages=2)
  result = step.result
  assert len(result.partition) == 4  # S x v chunks, in layer order
  assert [l for chunk in result.partition for l in chunk] == [
      l.name for l in detect_layers(Graph(step.original_graph_def)).model_layers]
  assert _chunk_devices(result, 2) == {0: {0}, 1: {1}, 2: {0}, 3: {1}}
  assert result.manifest_dict()["virtual_stages"] == 2
  assert result.manifest_dict()["schedule"] == "interleaved"


@pytest.mark.parametrize("name,mesh,m,size", [
    ("causallm_keras3", "pp=2", 4, "tiny"),
    pytest.param("llama_keras3", "pp=2", 4, "tiny", marks=pytest.mark.slow),
    pytest.param("llama_keras3", "pp=4", 8, "small", marks=pytest.mark.slow),
    pytest.param("causallm_keras3", "pp=4", 8, "small", marks=pytest.mark.slow),
])
def test_corpus_model_trains_exactly(name, mesh, m, size):
  stages = int(mesh.split("=")[1])
  step = check_training(example(name, size, batch_size=BATCH), seed=5, mesh=mesh,
                        microbatches=m, schedule="interleaved", virtual_stages=2)
  assert len(step.result.partition) == 2 * stages


def test_cli_rewrite_and_estimate(tmp_path, capsys):
  train = os.path.join(os.path.dirname(__file__), "..", "examples", "gpt_raw_train_tiny.pb")
  out = tmp_path / "gpt_pp2v2.pb"
  code = run(["tfsplit", "rewrite", train, "-o", str(out), "--stages", "2", "--mesh",
              "dp=1", "--microbatches", "4", "--schedule", "interleaved",
              "--virtual-stages", "2", "--collective-timeout", "60"])
  stdout = capsys.readouterr().out
  assert code == 0, stdout
  assert "pipeline: 2 stages x 2 virtual stages" in stdout
  manifest = json.loads((tmp_path / "gpt_pp2v2.manifest.json").read_text())
  assert manifest["virtual_stages"] == 2 and len(manifest["stages"]) == 4
  assert manifest["schedule"] == "interleaved"
  code = run(["tfsplit", "rewrite", train, "-o", str(tmp_path / "x.pb"), "--stages", "2",
              "--mesh", "dp=1", "--microbatches", "4", "--virtual-stages", "2"])
  err = capsys.readouterr().err
  assert code != 0 and "--schedule interleaved" in err and len(err.splitlines()) == 1, err
  assert not (tmp_path / "x.pb").exists()
  code = run(["tfsplit", "estimate", "--simulate-pipeline", "--stages", "4",
              "--microbatches", "8", "--schedule", "interleaved", "--virtual-stages", "2",
              "--format", "json"])
  pipe = json.loads(capsys.readouterr().out)["pipeline"]
  assert code == 0 and pipe["virtual_stages"] == 2
  assert pipe["bubble_fraction"] == pytest.approx(3 / 19)
  assert pipe["peak_activations"] == [11, 9, 7, 5]


def _split(stages=2, m=4, v=2):
  ex = example("gpt_raw", batch_size=BATCH)
  return ex, tfsplit.split(ex.train_step, mesh=f"pp={stages}", microbatches=m,
                           schedule="interleaved", virtual_stages=v,
                           input_signature=ex.train_signature, variable_names=names(ex),
                           timeout_seconds=TIMEOUT)


def _block_orders(ex, step, m):
  """{stage: [('F'|'B', j, chunk)]} of one traced step, after a warm-up step."""
  inputs = [tf.constant(x) for x in ex.make_inputs("train", seed=1)]
  step(*inputs)  # instantiation and Grappler stay out of the trace
  _, events = step.trace(*inputs)
  roles = detect_layers(Graph(step.original_graph_def)).block_roles()
  blocks = trace_lib.microbatch_blocks(events, roles, step.mesh.with_microbatches(m),
                                         step.graph_def, chunk_of=step.result.stage_of)
  return {stage: [b[0] for b in seq] for stage, seq in blocks.items()}


def test_split_step_trace_follows_the_schedule():
  ex, step = _split()
  orders = _block_orders(ex, step, 4)
  assert sorted(orders) == [0, 1]
  for stage, seq in orders.items():
    assert seq == Interleaved(2).order(stage, 2, 4), f"stage {stage} ran {seq}"


@pytest.mark.slow
def test_trace_tells_a_step_without_schedule_edges(monkeypatch):
  """The order check is not vacuous: without the schedule's edges a stage
  runs its blocks out of the interleaved order."""
  monkeypatch.setattr(schedules, "apply_schedule", lambda *args: 0)
  ex, step = _split()
  assert not any(schedules.SCHEDULE_BARRIER_ATTR in n.attr for n in step.graph_def.node)
  orders = _block_orders(ex, step, 4)
  assert any(seq != Interleaved(2).order(stage, 2, 4) for stage, seq in orders.items()), \
      orders


@pytest.mark.parametrize("stages,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 4, 2),
                                        (2, 2, 3), (8, 16, 2), (4, 16, 3)])
@pytest.mark.parametrize("fwd,bwd", [(1.0, 2.0), (1.0, 1.0), (3.0, 1.0)])
def test_simulated_bubble_and_peak_match_theory(stages, m, v, fwd, bwd):
  res = pipeline_sim.simulate_pipeline(stages, m, "interleaved", fwd, bwd,
                                       activation_bytes=1200, chunks=v)
  one = pipeline_sim.simulate_pipeline(stages, m, "1f1b", fwd, bwd, activation_bytes=1200)
  theory = (stages - 1) / (v * m + stages - 1)
  assert res.bubble_fraction == pytest.approx(theory, abs=1e-6)
  assert max(res.stage_bubble) == pytest.approx(theory, abs=1e-6)
  # Relative to the ideal step (no bubble): (S - 1) / (v m) against (S - 1) / m.
  ideal = m * (fwd + bwd)
  assert res.sim.step_time / ideal - 1 == pytest.approx((stages - 1) / (v * m))
  assert one.sim.step_time / ideal - 1 == pytest.approx((stages - 1) / m)
  assert res.peak_activations == pipeline_sim.theoretical_peak_activations(
      "interleaved", stages, m, v)
  assert res.peak_memory == [p * 1200 // v for p in res.peak_activations]
  assert res.summary()["theoretical_bubble_fraction"] == pytest.approx(theory)


def test_simulated_pipeline_with_links():
  base = pipeline_sim.simulate_pipeline(4, 8, "interleaved", 1.0, 2.0, chunks=2)
  res = pipeline_sim.simulate_pipeline(4, 8, "interleaved", 1.0, 2.0, p2p_time=0.1,
                                       chunks=2)
  # Every chunk boundary (S v - 1 of them) sends each micro-batch both ways.
  assert res.sim.comm_time == pytest.approx(2 * 7 * 8 * 0.1)
  assert res.sim.step_time > base.sim.step_time
  with pytest.raises(PlanError, match="multiple of the 4 pipeline stages"):
    pipeline_sim.simulate_pipeline(4, 6, "interleaved", chunks=2)
  with pytest.raises(PlanError, match="one model chunk per stage"):
    pipeline_sim.simulate_pipeline(4, 8, "1f1b", chunks=2)


def test_measured_bubble_counts_waits_not_per_op_gaps():
  """The measured bubble (bench_pipeline_memory): a stage waits when none of its ops runs
  for at least min_gap_us (leading and trailing waits included); the short
  gaps between its ops (executor overhead) count only as idle."""
  from tfsplit.runtime import trace as trace_lib  # pylint: disable=import-outside-toplevel
  a, b = "/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0"
  events = [(a, "x", 0, 1000), (a, "y", 1030, 2000), (a, "z", 3000, 4000),
            (b, "u", 0, 500), (b, "v", 3500, 5000)]
  bubble = trace_lib.stage_waits(events, [a, b], min_gap_us=500)
  idle = trace_lib.stage_waits(events, [a, b])
  assert bubble == pytest.approx([2000 / 5000, 3000 / 5000])
  assert idle == pytest.approx([2030 / 5000, 3000 / 5000])
