"""The planner: its search against exhaustive enumeration, plans that fit a
memory cap and train exactly once applied, the plan file, and every bad input
as one line with exit code 2."""
import dataclasses
import json
import os
import random

import numpy as np
import pytest

import tfsplit
from tfsplit import plan as plan_lib
from tfsplit.cli import run
from tfsplit.cost import cluster as cluster_lib
from tfsplit.errors import PlanError
from tfsplit.graph import load_graph
from tfsplit.pipeline import partition
from tfsplit.plan import costing as costing_lib
from tfsplit.plan import plan as plan_json
from tfsplit.plan import profile as profile_lib
from tfsplit.plan import search as search_lib
from tfsplit.plan import space
from tfsplit.units import format_bytes

from _util import check_training, example, names, training_report

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROFILES = {}


def _graph(name):
  return os.path.join(_ROOT, "examples", f"{name}_train_tiny.pb")


def _profile(name, cluster, devices):
  key = (name, cluster, devices)
  if key not in _PROFILES:
    _PROFILES[key] = plan_lib.profile_graph(load_graph(_graph(name)), devices, cluster)
  return _PROFILES[key]


def _plain_dp_memory(profile, cluster, devices):
  costing = costing_lib.Costing(profile, plan_lib.cluster_for(cluster, devices))
  return costing.evaluate(space.Candidate(devices, 1, 1), [(0, costing.n)]).memory


def _cli(args, capsys):
  code = run(["tfsplit"] + [str(a) for a in args])
  captured = capsys.readouterr()
  return code, captured.out, captured.err


def _one_line_error(code, out, err, command, *needles):
  assert code == 2 and out == "", (code, out, err)
  lines = err.splitlines()
  assert len(lines) == 1, err
  assert lines[0].startswith(f"tfsplit {command}: error: "), lines[0]
  for needle in needles:
    assert needle in lines[0], (needle, lines[0])


# --- the search against exhaustive enumeration ----------------------------------------
def _synthetic(n=9, seed=3, compute=1.0, input_bytes=10**8):
  """A model with uneven layers, for cuts that matter; `compute` scales
  their forward and backward times."""
  rng = random.Random(seed)
  rows = [profile_lib.LayerRow(
      name=f"layer_{i}", forward=compute * rng.uniform(1e-4, 4e-4),
      backward=compute * rng.uniform(2e-4, 8e-4),
      update=rng.uniform(1e-6, 1e-5), params=rng.randint(1, 8) * 10**8,
      slots=rng.randint(2, 16) * 10**8, activations=rng.randint(1, 6) * 10**9,
      input_bytes=input_bytes, splittable=0 < i < n - 1) for i in range(n)]
  return profile_lib.ModelProfile(rows, [rng.randint(1, 3) * 10**8 for _ in range(n - 1)],
                                  batch=32)


def _check_against_exhaustive(profile, cluster, devices, cap):
  planner = search_lib.Planner(profile, cluster, devices, cap)
  found = planner.search().best
  best = planner.exhaustive()
  assert (found is None) == (best is None), (found, best)
  if best is None:
    return None
  assert found.memory <= cap
  assert found.step_time <= 1.05 * best.step_time, (found.candidate.label(),
                                                     best.candidate.label())
  return found, best


@pytest.mark.parametrize("name", ["gpt_raw", "gpt_keras3", "mlp_raw"])
@pytest.mark.parametrize("preset", ["h100-80gb", "cpu-host"])
def test_search_within_5_percent_of_exhaustive_on_examples(name, preset):
  checked = 0
  for devices in (2, 4, 8):
    profile = _profile(name, preset, devices)
    cluster = plan_lib.cluster_for(preset, devices)
    unbounded = search_lib.Planner(profile, cluster, devices, None).search()
    # No cap, a cap between the smallest plan and the fastest, and one that
    # only the smallest plans meet.
    caps = [10**15, (unbounded.smallest.memory + unbounded.best.memory) // 2,
            int(unbounded.smallest.memory * 1.02)]
    for cap in caps:
      checked += _check_against_exhaustive(profile, cluster, devices, cap) is not None
  assert checked == 9  # every cap above the smallest plan has a plan


@pytest.mark.parametrize("devices", [4, 8])
def test_search_within_5_percent_of_exhaustive_on_uneven_layers(devices):
  # Layers heavy enough that replicating a block seldom pays: exhaustive
  # enumeration stays a matter of seconds (replicated blocks: the next test).
  profile = _synthetic(compute=10.0, input_bytes=10**6)
  cluster = cluster_lib.from_preset("h100-80gb", devices)
  unbounded = search_lib.Planner(profile, cluster, devices, None).search()
  for cap in (10**15, (unbounded.smallest.memory + unbounded.best.memory) // 2,
              int(unbounded.smallest.memory * 1.05)):
    found, best = _check_against_exhaustive(profile, cluster, devices, cap)
    # The cut matters on uneven layers: the search is not just lucky.
    assert found.candidate.pp > 1 or best.candidate.pp == 1


def test_search_within_5_percent_of_exhaustive_with_replicated_blocks():
  # Light blocks whose all-reduces cost more than tp saves: the search picks
  # which to replicate as exhaustive enumeration of every set does, also when
  # the cap leaves room for only some (or, at the smallest, none).
  profile = _synthetic(n=5)
  cluster = cluster_lib.from_preset("h100-80gb", 4)
  unbounded = search_lib.Planner(profile, cluster, 4, None).search()
  assert unbounded.best.candidate.replicate
  for cap in (10**15, (unbounded.smallest.memory + unbounded.best.memory) // 2,
              int(unbounded.smallest.memory * 1.05)):
    assert _check_against_exhaustive(profile, cluster, 4, cap) is not None


def _two_blocks(tiny_params=10**6):
  """A tiny block (little compute, a wide input: its all-reduces cost more
  than its compute) and a large one, on one replica (batch 1) that a pipeline
  cut would not pay for (huge activations cross it)."""
  rows = [profile_lib.LayerRow("tiny", 1e-6, 2e-6, 1e-7, tiny_params, 2 * tiny_params,
                               10**6, 10**9, True),
          profile_lib.LayerRow("large", 1.0, 2.0, 1e-3, 10**10, 2 * 10**10, 10**9, 10**9,
                               True)]
  return profile_lib.ModelProfile(rows, [10**13], batch=1)


