"""Per-op cost, graph simulation, calibration and estimates against measurements."""
import collections
import json
import os
import statistics
import time

import numpy as np
import pytest
import tensorflow as tf

from tfsplit.cli import run
from tfsplit.calibration import devices as calibration_devices
from tfsplit.calibration import graphs as calibration_graphs
from tfsplit.calibration import measure
from tfsplit.cost import collectives
from tfsplit.cost import fitting
from tfsplit.cost import graph_sim
from tfsplit.cost import op_cost
from tfsplit.cost.cluster import ClusterSpec, Device, Host, Link
from tfsplit.errors import CostTableError, PlanError
from tfsplit.graph import Graph, find_variables, infer_shapes, load_graph
from tfsplit.graph.endpoints import graph_inputs, graph_outputs
from tfsplit.runtime import timing

import bench_estimate  # tools/, on sys.path (see conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")

FLOPS = 1e9        # per device
LINK = 1e7         # bytes/s between the two devices, no latency
F32 = 100 * 100 * 4
ROUNDED = 40192    # F32 rounded up to the allocator's 256 bytes


def _cluster(n=2):
  host = Host("h", Link(LINK, 0.0), Link(LINK, 0.0))
  devices = [Device(f"d{i}", "h", "test", 10**9, 1e15, {"float32": FLOPS})
             for i in range(n)]
  return ClusterSpec(devices, [host], name="test")


def _two_device_graph():
  """x on d0; a = x@x on d0; b = x@x on d1 after ^a; c = a@b on d1;
  e = x@x on d0 after ^b (a control edge across devices)."""
  g = tf.Graph()
  with g.as_default():
    with g.device("/device:CPU:0"):
      x = tf.compat.v1.placeholder(tf.float32, [100, 100], name="x")
      a = tf.linalg.matmul(x, x, name="a")
    with g.device("/device:CPU:1"):
      with tf.control_dependencies([a]):
        b = tf.linalg.matmul(x, x, name="b")
      tf.linalg.matmul(a, b, name="c")
    with g.device("/device:CPU:0"):
      with tf.control_dependencies([b]):
        tf.linalg.matmul(x, x, name="e")
  return g.as_graph_def()


def test_matmul_cost_is_exact_and_roofline_picks_the_bound():
  graph = Graph(_two_device_graph())
  shapes = infer_shapes(graph, [])
  cost = op_cost.node_cost(graph.node("a"), shapes, graph)
  assert cost.flops == 2 * 100 * 100 * 100
  assert (cost.bytes_read, cost.bytes_written) == (2 * F32, F32)
  model = op_cost.CostModel(_cluster())
  assert model.compute_time(cost) == pytest.approx(2e6 / FLOPS)
  view = op_cost.node_cost(graph.node("x"), shapes, graph)
  assert view.flops == 0 and view.bytes_moved == 0


def test_simulation_honours_control_edges_and_transfers():
  res = graph_sim.simulate_graph(_two_device_graph(), _cluster(),
                                 variables=[])
  sim, t = res.sim, res.task_of
  mm, copy = 2e6 / FLOPS, F32 / LINK            # 2 ms, 4 ms
  assert res.transfers == 2                    # x and a to d1, once each
  assert sim.end[t["a"]] == pytest.approx(mm)
  # b waits for the copy of x (and, by control, for a), then runs.
  assert sim.start[t["b"]] == pytest.approx(copy)
  # a's copy queues behind x's on the one link, then c runs.
  assert sim.start[t["c"]] == pytest.approx(2 * copy)
  assert sim.end[t["c"]] == pytest.approx(2 * copy + mm)
  # e could start at 2 ms on d0, but its control edge waits for b on d1.
  assert sim.start[t["e"]] == pytest.approx(copy + mm)
  assert res.step_time == pytest.approx(2 * copy + mm)
  assert sim.comm_time == pytest.approx(2 * copy)
  # d1 holds x's copy and b while a's copy arrives (4..6 ms), then a's copy,
  # b and c; x itself is an input, static on d0.
  assert res.memory[1].peak == 3 * ROUNDED
  assert res.memory[0].inputs == ROUNDED
  # One allocator serving both devices (logical CPU devices of one process)
  # peaks at the largest sum at any instant, below the sum of the peaks.
  timelines = [sim.memory_timeline(d) for d in range(2)]
  def level(d, when):
    return [b for t_, b in timelines[d] if t_ <= when][-1]
  times = {t_ for tl in timelines for t_, _ in tl}
  assert res.shared_peak == max(level(0, w) + level(1, w) for w in times)
  assert res.shared_peak < res.memory[0].peak + res.memory[1].peak


def _fan_out_graph():
  """a = x^2 read by three expensive ops b1, b2, b3 (in that graph order) and
  by a Reshape r, itself read by e."""
  g = tf.Graph()
  with g.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [64, 64], name="x")
    a = tf.math.square(x, name="a")
    tf.math.negative(a, name="b1")
    tf.math.exp(a, name="b2")
    r = tf.reshape(a, [64 * 64], name="r")
    tf.math.abs(a, name="b3")
    tf.math.sqrt(r, name="e")
  return g.as_graph_def()


def test_executor_order_runs_views_inline_and_queued_ops_last_in_first_out():
  graph = Graph(_fan_out_graph())
  ops = {n.name: n.op for n in graph.nodes}
  order = [n for n in graph_sim.executor_order(graph) if ops[n] != "Const"]
  # a readies b1, b2, r, b3: the Reshape runs inline, and e after it; the
  # expensive ones are queued on the thread's stack, so the first queued
  # (b1) runs last. Graph order would run b1 right after a.
  assert order == ["x", "a", "r", "e", "b3", "b2", "b1"]
  assert graph.topological_order()[:3] == ["x", "a", "b1"]
  # Any order of the out edges gives a topological order of every node.
  for seed in range(3):
    shuffled = graph_sim.executor_order(graph, seed=seed)
    assert sorted(shuffled) == sorted(graph.node_names())
    at = {n: i for i, n in enumerate(shuffled)}
    assert all(at[src] < at[n.name] for n in graph.nodes
               for src, _ in Graph.inputs(n))


