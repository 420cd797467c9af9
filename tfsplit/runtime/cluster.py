"""Clusters of TF worker tasks: where a mesh's devices live, and running there.

A cluster is given the way TF users give one to a multi-worker job: the
TF_CONFIG environment variable ({"cluster": {"worker": ["host:port", ...]},
"task": {...}}), a JSON file holding a TF_CONFIG or a bare cluster
({"worker": [...]}), or a `tf.distribute.cluster_resolver.ClusterResolver`.
Both go through TF's own resolvers (TFConfigClusterResolver,
SimpleClusterResolver). tfsplit reads one optional key of its own from a
TF_CONFIG, "tfsplit": {"devices_per_task": K, "device_type": "CPU"|"GPU"}
(TF ignores keys it does not know; `tfsplit launch` writes it).

The mesh is placed on `/job:worker/replica:0/task:i/device:KIND:j`: the
axes that cross tasks (by default the data-parallel and pipeline axes, `dp`
and `pp`) choose the task, the others (tensor-parallel) the device within
it, so the collectives of a tensor-parallel layer stay inside one process.
When that does not fit (tp=2 over tasks of one device each), the mesh is
laid over the task-major device list with the crossing axes slowest.

One client drives every task (see BUILD_NOTES.md, "Multi-worker"): a
Session on task 0's master, the cluster's collectives led by task 0, every
step bounded by an operation timeout, and a failed step explained in one
line naming the task that no longer answers.
"""
import json
import os
import re
import time

import numpy as np

from tfsplit import constants
from tfsplit.errors import ClusterSpecError, TfsplitError
from tfsplit.runtime import workers as workers_lib

ENV = "TF_CONFIG"
OWN_KEY = "tfsplit"
DEFAULT_ACROSS = (constants.PIPELINE_AXIS, "dp")
# After a failed step, how long to look for a task whose port closed.
DEAD_PROBE_SECONDS = 3.0


class ClusterError(TfsplitError):
  """A cluster that cannot be reached, or a task that stopped answering."""


class Cluster(object):
  """The worker tasks of a cluster and the devices of each.

  spec: {job: [address, ...]}; job: the job the mesh runs on; kind: 'CPU' or
  'GPU'; devices_per_task: devices of that kind per task; task_type /
  task_index: this process's task, if TF_CONFIG names one.
  """

  def __init__(self, spec, job=workers_lib.JOB, devices_per_task=1, kind="CPU",
               task_type=None, task_index=None, source="cluster"):
    self.spec = {k: list(v) for k, v in spec.items()}
    self.source = source
    if job not in self.spec:
      jobs = [j for j in self.spec if j not in ("chief", "ps", "evaluator")]
      if len(jobs) != 1:
        raise ClusterSpecError(f"{source}: no '{job}' job in the cluster (jobs: "
                               f"{', '.join(sorted(self.spec)) or 'none'})")
      job = jobs[0]
    if not self.spec[job]:
      raise ClusterSpecError(f"{source}: job '{job}' has no tasks")
    self.job = job
    self.devices_per_task = int(devices_per_task or 1)
    if self.devices_per_task < 1:
      raise ClusterSpecError(f"{source}: devices_per_task must be >= 1")
    self.kind = str(kind or "CPU").upper()
    if self.kind not in ("CPU", "GPU"):
      raise ClusterSpecError(f"{source}: device_type must be CPU or GPU, not {kind}")
    self.task_type, self.task_index = task_type, task_index

  @property
  def addresses(self):
    return self.spec[self.job]

  @property
  def num_tasks(self):
    return len(self.addresses)

  def device(self, task, index):
    return f"/job:{self.job}/replica:0/task:{task}/device:{self.kind}:{index}"

  def target(self):
    """The Session target of the client driving the cluster: task 0's master."""
    return "grpc://" + self.addresses[0]

  def tf_config(self, task_type=None, task_index=None):
    """A TF_CONFIG JSON string for this cluster (and a task, if given)."""
    data = {"cluster": self.spec,
            OWN_KEY: {"devices_per_task": self.devices_per_task, "device_type": self.kind}}
    if task_type is not None:
      data["task"] = {"type": task_type, "index": int(task_index or 0)}
    return json.dumps(data)

  def describe(self):
    return (f"{self.num_tasks} task(s) of job '{self.job}' x {self.devices_per_task} "
            f"{self.kind}")

  def __repr__(self):
    return f"Cluster({self.describe()})"