def test_replicates_a_block_where_cheaper_and_splits_it_when_memory_forces():
  cluster = cluster_lib.from_preset("h100-80gb", 2)
  free = search_lib.Planner(_two_blocks(), cluster, 2, 10**15).search().best
  assert free.candidate.tp == 2 and free.candidate.replicate == (0,), free.label()
  split = space.Candidate(1, 2, 1)
  costing = costing_lib.Costing(_two_blocks(), cluster)
  everything = costing.evaluate(split, [(0, 2)])
  assert free.step_time < everything.step_time and free.memory > everything.memory
  # A tiny block with 10 GB of weights: replicated, the devices overflow.
  heavy = _two_blocks(tiny_params=10**10)
  costing = costing_lib.Costing(heavy, cluster)
  cap = (costing.evaluate(split, [(0, 2)]).memory +
         costing.evaluate(dataclasses.replace(split, replicate=(0,)), [(0, 2)]).memory) // 2
  planner = search_lib.Planner(heavy, cluster, 2, cap)
  assert planner.replication_gains(split)[0] == [0]   # it would still be faster
  best = planner.search().best
  assert best.candidate.tp == 2 and best.candidate.replicate == (), best.label()
  assert best.step_time > free.step_time * 0.999


def _optimizer_heavy():
  """One layer with 12 bytes of optimizer state per 2 of weights (mixed
  precision Adam), next to nothing of activations."""
  rows = [profile_lib.LayerRow("layer", 1e-2, 2e-2, 1e-3, 2 * 10**9, 12 * 10**9, 10**6, 0,
                               False)]
  return profile_lib.ModelProfile(rows, [], batch=8)


def test_offloads_only_when_nothing_fits_without():
  cluster = cluster_lib.from_preset("h100-80gb", 1)
  costing = costing_lib.Costing(_optimizer_heavy(), cluster)
  kept = costing.evaluate(space.Candidate(1, 1, 1), [(0, 1)])
  moved = costing.evaluate(space.Candidate(1, 1, 1, offload=True), [(0, 1)])
  assert moved.memory < kept.memory and moved.step_time > kept.step_time
  # Gradients to the host and weights back over PCIe, the update there.
  assert moved.update_time > 2 * 2e9 / costing_lib.HOST_LINK.bandwidth
  plan, _ = plan_lib.plan_profile(_optimizer_heavy(), 1, 10**15, cluster, memory_reserve=0)
  assert plan.offload is None
  cap = (kept.memory + moved.memory) // 2
  plan, result = plan_lib.plan_profile(_optimizer_heavy(), 1, cap, cluster,
                                       memory_reserve=0)
  assert plan.offload == "optimizer" and plan.options()["offload"] == "optimizer"
  assert plan_json.from_json(plan.to_json()).offload == "optimizer"
  best = search_lib.Planner(_optimizer_heavy(), cluster, 1, cap).exhaustive()
  assert best.candidate.offload and result.best.step_time == pytest.approx(best.step_time)
  # CPU devices have no host apart from themselves: never offloaded.
  cpu = cluster_lib.from_preset("cpu-host", 1)
  assert not costing_lib.Costing(_optimizer_heavy(), cpu).can_offload


def test_min_max_cut_agrees_with_the_stage_balancer():
  rng = random.Random(5)
  for _ in range(20):
    n = rng.randint(3, 12)
    costs = [rng.uniform(1, 10) for _ in range(n)]
    cuts = [rng.uniform(0, 2) for _ in range(n - 1)]
    stages = rng.randint(1, n)
    matrix = search_lib._chunk_cost_matrix(np.array(costs), np.array(cuts), n)  # pylint: disable=protected-access
    mine = search_lib.min_max_cut(matrix, stages)
    theirs = partition.balanced_partition(costs, stages, cuts)
    worst = lambda ranges: max(matrix[j, i] for j, i in ranges)  # pylint: disable=unnecessary-lambda-assignment
    assert worst(mine) == pytest.approx(worst(theirs))


def test_interleaved_and_gpipe_follow_the_pipeline_formulas():
  # Equal layers, no communication: the analytic times are the simulator's
  # uniform-stage bubbles.
  rows = [profile_lib.LayerRow(f"l{i}", 1.0, 2.0, 0.0, 4, 8, 100, 0, False)
          for i in range(8)]
  profile = profile_lib.ModelProfile(rows, [0] * 7, batch=8)
  costing = costing_lib.Costing(profile, cluster_lib.from_preset("h100-80gb", 4))
  est = costing.evaluate(space.Candidate(1, 1, 4, 8, "1f1b"), space.even_ranges(8, 4))
  per_stage = 2 * 3.0 / 8            # 2 layers, one micro-batch of 8
  assert est.pipeline_time == pytest.approx((8 + 3) * per_stage)
  assert est.bubble == pytest.approx(3 / 11)
  inter = costing.evaluate(space.Candidate(1, 1, 4, 8, "interleaved", 2),
                           space.even_ranges(8, 8))
  assert inter.pipeline_time == pytest.approx((8 + 3 / 2) * per_stage)
  gpipe = costing.evaluate(space.Candidate(1, 1, 4, 8, "gpipe"), space.even_ranges(8, 4))
  # gpipe keeps all 8 micro-batches on every stage, 1f1b at most S - s.
  act = 2 * 100 / 8
  assert gpipe.stage_memory[3] - est.stage_memory[3] == pytest.approx(7 * act, abs=1)
  assert est.stage_memory[0] - est.stage_memory[3] == pytest.approx(3 * act, abs=1)


def test_a_step_pays_its_launch_once_and_each_further_stage_its_cost():
  # One launch per step; each further pipeline stage what calibration
  # measured it adds (stage_overhead), or, with a table from before that
  # was measured, another launch. Data and tensor parallelism: no stage.
  rows = [profile_lib.LayerRow(f"l{i}", 1.0, 2.0, 0.0, 4, 8, 100, 0, True)
          for i in range(8)]
  cluster = cluster_lib.from_preset("h100-80gb", 4)

  def step(candidate, launch, stage):
    profile = profile_lib.ModelProfile(rows, [0] * 7, batch=8, step_overhead=launch,
                                       stage_overhead=stage)
    return costing_lib.Costing(profile, cluster).evaluate(
        candidate, space.even_ranges(8, candidate.chunks)).step_time

  for candidate, stages in ((space.Candidate(1, 1, 4, 8, "1f1b"), 4),
                            (space.Candidate(1, 1, 2, 2, "gpipe"), 2),
                            (space.Candidate(1, 1, 2, 4, "interleaved", 2), 2),
                            (space.Candidate(4, 1, 1, 1), 1),
                            (space.Candidate(2, 2, 1, 1), 1)):
    bare = step(candidate, 0.0, 0.0)
    assert step(candidate, 1e-3, 2e-4) - bare == pytest.approx(1e-3 + (stages - 1) * 2e-4)
    assert step(candidate, 1e-3, None) - bare == pytest.approx(stages * 1e-3)


def test_zero_and_recompute_lower_memory_as_modelled():
  profile = _profile("gpt_raw", "h100-80gb", 4)
  costing = costing_lib.Costing(profile, plan_lib.cluster_for("h100-80gb", 4))
  whole = [(0, costing.n)]
  plain = costing.evaluate(space.Candidate(4, 1, 1), whole)
  zero = costing.evaluate(space.Candidate(4, 1, 1, zero=1), whole)
  rc = costing.evaluate(space.Candidate(4, 1, 1, recompute="blocks"), whole)
  slots = sum(r.slots for r in profile.layers)
  assert plain.memory - zero.memory == pytest.approx(slots * 3 / 4, abs=2)
  assert rc.memory < plain.memory and rc.step_time > plain.step_time


