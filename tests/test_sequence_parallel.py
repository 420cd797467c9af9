"""Sequence parallelism (Korthikanti et al., 2022): the norms, residual and
bias adds between the megatron preset's row- and column-parallel
contractions split over the sequence. Exact training of corpus models, the
collectives that replace each forward all-reduce (same bytes), the check
failing on a broken reduce-scatter, and the errors."""
import collections
import json

import pytest

from tfsplit import constants
from tfsplit.cli import run
from tfsplit.errors import PlanError
from tfsplit.graph import Graph, load_graph
from tfsplit.graph.layers import detect_layers
from tfsplit.passes import manifest as manifest_lib
from tfsplit.passes import split_graph
from tfsplit.runtime.split_function import make_mesh
from tfsplit.sharding import reshard as reshard_lib
from tfsplit.strategies.sequence_parallel import activation_bytes

from _util import check_training, example, names

def _graph(ex):
  concrete = ex.train_step.get_concrete_function(*ex.train_signature)
  return load_graph(concrete, variable_names=names(ex))


def _forward(records, kind, roles, axis=constants.TENSOR_AXIS):
  """Elements of each collective of `kind` over `axis` that moves a forward
  tensor (`roles`: the original graph's), in order."""
  return [r.num_elements for r in records if r.kind == kind and r.axis == axis and
          roles.get(r.tensor) == constants.FORWARD]


def _roles(graph_def):
  return detect_layers(Graph(graph_def)).role


_CI = {("causallm_keras3", "tp=2"), ("llama_keras3", "dp=2,tp=2"), ("bert_keras3", "tp=2"),
       ("bert_keras3", "dp=2,tp=2")}


@pytest.mark.parametrize("name,mesh", [
    pytest.param(name, mesh, id=f"{name}-{mesh}",
                 marks=() if (name, mesh) in _CI else pytest.mark.slow)
    for name in ("causallm_keras3", "llama_keras3", "bert_keras3", "causallm_tfkeras",
                 "bert_tfkeras", "gpt_raw")
    for mesh in ("tp=2", "dp=2,tp=2")])
def test_corpus_model_trains_exactly(name, mesh):
  """Loss, every parameter and every update of 3 steps; each block's
  forward all-reduces are reduce-scatters (all-to-all plus a local sum on
  CPUs) and all-gathers of the same bytes."""
  ex = example(name)
  step = check_training(ex, mesh=mesh, sequence_parallel=True)
  graph_def = _graph(ex)
  roles = _roles(graph_def)
  plain = split_graph(graph_def, make_mesh(mesh))
  reduced = _forward(plain.collectives, "all_reduce", roles)
  scattered = _forward(step.result.collectives, "reduce_scatter", roles)
  # Off the residual stream (BERT's pooler and classifier) stays all-reduced.
  kept = _forward(step.result.collectives, "all_reduce", roles)
  assert reduced and len(kept) <= (1 if name.startswith("bert") else 0)
  assert sorted(scattered + kept) == sorted(reduced)
  # Each block's column inputs are gathered back (the first block's reads
  # the replicated embedding: nothing to gather), plus the LM head's input.
  gathered = _forward(step.result.collectives, "all_gather", roles)
  assert len(gathered) >= len(scattered) - 1 and sum(gathered) >= sum(scattered) - max(scattered)
  ops = collections.Counter(n.op for n in step.result.graph_def.node)
  assert ops["CollectiveAllToAllV2"] >= len(scattered)


@pytest.mark.slow
@pytest.mark.parametrize("name,mesh,options", [
    ("causallm_keras3", "dp=2,tp=2", {"microbatches": 4}),
    ("llama_keras3", "pp=2,tp=2", {"microbatches": 4}),
    ("causallm_keras3", "pp=2,tp=2", {"microbatches": 4}),
    ("causallm_keras3", "tp=2", {"recompute": "blocks"}),
    ("bert_keras3", "dp=2,tp=2", {"microbatches": 2, "recompute": "blocks"}),
    ("causallm_keras3", "dp=2,tp=2", {"zero": 1}),
    ("llama_keras3", "dp=2,tp=2", {"zero": 2, "microbatches": 2}),
])
def test_combines_with_the_other_splits(name, mesh, options):
  ex = example(name)
  step = check_training(ex, mesh=mesh, sequence_parallel=True, **options)
  assert _forward(step.result.collectives, "reduce_scatter", _roles(_graph(ex)))


