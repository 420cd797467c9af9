"""Benchmark: training-step time of tfsplit's data parallelism against
tf.distribute.MirroredStrategy, with and without gradient buckets.

In one process, on logical devices configured before TensorFlow starts (CPUs
by default), for one example model (default: the Keras 3 GPT, small) at one
global batch, measures ms per training step of:

  one device            the example's own tf.function step
  mirrored dp=2         MirroredStrategy over 2 devices: a fresh instance of the
                        same example built under strategy.scope(), stepped with
                        strategy.run (Keras sums the replicas' gradients)
  tfsplit dp=2          buckets of --bucket_mb MiB (the default), and 0 (one
                        all-reduce per gradient)
  tfsplit dp=2,tp=2     4 devices, buckets of --bucket_mb MiB
  mirrored dp=4         MirroredStrategy over the same 4 devices: what going
                        from 2 devices to 4 costs on this machine with TF's own
                        data parallelism (logical devices share the cores), the
                        reference for dp=2,tp=2 against dp=2

Inputs are placed once before timing. Every configuration is warmed up
(tracing, Grappler), then measured in --rounds rounds of --steps steps each,
the configurations taking turns within a round so that load from other
processes spreads over all of them. The median over every measured step is
reported with its 10th-90th percentile spread and the spread of the round
medians, each as a ratio to its baseline: dp=2 vs MirroredStrategy, dp=2,tp=2
vs bucketed dp=2, MirroredStrategy dp=4 vs its dp=2, one device vs nothing. The data-axis all-reduces per device
in each tfsplit graph are printed beside it.

Then the Keras fit path (--fit, on by default; Keras models only): seconds
per epoch of --fit_steps batches of `model.fit` on

  plain fit             the model on one device
  mirrored fit dp=2     a fresh instance built and compiled under
                        MirroredStrategy's scope
  tfsplit.keras dp=2    tfsplit.keras.split(model, mesh="dp=2")
  tfsplit.keras dp=2,tp=2

each fit(epochs=1) call taking turns in --rounds rounds after one warm-up
call each; the epoch is timed by a callback (on_epoch_begin to
on_epoch_end), so Keras' per-call set-up is left out. Ratios: tfsplit dp=2
against plain fit and against MirroredStrategy fit.

tfsplit's collectives run without a timeout here by default, as
MirroredStrategy's do (--collective_timeout): with one, TensorFlow starts
watchdog threads for every collective run, which live as long as the timeout.

    python tools/bench_step.py [--model gpt_keras3] [--size small] [--batch 16]
        [--config hidden=256,seq=128]
        [--steps 20] [--rounds 5] [--warmup 3] [--bucket_mb 25] [--devices 4]
        [--collective_timeout 0] [--nofit] [--fit_steps 10]
"""
import collections
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top
from absl import logging  # pylint: disable=g-import-not-at-top

import benchlib  # pylint: disable=g-import-not-at-top,wrong-import-position
from benchlib import define_example_flags  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
define_example_flags("small")
FLAGS.set_default("model", "gpt_keras3")
flags.DEFINE_list("config", [], "Overrides of the size's config, e.g. "
                  "hidden=256,seq=128 (a GPT whose step is compute-bound).")
flags.DEFINE_integer("batch", 16, "Global batch (divisible by 4).", lower_bound=4)
flags.DEFINE_integer("steps", 20, "Measured steps per configuration and round.",
                     lower_bound=1)
flags.DEFINE_integer("rounds", 5, "Rounds; the configurations take turns in each.",
                     lower_bound=1)
flags.DEFINE_integer("warmup", 3, "Unmeasured steps per configuration first.",
                     lower_bound=1)
flags.DEFINE_float("bucket_mb", 25.0, "Gradient bucket size (MiB) of the bucketed runs.")
flags.DEFINE_float("collective_timeout", 0.0,
                   "Timeout (s) of tfsplit's collectives; 0: none, as MirroredStrategy's "
                   "default. With a timeout TF starts a watchdog thread per collective "
                   "run that lives that long, so hundreds of steps of hundreds of "
                   "collectives pile up threads.", lower_bound=0.0)
flags.DEFINE_integer("devices", 4, "Logical devices to configure (at least 4).",
                     lower_bound=4)
flags.DEFINE_enum("device_type", "CPU", ["CPU", "GPU"],
                  "Device type; logical CPUs, or the first GPU split into logical GPUs.")
flags.DEFINE_integer("gpu_memory_mb", 4096, "Memory per logical GPU.")
flags.DEFINE_bool("fit", True, "Also time Keras fit: plain, MirroredStrategy, tfsplit.keras.")
flags.DEFINE_integer("fit_steps", 10, "Batches per timed fit epoch.", lower_bound=1)