def test_bucket_size_is_the_rewrite_default():
  from tfsplit.passes.config import SplitConfig  # pylint: disable=import-outside-toplevel
  assert costing_lib.DEFAULT_BUCKET_BYTES == SplitConfig.bucket_bytes == 25 * 2**20


def test_large_synthetic_gpt_plans_fast():
  profile = profile_lib.synthetic_gpt(blocks=96)
  plan, result = plan_lib.plan_profile(profile, 64, "80GB", "h100-80gb")
  assert result.seconds < 10  # 2 s on a quiet machine (tools/bench_planner.py)
  assert result.best.memory <= 80e9
  assert plan.devices == 64 and len(plan.layers) == 98
  # A 175B model on 64 80 GB devices needs model parallelism.
  assert result.best.candidate.tp * result.best.candidate.pp > 1


# --- plans that fit, applied, train exactly ---------------------------------------------
def _fitting_cap(name, fraction, devices=4, cluster="h100-80gb"):
  """A cap whose part left to plans (the default reserve kept free) is
  `fraction` of what plain data parallelism needs."""
  need = fraction * _plain_dp_memory(_profile(name, cluster, devices), cluster, devices)
  return search_lib.memory_needed(int(need), plan_lib.DEFAULT_RESERVE)


def _usable(cap):
  return search_lib.usable_memory(cap, plan_lib.DEFAULT_RESERVE)


@pytest.mark.parametrize("name", ["gpt_raw", pytest.param("gpt_keras3", marks=pytest.mark.slow),
                                  pytest.param("gpt_tfkeras", marks=pytest.mark.slow)])
def test_split_plan_auto_fits_the_cap_and_trains_exactly(name):
  # Half of plain data parallelism's memory: on the tiny GPTs, 2 pipeline
  # stages over 2-way tensor parallelism, 2 micro-batches (and the first
  # stage's block recomputed on the Keras models).
  cap = _fitting_cap(name, 0.5)
  step = check_training(example(name), steps=2, plan="auto", devices=4, device_memory=cap,
                        hardware="h100-80gb")
  plan = step.plan
  assert plan.predicted["per_device_memory"] <= _usable(cap)
  assert plan.memory_reserve == plan_lib.DEFAULT_RESERVE
  assert plan.mesh != "dp=4" or plan.zero or plan.recompute != "none"
  assert plan.layer_ranges and plan.microbatches > 1  # a pipeline, as this cap needs
  assert str(step.mesh) == plan.mesh
  assert step.result.config.microbatches == plan.microbatches
  assert step.result.config.zero == plan.zero


def test_split_plan_auto_defaults_to_this_process_devices():
  step = check_training(example("mlp_raw"), plan="auto")
  assert step.plan.devices == 4 and step.mesh.size == 4
  assert step.plan.cluster == "cpu-host x4"
  assert step.plan.predicted["step_time"] > 0
  # This process's logical CPUs are one host: tensor parallelism is tried
  # among them (the cpu-host preset alone is one server per device).
  profile = _profile("mlp_raw", "cpu-host", 4)
  for cluster, tps in ((plan_lib.local_cluster(4), {1, 2, 4}),
                       (plan_lib.cluster_for("cpu-host", 4), {1})):
    assert {tp for _, tp, _, _ in search_lib.Planner(profile, cluster, 4).meshes()} == tps


def test_plan_rewrite_verify_on_files(tmp_path, capsys):
  # 55% of plain data parallelism's memory: on the tiny tf_keras GPT, 2 stages
  # over 2 replicas with ZeRO, 2 micro-batches, and the first stage (which
  # 1f1b gives the most micro-batches to keep) recomputing its block. (The
  # zero-bubble schedules keep as many on every stage: all stages would
  # recompute, so they are left out here.)
  cap = _fitting_cap("gpt_tfkeras", 0.55)
  graph = _graph("gpt_tfkeras")
  plan_path, out = tmp_path / "plan.json", tmp_path / "out.pb"
  code, text, err = _cli(["plan", graph, "--devices", 4, "--device-memory", cap,
                          "--cluster", "h100-80gb", "--schedules", "1f1b,gpipe,interleaved",
                          "-o", plan_path], capsys)
  assert code == 0, err
  plan = plan_lib.read(str(plan_path))
  assert plan.devices == 4 and plan.predicted["per_device_memory"] <= _usable(cap)
  assert f"{format_bytes(cap)} each (10% kept in reserve: plans fit " \
         f"{format_bytes(_usable(cap))})" in text
  assert f"over the {format_bytes(_usable(cap))} plans may use" in text  # why plain dp lost
  assert text.splitlines()[4].split()[1] == plan.mesh.split()[0]  # rank 1 is the plan
  assert plan.recompute == ["gpt/block_0"] and plan.layer_ranges == [(0, 2), (2, 5)]
  assert plan.zero == 1 and plan.microbatches == 2
  code, text, err = _cli(["rewrite", graph, "--plan", plan_path, "-o", out], capsys)
  assert code == 0, err
  assert f"over mesh {plan.mesh}" in text
  assert "recompute" in text and "gpt/block_0" in text
  report = tfsplit.verify(graph, str(out), str(out)[:-3] + ".manifest.json", steps=2)
  assert report.ok, report.table()


def _hand_plan(devices, mesh, **fields):
  """A Plan of the tiny raw GPT written by hand."""
  layers = plan_lib.model_layer_names(load_graph(_graph("gpt_raw")))
  return plan_lib.Plan(devices=devices, layers=layers, mesh=mesh, **fields)


def _replicating_options():
  """tp=2 with gpt/block_0 whole on both devices and gpt/block_1 split."""
  return _hand_plan(2, "tp=2", replicate=["gpt/block_0"]).options(
      load_graph(_graph("gpt_raw")))


def test_plan_replicating_one_block_trains_exactly():
  # split(plan=) turns the plan's replicated blocks into annotations, which
  # keep the megatron preset off block_0 only.
  plan = _hand_plan(2, "tp=2", replicate=["gpt/block_0"])
  step = check_training(example("gpt_raw"), steps=2, plan=plan)
  sharding = {name: e["sharding"] for name, e in step.manifest.items()}
  assert not any(sharding["gpt/block_0/mlp/fc1/kernel"])
  assert any(sharding["gpt/block_1/mlp/fc1/kernel"])
  assert step.result.count("all_reduce") == 4   # block_1's only (8 with both split)


