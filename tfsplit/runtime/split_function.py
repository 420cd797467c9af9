"""`tfsplit.split`: wrap an existing tf.function as a split, multi-device callable.

    step = tfsplit.split(train_step, mesh="tp=2", strategy="megatron",
                         input_signature=[tf.TensorSpec([8, 64], tf.int32), ...])
    loss = step(tokens, labels)        # runs on the mesh's devices
    step.assign_back()                  # full values back into the model's variables

The function is traced once (Traced), the options make one SplitConfig
(tfsplit.passes.config; a plan fills it in), its graph is split under that
config, and a runner (runtime/runners.py: this process's devices, one client
over a cluster, or this process's task of it) creates the shards from the
current values of the function's variables and runs the step. Locally the
step runs with one Grappler round (see graph_function.grappler_config): a
pipelined one keeps its schedule's order so, and any split step starts
sooner.
"""
import itertools
import threading

from tfsplit.errors import PlanError
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.io import load_graph
from tfsplit.graph.ir import without_gc
from tfsplit.passes import split_graph
from tfsplit.passes.config import SplitConfig, exact_pattern
from tfsplit.runtime import checkpoint as checkpoint_lib
from tfsplit.runtime import deferred as deferred_lib
from tfsplit.runtime import runners as runners_lib
from tfsplit.runtime import shards as shards_lib
# The one placement of a mesh, named here too (tfsplit.runtime.split_function.make_mesh).
from tfsplit.runtime.placement import available_devices, make_mesh  # pylint: disable=unused-import


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


def _concrete(fn, input_signature):
  """The ConcreteFunction of `fn` to split, or one line saying what to give."""
  if hasattr(fn, "fit") and hasattr(fn, "layers"):
    raise PlanError(f"tfsplit.split wraps a tf.function, and {type(fn).__name__} is a Keras "
                    "model: train it split with tfsplit.keras.split(model, mesh=...) and its "
                    "fit(), or split a tf.function of its training step")
  if not hasattr(fn, "get_concrete_function"):
    if not hasattr(fn, "structured_outputs"):
      raise PlanError(f"tfsplit.split wraps a tf.function or a ConcreteFunction, not "
                      f"{type(fn).__name__}; decorate the training step with @tf.function")
    return fn
  try:
    return (fn.get_concrete_function(*input_signature) if input_signature
            else fn.get_concrete_function())
  except TypeError as e:
    if input_signature:
      raise
    first = (str(e).strip().splitlines() or [""])[0]
    raise PlanError(f"tfsplit.split traces the function once and needs the shapes and "
                    f"dtypes of its arguments ({first[:120]}); pass input_signature=["
                    "tf.TensorSpec([BATCH, ...], dtype), ...], the global batch") from None


class Traced(object):
  """A tf.function traced for a split: its ConcreteFunction's GraphDef (after
  `prepare`, a caller's GraphDef -> GraphDef edit), the variables it
  captures by recorded name, and the structure of its outputs."""

  def __init__(self, fn, input_signature=None, variable_names=None, prepare=None):
    # Over a model made under deferred_init(), the variables the step makes
    # while it is traced (optimizer slots) hold no memory either.
    with deferred_lib.following():
      concrete = _concrete(fn, input_signature)
    self.graph_def = load_graph(concrete, variable_names=variable_names)
    if prepare is not None:
      self.graph_def = prepare(self.graph_def)
    self.variables = _captured_variables(concrete, self.graph_def)
    self.structured_outputs = concrete.structured_outputs


def distribution_options(distribution, mesh, plan, options):
  """(mesh, KerasDistribution) of a split under a keras.distribution, its
  strategy ('none' unless asked) and zero (3 where its layouts put the
  batch axis on weights) set in `options`."""
  from tfsplit.runtime.keras_distribution import KerasDistribution  # pylint: disable=import-outside-toplevel
  if plan is not None:
    raise PlanError("give distribution= or plan=, not both: the plan chooses the mesh")
  ours = KerasDistribution(distribution)
  if mesh is not None and str(mesh) != ours.mesh:
    raise PlanError(f"mesh '{mesh}' differs from the distribution's device mesh "
                    f"({ours.mesh_text()}, that is {ours.mesh}); give one of them")
  if ours.zero:
    if options.get("zero", 3) != 3:
      raise PlanError(f"the layout map splits weights over '{ours.batch}' (fully sharded "
                      f"data parallelism, zero=3) but zero={options['zero']} was given; drop "
                      "zero= or the batch axis from the layouts")
    options["zero"] = 3
  options["strategy"] = options.get("strategy") or "none"
  return ours.mesh, ours