def test_micro_batches_under_data_parallel_train_exactly():
  check_training(example("llama_keras3"), mesh="dp=2,tp=2", microbatches=2,
                 sequence_parallel=True)


def test_a_broken_reduce_scatter_is_caught(monkeypatch):
  """The exactness check bites: with each reduce-scatter's local sum made a
  max, training no longer matches."""
  original = reshard_lib.Resharder.sum_node

  def broken(self, name, x, axis, dtype, device):
    node = original(self, name, x, axis, dtype, device)
    node.op = "Max"
    return node
  monkeypatch.setattr(reshard_lib.Resharder, "sum_node", broken)
  with pytest.raises(AssertionError):
    check_training(example("causallm_keras3"), mesh="tp=2", sequence_parallel=True)


def test_the_backward_gathers_again():
  """The weight gradients of the column-parallel contractions read an
  all-gather of their own, gated on their output gradient (so the forward
  keeps only the 1/tp split for the backward)."""
  ex = example("causallm_keras3")
  result = split_graph(_graph(ex), make_mesh("tp=2"), sequence_parallel=True)
  gated = [n for n in result.graph_def.node
           if n.name.endswith("sequence_gather/after/shard_0")]
  assert gated and all(constants.is_gradient_name(n.name) for n in gated)
  assert all(any(i.startswith("^") for i in n.input) for n in gated)


def test_errors():
  ex = example("causallm_keras3")
  graph_def = _graph(ex)
  with pytest.raises(PlanError, match="has none; add a tensor axis"):
    split_graph(graph_def, make_mesh("dp=2"), sequence_parallel=True)
  with pytest.raises(PlanError, match="does not combine with the zb-h1"):
    split_graph(graph_def, make_mesh("pp=2,tp=2"), sequence_parallel=True,
                schedule="zb-h1", microbatches=2)
  vit = example("vit_keras3")  # 4 patches + the class token: 5 does not divide by 2
  with pytest.raises(PlanError, match=r"dimension 1 \(size 5\).*does not divide"):
    split_graph(_graph(vit), make_mesh("tp=2"), sequence_parallel=True)


def test_cli_rewrite(tmp_path):
  out = tmp_path / "sp.pb"
  assert run(["tfsplit", "rewrite", "examples/gpt_raw_train_tiny.pb", "-o", str(out), "--mesh", "tp=2",
              "--sequence-parallel"]) == 0
  manifest = json.loads(open(manifest_lib.manifest_path(str(out))).read())
  assert manifest["sequence_parallel"] is True
  bad = tmp_path / "bad.pb"
  assert run(["tfsplit", "rewrite", "examples/gpt_raw_train_tiny.pb", "-o", str(bad), "--mesh", "dp=2",
              "--sequence-parallel"]) == 2
  assert not bad.exists()


def test_activation_formula():
  """The paper's Table 2 (t = 1: both 34 + 5as/h; with sequence
  parallelism everything is divided by t)."""
  s, b, h, a = 2048, 1, 4096, 32
  full = s * b * h * (34 + 5 * a * s / h)
  assert activation_bytes(s, b, h, a, 1, False) == activation_bytes(s, b, h, a, 1, True) == full
  assert activation_bytes(s, b, h, a, 8, True) == pytest.approx(full / 8)
  assert activation_bytes(s, b, h, a, 8, False) == pytest.approx(
      s * b * h * (10 + 24 / 8 + 5 * a * s / (8 * h)))


def test_a_plan_carries_it():
  """Plan.sequence_parallel round-trips through the plan file, is checked,
  and tfsplit.split(plan=) applies it."""
  import tfsplit  # pylint: disable=import-outside-toplevel
  from tfsplit import plan as plan_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.plan import plan as plan_file  # pylint: disable=import-outside-toplevel
  ex = example("causallm_keras3")
  layers = plan_lib.model_layer_names(_graph(ex))
  plan = plan_lib.Plan(devices=2, layers=layers, mesh="tp=2", sequence_parallel=True)
  text = plan.to_json()
  assert plan_file.from_json(json.loads(json.dumps(text))).sequence_parallel is True
  with pytest.raises(PlanError, match="'sequence_parallel' must be true or false"):
    plan_file.from_json({**text, "sequence_parallel": "yes"})
  step = tfsplit.split(ex.train_step, plan=plan, input_signature=ex.train_signature,
                       variable_names=names(ex))
  assert step.result.config.sequence_parallel
  assert any(r.kind == "reduce_scatter" for r in step.result.collectives)
