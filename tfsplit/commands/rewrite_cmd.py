"""`tfsplit rewrite IN -o OUT --mesh dp=2,tp=2 [--microbatches 4] [--strategy megatron]`.

Splits a graph over a device mesh and writes the rewritten GraphDef and, beside
it, its shard manifest (OUT without extension + '.manifest.json'). Both are
written atomically, and only after the whole rewrite succeeded.
"""
import sys
import time

from absl import flags

from tfsplit.errors import TfsplitError


def _define_flags():
  fv = flags.FlagValues()
  flags.DEFINE_string("output", None, "Where to write the rewritten graph (.pb/.pbtxt).",
                      short_name="o", flag_values=fv)
  flags.DEFINE_string("mesh", "tp=2", "Mesh axes, e.g. tp=4 or dp=2,tp=2.", flag_values=fv)
  flags.DEFINE_integer("microbatches", 1, "Micro-batches per step (in-graph gradient "
                       "accumulation); the batch must divide by dp x microbatches.",
                       flag_values=fv)
  flags.DEFINE_integer("stages", 1, "Pipeline stages (adds a pp axis in front of "
                       "--mesh); layers are balanced by FLOPs.", flag_values=fv)
  flags.DEFINE_enum("schedule", "1f1b", ["1f1b", "gpipe"], "Pipeline schedule.",
                    flag_values=fv)
  flags.DEFINE_string("layers", None, "Explicit stage layer ranges, e.g. '0:3,3:6' "
                      "(half-open, over the layers with parameters).", flag_values=fv)
  flags.DEFINE_enum("strategy", "megatron", ["megatron", "none"],
                    "How to choose what to split.", flag_values=fv)
  flags.DEFINE_multi_string("annotate", [], "VARIABLE_GLOB=DIMS, e.g. "
                            "'*/fc1/kernel=-,tp' (one entry per dimension, '-' = "
                            "replicated); overrides the strategy.", flag_values=fv)
  flags.DEFINE_enum("devices", "cpu", ["cpu", "gpu"], "Device type of the mesh.",
                    flag_values=fv)
  flags.DEFINE_string("job", "localhost", "Job name in device strings.", flag_values=fv)
  flags.DEFINE_float("collective_timeout", 600.0, "Seconds before a collective gives up "
                     "(a dead peer is then an error, not a hang).", flag_values=fv)
  flags.DEFINE_string("signature", None, "SavedModel signature to load.", flag_values=fv)
  flags.DEFINE_string("variables", None, "Checkpoint prefix or SavedModel directory to "
                      "take the shapes and names of IN's variables from, when IN was "
                      "written without them (tf.io.write_graph of a function's graph).",
                      flag_values=fv)
  return fv


def parse_annotation(text):
  pattern, sep, dims = text.rpartition("=")
  if not sep or not pattern:
    raise TfsplitError(f"cannot read --annotate '{text}'; write VARIABLE_GLOB=DIMS, e.g. "
                       "'*/fc1/kernel=-,tp'")
  return pattern, tuple(None if d.strip() in ("-", "", "none") else d.strip()
                        for d in dims.split(","))


def main(argv):
  fv = _define_flags()
  try:
    positional = fv(argv)[1:]
  except flags.Error as e:
    raise TfsplitError(f"{e}; usage: tfsplit rewrite IN -o OUT --mesh tp=4") from None
  if len(positional) != 1 or not fv.output:
    raise TfsplitError("usage: tfsplit rewrite IN -o OUT --mesh tp=4 [--strategy megatron]")
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.io import save_graph, write_atomically  # pylint: disable=import-outside-toplevel
  from tfsplit.sharding.mesh import Mesh  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import manifest as manifest_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import split_graph  # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  graph_def = load_graph(positional[0], signature=fv.signature, variables_from=fv.variables)
  from tfsplit.graph import recover  # pylint: disable=import-outside-toplevel
  recover.require_variable_shapes(graph_def, positional[0])
  axes = Mesh.parse(fv.mesh).axes
  if fv.stages > 1:
    if "pp" in axes:
      raise TfsplitError("give the pipeline either as --stages or as pp= in --mesh, "
                         "not both")
    axes = {"pp": fv.stages, **axes}
  layer_ranges = None
  if fv.layers:
    try:
      layer_ranges = [tuple(int(x) for x in part.split(":")) for part in fv.layers.split(",")]
    except ValueError:
      raise TfsplitError(f"cannot read --layers '{fv.layers}'; write start:end ranges, "
                         "e.g. 0:3,3:6") from None
  size = 1
  for s in axes.values():
    size *= s
  kind = fv.devices.upper()
  devices = [f"/job:{fv.job}/replica:0/task:0/device:{kind}:{i}" for i in range(size)]
  mesh = Mesh(axes, devices)
  annotations = dict(parse_annotation(a) for a in fv.annotate)
  result = split_graph(graph_def, mesh, strategy=fv.strategy, annotations=annotations,
                       timeout_seconds=fv.collective_timeout, microbatches=fv.microbatches,
                       schedule=fv.schedule, layer_ranges=layer_ranges)
  # Serialize both before writing either, so a failure leaves no output.
  manifest_text = result.manifest_json(source=positional[0])
  save_graph(result.graph_def, fv.output)
  write_atomically(manifest_lib.manifest_path(fv.output), manifest_text)
  split_vars = sum(1 for e in result.manifest.values() if any(e["sharding"]))
  sys.stdout.write(
      f"rewrote {positional[0]} over mesh {mesh} ({fv.strategy}) in "
      f"{time.perf_counter() - t0:.2f} s\n"
      f"  {len(graph_def.node)} -> {len(result.graph_def.node)} nodes, {split_vars} of "
      f"{len(result.manifest)} variables split\n"
      + (f"  pipeline: {len(result.partition)} stages {result.partition}, "
         f"{fv.schedule} over {fv.microbatches} micro-batches\n"
         if result.partition else "") +
      f"  collectives: {result.count('all_reduce')} all-reduce, "
      f"{result.count('local_sum')} micro-batch sums, "
      f"{result.count('all_gather')} all-gather; {len(result.fallbacks)} fallback(s) to "
      "replication\n")
  for msg in result.fallbacks:
    sys.stdout.write(f"  fallback: {msg}\n")
  sys.stdout.write(f"wrote {fv.output} and {manifest_lib.manifest_path(fv.output)}\n")
  return 0
