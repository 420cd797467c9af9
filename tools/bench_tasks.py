"""Benchmark: one task's graph against the whole-cluster graph as the data
axis grows (per-task graphs, sharding/tasks.py).

For each dp in --dps the example's training step (batch --batch-per-replica
x the largest dp, so every mesh divides it) is split over dp x --inner
(the inner axes within a task of that many devices, dp across tasks), once
for task 0 alone and once for the whole cluster. Printed per mesh: build
seconds, nodes and serialized bytes of each, and the ratios of task 0's
figures to those at the first dp: the part a worker builds, imports and
runs should stay flat while the whole graph grows with the replicas.

Without a pipeline axis across tasks only task 0's devices are made, so its
build time stays flat too; with one, its part is cut from the whole mesh's.

    python tools/bench_tasks.py [--model gpt_raw] [--size small] [--dps 2,4,8,16]
        [--inner tp=2]
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
flags.DEFINE_integer("batch_per_replica", 1, "Batch rows per replica at the largest dp.")
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
  ex = models.build(FLAGS.model, FLAGS.size, seed=0,
                    batch_size=max(dps) * FLAGS.batch_per_replica)
  graph_def = load_graph(ex.concrete("train"), variable_names=list(
      zip(ex.all_variables(), ex.variable_names())))
  print(f"{FLAGS.model}/{FLAGS.size}, batch {max(dps) * FLAGS.batch_per_replica}, "
        f"{per_task} device(s) per task ({FLAGS.inner or 'dp only'})")
  print(f"{'mesh':>16} {'devices':>7} | {'task 0: s':>9} {'nodes':>7} {'MB':>7} "
        f"{'x bytes':>7} | {'whole: s':>8} {'nodes':>8} {'MB':>8}")
  first = None
  for dp in dps:
    axes = {"dp": dp, **inner}
    cluster = cluster_lib.resolve({"worker": [f"127.0.0.1:{i + 1}" for i in range(dp)]},
                                  devices_per_task=per_task)
    mesh = cluster_lib.mesh_on_cluster(axes, cluster)
    t0 = time.perf_counter()
    part = split_graph(graph_def, mesh, timeout_seconds=60, task=0).graph_def
    part_s = time.perf_counter() - t0
    part_bytes = part.ByteSize()
    first = first or part_bytes
    whole_text = f"{'-':>8} {'-':>8} {'-':>8}"
    if mesh.size <= FLAGS.max_whole_devices:
      t0 = time.perf_counter()
      whole = split_graph(graph_def, mesh, timeout_seconds=60).graph_def
      whole_text = (f"{time.perf_counter() - t0:8.2f} {len(whole.node):8d} "
                    f"{whole.ByteSize() / 1e6:8.2f}")
    name = ",".join(f"{k}={v}" for k, v in axes.items())
    print(f"{name:>16} {mesh.size:7d} | {part_s:9.2f} {len(part.node):7d} "
          f"{part_bytes / 1e6:7.2f} {part_bytes / first:7.2f} | {whole_text}", flush=True)


if __name__ == "__main__":
  app.run(main)