@pytest.mark.slow
def test_a_stray_replica_of_a_replicated_block_fails_the_comparison():
  # The replica of block_0 on the second device, changed before training:
  # its forward feeds block_1's all-reduces, so the losses diverge.
  ex = example("gpt_raw")
  broken = tfsplit.split(ex.train_step, input_signature=ex.train_signature,
                         variable_names=names(ex), **_replicating_options())
  shard = broken.manifest["gpt/block_0/mlp/fc1/kernel"]["shards"][1]
  var = broken.variables[shard["name"]]
  var.assign(var.numpy() * 1.5)
  report, _ = training_report(broken, ex, ex.make_inputs("train", seed=11), 3)
  assert not report.ok
  assert any(c.kind == "output" for c in report.failures), report.table()


def test_rewrite_plan_honours_replicated_blocks_and_offload(tmp_path, capsys):
  plan = _hand_plan(2, "tp=2", replicate=["gpt/block_1"], offload="optimizer")
  path, out = tmp_path / "plan.json", tmp_path / "out.pb"
  plan.save(str(path))
  # GPU device names: the host CPU:0 is apart from the mesh (as on a GPU machine).
  code, text, err = _cli(["rewrite", _graph("gpt_raw"), "--plan", path, "--devices", "gpu",
                          "-o", out], capsys)
  assert code == 0, err
  manifest = json.loads((tmp_path / "out.manifest.json").read_text())
  entries = manifest["variables"] if "variables" in manifest else manifest
  sharding = {name: e["sharding"] for name, e in entries.items()}
  assert any(sharding["gpt/block_0/mlp/fc1/kernel"])
  assert not any(sharding["gpt/block_1/mlp/fc1/kernel"])
  slots = [e for name, e in entries.items() if name.startswith("adam/gpt_block_1_")]
  assert slots and all("CPU:0" in s["device"] for e in slots for s in e["shards"])
  code, text, err = _cli(["rewrite", _graph("gpt_raw"), "--plan", path, "--devices", "gpu",
                          "--offload", "none", "-o", out], capsys)
  _one_line_error(code, text, err, "rewrite", "the plan sets --offload optimizer but --offload none")


