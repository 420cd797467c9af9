"""The `tfsplit` command: `tfsplit <command> [args] [--flags]`.

Commands live in their own modules (tfsplit/commands/*_cmd.py); parsing their
flags, --help and usage errors is tfsplit.commands.common's. This module only
dispatches and turns TfsplitError into one stderr line with exit code 2 (no
traceback for user errors).
"""
import importlib
import sys

from tfsplit.commands import common
from tfsplit.errors import TfsplitError

# command name -> (module, one-line help). Modules are imported lazily so that
# commands that do not need TensorFlow start fast.
COMMANDS = {
    "inspect": ("tfsplit.commands.inspect_cmd", "op histogram, variables and layer table of a graph"),
    "rewrite": ("tfsplit.commands.rewrite_cmd", "split a graph over a device mesh (writes graph + shard manifest)"),
    "verify": ("tfsplit.commands.verify_cmd", "run original and rewritten graphs on seeded inputs and compare"),
    "trace": ("tfsplit.commands.trace_cmd", "Chrome-trace JSON of one real step of a (rewritten) graph"),
    "plan": ("tfsplit.commands.plan_cmd", "choose mesh, micro-batches, schedule, stage cut, recompute and ZeRO for N devices"),
    "estimate": ("tfsplit.commands.estimate_cmd", "memory from a parameter count; pipeline simulation; a graph's memory and step"),
    "calibrate": ("tfsplit.commands.calibrate_cmd", "measure op costs on this machine into a cost table"),
    "worker": ("tfsplit.commands.worker_cmd", "serve one task of a multi-worker cluster (TF gRPC server)"),
    "launch": ("tfsplit.commands.launch_cmd", "run a command as the client of N local worker processes"),
}

# Commands that can run without importing TensorFlow (e.g. a size-only estimate).
LIGHT_COMMANDS = frozenset(["estimate", "launch"])

USAGE = "usage: tfsplit <command> [args] [--flags]\n\ncommands:\n" + "\n".join(
    f"  {name:10s} {help_}" for name, (_, help_) in COMMANDS.items()) + \
    "\n\nRun 'tfsplit <command> --help' for the flags of one command.\n"


def run(argv=None):
  """Console-script entry point."""
  argv = list(sys.argv if argv is None else argv)
  if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
    sys.stdout.write(USAGE)
    return 0 if len(argv) >= 2 else 2
  command = argv[1]
  if command not in COMMANDS:
    sys.stderr.write(f"tfsplit: unknown command '{command}'; choose one of: "
                     f"{', '.join(COMMANDS)}\n")
    return 2
  if command not in LIGHT_COMMANDS:
    common.quiet_tensorflow()
  module = importlib.import_module(COMMANDS[command][0])
  try:
    return common.main(command, module, argv[2:])
  except TfsplitError as e:
    sys.stderr.write(f"tfsplit {command}: error: {e}\n")
    return 2


def main():
  sys.exit(run())


if __name__ == "__main__":
  main()