def _from_resolver(resolver, own, source, devices_per_task, kind):
  try:
    spec = resolver.cluster_spec().as_dict()
  except Exception as e:  # pylint: disable=broad-except
    raise ClusterSpecError(f"{source}: cannot read the cluster ({e})") from None
  if not spec:
    raise ClusterSpecError(f"{source}: names no cluster")
  spec = {job: (tasks if isinstance(tasks, list) else [tasks[i] for i in sorted(tasks)])
          for job, tasks in spec.items()}
  return Cluster(spec, devices_per_task=devices_per_task or own.get("devices_per_task", 1),
                 kind=kind or own.get("device_type", "CPU"),
                 task_type=getattr(resolver, "task_type", None),
                 task_index=getattr(resolver, "task_id", None), source=source)


def _read_tf_config(text, source):
  try:
    data = json.loads(text)
  except ValueError as e:
    raise ClusterSpecError(f"{source}: not JSON ({e})") from None
  if not isinstance(data, dict):
    raise ClusterSpecError(f"{source}: expected a JSON object")
  if "cluster" not in data:  # a bare cluster: {"worker": [...]}
    data = {"cluster": data}
  if not isinstance(data["cluster"], dict) or not all(
      isinstance(v, (list, dict)) for v in data["cluster"].values()):
    raise ClusterSpecError(f"{source}: 'cluster' must map job names to lists of "
                           "'host:port' addresses")
  return data


def resolve(cluster=None, devices_per_task=None, kind=None, required=False):
  """The Cluster that `cluster` names, or None.

  cluster: None (TF_CONFIG if it names a cluster), 'TF_CONFIG' (the
  environment variable, which must then name one), a path to a JSON file
  (a TF_CONFIG or a bare cluster), a dict, or a ClusterResolver.
  devices_per_task / kind override what the cluster says (default 1, CPU).
  required: raise ClusterSpecError instead of returning None.
  """
  from tensorflow.python.distribute.cluster_resolver import (  # pylint: disable=import-outside-toplevel
      cluster_resolver as resolver_lib, tfconfig_cluster_resolver)
  if isinstance(cluster, Cluster):
    return cluster
  if cluster is None or cluster == ENV:
    text = os.environ.get(ENV, "")
    if not text.strip() or "cluster" not in _read_tf_config(text, ENV):
      if cluster == ENV or required:
        raise ClusterSpecError(f"{ENV} names no cluster; set it (e.g. run under "
                               "'tfsplit launch') or give a cluster spec file")
      return None
    data = json.loads(text)
    if not data.get("cluster"):
      if required or cluster == ENV:
        raise ClusterSpecError(f"{ENV} names no cluster")
      return None
    return _from_resolver(tfconfig_cluster_resolver.TFConfigClusterResolver(),
                          data.get(OWN_KEY) or {}, ENV, devices_per_task, kind)
  if hasattr(cluster, "cluster_spec"):
    return _from_resolver(cluster, {}, type(cluster).__name__, devices_per_task, kind)
  if isinstance(cluster, str):
    try:
      with open(cluster, encoding="utf-8") as f:
        text = f.read()
    except OSError as e:
      raise ClusterSpecError(f"cannot read cluster spec '{cluster}': "
                             f"{e.strerror or e}") from None
    data, source = _read_tf_config(text, cluster), cluster
  elif isinstance(cluster, dict):
    data, source = _read_tf_config(json.dumps(cluster), "cluster"), "cluster"
  else:
    raise ClusterSpecError(f"cannot read a cluster from {type(cluster).__name__}; give "
                           "'TF_CONFIG', a spec file, a dict or a ClusterResolver")
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  try:
    resolver = resolver_lib.SimpleClusterResolver(tf.train.ClusterSpec(data["cluster"]))
  except (TypeError, ValueError) as e:
    raise ClusterSpecError(f"{source}: {e}") from None
  task = data.get("task") or {}
  out = _from_resolver(resolver, data.get(OWN_KEY) or {}, source, devices_per_task, kind)
  out.task_type, out.task_index = task.get("type"), task.get("index")
  return out