def _offload_plan():
  """The plan for the tiny raw GPT on one device under a cap that only
  optimizer offload meets."""
  profile = _profile("gpt_raw", "h100-80gb", 1)
  cluster = plan_lib.cluster_for("h100-80gb", 1)
  without = search_lib.Planner(profile, cluster, 1, None)
  kept = without.search().smallest.memory
  costing = costing_lib.Costing(profile, cluster)
  moved = min(costing.evaluate(space.Candidate(1, 1, 1, m, recompute=rc, offload=True),
                               [(0, costing.n)]).memory
              for m in space.divisors(profile.batch) for rc in ("none", "blocks"))
  assert moved < kept
  plan, _ = plan_lib.plan_profile(profile, 1, (moved + kept) // 2, cluster, memory_reserve=0)
  return plan


@pytest.mark.slow
def test_offload_plan_trains_exactly():
  # The mesh on CPU:1, its host CPU:0 apart from it (as a GPU's host).
  from tfsplit.layout import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  plan = _offload_plan()
  assert plan.offload == "optimizer"
  options = plan.options()
  mesh = mesh_lib.Mesh.parse(options.pop("mesh"), mesh_lib.local_cpu_devices(2)[1:])
  step = check_training(example("gpt_raw"), mesh=mesh, **options)
  assert step.result.offloaded_nodes


def test_plan_simulates_the_rewritten_winner(tmp_path, capsys):
  path = tmp_path / "plan.json"
  code, text, err = _cli(["plan", _graph("mlp_raw"), "--devices", 2, "--cluster",
                          "h100-80gb", "--simulate", 1, "-o", path], capsys)
  assert code == 0, err
  assert "whole-graph simulation of the rewritten candidates:" in text
  predicted = plan_lib.read(str(path)).predicted
  assert predicted["simulated_step_time"] > 0
  # The layer-level memory model against the whole graph's simulated peak.
  assert 0.5 < predicted["per_device_memory"] / predicted["simulated_memory"] < 2


def test_plan_json_round_trip(tmp_path):
  profile = _synthetic(n=5)
  plan, result = plan_lib.plan_profile(profile, 4, "10GB", "h100-80gb")
  assert plan.replicate and plan.layer_ranges   # light blocks, pipelined to fit
  path = tmp_path / "p.json"
  plan.save(str(path))
  again = plan_lib.read(str(path))
  assert again.to_json() == json.loads(path.read_text())
  assert again == plan and again.memory_reserve == plan_lib.DEFAULT_RESERVE
  c = result.best.candidate
  assert again.mesh == c.mesh and again.microbatches == c.microbatches
  assert again.layer_ranges == (result.best.ranges if c.pp > 1 else None)


# --- bad input: one line, exit code 2, no output -----------------------------------------
def test_model_that_fits_nowhere_names_the_smallest_memory(tmp_path, capsys):
  out = tmp_path / "plan.json"
  code, text, err = _cli(["plan", _graph("gpt_raw"), "--devices", 2, "--device-memory",
                          "1KB", "--cluster", "h100-80gb", "-o", out], capsys)
  _one_line_error(code, text, err, "plan", "fits under no plan on 2 devices with 1 KB each",
                  "smallest per-device memory that works is")
  assert not out.exists()
  assert "(10% kept in reserve)" in err
  profile = _profile("gpt_raw", "h100-80gb", 2)
  # What the message names: the smallest plan found under the cap, and the
  # reserve beside it (the least memory whose usable part holds that plan).
  need = search_lib.Planner(profile, plan_lib.cluster_for("h100-80gb", 2), 2, 1000).search()
  smallest = search_lib.memory_needed(need.smallest.memory, plan_lib.DEFAULT_RESERVE)
  assert f"works is {format_bytes(smallest)} ({format_bytes(need.smallest.memory)} planned " \
         "+ 10% reserve" in err
  assert search_lib.usable_memory(smallest, plan_lib.DEFAULT_RESERVE) >= \
      need.smallest.memory > search_lib.usable_memory(smallest - 1, plan_lib.DEFAULT_RESERVE)
  plan, _ = plan_lib.plan_profile(profile, 2, smallest, "h100-80gb")  # it works
  assert plan.predicted["per_device_memory"] <= need.smallest.memory
  with pytest.raises(PlanError, match=r"with 1 KB each \(10% kept in reserve\); the "
                     rf"smallest per-device memory that works is {format_bytes(smallest)}"):
    plan_lib.plan_profile(profile, 2, 1000, "h100-80gb")
  # Without a reserve a plan may take all of the memory.
  with pytest.raises(PlanError, match="works is " + format_bytes(need.smallest.memory)):
    plan_lib.plan_profile(profile, 2, 1000, "h100-80gb", memory_reserve=0)
  plan_lib.plan_profile(profile, 2, need.smallest.memory, "h100-80gb", memory_reserve=0)


@pytest.mark.parametrize("args,needles", [
    (["--devices", 0], ["too few devices"]),
    ([], ["missing --devices"]),
    (["--devices", 4, "--cluster", "no-such-preset"], ["no-such-preset"]),
    (["--devices", 4, "--device-memory", "lots"], ["cannot read size 'lots'"]),
    (["--devices", 16], ["no mesh over 16 devices suits the model", "batch of 4"]),
    (["--devices", 2, "--memory-reserve", 1], ["memory reserve", "in [0, 1)"]),
])
def test_plan_flags_errors(args, needles, tmp_path, capsys):
  out = tmp_path / "plan.json"
  code, text, err = _cli(["plan", _graph("mlp_raw")] + args + ["-o", out], capsys)
  _one_line_error(code, text, err, "plan", *needles)
  assert not out.exists()


def _write_plan(tmp_path, **changes):
  plan, _ = plan_lib.plan_graph(load_graph(_graph("gpt_raw")), 4, cluster="h100-80gb")
  obj = dict(plan.to_json(), **changes)
  path = tmp_path / "plan.json"
  path.write_text(json.dumps(obj) if changes.get("_raw") is None else changes["_raw"])
  return path


@pytest.mark.parametrize("changes,needles", [
    ({"_raw": "{not json"}, ["cannot read plan", "JSON"]),
    ({"format": "other"}, ["is not a tfsplit plan"]),
    ({"devices": 8, "mesh": "dp=4"}, ["mesh dp=4 has 4 devices but the plan says devices=8"]),
    ({"mesh": "pp=2,dp=2", "layer_ranges": [[0, 2], [3, 5]]}, ["must be contiguous"]),
    ({"mesh": "pp=2,dp=2", "layer_ranges": None}, ["no 'layer_ranges'"]),
    ({"microbatches": "4"}, ["field 'microbatches' must be an integer"]),
    ({"mesh": "xp=4"}, ["has axis 'xp'; plans use pp, dp, ep and tp"]),
    ({"recompute": ["gpt/block_9"]}, ["lists 'gpt/block_9', not one of the plan's layers"]),
    ({"recompute": "sometimes"}, ["field 'recompute' is 'sometimes'"]),
    ({"version": 7}, ["version 7 is not supported"]),
    ({"schedule": "zigzag"}, ["field 'schedule' is 'zigzag'"]),
    ({"layers": ["gpt/embed", "gpt/block_0", "gpt/block_9", "gpt/ln_f", "gpt/head"],
      "replicate": []}, ["layer 'gpt/block_9' of the plan is not in"]),
    ({"replicate": ["gpt/block_9"]}, ["field 'replicate' lists \"gpt/block_9\""]),
    ({"offload": "activations"}, ["field 'offload' is 'activations'"]),
    ({"memory_reserve": 1.5}, ["field 'memory_reserve'", "in [0, 1)"]),
    ({"mesh": None}, ["missing field 'mesh'"]),
    ({"mesh": "dp=x"}, ["field 'mesh': cannot read mesh 'dp=x'"]),
])
def test_rewrite_refuses_a_bad_plan(changes, needles, tmp_path, capsys):
  path = _write_plan(tmp_path, **changes)
  out = tmp_path / "out.pb"
  code, text, err = _cli(["rewrite", _graph("gpt_raw"), "--plan", path, "-o", out], capsys)
  _one_line_error(code, text, err, "rewrite", *needles)
  assert err.count(str(path)) <= 1, err   # the plan is named once
  assert not out.exists()


def test_rewrite_refuses_a_plan_of_another_graph_and_mixed_flags(tmp_path, capsys):
  path = tmp_path / "mlp.json"
  assert _cli(["plan", _graph("mlp_raw"), "--devices", 2, "-o", path], capsys)[0] == 0
  out = tmp_path / "out.pb"
  code, text, err = _cli(["rewrite", _graph("gpt_raw"), "--plan", path, "-o", out], capsys)
  _one_line_error(code, text, err, "rewrite", "plan does not match", "layer 'mlp/layer_0'")
  code, text, err = _cli(["rewrite", _graph("mlp_raw"), "--plan", path, "--mesh", "tp=2",
                          "-o", out], capsys)
  _one_line_error(code, text, err, "rewrite", "the plan sets --mesh dp=2 but --mesh tp=2")
  code, text, err = _cli(["rewrite", _graph("mlp_raw"), "--plan", tmp_path / "none.json",
                          "-o", out], capsys)
  _one_line_error(code, text, err, "rewrite", "does not exist")
  assert not out.exists()


def test_split_refuses_a_plan_for_more_devices_than_there_are(tmp_path):
  ex = example("gpt_raw")
  plan, _ = plan_lib.plan_graph(load_graph(_graph("gpt_raw")), 8, cluster="h100-80gb")
  with pytest.raises(PlanError, match="the plan is for 8 devices but 4 are available"):
    plan_lib.resolve(plan, load_graph(_graph("gpt_raw")), available=4)
  with pytest.raises(PlanError, match="too few devices: planning for 8 but 4"):
    tfsplit.split(ex.train_step, plan="auto", devices=8, input_signature=ex.train_signature)
  with pytest.raises(PlanError, match="plan is for 8 devices but devices=4"):
    plan_lib.resolve(plan, load_graph(_graph("gpt_raw")), devices=4)


def test_per_op_overhead_does_not_shrink_with_the_micro_batch():
  rows = [profile_lib.LayerRow("l0", 4.0, 8.0, 0.0, 4, 8, 100, 0, False,
                               forward_fixed=1.0, backward_fixed=2.0)]
  costing = costing_lib.Costing(profile_lib.ModelProfile(rows, [], batch=8),
                          cluster_lib.from_preset("h100-80gb", 1))
  one = costing.evaluate(space.Candidate(1, 1, 1, 1), [(0, 1)])
  four = costing.evaluate(space.Candidate(1, 1, 1, 4), [(0, 1)])
  assert one.pipeline_time == pytest.approx(12 + 3)
  assert four.pipeline_time == pytest.approx(4 * (12 / 4 + 3))


def test_groups_collectives_at_the_same_moments_add_their_measured_share():
  # On logical devices sharing cores, a dp=2,tp=2 split's two tensor-parallel
  # pairs all-reduce at the same moments (and so do its two data-parallel
  # pairs): each moment costs one pair's collective plus `overlap` of one per
  # further pair. Two blocks of 2 all-reduces each, one gradient bucket and
  # the loss: 4 tp moments and 2 dp moments of 1 ms, the second pair's at
  # 0.25 of that; one group (dp=4, tp=2) is priced as before.
  rows = [profile_lib.LayerRow(f"b{i}", 1e-6, 2e-6, 1e-7, 64, 128, 64, 64, True,
                               tp_collectives=2) for i in range(2)]
  cluster = cluster_lib.from_preset("cpu-host", 4, devices_per_host=4)

  def step(candidate, overlap):
    profile = profile_lib.ModelProfile(rows, [64], batch=8, concurrency=1.0,
                                       collective_overhead=1e-3, collective_at={4: 3e-3},
                                       collective_overlap=overlap)
    return costing_lib.Costing(profile, cluster).evaluate(candidate, [(0, 2)]).step_time

  both = space.Candidate(2, 2, 1, 1)
  assert step(both, 1.0) - step(both, 0.25) == pytest.approx((4 + 2) * 1e-3 * 0.75, rel=1e-6)
  assert step(both, 0.0) - step(both, 0.25) == pytest.approx(-(4 + 2) * 1e-3 * 0.25, rel=1e-6)
  for alone in (space.Candidate(4, 1, 1, 1), space.Candidate(1, 2, 1, 1)):
    assert step(alone, 1.0) == step(alone, 0.25)


def test_logical_cpus_overlap_ops_work_and_their_gaps_apart():
  # On logical CPUs sharing cores, a step's per-op gaps (op_gap a call,
  # inside the fixed parts) overlap at the gaps' concurrency and the rest
  # of the work at the kernels'. One layer of 100 forward and 200 backward
  # ops (1 us gap each) and 50 update ops: dp=2 runs 2 x (300 + 50) gaps.
  rows = [profile_lib.LayerRow("l0", 2e-3, 4e-3, 1e-3, 64, 128, 64, 0, False,
                               forward_fixed=1e-4, backward_fixed=2e-4, update_fixed=5e-5,
                               forward_ops=100, backward_ops=200, update_ops=50)]
  cluster = cluster_lib.from_preset("cpu-host", 4, devices_per_host=4)
  base = dict(batch=8, concurrency=1.4, op_gap=1e-6)
  dp2 = space.Candidate(2, 1, 1, 1)

  def host_time(**extra):
    profile = profile_lib.ModelProfile(rows, [], **base, **extra)
    return costing_lib.Costing(profile, cluster).shared_host_time(dp2, [(0, 1)], [False])

  work = 2 * ((2e-3 + 4e-3) / 2 + 1e-4 + 2e-4 + 1e-3)
  gaps = 2 * 350 * 1e-6
  assert host_time() == pytest.approx(work / 1.4)   # one concurrency for all
  split = host_time(kernel_concurrency={2: 1.25}, gap_concurrency={2: 2.0})
  assert split == pytest.approx((work - gaps) / 1.25 + gaps / 2.0)
  # Without gaps (op_gap 0) the split does not apply.
  assert profile_lib.ModelProfile(rows, [], batch=8, concurrency=1.4,
                                  gap_concurrency={2: 2.0}).kernel_and_gap_concurrency(2) is None


def test_pipeline_stages_on_shared_cores_update_and_overlap_at_the_concurrency():
  # On logical CPUs a pipeline's stages share the cores: all stages update
  # their weights at the same moment (the update is at least every
  # device's update over the concurrency of that many devices, not the
  # largest stage's), and the stages of the steady state slow each other
  # ((m - 1) max c at min(S, m) devices' concurrency); fill and drain run
  # one stage at a time, and the schedule's bubble does not change.
  rows = [profile_lib.LayerRow(f"l{i}", 1e-3, 2e-3, 4e-3, 64, 128, 64, 0, False)
          for i in range(4)]
  cluster = cluster_lib.from_preset("cpu-host", 4, devices_per_host=4)
  cut = [(i, i + 1) for i in range(4)]

  def priced(candidate, **extra):
    profile = profile_lib.ModelProfile(rows, [0] * 3, batch=8, **extra)
    return costing_lib.Costing(profile, cluster).evaluate(candidate, cut)

  pp4 = space.Candidate(1, 1, 4, 1)
  apart, shared = priced(pp4), priced(pp4, concurrency=1.6, concurrency_at={4: 2.0})
  assert apart.update_time == pytest.approx(4e-3)              # devices of their own
  assert shared.update_time == pytest.approx(4 * 4e-3 / 2.0)   # 4 devices at 2.0
  assert shared.pipeline_time == pytest.approx(apart.pipeline_time)   # m = 1: no overlap
  pp2 = space.Candidate(1, 1, 2, 4)
  cut2 = [(0, 2), (2, 4)]
  profile = profile_lib.ModelProfile(rows, [0] * 3, batch=8, concurrency=1.6)
  est = costing_lib.Costing(profile, cluster).evaluate(pp2, cut2)
  stage = 2 * (1e-3 + 2e-3) / 4
  assert est.pipeline_time == pytest.approx(3 * stage * 2 / 1.6 + 2 * stage)
  plain = costing_lib.Costing(profile_lib.ModelProfile(rows, [0] * 3, batch=8), cluster)
  assert est.bubble == pytest.approx(plain.evaluate(pp2, cut2).bubble)


def test_cluster_spec_with_too_few_devices_is_one_line(tmp_path, capsys):
  spec = tmp_path / "two.json"
  cluster_lib.from_preset("a100-40gb", 2).save(str(spec))
  code, text, err = _cli(["plan", _graph("mlp_raw"), "--devices", 4, "--cluster", spec],
                         capsys)
  _one_line_error(code, text, err, "plan", "has 2 devices", "4")
  spec.write_text('{"hosts": [], "devices": [{"name": "d0", "host": "nowhere"}]}')
  code, text, err = _cli(["plan", _graph("mlp_raw"), "--devices", 1, "--cluster", spec],
                         capsys)
  _one_line_error(code, text, err, "plan", "device 'd0'")


def test_calibration_table_overheads_enter_the_profile(tmp_path, capsys):
  from tfsplit.cost import op_cost  # pylint: disable=import-outside-toplevel
  table = tmp_path / "table.json"
  op_cost.CostTable(op_overhead=1e-5, step_overhead=1e-3, stage_overhead=2e-4, flops=1e11,
                    bandwidth=1e10).save(str(table))
  graph_def = load_graph(_graph("mlp_raw"))
  profile = plan_lib.profile_graph(graph_def, 2, "h100-80gb", str(table))
  assert (profile.step_overhead, profile.stage_overhead) == (1e-3, 2e-4)
  assert all(r.forward_fixed > 0 and r.backward_fixed > 0 for r in profile.layers)
  # Per-op overhead is paid per micro-batch: more micro-batches cost time.
  costing = costing_lib.Costing(profile, plan_lib.cluster_for("h100-80gb", 2))
  one, two = (costing.evaluate(space.Candidate(2, 1, 1, m), [(0, costing.n)])
              for m in (1, 2))
  fixed = sum(r.forward_fixed + r.backward_fixed for r in profile.layers)
  assert two.pipeline_time - one.pipeline_time == pytest.approx(fixed, rel=1e-6)
  assert one.step_time > 1e-3
  code, text, err = _cli(["plan", _graph("mlp_raw"), "--devices", 2, "--cluster",
                          "h100-80gb", "--calibration", table], capsys)
  assert code == 0, err
  assert " m=1 " in text.splitlines()[4]  # overheads make extra micro-batches cost


def test_long_searches_show_progress(monkeypatch, capsys):
  from tfsplit.commands import plan_cmd  # pylint: disable=import-outside-toplevel
  clock = iter([0.0, 0.5, 2.0, 2.1, 3.0])
  monkeypatch.setattr(plan_cmd.time, "perf_counter", lambda: next(clock))
  report = plan_cmd._progress()  # pylint: disable=protected-access
  for done in range(1, 5):  # at 0.5 s: quiet; 2.0 s: shown; 2.1 s: too soon; 3.0 s: done
    report(done, 4)
  assert capsys.readouterr().err.splitlines() == ["planning: 2/4 meshes",
                                                  "planning: 4/4 meshes"]


def test_tensor_parallel_sizes_divide_the_heads():
  # Keras kernels are [hidden, heads, head size]: the 4 heads of the tiny GPT
  # cap tp at 4, which `rewrite` would refuse above.
  for name, most in (("gpt_keras3", 4), ("gpt_tfkeras", 4), ("gpt_raw", 32)):
    profile = _profile(name, "h100-80gb", 8)
    assert profile.max_tp == most
    tps = {tp for _, tp, _, _ in space.meshes(8, profile)}
    assert max(tps) == min(8, most)


def _tp_all_reduces(graph_def):
  """(the profile's tensor-parallel all-reduces per step, those the
  planner prices for tp=2 (of the layers it splits), those the tp=2
  rewrite emits on one device)."""
  from tfsplit.passes import split_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.layout.mesh import Mesh  # pylint: disable=import-outside-toplevel
  profile = plan_lib.profile_graph(graph_def, 2, "h100-80gb")
  costing = search_lib.Planner(profile, cluster_lib.from_preset("h100-80gb", 2), 2).costing
  split_layers = costing.tp_split(space.Candidate(1, 2, 1))
  split = split_graph(graph_def, Mesh({"tp": 2}))
  emitted = [n.device for n in split.graph_def.node if n.op == "CollectiveReduceV2"]
  return (sum(r.tp_collectives for r in profile.layers),
          sum(r.tp_collectives for r, s in zip(profile.layers, split_layers) if s),
          emitted.count(emitted[0]) if emitted else 0)


@pytest.mark.parametrize("name", ["gpt_keras3", "mlp_raw", "mlp_raw_train_small"])
def test_tensor_parallel_all_reduces_are_those_the_rewrite_emits(name):
  # A block's Q, K and V read one tensor: one all-reduce of its gradient,
  # not one per weight matrix (4 per block, 2 blocks). The MLP's pair starts
  # at the batch, which has no gradient: its output's all-reduce alone. The
  # planner prices them all: the small MLP's first and last layers are no
  # repeated blocks, but the preset splits them (two pairs: 3 all-reduces).
  path = (os.path.join(_ROOT, "examples", name + ".pb") if name.endswith("small")
          else _graph(name))
  counted, priced, emitted = _tp_all_reduces(load_graph(path))
  assert counted == priced == emitted == {"gpt_keras3": 8, "mlp_raw": 1,
                                          "mlp_raw_train_small": 3}[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert_tfkeras", "llama_keras3", "vit_keras3"])
def test_tensor_parallel_all_reduces_of_the_corpus(name):
  # A post-norm block (BERT) reads its input in Q, K, V and the residual:
  # each of the three gradients is all-reduced before the residual's adds.
  from tfsplit.graph import load_graph as load  # pylint: disable=import-outside-toplevel
  ex = example(name)
  graph_def = load(ex.concrete("train"), variable_names=names(ex))
  counted, priced, emitted = _tp_all_reduces(graph_def)
  assert counted == priced == emitted > 0


def test_plan_json_format_is_the_plan_file(tmp_path, capsys):
  path = tmp_path / "plan.json"
  code, text, err = _cli(["plan", _graph("mlp_raw"), "--devices", 2, "--format", "json",
                          "-o", path], capsys)
  assert code == 0, err
  printed = json.loads(text)
  assert printed.pop("search")["evaluated"] > 0
  assert printed == json.loads(path.read_text())
  assert printed["layers"] == ["mlp/layer_0", "mlp/layer_1", "mlp/layer_2"]


# --- the objective against measured steps ------------------------------------------------
@pytest.mark.slow
def test_predicted_step_time_within_25_percent_of_measured_on_logical_cpus():
  # In fresh processes (each its own runtime, 4 logical CPUs, and its own
  # calibration), costs from the micro-benchmarks alone: the fastest of
  # interleaved rounds of steps of each split against the planner's price
  # for it, at the machine's level while the steps ran (the calibration's
  # small training steps, timed in the same rounds, against their
  # calibrated times: the median of the six ratios).
  # A step's time moves by up to a tenth between processes (one step up,
  # another down): the median over three processes counts.
  import benchlib  # pylint: disable=import-outside-toplevel
  meshes = ["dp=2", "tp=2", "pp=2 m=2"]
  rows = benchlib.run_script(
      os.path.join(_ROOT, "tools", "bench_planner.py"),
      ["--measure", "gpt_raw:small", "--meshes", ";".join(meshes), "--top", "0",
       "--rounds", "5", "--steps", "10", "--processes", "3", "--measure_only"],
      timeout=1800)
  got = {(r["mesh"], r["microbatches"]): r for r in rows}
  for text in meshes:
    mesh, _, m = text.partition(" m=")
    r = got[(mesh, int(m or 1))]
    assert len(r["ratios"]) == 3 and r["ratio"] == pytest.approx(1.0, rel=0.25), r


def test_measure_spec_divides_the_batch():
  # 'name:size/d' is the model on 1/d of its batch (a dp=d replica's share,
  # timed whole beside the split); a divisor that does not divide the
  # batch is one line naming the spec.
  import benchlib  # pylint: disable=import-outside-toplevel
  from tensorflow.core.framework import types_pb2  # pylint: disable=import-outside-toplevel
  from tfsplit.errors import TfsplitError  # pylint: disable=import-outside-toplevel
  batches = {}
  for text in ("mlp_raw:tiny", "mlp_raw:tiny/2"):
    ex, graph_def, names = benchlib.example_model(text)
    feeds = [n for n in graph_def.node if n.op == "Placeholder" and
             n.attr["dtype"].type == types_pb2.DT_FLOAT and
             len(n.attr["shape"].shape.dim) == 2 and
             n.attr["shape"].shape.dim[1].size == ex.config.in_dim]
    batches[text] = (ex.config.batch, {f.attr["shape"].shape.dim[0].size for f in feeds})
    assert len(names) == len(ex.all_variables())
  assert batches == {"mlp_raw:tiny": (4, {4}), "mlp_raw:tiny/2": (2, {2})}
  for text in ("mlp_raw:tiny/3", "mlp_raw:tiny/0", "mlp_raw:tiny/x"):
    with pytest.raises(TfsplitError, match="batch .4. is divided") as err:
      benchlib.example_model(text)
    assert str(err.value).startswith(text + ":")


def test_reprice_planner_prices_measured_plans_again_from_their_tables(tmp_path):
  # tools/reprice_planner.py judges a pricing change on timings already
  # taken: each measured plan priced again from its run's own table, at the
  # level it was measured at. Three runs of two plans: the same log with a
  # table whose collectives cost 10x, and a log at twice the level.
  import benchlib  # pylint: disable=import-outside-toplevel
  from tfsplit.cost import op_cost  # pylint: disable=import-outside-toplevel
  cheap, dear = str(tmp_path / "cheap.json"), str(tmp_path / "dear.json")
  op_cost.CostTable(concurrency=1.3, collective_overhead=1e-4, step_overhead=5e-5).save(cheap)
  op_cost.CostTable(concurrency=1.3, collective_overhead=1e-3, step_overhead=5e-5).save(dear)
  pp = space.Candidate(1, 1, 2, 2)
  rows = [{"model": "mlp_raw:small", "plan": "tp=2 m=1", "mesh": "tp=2", "microbatches": 1,
           "measured": 1e-3, "level": 1.1, "ratio": 0.5},
          {"model": "mlp_raw:small", "plan": "pp=2 m=2 1f1b", "mesh": "pp=2",
           "microbatches": 2, "candidate": dataclasses.asdict(pp),
           "measured": 1e-3, "level": 1.1, "ratio": 0.5}]
  logs = []
  for level in (1.1, 2.2):
    logs.append(str(tmp_path / f"run{level}.log"))
    with open(logs[-1], "w", encoding="utf-8") as f:
      f.write("predicted vs measured ...\n" + benchlib.RESULT_MARK +
              json.dumps([dict(r, level=level) for r in rows]) + "\n")
  out = benchlib.run_script(os.path.join(_ROOT, "tools", "reprice_planner.py"),
                            ["--json", f"{cheap}={logs[0]}", f"{dear}={logs[0]}",
                             f"{cheap}={logs[1]}"], timeout=600)
  got = {r["plan"]: r for r in out}
  for plan in ("tp=2 m=1", "pp=2 m=2 1f1b"):
    assert got[plan]["then"] == [0.5, 0.5, 0.5]
    cheap_now, dear_now, doubled = got[plan]["now"]
    assert doubled == pytest.approx(2 * cheap_now)
  # Each all-reduce of tp=2 costs 0.9 ms more (at level 1.1, over a 1 ms
  # step); the pipeline has no collective.
  tp, pipe = got["tp=2 m=1"]["now"], got["pp=2 m=2 1f1b"]["now"]
  each = 0.9e-3 * 1.1 / 1e-3
  count = round((tp[1] - tp[0]) / each)
  assert count >= 1 and tp[1] - tp[0] == pytest.approx(count * each), tp
  assert pipe[1] == pytest.approx(pipe[0]), pipe


def test_reprice_planner_bad_input_is_one_line_and_exit_2(tmp_path):
  # A log without bench_planner's result line, a row without what pricing
  # needs, an unreadable table: one line naming the file, exit 2.
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from tfsplit.cost import op_cost  # pylint: disable=import-outside-toplevel
  table, broken = str(tmp_path / "table.json"), str(tmp_path / "broken.json")
  op_cost.CostTable(concurrency=1.3).save(table)
  with open(broken, "w", encoding="utf-8") as f:
    f.write("{")
  no_result, no_keys, good = (str(tmp_path / n) for n in ("a.log", "b.log", "c.log"))
  with open(no_result, "w", encoding="utf-8") as f:
    f.write("predicted vs measured ...\n")
  with open(no_keys, "w", encoding="utf-8") as f:
    f.write('@bench-result [{"model": "mlp_raw:small"}]\n')
  with open(good, "w", encoding="utf-8") as f:
    f.write('@bench-result [{"model": "mlp_raw:small", "plan": "dp=2 m=1", "mesh": "dp=2", '
            '"microbatches": 1, "measured": 1e-3, "level": 1.0, "ratio": 1.0}]\n')
  for pair, named in ((f"{table}={no_result}", no_result), (f"{table}={no_keys}", no_keys),
                      (f"{broken}={good}", broken)):
    proc = subprocess.run([sys.executable, os.path.join(_ROOT, "tools", "reprice_planner.py"),
                           pair], capture_output=True, text=True, timeout=300, check=False)
    lines = [l for l in proc.stderr.splitlines() if l.startswith("reprice_planner:")]
    assert proc.returncode == 2 and len(lines) == 1 and named in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def _weight_heavy(n=10):
  """Layers whose weights and Adam moments (1 + 2 GB each) outweigh their
  activations: data parallelism holds 30 GB of state per device."""
  rows = [profile_lib.LayerRow(
      name=f"layer_{i}", forward=0.2, backward=0.4, update=1e-4, params=10**9,
      slots=2 * 10**9, activations=10**9, input_bytes=10**9 // 8, splittable=0 < i < n - 1)
          for i in range(n)]
  return profile_lib.ModelProfile(rows, [10**9 // 8] * (n - 1), batch=64)


def test_zero3_is_priced_and_chosen_where_only_it_fits():
  profile = _weight_heavy()
  cluster = plan_lib.cluster_for("h100-80gb", 8)
  costing = costing_lib.Costing(profile, cluster)
  whole = [(0, costing.n)]
  zero1, zero3 = (costing.evaluate(space.Candidate(8, 1, 1, zero=z), whole) for z in (1, 3))
  # Weights and their gradient sums 1/dp too (2 x 10 GB x 7/8 less), four
  # whole layers' weights held during the step (the gathers' window).
  assert zero1.memory - zero3.memory == pytest.approx(2 * 10 * 10**9 * 7 / 8 - 4 * 10**9,
                                                      abs=2)
  # A reduce-scatter and two all-gathers: 1.5x the all-reduce's time.
  assert zero3.sync_time == pytest.approx(1.5 * zero1.sync_time)
  # With micro-batches the gathers are not ordered: the whole weights stay.
  m2 = [costing.evaluate(space.Candidate(8, 1, 1, 2, zero=z), whole) for z in (1, 3)]
  assert m2[0].memory - m2[1].memory == pytest.approx(10 * 10**9 * 7 / 8 - 10 * 10**9 / 8,
                                                      abs=2)
  # Unbounded, zero=3 only adds traffic; under 11 GB only zero=3 plans fit.
  free = search_lib.Planner(profile, cluster, 8, None).search().best
  assert free.candidate.zero != 3
  result = search_lib.Planner(profile, cluster, 8, 11 * 10**9).search()
  assert result.best.candidate.zero == 3 and result.best.memory <= 11 * 10**9
  from tfsplit.plan import report  # pylint: disable=import-outside-toplevel
  lines = report.reasons(result, costing)
  assert any(line.startswith("zero=3 holds the weights 1/dp per device; the same plan "
                             "with zero=1 needs") and line.endswith("over the 11 GB cap")
             for line in lines), lines
  # The plan, and its file, carry it to the split.
  plan, _ = plan_lib.plan_profile(profile, 8, 11 * 10**9, cluster, memory_reserve=0)
  assert plan.zero == 3 and plan.options()["zero"] == 3
  assert plan_json.from_json(plan.to_json()).zero == 3
