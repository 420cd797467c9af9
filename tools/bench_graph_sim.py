"""Benchmark: simulating the 48-block GPT training graph placed over 64 devices.

Builds `gpt_raw` (size large: 48 blocks), loads its training-step GraphDef,
infers shapes, places its layers contiguously over --devices devices
(graph_sim.place_by_layers) and simulates one step on an H100 cluster with
the roofline cost model. Building (model, graph, shapes, layers, task DAG)
is timed apart from the simulation itself, which should take under 1 s.

    python tools/bench_graph_sim.py [--devices 64] [--graph large.pb]
"""
import time

from absl import app
from absl import flags

import benchlib  # sys.path: repo root, examples/ (pylint: disable=unused-import)

FLAGS = flags.FLAGS
flags.DEFINE_integer("devices", 64, "Devices to place the layers over.")
flags.DEFINE_string("model", "gpt_raw", "Example model (size large).")
flags.DEFINE_string("graph", None, "Use this GraphDef instead of building "
                    "the example (e.g. one written by export_examples.py).")
flags.DEFINE_string("preset", "h100-80gb", "Hardware preset of the cluster.")
flags.DEFINE_integer("repeats", 3, "Best of this many simulations.")


def main(argv):
  del argv
  from tfsplit.cost import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.cost import graph_sim  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import Graph, find_variables, infer_shapes, load_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.layers import detect_layers  # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  if FLAGS.graph:
    graph_def = load_graph(FLAGS.graph)
  else:
    import models  # pylint: disable=import-outside-toplevel
    # Keep the example alive while its function is read: dropping it
    # deletes the variables the function captures.
    example = models.build(FLAGS.model, "large")
    graph_def = load_graph(example.concrete("train"))
  t_load = time.perf_counter() - t0
  t0 = time.perf_counter()
  graph = Graph(graph_def)
  variables = find_variables(graph)
  shapes = infer_shapes(graph, variables)
  report = detect_layers(graph, shapes, variables)
  placed = Graph(graph_sim.place_by_layers(graph_def, FLAGS.devices,
                                           report=report))
  t_prep = time.perf_counter() - t0
  cluster = cluster_lib.from_preset(FLAGS.preset, FLAGS.devices)
  best = None
  for _ in range(FLAGS.repeats):
    res = graph_sim.simulate_graph(placed, cluster, shapes=shapes,
                                   variables=find_variables(placed),
                                   roles=report.role)
    if best is None or res.simulate_seconds < best.simulate_seconds:
      best = res
  sim = best.sim
  rows = sim.device_summary()
  used = [r for r, m in zip(rows, best.memory) if m.parameters]
  print(f"{len(graph)} nodes, {len(report.model_layers)} parameter layers, "
        f"{FLAGS.devices} devices ({cluster.name}): {len(sim.graph)} tasks, "
        f"{best.transfers} transfers, {len(sim.graph.resource_names)} "
        "resources")
  print(f"load graph        {t_load:7.3f} s")
  print(f"shapes, layers, placement {t_prep:7.3f} s")
  print(f"build task graph  {best.build_seconds:7.3f} s")
  orders = len(best.sampled_peaks or ()) or 1
  print(f"simulate          {best.simulate_seconds:7.3f} s  (best of "
        f"{FLAGS.repeats}; {orders} executor orders, "
        f"{best.simulate_seconds / orders:.3f} s each; target < 1 s each)")
  print(f"simulated step {sim.step_time * 1e3:.3f} ms; {len(used)} devices "
        f"hold parameters; mean idle {100 * sum(r['idle_fraction'] for r in used) / max(len(used), 1):.1f}%; "
        f"peak memory on device 0 {best.memory[0].peak / 1e6:.2f} MB")


if __name__ == "__main__":
  app.run(main)
