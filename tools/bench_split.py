"""Benchmark: the operator-splitting pass on the 48-block GPT training step.

Builds the example (size large: 48 blocks), loads its training-step GraphDef
and times `split_graph` (Megatron strategy) for each mesh, as a ratio to
Grappler's `OptimizeGraph` (default config) on the same original graph,
measured in the same run; the Python GC time inside the rewrite is shown
apart, and Grappler on the rewritten graph for reference. Then counts the
collectives the rewrite inserted: all-reduce bytes per block as a ratio to
Megatron's optimum (4 all-reduces of b*s*h float32 elements per block per
step: 2 forward, 2 backward) and all-gathers (0).

    python tools/bench_split.py [--model gpt_raw] [--size large] [--meshes tp=2,tp=4]
        [--profile tp=4] [--detail]
"""
import cProfile
import collections
import gc
import io
import os
import pstats
import re
import time

from absl import app
from absl import flags
from absl import logging

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchlib import best_of, define_example_flags  # pylint: disable=wrong-import-position
from tfsplit.graph import grappler as grappler_lib  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
define_example_flags("large", "examples/models name, a GPT")
flags.DEFINE_list("meshes", ["tp=2", "tp=4"], "Meshes to split over (tp axis only).")
flags.DEFINE_integer("repeats", 2, "Best of this many runs per measurement.")
flags.DEFINE_boolean("grappler_rewritten", True,
                     "Also time Grappler on each rewritten graph (reference).")
flags.DEFINE_string("profile", None, "Mesh to profile split_graph on with cProfile.")
flags.DEFINE_integer("profile_top", 25, "Profile rows to print (by cumulative time).")
flags.DEFINE_boolean("detail", False, "Print all-reduces grouped by tensor name.")

_FLOAT_BYTES = 4


class _GcClock(object):
  """Seconds spent in Python's cyclic GC while active (via gc.callbacks)."""

  def __init__(self):
    self.seconds, self.collections, self._start = 0.0, 0, None

  def __call__(self, phase, info):
    del info
    if phase == "start":
      self._start = time.perf_counter()
    elif self._start is not None:
      self.seconds += time.perf_counter() - self._start
      self.collections += 1
      self._start = None

  def __enter__(self):
    gc.callbacks.append(self)
    return self

  def __exit__(self, *exc):
    gc.callbacks.remove(self)


def _best_split(split_graph, graph_def, mesh, repeats):
  """(seconds, GC seconds of that run) of the fastest split_graph run, and
  the last run's result (every run's is the same). No earlier result is
  alive during a run."""
  best, result = None, None
  for _ in range(repeats):
    result = None
    gc.collect()
    with _GcClock() as clock:
      t0 = time.perf_counter()
      result = split_graph(graph_def, mesh, strategy="megatron")
      dt = time.perf_counter() - t0
    if best is None or dt < best[0]:
      best = (dt, clock.seconds)
  return best + (result,)


def _collective_dtypes(graph_def):
  """Counter of the T attr of the collective ops in `graph_def`."""
  from tensorflow.python.framework import dtypes  # pylint: disable=import-outside-toplevel
  return collections.Counter(
      dtypes.as_dtype(n.attr["T"].type).name for n in graph_def.node
      if n.op in ("CollectiveReduceV2", "CollectiveGatherV2"))


def _pattern(tensor):
  """Tensor name with block numbers folded: 'block_7/attn/x' -> 'block_#/attn/x'."""
  return re.sub(r"\d+", "#", tensor)


