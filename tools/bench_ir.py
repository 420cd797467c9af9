"""Benchmark: the GraphDef IR against TF's own Grappler on the same graph.

Times load (parse + validate + inline), index, shape inference, topological
order and save of the 48-layer GPT training step, and prints the total as a
ratio to Grappler's `OptimizeGraph` (default config) on the same graph,
measured in the same run. Then repeats on 4x and 16x graphs (disjoint copies
of the step, renamed) to show how both scale.

    python tools/bench_ir.py [--model gpt_raw] [--size large] [--scales 1,4,16]
        [--nograppler]
"""
import os
import tempfile
import time

from absl import app
from absl import flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchlib import best_of, define_example_flags  # pylint: disable=wrong-import-position
from tfsplit.graph import grappler as grappler_lib  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
define_example_flags("large")
flags.DEFINE_string("scales", "1,4,16", "Graph size multiples to time.")
flags.DEFINE_integer("repeats", 3, "Best of this many runs per measurement.")
flags.DEFINE_boolean("layers", True, "Also time layer detection (inspect).")
flags.DEFINE_boolean("grappler", True, "Time Grappler's OptimizeGraph at each scale (the "
                     "ratio column; superlinear: minutes at 16x the large graph).")


def _replicate(graph_def, copies):
  """`copies` disjoint renamed copies of `graph_def` in one GraphDef."""
  from tensorflow.core.framework import graph_pb2  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.ir import parse_input  # pylint: disable=import-outside-toplevel
  if copies == 1:
    return graph_def
  out = graph_pb2.GraphDef()
  out.versions.CopyFrom(graph_def.versions)
  out.library.CopyFrom(graph_def.library)
  def rename(name, prefix):
    # Keep gradient scopes first, as TF names them: gradient_tape/copy_1/...
    for grad in ("gradient_tape/", "gradients/"):
      if name.startswith(grad):
        return grad + prefix + name[len(grad):]
    return prefix + name

  for c in range(copies):
    prefix = f"copy_{c}/"
    for node in graph_def.node:
      new = out.node.add()
      new.CopyFrom(node)
      new.name = rename(node.name, prefix)
      del new.input[:]
      for text in node.input:
        name, port = parse_input(text)
        new.input.append(("^" if port < 0 else "") + rename(name, prefix) +
                         (f":{port}" if port > 0 else ""))
  return out


def _ir_pipeline(path, out_path, with_layers):
  from tfsplit.graph import Graph, find_variables, infer_shapes, load_graph, save_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.layers import detect_layers  # pylint: disable=import-outside-toplevel
  times = {}
  t = time.perf_counter()
  graph_def = load_graph(path)
  times["load"] = time.perf_counter() - t
  t = time.perf_counter()
  graph = Graph(graph_def)
  graph.consumers(graph_def.node[0].name)  # builds the consumer index
  variables = find_variables(graph)
  times["index"] = time.perf_counter() - t
  t = time.perf_counter()
  shapes = infer_shapes(graph, variables)
  times["shapes"] = time.perf_counter() - t
  t = time.perf_counter()
  order = graph.topological_order()
  times["order"] = time.perf_counter() - t
  t = time.perf_counter()
  save_graph(graph.to_graph_def(), out_path)
  times["save"] = time.perf_counter() - t
  if with_layers:
    t = time.perf_counter()
    detect_layers(graph, shapes, variables, order=order)
    times["layers"] = time.perf_counter() - t
  return times


def main(_):
  import models  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import load_graph, save_graph  # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  example = models.build(FLAGS.model, size=FLAGS.size)
  base = load_graph(example.concrete("train"))
  print(f"{FLAGS.model}/{FLAGS.size} training step: {len(base.node)} nodes "
        f"(built in {time.perf_counter() - t0:.1f} s)")
  print()
  header = (f"{'scale':>5} {'nodes':>8} {'load':>7} {'index':>7} {'shapes':>7} "
            f"{'order':>7} {'save':>7} {'IR total':>9} {'grappler':>9} "
            f"{'ratio':>6} {'layers':>7}")
  print(header)
  print("-" * len(header))
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for scale in [int(s) for s in FLAGS.scales.split(",")]:
      graph_def = _replicate(base, scale)
      path = os.path.join(tmp, f"g{scale}.pb")
      save_graph(graph_def, path)
      out_path = os.path.join(tmp, f"out{scale}.pb")
      runs = [_ir_pipeline(path, out_path, FLAGS.layers) for _ in range(FLAGS.repeats)]
      times = {k: min(r[k] for r in runs) for k in runs[0]}
      ir_total = sum(v for k, v in times.items() if k != "layers")
      grappler = float("nan")
      if FLAGS.grappler:
        grappler, _ = best_of(lambda g=graph_def: grappler_lib.optimize(g), FLAGS.repeats)
      rows.append((scale, len(graph_def.node), ir_total, grappler, times))
      print(f"{scale:>5} {len(graph_def.node):>8} {times['load']:>7.3f} "
            f"{times['index']:>7.3f} {times['shapes']:>7.3f} {times['order']:>7.3f} "
            f"{times['save']:>7.3f} {ir_total:>9.3f} {grappler:>9.3f} "
            f"{ir_total / grappler:>6.2f} {times.get('layers', 0):>7.3f}")
  print()
  print("ratio = IR total (load+index+shapes+order+save) / Grappler OptimizeGraph")
  if len(rows) > 1:
    s0, n0, ir0, g0, t0 = rows[0]
    for s, n, ir, g, t in rows[1:]:
      phases = ", ".join(f"{k} x{t[k] / t0[k]:.1f}" for k in t if t0[k] > 0)
      print(f"scaling {s0}x -> {s}x ({n / n0:.0f}x nodes): IR time x{ir / ir0:.1f}, "
            f"Grappler time x{g / g0:.1f}; {phases}")


if __name__ == "__main__":
  app.run(main)
