"""Expert parallelism on the corpus mixture-of-experts decoders
(examples/models/corpus.py: `switch`, GShard capacity dispatch, and `moe`,
dense top-2 routing; Keras 3 and tf_keras; 4 and 8 experts).

Over an 'ep' axis each device holds 1/ep of every stacked expert weight
(whole experts) and of its optimizer slots; everything else is data-parallel
over dp*mb*ep. The split trains exactly (3 steps: the loss, every copy of
every parameter and slot, every update), and the tokens travel only where
GShard sends them: per capacity-dispatched layer one all-to-all to the
experts and one back, forward and backward; per dense-routed layer the
tokens gathered in once and the experts' outputs returned by one
all-to-all, forward and backward. The experts' weights never move.
"""
import collections
import json
import math
import os
import re

import numpy as np
import pytest

from tfsplit.errors import PlanError
from tfsplit.graph import load_graph
from tfsplit.layout.mesh import Mesh
from tfsplit.passes import split_graph
from tfsplit.passes.manifest import bytes_per_device
from tfsplit.plan import costing as costing_lib
from tfsplit.plan import space
from tfsplit.plan.profile import LayerRow, ModelProfile
from tfsplit.plan.search import Planner
from tfsplit.runtime.split_function import make_mesh

from _util import check_training, example, names

BATCH = 16
MODELS = ("switch_keras3", "switch_tfkeras", "moe_keras3", "moe_tfkeras")
MESHES = (("ep=2", 1), ("dp=2,ep=2", 2), ("ep=2,tp=2", 1), ("pp=2,ep=2", 2))
# In CI: the pipeline over dense routing (tf_keras) here, data and expert
# parallelism with micro-batches over capacity dispatch (Keras 3) through a
# plan file (test_an_ep_plan_file_applies_and_trains_exactly); the rest is
# slow.
_CI = {("moe_tfkeras", "pp=2,ep=2")}
CASES = [pytest.param(name, mesh, m, id=f"{name}-{mesh}-m{m}",
                      marks=() if (name, mesh) in _CI else pytest.mark.slow)
         for name in MODELS for mesh, m in MESHES]
# Token collectives over ep per MoE layer (forward and backward), no tp.
_PER_LAYER = {"switch": {"all_to_all": 4, "all_gather": 0},
              "moe": {"all_to_all": 2, "all_gather": 1}}
# Of those, the forward's (run again when the blocks are recomputed).
_FORWARD = {"switch": {"all_to_all": 2}, "moe": {"all_to_all": 1, "all_gather": 1}}

# A block's MoE layer scope (Keras 3 suffixes its scopes with _1).
_MOE_LAYER = re.compile(r"block_\d+(_\d+)?/moe(_\d+)?/")


def _graph(name, experts=None):
  ex = example(name, batch_size=BATCH, **({"experts": experts} if experts else {}))
  return ex, load_graph(ex.concrete("train"), variable_names=names(ex))


