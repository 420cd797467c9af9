"""Every split says what each mesh axis really splits, and a model axis
that splits nothing is one warning naming why, or with strict a refusal
(passes/coverage.py)."""
import logging
import os

import numpy as np
import pytest
import tensorflow as tf

import models  # examples/models (see conftest.py)
from _util import example, names
from tfsplit.cli import run
from tfsplit.errors import PlanError
from tfsplit.graph import load_graph
from tfsplit.layout.mesh import Mesh
from tfsplit.passes import coverage
from tfsplit.passes import split_graph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(ROOT, "examples", "gpt_raw_train_tiny.pb")


def _warnings(caplog):
  return [r.getMessage() for r in caplog.records
          if r.levelno == logging.WARNING and "splits no variable" in r.getMessage()]


def test_rewrite_says_what_each_axis_splits(tmp_path, capsys):
  out = tmp_path / "out.pb"
  assert run(["tfsplit", "rewrite", GPT, "-o", str(out), "--mesh", "dp=2,tp=2"]) == 0
  line = next(l for l in capsys.readouterr().out.splitlines() if "per axis" in l)
  result = split_graph(load_graph(GPT), Mesh({"dp": 2, "tp": 2}))
  tp = next(a for a in coverage.axis_splits(result) if a.axis == "tp")
  split = [n for n, e in result.manifest.items() if "tp" in e["sharding"]]
  assert tp.variables == len(split) > 0 and tp.bytes < tp.total_bytes
  assert f"dp=2 splits the batch; tp=2 splits {len(split)} of {len(result.manifest)} " \
         "variables" in line, line


def test_an_axis_that_splits_nothing_warns_once_and_strict_refuses(tmp_path, capsys, caplog):
  graph_def = load_graph(GPT)
  with caplog.at_level(logging.WARNING):
    split_graph(graph_def, Mesh({"tp": 2}), strategy="none")
  warned = _warnings(caplog)
  assert len(warned) == 1 and "tp=2 splits no variable" in warned[0] and \
      "strategy 'none' and no annotation names tp" in warned[0], warned
  with pytest.raises(PlanError, match="tp=2 splits no variable.*--annotate"):
    split_graph(graph_def, Mesh({"tp": 2}), strategy="none", strict=True)
  caplog.clear()
  with caplog.at_level(logging.WARNING):   # a split that splits: no word, strict or not
    split_graph(graph_def, Mesh({"tp": 2}), strict=True)
  assert not _warnings(caplog)
  out = tmp_path / "out.pb"
  capsys.readouterr()
  code = run(["tfsplit", "rewrite", GPT, "-o", str(out), "--mesh", "tp=2", "--strategy",
              "none", "--strict"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and "splits no variable" in err[0] and not out.exists()
  with pytest.raises(PlanError, match="strict must be True or False"):
    split_graph(graph_def, Mesh({"tp": 2}), strict="yes")


def test_weights_only_inside_a_loop_name_the_loop():
  """An RNN whose one weight is read inside its loop: tp can split nothing,
  and the line says the loop is why."""
  import tfsplit  # pylint: disable=import-outside-toplevel
  w = tf.Variable(np.eye(8, dtype=np.float32) * 0.5, name="rnn/kernel")
  opt = tf.keras.optimizers.SGD(0.1)

  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      h = tf.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, tf.tanh(tf.matmul(a, w))),
                        (0, x))[1]
      loss = tf.reduce_mean(h * h)
    opt.apply_gradients([(tape.gradient(loss, w), w)])
    return loss

  signature = [tf.TensorSpec([4, 8], tf.float32)]
  with pytest.raises(PlanError, match=r"tp=2 splits no variable.*outside the loops kept "
                     r"whole \('while'"):
    tfsplit.split(step, mesh="tp=2", input_signature=signature, strict=True)


def _much_less(caplog):
  return [r.getMessage() for r in caplog.records
          if r.levelno == logging.WARNING and "its weight contractions read" in r.getMessage()]


def test_an_axis_that_splits_much_less_than_it_could_warns_and_strict_refuses(caplog):
  """A decoder whose tied embedding table holds most of its weights (a
  4000-token vocabulary over width 32): tp=2 splits its blocks but not the
  table, under half of what its weight contractions read. One warning names
  the table and split_embeddings; strict refuses; with split_embeddings
  there is nothing to say."""
  import keras  # pylint: disable=import-outside-toplevel
  from models import seeded  # pylint: disable=import-outside-toplevel
  gpt = seeded.build(keras, seeded.TINY._replace(vocab=4000), seed=0)
  graph_def = load_graph(gpt.train_step.get_concrete_function(*gpt.signature),
                         variable_names=gpt.variable_names())
  with caplog.at_level(logging.WARNING):
    split_graph(graph_def, Mesh({"tp": 2}))
  warned = _much_less(caplog)
  assert len(warned) == 1, warned
  assert "(16%)" in warned[0] and "'embed/embeddings' (0.488 MiB)" in warned[0] and \
      "split_embeddings=True" in warned[0], warned[0]
  with pytest.raises(PlanError, match="its weight contractions read.*--annotate"):
    split_graph(graph_def, Mesh({"tp": 2}), strict=True)
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    split_graph(graph_def, Mesh({"tp": 2}), split_embeddings=True, strict=True)
  assert not _much_less(caplog)


# --- no silent replication over the corpus ------------------------------------------------
# Each model's tp=2 split keeps at least this share of its variable bytes
# split (weights with their optimizer slots); every model measured 0.78 or more.
_FLOOR = 0.75


def _tp_share(graph_def):
  result = split_graph(graph_def, Mesh({"tp": 2}), strict=True)
  tp = next(a for a in coverage.axis_splits(result) if a.axis == "tp")
  return tp.bytes / tp.total_bytes


@pytest.mark.parametrize("name", models.NAMES)
def test_example_models_split_most_bytes_at_tp2(name):
  """Traced and as the plain graph file the examples ship."""
  ex = example(name)
  traced = load_graph(ex.train_step.get_concrete_function(*ex.train_signature),
                      variable_names=names(ex))
  assert _tp_share(traced) >= _FLOOR
  assert _tp_share(load_graph(os.path.join(ROOT, "examples", f"{name}_train_tiny.pb"))) \
      >= _FLOOR


@pytest.mark.slow
@pytest.mark.parametrize("name", models.CORPUS_NAMES)
def test_corpus_models_split_most_bytes_at_tp2(name):
  ex = example(name)
  assert _tp_share(load_graph(ex.train_step.get_concrete_function(*ex.train_signature),
                              variable_names=names(ex))) >= _FLOOR