def test_executor_schedule_is_the_median_of_its_sampled_orders():
  graph = Graph(_fan_out_graph())
  res = graph_sim.simulate_graph(graph, _cluster(1), variables=[], samples=5)
  assert res.schedule == "executor" and len(res.sampled_peaks) == 5
  assert res.shared_peak == sorted(res.sampled_peaks)[2]
  # In graph order b1, b2 and b3 run before the reshape chain, and a is
  # freed before e allocates: the executor's order never peaks lower.
  plain = graph_sim.simulate_graph(graph, _cluster(1), variables=[],
                                   schedule="graph")
  assert plain.schedule == "graph" and plain.sampled_peaks == [plain.shared_peak]
  assert min(res.sampled_peaks) >= plain.shared_peak
  with pytest.raises(PlanError, match="unknown schedule"):
    graph_sim.simulate_graph(graph, _cluster(1), variables=[], schedule="bfs")


def test_collective_members_wait_for_one_alpha_beta_task():
  g = tf.Graph()
  with g.as_default():
    outs = []
    for d in range(2):
      with g.device(f"/device:CPU:{d}"):
        x = tf.compat.v1.placeholder(tf.float32, [1000], name=f"x{d}")
        outs.append(tf.raw_ops.CollectiveReduceV2(
            input=x, group_size=2, group_key=1, instance_key=7,
            ordering_token=[], merge_op="Add", final_op="Id", name=f"r{d}"))
  graph = Graph(g.as_graph_def())
  shapes = infer_shapes(graph, [])
  cost = op_cost.node_cost(graph.node("r0"), shapes, graph)
  assert (cost.comm, cost.comm_bytes, cost.group_size) == ("all_reduce",
                                                          4000, 2)
  cluster = _cluster()
  res = graph_sim.simulate_graph(graph, cluster, shapes=shapes, variables=[])
  expected = collectives.ring_all_reduce(2, 4000, Link(LINK, 0.0))
  assert res.collectives == 1
  assert res.step_time == pytest.approx(expected)
  assert res.sim.end[res.task_of["r1"]] == pytest.approx(expected)


def test_measured_costs_override_the_roofline(tmp_path):
  graph = Graph(_two_device_graph())
  shapes = infer_shapes(graph, [])
  node = graph.node("a")
  sig = op_cost.signature(node, shapes)
  assert sig.startswith("MatMul|float32|[100,100],[100,100]|[100,100]")
  table = op_cost.CostTable(entries={sig: 0.5}, op_factor={"MatMul": 3.0},
                            time_scale=2.0, op_overhead=0.25)
  path = str(tmp_path / "table.json")
  table.save(path)
  table = op_cost.CostTable.load(path)
  model = op_cost.CostModel(_cluster(), table)
  cost = op_cost.node_cost(node, shapes, graph)
  assert model.compute_time(cost, 0, sig) == pytest.approx(0.5 * 2 + 0.25)
  # Shapes never measured: the op type's factor corrects the roofline.
  assert model.compute_time(cost, 0, "MatMul|other") == pytest.approx(
      0.25 + 3.0 * 2e6 / FLOPS)
  (tmp_path / "bad.json").write_text("{\"version\": 99}")
  with pytest.raises(CostTableError, match="rerun"):
    op_cost.CostTable.load(str(tmp_path / "bad.json"))


def test_einsums_batched_matmuls_and_transposes_have_a_line_per_form():
  g = tf.Graph()
  with g.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [2, 8, 4, 4], name="x")
    w = tf.compat.v1.placeholder(tf.float32, [4, 4, 16], name="w")
    m = tf.compat.v1.placeholder(tf.float32, [16, 16], name="m")
    einsum, matmul = tf.raw_ops.Einsum, tf.raw_ops.BatchMatMulV2
    einsum(inputs=[x, w], equation="abcd,cde->abe", name="dense")  # no batch label
    einsum(inputs=[x, x], equation="BTNH,BSNH->BNTS", name="attention")  # B, N
    y = tf.reshape(x, [2, 8, 16])
    matmul(x=y, y=m, name="by_matrix")
    matmul(x=y, y=y, adj_y=True, name="batched")
    tf.transpose(x, [0, 2, 1, 3], name="heads")   # attention's head split
    tf.transpose(m, name="matrix")
  graph = Graph(g.as_graph_def())
  shapes = infer_shapes(graph, [])
  names = ("dense", "attention", "by_matrix", "batched", "heads", "matrix")
  lines = {n: op_cost.node_cost(graph.node(n), shapes, graph).line for n in names}
  assert lines == {"dense": "Einsum:dense", "attention": "Einsum",
                   "by_matrix": "BatchMatMulV2:broadcast", "batched": "BatchMatMulV2",
                   "heads": "Transpose:nd", "matrix": "Transpose"}
  # A form the table has no line for takes its op type's (older tables).
  table = op_cost.CostTable(op_fixed={"Einsum": 1e-4, "Einsum:dense": 1e-6},
                            op_factor={"Einsum": 5.0})
  assert (table.fixed("Einsum:dense"), table.factor("Einsum:dense")) == (1e-6, 5.0)
  assert table.fixed("BatchMatMulV2:broadcast") == table.default_fixed == 0.0
  model = op_cost.CostModel(_cluster(), table)
  dense = op_cost.node_cost(graph.node("dense"), shapes, graph)
  assert model.compute_time(dense) == pytest.approx(1e-6 + 5.0 * model.roofline(dense))


def test_variable_updates_take_the_line_of_the_same_elementwise_work():
  # No calibration step runs an optimizer's in-place updates (its weights
  # are fed): they take the line of the elementwise op doing the same work,
  # unless the table has one of their own.
  g = tf.Graph()
  with g.as_default():
    v = tf.Variable(tf.zeros([64, 64]), name="v")
    delta = tf.compat.v1.placeholder(tf.float32, [64, 64], name="delta")
    tf.raw_ops.AssignAddVariableOp(resource=v.handle, value=delta, name="add")
    tf.raw_ops.AssignSubVariableOp(resource=v.handle, value=delta, name="sub")
  graph = Graph(g.as_graph_def())
  shapes = infer_shapes(graph, [])
  table = op_cost.CostTable(op_fixed={"AddV2": 2e-7, "Sub": 3e-7},
                            op_factor={"AddV2": 0.4, "Sub": 0.5},
                            default_fixed=1e-6, default_factor=1.4)
  model = op_cost.CostModel(_cluster(), table)
  for name, fixed, factor in (("add", 2e-7, 0.4), ("sub", 3e-7, 0.5)):
    cost = op_cost.node_cost(graph.node(name), shapes, graph)
    assert cost.bytes_read == 2 * 64 * 64 * 4 and cost.bytes_written == 64 * 64 * 4
    assert model.compute_time(cost) == pytest.approx(fixed + factor * model.roofline(cost))
  own = op_cost.CostTable(op_fixed={"AddV2": 2e-7, "AssignAddVariableOp": 5e-7})
  assert own.fixed("AssignAddVariableOp") == 5e-7
  assert op_cost.CostTable(default_fixed=1e-6).fixed("AssignAddVariableOp") == 1e-6