def _check_experts(result, ex, mesh, zero=0, recomputed=False):
  """Every stacked expert weight and its slots split over ep (1/ep of their
  bytes on each device; the slots also over dp under ZeRO); token
  collectives over ep only inside the MoE layers, as many as GShard's (the
  forward's twice when the blocks are recomputed); no variable moved over
  ep."""
  cfg = ex.config
  mesh_axes = make_mesh(mesh).axes
  ep = mesh_axes["ep"]
  assert len(result.experts) == 3 * cfg.blocks
  assert {e.experts for e in result.experts} == {cfg.experts}
  split = {n: e for n, e in result.manifest.items() if e["sharding"] and e["sharding"][0] == "ep"}
  # The weights and their Adam moments (two per weight), nothing else.
  assert len(split) == 3 * len(result.experts), sorted(split)
  for entry in split.values():
    assert all(s["shape"][0] == cfg.experts // ep for s in entry["shards"])
  assert set(result.manifest_dict()["experts"]) == {e.variable for e in result.experts}
  # Each expert byte once per data-parallel replica, at most 1/ep of them
  # on a device (fewer with tp inside the experts, or pipeline stages).
  held = bytes_per_device(result.manifest, set(split))
  whole = sum(4 * int(np.prod(e["shape"])) for e in split.values())
  weights = {e.variable for e in result.experts}
  dp = mesh_axes.get("dp", 1)
  copies = sum(4 * int(np.prod(e["shape"])) * (dp if n in weights or not zero else 1)
               for n, e in split.items())
  assert sum(held.values()) == copies, (held, whole)
  assert max(held.values()) * ep * mesh_axes.get("tp", 1) <= whole, (held, whole)
  ep_moves = [c for c in result.collectives
              if c.axis == "ep" and c.kind in ("all_to_all", "all_gather")]
  assert not [c for c in ep_moves if "ReadVariableOp" in c.tensor], ep_moves
  # All-to-alls only in the MoE layers; outside them only tf_keras's sparse
  # Adam gathers the token ids for its Unique (variable-free, as under dp).
  inside = [c for c in ep_moves if _MOE_LAYER.search(c.tensor + " " + c.consumer)]
  outside = [c for c in ep_moves if c not in inside]
  assert all(c.kind == "all_gather" and "embedding" in c.tensor for c in outside), outside
  if "tp" not in mesh:  # with tp, a partial expert output may travel once per reader
    per_kind = collections.Counter(c.kind for c in inside)
    want = collections.Counter(_PER_LAYER[cfg.family])
    if recomputed:
      want.update(_FORWARD[cfg.family])
    assert per_kind == collections.Counter(
        {k: n * cfg.blocks for k, n in want.items() if n}), per_kind


@pytest.mark.parametrize("name,mesh,m", CASES)
def test_experts_split_over_ep_train_exactly(name, mesh, m):
  ex = example(name, batch_size=BATCH)
  step = check_training(ex, seed=5, mesh=mesh, microbatches=m)
  _check_experts(step.result, ex, mesh)
  if "pp" in mesh:
    assert len(step.result.partition) == 2


@pytest.mark.parametrize("name,mesh", [
    pytest.param("switch_tfkeras", "ep=4", id="switch_tfkeras-8experts-ep4"),
    pytest.param("moe_keras3", "dp=2,ep=2", id="moe_keras3-8experts-dp2-ep2",
                 marks=pytest.mark.slow)])
def test_eight_experts_train_exactly(name, mesh):
  ex, _ = _graph(name, experts=8)
  step = check_training(ex, seed=5, mesh=mesh)
  _check_experts(step.result, ex, mesh)


@pytest.mark.parametrize("name", ["switch_keras3", "moe_tfkeras"])
def test_expert_layout_without_running(name):
  """The split alone (cheap): where the experts live and what travels."""
  ex, graph_def = _graph(name)
  _check_experts(split_graph(graph_def, make_mesh("ep=2")), ex, "ep=2")


def test_ep_that_does_not_divide_the_experts():
  _, graph_def = _graph("switch_keras3")
  with pytest.raises(PlanError, match=r"stacks 4 experts .* do not divide by ep=8"):
    split_graph(graph_def, Mesh.parse("ep=8"))


def test_ep_without_expert_weights():
  ex = example("gpt_keras3")
  graph_def = load_graph(ex.concrete("train"), variable_names=names(ex))
  with pytest.raises(PlanError, match="has an 'ep' axis but the graph has no expert weights"):
    split_graph(graph_def, make_mesh("ep=2"))


@pytest.mark.parametrize("name,options", [
    pytest.param("switch_keras3", {"zero": 1}, id="switch_keras3-zero1"),
    pytest.param("moe_tfkeras", {"recompute": "blocks"}, id="moe_tfkeras-recompute",
                 marks=pytest.mark.slow)])
def test_ep_with_zero_and_recompute(name, options):
  """dp=2,ep=2 over 2 micro-batches with optimizer-state sharding (each
  gradient reduce-scattered over dp, then its shard all-reduced over ep and
  bucketed at that shape) and with recomputed blocks (the scalar gradient of
  the routers' balance loss, one for the whole batch, is no drain the copies
  wait for)."""
  ex = example(name, batch_size=BATCH)
  step = check_training(ex, seed=5, mesh="dp=2,ep=2", microbatches=2, **options)
  _check_experts(step.result, ex, "dp=2,ep=2", zero=options.get("zero", 0),
                 recomputed="recompute" in options)


def test_inspect_shows_the_expert_layers(tmp_path, capsys):
  """`tfsplit inspect` lists each MoE layer with its expert count and the
  stacked weights an 'ep' axis splits; a dense model has none."""
  from tfsplit.cli import run
  from tfsplit.graph import save_graph
  ex, graph_def = _graph("switch_tfkeras")
  path = str(tmp_path / "switch.pb")
  save_graph(graph_def, path)
  assert run(["tfsplit", "inspect", path, "--format", "json"]) == 0
  report = json.loads(capsys.readouterr().out)
  layers = report["experts"]
  assert len(layers) == ex.config.blocks
  assert all(l["experts"] == ex.config.experts and len(l["weights"]) == 3 and
             _MOE_LAYER.search(l["scope"] + "/") for l in layers), layers
  by_name = {v["name"]: v for v in report["variables"]}
  assert all(l["bytes"] == sum(by_name[w]["bytes"] for w in l["weights"]) for l in layers)
  assert run(["tfsplit", "inspect", path]) == 0
  table = capsys.readouterr().out.splitlines()
  assert f"expert layers: {ex.config.blocks} ({ex.config.experts} experts each; an 'ep' " \
         "mesh axis splits their weights by whole experts)" in table
  dense = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                       "gpt_raw_train_tiny.pb")
  assert run(["tfsplit", "inspect", dense]) == 0
  assert "expert layers: none (no stacked expert weights for an 'ep' axis)" in \
      capsys.readouterr().out.splitlines()