def _build():
  """A fresh instance of the benchmarked example (same seed each time)."""
  import models  # pylint: disable=import-outside-toplevel
  overrides = {}
  for item in FLAGS.config:
    key, _, value = item.partition("=")
    overrides[key.strip()] = int(value)
  return models.build(FLAGS.model, size=FLAGS.size, seed=0, batch_size=FLAGS.batch,
                      **overrides)


def _mirrored_step(devices, inputs, group_key_start=None):
  """(step, per-replica args) of MirroredStrategy over `devices`, on a fresh
  instance of the example built under its scope.

  group_key_start: a second strategy in the process over other devices needs
  its own collective group keys (TF refuses a group key joined with two
  sizes); only TF's internal all-reduce takes them."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from models import common  # pylint: disable=import-outside-toplevel
  cross_device_ops = None
  if group_key_start is not None:
    from tensorflow.python.distribute import cross_device_ops as ops_lib  # pylint: disable=import-outside-toplevel
    from tensorflow.python.distribute import cross_device_utils  # pylint: disable=import-outside-toplevel
    cross_device_ops = ops_lib.CollectiveAllReduce(
        devices, len(devices), tf.distribute.experimental.CommunicationOptions(),
        collective_keys=cross_device_utils.CollectiveKeys(group_key_start=group_key_start))
  strategy = tf.distribute.MirroredStrategy(devices=devices,
                                            cross_device_ops=cross_device_ops)
  n = strategy.num_replicas_in_sync
  with strategy.scope():
    ex = _build()
  model, optimizer = ex.model, ex.optimizer
  variables = list(model.trainable_variables)

  @tf.function(autograph=False)
  def step(*args):
    def replica(*local):
      with tf.GradientTape() as tape:
        # Each replica's mean over its share; Keras sums the replicas' gradients.
        loss = common.sparse_xent(local[-1], model(local[0], training=True)) / n
      grads = tape.gradient(loss, variables)
      optimizer.apply_gradients(zip(grads, variables))
      return loss
    return strategy.reduce(tf.distribute.ReduceOp.SUM,
                           strategy.run(replica, args=args), axis=None)

  share = FLAGS.batch // n

  def values(x):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(x[ctx.replica_id_in_sync_group * share:
                                  (ctx.replica_id_in_sync_group + 1) * share]))
  return step, [values(x) for x in inputs]


def _fit_section(devices):
  """Epoch seconds of plain, MirroredStrategy and tfsplit.keras fit (see the
  module doc); prints the table."""
  import time  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import tfsplit.keras  # pylint: disable=import-outside-toplevel
  from tfsplit.keras.flavors import flavor_of  # pylint: disable=import-outside-toplevel

  ex = _build()
  if ex.model is None:
    print(f"\n{FLAGS.model} has no Keras model: no fit figures")
    return
  K = flavor_of(ex.model).module
  batches = [ex.make_inputs("train", seed=1 + i) for i in range(FLAGS.fit_steps)]
  arrays = tuple(np.concatenate([b[i] for b in batches]) for i in range(len(batches[0])))
  x, y = (arrays[0] if len(arrays) == 2 else arrays[:-1]), arrays[-1]
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
      FLAGS.batch, drop_remainder=True).cache()

  def compiled(target):
    target.compile(optimizer=K.optimizers.Adam(1e-3),
                   loss=K.losses.SparseCategoricalCrossentropy(from_logits=True))
    return target

  def fresh():
    return _build().model

  strategy = tf.distribute.MirroredStrategy(devices=devices[:2])
  with strategy.scope():
    mirrored = compiled(fresh())
  configs = collections.OrderedDict()
  configs["plain fit"] = compiled(ex.model)
  configs["mirrored fit dp=2"] = mirrored
  timeout = FLAGS.collective_timeout or None
  configs["tfsplit.keras dp=2"] = compiled(
      tfsplit.keras.split(fresh(), mesh="dp=2", timeout_seconds=timeout))
  configs["tfsplit.keras dp=2,tp=2"] = compiled(
      tfsplit.keras.split(fresh(), mesh="dp=2,tp=2", timeout_seconds=timeout))

  class EpochTimer(K.callbacks.Callback):

    def __init__(self):
      super().__init__()
      self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
      self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
      self.seconds.append(time.perf_counter() - self._start)

  timers = {name: EpochTimer() for name in configs}
  for name, model in configs.items():  # warm-up: tracing, splitting
    model.fit(dataset, epochs=1, verbose=0)
  for _ in range(FLAGS.rounds):
    for name, model in configs.items():
      model.fit(dataset, epochs=1, verbose=0, callbacks=[timers[name]])
  median = {name: statistics.median(t.seconds) for name, t in timers.items()}
  print(f"\nKeras fit ({K.__name__} {K.__version__}): {FLAGS.fit_steps} batches of "
        f"{FLAGS.batch} per epoch, {FLAGS.rounds} epochs each after one warm-up fit")
  header = f"{'configuration':<26} {'s/epoch':>8} {'min':>7} {'max':>7}  ratio"
  print(header)
  print("-" * len(header))
  baselines = {"tfsplit.keras dp=2": ("plain fit", "mirrored fit dp=2"),
               "tfsplit.keras dp=2,tp=2": ("plain fit", "mirrored fit dp=2"),
               "mirrored fit dp=2": ("plain fit",)}
  for name, t in timers.items():
    ratios = ", ".join(f"{median[name] / median[b]:.2f} x {b}"
                       for b in baselines.get(name, ()))
    print(f"{name:<26} {median[name]:>8.3f} {min(t.seconds):>7.3f} {max(t.seconds):>7.3f}  "
          f"{ratios}")


def _dp_reduces(result):
  """CollectiveReduceV2 over 'dp' per device (max over devices) in a split graph."""
  from tensorflow.python.framework import tensor_util  # pylint: disable=import-outside-toplevel
  nodes = {n.name: n for n in result.graph_def.node}

  def value(text):
    return int(tensor_util.MakeNdarray(nodes[text.split(":")[0]].attr["value"].tensor))
  members = collections.defaultdict(list)
  for n in result.graph_def.node:
    if n.op == "CollectiveReduceV2":
      members[(value(n.input[2]), value(n.input[3]))].append(result.records[n.name].device_id)
  dp_groups = {tuple(g) for g in result.mesh.groups("dp")}
  per_device = collections.Counter(d for ids in members.values()
                                   if tuple(sorted(ids)) in dp_groups for d in ids)
  return max(per_device.values()) if per_device else 0


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  devices = benchlib.logical_devices(FLAGS.device_type, FLAGS.devices, FLAGS.gpu_memory_mb)
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import tfsplit  # pylint: disable=import-outside-toplevel

  ex = _build()
  inputs = ex.make_inputs("train", seed=1)
  placed = [tf.constant(x) for x in inputs]
  names = list(zip(ex.all_variables(), ex.variable_names()))
  bucket = int(round(FLAGS.bucket_mb * 2**20))

  def split(mesh, bucket_bytes):
    step = tfsplit.split(ex.train_step, mesh=mesh, input_signature=ex.train_signature,
                         variable_names=names, bucket_bytes=bucket_bytes,
                         timeout_seconds=FLAGS.collective_timeout)
    return step, placed, _dp_reduces(step.result)

  mirrored, mirrored_args = _mirrored_step(devices[:2], inputs)
  # name: (step, args, dp all-reduces per device, baseline name)
  configs = collections.OrderedDict()
  configs["one device"] = (ex.train_step, placed, None, None)
  configs["mirrored dp=2"] = (mirrored, mirrored_args, None, None)
  configs[f"tfsplit dp=2 buckets {FLAGS.bucket_mb:g} MiB"] = \
      split("dp=2", bucket) + ("mirrored dp=2",)
  configs["tfsplit dp=2 no buckets"] = split("dp=2", 0) + ("mirrored dp=2",)
  configs[f"tfsplit dp=2,tp=2 buckets {FLAGS.bucket_mb:g} MiB"] = \
      split("dp=2,tp=2", bucket) + (f"tfsplit dp=2 buckets {FLAGS.bucket_mb:g} MiB",)
  if len(devices) >= 4 and FLAGS.batch % 4 == 0:
    mirrored4, mirrored4_args = _mirrored_step(devices[:4], inputs, group_key_start=1000)
    configs["mirrored dp=4"] = (mirrored4, mirrored4_args, None, "mirrored dp=2")

  samples, round_medians = benchlib.take_turns(
      {name: (fn, args) for name, (fn, args, _, _) in configs.items()},
      FLAGS.warmup, FLAGS.rounds, FLAGS.steps)
  median = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
  print(f"{FLAGS.model} {FLAGS.size}, global batch {FLAGS.batch}, {FLAGS.device_type} "
        f"logical devices, {FLAGS.rounds} rounds x {FLAGS.steps} steps after "
        f"{FLAGS.warmup} warm-up steps, {os.cpu_count()} cores, tfsplit collective "
        f"timeout {FLAGS.collective_timeout:g} s")
  header = f"{'configuration':<34} {benchlib.TIMING_HEADER} {'dp AR/dev':>9}  ratio"
  print(header)
  print("-" * len(header))
  for name, (_, _, reduces, baseline) in configs.items():
    ratio = f"{median[name] / median[baseline]:.2f} x {baseline}" if baseline else ""
    print(f"{name:<34} {benchlib.timing_columns(samples[name], round_medians[name])} "
          f"{'' if reduces is None else reduces:>9}  {ratio}")
  if FLAGS.fit:
    _fit_section(devices)

if __name__ == "__main__":
  app.run(main)