def test_device_overheads_per_device_count(tmp_path):
  # Measured over 2 and 4 logical devices; a collective's fixed time grows
  # with its group (a ring's steps), linearly past the last point; the
  # concurrency of more devices than measured is the last one's.
  table = op_cost.CostTable(concurrency=1.4, collective_overhead=1e-4,
                            concurrency_at={4: 1.1}, collective_at={4: 2.5e-4},
                            collective_overlap=0.4)
  path = str(tmp_path / "table.json")
  table.save(path)
  table = op_cost.CostTable.load(path)
  assert table.concurrency_at == {4: 1.1} and table.collective_at == {4: 2.5e-4}
  assert table.collective_overlap == 0.4
  assert [table.concurrency_for(n) for n in (2, 3, 4, 16)] == [1.4, 1.4, 1.1, 1.1]
  assert [table.collective_for(n) for n in (2, 3, 4, 8)] == pytest.approx(
      [1e-4, 1.75e-4, 2.5e-4, 5.5e-4])
  # An older table (two devices only): a ring of n over one of 2, n - 1 times.
  old = op_cost.CostTable(concurrency=1.4, collective_overhead=1e-4)
  assert (old.concurrency_for(8), old.collective_for(4)) == (1.4, pytest.approx(3e-4))
  assert old.collective_overlap == 1.0   # unmeasured: groups' collectives in turn
  assert op_cost.CostTable().concurrency_for(4) is None


def test_place_by_layers_spreads_parameters_over_devices():
  graph_def = load_graph(os.path.join(EXAMPLES, "gpt_raw_train_tiny.pb"))
  placed = graph_sim.place_by_layers(graph_def, 4)
  res = graph_sim.simulate_graph(placed, _cluster(4))
  assert len(res.memory) == 4
  assert all(m.parameters > 0 for m in res.memory)
  assert res.transfers > 0 and res.step_time > 0


def _quick_calibration(tmp_path, capsys, monkeypatch):
  """(graph, table path) of `tfsplit calibrate` on the tiny MLP with fewer
  timed rounds and no micro-batched steps: a fraction of a whole
  calibration's time, enough for the table's structure (the slow tests
  judge calibrated predictions)."""
  graph = os.path.join(EXAMPLES, "mlp_raw_train_tiny.pb")
  table = str(tmp_path / "table.json")
  # Three of the six steps: the two smallest transformer-shaped ones (every
  # block style between them) and an MLP, cut into 2 and 4 stages.
  for module, name, value in (
      (measure, "WARMUP", 2), (measure, "ROUNDS", 2), (calibration_devices, "_STAGE_ROUNDS", 3),
      (measure, "_MICROBATCHES", ()),
      (calibration_graphs, "TRAINING_STEPS", ((1, 4, 24, 48), (2, 6, 24, 48), (4, 24, 1, 96))),
      (calibration_devices, "_STAGE_CUTS", ((2, 2), (2, 4)))):
    monkeypatch.setattr(module, name, value)
  assert run(["tfsplit", "calibrate", graph, "-o", table, "--repeats", "2",
              "--traced", "1"]) == 0
  assert "measured op shapes" in capsys.readouterr().out
  return graph, table


