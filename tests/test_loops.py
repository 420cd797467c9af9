"""Loops do not poison the rest: a step with a tf.while_loop or tf.scan that
reads a variable (an RNN) keeps the loop whole and splits the layers around
it at tp, trained exactly (the tape's loop accumulators, made in the
gradient scope for the forward loop to fill, used to make the loop and all
after it 'backward', so no weight was split, silently)."""
import numpy as np
import pytest
import tensorflow as tf

import tfsplit

SIGNATURE = [tf.TensorSpec([8, 16], tf.float32), tf.TensorSpec([8], tf.int32)]


def _while(x, w0):
  return tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, tf.tanh(tf.matmul(a, w0)) + a),
                       (0, x))[1]


def _scan(x, w0):
  steps = tf.stack([x, x * 0.5, x * 0.25])
  return tf.scan(lambda a, s: tf.tanh(tf.matmul(a, w0)) + s, steps, initializer=x)[-1]


class _Rnn(object):
  """A recurrent block (`loop`) over the features, then a two-layer MLP."""

  def __init__(self, loop):
    rng = np.random.RandomState(5)
    shapes = {"rnn/kernel": (16, 16), "fc1/kernel": (16, 64), "fc2/kernel": (64, 4)}
    self.vars = {n: tf.Variable(rng.normal(size=s).astype(np.float32) * 0.2, name=n)
                 for n, s in shapes.items()}
    self.start = {n: v.numpy() for n, v in self.vars.items()}
    opt = tf.keras.optimizers.SGD(0.1)
    ws = list(self.vars.values())

    @tf.function
    def step(x, y):
      with tf.GradientTape() as tape:
        h = loop(x, self.vars["rnn/kernel"])
        h = tf.nn.relu(tf.matmul(h, self.vars["fc1/kernel"], name="fc1/MatMul"))
        logits = tf.matmul(h, self.vars["fc2/kernel"], name="fc2/MatMul")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
      opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
      return loss

    self.fn = step
    self.x = rng.normal(size=(8, 16)).astype(np.float32)
    self.y = (np.arange(8) % 4).astype(np.int32)

  def reset(self):
    for n, v in self.vars.items():
      v.assign(self.start[n])


@pytest.mark.parametrize("loop", [_while, _scan], ids=["while_loop", "scan"])
@pytest.mark.parametrize("mesh", ["tp=2", "dp=2,tp=2"])
def test_layers_around_a_loop_split_and_train_exactly(loop, mesh):
  model = _Rnn(loop)
  try:
    want = [float(model.fn(model.x, model.y)) for _ in range(3)]
    want_vars = {n: v.numpy() for n, v in model.vars.items()}
    model.reset()
    step = tfsplit.split(model.fn, mesh=mesh, input_signature=SIGNATURE)
    sharding = {n: step.manifest[n]["sharding"] for n in model.vars}
    assert sharding == {"rnn/kernel": [None, None], "fc1/kernel": [None, "tp"],
                        "fc2/kernel": ["tp", None]}, sharding
    got = [float(step(model.x, model.y)) for _ in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    full = step.full_values()
    for name, value in want_vars.items():
      np.testing.assert_allclose(full[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
  finally:
    model.reset()


def test_keras_lstm_model_splits_its_dense_layers_under_fit(caplog):
  """Embedding -> LSTM -> Dense -> Dense through tfsplit.keras at tp=2: the
  Dense kernels split, fit's losses are the plain fit's, and one warning
  names the loop."""
  import logging  # pylint: disable=import-outside-toplevel
  import keras  # pylint: disable=import-outside-toplevel

  def build():
    keras.utils.set_random_seed(1)
    return keras.Sequential([
        keras.Input((6,), dtype="int32"), keras.layers.Embedding(50, 16),
        keras.layers.LSTM(16), keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(4)])

  rng = np.random.RandomState(0)
  x, y = rng.randint(0, 50, (16, 6)).astype(np.int32), (np.arange(16) % 4).astype(np.int32)

  def fit(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]

  want = fit(build())
  with caplog.at_level(logging.WARNING):
    split_model = tfsplit.keras.split(build(), mesh="tp=2")
    got = fit(split_model)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  sharding = {name.split("/", 1)[1]: e["sharding"]
              for name, e in split_model.split_step.manifest.items() if "kernel" in name}
  dense = [v for k, v in sorted(sharding.items()) if k.startswith("dense")]
  assert dense == [[None, "tp"], ["tp", None]], sharding
  assert all(not any(v) for k, v in sharding.items() if k.startswith("lstm")), sharding
  loops = [r for r in caplog.records if "functional control flow runs whole" in r.getMessage()]
  assert len(loops) == 1 and "While" in loops[0].getMessage(), [r.getMessage() for r in loops]
