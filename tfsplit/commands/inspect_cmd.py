"""What is in a graph: op histogram, variables (name, shape, dtype, layer), the
layer table (params, optimizer state, forward/backward FLOPs, activations kept
for backward) and totals. GRAPH is a .pb / .pbtxt GraphDef or a SavedModel
directory.

With --mesh, also the ops that would fall back to replication if the graph
were split over that mesh (as `tfsplit rewrite` would split it, with the same
--microbatches, --stages, --strategy and --annotate): grouped per op type,
with how many, example nodes and why. Nothing is rewritten.
"""
import collections
import sys

from absl import flags

from tfsplit import report as report_lib
from tfsplit.commands import common
from tfsplit.errors import TfsplitError

USAGE = ("tfsplit inspect GRAPH [--mesh dp=2,tp=2 [--microbatches N] [--stages S]] "
         "[--format table|json] [-o REPORT]")
ARGS = (1, 1)
_EXAMPLES = 3   # node names shown per op type in the table
def define_flags(fv):
  common.define_format(fv)
  common.define_output(fv, "Write the report here instead of stdout.")
  common.define_source(fv)
  flags.DEFINE_integer("layer-depth", None, "Force the name-scope depth of layers "
                       "(default: detected).", flag_values=fv)
  flags.DEFINE_integer("top-ops", 25, "Op types shown in the table.", flag_values=fv)
  flags.DEFINE_string("mesh", None, "Also list the ops that would fall back to "
                      "replication when split over this mesh, e.g. dp=2,tp=2 (pp= "
                      "adds pipeline stages).", flag_values=fv)
  flags.DEFINE_integer("microbatches", 1, "With --mesh: micro-batches per step.",
                       flag_values=fv)
  flags.DEFINE_integer("stages", 1, "With --mesh: pipeline stages (a pp axis in front "
                       "of --mesh).", flag_values=fv)
  flags.DEFINE_enum("strategy", "megatron", ["megatron", "none"], "With --mesh: how "
                    "to choose what to split.", flag_values=fv)
  flags.DEFINE_multi_string("annotate", [], "With --mesh: VARIABLE_GLOB=DIMS, as for "
                            "rewrite.", flag_values=fv)


def run(fv, args):
  mesh_flags = [f"--{n}" for n in ("microbatches", "stages", "strategy", "annotate")
                if fv[n].present]
  if mesh_flags and not fv.mesh:
    verb = "needs" if len(mesh_flags) == 1 else "need"
    raise TfsplitError(f"{', '.join(mesh_flags)} {verb} --mesh, the split whose "
                       "fallbacks to list (e.g. --mesh dp=2)")
  config = None
  if fv.mesh:
    from tfsplit.commands import split_flags  # pylint: disable=import-outside-toplevel
    config = split_flags.split_config(fv)  # a bad mesh fails before any work
  report = report_lib.inspect_graph(args[0], fv.signature, fv["layer-depth"].value,
                                    fv.variables, sections=[("experts", expert_section)])
  lines = report_lib.inspect_table(report, fv["top-ops"].value)
  # Before the variables table.
  at = lines.index("variables")
  lines[at:at] = expert_table(report["experts"]) + [""]
  if config is not None:
    report["fallbacks"] = mesh_fallbacks(args[0], config, fv)
    # Before the closing "inspected in" line.
    lines[-1:-1] = fallback_table(report["fallbacks"]) + [""]
  note = report_lib.unknown_shapes_note(report)
  if note:
    sys.stderr.write(f"tfsplit inspect: note: {note}\n")
  common.emit_report(fv.format, report, lines, fv.output)
  return 0


def expert_section(graph, shapes, variables, layers):
  """The mixture-of-experts layers: stacked expert weights (what an 'ep'
  axis would split), grouped per layer."""
  from tfsplit.strategies import experts as experts_lib  # pylint: disable=import-outside-toplevel
  found = experts_lib.find_expert_weights(graph, shapes, variables, layers.role)
  return experts_lib.expert_layers(found, layers.layer_of, variables)


def expert_table(layers):
  """Text lines of the expert section: one line when there are none."""
  if not layers:
    return ["expert layers: none (no stacked expert weights for an 'ep' axis)"]
  rows = [[l["layer"], l["scope"], str(l["experts"]), str(len(l["weights"])),
           report_lib.human_bytes(l["bytes"]), ", ".join(w.rsplit("/", 1)[-1]
                                                        for w in l["weights"])]
          for l in layers]
  counts = sorted({str(l["experts"]) for l in layers})
  return [f"expert layers: {len(layers)} ({' or '.join(counts)} experts each; an 'ep' "
          "mesh axis splits their weights by whole experts)",
          report_lib.format_table(["layer", "scope", "experts", "weights", "bytes",
                                   "weight names"], rows)]


def mesh_fallbacks(source, config, fv):
  """The fallbacks of splitting `source` under `config` (a SplitConfig),
  grouped per op type.

  Runs the split's own passes up to the stage assignment (propagation
  decides every fallback; a mesh that does not fit the graph fails there,
  as in rewrite) and leaves materializing the devices out."""
  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import load_graph, recover
  from tfsplit.passes import split as split_lib
  from tfsplit.passes.analysis import Analysis
  graph_def = load_graph(source, signature=fv.signature, variables_from=fv.variables)
  recover.require_variable_shapes(graph_def, source, fv.variables)
  state = split_lib.SplitState(config, config.split_mesh(),
                               Analysis(graph_def))
  last = split_lib.PASSES.index(split_lib.assign_stages)
  for pass_fn in split_lib.PASSES[:last + 1]:
    pass_fn(state)
  return group_fallbacks(state.propagation.fallbacks, config.mesh, config)


def group_fallbacks(fallbacks, mesh, config):
  """{mesh, ..., count, by_op: [{op, count, reasons: {reason: count}, nodes}]},
  op types by count (most first)."""
  groups = collections.OrderedDict()
  for fallback in fallbacks:   # propagate.Fallback: node, op and reason apart
    node, op, reason = fallback.node, fallback.op, fallback.reason
    group = groups.setdefault(op, {"op": op, "count": 0, "reasons": {}, "nodes": []})
    group["count"] += 1
    group["reasons"][reason] = group["reasons"].get(reason, 0) + 1
    group["nodes"].append(node)
  ops = sorted(groups.values(), key=lambda g: (-g["count"], g["op"]))
  return {"mesh": str(mesh), "microbatches": int(config.microbatches),
          "strategy": config.strategy, "count": len(fallbacks), "by_op": ops}


def fallback_table(data):
  """Text lines of a group_fallbacks result: one line when there are none."""
  where = f"mesh {data['mesh']}" + (f", {data['microbatches']} micro-batches"
                                    if data["microbatches"] > 1 else "")
  if not data["count"]:
    return [f"fallbacks to replication over {where}: none"]
  rows = []
  for g in data["by_op"]:
    shown = g["nodes"][:_EXAMPLES]
    more = len(g["nodes"]) - len(shown)
    rows.append([g["op"], str(g["count"]), "; ".join(g["reasons"]),
                 ", ".join(shown) + (f" (+{more} more)" if more else "")])
  n, kinds = data["count"], len(data["by_op"])
  verb = "gather their" if n > 1 else "gathers its"
  return [f"fallbacks to replication over {where}: {n} op{'s' if n > 1 else ''} "
          f"({kinds} op type{'s' if kinds > 1 else ''}) {verb} split inputs",
          report_lib.format_table(["op", "count", "reason", "nodes"], rows,
                                  align="<><<")]
