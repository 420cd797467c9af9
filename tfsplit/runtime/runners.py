"""Where a split step runs: one interface, three runners.

    runner = choose(mesh, cluster)            # which of the three, from the cluster
    config = runner.configure(SplitConfig(runner.place(mesh), ...))
    result = split_graph(graph_def, config)
    runner.start(graph_def, result, shard_source)   # create and initialise shards
    outputs = runner.call(args)

- LocalRunner: the mesh on this process's devices; shards are tf.Variables,
  the step a function imported over them (runtime/graph_function.py).
- ClientRunner: one client over a cluster's worker tasks (TF_CONFIG or
  cluster= naming a cluster, not this process's task): a Session on task
  0's master drives every task (runtime/cluster.py); calls return numpy.
- TaskRunner: this process is one task of the cluster (every worker runs the
  script, TF_CONFIG naming its task): it splits and runs only its task's
  part, on its own server (runtime/multi_client.py), and holds only its
  task's shards.

Every runner places a mesh, sets what its way of running means for the
split's config (a task's index, a timeout on collectives), creates its
shards from `shard_source(manifest)` ({shard name: value} chunks, one
variable's shards each, for the shards it holds: taken one at a time, so a
process never holds more than one variable beyond its shards) or shares
another runner's, runs and traces a step, reads and writes
shards, assembles full values and saves checkpoints. What a runner cannot do
is its own one-line refusal: a task holds no full values. tfsplit.split's
SplitFunction delegates all of it and never asks which runner it has.
"""
import numpy as np

from tfsplit.errors import PlanError
from tfsplit.layout.mesh import Mesh
from tfsplit.runtime import checkpoint as checkpoint_lib
from tfsplit.runtime import slices as slices_lib
from tfsplit.runtime import cluster as cluster_lib
from tfsplit.runtime import multi_client
from tfsplit.runtime import placement
from tfsplit.runtime import shards as shards_lib


def choose(mesh=None, cluster=None):
  """The runner of a split of `mesh` with `cluster` (tfsplit.split's
  keywords): a Mesh given with its devices runs in this process; else a
  cluster (cluster=, or TF_CONFIG naming one when cluster is None) runs on
  its tasks, by this process's task alone when TF_CONFIG names it; else this
  process's devices."""
  if isinstance(mesh, Mesh):
    return LocalRunner()
  found = cluster if isinstance(cluster, cluster_lib.Cluster) else \
      cluster_lib.resolve(cluster)
  if found is None:
    return LocalRunner()
  if multi_client.own_task(found) is not None:
    return TaskRunner(found)
  return ClientRunner(found)


