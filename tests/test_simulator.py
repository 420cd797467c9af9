"""The event simulator, pipeline schedules against theory, trace output, speed."""
import json
import struct
import time

import numpy as np
import pytest

from tfsplit.cost import output
from tfsplit.cost import pipeline_sim
from tfsplit.cost.simulator import TaskGraph
from tfsplit.errors import PlanError

from synthetic import transformer_step  # tools/ (see conftest.py)


def test_chain_and_parallel_devices():
  g = TaskGraph()
  d0, d1 = g.add_device("d0"), g.add_device("d1")
  a = g.add_task("a", d0, 1.0)
  b = g.add_task("b", d0, 2.0, deps=[a])
  c = g.add_task("c", d1, 4.0)               # runs alongside a and b
  d = g.add_task("d", d1, 1.0, deps=[b, c])
  r = g.simulate()
  assert (r.start[b], r.end[b]) == (1.0, 3.0)
  assert (r.start[d], r.end[d]) == (4.0, 5.0)
  assert r.step_time == 5.0
  assert r.busy[d0] == 3.0 and r.idle_fraction(d0) == pytest.approx(0.4)
  assert r.events()[0] == ("d0", "a", "compute", 0.0, 1.0)


def test_one_task_at_a_time_lowest_priority_first():
  g = TaskGraph()
  d = g.add_device("d")
  late = g.add_task("late", d, 1.0, priority=5)
  early = g.add_task("early", d, 1.0, priority=1)
  default = g.add_task("default", d, 1.0, priority=3)
  r = g.simulate()
  assert [r.start[t] for t in (early, default, late)] == [0.0, 1.0, 2.0]


def test_set_priority_reorders_a_built_graph():
  g = TaskGraph()
  d = g.add_device("d")
  a = g.add_task("a", d, 1.0)
  b = g.add_task("b", d, 1.0)
  assert g.simulate().start[b] == 1.0
  g.set_priority(b, -1)  # the same graph, simulated in another order
  r = g.simulate()
  assert (r.start[b], r.start[a]) == (0.0, 1.0)
  with pytest.raises(PlanError, match="unknown task"):
    g.set_priority(7, 0)


def test_priority_decides_between_tasks_ready_at_the_same_instant():
  g = TaskGraph()
  d0, d1 = g.add_device("d0"), g.add_device("d1")
  x = g.add_task("x", d0, 1.0)
  y = g.add_task("y", d1, 1.0)
  lo = g.add_task("lo", d0, 1.0, deps=[y], priority=0)   # ready via d1
  hi = g.add_task("hi", d0, 1.0, deps=[x], priority=9)   # ready via d0
  r = g.simulate()
  assert r.start[lo] == 1.0 and r.start[hi] == 2.0


def test_control_deps_order_without_holding_memory():
  g = TaskGraph()
  d = g.add_device("d")
  p = g.add_task("p", d, 1.0, alloc=100)
  data = g.add_task("data", d, 1.0, deps=[p])
  ctrl = g.add_task("ctrl", d, 5.0, control_deps=[data])
  r = g.simulate()
  assert r.start[ctrl] == 2.0
  # p is freed when its only data consumer ends (t=2), not after ctrl.
  assert r.memory_timeline(d) == [(0.0, 100), (2.0, 0)]
  assert r.peak_memory[d] == 100


def test_memory_freed_by_last_consumer_static_and_persistent():
  g = TaskGraph()
  d = g.add_device("d", static_bytes=1000)
  other = g.add_device("other")
  a = g.add_task("a", d, 1.0, alloc=10)
  g.add_task("use1", d, 1.0, deps=[a])
  g.add_task("use2", other, 3.0, deps=[a])            # a lives until t=4
  g.add_task("w", d, 1.0, alloc=5, persistent=True)
  g.add_task("tmp", d, 1.0, alloc=7)                   # no consumer: own end
  r = g.simulate()
  tl = dict(r.memory_timeline(d))
  assert tl[0.0] == 1010
  assert r.peak_memory[d] == 1000 + 10 + 5 + 7
  assert r.memory_timeline(d)[-1] == (4.0, 1005)
  assert r.peak_memory[other] == 0