def main(argv):
  del argv
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # the pass logs one line per split op
  import models  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.layout.mesh import Mesh  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import split_graph  # pylint: disable=import-outside-toplevel

  t0 = time.perf_counter()
  ex = models.build(FLAGS.model, size=FLAGS.size)
  graph_def = load_graph(ex.concrete("train"),
                         variable_names=list(zip(ex.all_variables(), ex.variable_names())))
  cfg = ex.config
  print(f"{FLAGS.model}/{FLAGS.size} training step: {len(graph_def.node)} nodes, "
        f"{cfg.blocks} blocks, b={cfg.batch} s={cfg.seq} h={cfg.hidden} "
        f"heads={cfg.heads} vocab={cfg.vocab} (built and traced in "
        f"{time.perf_counter() - t0:.1f} s)")

  grappler, _ = best_of(lambda: grappler_lib.optimize(graph_def), FLAGS.repeats)
  print(f"Grappler OptimizeGraph on the original graph: {grappler:.3f} s "
        f"(best of {FLAGS.repeats})")
  optimum = 4 * cfg.batch * cfg.seq * cfg.hidden * _FLOAT_BYTES
  print(f"Megatron optimum per block: 4 all-reduces x {cfg.batch}*{cfg.seq}*{cfg.hidden} "
        f"float32 = {optimum / 2**20:.3f} MiB")
  print()

  header = (f"{'mesh':>6} {'nodes':>8} {'rewrite s':>10} {'(gc s)':>7} {'grappler s':>11} "
            f"{'ratio':>6} {'grap(out) s':>12} {'AR':>5} {'AG':>4} {'AR/blk':>7} "
            f"{'MiB/blk':>8} {'/opt':>6} {'fallbk':>6}")
  print(header)
  print("-" * len(header))
  rows = []
  for text in FLAGS.meshes:
    mesh = Mesh.parse(text)
    rewrite, gc_seconds, result = _best_split(split_graph, graph_def, mesh, FLAGS.repeats)
    out = result.graph_def
    grappler_out = float("nan")
    if FLAGS.grappler_rewritten:
      grappler_out, _ = best_of(lambda g=out: grappler_lib.optimize(g), FLAGS.repeats)
    reduces = [c for c in result.collectives if c.kind == "all_reduce"]
    gathers = [c for c in result.collectives if c.kind == "all_gather"]
    ar_bytes = sum(c.num_elements for c in reduces) * _FLOAT_BYTES
    per_block = ar_bytes / cfg.blocks
    # Only what the summary prints is kept: a held split graph (63k nodes at
    # tp=2) would slow the next mesh's split by a tenth, measured.
    rows.append((text, rewrite, per_block / optimum, _collective_dtypes(out),
                 result.fallbacks, result.collectives))
    print(f"{text:>6} {len(out.node):>8} {rewrite:>10.3f} {gc_seconds:>7.3f} {grappler:>11.3f} "
          f"{rewrite / grappler:>6.2f} {grappler_out:>12.3f} {len(reduces):>5} "
          f"{len(gathers):>4} {len(reduces) / cfg.blocks:>7.2f} "
          f"{per_block / 2**20:>8.3f} {per_block / optimum:>6.3f} "
          f"{len(result.fallbacks):>6}")
    result = out = None
  print()
  print("ratio = split_graph rewrite / Grappler OptimizeGraph (original graph); "
        "(gc s) = Python GC time within the rewrite; grap(out) = Grappler on the "
        "rewritten graph")
  print("AR, AG = all-reduces, all-gathers inserted; MiB/blk = all-reduce payload "
        f"(float32) / {cfg.blocks} blocks; /opt = MiB/blk / Megatron optimum")
  for text, rewrite, opt_ratio, dtypes, fallbacks, _ in rows:
    print(f"[{FLAGS.model} {FLAGS.size} {text}] rewrite/grappler ratio: "
          f"{rewrite / grappler:.2f}")
    print(f"[{FLAGS.model} {FLAGS.size} {text}] collective bytes per layer / "
          f"Megatron optimum: {opt_ratio:.3f}")
    if set(dtypes) - {"float32"}:
      print(f"  note: collective dtypes {dict(dtypes)}; bytes assume float32")
    if fallbacks:
      print(f"  note: {len(fallbacks)} fallbacks, e.g. {fallbacks[:3]}")

  if FLAGS.detail:
    for text, _, _, _, _, collectives in rows:
      groups = collections.defaultdict(lambda: [0, 0])
      for c in collectives:
        g = groups[(c.kind, _pattern(c.tensor))]
        g[0] += 1
        g[1] += c.num_elements
      print()
      print(f"collectives for {text} (block numbers folded to #):")
      for (kind, name), (count, elements) in sorted(
          groups.items(), key=lambda kv: -kv[1][1]):
        print(f"  {kind:>10} x{count:<4} {elements * _FLOAT_BYTES / 2**20:9.3f} MiB  {name}")

  if FLAGS.profile:
    mesh = Mesh.parse(FLAGS.profile)
    profiler = cProfile.Profile()
    profiler.enable()
    split_graph(graph_def, mesh, strategy="megatron")
    profiler.disable()
    buf = io.StringIO()
    pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(
        FLAGS.profile_top)
    print()
    print(f"cProfile of split_graph over {FLAGS.profile} "
          f"(top {FLAGS.profile_top} by cumulative time):")
    print(buf.getvalue())


if __name__ == "__main__":
  app.run(main)
