"""Re-prices measured plans with the planner's code as it is now.

`tools/bench_planner.py --measure ... --calibration TABLE --measure_only`
prints each plan's measured step time and the machine's level as a result
line. Timing a grid of plans takes minutes and a quiet machine; a change to
the planner's pricing (plan/costing.py, plan/profile.py) does not need new
timings to be judged: this prices the same plans again from the same
tables and prints, per plan, the ratio then and now (predicted at the
process's level over measured), and over all runs how many plans' median
ratios are within ±25%, their range and spread.

    python tools/bench_planner.py --measure mlp_raw:small --meshes "dp=2;tp=2" \\
        --top 1 --measure_only --calibration t1.json > run1.log
    python tools/reprice_planner.py t1.json=run1.log [t2.json=run2.log ...]

A change to calibration itself changes the tables: time a new grid.
"""
import json
import math
import os
import statistics
import sys

from absl import app
from absl import flags

import benchlib  # sys.path: repo root (pylint: disable=unused-import)
from tfsplit.report import format_table

FLAGS = flags.FLAGS
flags.DEFINE_integer("devices", 4, "Logical CPUs the plans were measured on.")
flags.DEFINE_float("band", 0.25, "A plan's median ratio counts as within 1 +- this.")
flags.DEFINE_bool("json", False, "Also print the rows as a result line.")


# What a row of bench_planner's --measure result needs to be priced again.
ROW_KEYS = ("model", "plan", "mesh", "microbatches", "measured", "level", "ratio")


def read_rows(path):
  """The rows of the last result line bench_planner printed into `path`."""
  rows = None
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.startswith(benchlib.RESULT_MARK):
        rows = json.loads(line[len(benchlib.RESULT_MARK):])
  if rows is None:
    raise ValueError(f"{path}: no '{benchlib.RESULT_MARK.strip()}' line (a "
                     "bench_planner.py --measure ... --measure_only output)")
  for row in rows:
    missing = [k for k in ROW_KEYS if not isinstance(row, dict) or k not in row]
    if missing:
      raise ValueError(f"{path}: a result row without {', '.join(missing)}; give the "
                       "output of bench_planner.py --measure ... --processes 1 --measure_only")
  return rows


def candidate_of(row):
  """The row's Candidate: its record, or (older rows) its mesh and
  micro-batches."""
  from tfsplit.plan import space  # pylint: disable=import-outside-toplevel
  fields = row.get("candidate")
  if fields:
    return space.Candidate(**{k: tuple(v) if isinstance(v, list) else v
                              for k, v in fields.items()})
  return benchlib.mesh_candidates(f"{row['mesh']} m={row['microbatches']}")[0]


def reprice(runs, devices):
  """[(table path, rows)] -> {(model, plan): [(ratio then, ratio now)] per
  run}: each row's plan priced now from its run's table, at the level the
  row was measured at."""
  benchlib.logical_devices("CPU", devices)
  from tfsplit.cost import cluster as cluster_lib, op_cost  # pylint: disable=import-outside-toplevel
  from tfsplit.plan import profile as profile_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.plan.search import Planner  # pylint: disable=import-outside-toplevel
  spec = cluster_lib.from_preset("cpu-host", devices, devices_per_host=devices)
  graphs, cells = {}, {}
  for table_path, rows in runs:
    table = op_cost.CostTable.load(table_path)
    planners = {}
    for row in rows:
      text = row["model"]
      if text not in graphs:
        graphs[text] = benchlib.example_model(text)[1]
      if text not in planners:
        profile = profile_lib.from_graph(graphs[text], op_cost.CostModel(spec, table=table))
        planners[text] = Planner(profile, spec, devices)
      est = planners[text].price(candidate_of(row))
      now = est.step_time * row["level"] / row["measured"] if est else float("nan")
      cells.setdefault((text, row["plan"]), []).append((row["ratio"], now))
  return cells


def summary(cells, band, which):
  """(within, count, low, high, rms of log, [outside per run]) of the
  median ratios (which: 0 then, 1 now)."""
  medians = [statistics.median(r[which] for r in runs) for runs in cells.values()]
  inside = [1 - band <= m <= 1 + band for m in medians]
  runs = max(len(r) for r in cells.values())
  outside = [sum(1 for r in cells.values() if len(r) > k and
                 not 1 - band <= r[k][which] <= 1 + band) for k in range(runs)]
  spread = statistics.pstdev([math.log(m) for m in medians]) if len(medians) > 1 else 0.0
  return sum(inside), len(medians), min(medians), max(medians), spread, outside


def main(argv):
  pairs = argv[1:]
  if not pairs or any("=" not in p for p in pairs):
    raise app.UsageError("give TABLE.json=RESULT.log pairs (bench_planner.py --measure "
                         "... --calibration TABLE.json --measure_only > RESULT.log)")
  from tfsplit.errors import TfsplitError  # pylint: disable=import-outside-toplevel
  try:   # bad input: one line, exit 2
    runs = []
    for pair in pairs:
      table, _, log = pair.partition("=")
      for path in (table, log):
        if not os.path.exists(path):
          raise ValueError(f"{path}: no such file")
      runs.append((table, read_rows(log)))
    cells = reprice(runs, FLAGS.devices)
  except (ValueError, TfsplitError) as e:
    print(f"reprice_planner: {e}", file=sys.stderr)
    return 2
  rows = [[model, plan, " ".join(f"{a:.2f}" for a, _ in r),
           " ".join(f"{b:.2f}" for _, b in r),
           f"{statistics.median(a for a, _ in r):.2f}", f"{statistics.median(b for _, b in r):.2f}"]
          for (model, plan), r in cells.items()]
  print(format_table(["model", "plan", "then per run", "now per run", "median then",
                      "median now"], rows, "<<>>>>", indent="  "))
  for which, name in ((0, "then"), (1, "now")):
    inside, count, low, high, spread, outside = summary(cells, FLAGS.band, which)
    print(f"  {name}: {inside} of {count} medians within ±{FLAGS.band:.0%} "
          f"({low:.2f}-{high:.2f}, rms of log {spread:.3f}); outside per run: "
          + ", ".join(str(x) for x in outside))
  if FLAGS.json:
    benchlib.print_result([{"model": m, "plan": p, "then": [a for a, _ in r],
                            "now": [b for _, b in r]} for (m, p), r in cells.items()])


if __name__ == "__main__":
  sys.exit(app.run(main))
