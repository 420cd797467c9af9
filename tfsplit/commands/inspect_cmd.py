"""What is in a graph: op histogram, variables (name, shape, dtype, layer), the
layer table (params, optimizer state, forward/backward FLOPs, activations kept
for backward) and totals. GRAPH is a .pb / .pbtxt GraphDef or a SavedModel
directory.
"""
import sys

from absl import flags

from tfsplit import report as report_lib
from tfsplit.commands import common

USAGE = "tfsplit inspect GRAPH [--format table|json] [-o REPORT]"
ARGS = (1, 1)


def define_flags(fv):
  common.define_format(fv)
  common.define_output(fv, "Write the report here instead of stdout.")
  common.define_source(fv)
  flags.DEFINE_integer("layer-depth", None, "Force the name-scope depth of layers "
                       "(default: detected).", flag_values=fv)
  flags.DEFINE_integer("top-ops", 25, "Op types shown in the table.", flag_values=fv)


def run(fv, args):
  report = report_lib.inspect_graph(args[0], fv.signature, fv["layer-depth"].value,
                                    fv.variables)
  note = report_lib.unknown_shapes_note(report)
  if note:
    sys.stderr.write(f"tfsplit inspect: note: {note}\n")
  common.emit_report(fv.format, report, report_lib.inspect_table(report, fv["top-ops"].value),
                     fv.output)
  return 0
