"""Measure op costs on this machine into a cost table.

Runs the standard micro-benchmarks (chains of MatMuls, elementwise ops,
transposes, reductions, copies and tiny ops; small synthetic training
steps; collectives and transfers between two logical CPUs) and every op of
each GRAPH inside the graph itself, on this machine, and writes a JSON cost
table. Give it to
`tfsplit estimate GRAPH --calibration table.json`: measured costs override
the roofline. GRAPH is a .pb / .pbtxt GraphDef or a SavedModel directory.
"""
import sys
import time

from absl import flags

from tfsplit.commands import common

USAGE = "tfsplit calibrate [GRAPH ...] -o table.json"
ARGS = (0, None)
REQUIRED = ("output",)
ALIASES = {"out": "output"}


def define_flags(fv):
  common.define_output(fv, "Write the cost table (JSON) here.")
  flags.DEFINE_integer("repeats", 10, "Untraced runs per graph (the median "
                       "is its step time).", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("traced", 5, "Traced runs per graph (each op's fastest "
                       "kernel time is kept).", lower_bound=1, flag_values=fv)
  common.define_source(fv, variables=False)


def run(fv, args):
  from tfsplit.calibration.run import calibrate  # pylint: disable=import-outside-toplevel
  from tfsplit.fileio import require_folder  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  require_folder(fv.output)  # fail before minutes of measuring
  graph_defs = [load_graph(path, signature=fv.signature) for path in args]
  t0 = time.perf_counter()

  def progress(message):
    sys.stderr.write(f"tfsplit calibrate: {message}\n")
    sys.stderr.flush()

  table = calibrate(graph_defs, repeats=fv.repeats, traced=fv.traced,
                    progress=progress)
  table.save(fv.output)
  flops = f"{table.flops / 1e9:.4g} GFLOP/s" if table.flops else "?"
  bandwidth = f"{table.bandwidth / 1e9:.4g} GB/s" if table.bandwidth else "?"
  sys.stdout.write(
      f"wrote {fv.output}: {len(table.entries)} measured op shapes, "
      f"{len(table.op_factor)} fitted lines (op types and forms); MatMul {flops}, copy {bandwidth}; "
      f"per-op overhead {table.op_overhead * 1e6:.3g} us, per-step "
      f"{table.step_overhead * 1e6:.3g} us (each further argument "
      f"{table.argument_overhead * 1e6:.2g} us, output {table.output_overhead * 1e6:.2g} us), "
      f"kernel scale "
      f"{table.time_scale:.3g}, in a step x{table.graph_scale:.3g}; logical devices: "
      f"concurrency {_per_count(table.concurrency or 1, table.concurrency_at, 1)}, "
      f"collective {_per_count(table.collective_overhead, table.collective_at, 1e6)} us "
      f"(each further group's at once: x{table.collective_overlap:.2g}), transfer "
      f"{table.transfer_overhead * 1e6:.3g} us, each further pipeline stage "
      f"{_microseconds(table.stage_overhead)} ({time.perf_counter() - t0:.1f} s)\n")
  return 0


def _microseconds(seconds):
  return "unmeasured (too few logical CPUs)" if seconds is None else f"{seconds * 1e6:.3g} us"


def _per_count(two, more, scale):
  """'1.2 (2 devices), 1.1 (4)': a value measured over 2 devices and more."""
  text = f"{two * scale:.3g} (2 devices)"
  return ", ".join([text] + [f"{v * scale:.3g} ({n})" for n, v in sorted(more.items())])
