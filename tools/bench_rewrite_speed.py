"""Benchmark: how fast tfsplit.split gets a real training step running.

Builds a Keras GPT training step (default: the small GPT with 12 blocks,
hidden 64, batch 8) twice from the same seed, then measures in one process,
each against a baseline measured in the same run:

1. tfsplit.split end to end once the function is traced (load, split,
   shard-variable creation, import), against Grappler's OptimizeGraph
   (default config) on the same loaded graph; best of --repeats each, with
   the time of each part;
2. time to the first finished step: tracing, tfsplit.split and the first
   call of the split step, against the plain tf.function's first call
   (tracing, then Grappler, placement and the run);
3. the steady step time of the split step against the plain step on one
   device (median of --steps calls after the first).

Both first-step measurements come after a warm-up (a tiny model, plain and
split), so neither pays for starting TensorFlow's runtime.

    python tools/bench_rewrite_speed.py [--model gpt_keras3] [--blocks 12] [--hidden 64]
        [--batch 8] [--mesh tp=2] [--repeats 3] [--steps 10] [--profile]
"""
import cProfile
import dataclasses
import gc
import io
import os
import pstats
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top
from absl import logging  # pylint: disable=g-import-not-at-top

from benchlib import best_of  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "gpt_keras3", "A GPT of examples/models (gpt_keras3, "
                    "gpt_tfkeras or gpt_raw).")
flags.DEFINE_integer("blocks", 12, "Transformer blocks.")
flags.DEFINE_integer("hidden", 64, "Hidden size (a multiple of the small GPT's heads).")
flags.DEFINE_integer("batch", 8, "Static batch size.")
flags.DEFINE_string("mesh", "tp=2", "Mesh to split over.")
flags.DEFINE_integer("repeats", 3, "Best of this many runs for the end-to-end times.")
flags.DEFINE_integer("steps", 10, "Steady steps timed (median) after the first.")
flags.DEFINE_boolean("profile", False, "Print a cProfile of one tfsplit.split call.")
flags.DEFINE_integer("profile_top", 30, "Profile rows to print (by cumulative time).")


def _set_devices(count):
  """`count` logical CPU devices (unless the process has GPUs); before TF starts."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  if tf.config.list_physical_devices("GPU"):
    return
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * count)


def _build(name, cfg, seed=0):
  """An ExampleModel of GPT `name` with config `cfg` (not one of the sizes)."""
  from models import example  # pylint: disable=import-outside-toplevel
  family, flavor = example.split_name(name)
  if family != "gpt":
    raise app.UsageError(f"--model must be a GPT, got {name}")
  if flavor == "raw":
    from models import raw  # pylint: disable=import-outside-toplevel
    return raw.build(family, name, "custom", cfg, seed)
  from models import keras_models  # pylint: disable=import-outside-toplevel
  if flavor == "keras3":
    import keras as K  # pylint: disable=import-outside-toplevel
  else:
    import tf_keras as K  # pylint: disable=import-outside-toplevel
  return keras_models.build(K, name, "custom", cfg, seed)


def _names(ex):
  return list(zip(ex.all_variables(), ex.variable_names()))


def _timed(fn):
  t0 = time.perf_counter()
  result = fn()
  return time.perf_counter() - t0, result


def _steady(fn, inputs, steps):
  times = []
  for _ in range(steps):
    t, _ = _timed(lambda: _block(fn(*inputs)))
    times.append(t)
  return statistics.median(times)


def _block(outputs):
  """Waits for the step's outputs (a tensor or a list of them)."""
  for out in outputs if isinstance(outputs, (list, tuple)) else [outputs]:
    out.numpy()
  return outputs


def _parts(ex, mesh, repeats):
  """Best seconds of each part of tfsplit.split, in its order."""
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import split_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import shards  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime.graph_function import import_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime.split_function import _captured_variables  # pylint: disable=import-outside-toplevel
  concrete = ex.concrete("train")
  best = {}
  for _ in range(repeats):
    gc.collect()
    times = {}
    times["load"], graph_def = _timed(lambda: load_graph(concrete, variable_names=_names(ex)))
    times["split passes"], result = _timed(lambda: split_graph(graph_def, mesh))
    values = {k: v.numpy() for k, v in _captured_variables(concrete, graph_def).items()}
    times["shard variables"], variables = _timed(
        lambda: shards.create_shard_variables(result.manifest, values))
    times["import"], _ = _timed(lambda: import_graph(result.graph_def, variables))
    for key, value in times.items():
      best[key] = min(best.get(key, value), value)
  return best, graph_def, result


