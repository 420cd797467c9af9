"""Train a Keras GPT with model.fit, split over logical devices by tfsplit.keras.

    python examples/train_keras_fit.py --mesh tp=2                 # 2 devices
    python examples/train_keras_fit.py --mesh dp=2,tp=2 --microbatches 2 --compare
    python examples/train_keras_fit.py --model causallm_tfkeras --mesh pp=2 --microbatches 4

The model is a corpus model from examples/models (default: the Keras 3
CausalLM, a backbone of pre-LayerNorm blocks with an LM head tied to its
token embedding). The script configures --devices logical CPUs (or splits
the first GPU into logical GPUs with --gpu), compiles the split model like
any Keras model and trains it with fit (progress bar, accuracy metric,
validation data, a ModelCheckpoint writing full weights). --compare trains
the same model with plain fit on one device from the same weights and prints
both histories and the largest relative difference of the final weights.
"""
import os
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/models

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "causallm_keras3", "Corpus model: <causallm|llama>_<keras3|tfkeras>.")
flags.DEFINE_string("size", "tiny", "Model size: tiny or small.")
flags.DEFINE_string("mesh", "tp=2", "Mesh axes, e.g. dp=2, tp=2, dp=2,tp=2, pp=2.")
flags.DEFINE_integer("microbatches", 1, "Micro-batches per replica and step.")
flags.DEFINE_integer("devices", 4, "Logical devices to configure.")
flags.DEFINE_bool("gpu", False, "Split the first GPU into logical GPUs instead of CPUs.")
flags.DEFINE_integer("batch", 16, "Global batch size.")
flags.DEFINE_integer("examples", 128, "Training examples (validation: half as many).")
flags.DEFINE_integer("epochs", 2, "Epochs.")
flags.DEFINE_string("checkpoint", None, "ModelCheckpoint path (default: a temp dir).")
flags.DEFINE_bool("compare", False, "Also run plain fit and compare.")


def _devices():
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  kind = "GPU" if FLAGS.gpu else "CPU"
  physical = tf.config.list_physical_devices(kind)
  if not physical:
    raise SystemExit(f"no {kind} device on this machine")
  extra = {"memory_limit": 4096} if FLAGS.gpu else {}
  tf.config.set_logical_device_configuration(
      physical[0], [tf.config.LogicalDeviceConfiguration(**extra)] * FLAGS.devices)


def main(argv):
  del argv
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  _devices()
  import tempfile  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import models  # pylint: disable=import-outside-toplevel
  import tfsplit.keras  # pylint: disable=import-outside-toplevel
  from tfsplit.errors import TfsplitError  # pylint: disable=import-outside-toplevel
  from tfsplit.keras.flavors import flavor_of  # pylint: disable=import-outside-toplevel

  def data(n, seed):
    ex = models.build(FLAGS.model, size=FLAGS.size, seed=0, batch_size=FLAGS.batch)
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, ex.config.vocab, [n, ex.config.seq + 1], dtype=np.int32)
    return tf.data.Dataset.from_tensor_slices((seq[:, :-1], seq[:, 1:])).batch(
        FLAGS.batch, drop_remainder=True)

  def train(split):
    model = models.build(FLAGS.model, size=FLAGS.size, seed=0, batch_size=FLAGS.batch).model
    K = flavor_of(model).module
    target = (tfsplit.keras.split(model, mesh=FLAGS.mesh, microbatches=FLAGS.microbatches)
              if split else model)
    target.compile(optimizer=K.optimizers.Adam(1e-3),
                   loss=K.losses.SparseCategoricalCrossentropy(from_logits=True),
                   metrics=[K.metrics.SparseCategoricalAccuracy(name="acc")])
    suffix = ".weights.h5" if K.__name__ == "keras" else ".h5"
    path = FLAGS.checkpoint or os.path.join(tempfile.mkdtemp(), "best" + suffix)
    history = target.fit(
        data(FLAGS.examples, 1), epochs=FLAGS.epochs, verbose=2 if split else 0,
        validation_data=data(FLAGS.examples // 2, 2),
        callbacks=[K.callbacks.ModelCheckpoint(path, monitor="val_loss", save_best_only=True,
                                               save_weights_only=True)])
    return history.history, model.get_weights(), path

  try:
    got, got_weights, path = train(split=True)
  except TfsplitError as e:
    raise SystemExit(f"tfsplit: {e}") from None
  print(f"split fit on mesh {FLAGS.mesh} (m={FLAGS.microbatches}): "
        + ", ".join(f"{k} {[round(v, 5) for v in vals]}" for k, vals in got.items()))
  print(f"best weights (full, for the plain model): {path}")
  if FLAGS.compare:
    want, want_weights, _ = train(split=False)
    print("plain fit on one device:  "
          + ", ".join(f"{k} {[round(v, 5) for v in vals]}" for k, vals in want.items()))
    # Attention key biases get an identically zero gradient: Adam moves them
    # by rounding noise alone (values ~1e-7), so they are left out here.
    worst = max(float(np.abs(a - b).max() / np.abs(b).max())
                for a, b in zip(got_weights, want_weights) if np.abs(b).max() > 1e-4)
    history = max(abs(g - w) / abs(w) for k in want for g, w in zip(got[k], want[k]) if w)
    print(f"largest relative difference: history {history:.2e}, weights {worst:.2e} "
          "(of each tensor's largest value)")


if __name__ == "__main__":
  app.run(main)