class SplitFunction(object):
  """A split tf.function: call it like the original; its variables are shards.

  It holds the traced function, the split's config and result, and a runner
  (runtime/runners.py) that holds the shards and runs the step wherever the
  mesh is; every method below is the runner's, whichever runner it is."""

  # The split makes millions of small objects and no cycles: the GC's full
  # collections over them would only add pauses (0.1 s a split, median).
  @without_gc
  def __init__(self, traced, config, runner, shares_with=None, plan=None, release=False,
               weights=None, weights_model=None):
    self.plan = plan                  # the Plan that chose the config, if any
    self.release = release
    self.runner = runner
    self.original_graph_def = traced.graph_def
    self.original_variables = traced.variables
    self._structured_outputs = traced.structured_outputs
    self.result = split_graph(traced.graph_def, runner.configure(config))
    self.weights = None
    if weights is not None and shares_with is None:
      from tfsplit.runtime import weights as weights_lib  # pylint: disable=import-outside-toplevel
      named = {n: self.original_variables[n] for n in self.result.manifest
               if n in self.original_variables}
      self.weights = weights_lib.open_weights(weights, named, weights_model)
    if shares_with is not None:
      # The same model traced for another input shape or kind of step (a
      # smaller last batch, evaluation): it runs on the first split's shards.
      shards_lib.check_same_layout(self.manifest, shares_with.manifest)
    runner.start(traced.graph_def, self.result, self._initial_shards,
                 shares_with.runner if shares_with is not None else None)

  def _initial_shards(self, manifest, release=None, weights=True):
    """{shard name: value} chunks of `manifest`'s shards, one variable at a
    time (runtime/deferred.stream): from the weights file given to split()
    (each shard read as its slice), a deferred variable's initializer, or an
    original variable's current value (emptied after, on release)."""
    held = {name: entry for name, entry in manifest.items() if entry["shards"]}
    missing = sorted(set(held) - set(self.original_variables))
    if missing:
      raise PlanError(f"no value for variable '{missing[0]}'; give every variable the "
                      "graph uses")
    loaded = {}
    if weights and self.weights is not None:
      loaded = {n: e for n, e in held.items() if n in self.weights.keys}
    rest = deferred_lib.stream({n: e for n, e in held.items() if n not in loaded},
                               self.original_variables,
                               self.release if release is None else release)
    return itertools.chain(self.weights.chunks(loaded), rest) if loaded else rest

  config = property(lambda self: self.result.config, doc="The SplitConfig of the split.")
  mesh = property(lambda self: self.result.config.mesh, doc="The mesh, on its devices.")
  manifest = property(lambda self: self.result.manifest,
                      doc="{variable: its shards} (passes/manifest.py).")
  graph_def = property(lambda self: self.result.graph_def, doc="The split GraphDef.")
  cluster = property(lambda self: self.runner.cluster,
                     doc="The cluster the step runs on, or None.")
  task = property(lambda self: self.result.config.task,
                  doc="This process's task when every worker runs the script, or None.")
  variables = property(lambda self: self.runner.variables,
                       doc="{shard name: tf.Variable} where this process holds them.")

  task_inputs = property(
      lambda self: self.runner.task_inputs,
      doc="""{input: {"begin", "shape", "global_shape"}}: the share of each input
      this task's step takes (None when one client runs every task).""")

  def local_batch(self, *inputs):
    """This task's share of a global batch (every input, in order): what a
    tf.data pipeline sharded by task gives each worker. One client: as given."""
    return self.runner.local_batch(inputs)

  def __call__(self, *args):
    outputs = self.runner.call(args)
    return outputs[0] if len(outputs) == 1 else outputs

  def save(self, directory, step, keep=2, asynchronous=False):
    """Checkpoints the variables into DIR/ckpt-<step>, atomically, in TF's
    checkpoint format (each distinct block once, as a slice of its full
    tensor) with the manifest; returns its path (runtime/checkpoint.py).
    When every worker runs the script, each writes its own task's part.

    asynchronous=True: the values are taken now and written by a thread
    while training goes on; returns a PendingSave (wait() gives the path or
    raises what the writing raised). One save is in flight at a time: the
    next save or restore waits for it first. A crash while it writes leaves
    the previous checkpoint the latest."""
    self.wait_for_save()
    write = self.runner.checkpoint_writer(directory, step, keep)
    if not asynchronous:
      return write()
    self._pending = PendingSave(write)
    return self._pending

  def wait_for_save(self):
    """Waits for an asynchronous save in flight (raising its error); its
    path, or None if there was none."""
    pending, self._pending = getattr(self, "_pending", None), None
    return pending.wait() if pending is not None else None

  def restore(self, directory):
    """Loads the latest checkpoint in `directory` (or a ckpt-* path) into the
    shards, a few variables at a time, each shard read as its slice of the
    saved tensor, whatever mesh saved it (on a cluster, each worker its own
    task's shards); returns its step."""
    self.wait_for_save()
    meta, saved = checkpoint_lib.load(directory)
    for chunk in checkpoint_lib.chunks(meta, saved, self.manifest, self.runner.manifest):
      self.assign_shards(chunk)
    return meta["step"]

  def assign_shards(self, values):
    """{shard name: value} into the shard variables (on a cluster, its tasks')."""
    self.runner.assign(values)

  def trace(self, *args):
    """(outputs, op events) of one step, traced with TF's profiler (a
    Session's step stats on a cluster); events are [(device, node,
    start_us, end_us)] as in tfsplit.runtime.trace.op_events."""
    outputs, events = self.runner.trace(args)
    return (outputs[0] if len(outputs) == 1 else outputs), events

  def shard_values(self):
    """{shard name: numpy value}, every device's copy (see self.manifest); when
    every worker runs the script, the copies on this worker's task."""
    return self.runner.shard_values()

  def full_values(self):
    """{variable name: numpy value} assembled from the shards (the whole
    model in this process: iter_full_values() gives one at a time)."""
    return self.runner.full_values()

  def iter_full_values(self):
    """(variable name, numpy value) assembled from its shards, one variable
    at a time."""
    return self.runner.iter_full_values()

  def pinned_annotations(self):
    """{exact variable pattern: dims} of every variable of this split whose
    dims name only mesh axes: what another split over its shards keeps."""
    axes = set(self.mesh.axes)
    return {exact_pattern(name): tuple(e["sharding"]) for name, e in self.manifest.items()
            if all(d is None or d in axes for d in e["sharding"])}

  @property
  def deferred(self):
    """The names of the split's variables made under deferred_init(): their
    originals hold no values (and assign_back would make them whole)."""
    return [n for n in self.manifest
            if deferred_lib.record_of(self.original_variables.get(n)) is not None]

  def assign_back(self):
    """Writes the assembled values into the original function's variables.
    A variable made under deferred_init() would make the model whole in
    this process: refused in one line (save() the split instead)."""
    deferred = self.deferred
    if deferred:
      raise PlanError(
          f"assign_back would make the model whole in this process: variable "
          f"'{deferred[0]}' (and {len(deferred) - 1} more) was made under "
          "tfsplit.deferred_init(); keep training the split, and save() it to keep its "
          "values")
    for name, value in self.runner.iter_full_values():
      deferred_lib.refill(self.original_variables[name], value)

  def release_originals(self):
    """Empties the function's variables again (release=True) once the shards
    hold newer values than what assign_back put there."""
    for name in self.manifest:
      variable = self.original_variables.get(name)
      if variable is not None and deferred_lib.record_of(variable) is None:
        deferred_lib.release_one(variable)

  def assign_from_originals(self):
    """The inverse of assign_back: every shard from the current value of the
    original function's variable (after the user changed them)."""
    values = {}
    for chunk in self._initial_shards(self.runner.manifest, release=False, weights=False):
      values.update(chunk)
    self.assign_shards(values)