@pytest.mark.slow  # 33 s; the calibration table's use: test_plan.py
def test_calibrate_then_estimate_graph_cli(tmp_path, capsys, monkeypatch):
  graph, table = _quick_calibration(tmp_path, capsys, monkeypatch)
  saved = json.load(open(table, encoding="utf-8"))
  entries = saved["entries"]
  # The graph's own matmuls were measured, keyed by op, dtype and shapes.
  assert "MatMul|float32|[4,32],[32,32]|[4,32]|transpose_a=0,transpose_b=0" in entries
  # Attention's head transposes have a line of their own (Eigen's generic
  # shuffle costs several times a matrix transpose per call): its chain
  # must keep its transposes, which Grappler cancels in pairs around a
  # multiply. (How much more it costs is the full calibration's to judge:
  # this quick one's 2 timed rounds on 2 shared cores have fitted its fixed
  # time to 0 while the other worker ran a heavy test.)
  assert "Transpose:nd" in saved["op_fixed"] and "Transpose" in saved["op_fixed"]
  assert saved["op_fixed"]["Transpose:nd"] >= 0
  # Only the graph's ops: the micro-benchmark's chains time each op alone,
  # below what it costs inside a step, so they only fit the lines.
  g = Graph(load_graph(graph))
  g_shapes = infer_shapes(g)
  assert set(entries) <= {op_cost.signature(n, g_shapes) for n in g.nodes}
  # The small training steps' times are this machine's level: a later
  # timing of the same steps is priced against them, step by step, and the
  # level is the median of those ratios. (Whether a re-timing agrees needs a
  # machine with nothing else running: the slow test below.)
  steps = saved["machine"]["training_steps"]
  assert len(steps) == len(calibration_graphs.TRAINING_STEPS)
  now = {k: 1.5 * t for k, t in enumerate(steps)}
  now[0] = 3.0 * steps[0]
  loaded = op_cost.CostTable.load(table)
  assert fitting.level_ratios(loaded, now) == pytest.approx(
      {k: 3.0 if k == 0 else 1.5 for k in now})
  assert fitting.machine_level(loaded, now) == pytest.approx(1.5)
  assert fitting.machine_level(loaded, {}) is None
  # The launch cost of a step (a 2-op function call, timed in the same
  # turns as the steps) is part of every step: below the smallest.
  assert 0 < saved["step_overhead"] < min(steps), (saved["step_overhead"], steps)
  # The MLP steps cut into pipeline stages, timed in the same turns: what
  # a further stage adds, less than a whole step.
  assert sorted(saved["machine"]["stage_cuts"]) == sorted(
      f"{k}x{n}" for k, n in calibration_devices._STAGE_CUTS)  # pylint: disable=protected-access
  assert 0 <= saved["stage_overhead"] < min(steps), (saved["stage_overhead"], steps)
  trace = str(tmp_path / "step.json")
  assert run(["tfsplit", "estimate", graph, "--calibration", table,
              "--trace", trace, "--format", "json"]) == 0
  out = json.loads(capsys.readouterr().out)
  # Every op got a measured time (none fell back to the model).
  assert out["measured_ops"] == out["tasks"] - 1 and out["modelled_ops"] == 0
  # Parameter and Adam-state bytes are the variables' sizes, each rounded up
  # to the allocator's 256-byte alignment.
  variables = find_variables(Graph(load_graph(graph)))
  aligned = [-(-4 * int(np.prod(v.shape)) // 256) * 256 for v in variables if v.trainable]
  memory = out["devices"][0]["memory"]
  assert memory["parameters"] == sum(aligned) == 11008
  assert memory["optimizer_state"] == 2 * sum(aligned) + 2 * 256  # + lr, iteration
  spans = [e for e in json.load(open(trace, encoding="utf-8"))["traceEvents"]
           if e["ph"] == "X"]
  assert len(spans) >= out["tasks"] - 1
  assert run(["tfsplit", "estimate", graph, "--calibration",
              str(tmp_path / "none.json")]) == 2
  assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_level_steps_timed_again_take_what_the_table_says(tmp_path, capsys, monkeypatch):
  # The level steps' times are the machine's level only if timing them
  # again in the same process gives about the same: on a quiet machine each
  # ratio is near 1 (another process sharing the cores moves them all).
  _, table = _quick_calibration(tmp_path, capsys, monkeypatch)
  steps = json.load(open(table, encoding="utf-8"))["machine"]["training_steps"]
  now = timing.median_of_rounds(measure.level_steps(), warmup=5, rounds=3, steps=3)
  ratios = sorted(now[k] / steps[k] for k in now)
  assert 0.5 < ratios[0] and ratios[-1] < 2.0, (now, steps)
  loaded = op_cost.CostTable.load(table)
  assert sorted(fitting.level_ratios(loaded, now).values()) == ratios
  assert fitting.machine_level(loaded, now) == statistics.median(ratios)


# Three models of ~11 MB peak; the small MLP (~0.8 MB) swings by 25% between
# processes (allocator rounding and Grappler order), more than the tolerance.
MODELS = ["gpt_raw:small", "gpt_keras3:small", "gpt_tfkeras:small"]


@pytest.mark.parametrize("spec", MODELS)
def test_memory_estimate_within_15_percent_of_allocator_peak(spec):
  r = bench_estimate.run_one(spec, with_time=False)
  assert r["estimated_peak"] == pytest.approx(r["measured_peak"], rel=0.15), r


@pytest.mark.slow
@pytest.mark.parametrize("spec", MODELS)
def test_calibrated_step_time_within_25_percent(spec):
  r = bench_estimate.run_one(spec, steps=30, with_time=True)
  assert r["calibrated_step"] == pytest.approx(r["measured_step"],
                                               rel=0.25), r


def _run_updates(graph_def, values):
  """{weight placeholder: its update (new value less the fed one)} of a
  calibration training step run with `values` fed by placeholder name:
  the Identity nodes under 'update/' output w - step."""
  nodes = {n.name: n for n in graph_def.node}
  weights = {}
  for node in graph_def.node:
    if node.name.startswith("update/") and node.op == "Identity":
      weights[node.name] = nodes[nodes[node.input[0]].input[0]].name
  g = tf.Graph()
  with g.as_default():
    tf.graph_util.import_graph_def(graph_def, name="")
  with tf.compat.v1.Session(graph=g) as sess:
    out = sess.run({name: name + ":0" for name in weights},
                   {name + ":0": v for name, v in values.items()})
  return {weights[name]: value - values[weights[name]] for name, value in out.items()}


def test_microbatched_training_step_computes_the_same_update():
  # The calibration times its transformer-shaped steps in micro-batches:
  # the same step, each micro-batch's forward and backward on a slice of
  # the batch, summed, one update. The micro-batched graph must compute
  # what the whole-batch one does, or its times price another step.
  whole = calibration_graphs.training_graph(2, 4, 8, 16, first_style=0)
  rng = np.random.default_rng(0)
  values = {}
  for node in whole.node:
    if node.op == "Placeholder":
      shape = tf.TensorShape(node.attr["shape"].shape).as_list()
      values[node.name] = (rng.integers(0, 256, shape).astype(np.int32)
                           if node.attr["dtype"].type == tf.int32.as_datatype_enum
                           else rng.random(shape, dtype=np.float32) * 0.1)  # v >= 0
  expected = _run_updates(whole, values)
  fed = sum(1 for n in whole.node if n.op == "Placeholder")
  assert len(expected) == (fed - 2) // 3   # one per weight (fed with its two moments)
  for m in (2, 4):
    mb = calibration_graphs.training_graph(2, 4, 8, 16, first_style=0, microbatches=m)
    got = _run_updates(mb, values)
    assert sorted(got) == sorted(expected)
    for name, step in expected.items():
      np.testing.assert_allclose(got[name], step, rtol=1e-4,
                                 atol=1e-5 * float(np.abs(step).max()),
                                 err_msg=f"update of {name} with {m} micro-batches")
    # Micro-batch j + 1 starts after micro-batch j's gradients joined the sums.
    graph = Graph(mb)
    starts = [n for n in graph.nodes if n.op == "Identity" and
              any(t.startswith("^") for t in n.input)]
    assert len(starts) == m - 1


def test_calibration_creates_a_graphs_variables_on_their_devices():
  # A split graph's variables live on their devices (a pipeline stage's
  # weights on its own): calibration must run it on variables created
  # there, not on CPU:0, where every read would time a transfer.
  import types  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import variables as variables_lib  # pylint: disable=import-outside-toplevel
  g = tf.Graph()
  with g.as_default(), tf.device("/device:CPU:1"):
    handle = tf.compat.v1.placeholder(tf.resource, [], name="w")
    x = tf.compat.v1.placeholder(tf.float32, [4], name="x")
    tf.identity(tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32) * x, name="y")
  graph_def = g.as_graph_def()
  variables_lib.annotate_captured_variable(
      next(n for n in graph_def.node if n.name == "w"),
      types.SimpleNamespace(shape=tf.TensorShape([4]), dtype=tf.float32, trainable=True),
      name="w")
  graph = Graph(graph_def)
  fn, args, variables = measure.step_function(graph_def, graph, 0)
  assert [v.device.rpartition(":")[2] for v in variables] == ["1"]
  assert args[0].device.endswith("CPU:1")
  (y,) = fn(*args)
  np.testing.assert_allclose(y.numpy(), variables[0].numpy() * args[0].numpy(), rtol=1e-6)
  tf_graph, _, _, _ = measure.session_graph(graph_def, graph, np.random.default_rng(0))
  created = tf_graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
  assert [v.device.rpartition(":")[2] for v in created] == ["1"], [v.device for v in created]


def test_in_step_points_scale_each_op_by_its_steps_untraced_time():
  # Two ops traced at 1 and 3 ms in a step that runs untraced in 6 ms
  # (less a launch of 2 ms): each counts what it adds to the step, 1 and 3
  # ms scaled by 4 / 4; in a step of 10 ms, by 8 / 4.
  g = tf.Graph()
  with g.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [64, 64], name="x")
    w = tf.compat.v1.placeholder(tf.float32, [64, 32], name="w")
    tf.linalg.matmul(tf.linalg.matmul(x, x, name="mm"), w, name="mm2")
  graph = Graph(g.as_graph_def())
  shapes = infer_shapes(graph, [])
  traced = {"mm": [1e-3, 2e-3], "mm2": [3e-3]}
  for step, scale in ((6e-3, 1.0), (10e-3, 2.0)):
    points = fitting.in_step_points(
        [(graph, shapes, fitting.Profile(traced, step, 4e-3))], launch=2e-3)
    got = sorted(seconds for _, _, seconds in points.values())
    assert got == pytest.approx([1e-3 * scale, 3e-3 * scale])
  # What the step's call pays for its arguments is outside its ops too:
  # 6 ms less 2 of launch and 1 of arguments, 3 ms over 4 traced.
  points = fitting.in_step_points([(graph, shapes, fitting.Profile(traced, 6e-3, 4e-3))],
                                  launch=2e-3, call_cost=lambda g: 1e-3)
  assert sorted(seconds for _, _, seconds in points.values()) == pytest.approx(
      [0.75e-3, 2.25e-3])