class Runner(object):
  """The interface (see the module doc); subclasses fill in how."""

  cluster = None
  variables = None   # {shard name: tf.Variable} where this process holds them

  def __init__(self):
    self.result = None
    self.manifest = None     # the shards this runner holds

  def place(self, mesh):
    """The Mesh of `mesh` ('dp=2', a dict, a Mesh) on this runner's devices."""
    return placement.make_mesh(mesh)

  def available(self):
    """How many devices a plan may use here (None: the cluster's, unknown)."""
    return None

  def configure(self, config):
    """`config` (a SplitConfig) with what this way of running sets."""
    return config

  @property
  def task_inputs(self):
    """{input: {"begin", "shape", "global_shape"}} of this task's share of
    each input; None where the step takes the whole batch."""
    return None

  def local_batch(self, inputs):
    """The part of a global batch (every input, in order) this runner's step
    takes: all of it, but on a task of a cluster."""
    return tuple(inputs)

  def held(self, manifest):
    """The part of a split's manifest whose shards this runner holds."""
    return manifest

  def start(self, original_graph_def, result, shard_source, shares_with=None):
    """Creates and initialises the shards this runner holds from
    shard_source(manifest) ({shard name: value} chunks), or uses those of
    `shares_with` (another runner of a split of the same model), and makes
    the step runnable."""
    raise NotImplementedError

  def call(self, args):
    """The step's outputs (a list) for `args`."""
    raise NotImplementedError

  def trace(self, args):
    """(outputs, [(device, node, start_us, end_us)]) of one step."""
    raise NotImplementedError

  def assign(self, values):
    """{shard name: value} into the shards."""
    raise NotImplementedError

  def shard_values(self):
    """{shard name: numpy value} of every shard this runner holds."""
    raise NotImplementedError

  def read_shards(self, names):
    """{shard name: numpy value} of the shards named."""
    values = self.shard_values()
    return {n: values[n] for n in names}

  def iter_full_values(self):
    """(variable name, numpy value) assembled from its shards, one variable
    at a time: no more than one full value exists at once."""
    for name, entry in self.manifest.items():
      values = self.read_shards([s["name"] for s in entry["shards"]])
      yield name, shards_lib.full_values({name: entry}, values)[name]

  def full_values(self):
    """{variable name: numpy value} assembled from the shards."""
    return dict(self.iter_full_values())

  def checkpoint_writer(self, directory, step, keep):
    """A function that writes DIR/ckpt-<step> and returns its path, from the
    values the shards hold now: each block's value is taken before this
    returns (a tensor the next step's updates leave alone: TF copies a
    variable's buffer before updating one still read), so it may run on
    another thread while training goes on."""
    names = [s["name"] for chosen in slices_lib.blocks(self.manifest).values() for s in chosen]
    values, mesh = self.shard_tensors(names), self.result.mesh_record()
    return lambda: checkpoint_lib.save(directory, self.manifest, values, step, mesh, keep)

  def shard_tensors(self, names):
    """{shard name: value} of the shards named, as cheaply as this runner
    has them (what a checkpoint writes)."""
    return self.read_shards(names)


class LocalRunner(Runner):
  """This process's devices; shards are tf.Variables."""

  def available(self):
    return len(placement.available_devices())

  def start(self, original_graph_def, result, shard_source, shares_with=None):
    from tfsplit.runtime.graph_function import import_graph  # pylint: disable=import-outside-toplevel
    self.result, self.manifest = result, self.held(result.manifest)
    if shares_with is not None:
      self.variables = {s["name"]: shares_with.variables[s["name"]]
                        for e in self.manifest.values() for s in e["shards"]}
    else:
      self.variables = shards_lib.create_variables(self.manifest,
                                                   shard_source(self.manifest))
    self._fn = import_graph(result.graph_def, self.variables)

  def call(self, args):
    return list(self._fn(*args))

  def trace(self, args):
    from tfsplit.runtime.graph_function import traced_call  # pylint: disable=import-outside-toplevel
    outputs, events = traced_call(self._fn, args, self.result.graph_def)
    return list(outputs), events

  def assign(self, values):
    for name, value in values.items():
      self.variables[name].assign(value)

  def shard_values(self):
    return {k: v.numpy() for k, v in self.variables.items()}

  def read_shards(self, names):
    return {n: self.variables[n].numpy() for n in names}

  def shard_tensors(self, names):
    return {n: self.variables[n].read_value() for n in names}


