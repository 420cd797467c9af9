"""Benchmark: one task's graph against the whole-cluster graph as the data
axis grows (per-task graphs, sharding/tasks.py).

For each dp in --dps the example's training step (batch --batch-per-replica
x the largest dp x --microbatches, so every mesh divides it) is split over
dp x --pp x --inner (dp and pp across tasks, dp * pp tasks; the inner axes
within a task of that many devices), once for task 0 alone and, up to
--max_whole_devices, once for the whole cluster. Printed per mesh: build
seconds (task 0's: the median of --repeats builds), nodes and serialized
bytes of each, and the ratios of task 0's seconds and bytes to those at
the first dp: the part a worker builds, imports and runs should stay flat
while the whole graph grows with the replicas. Task 0 makes its own devices and, with --pp, its pipeline peers'
(passes/tasks.py task_devices), never the whole mesh.

    python tools/bench_tasks.py [--model gpt_raw] [--size small] [--dps 2,4,8,16]
        [--inner tp=2] [--pp 2 --microbatches 2] [--repeats 3]
"""
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

import benchlib  # sys.path: repo root, examples/ (pylint: disable=unused-import)

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "gpt_raw", "examples/models name.")
flags.DEFINE_string("size", "small", "Model size.")
flags.DEFINE_list("dps", ["2", "4", "8", "16"], "Data-parallel sizes (tasks).")
flags.DEFINE_string("inner", "tp=2", "Mesh axes within a task ('' for none).")
flags.DEFINE_integer("pp", 1, "Pipeline stages, each on its own tasks.")
flags.DEFINE_integer("microbatches", 1, "Micro-batches per step.")
flags.DEFINE_integer("batch_per_replica", 1, "Batch rows per replica at the largest dp.")
flags.DEFINE_integer("repeats", 3, "Builds of task 0 per mesh; the median is printed "
                     "(a build moves 20-30% between runs on a shared machine).")
flags.DEFINE_integer("max_whole_devices", 256, "Skip the whole graph above this many "
                     "devices.")


def main(argv):
  del argv
  from absl import logging  # pylint: disable=import-outside-toplevel
  logging.set_verbosity(logging.WARNING)
  import numpy as np  # pylint: disable=import-outside-toplevel
  import models  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.layout.mesh import Mesh  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import split_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
  dps = [int(d) for d in FLAGS.dps]
  inner = Mesh.parse(FLAGS.inner).axes if FLAGS.inner else {}
  per_task = int(np.prod(list(inner.values()))) if inner else 1
  batch = max(dps) * FLAGS.batch_per_replica * FLAGS.microbatches
  ex = models.build(FLAGS.model, FLAGS.size, seed=0, batch_size=batch)
  graph_def = load_graph(ex.concrete("train"), variable_names=list(
      zip(ex.all_variables(), ex.variable_names())))
  print(f"{FLAGS.model}/{FLAGS.size}, batch {batch}, {FLAGS.microbatches} micro-batch(es), "
        f"{per_task} device(s) per task ({FLAGS.inner or 'dp only'}), pp={FLAGS.pp}")
  print(f"{'mesh':>16} {'devices':>7} | {'task 0: s':>9} {'nodes':>7} {'MB':>7} "
        f"{'x bytes':>7} {'x s':>5} | {'whole: s':>8} {'nodes':>8} {'MB':>8}")
  first = None
  pipeline = {"pp": FLAGS.pp} if FLAGS.pp > 1 else {}
  options = dict(timeout_seconds=60, microbatches=FLAGS.microbatches)
  for index, dp in enumerate([dps[0]] + dps):  # the first, once untimed: warm-up
    axes = {"dp": dp, **pipeline, **inner}
    tasks = dp * FLAGS.pp
    cluster = cluster_lib.resolve({"worker": [f"127.0.0.1:{i + 1}" for i in range(tasks)]},
                                  devices_per_task=per_task)
    mesh = cluster_lib.mesh_on_cluster(axes, cluster)
    times = []
    for _ in range(FLAGS.repeats):
      t0 = time.perf_counter()
      part = split_graph(graph_def, mesh, task=0, **options).graph_def
      times.append(time.perf_counter() - t0)
    part_s = float(np.median(times))
    part_bytes = part.ByteSize()
    if index == 0:
      continue
    first = first or (part_bytes, part_s)
    whole_text = f"{'-':>8} {'-':>8} {'-':>8}"
    if mesh.size <= FLAGS.max_whole_devices:
      t0 = time.perf_counter()
      whole = split_graph(graph_def, mesh, **options).graph_def
      whole_text = (f"{time.perf_counter() - t0:8.2f} {len(whole.node):8d} "
                    f"{whole.ByteSize() / 1e6:8.2f}")
    name = ",".join(f"{k}={v}" for k, v in axes.items())
    print(f"{name:>16} {mesh.size:7d} | {part_s:9.2f} {len(part.node):7d} "
          f"{part_bytes / 1e6:7.2f} {part_bytes / first[0]:7.2f} {part_s / first[1]:5.2f} | "
          f"{whole_text}", flush=True)


if __name__ == "__main__":
  app.run(main)