def test_fused_matmul_and_bias_add_are_a_point_of_the_matmul_line():
  # Grappler's remapper runs MatMul + BiasAdd (+ Relu) as one kernel named
  # after the last: the trace has no MatMul and a matmul's time for the
  # last node. That time is the MatMul line's point (the BiasAdd line keeps
  # bias adds alone; a model's pair is priced by both lines).
  g = tf.Graph()
  with g.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [64, 128], name="x")
    w = tf.compat.v1.placeholder(tf.float32, [128, 128], name="w")
    b = tf.compat.v1.placeholder(tf.float32, [128], name="b")
    tf.nn.relu(tf.nn.bias_add(tf.linalg.matmul(x, w, name="mm"), b, name="bias"), name="out")
  graph_def = g.as_graph_def()
  graph = Graph(graph_def)
  shapes = infer_shapes(graph, [])
  profile = measure.profile_graph(graph_def, repeats=2, traced=1)
  assert set(profile.node_times) == {"out"}, profile.node_times
  assert fitting.fused_matmuls(graph, profile) == {"mm": "out", "bias": "out"}
  fused = fitting.Profile({"out": [4e-3]}, 4e-3, 4e-3)
  lines = {line: seconds for line, _, seconds in
           fitting.in_step_points([(graph, shapes, fused)]).values()}
  assert lines == pytest.approx({"MatMul": 4e-3}), lines
  # Unfused (each traced), each keeps its own time.
  apart = fitting.Profile({"mm": [3e-3], "bias": [1e-3], "out": [1e-3]}, 5e-3, 5e-3)
  assert fitting.fused_matmuls(graph, apart) == {}
  lines = {line: seconds for line, _, seconds in
           fitting.in_step_points([(graph, shapes, apart)]).values()}
  assert lines == pytest.approx({"MatMul": 3e-3, "BiasAdd": 1e-3, "Relu": 1e-3}), lines
  # A traced bias add straight after an untraced MatMul is the same kernel.
  pair = fitting.Profile({"bias": [4e-3], "out": [1e-3]}, 5e-3, 5e-3)
  assert fitting.fused_matmuls(graph, pair) == {"mm": "bias"}


def test_dense_lines_keep_their_chains_fixed_part_attention_lines_fit_theirs():
  # Of the lines timed inside the training steps, those only transformer
  # steps run are fitted on both parts there (attention's ops cost twice
  # their chains' per call inside a step), but Keras 3's dense layer (a
  # batched matmul by one matrix) keeps its chain's fixed part, as the
  # MLP's MatMuls do: fitted in the steps, it priced Keras 3's GPT's dense
  # calls at 2.5x their time in the model's own step.

  def step(graph_def):   # every op ran
    graph = Graph(graph_def)
    return graph, infer_shapes(graph, []), fitting.Profile(
        {n.name: [1e-6] for n in graph.nodes}, 1e-3, 1e-3)

  mlp = step(calibration_graphs.training_graph(2, 4, 1, 16))
  keras3 = step(calibration_graphs.training_graph(1, 2, 8, 16, first_style=2))
  in_step = fitting.step_lines([mlp, keras3])
  assert {"BatchMatMulV2:broadcast", "Einsum", "Softmax", "MatMul"} <= in_step, in_step
  fitted = fitting.lines_fitted_in_steps(in_step, [mlp])
  assert {"Einsum", "Softmax"} <= fitted, fitted
  assert not {"BatchMatMulV2:broadcast", "MatMul"} & fitted, fitted


