"""Benchmark: activation memory and step time of recomputation, against none.

For each model (default: the GPT examples; `corpus` stands for every corpus
model, models.CORPUS_NAMES), in a fresh Python process of its own, splits its
training step with `tfsplit.split(..., mesh=--mesh, recompute=mode)` for mode
= none (the baseline: the same graph, same mesh, no recomputation) and each of
--modes, and runs them under the split step's own Grappler config (TF's
default optimizers, one meta-optimizer round: runtime/graph_function.py).
Activation memory of a step is the allocator's peak minus what was in use
just before it (variables, inputs; benchlib.step_memory), the median over
--steps steps after --warmup steps. Step time is the best wall time of one
step over --rounds x --time_steps steps per mode, the modes taking turns step
by step (so a busy machine slows them alike; the median is printed beside
it; --rounds 0 times nothing). Each mode is printed beside the baseline as
ratios: memory kept (mode / none), how many times less (none / mode) and time
(mode / none). The last lines give each model's ratios against the targets
(blocks: at most 0.4 of the activation memory, i.e. 2.5x less, for at most
1.4x the step time).

One process per model, as bench_microbatch.py measures: all CPU devices of a
process share one BFC allocator, and what earlier models leave in it moves a
later model's peak. The script runs itself with --one=MODEL for each model,
bounded by --timeout, echoes that process's output and reads its ratios back
from one result line (benchlib.run_script); a model whose process fails gets
one FAILED line among the summary lines, the others still run, and the exit
status is 1.

Memory statistics on CPU need TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow
is imported (set below). TensorFlow runs with its default inter-op threads
(one per core) unless --inter_op_threads says otherwise. When no thread is
idle (one inter-op thread, or dp=2 on two cores: a thread per replica) the
executor runs depth-first and defers gradient ops off the critical path, a
bias's BiasAddGrad until the end of the step; recomputation orders them
before each segment's copies (memory/recompute.py: drains), or the
activation-sized gradients they read stay alive across the whole backward.
--explain profiles one more step per mode and prints what is alive at its
peak: recomputed copies, other backward ops, forward ops.

    python tools/bench_recompute.py [--models gpt_raw,gpt_keras3,gpt_tfkeras|corpus]
        [--size small] [--batch 64] [--mesh dp=1] [--modes blocks,selective]
        [--steps 5] [--rounds 5] [--time_steps 3] [--explain] [--timeout 900]
"""
import gc
import os
import statistics
import sys
import time

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # before TensorFlow is imported
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

from benchlib import (buffers_at_peak, memory_events, print_peak, print_result,  # pylint: disable=g-import-not-at-top,wrong-import-position
                      run_script, step_memory)

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["gpt_raw", "gpt_keras3", "gpt_tfkeras"],
                  "Example models (examples/models names; 'corpus': every corpus model).")
flags.DEFINE_string("size", "small", "Example size: tiny, small or large.")
flags.DEFINE_integer("batch", 64, "Batch size.", lower_bound=1)
flags.DEFINE_string("mesh", "dp=1", "Mesh every step is split over (dp=1: one device).")
flags.DEFINE_list("modes", ["blocks", "selective"], "Recompute modes against none.")
flags.DEFINE_integer("steps", 5, "Measured steps for memory (median).", lower_bound=1)
flags.DEFINE_integer("warmup", 2, "Unmeasured steps first.", lower_bound=0)
flags.DEFINE_integer("rounds", 5, "Timing rounds (every mode once per round; 0: no timing).",
                     lower_bound=0)
flags.DEFINE_integer("time_steps", 3, "Timed steps per mode per round.", lower_bound=1)
flags.DEFINE_integer("inter_op_threads", 0, "TensorFlow inter-op threads (0: TensorFlow's "
                     "default, one per core).", lower_bound=0)
flags.DEFINE_boolean("explain", False,
                     "Profile one step per mode and print the tensors alive at its peak.")
flags.DEFINE_integer("explain_top", 12, "Live tensors to print per mode with --explain.")
flags.DEFINE_float("timeout", 900, "Seconds each model's process may run.", lower_bound=1)
flags.DEFINE_string("one", None, "Internal: measure this model here and print one "
                    "result line.")

_MIB = 2.0**20
_NONE = "none"
BLOCKS_TARGET = 0.4       # activation memory kept by recompute=blocks, at most
TIME_TARGET = 1.4         # its step time against none, at most


def _device():
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def _step_seconds(fn, inputs):
  t0 = time.perf_counter()
  float(fn(*inputs))
  return time.perf_counter() - t0


def _kind_of(graph_def):
  """op name -> 'recomputed', 'backward' or 'forward' for a profile's ops (a
  split step's nodes; names Grappler made fall to their scope's kind)."""
  from tfsplit import constants  # pylint: disable=import-outside-toplevel
  from tfsplit.memory import recompute as recompute_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.sharding.builder import read_records  # pylint: disable=import-outside-toplevel
  copies, records = recompute_lib.copies_of(graph_def), read_records(graph_def)

  def kind(op):
    name = op
    while name and name not in records:
      name = name.rpartition("/")[0]
    if name in copies:
      return "recomputed"
    source = records[name].source if name else op
    return "backward" if constants.is_gradient_name(source) else "forward"
  return kind