class ClientRunner(Runner):
  """One Session client driving every task of a cluster; numpy outputs."""

  def __init__(self, cluster):
    super().__init__()
    self.cluster = cluster
    self.session = None

  def place(self, mesh):
    return placement.make_mesh(mesh, cluster=self.cluster)

  def configure(self, config):
    if config.timeout_seconds is None:
      config = config.replace(timeout_seconds=cluster_lib.DEFAULT_TIMEOUT_SECONDS)
    return config

  def _session(self, graph_def, values, original_graph_def, config):
    return cluster_lib.ClusterRunner(graph_def, values, self.cluster,
                                     config.timeout_seconds)

  def start(self, original_graph_def, result, shard_source, shares_with=None):
    self.result, self.manifest = result, self.held(result.manifest)
    # Shared shards already live in the workers' containers: no new values.
    values = None if shares_with is not None else shard_source(self.manifest)
    self.session = self._session(result.graph_def, values, original_graph_def,
                                 result.config)

  def _feed(self, args):
    """`args` as numpy, each of the shape this client's graph takes, or one
    line saying which shape that is."""
    args = [np.asarray(a) for a in args]
    for (name, shape), arg in zip(self._input_shapes(), args):
      if shape is not None and list(arg.shape) != list(shape):
        raise PlanError(self._shape_message(name, list(arg.shape), list(shape)))
    return args

  def _input_shapes(self):
    """[(input, shape the step takes or None)] in the graph's input order."""
    from tfsplit.graph import Graph  # pylint: disable=import-outside-toplevel
    from tfsplit.graph.endpoints import graph_inputs  # pylint: disable=import-outside-toplevel
    if not hasattr(self, "_shapes"):
      nodes = {n.name: n for n in self.result.graph_def.node}
      self._shapes = []
      for name in graph_inputs(Graph(self.result.graph_def)):
        attr = nodes[name].attr.get("shape")
        known = attr is not None and not attr.shape.unknown_rank and \
            all(d.size >= 0 for d in attr.shape.dim)
        self._shapes.append((name, [d.size for d in attr.shape.dim] if known else None))
    return self._shapes

  def _shape_message(self, name, got, want):
    return (f"input '{name}' of shape {got}: the split step takes {want}, the shape it was "
            "traced with (input_signature); feed the batch it was traced for")

  def call(self, args):
    outputs, _ = self.session.run(self._feed(args))
    return list(outputs)

  def trace(self, args):
    from tfsplit.runtime import trace as trace_lib  # pylint: disable=import-outside-toplevel
    outputs, metadata = self.session.run(self._feed(args), trace=True)
    return list(outputs), trace_lib.op_events(metadata)

  def assign(self, values):
    self.session.assign(values)

  def shard_values(self):
    return self.session.variable_values(
        [s["name"] for e in self.manifest.values() for s in e["shards"]])

  def read_shards(self, names):
    return self.session.variable_values(names)


class TaskRunner(ClientRunner):
  """This process's task of a cluster: its part of the split, its shards."""

  @property
  def task(self):
    return multi_client.own_task(self.cluster)

  def configure(self, config):
    multi_client.check_tasks(config.mesh, self.cluster)
    multi_client.local_server(self.cluster)  # peers can reach it while we split
    return super().configure(config).replace(task=self.task)

  def held(self, manifest):
    return multi_client.task_shards(manifest, self.task)

  @property
  def task_inputs(self):
    return self.result.task.inputs

  def _shape_message(self, name, got, want):
    share = self.task_inputs.get(name, {})
    glob = share.get("global_shape")
    return (f"input '{name}' of shape {got}: task {self.task}'s step takes {want}, its share "
            f"of the global batch {glob} the step was traced with; trace it with the global "
            "batch (input_signature) and feed each task step.local_batch(*global_batch)")

  def local_batch(self, inputs):
    shares = list(self.task_inputs.values())
    return tuple(np.asarray(x)[tuple(slice(b, b + n) for b, n in
                                     zip(share["begin"], share["shape"]))]
                 for x, share in zip(inputs, shares))

  def _session(self, graph_def, values, original_graph_def, config):
    return multi_client.TaskRunner(graph_def, values, self.cluster, config.timeout_seconds,
                                   multi_client.plan_fingerprint(original_graph_def, config))

  def iter_full_values(self):
    raise PlanError("each worker holds only its task's shards (shard_values()); the "
                    "full values are the checkpoint's (save(), then "
                    "tfsplit.runtime.shards.full_values_from_checkpoint)")

  def checkpoint_writer(self, directory, step, keep):
    """This task's part of the checkpoint: the blocks whose first copy its
    devices hold, read now."""
    manifest = self.result.manifest
    own = {s["device"] for e in self.manifest.values() for s in e["shards"]}
    names = [s["name"] for chosen in slices_lib.blocks(manifest).values() for s in chosen
             if s["device"] in own]
    values, mesh = self.read_shards(names), self.result.mesh_record()
    return lambda: checkpoint_lib.save_task(directory, manifest, values, step, self.task,
                                            mesh, keep)
