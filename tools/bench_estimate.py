"""Benchmark: estimated vs measured memory and step time of training steps.

For each example model (default: mlp_raw, gpt_raw and gpt_keras3, size
small), in a fresh Python process:

- measured memory: the CPU allocator's peak over one training step
  (tf.config.experimental.get_memory_info('CPU:0')['peak'] after a
  warm-up step and reset_memory_stats), the median over 15 steps; TF_CPU_ALLOCATOR_USE_BFC=true makes
  the CPU allocator a BFC allocator that keeps these statistics. One process
  per model: all CPU devices of a process share one allocator;
- measured time: the median of --steps calls of the training step's
  ConcreteFunction (the graph's time; the tf.function's, which adds Python
  dispatch, is printed beside it);
- estimated memory: tfsplit's single-device simulation of the step's graph
  (variables, constants and inputs, plus the simulated peak of tensors);
- estimated time: the simulation priced by a cost table that `calibrate`
  measured in the same process (the micro-benchmark, plus the graph's ops
  when --calibrate_graph), and by the micro-benchmark alone.

    python tools/bench_estimate.py [--models mlp_raw:small,gpt_raw:small]
"""
import json
import os
import subprocess
import sys
import time

from absl import app
from absl import flags

import benchlib  # sys.path: repo root, examples/ (pylint: disable=unused-import)

_MEMORY_STEPS = 15
FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mlp_raw:small", "gpt_raw:small",
                             "gpt_keras3:small"], "NAME:SIZE of each model.")
flags.DEFINE_integer("steps", 20, "Timed training steps per model (median).")
flags.DEFINE_boolean("time", True, "Also measure and estimate step time "
                     "(calibration takes a few seconds per model).")
flags.DEFINE_string("one", None, "Internal: measure NAME:SIZE here and print "
                    "one JSON line.")


def measure_one(name, size, steps, with_time):
  """Measured and estimated figures of one model, as a dict."""
  import statistics  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import models  # pylint: disable=import-outside-toplevel
  from tfsplit.cost import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.cost import graph_sim, op_cost  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import Graph, find_variables, infer_shapes, load_graph  # pylint: disable=import-outside-toplevel

  if not with_time:
    # Memory only: one inter-op thread, so ops run one at a time in a fixed
    # order, as the simulator models them; with two threads the peak wanders
    # with scheduling (the MLP's by +-25% between runs on a loaded 2-core
    # machine). Timing runs keep TF's default threads, as training would.
    tf.config.threading.set_inter_op_parallelism_threads(1)
  ex = models.build(name, size, seed=0)
  inputs = [tf.constant(x) for x in ex.make_inputs("train", seed=1)]
  ex.train_step(*inputs)  # trace, Grappler, kernels
  # The peak depends on the order TF's inter-op threads run ready ops in,
  # which changes from step to step: keep the median of several steps.
  peaks = []
  for _ in range(_MEMORY_STEPS):
    tf.config.experimental.reset_memory_stats("CPU:0")
    ex.train_step(*inputs).numpy()
    peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
  out = {"model": f"{name}:{size}", "measured_peak": int(
      statistics.median(peaks)), "measured_peaks": peaks}
  if with_time:
    # The graph's own time: a call of its ConcreteFunction. A tf.function
    # call adds Python dispatch (argument binding, trace-cache lookup) on
    # top, which no graph estimate can see; it is printed beside it.
    concrete = ex.concrete("train")
    for key, fn in (("measured_step", concrete),
                    ("function_step", ex.train_step)):
      times = []
      for _ in range(steps):
        t0 = time.perf_counter()
        fn(*inputs)
        times.append(time.perf_counter() - t0)
      out[key] = statistics.median(times)

  graph_def = load_graph(ex.concrete("train"))
  graph = Graph(graph_def)
  variables = find_variables(graph)
  shapes = infer_shapes(graph, variables)
  cluster = cluster_lib.from_preset("cpu-host", 1)
  res = graph_sim.simulate_graph(graph, cluster, shapes=shapes,
                                 variables=variables)
  out["estimated_peak"] = res.memory[0].peak
  out["memory"] = res.memory[0].as_dict()
  if with_time:
    from tfsplit.cost import calibrate  # pylint: disable=import-outside-toplevel
    for key, graphs in (("micro", []), ("calibrated", [graph_def])):
      table = calibrate.calibrate(graphs)
      res = graph_sim.simulate_graph(
          graph, cluster, op_cost.CostModel(cluster, table), shapes=shapes,
          variables=variables)
      out[f"{key}_step"] = res.step_time
  return out


def run_one(spec, steps=20, with_time=True, timeout=600):
  """measure_one in a fresh process (its own allocator); returns the dict."""
  env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true",
             TF_CPP_MIN_LOG_LEVEL="2")
  cmd = [sys.executable, os.path.abspath(__file__), f"--one={spec}",
         f"--steps={steps}", f"--time={str(with_time).lower()}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                        timeout=timeout, check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if proc.returncode or not lines:
    raise RuntimeError(f"measuring {spec} failed (exit {proc.returncode}):\n"
                       f"{proc.stderr[-3000:]}")
  return json.loads(lines[-1])


def _ratio(est, real):
  return f"{est / real:.3f}" if real else "-"


def main(argv):
  del argv
  if FLAGS.one:
    name, _, size = FLAGS.one.partition(":")
    print(json.dumps(measure_one(name, size or "small", FLAGS.steps,
                                 FLAGS.time)))
    return
  rows = [run_one(spec, FLAGS.steps, FLAGS.time) for spec in FLAGS.models]
  print("memory (single device, training step; allocator peak vs estimate)")
  print(f"  {'model':18s} {'measured':>12s} {'estimated':>12s} {'ratio':>7s}")
  for r in rows:
    print(f"  {r['model']:18s} {r['measured_peak']:12,d} "
          f"{r['estimated_peak']:12,d} "
          f"{_ratio(r['estimated_peak'], r['measured_peak']):>7s}")
  if FLAGS.time:
    print("step time, ms (measured: median call of the step's "
          "ConcreteFunction; estimated: simulated with a cost table from the "
          "graph's ops, and from the micro-benchmark alone)")
    print(f"  {'model':18s} {'tf.function':>11s} {'measured':>9s} "
          f"{'calibrated':>10s} {'ratio':>7s} {'micro':>9s} {'ratio':>7s}")
    for r in rows:
      m = r["measured_step"]
      print(f"  {r['model']:18s} {r['function_step'] * 1e3:11.3f} "
            f"{m * 1e3:9.3f} {r['calibrated_step'] * 1e3:10.3f}"
            f" {_ratio(r['calibrated_step'], m):>7s} "
            f"{r['micro_step'] * 1e3:9.3f} {_ratio(r['micro_step'], m):>7s}")


if __name__ == "__main__":
  app.run(main)