def _measure_model(name, modes, device):
  """Prints one model's table; returns {mode: {act, memory, time}}: activation
  bytes, their ratio to none's and the step time's (None untimed)."""
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
    if FLAGS.explain:
      print(f"[{name} recompute={mode}] split step")
      peak, live = buffers_at_peak(memory_events(step, inputs))
      print_peak(peak, live, FLAGS.explain_top, _kind_of(step.graph_def), "kind")
    gc.collect()
  times = {mode: [] for mode in steps}
  for _ in range(FLAGS.rounds * FLAGS.time_steps):
    for mode, step in steps.items():
      times[mode].append(_step_seconds(step, inputs))
  for mode in steps:
    rows[mode].append((min(times[mode]), statistics.median(times[mode]))
                      if times[mode] else (None, None))
  timing = (f"time: best (and median) of {FLAGS.rounds * FLAGS.time_steps} steps, the "
            "modes taking turns step by step" if FLAGS.rounds else "not timed")
  print(f"{name}/{FLAGS.size} batch {FLAGS.batch} on {device}, mesh {FLAGS.mesh}, "
        f"{FLAGS.inter_op_threads or 'default'} inter-op threads; memory: median of "
        f"{FLAGS.steps} steps after {FLAGS.warmup} warm-up; {timing}")
  header = (f"{'recompute':>10} {'nodes':>6} {'copies':>6} {'peak MiB':>9} {'act MiB':>8} "
            f"{'min-max':>13} {'kept':>6} {'x less':>7} {'ms/step':>8} {'median':>7} "
            f"{'time x':>7} {'loss':>8}")
  print(header)
  print("-" * len(header))
  _, _, (_, _, ref_act, _, _, _), (ref_time, _) = rows[_NONE]
  results = {}
  for mode, (nodes, copies, (peak, _, act, lo, hi, loss), (seconds, median)) in rows.items():
    ratio = seconds / ref_time if seconds is not None else None
    results[mode] = {"act": act, "memory": act / ref_act, "time": ratio}
    clock = (f"{seconds * 1e3:>8.1f} {median * 1e3:>7.1f} {ratio:>7.2f}"
             if seconds is not None else f"{'-':>8} {'-':>7} {'-':>7}")
    print(f"{mode:>10} {nodes:>6} {copies:>6} {peak / _MIB:>9.2f} {act / _MIB:>8.2f} "
          f"{lo / _MIB:>6.2f}-{hi / _MIB:<6.2f} {act / ref_act:>6.3f} {ref_act / act:>7.2f} "
          f"{clock} {loss:>8.4f}")
  print()
  del steps
  gc.collect()
  return results


def _measure_here(name):
  """Measures one model in this process (a fresh one)."""
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
  modes = [m for m in FLAGS.modes if m != _NONE]
  return _measure_model(name, modes, _device())


def model_names(names):
  """--models with 'corpus' expanded to every corpus model."""
  import models  # pylint: disable=import-outside-toplevel
  out = []
  for name in names:
    out.extend(models.CORPUS_NAMES if name == "corpus" else [name])
  return list(dict.fromkeys(out))


def main(argv):
  del argv
  if FLAGS.one:
    print_result(_measure_here(FLAGS.one))
    return 0
  results = {}  # name: {mode: {...}} or the reason its process failed
  for name in model_names(FLAGS.models):
    try:
      results[name] = run_script(__file__, sys.argv[1:] + [f"--one={name}"], FLAGS.timeout)
    except RuntimeError as e:
      results[name] = str(e)
  print("act = peak - memory in use just before the step; kept = act(mode) / act(none); "
        "x less = act(none) / act(mode); time x = best step time(mode) / best step "
        "time(none) (the best of many steps: on a shared machine the median moves with "
        "the load); loss = first loss of the step (every step starts from the same values)")
  for name, by_mode in results.items():
    label = f"[{name} {FLAGS.size} b={FLAGS.batch} {FLAGS.mesh}]"
    if isinstance(by_mode, str):
      print(f"{label} FAILED: {by_mode} (its output is above)")
      continue
    for mode, r in by_mode.items():
      if mode == _NONE:
        continue
      target = (f" (target: at most {BLOCKS_TARGET:g} kept, at most {TIME_TARGET:.2f}x "
                "the time)" if mode == "blocks" else "")
      clock = f", step time {r['time']:.2f}x" if r["time"] is not None else ""
      print(f"{label} recompute={mode}: activation memory {r['memory']:.3f} kept, "
            f"{1 / r['memory']:.2f}x less{clock}{target}")
  return 1 if any(isinstance(r, str) for r in results.values()) else 0


if __name__ == "__main__":
  app.run(main)
