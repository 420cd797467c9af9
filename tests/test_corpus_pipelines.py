"""Pipelines and micro-batching on the real-structure corpus (examples/models/corpus.py):
a task model wrapping a backbone with a tied LM head, a pre-norm decoder with
RMSNorm, rotary embeddings, grouped-query attention and SwiGLU, a BERT-style
encoder with a padding mask, a ViT with a class token, and the raw TF GPT.
Each trains exactly (3 steps: the loss, every copy of every parameter and
optimizer slot, and every update) against the unsplit step."""
import pytest

from tfsplit.graph import load_graph
from tfsplit.graph.layers import detect_layers

from _util import check_training, example, names

BATCH = 16
CORPUS = [f"{family}_{flavor}" for family in ("causallm", "llama", "bert", "vit")
          for flavor in ("keras3", "tfkeras")] + ["gpt_raw"]

# (model, mesh, micro-batches, schedule) run in CI; the rest of the matrix is slow.
_CI = {
    ("causallm_keras3", "pp=2", 4, "1f1b"),
    ("llama_tfkeras", "pp=2,tp=2", 4, "1f1b"),
    ("bert_keras3", "dp=2,pp=2", 4, "1f1b"),
}
# (vit_tfkeras pp=4 m=8 gpipe, the corpus's 4-stage gpipe case, is slow for
# CI time; tests/test_pipeline.py runs 4 stages and gpipe in CI.)
# 'interleaved' runs 2 model chunks per stage (the tiny models have too few
# layers for 4 stages x 2 chunks).
_MATRIX = ([(mesh, m, sched) for mesh in ("pp=2", "pp=4") for m in (4, 8)
            for sched in ("gpipe", "1f1b")] +
           [("pp=2,tp=2", 4, "1f1b"), ("dp=2,pp=2", 4, "1f1b")] +
           [("pp=2", 4, "interleaved"), ("pp=2", 8, "interleaved")])
CASES = [pytest.param(name, *case, marks=() if (name,) + case in _CI else pytest.mark.slow,
                      id=f"{name}-{case[0]}-m{case[1]}-{case[2]}")
         for name in CORPUS for case in _MATRIX]


@pytest.mark.parametrize("name,mesh,m,schedule", CASES)
def test_corpus_pipeline_trains_exactly(name, mesh, m, schedule):
  chunks = 2 if schedule == "interleaved" else 1
  step = check_training(example(name, batch_size=BATCH), seed=5, mesh=mesh,
                        microbatches=m, schedule=schedule, virtual_stages=chunks)
  stages = int(dict(a.split("=") for a in mesh.split(","))["pp"])
  assert len(step.result.partition) == stages * chunks


@pytest.mark.parametrize("name", CORPUS)
def test_corpus_layers_are_the_blocks(name):
  """Layer detection finds the repeated blocks, at any depth (the causal LM's
  blocks sit inside its backbone model), with the embedding, final norm and
  head around them; a tied embedding has one owner and the head as reader."""
  ex = example(name, batch_size=BATCH)
  graph_def = load_graph(ex.concrete("train"), variable_names=names(ex))
  report = detect_layers(graph_def)
  blocks = [l for l in report.model_layers if l.block]
  assert len(blocks) == ex.config.blocks, [l.name for l in report.model_layers]
  for i, layer in enumerate(blocks):
    assert layer.name.split("/")[-1].startswith(f"block_{i}"), layer.name
  layers = report.model_layers
  assert not layers[0].block and layers.index(blocks[-1]) < len(layers) - 1 or \
      name.startswith("causallm")
  if name.startswith("causallm"):
    tied = [h for h, readers in report.variable_readers.items() if len(readers) > 1]
    assert len(tied) == 1, tied
    owner = report.variable_layer[tied[0]]
    assert owner.split("/")[-1].startswith("embed"), owner
    # The embedding's optimizer slots follow it, not the head that reads it.
    slots = [l for l in report.layers if owner == l.name][0].slots
    assert len(slots) >= 2, slots
