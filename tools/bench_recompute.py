"""Benchmark: activation memory and step time of recomputation, against none.

For each GPT-style example, in one process, splits its training step with
`tfsplit.split(..., mesh=--mesh, recompute=mode)` for mode = none (the
baseline: the same graph, same mesh, no recomputation) and each of --modes,
and runs them under the split step's own Grappler config (TF's default
optimizers, one meta-optimizer round: runtime/graph_function.py). Activation
memory of a step is the allocator's peak minus what was in use just before
it (variables, inputs; benchlib.step_memory), the median over --steps steps
after a warm-up step. Step time is the best wall time of one step over
--rounds x --time_steps steps per mode, the modes taking turns step by step
(so a busy machine slows them alike; the median is printed beside it). Each
mode is printed beside the baseline as two ratios: memory (none / mode: how
many times less) and time (mode / none). The last lines
give each model's blocks and selective ratios against the targets (blocks: at
least 2.5x less activation memory for at most 1.4x the step time).

Memory statistics on CPU need TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow
is imported (set below). TensorFlow runs with its default inter-op threads
(one per core). With --inter_op_threads 1 the executor runs depth-first (a
worker takes the ops it scheduled itself last in, first out) and defers
gradient ops off the critical path, a bias's BiasAddGrad until the end of the
step: the activation-sized gradient each of them reads stays alive across the
blocks' backward passes, with or without recomputation, and recomputation
then saves less (1.7x on the small raw GPT, against 3x with two threads).

    python tools/bench_recompute.py [--models gpt_raw,gpt_keras3,gpt_tfkeras]
        [--size small] [--batch 64] [--mesh dp=1] [--modes blocks,selective]
        [--steps 5] [--rounds 5] [--time_steps 3]
"""
import gc
import os
import statistics
import time

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # before TensorFlow is imported
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

from benchlib import step_memory  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["gpt_raw", "gpt_keras3", "gpt_tfkeras"],
                  "Example models (examples/models names).")
flags.DEFINE_string("size", "small", "Example size: tiny, small or large.")
flags.DEFINE_integer("batch", 64, "Batch size.", lower_bound=1)
flags.DEFINE_string("mesh", "dp=1", "Mesh every step is split over (dp=1: one device).")
flags.DEFINE_list("modes", ["blocks", "selective"], "Recompute modes against none.")
flags.DEFINE_integer("steps", 5, "Measured steps for memory (median).", lower_bound=1)
flags.DEFINE_integer("warmup", 2, "Unmeasured steps first.", lower_bound=0)
flags.DEFINE_integer("rounds", 5, "Timing rounds (every mode once per round).",
                     lower_bound=1)
flags.DEFINE_integer("time_steps", 3, "Timed steps per mode per round.", lower_bound=1)
flags.DEFINE_integer("inter_op_threads", 0, "TensorFlow inter-op threads (0: TensorFlow's "
                     "default, one per core).", lower_bound=0)

_MIB = 2.0**20
_NONE = "none"


def _device():
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def _step_seconds(fn, inputs):
  t0 = time.perf_counter()
  float(fn(*inputs))
  return time.perf_counter() - t0


def _measure_model(name, modes, device):
  """Prints one model's table; returns {mode: (memory ratio, time ratio)}."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import tfsplit  # pylint: disable=import-outside-toplevel
  from tfsplit.memory import recompute as recompute_lib  # pylint: disable=import-outside-toplevel
  import models  # pylint: disable=import-outside-toplevel
  ex = models.build(name, size=FLAGS.size, seed=0, batch_size=FLAGS.batch)
  names = list(zip(ex.all_variables(), ex.variable_names()))
  inputs = [tf.constant(x) for x in ex.make_inputs("train", seed=1)]
  steps, rows = {}, {}
  for mode in [_NONE] + modes:
    step = tfsplit.split(ex.train_step, mesh=FLAGS.mesh, recompute=mode,
                         input_signature=ex.train_signature, variable_names=names)
    copies = recompute_lib.copies_of(step.graph_def)
    problems = recompute_lib.check(step.graph_def) if copies else []
    if problems:
      raise SystemExit(f"{name} {mode}: {problems[0]}")
    steps[mode] = step
    rows[mode] = [len(step.graph_def.node), len(copies),
                  step_memory(step, inputs, device, FLAGS.steps, FLAGS.warmup)]
    gc.collect()
  times = {mode: [] for mode in steps}
  for _ in range(FLAGS.rounds * FLAGS.time_steps):
    for mode, step in steps.items():
      times[mode].append(_step_seconds(step, inputs))
  for mode in steps:
    rows[mode].append((min(times[mode]), statistics.median(times[mode])))
  print(f"{name}/{FLAGS.size} batch {FLAGS.batch} on {device}, mesh {FLAGS.mesh}, "
        f"{FLAGS.inter_op_threads or 'default'} inter-op threads; memory: median of {FLAGS.steps} "
        f"steps after {FLAGS.warmup} warm-up; time: best (and median) of "
        f"{FLAGS.rounds * FLAGS.time_steps} steps, the modes taking turns step by step")
  header = (f"{'recompute':>10} {'nodes':>6} {'copies':>6} {'peak MiB':>9} {'act MiB':>8} "
            f"{'min-max':>13} {'mem x less':>10} {'ms/step':>8} {'median':>7} {'time x':>7} "
            f"{'loss':>8}")
  print(header)
  print("-" * len(header))
  _, _, (_, _, ref_act, _, _, _), (ref_time, _) = rows[_NONE]
  ratios = {}
  for mode, (nodes, copies, (peak, _, act, lo, hi, loss), (seconds, median)) in rows.items():
    ratios[mode] = (ref_act / act, seconds / ref_time)
    print(f"{mode:>10} {nodes:>6} {copies:>6} {peak / _MIB:>9.2f} {act / _MIB:>8.2f} "
          f"{lo / _MIB:>6.2f}-{hi / _MIB:<6.2f} {ref_act / act:>10.2f} "
          f"{seconds * 1e3:>8.1f} {median * 1e3:>7.1f} {seconds / ref_time:>7.2f} "
          f"{loss:>8.4f}")
  print()
  del steps
  gc.collect()
  return ratios


def main(argv):
  del argv
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  # Before any op runs (the thread pools are created with the context).
  if FLAGS.inter_op_threads:
    tf.config.threading.set_inter_op_parallelism_threads(FLAGS.inter_op_threads)
  size = 1
  for part in FLAGS.mesh.split(","):
    size *= int(part.split("=")[1])
  if not tf.config.list_physical_devices("GPU") and size > 1:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * size)
  device = _device()
  modes = [m for m in FLAGS.modes if m != _NONE]
  results = {name: _measure_model(name, modes, device) for name in FLAGS.models}
  print("act = peak - memory in use just before the step; mem x less = act(none) / "
        "act(mode); time x = best step time(mode) / best step time(none) (the best of "
        "many steps: on a shared machine the median moves with the load); loss = first "
        "loss of "
        "the step (every step starts from the same values)")
  for name, ratios in results.items():
    for mode in modes:
      memory, seconds = ratios[mode]
      target = (" (target: at least 2.5x less, at most 1.40x the time)"
                if mode == "blocks" else "")
      print(f"[{name} {FLAGS.size} b={FLAGS.batch} {FLAGS.mesh}] recompute={mode}: "
            f"activation memory {memory:.2f}x less, step time {seconds:.2f}x{target}")


if __name__ == "__main__":
  app.run(main)
