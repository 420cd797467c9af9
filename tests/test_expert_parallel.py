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
import os
import re

import numpy as np
import pytest

from tfsplit.errors import PlanError
from tfsplit.graph import load_graph
from tfsplit.layout.mesh import Mesh
from tfsplit.passes import split_graph
from tfsplit.passes.manifest import bytes_per_device
from tfsplit.runtime.split_function import make_mesh

from _util import check_training, example, names

BATCH = 16
MODELS = ("switch_keras3", "switch_tfkeras", "moe_keras3", "moe_tfkeras")
MESHES = (("ep=2", 1), ("dp=2,ep=2", 2), ("ep=2,tp=2", 1), ("pp=2,ep=2", 2))
# In CI: both layer kinds and flavors, data and expert parallelism with
# micro-batches, and the pipeline; the rest is slow.
_CI = {("switch_keras3", "dp=2,ep=2"), ("moe_tfkeras", "pp=2,ep=2")}
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
    pytest.param("moe_tfkeras", {"recompute": "blocks"}, id="moe_tfkeras-recompute")])
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
