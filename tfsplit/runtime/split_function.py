"""`tfsplit.split`: wrap an existing tf.function as a split, multi-device callable.

    step = tfsplit.split(train_step, mesh="tp=2", strategy="megatron",
                         input_signature=[tf.TensorSpec([8, 64], tf.int32), ...])
    loss = step(tokens, labels)        # runs on the mesh's devices
    step.assign_back()                  # full values back into the model's variables

The function is traced once, its graph split (tfsplit.sharding), and the
result imported with wrap_function over shard variables created from the
current values of the function's variables. The step runs with one Grappler
round (see graph_function.grappler_config): a pipelined one keeps its
schedule's order so, and any split step starts sooner.
"""
import numpy as np
import tensorflow as tf

from tfsplit.errors import PlanError
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.io import load_graph
from tfsplit.graph.ir import without_gc
from tfsplit.runtime import checkpoint as checkpoint_lib
from tfsplit.runtime import cluster as cluster_lib
from tfsplit.runtime import multi_client
from tfsplit.runtime import shards as shards_lib
from tfsplit.runtime.graph_function import import_graph, traced_call
from tfsplit.layout.mesh import Mesh
from tfsplit.passes import split_graph
from tfsplit.passes.config import DEFAULT_BUCKET_BYTES


def available_devices():
  """Logical GPUs if any, else logical CPUs (full names)."""
  for kind in ("GPU", "CPU"):
    devices = [d.name for d in tf.config.list_logical_devices(kind)]
    if devices:
      return devices
  return []


def make_mesh(mesh):
  """A Mesh from 'tp=4' / a dict / a Mesh, placed on this process's devices."""
  if isinstance(mesh, Mesh):
    return mesh
  axes = Mesh.parse(mesh).axes if isinstance(mesh, str) else dict(mesh)
  devices = available_devices()
  size = int(np.prod(list(axes.values())))
  if size > len(devices):
    raise PlanError(
        f"mesh {','.join(f'{k}={v}' for k, v in axes.items())} needs {size} devices but "
        f"this process has {len(devices)} ({', '.join(devices)}); use a smaller mesh, or "
        "split one device into logical ones with tf.config.set_logical_device_configuration "
        "before TensorFlow starts")
  return Mesh(axes, devices[:size])


def _captured_variables(concrete_fn, graph_def):
  """{recorded variable name: tf.Variable} for a loaded ConcreteFunction."""
  by_handle = {id(v.handle): v for v in concrete_fn.graph.variables
               if getattr(v, "handle", None) is not None}
  by_node = {}
  for external, internal in concrete_fn.graph.captures:
    if id(external) in by_handle:
      by_node[internal.op.name] = by_handle[id(external)]
  out = {}
  for node in graph_def.node:
    if variables_lib.VAR_NAME_ATTR in node.attr and node.name in by_node:
      out[node.attr[variables_lib.VAR_NAME_ATTR].s.decode()] = by_node[node.name]
  return out