def mesh_on_cluster(axes, cluster, across=DEFAULT_ACROSS):
  """A Mesh of `axes` ({name: size}, ordered) placed on `cluster`'s devices.

  Axes named in `across` choose the task, the others the device within it
  (row-major each, in mesh order). If they do not fit that way, the mesh is
  laid over the task-major device list with the `across` axes slowest.
  """
  from tfsplit.layout.mesh import Mesh  # pylint: disable=import-outside-toplevel
  axes = dict(axes)
  names = list(axes)
  size = int(np.prod(list(axes.values()))) if axes else 1
  capacity = cluster.num_tasks * cluster.devices_per_task
  if size > capacity:
    raise ClusterSpecError(
        f"mesh {','.join(f'{k}={v}' for k, v in axes.items())} needs {size} devices but "
        f"the cluster has {capacity} ({cluster.describe()}); use a smaller mesh or more "
        "workers / devices per worker")
  outer = [a for a in names if a in across]
  inner = [a for a in names if a not in across]
  n_outer = int(np.prod([axes[a] for a in outer])) if outer else 1
  n_inner = int(np.prod([axes[a] for a in inner])) if inner else 1
  shape = [axes[a] for a in names]
  fits = n_outer <= cluster.num_tasks and n_inner <= cluster.devices_per_task
  devices = []
  for coords in np.ndindex(*shape) if shape else [()]:
    c = dict(zip(names, coords))
    task = int(np.ravel_multi_index([c[a] for a in outer], [axes[a] for a in outer])) \
        if outer else 0
    local = int(np.ravel_multi_index([c[a] for a in inner], [axes[a] for a in inner])) \
        if inner else 0
    if fits:
      devices.append(cluster.device(task, local))
    else:
      flat = task * n_inner + local
      devices.append(cluster.device(flat // cluster.devices_per_task,
                                    flat % cluster.devices_per_task))
  return Mesh(axes, devices)


def graph_jobs(graph_def):
  """The job names the graph's node devices name ('localhost' included)."""
  jobs = set()
  for node in graph_def.node:
    if "/job:" in node.device:
      jobs.add(node.device.split("/job:", 1)[1].split("/", 1)[0])
  return jobs


def graph_tasks(graph_def, job):
  """Sorted task indices of `job` that the graph's nodes are placed on."""
  tasks = set()
  marker = f"/job:{job}/"
  for node in graph_def.node:
    if marker in node.device and "/task:" in node.device:
      tasks.add(int(node.device.split("/task:", 1)[1].split("/", 1)[0]))
  return sorted(tasks)


def needs_cluster(graph_def):
  """True if the graph is placed on tasks of a job other than this process's."""
  return bool(graph_jobs(graph_def) - {"localhost"})


