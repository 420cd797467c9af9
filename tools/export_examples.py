"""Writes the example graphs: examples/<name>_<kind>_<size>.pb.

    python tools/export_examples.py                       # tiny + small
    python tools/export_examples.py --sizes=large --jobs=1
    python tools/export_examples.py --names=gpt_raw --sizes=tiny --out_dir=/tmp/x

Each (model, size) is exported in its own Python process. Some captured
variables are named by a process-wide counter (tf_keras embedding lookups
capture the variable as `.../embedding_lookup/<uid>`), so a fresh process
with a fixed build order is what makes the files byte-reproducible.
"""
import os
import subprocess
import sys
import time
from concurrent import futures

from absl import app
from absl import flags
from absl import logging

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from benchlib import ROOT  # sys.path: repo root, examples/ (pylint: disable=g-import-not-at-top)
import models  # pylint: disable=g-import-not-at-top,wrong-import-order

FLAGS = flags.FLAGS
flags.DEFINE_list("names", list(models.NAMES), "Example models to export.")
flags.DEFINE_list("sizes", ["tiny", "small"], "Sizes: tiny, small, large.")
flags.DEFINE_list("kinds", list(models.KINDS), "Functions: forward, train.")
flags.DEFINE_string("out_dir", os.path.join(ROOT, "examples"),
                    "Directory for the .pb files.")
flags.DEFINE_integer("seed", 0, "Weight seed (does not change the graphs).")
flags.DEFINE_integer("jobs", min(4, os.cpu_count() or 1),
                     "Models exported in parallel (one process each).")
flags.DEFINE_string("one", None, "Internal: export only NAME:SIZE here.")


def output_path(out_dir, name, kind, size):
  return os.path.join(out_dir, f"{name}_{kind}_{size}.pb")


def export_one(name, size, kinds, out_dir, seed):
  """Builds one example and writes the graph of each kind; returns paths."""
  from tfsplit.graph.io import load_graph, save_graph  # pylint: disable=g-import-not-at-top
  ex = models.build(name, size=size, seed=seed)
  paths = []
  # Trace every kind in a fixed order even if fewer are written, so the
  # counter-named captures do not depend on --kinds.
  for kind in models.KINDS:
    start = time.time()
    graph_def = load_graph(ex.concrete(kind), variable_names=list(
        zip(ex.all_variables(), ex.variable_names())))
    if kind not in kinds:
      continue
    path = output_path(out_dir, name, kind, size)
    save_graph(graph_def, path)
    logging.info("%s: %d nodes, %d bytes, %.1fs", path, len(graph_def.node),
                 os.path.getsize(path), time.time() - start)
    paths.append(path)
  return paths


def _run_child(name, size):
  cmd = [sys.executable, os.path.abspath(__file__), f"--one={name}:{size}",
         f"--kinds={','.join(FLAGS.kinds)}", f"--out_dir={FLAGS.out_dir}",
         f"--seed={FLAGS.seed}"]
  start = time.time()
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  return name, size, proc, time.time() - start


def _check_choices(values, choices, what):
  bad = [v for v in values if v not in choices]
  if bad:
    raise app.UsageError(f"unknown {what} {', '.join(bad)}; choose from "
                         f"{', '.join(choices)}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  _check_choices(FLAGS.names, models.NAMES, "model")
  _check_choices(FLAGS.sizes, models.SIZES, "size")
  _check_choices(FLAGS.kinds, models.KINDS, "kind")
  if FLAGS.one:
    name, size = FLAGS.one.split(":")
    export_one(name, size, FLAGS.kinds, FLAGS.out_dir, FLAGS.seed)
    return 0

  os.makedirs(FLAGS.out_dir, exist_ok=True)
  jobs = [(n, s) for s in FLAGS.sizes for n in FLAGS.names]
  failed = 0
  with futures.ThreadPoolExecutor(max(1, FLAGS.jobs)) as pool:
    pending = [pool.submit(_run_child, n, s) for n, s in jobs]
    for done, fut in enumerate(futures.as_completed(pending), 1):
      name, size, proc, seconds = fut.result()
      if proc.returncode == 0:
        print(f"[{done}/{len(jobs)}] {name} {size}: ok ({seconds:.0f}s)",
              flush=True)
      else:
        failed += 1
        print(f"[{done}/{len(jobs)}] {name} {size}: FAILED\n{proc.stderr}",
              file=sys.stderr, flush=True)
  for n, s in jobs:
    for kind in FLAGS.kinds:
      path = output_path(FLAGS.out_dir, n, kind, s)
      if os.path.exists(path):
        print(f"{os.path.getsize(path):>10,d}  {os.path.relpath(path)}")
  return 1 if failed else 0


if __name__ == "__main__":
  app.run(main)