def test_step_copies_run_one_per_logical_cpu_and_compute_the_same():
  # The concurrency of logical CPUs is measured on copies of a training
  # step run in lockstep, one per device: each copy must run on its own
  # device (all on one would measure nothing) and compute the same step.
  graph_def = calibration_graphs.training_graph(1, 2, 4, 8)
  (run_copies, args), sess = calibration_devices._copies_session(graph_def, 2)  # pylint: disable=protected-access
  try:
    run_copies(*args)
    ends = sorted(n.name for n in graph_def.node
                  if n.name.startswith("update/") and n.op == "Identity")
    metadata = tf.compat.v1.RunMetadata()
    out = sess.run({(d, e): f"copy{d}/{e}:0" for d in range(2) for e in ends},
                   options=tf.compat.v1.RunOptions(
                       trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
                   run_metadata=metadata)
  finally:
    sess.close()
  for e in ends:
    np.testing.assert_array_equal(out[(1, e)], out[(0, e)], err_msg=e)
  ran = collections.defaultdict(set)
  for dev in metadata.step_stats.dev_stats:
    for stats in dev.node_stats:
      if stats.node_name.startswith("copy"):
        ran[dev.device[-1]].add(stats.node_name.partition("/")[0])
  assert ran == {"0": {"copy0"}, "1": {"copy1"}}, dict(ran)


def test_stage_cut_steps_run_each_block_on_its_stage_and_compute_the_same():
  # What a further pipeline stage adds is measured on a training step cut
  # into stages (calibration.devices.stage_steps): block i, its weights'
  # gradients and update on logical CPU i * S // blocks, the head on the last. It
  # must run there (all on one device would measure no stage) and compute
  # what the uncut step does.
  whole = calibration_graphs.training_graph(4, 4, 1, 16)
  cut = calibration_graphs.training_graph(4, 4, 1, 16, stages=4)
  assert [n.name for n in whole.node] == [n.name for n in cut.node]

  def run(graph_def):
    graph = tf.Graph()
    with graph.as_default():
      tf.graph_util.import_graph_def(graph_def, name="")
    rng = np.random.default_rng(0)
    feeds = {f"{n.name}:0": measure.feed_value(
        n.attr["dtype"].type, tf.TensorShape(n.attr["shape"].shape).as_list(), rng)
             for n in graph_def.node if n.op == "Placeholder"}
    ends = [f"{n.name}:0" for n in graph_def.node
            if n.name.startswith("update/") and n.op == "Identity"]
    config = tf.compat.v1.ConfigProto(allow_soft_placement=False)
    config.device_count["CPU"] = 4
    metadata = tf.compat.v1.RunMetadata()
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
      out = sess.run(ends, feeds, options=tf.compat.v1.RunOptions(
          trace_level=tf.compat.v1.RunOptions.FULL_TRACE), run_metadata=metadata)
    ran = collections.defaultdict(set)
    for dev in metadata.step_stats.dev_stats:
      for stats in dev.node_stats:
        ran[stats.node_name].add(dev.device[-1])
    return dict(zip(ends, out)), ran

  (plain, _), (staged, ran) = run(whole), run(cut)
  for name, value in plain.items():
    np.testing.assert_allclose(staged[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
  # Each block's matmul (Grappler fuses it with its bias add, traced
  # under the BiasAdd's name) ran on its stage's device, and only there.
  blocks = [n.name for n in cut.node if n.op == "BiasAdd" and "gradients" not in n.name]
  assert [ran[name] for name in blocks] == [{"0"}, {"1"}, {"2"}, {"3"}]
  head = [n.name for n in cut.node if n.op == "MatMul" and "gradients" not in n.name][-1]
  assert ran[head] == {"3"}
  # Every weight's update runs where its block does.
  update_devices = {d for n in cut.node if n.name.startswith("update/") for d in ran[n.name]}
  assert update_devices == {"0", "1", "2", "3"}


def test_further_stage_is_the_median_cut_beyond_its_transfers_paired_by_round():
  # Round medians: the machine slows in round 2; each round's cut and
  # uncut steps slow together, so their paired difference does not move.
  rounds = {4: [600e-6, 900e-6, 610e-6], 5: [900e-6, 1300e-6, 905e-6],
            (4, 2): [680e-6, 980e-6, 690e-6],      # 80 us a stage
            (4, 4): [840e-6, 1140e-6, 820e-6],     # 80, 80, 70
            (5, 2): [950e-6, 1350e-6, 940e-6]}     # 50, 50, 35
  overhead, per_cut = fitting.further_stage_seconds(rounds, 10e-6)
  assert per_cut == pytest.approx({(4, 2): 80e-6, (4, 4): 80e-6, (5, 2): 50e-6})
  assert overhead == pytest.approx(60e-6)
  # Cut steps faster than uncut (their devices' work overlapping): 0.
  faster = {**rounds, (4, 2): [590e-6, 890e-6, 600e-6], (5, 2): [880e-6, 1290e-6, 890e-6]}
  assert fitting.further_stage_seconds(faster, 10e-6)[0] == 0.0


def test_take_turns_lengthens_the_turns_of_short_steps():
  # A step far shorter than the minimum turn makes more calls per turn (by
  # its warm-up calls' time); a long enough one makes `steps` calls.
  calls = collections.Counter()

  def step(name, seconds):
    def fn():
      calls[name] += 1
      time.sleep(seconds)
      return 0
    return fn, ()

  steps = {"short": step("short", 0.001), "long": step("long", 0.02)}
  samples, medians = timing.take_turns(steps, warmup=2, rounds=3, steps=2, min_turn=0.02)
  per_turn = len(samples["short"]) // 3
  # sleep(1 ms) lasts at least 1 ms: at most 20 calls, and far more than 2.
  assert 8 <= per_turn <= 20 and len(samples["short"]) == 3 * per_turn
  assert len(samples["long"]) == 3 * 2 and len(medians["short"]) == 3
  assert calls["short"] == 2 + 3 * per_turn
  samples, _ = timing.take_turns(steps, warmup=2, rounds=3, steps=2, min_turn=0)
  assert len(samples["short"]) == 3 * 2


def test_fastest_of_rounds_is_the_quietest_rounds_median_call():
  # Other work only slows a turn: a step slowed in two of three rounds
  # (a burst of other work during its turn) counts at its third, quiet one;
  # the median round would be a slowed one.
  turn = collections.Counter()
  slow_rounds = {0, 1}

  def fn():
    turn["calls"] += 1
    # 2 warm-up calls (slow: then a turn is `steps` calls), then 3 a round
    rnd = (turn["calls"] - 1 - 2) // 3
    time.sleep(0.02 if rnd < 0 or rnd in slow_rounds else 0.005)
    return 0

  fastest = timing.fastest_of_rounds({"step": (fn, ())}, warmup=2, rounds=3, steps=3)
  turn.clear()
  median = timing.median_of_rounds({"step": (fn, ())}, warmup=2, rounds=3, steps=3)
  assert 0.005 <= fastest["step"] < 0.012 <= 0.02 <= median["step"], (fastest, median)


def test_exchanging_step_copies_compute_the_plain_step_over_their_collectives():
  # What a collective costs inside a step is timed on copies of the MLP
  # step that all-reduce (mean) each block's output and its gradient over
  # the copies: 2 collectives a block, one instance each, over all copies.
  # Identical copies' mean is the value itself, so each copy must compute
  # the plain step's updates exactly (a sum, or a gradient left out of the
  # exchange, changes them), and the collectives must be what is counted.
  plain = calibration_graphs.training_graph(2, 4, 1, 16)
  exchanging = calibration_graphs.training_graph(2, 4, 1, 16, exchange_over=2)
  collectives = [n for n in exchanging.node if n.op == "CollectiveReduceV2"]
  assert not [n for n in plain.node if n.op.startswith("Collective")]
  assert len(collectives) == 2 * 2
  consts = {n.name: tf.make_ndarray(n.attr["value"].tensor) for n in exchanging.node
            if n.op == "Const"}
  # CollectiveReduceV2's inputs: input, group_size, group_key, instance_key.
  assert {int(consts[n.input[1]]) for n in collectives} == {2}
  assert len({int(consts[n.input[3]]) for n in collectives}) == len(collectives)
  ends = sorted(n.name for n in plain.node if n.name.startswith("update/") and n.op == "Identity")
  assert ends and ends == sorted(n.name for n in exchanging.node
                                 if n.name.startswith("update/") and n.op == "Identity")

  def updates(graph_def, copies):
    (run, args), sess = calibration_devices._copies_session(graph_def, copies)  # pylint: disable=protected-access
    try:
      run(*args)
      return sess.run({(d, e): f"copy{d}/{e}:0" for d in range(copies) for e in ends})
    finally:
      sess.close()

  # Two groups of 2 exchanging at once: 4 copies, each group under its own
  # key (one key for all 4 would wait for 2 members more than the group has).
  grouped = [calibration_graphs.training_graph(2, 4, 1, 16, exchange_over=2, exchange_group=d // 2)
             for d in range(4)]

  def group_keys(graph_def):
    values = {n.name: tf.make_ndarray(n.attr["value"].tensor) for n in graph_def.node
              if n.op == "Const"}
    return {int(values[n.input[2]]) for n in graph_def.node if n.op == "CollectiveReduceV2"}

  keys = [group_keys(g) for g in grouped]
  assert all(len(k) == 1 for k in keys) and keys[0] == keys[1] != keys[2] == keys[3]
  assert keys[0] == group_keys(exchanging)

  want = updates(plain, 1)
  for copies, graph_def in ((2, exchanging), (4, grouped)):
    got = updates(graph_def, copies)
    for (d, e), value in got.items():
      np.testing.assert_allclose(value, want[(0, e)], rtol=1e-6,
                                 atol=1e-7 * float(np.abs(want[(0, e)]).max()),
                                 err_msg=f"{copies} copies, copy {d}: {e}")


def test_a_collective_is_priced_at_its_in_step_cost_never_below_the_chains(monkeypatch):
  # A collective inside a step costs more than in a chain of them alone
  # (the devices' threads are busy with the step's ops); the table prices
  # the in-step cost, and the chain's where the steps read less (their
  # difference is then noise).
  chain = {2: 60e-6, 4: 130e-6}
  monkeypatch.setattr(calibration_devices, "_unit_seconds",
                      lambda kind, repeats, devices=2: chain[devices] if kind == "collective"
                      else 5e-6)
  monkeypatch.setattr(calibration_devices, "step_concurrency", lambda repeats: (
      {2: 1.3, 4: 1.3}, {2: [1.3], 4: [1.3]},
      {(2, 1): 200e-6, (4, 1): 100e-6, (2, 2): 260e-6}))
  got = calibration_devices.device_benchmark(1)
  assert got["collective"] == pytest.approx({2: 200e-6, 4: 130e-6})
  assert got["chain"] == chain and got["transfer"] == 5e-6
  assert got["concurrency"] == {2: 1.3, 4: 1.3}
  # Two pairs exchanging at once added 260 us where one pair's added 200:
  # the second pair's collective cost 0.3 of one.
  assert got["at_once"] == {(2, 2): 260e-6}
  assert got["overlap"] == pytest.approx(0.3)


def test_a_collectives_in_step_cost_is_the_exchanges_added_time_over_their_count():
  # Over the MLP-shaped steps' copies: what exchanging added to each, summed,
  # over the collectives they ran (the step with the most weighs most).
  # Two groups of 2 exchanging at once are timed against 4 plain copies.
  x = fitting.EXCHANGE
  seconds = {(4, 2): 1e-3, (4, 2, x, 1): 2.6e-3, (5, 2): 2e-3, (5, 2, x, 1): 2.4e-3,
             (4, 4): 2e-3, (4, 4, x, 1): 6.8e-3, (5, 4): 3e-3, (5, 4, x, 1): 3e-3,
             (4, 2, x, 2): 4.4e-3, (5, 2, x, 2): 3.6e-3}
  got = fitting.in_step_collective(seconds, {4: 8, 5: 4}, ((2, 1), (4, 1), (2, 2)))
  assert got == pytest.approx({(2, 1): 2e-3 / 12, (4, 1): 4.8e-3 / 12, (2, 2): 3e-3 / 12})


def test_collective_overlap_is_the_further_groups_share_within_0_and_1():
  assert fitting.collective_overlap(150e-6, 100e-6, 2) == pytest.approx(0.5)
  assert fitting.collective_overlap(300e-6, 100e-6, 3) == pytest.approx(1.0)
  assert fitting.collective_overlap(80e-6, 100e-6, 2) == 0.0    # noise below one group's
  assert fitting.collective_overlap(500e-6, 100e-6, 2) == 1.0   # no worse than in turn
  assert op_cost.collectives_at_once(100e-6, 1, 0.4) == pytest.approx(100e-6)
  assert op_cost.collectives_at_once(100e-6, 3, 0.4) == pytest.approx(180e-6)


def test_a_calls_arguments_and_outputs_cost_what_its_calls_beside_the_launch_add(tmp_path):
  # The calibration's training steps are called with their weights and
  # moments as arguments (17-143 of them, 3-4 us each here); a user's step
  # captures its weights. What a call's further arguments and outputs add
  # is priced by calls of 40 of each beside the launch's call of one.
  for arguments, outputs in ((1, 1), (fitting.CALL_TENSORS, 1), (1, fitting.CALL_TENSORS)):
    graph = Graph(calibration_graphs.call_graph(arguments, outputs))
    assert (len(graph_inputs(graph)), len(graph_outputs(graph))) == (arguments, outputs)
  seconds = {"arguments": 100e-6 + 39 * 3e-6, "outputs": 100e-6 + 39 * 1e-6}
  assert fitting.call_costs(seconds, 100e-6) == pytest.approx((3e-6, 1e-6))
  assert fitting.call_costs({"arguments": 90e-6, "outputs": 90e-6}, 100e-6) == (0.0, 0.0)
  path = str(tmp_path / "table.json")
  op_cost.CostTable(step_overhead=1e-4, argument_overhead=3e-6, output_overhead=1e-6).save(path)
  table = op_cost.CostTable.load(path)
  assert table.call_overhead(1, 1) == 0.0   # the launch's call
  assert table.call_overhead(11, 3) == pytest.approx(10 * 3e-6 + 2 * 1e-6)
  step = Graph(calibration_graphs.training_graph(1, 2, 4, 8))
  assert table.graph_call_overhead(step) == pytest.approx(
      table.call_overhead(len(graph_inputs(step)), len(graph_outputs(step))))
  assert len(graph_inputs(step)) > 10   # its weights and moments are fed


def test_step_scale_fits_the_lines_scale_and_each_ops_gap_over_the_steps():
  # Steps timed at 1.1 x their ops' times by the lines + 0.8 us per op +
  # the launch and their calls' arguments: step_scale gives back (1.1,
  # 0.8 us). With the gap left out (the ratio of the sums, as before) the
  # smallest step would be priced well below its time.
  table = op_cost.CostTable(step_overhead=1e-4, argument_overhead=3e-6, output_overhead=1e-6,
                            flops=1e10, bandwidth=1e10)
  cluster = ClusterSpec([Device("d", "h", "cpu", 1, 1e10, {"float32": 1e10})],
                        [Host("h", Link(1e10, 0), Link(1e10, 0))])
  model = op_cost.CostModel(cluster, table=table, op_overhead=0.0)
  steps = []
  for sizes in ((1, 2, 4, 8), (2, 4, 8, 16), (1, 8, 16, 32), (2, 16, 32, 64)):
    graph = Graph(calibration_graphs.training_graph(*sizes))
    shapes = infer_shapes(graph, [])
    costs = [op_cost.node_cost(n, shapes, graph) for n in graph.nodes]
    lines = sum(model.compute_time(c) for c in costs if not c.comm)
    ops = sum(1 for c in costs if not c.comm)
    seconds = 1.1 * lines + 0.8e-6 * ops + 1e-4 + table.graph_call_overhead(graph)
    steps.append((graph, shapes, fitting.Profile({}, seconds, seconds), lines, ops))
  scale, gap = fitting.step_scale(table, [s[:3] for s in steps], cluster)
  assert (scale, gap) == pytest.approx((1.1, 0.8e-6), rel=1e-6)
  graph, shapes, profile, lines, ops = steps[0]
  ratio_of_sums = (sum(s[2].step_time - 1e-4 - table.graph_call_overhead(s[0]) for s in steps) /
                   sum(s[3] for s in steps))
  assert ratio_of_sums * lines < 0.97 * (profile.step_time - 1e-4 - table.graph_call_overhead(graph))


def test_kernel_and_gap_concurrency_come_back_from_the_steps_measured_concurrency():
  # Steps whose copies overlap their work 1.25 x and their per-op gaps
  # 1.8 x (n = 2): each step's concurrency is the mix of its work and
  # gaps; the fit over the steps gives both back. A table without gaps
  # (op_overhead 0) measures no split.
  table = op_cost.CostTable(op_overhead=1e-6, flops=1e10, bandwidth=1e10)
  cluster = ClusterSpec([Device("d", "h", "cpu", 1, 1e10, {"float32": 1e10})],
                        [Host("h", Link(1e10, 0), Link(1e10, 0))])
  model = op_cost.CostModel(cluster, table=table, op_overhead=0.0)
  steps, measured = [], []
  for sizes in ((1, 2, 4, 8), (2, 4, 8, 16), (1, 8, 16, 32), (2, 16, 32, 64)):
    graph = Graph(calibration_graphs.training_graph(*sizes))
    shapes = infer_shapes(graph, [])
    costs = [c for c in (op_cost.node_cost(n, shapes, graph) for n in graph.nodes)
             if not c.comm]
    work = sum(model.compute_time(c) for c in costs)
    gaps = 1e-6 * len(costs)
    steps.append((graph, shapes, None))
    measured.append((work + gaps) / (work / 1.25 + gaps / 1.8))
  assert len({round(c, 3) for c in measured}) == len(measured)   # steps of different mixes
  kernels, gaps = fitting.kernel_and_gap_concurrency(table, steps, {2: measured}, cluster)
  assert kernels == pytest.approx({2: 1.25}) and gaps == pytest.approx({2: 1.8})
  table.op_overhead = 0.0
  assert fitting.kernel_and_gap_concurrency(table, steps, {2: measured}, cluster) == ({}, {})