def cluster_for_graph(graph_def, cluster=None):
  """The Cluster to run `graph_def` on (None for a graph of this process):
  `cluster` or TF_CONFIG, checked against the jobs and tasks the graph names."""
  if not needs_cluster(graph_def):
    return None
  jobs = sorted(graph_jobs(graph_def) - {"localhost"})
  found = resolve(cluster)
  if found is None:
    raise ClusterSpecError(
        f"the graph is placed on /job:{jobs[0]} tasks but no cluster is given; run it "
        f"under 'tfsplit launch --workers N -- ...' or set {ENV} (or --cluster)")
  if jobs != [found.job]:
    raise ClusterSpecError(f"the graph is placed on job(s) {', '.join(jobs)} but the "
                           f"cluster's job is '{found.job}'")
  tasks = graph_tasks(graph_def, found.job)
  if tasks and tasks[-1] >= found.num_tasks:
    raise ClusterSpecError(f"the graph uses task {tasks[-1]} of job '{found.job}' but the "
                           f"cluster has {found.num_tasks} task(s)")
  return found


def client_config(graph_def, cluster, timeout_seconds):
  """Session ConfigProto of the client driving `cluster`: the graph's Grappler
  settings (one round for a pipeline), the collective group leader, and an
  operation timeout so that no step waits longer than `timeout_seconds`."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime.graph_function import grappler_config  # pylint: disable=import-outside-toplevel
  config = tf.compat.v1.ConfigProto(allow_soft_placement=False)
  config.experimental.collective_group_leader = workers_lib.leader_of(cluster.job)
  if timeout_seconds:
    config.operation_timeout_in_ms = int(timeout_seconds * 1000)
  return grappler_config(graph_def, config)


def unreachable_tasks(cluster, tasks=None, timeout=1.0):
  """Indices of the tasks (of `tasks`, default all) whose port does not answer."""
  tasks = range(cluster.num_tasks) if tasks is None else tasks
  return [t for t in tasks if not workers_lib.reachable(cluster.addresses[t], timeout)]


def _answers(cluster, task, timeout):
  """True if task `task` runs a constant on its own device within `timeout`
  (a Session with that task as master, its device filter on that task only,
  so no other task is contacted)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=int(timeout * 1000))
  config.device_filters.append(f"/job:{cluster.job}/task:{task}")
  graph = tf.Graph()
  with graph.as_default(), tf.device(f"/job:{cluster.job}/task:{task}"):
    probe = tf.constant(1)
  try:
    with tf.compat.v1.Session("grpc://" + cluster.addresses[task], graph=graph,
                              config=config) as session:
      return session.run(probe) == 1
  except Exception:  # pylint: disable=broad-except
    return False


def unresponsive_tasks(cluster, timeout=3.0):
  """Indices of the tasks that do not run a trivial op within `timeout`
  seconds (probed in parallel; a probe stuck on a hung task is abandoned)."""
  import threading  # pylint: disable=import-outside-toplevel
  results = {}

  def probe(task):
    results[task] = _answers(cluster, task, timeout)

  threads = [threading.Thread(target=probe, args=(t,), daemon=True)
             for t in range(cluster.num_tasks)]
  for t in threads:
    t.start()
  deadline = time.time() + timeout + 1.0
  for t in threads:
    t.join(max(0.0, deadline - time.time()))
  return [t for t in range(cluster.num_tasks) if not results.get(t, False)]


