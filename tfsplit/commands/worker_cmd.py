"""Serve one task of a multi-worker cluster with TF's gRPC runtime.

Reads the cluster and this process's task from TF_CONFIG (or --cluster and
--task-index), starts a tf.distribute.Server for that task (with --devices-
per-task CPU devices, or the process's GPUs) and serves until SIGTERM or
SIGINT, or until its stdin closes when stdin is a pipe (the process that
started it is gone). The client that drives training (`tfsplit verify`, a
training script calling tfsplit.split) runs elsewhere: see `tfsplit launch`.
"""
import sys

from absl import flags

USAGE = "tfsplit worker [--cluster TF_CONFIG|spec.json] [--task-index I]"
ARGS = (0, 0)


def define_flags(fv):
  flags.DEFINE_string("cluster", "TF_CONFIG", "The cluster: TF_CONFIG (the environment "
                      "variable) or a JSON file (a TF_CONFIG or {\"worker\": "
                      "[\"host:port\", ...]}).", flag_values=fv)
  flags.DEFINE_integer("task-index", None, "This process's task in the worker job "
                       "(default: TF_CONFIG's task).", lower_bound=0, flag_values=fv)
  flags.DEFINE_integer("devices-per-task", None, "CPU devices of this task (default: "
                       "TF_CONFIG's tfsplit.devices_per_task, else 1).", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_integer("inter-op-threads", 0, "Inter-op threads (0: TF's default).",
                       lower_bound=0, flag_values=fv)
  flags.DEFINE_integer("intra-op-threads", 0, "Intra-op threads (0: TF's default).",
                       lower_bound=0, flag_values=fv)


def run(fv, args):
  del args
  from tfsplit.errors import ClusterSpecError  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import workers  # pylint: disable=import-outside-toplevel
  cluster = cluster_lib.resolve(fv.cluster, devices_per_task=fv["devices-per-task"].value,
                                required=True)
  index = fv["task-index"].value
  if index is None:
    if cluster.task_type not in (None, cluster.job) or cluster.task_index is None:
      what = (f"task {cluster.task_type!r}, not a task of job '{cluster.job}'"
              if cluster.task_type not in (None, cluster.job) else "no task")
      raise ClusterSpecError(
          f"{cluster.source} names {what}; give --task-index or a TF_CONFIG whose task "
          f"is {{\"type\": \"{cluster.job}\", \"index\": I}}")
    index = int(cluster.task_index)
  if index >= cluster.num_tasks:
    raise ClusterSpecError(f"task {index} is not in the cluster ({cluster.describe()})")
  cpus = cluster.devices_per_task if cluster.kind == "CPU" else None
  try:
    workers.start_server(cluster.spec, cluster.job, index, cpus,
                         fv["inter-op-threads"].value, fv["intra-op-threads"].value)
  except Exception as e:  # pylint: disable=broad-except
    raise ClusterSpecError(f"cannot start the server of task {index} at "
                           f"{cluster.addresses[index]}: {str(e).splitlines()[0]}") from None
  sys.stderr.write(f"tfsplit worker: serving /job:{cluster.job}/task:{index} on "
                   f"{cluster.addresses[index]} ({cluster.devices_per_task} "
                   f"{cluster.kind})\n")
  sys.stderr.flush()
  workers.serve_forever({"task": index, "address": cluster.addresses[index]})
  return 0
