"""Run a command as the client of N local worker processes, or in each of them.

Starts N `tfsplit worker` processes, each a TF gRPC server on a free
127.0.0.1 port (task i of job 'worker', with --devices-per-worker devices),
waits until every one serves, then runs COMMAND with TF_CONFIG naming the
cluster: a training script that calls tfsplit.split, or `tfsplit rewrite
--cluster TF_CONFIG`, `tfsplit verify`, `tfsplit trace` on a graph placed on
the workers. Exits with COMMAND's exit code, and stops every worker it
started (and whatever COMMAND left running) when COMMAND ends, fails or is
interrupted.

With --each, COMMAND runs in every one of N processes instead, each with a
TF_CONFIG naming its own task (every worker runs the same script, as
multi-worker jobs do): tfsplit.split in each builds and runs only its task's
part of the split. Exits 0 if every worker did, else with the code of the
first that failed.
"""
from absl import flags

USAGE = "tfsplit launch --workers N [--devices-per-worker K] [--each] -- COMMAND [ARGS...]"
ARGS = (1, None)


def define_flags(fv):
  flags.DEFINE_integer("workers", 2, "Worker processes to start.", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_integer("devices-per-worker", 1, "Devices of each worker (logical CPUs; "
                       "with --devices gpu, that many GPUs each).", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_enum("devices", "cpu", ["cpu", "gpu"], "Device type of the workers.",
                    flag_values=fv)
  flags.DEFINE_float("start-timeout", 120.0, "Seconds to wait for the workers to serve.",
                     lower_bound=1.0, flag_values=fv)
  flags.DEFINE_boolean("each", False, "Run COMMAND in every worker process, each with "
                       "TF_CONFIG naming its task (one client per task), instead of once "
                       "as the client of N 'tfsplit worker' processes.", flag_values=fv)
  flags.DEFINE_string("logdir", None, "Where the workers' logs go (default: a new "
                      "temporary directory).", flag_values=fv)


def run(fv, args):
  from tfsplit.errors import TfsplitError  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import workers  # pylint: disable=import-outside-toplevel
  try:
    if fv.each:
      return workers.launch_each(list(args), fv.workers, fv["devices-per-worker"].value,
                                 fv.devices)
    return workers.launch(list(args), fv.workers, fv["devices-per-worker"].value,
                          fv.devices, fv["start-timeout"].value, fv.logdir)
  except workers.WorkerError as e:
    raise TfsplitError(str(e).splitlines()[0]) from None
