"""Run the original and the rewritten graph on seeded inputs and compare.

Runs both graphs on the same seeded variables and inputs (on logical CPU
devices) and prints the largest absolute and relative errors. Exit code 0
when they match within --rtol, 1 when they do not, 2 on bad input.
"""
import sys

from absl import flags

from tfsplit.commands import common

USAGE = "tfsplit verify ORIGINAL REWRITTEN [--manifest M] [--steps N]"
ARGS = (2, 2)


def define_flags(fv):
  flags.DEFINE_string("manifest", None, "Shard manifest of the rewritten graph (default: "
                      "REWRITTEN without extension + .manifest.json, if present).",
                      flag_values=fv)
  flags.DEFINE_integer("steps", 1, "How many times to run (a training step updates "
                       "its variables each time).", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "Seed of variable values and inputs.", flag_values=fv)
  flags.DEFINE_float("rtol", 1e-4, "Largest error of a tensor's values, relative to "
                     "the tensor's own largest magnitude.", flag_values=fv)
  flags.DEFINE_float("update-rtol", 1e-2, "Largest error of a variable's update over the "
                     "steps, relative to that variable's largest update.", flag_values=fv)
  flags.DEFINE_integer("int-max", None, "Integer inputs are drawn from [0, int-max) "
                       "(default: the smallest embedding table).", flag_values=fv)
  flags.DEFINE_boolean("all", False, "Show every variable, not only the worst.",
                       flag_values=fv)
  flags.DEFINE_string("cluster", None, "For a graph placed on worker tasks (tfsplit "
                      "rewrite --cluster): the cluster that runs it, TF_CONFIG or a JSON "
                      "file (default: TF_CONFIG, as 'tfsplit launch' sets it).",
                      flag_values=fv)
  flags.DEFINE_float("timeout", 600.0, "On a cluster: seconds a step may take before it "
                     "fails (a dead worker is then an error naming it, not a hang).",
                     lower_bound=0.0, flag_values=fv)
  common.define_source(fv, "ORIGINAL")


def run(fv, args):
  from tfsplit.runtime import verify  # pylint: disable=import-outside-toplevel
  report = verify.verify_files(*args, **common.values(
      fv, "manifest", "signature", "variables", "steps", "seed", "rtol", "int-max",
      "update-rtol", "cluster"), timeout_seconds=fv.timeout)
  sys.stdout.write(report.table(show_all=fv.all) + "\n")
  return 0 if report.ok else 1