def test_links_comm_time_and_exposed_comm():
  g = TaskGraph()
  d0, d1 = g.add_device("d0"), g.add_device("d1")
  link = g.add_link("d0->d1", (d0, d1))
  f = g.add_task("f", d0, 1.0, alloc=8)
  send = g.add_task("send", link, 2.0, deps=[f], alloc=8, mem_device=d1)
  g.add_task("overlap", d0, 1.5, deps=[f])        # d0 computes during send
  g.add_task("g", d1, 1.0, deps=[send])
  r = g.simulate()
  assert r.step_time == 4.0
  assert r.comm_time == 2.0
  rows = {row["device"]: row for row in r.device_summary()}
  assert rows["d0"]["comm"] == 2.0
  assert rows["d0"]["exposed_comm"] == pytest.approx(0.5)
  assert rows["d1"]["exposed_comm"] == pytest.approx(2.0)
  assert r.peak_memory[d1] == 8
  assert r.summary()["devices"][1]["busy"] == 1.0


def test_tasks_without_resource_run_in_parallel():
  g = TaskGraph()
  d = g.add_device("d")
  a = g.add_task("a", None, 1.0)
  b = g.add_task("b", None, 1.0)
  c = g.add_task("c", d, 1.0, deps=[a, b])
  r = g.simulate()
  assert r.start[c] == 1.0 and r.step_time == 2.0
  assert r.events() == [("d", "c", "compute", 1.0, 2.0)]


def test_bad_graphs_raise_plan_errors():
  g = TaskGraph()
  d = g.add_device("d")
  link = g.add_link("l", (d,))
  with pytest.raises(PlanError, match="does not exist yet"):
    g.add_task("x", d, 1.0, deps=[3])
  with pytest.raises(PlanError, match="unknown resource"):
    g.add_task("x", 7, 1.0)
  with pytest.raises(PlanError, match="duration"):
    g.add_task("x", d, -1.0)
  with pytest.raises(PlanError, match="mem_device"):
    g.add_task("x", link, 1.0, alloc=4)
  with pytest.raises(PlanError, match="not a device"):
    g.add_link("l2", (link,))
  a = g.add_task("a", d, 1.0)
  b = g.add_task("b", d, 1.0, deps=[a])
  g.add_control_dep(a, b)
  with pytest.raises(PlanError, match="cycle"):
    g.simulate()