# --- the planner -------------------------------------------------------------------------
def _moe_rows(n=5, experts=4, seed=7):
  """Uneven layers, the middle ones MoE blocks whose expert weights are
  most of their weights."""
  import random
  rng = random.Random(seed)
  rows = []
  for i in range(n):
    moe = 0 < i < n - 1
    params = rng.randint(4, 8) * 10**8
    rows.append(LayerRow(
        name=f"layer_{i}", forward=rng.uniform(1e-3, 4e-3), backward=rng.uniform(2e-3, 8e-3),
        update=rng.uniform(1e-5, 1e-4), params=params, slots=2 * params,
        activations=rng.randint(1, 6) * 10**9, input_bytes=10**7, splittable=moe,
        experts=experts if moe else 0, expert_params=int(0.8 * params) if moe else 0,
        expert_exchange=4 * 10**7 if moe else 0))
  return ModelProfile(rows, [10**7] * (n - 1), batch=32)


def test_profile_rows_hold_the_experts_the_rewrite_splits():
  """The planner's rows of the corpus Switch decoder: each block's expert
  count and expert bytes are those of the weights an ep split shards, and
  its token exchange is what the ep=2 rewrite's all-to-alls move (forward
  and backward)."""
  from tfsplit import plan as plan_lib
  ex, graph_def = _graph("switch_keras3")
  profile = plan_lib.profile_graph(graph_def, 2, "h100-80gb")
  moe = [row for row in profile.layers if row.experts]
  assert len(moe) == ex.config.blocks and profile.experts == ex.config.experts
  result = split_graph(graph_def, make_mesh("ep=2"))
  shards = {n: e for n, e in result.manifest.items()}
  for row in moe:
    mine = [e for e in result.experts if e.contractions[0].startswith(row.name + "/")]
    assert len(mine) == 3
    assert row.expert_params == sum(4 * int(np.prod(shards[e.variable]["shape"]))
                                    for e in mine)
  moved = sum(c.num_elements * 4 for c in result.collectives
              if c.axis == "ep" and c.kind == "all_to_all")
  assert moved == 2 * sum(row.expert_exchange for row in moe), moved
  dense = plan_lib.profile_graph(load_graph(os.path.join(
      os.path.dirname(os.path.abspath(__file__)), "..", "examples",
      "gpt_raw_train_tiny.pb")), 2, "h100-80gb")
  assert dense.experts == 0 and {ep for *_, ep in space.meshes(4, dense)} == {1}


def test_ep_sizes_divide_the_experts_and_the_batch():
  profile = _moe_rows(experts=4)
  meshes = space.meshes(8, profile)
  assert {ep for *_, ep in meshes} == {1, 2, 4}
  assert all(profile.batch % (dp * ep) == 0 for dp, _, _, ep in meshes)
  assert all(dp * tp * pp * ep == 8 for dp, tp, pp, ep in meshes)


