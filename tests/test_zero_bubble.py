"""Zero-bubble schedules (Qi et al., ICLR 2024): each backward block split
into input gradients (B) and weight gradients (W). The orders, the
simulated bubble and memory against 1f1b, exact training of corpus models,
a real step's trace against the order, the planner's choice, and the
errors."""
import json
import os

import pytest

from tfsplit.cli import run
from tfsplit.cost import pipeline_sim
from tfsplit.errors import PlanError
from tfsplit.graph import load_graph
from tfsplit.passes import split_graph
from tfsplit.pipeline import schedules
from tfsplit.plan import profile as profile_lib
from tfsplit.plan import report as plan_report
from tfsplit.plan.search import Planner
from tfsplit.cost import cluster as cluster_lib
from tfsplit.runtime import trace as trace_lib
from tfsplit.runtime.split_function import make_mesh
from tfsplit.sharding.builder import read_records

from _util import check_training, example, names
from test_schedule_trace import _block_orders, _split

BATCH = 16
ZB = ("zb-h1", "zb-h2")


def _runs(orders, stages):
  """Whether every stage can run its order, each block once its inputs
  exist: F(s, j) after F(s-1, j); B(s, j) after F(s, j) and B(s+1, j);
  W(s, j) after B(s, j)."""
  done, pos = set(), [0] * stages
  while any(p < len(o) for p, o in zip(pos, orders)):
    progressed = False
    for s in range(stages):
      if pos[s] == len(orders[s]):
        continue
      kind, j = orders[s][pos[s]]
      need = {"F": [("F", s - 1, j)] if s else [],
              "B": [("F", s, j)] + ([("B", s + 1, j)] if s < stages - 1 else []),
              "W": [("B", s, j)]}[kind]
      if all(n in done for n in need):
        done.add((kind, s, j))
        pos[s] += 1
        progressed = True
    if not progressed:
      return False
  return True