class PendingSave(object):
  """A checkpoint being written by its own thread (SplitFunction.save with
  asynchronous=True). The thread is not a daemon: the interpreter waits for
  it before exiting."""

  def __init__(self, write):
    self._path, self._error = None, None
    self._thread = threading.Thread(target=self._run, args=(write,),
                                    name="tfsplit-checkpoint")
    self._thread.start()

  def _run(self, write):
    try:
      self._path = write()
    except BaseException as e:  # pylint: disable=broad-except
      self._error = e

  def done(self):
    return not self._thread.is_alive()

  def wait(self, timeout=None):
    """The checkpoint's path once written (re-raising what writing raised)."""
    self._thread.join(timeout)
    if self._thread.is_alive():
      raise TimeoutError(f"the checkpoint is still being written after {timeout} s")
    if self._error is not None:
      raise self._error
    return self._path


def split(fn, mesh=None, input_signature=None, *, config=None, cluster=None, plan=None,
          devices=None, device_memory=None, hardware=None, memory_reserve=None,
          variable_names=None, prepare=None, shares_with=None, release=False, weights=None,
          weights_model=None, distribution=None, **options):
  """Wraps tf.function `fn` as a SplitFunction over `mesh` (see module doc).

  mesh: 'tp=4' (tensor parallel), 'dp=4' (data parallel), 'dp=2,tp=2', ...,
    or a Mesh with its own devices; default 'tp=2', or the distribution's.
  options: the split's options, each a field of
    tfsplit.passes.config.SplitConfig, whose docstring says what each does
    (strategy, annotations, microbatches, schedule, recompute, zero, ...).
  config: a whole SplitConfig instead of mesh and options (its mesh placed).
  cluster: run on a cluster's worker tasks ('TF_CONFIG', a spec file, a dict
    or a tf.distribute.cluster_resolver.ClusterResolver; default: TF_CONFIG
    when it names a cluster, as under `tfsplit launch`): dp and pp across
    tasks, the other axes within one; calls return numpy values, and
    timeout_seconds (default 600) bounds every collective and step
    (runtime/runners.py says which runner runs it).
  plan: 'auto' chooses mesh, micro-batches, schedule, stage ranges,
    recompute, zero, the blocks replicated over tp and offload with the
    planner (tfsplit.plan) for `devices` (default: this process's) devices
    of `device_memory` each on `hardware` (a preset name or cluster spec
    file, default cpu-host), leaving `memory_reserve` of it free (default
    0.1); a plan file ('tfsplit plan -o plan.json') or a tfsplit.plan.Plan
    is applied as given. The plan sets those options (an option given
    besides it with another value is refused; annotations add to its
    replicated blocks'); the chosen Plan is the result's `plan`.
  variable_names: [(variable, unique name)] where the function's variables'
    names are not unique (Keras 3: var.path).
  prepare: a GraphDef -> GraphDef function applied to the traced graph
    before it is split (tfsplit.keras drops the Keras metric updates so).
  shares_with: another SplitFunction of the same model (another input shape,
    an evaluation step): this one runs on its shards.
  release: empty each of the function's variables once its shards hold its
    value, so the process never holds the model twice (assign_back fills
    them again). A model made under tfsplit.deferred_init() holds nothing
    to release: each shard is made from its variable's initializer.
  weights: start from the weights in this file instead of the variables'
    values: a TF checkpoint (tf.train.Checkpoint, a name-based or a tfsplit
    checkpoint) or a Keras .weights.h5 (weights_model: the Keras model it was
    saved from, whose saving walk names its datasets; tfsplit.keras.split
    passes it); each shard is read as its slice of the stored tensor
    (runtime/weights.py). Every trainable variable must be there; the
    optimizer's state not in the file starts from its initializer.
  distribution: a keras.distribution.ModelParallel or DataParallel: its
    device mesh is the mesh, its layout map (keyed by Keras 3 variable
    paths, the graph's variable names) the variables' annotations
    (runtime/keras_distribution.py says what maps to what).
  """
  if config is not None and (options or plan is not None or distribution is not None):
    raise TypeError("give split() either config= or mesh, plan and options, not both")
  keras_layout = None
  if distribution is not None:
    mesh, keras_layout = distribution_options(distribution, mesh, plan, options)
  mesh = "tp=2" if mesh is None else mesh
  runner = runners_lib.choose(mesh if config is None and plan is None else None, cluster)
  traced = Traced(fn, input_signature, variable_names, prepare)
  if keras_layout is not None:
    from tfsplit.graph import Graph  # pylint: disable=import-outside-toplevel
    from tfsplit.graph.variables import find_variables  # pylint: disable=import-outside-toplevel
    laid_out = keras_layout.annotations(
        [(v, v.name) for v in find_variables(Graph(traced.graph_def)) if v.trainable
         is not False], options["strategy"], quiet=shares_with is not None)
    # The user's own annotations win over the layout map's.
    options["annotations"] = {**laid_out, **dict(options.get("annotations") or {})}
  chosen = None
  if shares_with is not None:
    # Another step of the same model runs on the first one's shards: every
    # variable they share split the way it is there, whatever this graph
    # alone would choose (a forward step whose first layer feeds nothing).
    pinned = shares_with.pinned_annotations()
    if config is not None:
      config = config.replace(annotations={**pinned, **config.annotations})
    elif plan is None:
      options["annotations"] = {**pinned, **dict(options.get("annotations") or {})}
  if plan is not None:
    from tfsplit import plan as plan_lib  # pylint: disable=import-outside-toplevel
    chosen = plan_lib.resolve(plan, traced.graph_def, devices, device_memory, hardware,
                              available=runner.available(),
                              memory_reserve=plan_lib.DEFAULT_RESERVE
                              if memory_reserve is None else memory_reserve)
    chosen.refuse(options)
    config = chosen.apply(SplitConfig(runner.place(chosen.mesh), **options))
  elif config is None:
    config = SplitConfig(runner.place(mesh), **options)
  return SplitFunction(traced, config, runner, shares_with, chosen, release, weights,
                       weights_model)
