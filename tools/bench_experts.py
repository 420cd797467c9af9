"""Benchmark: expert parallelism against the tensor-parallel split of the same
experts, on a corpus mixture-of-experts decoder.

In one process, on --devices logical devices (CPUs by default), for one
corpus MoE decoder (default: `switch_keras3`, GShard capacity dispatch, size
small), measures per configuration:

  expert MiB/dev   bytes of the stacked expert weights and their optimizer
                   slots on the fullest device (from the split's manifest)
  ms/step          median training step over every measured call, with the
                   ratio to the `dp=N` baseline of the same device count
  a2a, gather      collectives over 'ep' per step (token exchanges)

for `one device`, `dp=2`, `ep=2`, `tp=2` and, with 4 devices, `dp=4`,
`dp=2,ep=2`, `ep=4`, `tp=4` (tp: the megatron preset splits each stacked
expert matrix over tp; every device sees every token of its replica). The
configurations take turns in --rounds rounds (benchlib.take_turns), so load
from other processes spreads over all of them; logical devices share this
machine's cores, so a step's time here says what the split costs in
communication and copies, not what it would gain on real devices.

    python tools/bench_experts.py [--model switch_keras3] [--size small]
        [--experts 4] [--batch 16] [--steps 10] [--rounds 3] [--devices 4]
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
define_example_flags("small", "a corpus MoE decoder: switch_* or moe_*")
FLAGS.set_default("model", "switch_keras3")
flags.DEFINE_integer("experts", None, "Experts per layer (default: the size's).")
flags.DEFINE_integer("batch", 16, "Global batch (divisible by 4).", lower_bound=4)
flags.DEFINE_integer("steps", 10, "Measured steps per configuration and round.",
                     lower_bound=1)
flags.DEFINE_integer("rounds", 3, "Rounds; the configurations take turns in each.",
                     lower_bound=1)
flags.DEFINE_integer("warmup", 2, "Unmeasured steps per configuration first.",
                     lower_bound=1)
flags.DEFINE_integer("devices", 4, "Logical devices to configure (2 or 4).", lower_bound=2)


def expert_state_bytes(manifest, experts):
  """Bytes of expert weights and optimizer slots on the fullest device: the
  manifest's variables shaped like a stacked expert weight ([experts, ...],
  rank 3 or more; an Adam moment has its weight's shape)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from tfsplit.passes.manifest import bytes_per_device  # pylint: disable=import-outside-toplevel
  names = {n for n, e in manifest.items()
           if len(e["shape"]) >= 3 and e["shape"][0] == experts}
  held = bytes_per_device(manifest, names)
  whole = sum(int(np.prod(manifest[n]["shape"])) * np.dtype(manifest[n]["dtype"]).itemsize
              for n in names)
  return max(held.values()), whole


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  devices = benchlib.logical_devices("CPU", FLAGS.devices)
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import models  # pylint: disable=import-outside-toplevel
  import tfsplit  # pylint: disable=import-outside-toplevel

  config = {"experts": FLAGS.experts} if FLAGS.experts else {}
  ex = models.build(FLAGS.model, size=FLAGS.size, seed=0, batch_size=FLAGS.batch, **config)
  experts = ex.config.experts
  placed = [tf.constant(x) for x in ex.make_inputs("train", seed=1)]
  names = list(zip(ex.all_variables(), ex.variable_names()))
  meshes = ["dp=2", "ep=2", "tp=2"]
  if len(devices) >= 4:
    meshes += ["dp=4", "dp=2,ep=2", "ep=4", "tp=4"]
  # name: (step, args, baseline, expert bytes on the fullest device, whole, a2a, gathers)
  rows = collections.OrderedDict()
  whole = None
  for mesh in meshes:
    step = tfsplit.split(ex.train_step, mesh=mesh, input_signature=ex.train_signature,
                         variable_names=names, timeout_seconds=0)
    held, whole = expert_state_bytes(step.result.manifest, experts)
    size = step.result.config.mesh.size
    rows[mesh] = (step, placed, f"dp={size}", held,
                  step.result.count("all_to_all", "ep"), step.result.count("all_gather", "ep"))
  rows = collections.OrderedDict([("one device", (ex.train_step, placed, None, whole, 0, 0)),
                                  *rows.items()])
  samples, _ = benchlib.take_turns({n: (r[0], r[1]) for n, r in rows.items()},
                                   FLAGS.warmup, FLAGS.rounds, FLAGS.steps)
  median = {n: statistics.median(s) * 1e3 for n, s in samples.items()}
  print(f"{FLAGS.model} {FLAGS.size}, {experts} experts x {ex.config.blocks} layers, global "
        f"batch {FLAGS.batch}, {len(devices)} logical CPUs; expert weights + Adam slots "
        f"{whole / 2**20:.3g} MiB in all")
  print(f"{'config':<12} {'expert MiB/dev':>14} {'share':>6} {'ms/step':>9} "
        f"{'vs dp=N':>8} {'a2a':>4} {'gather':>6}")
  for name, (_, _, base, held, a2a, gathers) in rows.items():
    ratio = f"{median[name] / median[base]:.2f}x" if base in median else "-"
    print(f"{name:<12} {held / 2**20:>14.3g} {held / whole:>6.2f} {median[name]:>9.1f} "
          f"{ratio:>8} {a2a:>4} {gathers:>6}")


if __name__ == "__main__":
  app.run(main)
