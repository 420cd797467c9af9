"""`tfsplit inspect GRAPH [--format table|json]`: what is in a graph.

Op histogram, variables (name, shape, dtype, layer), the layer table (params,
optimizer state, forward/backward FLOPs, activations kept for backward) and
totals. GRAPH is a .pb / .pbtxt GraphDef or a SavedModel directory.
"""
import collections
import json
import sys
import time

from absl import flags

from tfsplit.errors import TfsplitError
from tfsplit.report import human_bytes, human_count, format_table


def _define_flags():
  fv = flags.FlagValues()
  flags.DEFINE_enum("format", "table", ["table", "json"], "Output format.", flag_values=fv)
  flags.DEFINE_string("signature", None, "SavedModel signature to load.", flag_values=fv)
  flags.DEFINE_integer("layer_depth", None, "Force the name-scope depth of layers "
                       "(default: detected).", flag_values=fv)
  flags.DEFINE_integer("top_ops", 25, "Op types shown in the table.", flag_values=fv)
  flags.DEFINE_string("output", None, "Write the report here instead of stdout.",
                      flag_values=fv)
  flags.DEFINE_string("variables", None, "Checkpoint prefix or SavedModel directory to "
                      "take the shapes and names of GRAPH's variables from, when GRAPH "
                      "was written without them (tf.io.write_graph of a function's "
                      "graph).", flag_values=fv)
  return fv


def inspect_graph(source, signature=None, layer_depth=None, variables_from=None):
  """The inspect report as a dict (what `--format json` prints).

  variables_from: checkpoint or SavedModel with the variables of a graph file
  written without their shapes (see graph/recover.py).
  """
  from absl import logging  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import Graph, find_variables, infer_shapes, load_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.layers import detect_layers  # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  graph_def = load_graph(source, signature=signature, variables_from=variables_from)
  graph = Graph(graph_def)
  variables = find_variables(graph)
  verbosity = logging.get_verbosity()
  if any(v.shape is None for v in variables):
    # Unknown shapes are reported once, by main(), not once per variable.
    logging.set_verbosity(logging.ERROR)
  try:
    shapes = infer_shapes(graph, variables)
  finally:
    logging.set_verbosity(verbosity)
  report = detect_layers(graph, shapes, variables, depth=layer_depth)
  ops = collections.Counter(n.op for n in graph.nodes)
  var_rows = []
  for v in variables:
    var_rows.append({
        "name": v.name, "node": v.node, "shape": list(v.shape) if v.shape is not None else None,
        "dtype": v.dtype_name, "bytes": v.num_bytes,
        "trainable": v.trainable, "layer": report.layer_of.get(v.node)})
  layers = [l.as_dict() for l in report.layers]
  totals = {
      "nodes": len(graph),
      "functions_left": len(graph_def.library.function),
      "variables": len(variables),
      "param_count": sum(l.param_count for l in report.layers),
      "param_bytes": sum(l.param_bytes for l in report.layers),
      "optimizer_state_bytes": sum(l.slot_bytes for l in report.layers),
      "forward_flops": sum(l.forward_flops for l in report.layers),
      "backward_flops": sum(l.backward_flops for l in report.layers),
      "activation_bytes": sum(l.activation_bytes for l in report.layers),
      "model_layers": len(report.model_layers),
      "layer_depth": report.depth,
      "seconds": round(time.perf_counter() - t0, 3),
  }
  return {"source": str(source), "ops": dict(ops.most_common()),
          "variables": var_rows, "layers": layers, "totals": totals}


def render_table(report, top_ops=25):
  out = []
  t = report["totals"]
  out.append(f"graph: {report['source']}")
  out.append(f"{t['nodes']} nodes, {t['variables']} variables, "
             f"{t['model_layers']} layers with parameters (scope depth "
             f"{t['layer_depth']})")
  out.append("")
  ops = list(report["ops"].items())
  shown = ops[:top_ops]
  rest = sum(c for _, c in ops[top_ops:])
  rows = [[op, str(c)] for op, c in shown]
  if rest:
    rows.append([f"({len(ops) - top_ops} more op types)", str(rest)])
  out.append("ops")
  out.append(format_table(["op", "count"], rows))
  out.append("")
  out.append("layers")
  rows = []
  for l in report["layers"]:
    rows.append([str(l["index"]), l["name"], human_count(l["param_count"]),
                 human_bytes(l["param_bytes"]), human_bytes(l["slot_bytes"]),
                 human_count(l["forward_flops"]), human_count(l["backward_flops"]),
                 human_bytes(l["activation_bytes"]),
                 f"{l['forward_ops']}/{l['backward_ops']}/{l['update_ops']}"])
  rows.append(["", "total", human_count(t["param_count"]), human_bytes(t["param_bytes"]),
               human_bytes(t["optimizer_state_bytes"]), human_count(t["forward_flops"]),
               human_count(t["backward_flops"]), human_bytes(t["activation_bytes"]), ""])
  out.append(format_table(
      ["#", "layer", "params", "param bytes", "opt state", "fwd FLOPs",
       "bwd FLOPs", "activations", "ops f/b/u"], rows))
  out.append("")
  out.append("variables")
  rows = [[v["name"], str(v["shape"]), v["dtype"], human_bytes(v["bytes"]),
           {True: "yes", False: "no", None: "?"}[v["trainable"]], v["layer"] or ""]
          for v in report["variables"]]
  out.append(format_table(["variable", "shape", "dtype", "bytes", "trainable", "layer"], rows))
  out.append("")
  out.append(f"inspected in {t['seconds']:.2f} s")
  return "\n".join(out) + "\n"


def main(argv):
  fv = _define_flags()
  try:
    positional = fv(argv)[1:]
  except flags.Error as e:
    raise TfsplitError(f"{e}; usage: tfsplit inspect GRAPH [--format table|json]") from None
  if fv["help"].value if "help" in fv else False:
    print(fv.module_help(__name__))
    return 0
  if len(positional) != 1:
    raise TfsplitError("expected one graph path; usage: tfsplit inspect GRAPH "
                       "[--format table|json]")
  report = inspect_graph(positional[0], fv.signature, fv.layer_depth, fv.variables)
  unknown = [v["name"] for v in report["variables"] if v["shape"] is None]
  if unknown:
    sys.stderr.write(
        f"tfsplit inspect: note: {len(unknown)} of {len(report['variables'])} variables "
        f"have no known shape ({', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''}"
        "); pass --variables PATH (a checkpoint or SavedModel holding them), or load the "
        "graph from its tf.function\n")
  text = (json.dumps(report, indent=1) + "\n" if fv.format == "json"
          else render_table(report, fv.top_ops))
  if fv.output:
    from tfsplit.graph.io import write_atomically  # pylint: disable=import-outside-toplevel
    write_atomically(fv.output, text)
  else:
    sys.stdout.write(text)
  return 0
