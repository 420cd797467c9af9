"""`tfsplit verify ORIGINAL REWRITTEN [--manifest M] [--steps 3]`.

Runs both graphs on the same seeded variables and inputs (on logical CPU
devices) and prints the largest absolute and relative errors. Exit code 0
when they match within --rtol, 1 when they do not, 2 on bad input.
"""
import sys

from absl import flags

from tfsplit.errors import TfsplitError


def _define_flags():
  fv = flags.FlagValues()
  flags.DEFINE_string("manifest", None, "Shard manifest of the rewritten graph (default: "
                      "REWRITTEN without extension + .manifest.json, if present).",
                      flag_values=fv)
  flags.DEFINE_string("signature", None, "SavedModel signature of ORIGINAL (the one "
                      "given to tfsplit rewrite --signature).", flag_values=fv)
  flags.DEFINE_integer("steps", 1, "How many times to run (a training step updates "
                       "its variables each time).", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "Seed of variable values and inputs.", flag_values=fv)
  flags.DEFINE_float("rtol", 1e-4, "Largest error of a tensor's values, relative to "
                     "the tensor's own largest magnitude.", flag_values=fv)
  flags.DEFINE_float("update_rtol", 1e-2, "Largest error of a variable's update over the "
                     "steps, relative to that variable's largest update.", flag_values=fv)
  flags.DEFINE_integer("int_max", None, "Integer inputs are drawn from [0, int_max) "
                       "(default: the smallest embedding table).", flag_values=fv)
  flags.DEFINE_boolean("all", False, "Show every variable, not only the worst.",
                       flag_values=fv)
  flags.DEFINE_string("variables", None, "Checkpoint prefix or SavedModel directory "
                      "ORIGINAL's variable shapes and names come from (the one given "
                      "to tfsplit rewrite --variables).", flag_values=fv)
  return fv


def main(argv):
  fv = _define_flags()
  try:
    positional = fv(argv)[1:]
  except flags.Error as e:
    raise TfsplitError(f"{e}; usage: tfsplit verify ORIGINAL REWRITTEN") from None
  if len(positional) != 2:
    raise TfsplitError("usage: tfsplit verify ORIGINAL REWRITTEN [--manifest M] [--steps N]")
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import devices as devices_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import verify as verify_lib  # pylint: disable=import-outside-toplevel
  # Devices first: loading a SavedModel starts TensorFlow's runtime, after
  # which the logical devices the rewritten graph needs can no longer be made.
  rewritten = load_graph(positional[1])
  devices_lib.ensure_logical_devices(devices_lib.required_devices(rewritten))
  original = load_graph(positional[0], signature=fv.signature, variables_from=fv.variables)
  from tfsplit.graph import recover  # pylint: disable=import-outside-toplevel
  recover.require_variable_shapes(original, positional[0])
  from tfsplit.passes import manifest as manifest_lib  # pylint: disable=import-outside-toplevel
  manifest = manifest_lib.find(positional[1], fv.manifest)
  report = verify_lib.verify(original, rewritten, manifest, steps=fv.steps, seed=fv.seed,
                             rtol=fv.rtol, int_max=fv.int_max,
                             update_rtol=fv.update_rtol)
  sys.stdout.write(report.table(show_all=fv.all) + "\n")
  return 0 if report.ok else 1
