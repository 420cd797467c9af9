"""`tfsplit calibrate [GRAPH ...] --out table.json`: measure op costs here.

Runs the standard micro-benchmark (MatMuls, elementwise ops, transposes,
reductions, copies, chains of tiny ops) and every op of each GRAPH inside
the graph itself, on this machine, and writes a JSON cost table. Give it to
`tfsplit estimate GRAPH --calibration table.json`: measured costs override
the roofline. GRAPH is a .pb / .pbtxt GraphDef or a SavedModel directory.
"""
import os
import sys
import time

from absl import flags

from tfsplit.errors import TfsplitError


def _define_flags():
  fv = flags.FlagValues()
  flags.DEFINE_string("out", None, "Write the cost table (JSON) here.",
                      flag_values=fv)
  flags.DEFINE_integer("repeats", 10, "Untraced runs per graph (the median "
                       "is its step time).", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("traced", 5, "Traced runs per graph (the median of "
                       "each op's kernel time is kept).", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_string("signature", None, "SavedModel signature to load.",
                      flag_values=fv)
  return fv


def main(argv):
  fv = _define_flags()
  if any(a in ("-h", "--help", "-help", "--helpshort") for a in argv[1:]):
    sys.stdout.write(__doc__ + "\nflags:\n" + fv.module_help(__name__) + "\n")
    return 0
  try:
    rest = fv(argv)
  except flags.Error as e:
    raise TfsplitError(f"{e}; run 'tfsplit calibrate --help' for the flags") \
        from None
  if not fv["out"].value:
    raise TfsplitError("say where to write the table: --out table.json")
  from tfsplit.cost import calibrate  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  folder = os.path.dirname(os.path.abspath(fv["out"].value))
  if not os.path.isdir(folder):  # fail before minutes of measuring
    raise TfsplitError(f"cannot write '{fv['out'].value}': folder '{folder}' "
                       "does not exist; create it or choose another path")
  graph_defs = [load_graph(path, signature=fv["signature"].value)
                for path in rest[1:]]
  t0 = time.perf_counter()

  def progress(message):
    sys.stderr.write(f"tfsplit calibrate: {message}\n")
    sys.stderr.flush()

  table = calibrate.calibrate(graph_defs, repeats=fv["repeats"].value,
                              traced=fv["traced"].value, progress=progress)
  table.save(fv["out"].value)
  flops = f"{table.flops / 1e9:.4g} GFLOP/s" if table.flops else "?"
  bandwidth = f"{table.bandwidth / 1e9:.4g} GB/s" if table.bandwidth else "?"
  sys.stdout.write(
      f"wrote {fv['out'].value}: {len(table.entries)} measured op shapes, "
      f"{len(table.op_factor)} op types; MatMul {flops}, copy {bandwidth}; "
      f"per-op overhead {table.op_overhead * 1e6:.3g} us, per-step "
      f"{table.step_overhead * 1e6:.3g} us, kernel scale "
      f"{table.time_scale:.3g} ({time.perf_counter() - t0:.1f} s)\n")
  return 0