def main(argv):
  del argv
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # the pass logs one line per split op
  from tfsplit.layout.mesh import Mesh  # pylint: disable=import-outside-toplevel
  size = 1
  for n in Mesh.parse(FLAGS.mesh).axes.values():
    size *= n
  _set_devices(size)
  import tfsplit  # pylint: disable=import-outside-toplevel
  import models  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import grappler as grappler_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime.split_function import make_mesh  # pylint: disable=import-outside-toplevel

  cfg = dataclasses.replace(models.CONFIGS["gpt"]["small"], blocks=FLAGS.blocks,
                            hidden=FLAGS.hidden, batch=FLAGS.batch)
  # Warm-up: TensorFlow's runtime, the devices and the split code paths.
  tiny = models.build(FLAGS.model, "tiny")
  tiny_inputs = tiny.make_inputs("train", seed=1)
  _block(tiny.train_step(*tiny_inputs))
  _block(tfsplit.split(tiny.train_step, mesh=FLAGS.mesh, variable_names=_names(tiny))(
      *tiny_inputs))

  t0 = time.perf_counter()
  plain, split_ex = _build(FLAGS.model, cfg), _build(FLAGS.model, cfg)
  inputs = plain.make_inputs("train", seed=1)
  print(f"{FLAGS.model}: {cfg.blocks} blocks, hidden {cfg.hidden}, heads {cfg.heads}, "
        f"batch {cfg.batch}, seq {cfg.seq}, vocab {cfg.vocab}; mesh {FLAGS.mesh} "
        f"(built twice in {time.perf_counter() - t0:.1f} s)")

  # 2. Time to the first finished step (tracing included in both, timed apart).
  gc.collect()
  plain_trace, _ = _timed(lambda: plain.concrete("train"))
  plain_call, _ = _timed(lambda: _block(plain.train_step(*inputs)))
  gc.collect()
  split_trace, _ = _timed(lambda: split_ex.concrete("train"))
  split_call, step = _timed(lambda: tfsplit.split(
      split_ex.train_step, mesh=FLAGS.mesh, variable_names=_names(split_ex)))
  split_run, _ = _timed(lambda: _block(step(*inputs)))
  plain_first = plain_trace + plain_call
  split_first = split_trace + split_call + split_run
  print(f"nodes: {len(step.original_graph_def.node)} original, "
        f"{len(step.graph_def.node)} split")

  # 1. tfsplit.split end to end on the traced function, against Grappler.
  mesh = make_mesh(FLAGS.mesh)
  parts, graph_def, _ = _parts(split_ex, mesh, FLAGS.repeats)
  end_to_end, _ = best_of(lambda: tfsplit.split(split_ex.train_step, mesh=FLAGS.mesh,
                                                variable_names=_names(split_ex)),
                          FLAGS.repeats)
  grappler, _ = best_of(lambda: grappler_lib.optimize(graph_def), FLAGS.repeats)

  # 3. Steady step times.
  plain_step = _steady(plain.train_step, inputs, FLAGS.steps)
  split_step = _steady(step, inputs, FLAGS.steps)

  print()
  print(f"tfsplit.split end to end (traced function): {end_to_end:8.3f} s  "
        f"(best of {FLAGS.repeats})")
  for key, value in parts.items():
    print(f"  {key:<18} {value:8.3f} s")
  print(f"Grappler OptimizeGraph, same graph:         {grappler:8.3f} s")
  print(f"first finished step, split:                {split_first:8.3f} s  (trace "
        f"{split_trace:.2f} + tfsplit.split {split_call:.2f} + first call {split_run:.2f})")
  print(f"first finished step, plain tf.function:     {plain_first:8.3f} s  (trace "
        f"{plain_trace:.2f} + first call {plain_call:.2f})")
  print(f"steady step, split over {FLAGS.mesh}:         {split_step * 1e3:8.1f} ms  "
        f"(median of {FLAGS.steps})")
  print(f"steady step, plain on one device:           {plain_step * 1e3:8.1f} ms")
  print()
  label = f"[{FLAGS.model} {cfg.blocks} blocks {FLAGS.mesh}]"
  print(f"{label} split end-to-end / Grappler OptimizeGraph: {end_to_end / grappler:.2f}")
  print(f"{label} first finished step, split / plain: {split_first / plain_first:.2f}")
  print(f"{label} steady step, split / one device: {split_step / plain_step:.2f}")

  if FLAGS.profile:
    profiler = cProfile.Profile()
    profiler.enable()
    tfsplit.split(split_ex.train_step, mesh=FLAGS.mesh, variable_names=_names(split_ex))
    profiler.disable()
    buf = io.StringIO()
    pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(FLAGS.profile_top)
    print()
    print(f"cProfile of tfsplit.split over {FLAGS.mesh} (top {FLAGS.profile_top} by "
          "cumulative time):")
    print(buf.getvalue())


if __name__ == "__main__":
  app.run(main)