class SplitFunction(object):
  """A split tf.function: call it like the original; its variables are shards."""

  # The split makes millions of small objects and no cycles: the GC's full
  # collections over them would only add pauses (0.1 s a split, median).
  @without_gc
  def __init__(self, fn, mesh, strategy="megatron", input_signature=None,
               annotations=None, variable_names=None, timeout_seconds=None,
               microbatches=1, schedule="1f1b", layer_ranges=None, virtual_stages=1,
               bucket_bytes=DEFAULT_BUCKET_BYTES, recompute=None, zero=0, cluster=None,
               offload=None, offload_device=None, prepare=None, plan=None, devices=None,
               device_memory=None, hardware=None, shares_with=None, memory_reserve=None,
               gradient_reduce_dtype=None, sequence_parallel=False):
    # With a cluster (cluster=, or TF_CONFIG naming one) the mesh lives on its
    # worker tasks and one Session client drives them (runtime/cluster.py).
    # With a plan the mesh is known only once the graph is (below).
    self.plan = None
    if plan is None:
      self.cluster, cluster_mesh = cluster_lib.place(mesh, cluster)
      self.mesh = cluster_mesh or make_mesh(mesh)
    self._runner = None
    concrete = (fn.get_concrete_function(*input_signature) if input_signature
                else fn.get_concrete_function()) if hasattr(fn, "get_concrete_function") \
        else fn
    self.original_graph_def = load_graph(concrete, variable_names=variable_names)
    if prepare is not None:  # a caller's GraphDef -> GraphDef edit before splitting
      self.original_graph_def = prepare(self.original_graph_def)
    self.original_variables = _captured_variables(concrete, self.original_graph_def)
    if plan is not None:  # the plan's mesh and options replace the keywords
      from tfsplit import plan as plan_lib  # pylint: disable=import-outside-toplevel
      self.plan = plan_lib.resolve(plan, self.original_graph_def, devices, device_memory,
                                   hardware, available=None if cluster is not None
                                   else len(available_devices()),
                                   memory_reserve=plan_lib.DEFAULT_RESERVE
                                   if memory_reserve is None else memory_reserve)
      options = self.plan.split_options()   # resolve bound it to this graph
      mesh = options.pop("mesh")
      microbatches, schedule, layer_ranges, virtual_stages, recompute, zero = (
          options[k] for k in ("microbatches", "schedule", "layer_ranges",
                               "virtual_stages", "recompute", "zero"))
      # The blocks the plan keeps whole over tp (annotated replicated), and
      # its optimizer offload.
      annotations = {**(annotations or {}), **options.get("annotations", {})}
      offload = options["offload"] or offload
      sequence_parallel = options["sequence_parallel"] or sequence_parallel
      self.cluster, cluster_mesh = cluster_lib.place(mesh, cluster)
      self.mesh = cluster_mesh or make_mesh(mesh)
    if self.cluster is not None and timeout_seconds is None:
      timeout_seconds = cluster_lib.DEFAULT_TIMEOUT_SECONDS
    # TF_CONFIG naming this process's task: every worker runs the script and
    # this one builds and runs its own task's part (runtime/multi_client.py).
    self.task = multi_client.own_task(self.cluster)
    if self.task is not None:
      multi_client.check_tasks(self.mesh, self.cluster)
      multi_client.local_server(self.cluster)  # peers can reach it while we split
    self.result = split_graph(self.original_graph_def, self.mesh, strategy=strategy,
                              annotations=annotations, timeout_seconds=timeout_seconds,
                              microbatches=microbatches, schedule=schedule,
                              layer_ranges=layer_ranges, virtual_stages=virtual_stages,
                              bucket_bytes=bucket_bytes, recompute=recompute, zero=zero,
                              offload=offload, offload_device=offload_device,
                              task=self.task, gradient_reduce_dtype=gradient_reduce_dtype,
                              sequence_parallel=sequence_parallel)
    self.manifest = self.result.manifest
    self.graph_def = self.result.graph_def
    values = {name: var.numpy() for name, var in self.original_variables.items()}
    if shares_with is not None:
      # The same model traced for another input shape or kind of step (a
      # smaller last batch, evaluation): it runs on the first split's shards.
      shards_lib.check_same_layout(self.manifest, shares_with.manifest)
    if self.task is not None:
      self.variables, self._fn = None, None
      own = multi_client.task_shards(self.manifest, self.task)
      self._runner = multi_client.TaskRunner(
          self.graph_def, None if shares_with is not None
          else shards_lib.shard_values(own, values), self.cluster, timeout_seconds,
          multi_client.plan_fingerprint(self.original_graph_def, self.result.config))
    elif self.cluster is not None:
      self.variables, self._fn = None, None
      # Shared shards already live in the workers' containers: no new values.
      self._runner = cluster_lib.ClusterRunner(
          self.graph_def, None if shares_with is not None
          else shards_lib.shard_values(self.manifest, values), self.cluster,
          timeout_seconds)
    elif shares_with is not None:
      self.variables = {s["name"]: shares_with.variables[s["name"]]
                        for e in self.manifest.values() for s in e["shards"]}
      self._fn = import_graph(self.graph_def, self.variables)
    else:
      self.variables = shards_lib.create_shard_variables(self.manifest, values)
      self._fn = import_graph(self.graph_def, self.variables)
    self._structured_outputs = concrete.structured_outputs

  @property
  def task_inputs(self):
    """{input: {"begin", "shape", "global_shape"}}: the share of each input
    this task's step takes (None when one client runs every task)."""
    return self.result.task.inputs if self.result.task is not None else None

  def local_batch(self, *inputs):
    """This task's share of a global batch (every input, in order): what a
    tf.data pipeline sharded by task gives each worker. One client: as given."""
    if self.result.task is None:
      return inputs
    shares = list(self.result.task.inputs.values())
    return tuple(np.asarray(x)[tuple(slice(b, b + n) for b, n in
                                     zip(share["begin"], share["shape"]))]
                 for x, share in zip(inputs, shares))

  def __call__(self, *args):
    if self._runner is not None:  # on a cluster: numpy outputs
      outputs, _ = self._runner.run([np.asarray(a) for a in args])
      return outputs[0] if len(outputs) == 1 else outputs
    outputs = self._fn(*args)
    return outputs[0] if len(outputs) == 1 else outputs

  def save(self, directory, step, keep=2):
    """Checkpoints every shard (one file per device) and the manifest into
    DIR/ckpt-<step>, atomically; returns its path (runtime/checkpoint.py).
    When every worker runs the script, each writes its own task's part."""
    mesh = {"axes": self.mesh.axes, "devices": self.mesh.devices}
    if self.task is not None:
      return checkpoint_lib.save_task(directory, self.manifest, self.shard_values(), step,
                                      self.task, mesh, keep)
    return checkpoint_lib.save(directory, self.manifest, self.shard_values(), step, mesh,
                               keep)

  def restore(self, directory):
    """Loads the latest checkpoint in `directory` (or a ckpt-* path) into the
    shards, converting one of another mesh through full values; returns its
    step."""
    meta, saved = checkpoint_lib.load(directory)
    self.assign_shards(checkpoint_lib.convert(meta, saved, self.manifest))
    return meta["step"]

  def assign_shards(self, values):
    """{shard name: value} into the shard variables (on a cluster, its tasks')."""
    if self._runner is not None:
      self._runner.assign(values)
    else:
      for name, value in values.items():
        self.variables[name].assign(value)

  def trace(self, *args):
    """(outputs, op events) of one step, traced with TF's profiler; events are
    [(device, node, start_us, end_us)] as in tfsplit.runtime.session.op_events."""
    outputs, events = traced_call(self._fn, args, self.graph_def)
    return (outputs[0] if len(outputs) == 1 else outputs), events

  def shard_values(self):
    """{shard name: numpy value}, every device's copy (see self.manifest); when
    every worker runs the script, the copies on this worker's task."""
    if self._runner is not None:
      manifest = self.manifest if self.task is None else \
          multi_client.task_shards(self.manifest, self.task)
      return self._runner.variable_values(
          [s["name"] for e in manifest.values() for s in e["shards"]])
    return {k: v.numpy() for k, v in self.variables.items()}

  def full_values(self):
    """{variable name: numpy value} assembled from the shards."""
    if self.task is not None:
      raise PlanError("each worker holds only its task's shards (shard_values()); the "
                      "full values are the checkpoint's (save(), then "
                      "tfsplit.runtime.shards.full_values_from_checkpoint)")
    return shards_lib.full_values(self.manifest, self.shard_values())

  def assign_back(self):
    """Writes the assembled values into the original function's variables."""
    for name, value in self.full_values().items():
      self.original_variables[name].assign(value)

  def assign_from_originals(self):
    """The inverse of assign_back: every shard from the current value of the
    original function's variable (after the user changed them)."""
    values = {name: var.numpy() for name, var in self.original_variables.items()}
    self.assign_shards(shards_lib.shard_values(self.manifest, values))