def explain_failure(error, cluster, what="the step"):
  """ClusterError (one line) for an error raised while running on `cluster`:
  the task(s) that no longer answer if any, else the error's first line."""
  message = str(getattr(error, "message", None) or error)
  text = [l for l in message.strip().splitlines() if l.strip()]
  first = text[0] if text else type(error).__name__
  # A worker killed a moment ago may still hold its port: probe for a while
  # (not after a timeout: the step already waited that long).
  timed_out = type(error).__name__ == "DeadlineExceededError"
  deadline = time.time() + (0.0 if timed_out else DEAD_PROBE_SECONDS)
  dead = unreachable_tasks(cluster)
  while not dead and time.time() < deadline:
    time.sleep(0.2)
    dead = unreachable_tasks(cluster)
  named = lambda tasks: ", ".join(f"/job:{cluster.job}/task:{t} ({cluster.addresses[t]})"
                                  for t in tasks)
  if dead:
    return ClusterError(f"{what} failed: worker {named(dead)} is not answering "
                        f"({type(error).__name__})")
  if timed_out:
    hung = unresponsive_tasks(cluster)
    if hung:
      return ClusterError(f"{what} failed: worker {named(hung)} accepts connections but "
                          f"does not answer (hung or stopped; {type(error).__name__})")
  mentioned = sorted({int(t) for t in re.findall(
      rf"/job:{re.escape(cluster.job)}/replica:\d+/task:(\d+)", message)
                      if int(t) < cluster.num_tasks})
  if mentioned and type(error).__name__ in ("UnavailableError", "DeadlineExceededError",
                                            "AbortedError", "CancelledError"):
    return ClusterError(f"{what} failed: lost contact with worker {named(mentioned)} "
                        f"({type(error).__name__}: {first[:200]})")
  return ClusterError(f"{what} failed on the cluster ({type(error).__name__}: "
                      f"{first[:300]})")


class ClusterRunner(object):
  """A rewritten graph run on a cluster by one client: SessionRunner over
  task 0's master, every failure raised as a one-line ClusterError."""

  def __init__(self, graph_def, values, cluster, timeout_seconds=600.0):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfsplit.runtime import session as session_lib  # pylint: disable=import-outside-toplevel
    self.cluster = cluster
    dead = unreachable_tasks(cluster, timeout=max(1.0, min(5.0, timeout_seconds)))
    if dead:
      raise ClusterError(
          "cannot reach worker " + ", ".join(
              f"/job:{cluster.job}/task:{t} ({cluster.addresses[t]})" for t in dead)
          + "; start the workers first ('tfsplit worker' on each task, or run under "
          "'tfsplit launch')")
    self._errors = (tf.errors.OpError,)
    try:
      self.runner = session_lib.SessionRunner(
          graph_def, values, target=cluster.target(),
          config=client_config(graph_def, cluster, timeout_seconds))
    except self._errors as e:
      raise explain_failure(e, cluster, "initialising the variables") from None

  @property
  def outputs(self):
    return self.runner.outputs

  def run(self, inputs, trace=False, fetch=None):
    try:
      return self.runner.run(inputs, trace=trace, fetch=fetch)
    except self._errors as e:
      raise explain_failure(e, self.cluster) from None

  def assign(self, values):
    try:
      return self.runner.assign(values)
    except self._errors as e:
      raise explain_failure(e, self.cluster, "assigning the variables") from None

  def variable_values(self, names):
    try:
      return self.runner.variable_values(names)
    except self._errors as e:
      raise explain_failure(e, self.cluster, "reading the variables") from None

  def close(self, reset=False):
    """Closes the session; with reset=True also clears the workers' resource
    containers (the variables this client made live in the servers)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    try:
      self.runner.session.close()
      if reset:
        tf.compat.v1.Session.reset(self.cluster.target())
    except Exception:  # pylint: disable=broad-except
      pass


# Collective and step timeout of a tfsplit.split step run on a cluster when
# the caller gives none (as `tfsplit rewrite --collective-timeout`).
DEFAULT_TIMEOUT_SECONDS = 600.0


def place(mesh, cluster=None):
  """(Cluster, Mesh on it) for tfsplit.split's `mesh` ('dp=2', a dict) when
  `cluster` (or TF_CONFIG, when cluster is None) names one; (None, None)
  otherwise, and for a Mesh given with its own devices."""
  from tfsplit.layout.mesh import Mesh  # pylint: disable=import-outside-toplevel
  if isinstance(mesh, Mesh):
    return None, None
  found = cluster if isinstance(cluster, Cluster) else resolve(cluster)
  if found is None:
    return None, None
  axes = Mesh.parse(mesh).axes if isinstance(mesh, str) else dict(mesh)
  return found, mesh_on_cluster(axes, found)
