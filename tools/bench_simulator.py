"""Benchmark: the event simulator on a synthetic 48-layer step over 64 devices.

Builds the task DAG of a Megatron-style GPT step (8 pipeline stages x 8-way
tensor parallelism, 1f1b, two all-reduces per layer each way; see
tools/synthetic.py) and times building it and simulating it, printing
tasks per second. The simulation of ~100k+ tasks should take well under 1 s.

    python tools/bench_simulator.py [--microbatches 32] [--repeats 3]
"""
import time

from absl import app
from absl import flags

import benchlib  # sys.path: repo root (pylint: disable=unused-import)
from synthetic import transformer_step

FLAGS = flags.FLAGS
flags.DEFINE_integer("layers", 48, "Transformer layers.")
flags.DEFINE_integer("devices", 64, "Devices (stages x tensor-parallel ranks).")
flags.DEFINE_integer("stages", 8, "Pipeline stages.")
flags.DEFINE_integer("microbatches", 32, "Micro-batches per step.")
flags.DEFINE_integer("repeats", 3, "Best of this many simulations.")


def main(argv):
  del argv
  t0 = time.perf_counter()
  graph = transformer_step(layers=FLAGS.layers, devices=FLAGS.devices,
                           stages=FLAGS.stages, microbatches=FLAGS.microbatches)
  build = time.perf_counter() - t0
  n = len(graph)
  best, result = None, None
  for _ in range(FLAGS.repeats):
    t0 = time.perf_counter()
    result = graph.simulate()
    dt = time.perf_counter() - t0
    best = dt if best is None else min(best, dt)
  rows = result.device_summary()
  bubble = sum(r["idle_fraction"] for r in rows) / len(rows)
  print(f"{FLAGS.layers} layers, {FLAGS.devices} devices, {FLAGS.stages} "
        f"stages, {FLAGS.microbatches} micro-batches: {n} tasks, "
        f"{len(graph.resource_names)} resources")
  print(f"build    {build:.3f} s  ({n / build:,.0f} tasks/s)")
  print(f"simulate {best:.3f} s  ({n / best:,.0f} tasks/s, best of "
        f"{FLAGS.repeats})")
  print(f"simulated step {result.step_time * 1e3:.1f} ms, mean bubble "
        f"{100 * bubble:.1f}%, peak memory on stage 0 "
        f"{result.peak_memory[0] / 1e9:.2f} GB")


if __name__ == "__main__":
  app.run(main)