def split(fn, mesh="tp=2", strategy="megatron", input_signature=None, annotations=None,
          variable_names=None, timeout_seconds=None, microbatches=1, schedule="1f1b",
          layer_ranges=None, virtual_stages=1, bucket_bytes=DEFAULT_BUCKET_BYTES,
          recompute=None, zero=0, cluster=None, offload=None, offload_device=None,
          prepare=None, plan=None, devices=None, device_memory=None, hardware=None,
          memory_reserve=None, gradient_reduce_dtype=None, sequence_parallel=False):
  """Wraps tf.function `fn` as a SplitFunction over `mesh` (see module doc).

  mesh: 'tp=4' (tensor parallel), 'dp=4' (data parallel), 'dp=2,tp=2', ...
  microbatches: in-graph gradient accumulation over m micro-batches.
  schedule / layer_ranges: with a 'pp' mesh axis, the pipeline schedule
    ('1f1b', 'gpipe' or 'interleaved') and optional explicit stage layer ranges.
  virtual_stages: model chunks per stage for schedule='interleaved' (>= 2;
    microbatches a multiple of the stages).
  bucket_bytes: gradient all-reduces over 'dp' are packed into buckets of at
    most this many bytes (default 25 MiB); 0: one all-reduce per gradient.
  recompute: recompute forward activations in the backward pass instead of
    keeping them: 'blocks' (each repeated block), 'auto' (sqrt(n) checkpoints
    over the blocks), 'selective' (the attention cores) or a list of name
    scopes; any mesh, 'dp=1' included (memory/recompute.py).
  zero: optimizer-state sharding over 'dp' (sharding/zero.py): 1 keeps 1/dp
    of the optimizer slots per replica (gradients reduce-scattered, updates
    all-gathered), 2 also each micro-batch's gradient sum; 0 (default) off.
  cluster: run on a cluster's worker tasks ('TF_CONFIG', a spec file, a dict
    or a tf.distribute.cluster_resolver.ClusterResolver; default: TF_CONFIG
    when it names a cluster, as under `tfsplit launch`): dp and pp across
    tasks, the other axes within one, driven by one Session client; calls
    return numpy values, and timeout_seconds (default 600) bounds every
    collective and step (runtime/cluster.py).
  offload: 'optimizer' keeps the optimizer slots and their update ops on
    each device's host CPU (CPU:0 of its task; offload_device names another),
    the weights on the device (memory/offload.py); a host that is itself a
    mesh device is refused.
  gradient_reduce_dtype: 'bfloat16' reduces float32 gradients over 'dp' in
    bfloat16, half the bytes, each partial gradient rounded to 8 significant
    bits (no longer float32-exact); None (default): the graph's own dtype.
  sequence_parallel: with the megatron strategy and a 'tp' axis, the norms,
    residual and bias adds between tensor-parallel blocks run on 1/tp of the
    sequence (reduce-scatter and all-gather in place of each forward
    all-reduce: strategies/sequence_parallel.py).
  prepare: a GraphDef -> GraphDef function applied to the traced graph
    before it is split (tfsplit.keras drops the Keras metric updates so).
  plan: 'auto' chooses mesh, micro-batches, schedule, stage ranges,
    recompute, zero, the blocks replicated over tp and offload with the
    planner (tfsplit.plan) for `devices` (default: this process's) devices
    of `device_memory` each on `hardware` (a preset name or cluster spec
    file, default cpu-host), leaving `memory_reserve` of it free (default
    0.1); a plan file ('tfsplit plan -o plan.json') or a tfsplit.plan.Plan
    is applied as given. The plan's choices replace those keywords (its
    replicated blocks add annotations); the chosen Plan is the result's
    `plan`.
  """
  return SplitFunction(fn, mesh, strategy, input_signature, annotations, variable_names,
                       timeout_seconds, microbatches, schedule, layer_ranges,
                       virtual_stages, bucket_bytes, recompute, zero, cluster, offload,
                       offload_device, prepare, plan, devices, device_memory, hardware,
                       memory_reserve=memory_reserve,
                       gradient_reduce_dtype=gradient_reduce_dtype,
                       sequence_parallel=sequence_parallel)