@pytest.mark.parametrize("name", ZB)
@pytest.mark.parametrize("stages,m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 3), (8, 16)])
def test_orders_run_every_block_once(name, stages, m):
  sched = schedules.get_schedule(name)
  assert sched.splits_backward
  orders = [sched.order(s, stages, m) for s in range(stages)]
  for s, seq in enumerate(orders):
    assert sorted(seq) == sorted((k, j) for k in "BFW" for j in range(m))
    for j in range(m):  # W after its own B
      assert seq.index(("W", j)) > seq.index(("B", j))
    if name == "zb-h1":  # 1f1b's warm-up
      k = schedules.OneFOneB.warmup(s, stages, m)
      assert [b[0] for b in seq[:k + 1]] == ["F"] * k + ["B"]
  assert _runs(orders, stages)
  assert not _runs([list(reversed(o)) for o in orders], stages)  # the check bites
  peaks = pipeline_sim.theoretical_peak_activations(name, stages, m)
  assert peaks == [min(stages, m) if name == "zb-h1" else min(2 * stages - 1, m)] * stages
  for seq, peak in zip(orders, peaks):  # micro-batches between an F and its W
    live = most = 0
    for kind, _ in seq:
      live += {"F": 1, "W": -1}.get(kind, 0)
      most = max(most, live)
    assert most == peak


# The ZB-H1 order of the paper's Figure 3 for p = 4 (0-based micro-batches):
# stage s defers its W blocks by s.
ZB_H1_ORDER = {
    0: "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7",
    3: "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7",
}


def test_zb_h1_order():
  for stage, text in ZB_H1_ORDER.items():
    want = [(b[0], int(b[1:])) for b in text.split()]
    assert schedules.get_schedule("zb-h1").order(stage, 4, 8) == want


@pytest.mark.parametrize("stages,m", [(2, 8), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_simulated_bubble_against_1f1b(stages, m):
  """Equal F, B and W (backward = 2 F, half of it weight gradients): zb-h1's
  bubble is (S - 1)(F + B - W), a third of 1f1b's, at 1f1b's peak memory;
  zb-h2 leaves no stage idle between its first and last block."""
  act = 1000
  one = pipeline_sim.simulate_pipeline(stages, m, "1f1b", 1.0, 2.0, activation_bytes=act)
  h1 = pipeline_sim.simulate_pipeline(stages, m, "zb-h1", 1.0, 2.0, activation_bytes=act)
  h2 = pipeline_sim.simulate_pipeline(stages, m, "zb-h2", 1.0, 2.0, activation_bytes=act)
  assert one.bubble_time == pytest.approx(3 * (stages - 1))
  assert h1.bubble_time == pytest.approx(stages - 1)
  assert h1.bubble_time <= 0.4 * one.bubble_time
  assert max(h1.peak_memory) == pytest.approx(max(one.peak_memory), rel=0.05)
  assert h2.steady_bubble_time <= 0.1 * one.bubble_time
  assert max(h2.peak_activations) == 2 * stages - 1
  # One synchronous step: the last stage waits (S - 1) F for its first
  # forward under every schedule, so zb-h2's step is zb-h1's here ...
  assert h2.sim.step_time == pytest.approx(h1.sim.step_time)
  assert h1.sim.step_time == pytest.approx(3 * m + stages - 1)
  # ... and shorter where B outweighs W (attention's input gradients).
  h1b = pipeline_sim.simulate_pipeline(stages, m, "zb-h1", 1.0, 2.0, weight_fraction=0.4)
  h2b = pipeline_sim.simulate_pipeline(stages, m, "zb-h2", 1.0, 2.0, weight_fraction=0.4)
  if m >= 2 * stages - 1:
    assert h2b.sim.step_time < h1b.sim.step_time
  summary = h1.summary()
  assert summary["bubble_time"] == pytest.approx(h1.bubble_time)
  assert summary["theoretical_peak_activations"] == h1.peak_activations


def test_simulator_runs_w_tasks_and_checks_the_share():
  res = pipeline_sim.simulate_pipeline(2, 4, "zb-h1", 1.0, 2.0, p2p_time=0.1)
  kinds = [k for k, r in zip(res.sim.graph.kinds, res.sim.graph.resources) if r >= 0]
  assert kinds.count("weight") == 8 and kinds.count("backward") == 8
  assert res.sim.comm_time == pytest.approx(2 * 4 * 0.1)
  with pytest.raises(PlanError, match="weight-gradient share"):
    pipeline_sim.simulate_pipeline(2, 4, "zb-h1", weight_fraction=1.0)


def _cases():
  out = []
  for name in ("causallm_keras3", "llama_keras3"):
    for sched in ZB:
      for mesh, size in (("pp=2", "tiny"), ("pp=4", "small")):
        ci = mesh == "pp=2" and (name, sched) in (("causallm_keras3", "zb-h1"),
                                                  ("llama_keras3", "zb-h2"))
        out.append(pytest.param(name, sched, mesh, size, id=f"{name}-{sched}-{mesh}",
                                marks=() if ci else pytest.mark.slow))
  return out


@pytest.mark.parametrize("name,schedule,mesh,size", _cases())
def test_corpus_model_trains_exactly(name, schedule, mesh, size):
  """Loss, every parameter and every update of 3 steps at m = 8."""
  step = check_training(example(name, size, batch_size=BATCH), seed=5, mesh=mesh,
                        microbatches=8, schedule=schedule)
  result = step.result
  assert result.manifest_dict()["schedule"] == schedule
  kinds = trace_lib.scheduled_kinds(result.graph_def)
  assert "W" in kinds.values() and "B" in kinds.values()


@pytest.mark.parametrize("schedule", ZB)
def test_split_step_trace_follows_the_schedule(schedule):
  """A real step's W ops run as their own blocks, where the order puts
  them: after later micro-batches' B blocks (what 1f1b leaves idle)."""
  ex, step = _split(schedule, 2, 4)
  orders = _block_orders(ex, step, 4)
  assert sorted(orders) == [0, 1]
  for stage, seq in orders.items():
    assert seq == schedules.get_schedule(schedule).order(stage, 2, 4), (
        f"stage {stage} ran {seq}")
  # Stage 1 runs W0 after B1: its first W waits for a later backward.
  assert orders[1].index(("W", 0)) > orders[1].index(("B", 1))


def test_weight_gradients_are_weight_matmuls_and_a_wrong_split_is_refused(monkeypatch):
  ex = example("gpt_raw", batch_size=BATCH)
  graph_def = load_graph(ex.concrete("train"), variable_names=names(ex))
  result = split_graph(graph_def, make_mesh("pp=2"), microbatches=2, schedule="zb-h1")
  kinds = trace_lib.scheduled_kinds(result.graph_def)
  nodes = {n.name: n for n in result.graph_def.node}
  records = read_records(result.graph_def)
  last = {n for n, r in records.items() if result.mesh.coord(r.device_id, "pp") == 1}
  matmuls = {k: {n for n, kind in kinds.items()
                 if kind == k and nodes[n].op == "MatMul" and n in last} for k in "BW"}
  # TF's MatMul gradient: MatMul for the input, MatMul_1 for the weight; on
  # the last stage the input gradients go on to stage 0. (On the first
  # stage every gradient ends in a weight's, the embedding's at the end.)
  assert matmuls["W"] and all("/MatMul/MatMul_1/" in n for n in matmuls["W"]), matmuls
  assert matmuls["B"] and not any("/MatMul/MatMul_1/" in n for n in matmuls["B"])
  # An order that runs a W block before its own B (which it reads) closes a
  # cycle: one line, no graph.
  good = schedules.ZeroBubbleH1.order

  def w_first(self, stage, stages, microbatches):
    seq = good(self, stage, stages, microbatches)
    b, w = seq.index(("B", 0)), seq.index(("W", 0))
    seq[b], seq[w] = seq[w], seq[b]
    return seq

  monkeypatch.setattr(schedules.ZeroBubbleH1, "order", w_first)
  with pytest.raises(PlanError, match="zb-h1 schedule would make a cycle") as e:
    split_graph(graph_def, make_mesh("pp=2"), microbatches=2, schedule="zb-h1")
  assert "\n" not in str(e.value)


def test_cli_rewrite_and_estimate(tmp_path, capsys):
  train = os.path.join(os.path.dirname(__file__), "..", "examples", "gpt_raw_train_tiny.pb")
  out = tmp_path / "gpt_zb.pb"
  code = run(["tfsplit", "rewrite", train, "-o", str(out), "--stages", "2", "--mesh",
              "dp=1", "--microbatches", "4", "--schedule", "zb-h2",
              "--collective-timeout", "60"])
  stdout = capsys.readouterr().out
  assert code == 0, stdout
  manifest = json.loads((tmp_path / "gpt_zb.manifest.json").read_text())
  assert manifest["schedule"] == "zb-h2"
  code = run(["tfsplit", "estimate", "--simulate-pipeline", "--stages", "4",
              "--microbatches", "8", "--schedule", "zb-h1", "--format", "json"])
  pipe = json.loads(capsys.readouterr().out)["pipeline"]
  assert code == 0 and pipe["bubble_time"] == pytest.approx(3e-3)
  assert pipe["peak_activations"] == [4, 4, 4, 4]
  code = run(["tfsplit", "estimate", "--simulate-pipeline", "--stages", "4",
              "--microbatches", "8", "--schedule", "zb-h2"])
  text = capsys.readouterr().out
  assert code == 0 and "steady bubble" in text and "0 ms between its first and last" in text


def _planner(devices, memory):
  prof = profile_lib.synthetic_gpt(blocks=8, hidden=2048, seq_len=2048, batch=64, heads=16)
  cluster = cluster_lib.from_preset("h100-80gb", devices)
  return Planner(prof, cluster, devices, memory)


def test_planner_prices_and_explains_zero_bubble():
  planner = _planner(8, 10 * 2**30)
  result = planner.search()
  best = result.best
  assert set(result.best_by_schedule) >= {"1f1b", "zb-h1", "zb-h2"}
  # At the same cut and memory, zb-h1's step is never slower than 1f1b's.
  h1, one = result.best_by_schedule["zb-h1"], result.best_by_schedule["1f1b"]
  assert h1.step_time <= one.step_time
  lines = plan_report.reasons(result, planner.costing)
  if best.candidate.pp > 1:
    why = [l for l in lines if l.startswith(f"runs {best.candidate.schedule}")]
    assert why and "the fastest 1f1b plan" in why[0] or best.candidate.schedule == "1f1b"


def test_planner_zero_bubble_matches_the_simulator_on_equal_stages():
  """Costing's zb formula against the event simulator: 4 equal blocks cut
  into 4 stages, m = 8, W half of each backward."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from tfsplit.plan import costing as costing_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.plan import space  # pylint: disable=import-outside-toplevel
  rows = [profile_lib.LayerRow(name=f"block_{i}", forward=8.0, backward=16.0, update=0.0,
                               params=4, slots=4, activations=8, input_bytes=0,
                               splittable=False, weight_share=0.5) for i in range(4)]
  prof = profile_lib.ModelProfile(rows, [0] * 3, 8)
  costing = costing_lib.Costing(prof, cluster_lib.from_preset("h100-80gb", 4))
  for sched in ("1f1b", "zb-h1", "zb-h2"):
    c = space.Candidate(1, 1, 4, 8, sched)
    est = costing.evaluate(c, [(i, i + 1) for i in range(4)])
    sim = pipeline_sim.simulate_pipeline(4, 8, sched, 1.0, 2.0)
    assert est.pipeline_time == pytest.approx(sim.sim.step_time, rel=1e-6), sched
  assert dataclasses.fields(space.Candidate)
