"""Benchmark: fully sharded data parallelism (zero=3) against ZeRO-1 and
tensor parallelism on the same devices.

In one process on --devices logical CPU devices, for one example model
(default: the corpus Llama, Keras 3, small), splits its training step as

  dp=N zero=1       the baseline: optimizer slots 1/dp, weights whole
  dp=N zero=3       FSDP: weights, gradient sums and slots 1/dp
  tp=N              Megatron over the same devices
  dp=N/2,tp=2 zero=3  (N >= 4) FSDP over dp, Megatron over tp

and prints, per configuration, the weight and optimizer-slot bytes each
device holds between steps (from the split's manifest: exact), the dp
collectives per device, and ms per step timed in turns (--rounds rounds of
--steps steps, warmed up first) with the ratio of each median to the
baseline's, measured in the same run. Every configuration's loss after the
timed steps is checked against the baseline's first step (same inputs, same
starting weights: each split starts from the model's values).

    python tools/bench_fsdp.py [--model llama_keras3] [--size small]
        [--devices 2] [--batch 8] [--steps 5] [--rounds 5] [--warmup 2]
"""
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402  pylint: disable=wrong-import-position

from absl import app  # noqa: E402  pylint: disable=wrong-import-position
from absl import flags  # noqa: E402  pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
benchlib.define_example_flags("small")
FLAGS.set_default("model", "llama_keras3")
flags.DEFINE_integer("devices", 2, "Logical CPU devices (N).", lower_bound=2)
flags.DEFINE_integer("batch", 8, "Global batch.", lower_bound=1)
flags.DEFINE_integer("steps", 5, "Steps per turn.", lower_bound=1)
flags.DEFINE_integer("rounds", 5, "Rounds of turns.", lower_bound=1)
flags.DEFINE_integer("warmup", 2, "Unmeasured calls per configuration.", lower_bound=1)


def _configs(n):
  out = [("dp=%d zero=1" % n, dict(mesh=f"dp={n}", zero=1)),
         ("dp=%d zero=3" % n, dict(mesh=f"dp={n}", zero=3)),
         ("tp=%d" % n, dict(mesh=f"tp={n}"))]
  if n >= 4 and n % 2 == 0:
    out.append((f"dp={n // 2},tp=2 zero=3", dict(mesh=f"dp={n // 2},tp=2", zero=3)))
  return out


def _held(result, n_devices):
  """(MiB of trainable weights, MiB of the other variables: optimizer slots,
  counters) the most loaded device holds."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  weights, slots = [0] * n_devices, [0] * n_devices
  for entry in result.manifest.values():
    size = np.dtype(entry["dtype"]).itemsize
    into = weights if entry.get("trainable") else slots  # slots and counters
    for shard in entry["shards"]:
      into[shard["device_id"]] += int(np.prod(shard["shape"], dtype=np.int64)) * size
  return max(weights) / 2**20, max(slots) / 2**20


def _dp_collectives(result):
  device = result.mesh.devices[0]
  ops = [n.op for n in result.graph_def.node
         if n.op.startswith("Collective") and n.device == device]
  return {op: ops.count(op) for op in sorted(set(ops))}


def main(argv):
  del argv
  benchlib.logical_devices("CPU", FLAGS.devices)
  import models  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import tfsplit  # pylint: disable=import-outside-toplevel
  ex = models.build(FLAGS.model, FLAGS.size, seed=0, batch_size=FLAGS.batch)
  inputs = [tf.constant(x) for x in ex.make_inputs("train", seed=1)]
  variables = ex.all_variables()
  start = [v.numpy() for v in variables]
  names = list(zip(variables, ex.variable_names()))
  steps, losses = {}, {}
  print(f"{FLAGS.model}:{FLAGS.size}, batch {FLAGS.batch}, {FLAGS.devices} logical CPU "
        f"devices, state (weights + slots) "
        f"{sum(v.numpy().nbytes for v in variables) / 2**20:.1f} MiB")
  print(f"{'config':<22} {'weights/dev':>11} {'slots/dev':>10}  collectives on device 0")
  for label, kwargs in _configs(FLAGS.devices):
    for v, s in zip(variables, start):
      v.assign(s)
    step = tfsplit.split(ex.train_step, input_signature=ex.train_signature,
                         variable_names=names, **kwargs)
    losses[label] = float(step(*inputs))
    weights, slots = _held(step.result, FLAGS.devices)
    print(f"{label:<22} {weights:>8.2f} MiB {slots:>6.2f} MiB  {_dp_collectives(step.result)}")
    steps[label] = (step, inputs)
  first = next(iter(losses.values()))
  for label, loss in losses.items():
    if abs(loss - first) > 1e-4 * max(1.0, abs(first)):
      raise SystemExit(f"{label}: first loss {loss} differs from the baseline's {first}")
  samples, rounds = benchlib.take_turns(steps, FLAGS.warmup, FLAGS.rounds, FLAGS.steps)
  base = statistics.median(next(iter(samples.values())))
  print(f"\n{'config':<22} {benchlib.TIMING_HEADER}  x baseline")
  for label in steps:
    print(f"{label:<22} {benchlib.timing_columns(samples[label], rounds[label])}  "
          f"{statistics.median(samples[label]) / base:.2f}")


if __name__ == "__main__":
  app.run(main)
