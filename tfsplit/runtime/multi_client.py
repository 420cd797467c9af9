"""One client per task: the worker process that runs the script runs its
own task's part of the split.

When TF_CONFIG names this process's task (as `tfsplit launch --each` and
every multi-worker launcher set it), tfsplit.split builds only that task's
graph (sharding/tasks.py) and runs it here: this process serves its task
(an in-process tf.distribute.Server, started once), and a Session on that
server runs the graph with the cluster's collective group leader, a device
filter on this task alone (no other task is contacted but through
collectives) and an operation timeout, so a dead or hung peer ends the step
with one line naming it.

Before the first step every task gathers every other task's plan
fingerprint (one small collective): a worker whose graph or flags differ is
refused at start with one line instead of hanging on keys its peers never
use. At exit, after a step that succeeded, the tasks meet once more, so no
task takes its server down while a peer still finishes its last step.
"""
import atexit
import json
import zlib

import numpy as np

from tfsplit.errors import TfsplitError
from tfsplit.runtime import cluster as cluster_lib
from tfsplit.runtime import workers as workers_lib
from tfsplit.sharding.tasks import task_of

# Instance keys of the start and exit meetings: above the range the split's
# collectives use (sharding/reshard.py counts up from a 28-bit seed << 2).
_HANDSHAKE_KEY = 0x7FFFFF00
_BARRIER_KEY = 0x7FFFFF01
_BARRIER_SECONDS = 30.0
_SERVERS = {}


def own_task(cluster):
  """This process's task index if TF_CONFIG names one of the cluster's mesh
  job (every worker runs the script), else None (one client drives all)."""
  if cluster is None or cluster.task_index is None or cluster.task_type != cluster.job:
    return None
  return int(cluster.task_index)


def local_server(cluster):
  """The tf.distribute.Server of this process's task, started on first use."""
  key = (json.dumps(cluster.spec, sort_keys=True), cluster.job, cluster.task_index)
  if key not in _SERVERS:
    cpus = cluster.devices_per_task if cluster.kind == "CPU" else None
    try:
      _SERVERS[key] = workers_lib.start_server(cluster.spec, cluster.job,
                                               int(cluster.task_index), cpus=cpus)
    except Exception as e:  # pylint: disable=broad-except
      first = (str(e).strip().splitlines() or [type(e).__name__])[0]
      raise cluster_lib.ClusterError(
          f"cannot serve task {cluster.task_index} of job '{cluster.job}' on "
          f"{cluster.addresses[int(cluster.task_index)]} ({first[:200]})") from None
  return _SERVERS[key]