def test_ep_prices_expert_memory_sync_and_token_exchange():
  """dp=2,ep=2 against dp=4 (the same tokens per device): the expert
  weights, gradients and slots halve; each MoE layer adds its tokens'
  all-to-alls (2 forward, 2 backward); the non-expert gradients are summed
  over ep after dp."""
  from tfsplit.cost import collectives
  profile = _moe_rows()
  cluster = plan_lib_cluster(4)
  costing = costing_lib.Costing(profile, cluster)
  whole = [(0, costing.n)]
  dp4 = costing.evaluate(space.Candidate(4, 1, 1), whole)
  ep = space.Candidate(2, 1, 1, ep=2)
  dp2ep2 = costing.evaluate(ep, whole)
  expert = sum(r.expert_params for r in profile.layers)
  slots = sum(r.slots * r.expert_params / r.params for r in profile.layers)
  assert dp4.memory - dp2ep2.memory == pytest.approx((2 * expert + slots) / 2, rel=1e-9)
  link = costing._link("ep", ep)  # pylint: disable=protected-access
  exchange = sum(4 * collectives.pairwise_all_to_all(2, r.expert_exchange / 2 / 4, link)
                 for r in profile.layers if r.experts)
  assert dp2ep2.pipeline_time - dp4.pipeline_time == pytest.approx(exchange, rel=1e-9)
  dp_link = costing.dp_link(ep)
  grads = sum(r.params - r.expert_params / 2 for r in profile.layers)
  dense = sum(r.params - r.expert_params for r in profile.layers)
  buckets = lambda b: 2 * (2 - 1) * math.ceil(b / costing.bucket_bytes - 1)  # pylint: disable=unnecessary-lambda-assignment
  want = (collectives.ring_all_reduce(2, grads, dp_link) + dp_link.latency * buckets(grads) +
          collectives.ring_all_reduce(2, dense, link) + link.latency * buckets(dense))
  assert dp2ep2.sync_time == pytest.approx(want, rel=1e-9)


def plan_lib_cluster(devices):
  from tfsplit import plan as plan_lib
  return plan_lib.cluster_for("h100-80gb", devices)


def test_search_with_ep_within_5_percent_of_exhaustive():
  profile = _moe_rows()
  cluster = plan_lib_cluster(4)
  unbounded = Planner(profile, cluster, 4, None).search()
  for cap in (10**15, (unbounded.smallest.memory + unbounded.best.memory) // 2,
              int(unbounded.smallest.memory * 1.05)):
    planner = Planner(profile, cluster, 4, cap)
    found, best = planner.search().best, planner.exhaustive()
    assert found is not None and best is not None
    assert found.memory <= cap and found.step_time <= 1.05 * best.step_time, (
        found.label(), best.label())


def test_planner_splits_the_experts_of_a_large_moe_and_says_why():
  """A 32-block MoE decoder of 8 experts per block (74 GB of 16-bit
  weights) on 64 H100s: the winner shards the experts over ep; the reasons
  name what that saves and the fastest plan without ep. The dense decoder
  of the same sizes gets no ep axis."""
  from tfsplit.plan import report
  from tfsplit.plan.profile import synthetic_gpt
  sizes = dict(blocks=32, hidden=4096, seq_len=4096, batch=256, vocab=32000, heads=32)
  cluster = plan_lib_cluster(64)
  result = Planner(synthetic_gpt(experts=8, **sizes), cluster, 64, 80e9, reserve=0.1).search()
  best = result.best
  assert best.candidate.ep > 1 and 8 % best.candidate.ep == 0
  assert f"ep={best.candidate.ep}" in best.candidate.mesh
  why = report.reasons(result, result.costing)
  line = [r for r in why if r.startswith(f"splits the experts over ep={best.candidate.ep}")]
  assert line and "the fastest plan without ep, " in line[0], why
  without = result.best_by_ep[False]
  assert without.candidate.ep == 1 and without.step_time >= best.step_time
  dense = Planner(synthetic_gpt(**sizes), cluster, 64, 80e9, reserve=0.1).search()
  assert all(e.candidate.ep == 1 for e in dense.ranked) and not dense.best_by_ep


def test_an_ep_plan_file_applies_and_trains_exactly(tmp_path):
  """A plan with an ep axis survives its JSON form and trains exactly."""
  from tfsplit import plan as plan_lib
  from tfsplit.plan.plan import Plan
  ex, graph_def = _graph("switch_keras3")
  profile = plan_lib.profile_graph(graph_def, 4, "h100-80gb")
  costing = costing_lib.Costing(profile, plan_lib_cluster(4))
  est = costing.evaluate(space.Candidate(2, 1, 1, 2, ep=2), [(0, costing.n)])
  path = str(tmp_path / "plan.json")
  Plan.from_estimate(est, profile).save(path)
  plan = plan_lib.read(path)
  assert plan.mesh == "dp=2,ep=2" and plan.microbatches == 2
  step = check_training(ex, seed=5, steps=3, plan=path)
  _check_experts(step.result, ex, "dp=2,ep=2")
