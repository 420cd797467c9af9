"""A training step exported the standard way, as a SavedModel signature
(tf.saved_model.save(module, dir, signatures={"train": concrete_fn})),
splits as its plain write_graph file does: the signature's one call is
inlined under the body's own names (gradient scopes stay scopes), its
resource arguments read the variables directly, its colocation names
follow; rewrite splits as many variables and verify passes."""
import os
import subprocess
import sys

import tensorflow as tf

from _util import example
from tfsplit.cli import run
from tfsplit.graph import load_graph, save_graph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _split_line(text):
  return next(l for l in text.splitlines() if "variables split" in l).split(", ")[1]


def test_train_signature_splits_as_its_plain_graph(tmp_path, capsys):
  ex = example("gpt_raw")
  concrete = ex.train_step.get_concrete_function(*ex.train_signature)
  module = tf.Module()
  module.weights = list(ex.all_variables())
  saved = tmp_path / "saved"
  tf.saved_model.save(module, str(saved), signatures={"train": concrete})
  plain = tmp_path / "plain.pb"
  save_graph(load_graph(concrete), str(plain))
  graph_def = load_graph(str(saved), signature="train")
  assert any(n.name.startswith("gradient_tape/") for n in graph_def.node)
  lines = {}
  for name, source, extra in (("plain", plain, []), ("saved", saved, ["--signature", "train"])):
    assert run(["tfsplit", "rewrite", str(source), "-o", str(tmp_path / f"{name}_tp2.pb"),
                "--mesh", "tp=2", *extra]) == 0
    lines[name] = _split_line(capsys.readouterr().out)
  assert lines["saved"] == lines["plain"] and not lines["saved"].startswith("0 of"), lines
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             TF_CPP_MIN_LOG_LEVEL="3")
  done = subprocess.run([sys.executable, "-m", "tfsplit.cli", "verify", str(saved),
                         str(tmp_path / "saved_tp2.pb"), "--signature", "train", "--steps", "2"],
                        capture_output=True, text=True, timeout=300, env=env, check=False)
  assert done.returncode == 0 and "OK:" in done.stdout, done.stdout + done.stderr[-3000:]
