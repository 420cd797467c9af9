"""Plain-text tables and human-readable numbers for command output, and the
`tfsplit inspect` report of a graph (built as a dict, rendered as a table).

This module does not import TensorFlow at import time: the size-only
`tfsplit estimate` renders its tables with `format_table` too.
"""
import collections
import time

from tfsplit.units import format_bytes, format_count


def human_bytes(n):
  return "?" if n is None else format_bytes(n)


def human_count(n):
  return "?" if n is None else format_count(n)


def format_table(header, rows, align=None, indent="", rule=True):
  """The rows under `header` in columns two spaces apart, as one string.

  align: one '<' (left) or '>' (right) per column; by default the first two
  columns are left-aligned and the others right-aligned. rule: a line of
  dashes under the header. indent: put in front of every line.
  """
  cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
  widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(len(header))]
  align = align or "<<" + ">" * (len(header) - 2)

  def line(row):
    parts = [cell.ljust(widths[i]) if align[i] == "<" else cell.rjust(widths[i])
             for i, cell in enumerate(row)]
    return indent + "  ".join(parts).rstrip()
  lines = [line(cells[0])]
  if rule:
    lines.append(indent + "  ".join("-" * w for w in widths))
  return "\n".join(lines + [line(r) for r in cells[1:]])


# --- tfsplit inspect ---------------------------------------------------------------
def inspect_graph(source, signature=None, layer_depth=None, variables_from=None,
                  sections=()):
  """The inspect report of a graph as a dict (what `--format json` prints).

  variables_from: checkpoint or SavedModel with the variables of a graph file
  written without their shapes (see graph/recover.py). sections: (key,
  fn(graph, shapes, variables, layer report)) pairs whose results join the
  report under their key, over the same analysis (the command layer's
  additions, such as the expert layers).
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
    # Unknown shapes are reported once (unknown_shapes_note), not per variable.
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
        "trainable": v.trainable, "layer": report.layer_of.get(v.node),
        "readers": report.variable_readers.get(v.node, [])})
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
      "blocks": sum(l.block for l in report.layers),
      "layer_depth": report.depth,
      "seconds": round(time.perf_counter() - t0, 3),
  }
  out = {"source": str(source), "ops": dict(ops.most_common()),
         "variables": var_rows, "layers": layers, "totals": totals}
  for key, section in sections:
    out[key] = section(graph, shapes, variables, report)
  return out


def unknown_shapes_note(report):
  """One line naming the variables without a known shape, or None."""
  unknown = [v["name"] for v in report["variables"] if v["shape"] is None]
  if not unknown:
    return None
  return (f"{len(unknown)} of {len(report['variables'])} variables have no known shape "
          f"({', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''}); pass "
          "--variables PATH (a checkpoint or SavedModel holding them), or load the "
          "graph from its tf.function")


def inspect_table(report, top_ops=25):
  """The inspect report as text lines: ops, layers, variables."""
  out = []
  t = report["totals"]
  out.append(f"graph: {report['source']}")
  out.append(f"{t['nodes']} nodes, {t['variables']} variables, "
             f"{t['model_layers']} layers with parameters, {t['blocks']} of them "
             f"repeated blocks (scope depth {t['layer_depth']})")
  out.append("")
  ops = list(report["ops"].items())
  rest = sum(c for _, c in ops[top_ops:])
  rows = [[op, str(c)] for op, c in ops[:top_ops]]
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
                 f"{l['forward_ops']}/{l['backward_ops']}/{l['update_ops']}",
                 "block" if l["block"] else ""])
  rows.append(["", "total", human_count(t["param_count"]), human_bytes(t["param_bytes"]),
               human_bytes(t["optimizer_state_bytes"]), human_count(t["forward_flops"]),
               human_count(t["backward_flops"]), human_bytes(t["activation_bytes"]), "", ""])
  out.append(format_table(
      ["#", "layer", "params", "param bytes", "opt state", "fwd FLOPs",
       "bwd FLOPs", "activations", "ops f/b/u", "kind"], rows))
  out.append("")
  out.append("variables")
  rows = [[v["name"], str(v["shape"]), v["dtype"], human_bytes(v["bytes"]),
           {True: "yes", False: "no", None: "?"}[v["trainable"]],
           " + read by ".join([v["layer"] or ""] + v["readers"][1:])]
          for v in report["variables"]]
  out.append(format_table(["variable", "shape", "dtype", "bytes", "trainable", "layer"], rows))
  out.append("")
  out.append(f"inspected in {t['seconds']:.2f} s")
  return out