# --- pipeline schedules against theory ---------------------------------------
CASES = [(2, 1), (2, 4), (4, 2), (4, 4), (4, 8), (4, 16), (8, 3), (8, 8),
         (8, 32), (5, 7), (1, 4)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", CASES)
@pytest.mark.parametrize("fwd,bwd", [(1.0, 2.0), (1.0, 1.0), (3.0, 1.0)])
def test_bubble_and_peak_activations_match_theory(schedule, stages,
                                                  microbatches, fwd, bwd):
  res = pipeline_sim.simulate_pipeline(stages, microbatches, schedule, fwd, bwd,
                                       activation_bytes=1000)
  theory = (stages - 1) / (microbatches + stages - 1)
  assert abs(res.bubble_fraction - theory) <= 0.01
  for s in range(stages):
    assert abs(res.stage_bubble[s] - theory) <= 0.01
  if schedule == "1f1b":
    expected = [min(stages - i, microbatches) for i in range(stages)]
  else:
    expected = [microbatches] * stages
  assert res.peak_activations == expected
  assert res.peak_memory == [1000 * e for e in expected]
  assert res.sim.step_time == pytest.approx(
      (microbatches + stages - 1) * (fwd + bwd))


def test_1f1b_stage_order_is_warmup_then_alternate():
  order = pipeline_sim.stage_order("1f1b", 4, 6, 1)
  assert order == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1),
                   ("F", 4), ("B", 2), ("F", 5), ("B", 3), ("B", 4), ("B", 5)]
  assert pipeline_sim.stage_order("gpipe", 2, 2, 0) == [
      ("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def test_p2p_links_add_communication():
  base = pipeline_sim.simulate_pipeline(4, 8, "1f1b", 1.0, 2.0)
  res = pipeline_sim.simulate_pipeline(4, 8, "1f1b", 1.0, 2.0, p2p_time=0.25)
  assert res.sim.comm_time == pytest.approx(2 * 3 * 8 * 0.25)
  assert res.sim.step_time > base.sim.step_time
  assert res.peak_activations == [4, 3, 2, 1]


def test_pipeline_rejects_bad_requests():
  with pytest.raises(PlanError, match="schedule"):
    pipeline_sim.simulate_pipeline(4, 8, "zigzag")
  with pytest.raises(PlanError, match="stages"):
    pipeline_sim.simulate_pipeline(0, 8)


def test_chrome_trace(tmp_path):
  res = pipeline_sim.simulate_pipeline(3, 4, "1f1b", 1e-3, 2e-3, p2p_time=1e-4)
  path = tmp_path / "trace.json"
  output.write_chrome_trace(res.sim, str(path))
  trace = json.loads(path.read_text())
  spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
  assert len(spans) == len(res.sim.graph)        # every task is on a stream
  f0 = next(e for e in spans if e["name"] == "F0" and e["tid"] == 0)
  assert (f0["ts"], f0["dur"]) == (0.0, pytest.approx(1000.0))
  assert {e["cat"] for e in spans} == {"forward", "backward", "comm"}
  assert any(e["ph"] == "C" for e in trace["traceEvents"])
  assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]


def test_gantt_png(tmp_path):
  """A real PNG (matplotlib is in the test extra: no skip), one row per device
  and link, bars in each kind's colour, as wide as the tasks take."""
  import matplotlib.image  # pylint: disable=import-outside-toplevel
  heights = {}
  for stages in (3, 6):
    res = pipeline_sim.simulate_pipeline(stages, 4, "1f1b", 1e-3, 2e-3, p2p_time=1e-4)
    path = tmp_path / f"gantt{stages}.png"
    output.write_gantt(res.sim, str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert len(data) > 10_000
    width, height = struct.unpack(">II", data[16:24])
    assert 600 <= width <= 4000 and 200 <= height <= 4000, (width, height)
    image = matplotlib.image.imread(str(path))
    assert image.shape[:2] == (height, width)
    rgb = np.round(image[..., :3] * 255).astype(int).reshape(-1, 3)
    pixels = {}
    for kind in ("forward", "backward", "comm"):
      colour = output._COLORS[kind]  # pylint: disable=protected-access
      want = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
      pixels[kind] = int((np.abs(rgb - want).max(axis=1) <= 2).sum())
    assert all(pixels.values()), pixels
    # A backward takes twice a forward here: its bars cover about twice the area.
    assert 1.5 <= pixels["backward"] / pixels["forward"] <= 2.5, pixels
    heights[stages] = height
  assert heights[6] > heights[3]  # more devices and links, more rows
  assert sorted(p.name for p in tmp_path.iterdir()) == ["gantt3.png", "gantt6.png"]


# --- speed --------------------------------------------------------------------
def test_simulates_150k_tasks_in_under_a_second():
  g = transformer_step(layers=48, devices=64, stages=8, microbatches=45)
  assert len(g) >= 150_000
  best = None
  for _ in range(2):
    t0 = time.perf_counter()
    r = g.simulate()
    dt = time.perf_counter() - t0
    best = dt if best is None else min(best, dt)
  assert best < 1.0, f"{len(g)} tasks took {best:.2f} s"
  # 1f1b on stage 0 keeps K_0 = 8 micro-batches of 6 layers x 4 ops alive.
  assert r.peak_memory[0] == 8 * 6 * 4 * 2048 * 8192 * 2