def plan_fingerprint(original_graph_def, config):
  """A 31-bit number that differs between tasks splitting other graphs, or
  the same graph otherwise (another mesh, schedule, option)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  # Every field but the task (which differs between tasks by design); the
  # mesh by its axes and devices (its repr may hold object ids).
  options = tuple(getattr(config, f.name) for f in dataclasses.fields(config)
                  if f.name not in ("task", "mesh"))
  text = repr((sorted(config.mesh.axes.items()), list(config.mesh.devices),
               options))
  return zlib.crc32(text.encode(), zlib.crc32(
      original_graph_def.SerializeToString(deterministic=True))) & 0x7FFFFFFF


def task_shards(manifest, task):
  """The manifest with only the shards that live on `task`."""
  return {name: dict(entry, shards=[s for s in entry["shards"]
                                    if task_of(s["device"]) == task])
          for name, entry in manifest.items()}


class _Meeting(object):
  """A gather of one int64 per task over the first device of each task."""

  def __init__(self, cluster, instance_key, timeout_seconds):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfsplit.sharding.builder import NodeMaker  # pylint: disable=import-outside-toplevel
    task = own_task(cluster)
    members = [cluster.device(t, 0) for t in range(cluster.num_tasks)]
    device = members[task]
    group_key = (zlib.crc32(",".join(members).encode()) & 0x3FFFFFFF) + 1
    graph_def = tf.compat.v1.GraphDef()
    placeholder = graph_def.node.add(name="value", op="Placeholder", device=device)
    placeholder.attr["dtype"].type = tf.int64.as_datatype_enum
    make = NodeMaker({"value"})
    keys = [make.const(name, np.int32(v), device)
            for name, v in (("group_size", len(members)), ("group_key", group_key),
                            ("instance_key", instance_key))]
    graph_def.node.extend(keys)
    graph_def.node.add().CopyFrom(make.collective(
        "CollectiveGatherV2", "gathered", device, ["value"] + [k.name for k in keys],
        tf.int64.as_datatype_enum, timeout_seconds))
    self.graph = tf.Graph()
    with self.graph.as_default():
      tf.graph_util.import_graph_def(graph_def, name="")
    config = cluster_lib.client_config(graph_def, cluster, timeout_seconds)
    config.device_filters.append(f"/job:{cluster.job}/task:{task}")
    self.session = tf.compat.v1.Session(local_server(cluster).target, graph=self.graph,
                                        config=config)

  def run(self, value):
    return self.session.run("gathered:0", feed_dict={"value:0": np.asarray([value],
                                                                         np.int64)})


class TaskRunner(object):
  """This task's graph on this process's server (see the module doc); every
  failure a one-line ClusterError naming the task that stopped."""

  def __init__(self, graph_def, values, cluster, timeout_seconds, fingerprint):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    self.cluster, self.task = cluster, own_task(cluster)
    self.timeout = timeout_seconds
    self._errors = (tf.errors.OpError,)
    server = local_server(cluster)
    try:
      seen = _Meeting(cluster, _HANDSHAKE_KEY, timeout_seconds).run(fingerprint)
    except self._errors as e:
      raise cluster_lib.explain_failure(e, cluster, "meeting the other workers") from None
    differ = [t for t, f in enumerate(seen) if int(f) != int(seen[0])]
    if differ:
      raise cluster_lib.ClusterError(
          "worker " + ", ".join(f"/job:{cluster.job}/task:{t}" for t in differ) +
          " split another graph or plan than task 0 (another script, model or flags); "
          "run the same script with the same flags on every worker")
    config = cluster_lib.client_config(graph_def, cluster, timeout_seconds)
    config.device_filters.append(f"/job:{cluster.job}/task:{self.task}")
    from tfsplit.runtime import session as session_lib  # pylint: disable=import-outside-toplevel
    self.runner = self._call("initialising the variables", session_lib.SessionRunner,
                             graph_def, values, target=server.target, config=config)
    atexit.register(self._leave)

  @property
  def outputs(self):
    return self.runner.outputs

  def _call(self, what, fn, *args, **kwargs):
    try:
      out = fn(*args, **kwargs)
      self.healthy = True
      return out
    except self._errors as e:
      self.healthy = False
      raise cluster_lib.explain_failure(e, self.cluster, what) from None

  def run(self, inputs, trace=False, fetch=None):
    return self._call(f"the step on task {self.task}", self.runner.run, inputs,
                      trace=trace, fetch=fetch)

  def assign(self, values):
    return self._call("assigning the variables", self.runner.assign, values)

  def variable_values(self, names):
    return self._call("reading the variables", self.runner.variable_values, names)

  def _leave(self):
    """Waits (bounded) for every task to end its steps, after a good step."""
    if not self.healthy:
      return
    try:
      _Meeting(self.cluster, _BARRIER_KEY, min(self.timeout or _BARRIER_SECONDS,
                                               _BARRIER_SECONDS)).run(0)
    except Exception:  # pylint: disable=broad-except
      pass


def check_tasks(mesh, cluster):
  """Every task of the cluster must hold part of the mesh (each runs the script)."""
  used = sorted({task_of(d) for d in mesh.devices})
  if used != list(range(cluster.num_tasks)):
    raise TfsplitError(
        f"mesh {mesh} uses {len(used)} of the cluster's {cluster.num_tasks} tasks; when "
        "every worker runs the script each must hold part of the mesh: run "
        f"{len(used)} workers, or a mesh of {cluster.num_tasks * cluster.devices_per_task} "
        "devices")
