"""Chrome-trace JSON of one real step of a (rewritten) graph.

Runs the graph once to warm up and once with full tracing in a Session on
logical CPU devices, and writes a Chrome-trace / Perfetto JSON of every op per
device (open it in chrome://tracing or ui.perfetto.dev). Ops of a split graph
are labelled with their micro-batch and forward/backward role, so a pipeline
schedule's order can be looked at.
"""
import sys

from absl import flags

from tfsplit.commands import common

USAGE = "tfsplit trace GRAPH -o trace.json [--manifest M]"
ARGS = (1, 1)
REQUIRED = ("output",)


def define_flags(fv):
  common.define_output(fv, "Trace JSON to write.")
  flags.DEFINE_string("manifest", None, "Shard manifest (default: beside GRAPH).",
                      flag_values=fv)
  flags.DEFINE_string("original", None, "The original graph (for forward/backward labels; "
                      "default: the manifest's source).", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "Seed of variable values and inputs.", flag_values=fv)
  flags.DEFINE_string("cluster", None, "For a graph placed on worker tasks (tfsplit "
                      "rewrite --cluster): the cluster that runs it, TF_CONFIG or a JSON "
                      "file (default: TF_CONFIG, as 'tfsplit launch' sets it).",
                      flag_values=fv)
  flags.DEFINE_float("timeout", 600.0, "On a cluster: seconds a step may take.",
                     lower_bound=0.0, flag_values=fv)


def run(fv, args):
  from tfsplit.runtime import trace  # pylint: disable=import-outside-toplevel
  events, devices = trace.trace_file(args[0], fv.output, fv.manifest, fv.original,
                                       fv.seed, fv.cluster, fv.timeout)
  sys.stdout.write(f"traced {events} op executions on {devices} devices; "
                   f"wrote {fv.output}\n")
  return 0
