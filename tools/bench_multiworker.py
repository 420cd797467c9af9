"""Benchmark: step time of a plan across 2 worker processes vs the same plan on
logical devices of one process.

For each mesh (default dp=2, tp=2, pp=2), the example training step is split
twice with the same plan: once placed on 2 worker processes (one TF gRPC
server each on loopback, started by tfsplit.runtime.workers as `tfsplit
launch` does, /job:worker/task:i) and once on 2 logical CPU devices of this
process. Both run through the same one-client Session path (the rewritten
graph, seeded variables and inputs), so the ratio is the cost of the process
boundary: gRPC Send/Recv and cross-process collectives instead of in-process
copies. The median over --steps steps after --warmup steps is printed, with
the ratio multi-process / one-process. The first loss of both runs must agree.

On a 2-core machine both workers share the cores with this client, as the
logical devices of one process share them.

    python tools/bench_multiworker.py [--graph examples/gpt_raw_train_small.pb]
        [--meshes dp=2,tp=2,pp=2] [--steps 20] [--microbatches 1]
"""
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
flags.DEFINE_string("graph", os.path.join(_ROOT, "examples", "gpt_raw_train_small.pb"),
                    "Training-step graph to split.")
flags.DEFINE_list("meshes", ["dp=2", "tp=2", "pp=2"], "Meshes of 2 devices to compare.")
flags.DEFINE_integer("steps", 20, "Measured steps (median).", lower_bound=1)
flags.DEFINE_integer("warmup", 3, "Unmeasured steps first.", lower_bound=1)
flags.DEFINE_integer("microbatches", 1, "Micro-batches (pp: the pipeline's m).",
                     lower_bound=1)
flags.DEFINE_float("timeout", 120.0, "Collective and step timeout on the cluster (s).")


def _time_steps(runner, inputs):
  first = None
  for _ in range(FLAGS.warmup):
    out, _ = runner.run(inputs)
    first = float(out[0]) if first is None else first
  times = []
  for _ in range(FLAGS.steps):
    t0 = time.perf_counter()
    runner.run(inputs)
    times.append(time.perf_counter() - t0)
  return statistics.median(times), first


def main(argv):
  del argv
  from tfsplit.runtime import devices  # pylint: disable=import-outside-toplevel
  devices.ensure_logical_devices(2)
  from tfsplit.graph import Graph, load_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import split_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import seeds, workers  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import session as session_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.layout.mesh import Mesh  # pylint: disable=import-outside-toplevel
  graph_def = load_graph(FLAGS.graph)
  inputs = seeds.seeded_inputs(Graph(graph_def), 0)
  rows = []
  t_start = time.time()
  group, spec = workers.start_workers(2, 1, timeout=300)
  print(f"2 workers on {', '.join(spec['worker'])} started in {time.time() - t_start:.1f} s",
        flush=True)
  try:
    cluster = cluster_lib.resolve(spec)
    for text in FLAGS.meshes:
      axes = Mesh.parse(text).axes
      local = split_graph(graph_def, Mesh(axes), microbatches=FLAGS.microbatches)
      runner = session_lib.SessionRunner(local.graph_def, session_lib.seeded_values(
          local.graph_def, local.manifest))
      try:
        one, loss_one = _time_steps(runner, inputs)
      finally:
        runner.session.close()
      remote = split_graph(graph_def, cluster_lib.mesh_on_cluster(axes, cluster),
                           microbatches=FLAGS.microbatches, timeout_seconds=FLAGS.timeout)
      runner = cluster_lib.ClusterRunner(remote.graph_def, session_lib.seeded_values(
          remote.graph_def, remote.manifest), cluster, FLAGS.timeout)
      try:
        two, loss_two = _time_steps(runner, inputs)
      finally:
        runner.close(reset=True)
      agree = abs(loss_one - loss_two) <= 1e-4 * max(abs(loss_one), 1e-6)
      rows.append((text, one, two, loss_one, loss_two, agree))
      print(f"[{text}] one process {1e3 * one:.1f} ms/step, 2 worker processes "
            f"{1e3 * two:.1f} ms/step, ratio {two / one:.2f}x; first loss "
            f"{loss_one:.6f} vs {loss_two:.6f}", flush=True)
  finally:
    group.stop()
  print(f"\n{os.path.basename(FLAGS.graph)}, median of {FLAGS.steps} steps after "
        f"{FLAGS.warmup} warm-up, m={FLAGS.microbatches}")
  print(f"{'mesh':8s} {'1 process ms':>13s} {'2 processes ms':>15s} {'ratio':>7s}  loss")
  print("-" * 52)
  for text, one, two, l1, l2, agree in rows:
    print(f"{text:8s} {1e3 * one:13.1f} {1e3 * two:15.1f} {two / one:6.2f}x  "
          f"{'same' if agree else f'DIFFERS {l1:.6f} vs {l2:.6f}'}")
  return 0 if all(r[5] for r in rows) else 1


if __name__ == "__main__":
  app.run(main)
