"""A step traced with an unknown batch (TensorSpec([None, ...]), what
SavedModels and Keras exports carry): bound to the global batch
(batch_size= / --batch) it splits and trains exactly; unbound it is one
line naming the input and the fix, with no error log from the rules."""
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfsplit
from tfsplit.cli import run
from tfsplit.errors import PlanError
from tfsplit.graph import save_graph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DYNAMIC = [tf.TensorSpec([None, 16], tf.float32), tf.TensorSpec([None], tf.int32)]


class _Step(object):
  """A two-layer classifier trained by Adam, traced with a None batch."""

  def __init__(self):
    rng = np.random.RandomState(3)
    self.w1 = tf.Variable(rng.normal(size=(16, 64)).astype(np.float32) * 0.1,
                          name="fc1/kernel")
    self.w2 = tf.Variable(rng.normal(size=(64, 4)).astype(np.float32) * 0.1,
                          name="fc2/kernel")
    self.start = [self.w1.numpy(), self.w2.numpy()]
    opt = tf.keras.optimizers.Adam(0.01)
    opt.build([self.w1, self.w2])

    @tf.function
    def step(x, y):
      with tf.GradientTape() as tape:
        h = tf.nn.relu(tf.matmul(x, self.w1, name="fc1/MatMul"))
        logits = tf.matmul(h, self.w2, name="fc2/MatMul")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
      opt.apply_gradients(zip(tape.gradient(loss, [self.w1, self.w2]), [self.w1, self.w2]))
      return loss

    self.opt, self.fn = opt, step
    self.x = rng.normal(size=(8, 16)).astype(np.float32)
    self.y = (np.arange(8) % 4).astype(np.int32)

  def reset(self):
    self.w1.assign(self.start[0])
    self.w2.assign(self.start[1])
    for v in self.opt.variables:   # the step count and the moments, not the rate
      if "learning_rate" not in v.path:
        v.assign(tf.zeros_like(v))


@pytest.mark.parametrize("mesh", ["tp=2", "dp=2,tp=2"])
def test_bound_batch_trains_exactly(mesh):
  model = _Step()
  try:
    want = [float(model.fn(model.x, model.y)) for _ in range(3)]
    want_w = [model.w1.numpy(), model.w2.numpy()]
    model.reset()
    step = tfsplit.split(model.fn, mesh=mesh, input_signature=DYNAMIC, batch_size=8)
    assert step.manifest["fc1/kernel"]["sharding"] == [None, "tp"]
    assert step.config.batch_size == 8 and not step.result.fallbacks
    got = [float(step(model.x, model.y)) for _ in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    full = step.full_values()
    np.testing.assert_allclose(full["fc1/kernel"], want_w[0], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(full["fc2/kernel"], want_w[1], rtol=1e-4, atol=1e-6)
  finally:
    model.reset()


def test_unbound_batch_is_one_line_without_an_error_flood(caplog):
  model = _Step()
  with caplog.at_level(logging.ERROR):
    with pytest.raises(PlanError, match=r"input 'x' \(and 1 more\) has shape \[None, 16\]: "
                       r"its batch dimension is unknown.*batch_size=N \(--batch N\)"):
      tfsplit.split(model.fn, mesh="tp=2", input_signature=DYNAMIC)
  assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
  with pytest.raises(PlanError, match="batch_size must be a positive integer"):
    tfsplit.split(model.fn, mesh="tp=2", input_signature=DYNAMIC, batch_size=0)


def test_cli_binds_the_batch_and_verify_runs_the_original_at_it(tmp_path, capsys):
  model = _Step()
  graph = tmp_path / "dynamic.pb"
  save_graph(tfsplit.graph.load_graph(model.fn.get_concrete_function(*DYNAMIC)), str(graph))
  out = tmp_path / "tp2.pb"
  code = run(["tfsplit", "rewrite", str(graph), "-o", str(out), "--mesh", "tp=2"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and "--batch N" in err[0] and not out.exists(), err
  assert run(["tfsplit", "rewrite", str(graph), "-o", str(out), "--mesh", "tp=2",
              "--batch", "8"]) == 0
  capsys.readouterr()
  # verify in a process of its own (it makes the logical devices it needs).
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             TF_CPP_MIN_LOG_LEVEL="3")
  done = subprocess.run([sys.executable, "-m", "tfsplit.cli", "verify", str(graph), str(out),
                         "--steps", "2"], capture_output=True, text=True, timeout=300,
                        env=env, check=False)
  assert done.returncode == 0 and "OK:" in done.stdout, done.stdout + done.stderr[-2000:]


def test_another_unknown_dimension_is_one_line_naming_the_input(caplog):
  """A sequence traced as None: one line, before any rule sees the shape
  (the rules used to log an internal error per op)."""
  emb = tf.Variable(tf.random.normal([50, 16]), name="emb")
  w = tf.Variable(tf.random.normal([16, 32]), name="fc/kernel")

  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.einsum("bsh,hf->bsf", tf.gather(emb, x), w) ** 2)
    grads = tape.gradient(loss, [emb, w])
    emb.assign_sub(tf.convert_to_tensor(grads[0]) * 0.1)
    w.assign_sub(grads[1] * 0.1)
    return loss

  with caplog.at_level(logging.ERROR):
    with pytest.raises(PlanError, match=r"input 'x' has shape \[8, None\]: dimension 1 is "
                       r"unknown.*fixed shapes"):
      tfsplit.split(step, mesh="tp=2", input_signature=[tf.TensorSpec([8, None], tf.int32)])
  assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
