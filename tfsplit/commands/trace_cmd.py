"""`tfsplit trace GRAPH -o trace.json [--manifest M]`: one real step, traced.

Runs the (rewritten) graph once to warm up and once with full tracing in a
Session on logical CPU devices, and writes a Chrome-trace / Perfetto JSON of
every op per device (open it in chrome://tracing or ui.perfetto.dev). Ops of a
split graph are labelled with their micro-batch and forward/backward role, so
a pipeline schedule's order can be looked at.
"""
import os
import sys

from absl import flags

from tfsplit.errors import TfsplitError


def _define_flags():
  fv = flags.FlagValues()
  flags.DEFINE_string("output", None, "Trace JSON to write.", short_name="o", flag_values=fv)
  flags.DEFINE_string("manifest", None, "Shard manifest (default: beside GRAPH).",
                      flag_values=fv)
  flags.DEFINE_string("original", None, "The original graph (for forward/backward labels; "
                      "default: the manifest's source).", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "Seed of variable values and inputs.", flag_values=fv)
  return fv


def main(argv):
  fv = _define_flags()
  try:
    positional = fv(argv)[1:]
  except flags.Error as e:
    raise TfsplitError(f"{e}; usage: tfsplit trace GRAPH -o trace.json") from None
  if len(positional) != 1 or not fv.output:
    raise TfsplitError("usage: tfsplit trace GRAPH -o trace.json [--manifest M]")
  from tfsplit.passes import manifest as manifest_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import Graph, load_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.layers import detect_layers  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import session as session_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import devices as devices_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import seeds  # pylint: disable=import-outside-toplevel
  from tfsplit.sharding.mesh import Mesh  # pylint: disable=import-outside-toplevel
  graph_def = load_graph(positional[0])
  data = manifest_lib.find(positional[0], fv.manifest)
  manifest = data["variables"] if data else None
  devices_lib.ensure_logical_devices(devices_lib.required_devices(graph_def))
  values = session_lib.seeded_values(graph_def, manifest, fv.seed)
  runner = session_lib.SessionRunner(graph_def, values)
  original_path = fv.original or (data or {}).get("source")
  source_graph = load_graph(original_path) if original_path and os.path.exists(
      original_path) else graph_def
  inputs = seeds.seeded_inputs(Graph(source_graph), fv.seed)
  runner.run(inputs)
  _, metadata = runner.run(inputs, trace=True)
  events = session_lib.op_events(metadata)
  labels = {}
  if data:
    mesh = Mesh(data["mesh"], data["devices"]).with_microbatches(data.get("microbatches", 1))
    labels = session_lib.microbatch_labels(events, detect_layers(Graph(source_graph)).role,
                                           mesh, graph_def)
  session_lib.write_chrome_trace(events, fv.output, labels)
  sys.stdout.write(f"traced {len(events)} op executions on "
                   f"{len({e[0] for e in events})} devices; wrote {fv.output}\n")
  return 0
