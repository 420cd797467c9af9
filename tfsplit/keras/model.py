"""The split Keras model: a Model subclass wrapping the user's model.

Its `call` is the wrapped model's, so summary / save see the plain model.
`make_train_function` (Keras' documented hook) returns a function that runs
each batch through a tfsplit.split of one Keras training step (forward,
compute_loss, gradients, optimizer.apply_gradients), traced once from the
first batch; the loss metric and the compiled metrics are updated by Keras'
own code, on this process's default device, from the step's loss and
predictions. `make_test_function` / `make_predict_function` do the same
with forward-only splits over the training step's shards. Nothing of Keras
is patched.

Where the weights live: between fits the wrapped model's variables hold them;
during fit the split step's shard variables do. `_use_shards` / `_use_model`
copy one way or the other only when the other side is behind: pushed when a
fit starts after the weights changed (set_weights, load_weights, another
fit of the plain model), pulled at each epoch's end (callbacks that read
weights see the trained ones), before save / get_weights and when fit
returns.
"""
import re

from absl import logging
import numpy as np
import tensorflow as tf

from tfsplit.constants import is_write_op
from tfsplit.errors import PlanError, TfsplitError, printable
from tfsplit.graph.ir import input_node
from tfsplit.graph.prune import drop_variable_writes
from tfsplit.keras.flavors import compile_arguments, wants_predictions
from tfsplit.runtime.split_function import split

# Where the current weights are (see the module doc).
MODEL, SHARDS, BOTH = "model", "shards", "both"
KINDS = ("train", "test", "predict")
_METRIC_PREFIX = "keras_metric/"


class _State(object):
  """The wrapper's own bookkeeping, kept out of Keras' attribute tracking."""

  def __init__(self, flavor, options, mesh_axes):
    self.flavor = flavor
    self.options = options
    self.mesh_axes = mesh_axes
    self.step = None          # the first training SplitFunction: owns the shards
    self.kinds = {k: _Kind() for k in KINDS}
    self.names = None         # [(tf.Variable, name)] for load_graph
    self.metric_names = set()  # metric variables whose updates are dropped
    self.host_scalars = {}    # {name: tf.Variable} the step reads, never writes
    self.pushed_scalars = {}
    self.metrics_fn = None    # tf.function of the loss and metric updates
    self.plain = {}           # kind -> the plain Keras step, for what is not split
    self.weights_at = MODEL


class _Kind(object):
  """One kind of step ('train', 'test', 'predict'): the tf.function every
  split of it is traced from, and its splits by batch shapes."""

  def __init__(self):
    self.trace = None
    self.steps = {}           # ((shape, dtype), ...) -> SplitFunction
    self.structure = None     # (x, y, sample_weight) of a batch
    self.pred_structure = None
    self.fetch_predictions = True


def _dataset_batches(dataset):
  """(batch size, examples batched or None) of a tf.data dataset, read from
  the last batch op on its way (Dataset.batch / padded_batch, before any
  map, prefetch, cache or repeat) and the cardinality of what that op
  batches, without reading an element; (size, None) when every batch is
  full (drop_remainder, an infinite input). None when it cannot be told
  (no batch op found, a filter before it, a batch op after an unbatch)."""
  spec = tf.nest.flatten(dataset.element_spec)
  if spec and getattr(spec[0], "shape", None) is not None and spec[0].shape.rank and \
      spec[0].shape[0] is not None:
    return int(spec[0].shape[0]), None     # static: every batch is that size
  node = dataset
  for _ in range(100):   # a dataset's chain of inputs
    size = getattr(node, "_batch_size", None)
    source = getattr(node, "_input_dataset", None)
    if size is not None and source is not None:
      try:
        size = int(size)
        drop = bool(getattr(node, "_drop_remainder", False))
        n = int(source.cardinality())
      except (TypeError, ValueError, tf.errors.OpError):
        return None
      if size < 1:
        return None
      if drop or n == int(tf.data.INFINITE_CARDINALITY):
        return size, None
      if n < 0:
        return None
      # What follows the batch op keeps its batches (map, prefetch,
      # repeat): else a take/skip/shard decides which ones fit sees.
      batches, total = -(-n // size), int(dataset.cardinality())
      if total != int(tf.data.INFINITE_CARDINALITY) and \
          (batches == 0 or total % batches or total == 0):
        return None
      return size, n
    if source is None:
      return None
    node = source
  return None


def _flat(data):
  """The non-None tensors of a batch (x, y, sample_weight), flattened."""
  return [t for t in tf.nest.flatten(data) if t is not None]


def _unflatten(structure, tensors):
  flat = tf.nest.flatten(structure)
  it = iter(tensors)
  return tf.nest.pack_sequence_as(structure, [None if t is None else next(it) for t in flat])


class SplitModelMixin(object):
  """The part of the split model written once for Keras 3 and tf_keras."""

  def _init_split(self, model, flavor, options, mesh_axes):
    self.model = model
    self._tfsplit = _State(flavor, options, mesh_axes)

  def call(self, inputs, training=None):  # pylint: disable=arguments-differ
    return self.model(inputs, training=training)

  # --- where the weights are ----------------------------------------------------
  def _use_shards(self, writing=True):
    state = self._tfsplit
    if state.weights_at == MODEL:
      state.step.assign_from_originals()
      state.pushed_scalars = {n: v.numpy() for n, v in state.host_scalars.items()}
    else:
      # A callback may have changed a value the step only reads (the learning
      # rate under LearningRateScheduler): hand it over before the step.
      for name, var in state.host_scalars.items():
        value = var.numpy()
        if not np.array_equal(value, state.pushed_scalars.get(name)):
          state.step.assign_shards({shard["name"]: value
                                    for shard in state.step.manifest[name]["shards"]})
          state.pushed_scalars[name] = value
    if writing and state.weights_at == BOTH and state.step.release:
      state.step.release_originals()   # the model held once: in the shards
    state.weights_at = SHARDS if writing or state.weights_at == SHARDS else BOTH

  def _use_model(self, asked=True):
    """The wrapped model's weights brought up to date: `asked` by the user
    (get_weights, save), or automatically (an epoch's end, fit's return),
    which a model made under tfsplit.deferred_init() skips: its weights
    stay in the shards, never whole here (asked, assign_back refuses)."""
    state = self._tfsplit
    if state.weights_at == SHARDS:
      if not asked and (state.step.deferred or state.step.release):
        return
      state.step.assign_back()
      state.weights_at = BOTH

  @property
  def split_step(self):
    """The tfsplit.split step fit trains with (its manifest, shard values,
    trace()); None before the first batch."""
    return self._tfsplit.step

  def sync_weights(self):
    """Copies the split step's weights into the wrapped model now (fit and
    the Keras methods that read weights do it themselves)."""
    self._use_model()

  # --- building the split steps -----------------------------------------------------
  def _step_for(self, kind_name, data):
    """(the split step for this batch's shapes, the flat batch). Training's
    first batch traces and splits the step; a batch of other shapes (a
    smaller last batch) gets its own split over the same shard variables, and
    so do evaluation and prediction, once a training step owns the shards
    (before that: None, the plain model runs)."""
    state = self._tfsplit
    kind = state.kinds[kind_name]
    flat = _flat(data)
    key = tuple((tuple(t.shape), t.dtype) for t in flat)
    if key in kind.steps:
      return kind.steps[key], flat
    if kind_name != "train" and state.step is None:
      return None, flat
    self._check_batch(data[0])
    if kind.trace is None:
      self._prepare(kind_name, data)
    signature = [tf.TensorSpec(t.shape, t.dtype) for t in flat]
    concrete = kind.trace.get_concrete_function(*signature)
    try:
      step = split(concrete, variable_names=state.names,
                   prepare=lambda g: drop_variable_writes(g, state.metric_names)[0],
                   shares_with=state.step, **state.options)
    except TfsplitError as e:
      raise type(e)(self._in_keras_terms(str(e))) from None
    if state.step is None:
      state.step = step
      if getattr(step, "plan", None) is not None:
        # The plan chose the mesh and options: later splits (evaluation, a
        # smaller last batch) take the same ones, and the batch checks too.
        state.options = {"config": step.config, "cluster": state.options.get("cluster")}
        state.mesh_axes = dict(step.mesh.axes)
      self._report_fallbacks(step)
      written = _written_variables(step.original_graph_def)
      state.host_scalars = {name: var for name, var in step.original_variables.items()
                            if name not in written and int(np.prod(var.shape)) <= 1}
      # Shards started from a weights file hold newer values than the model;
      # with release=True the model's variables were emptied into them.
      state.weights_at = SHARDS if step.weights is not None or step.release else MODEL
    kind.steps[key] = step
    return step, flat

  def _prepare(self, kind_name, data):
    """The tf.function every split of one kind is traced from; for training
    also what all kinds share: the variable names, and the metric variables
    whose updates are dropped from the split graphs."""
    state, flavor = self._tfsplit, self._tfsplit.flavor
    kind = state.kinds[kind_name]
    x = data[0]
    kind.structure = data
    if kind_name == "train":
      if not self.model.built:
        self.model(x, training=False)
      flavor.build_optimizer(self)
    kind.fetch_predictions = kind_name == "predict" or wants_predictions(self)

    def step(*args):
      x_, y_, sw_ = _unflatten(kind.structure, args)
      if kind_name == "predict":
        loss, y_pred = None, self(x_, training=False)
      elif kind_name == "test":
        loss, y_pred = flavor.test(self, x_, y_, sw_)
      else:
        loss, y_pred = flavor.train(self, x_, y_, sw_)
      kind.pred_structure = y_pred
      head = [] if loss is None else [loss]
      return head + (tf.nest.flatten(y_pred) if kind.fetch_predictions else [])

    kind.trace = tf.function(step)
    # Tracing once creates what the trace itself builds (tf_keras' loss
    # metric) before the metric variables are listed.
    flat = _flat(data)
    kind.trace.get_concrete_function(*[tf.TensorSpec(t.shape, t.dtype) for t in flat])
    if kind_name != "train":
      return
    named = named_variables(flavor, self)
    owned_ids = {id(v) for _, v in named}
    for metric in self.metrics:
      for v in metric.variables:
        tv = flavor.tf_variable(v)
        if id(tv) not in owned_ids:
          name = f"{_METRIC_PREFIX}{metric.name}/{flavor.variable_name(v)}"
          named.append((name, tv))
          state.metric_names.add(name)
    state.names = [(v, name) for name, v in named]

  def _check_batch(self, x):
    if self._tfsplit.mesh_axes is None:
      return  # a plan decides the mesh: the split itself checks the batch
    dp = self._tfsplit.mesh_axes.get("dp", 1)
    state = self._tfsplit
    m = int(state.step.config.microbatches if state.step is not None
            else state.options.get("microbatches", 1) or 1)
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    batch = int(first.shape[0])
    if batch % (dp * m):
      raise PlanError(
          f"a batch of {batch} examples does not divide over dp={dp} x microbatches={m}: "
          f"use a global batch size that is a multiple of {dp * m}, and a last batch "
          "that is one too (batch a tf.data dataset with drop_remainder=True)")

  def _check_batches(self, x, batch_size):
    """Before the first epoch: inputs whose batches (the last one too) will
    not divide over dp x micro-batches are refused now, not when the odd
    batch arrives after epochs of training: arrays from their length and
    batch_size, a tf.data dataset from its batch op and what feeds it
    (_dataset_batches); one whose last batch cannot be known without
    reading it is one warning."""
    state = self._tfsplit
    if state.mesh_axes is None or x is None:
      return
    dp = state.mesh_axes.get("dp", 1)
    m = int(state.options.get("microbatches", 1) or 1) if state.step is None else \
        int(state.step.config.microbatches)
    if dp * m == 1:
      return
    first = next((t for t in tf.nest.flatten(x) if t is not None), None)
    if isinstance(first, tf.data.Dataset):
      found = _dataset_batches(first)
      if found is None:
        logging.warning(
            "tfsplit.keras: the size of the dataset's last batch is not known before it "
            "arrives (no batch op over an input of known length); if it does not divide "
            "over dp=%d x microbatches=%d, fit stops there: batch the dataset with "
            "drop_remainder=True", dp, m)
        return
      size, n = found
      where = f"the dataset batches {n} examples by {size}" if n is not None else \
          f"the dataset batches by {size}"
    elif first is None or not hasattr(first, "shape") or not first.shape or \
        first.shape[0] is None:
      return
    else:
      n, size = int(first.shape[0]), int(batch_size or 32)
      where = f"fit would cut {n} examples into batches of {size}"
    last = n % size if n is not None and n > size and n % size else None
    sizes = {size if n is None else min(size, n)} | ({last} if last else set())
    bad = sorted(b for b in sizes if b % (dp * m))
    if bad:
      raise PlanError(
          where + (f" (the last of {last})" if last else "")
          + f", and a batch of {bad[0]} examples does not divide over dp={dp} x "
          f"microbatches={m}: "
          f"use a batch size and a number of examples that are multiples of {dp * m} "
          "(or a tf.data dataset batched with drop_remainder=True)")

  def _report_fallbacks(self, step):
    """Says once, by Keras layer, which ops were replicated instead of split
    (their split inputs gathered): correct, but slower and bigger."""
    fallbacks = list(getattr(step.result, "fallbacks", ()) or ())
    if not fallbacks:
      return
    layers = sorted({_layer_for_node(self.model, m.split("'")[1]) or "?" for m in fallbacks
                     if "'" in m})
    logging.warning(
        "tfsplit.keras: %d ops run replicated instead of split, in Keras layers %s; the "
        "first: %s (split_model.split_step.result.fallbacks lists them all)",
        len(fallbacks), ", ".join(f"'{n}'" for n in layers[:8]),
        self._in_keras_terms(fallbacks[0]))

  def _in_keras_terms(self, message):
    """`message` naming the Keras layer whose graph node it names."""
    found = re.search(r"node '([^']+)'", message)
    layer = _layer_for_node(self.model, found.group(1)) if found else None
    prefix = f"Keras layer '{layer}': " if layer else ""
    return printable(prefix + message)

  # --- the functions Keras' fit / evaluate / predict call ------------------------------
  def _loop(self, run_batch):
    """A Keras train/test function: `run_batch` over steps_per_execution
    batches of the iterator Keras passes (a list of batches for Keras 3's
    predict), returning the last logs or the outputs concatenated."""
    flavor = self._tfsplit.flavor

    def function(iterator):
      results = []
      batches = iter(iterator) if isinstance(iterator, list) else iterator
      for _ in range(len(iterator) if isinstance(iterator, list)
                     else flavor.steps_per_execution(self)):
        try:
          data = next(batches)
        except (StopIteration, tf.errors.OutOfRangeError):
          if not results:
            raise StopIteration() from None
          break
        results.append(run_batch(_as_triple(data)))
      return results

    return function

  def make_train_function(self, force=False):
    if self.train_function is not None and not force:
      return self.train_function
    loop = self._loop(self._train_batch)
    flavor = self._tfsplit.flavor

    def train_function(iterator):
      logs = loop(iterator)[-1]
      flavor.count_execution(self)
      return logs

    self.train_function = train_function
    return train_function

  def make_test_function(self, force=False):
    if self.test_function is not None and not force:
      return self.test_function
    loop = self._loop(lambda data: self._split_or_plain("test", data))

    def test_function(iterator):
      return loop(iterator)[-1]

    self.test_function = test_function
    return test_function

  def make_predict_function(self, force=False):
    if self.predict_function is not None and not force:
      return self.predict_function
    loop = self._loop(lambda data: self._split_or_plain("predict", data))

    def predict_function(iterator):
      outputs = loop(iterator)
      if len(outputs) == 1:
        return outputs[0]
      return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *outputs)

    self.predict_function = predict_function
    return predict_function

  def _train_batch(self, data):
    step, flat = self._step_for("train", data)
    self._use_shards()
    return self._after_step("train", step(*flat), data)

  def _split_or_plain(self, kind_name, data):
    """One evaluation or prediction batch on the split step's shards; on the
    plain model (this process's default device) before any training step,
    or for a batch the split refuses (told once)."""
    state = self._tfsplit
    try:
      step, flat = self._step_for(kind_name, data)
    except TfsplitError as e:
      if kind_name not in state.plain:
        logging.warning("tfsplit.keras: %s runs on one device (%s)", kind_name, e)
      step = None
    if step is None:
      self._use_model()
      if kind_name not in state.plain:
        method = self.test_step if kind_name == "test" else self.predict_step
        state.plain[kind_name] = tf.function(method, reduce_retracing=True)
      return state.plain[kind_name](tuple(t for t in data if t is not None))
    self._use_shards(writing=False)
    outputs = step(*flat)
    if kind_name == "predict":
      outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
      return tf.nest.pack_sequence_as(state.kinds["predict"].pred_structure, outputs)
    return self._after_step("test", outputs, data)

  def _after_step(self, kind_name, outputs, data):
    """The loss and compiled metrics updated from a split step's outputs."""
    state = self._tfsplit
    kind = state.kinds[kind_name]
    # The step runs as its own function (with the Grappler settings the
    # split chose, runtime/graph_function.py), not inlined into the metrics'.
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    y_pred = (tf.nest.pack_sequence_as(kind.pred_structure, outputs[1:])
              if kind.fetch_predictions else None)
    x, y, sample_weight = data
    if state.metrics_fn is None:
      state.metrics_fn = tf.function(self._update_metrics)
    return state.metrics_fn(x, y, y_pred, sample_weight, tf.convert_to_tensor(outputs[0]))

  def _update_metrics(self, x, y, y_pred, sample_weight, loss):
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    for metric in self.metrics:
      if metric.name == "loss":
        metric.update_state(loss, sample_weight=tf.shape(first)[0])
        break
    if y_pred is None:
      return self.get_metrics_result()
    return self.compute_metrics(x, y, y_pred, sample_weight)

  # --- Keras methods that read or write the weights ----------------------------------
  def compile(self, *args, **kwargs):  # pylint: disable=arguments-differ
    """Keras' compile, with the wrapped model's own defaults when its class
    overrides compile (a task model's default loss or metrics)."""
    resolved = compile_arguments(self.model, args, kwargs)
    if resolved is None:
      return super().compile(*args, **kwargs)
    return super().compile(**resolved)

  def fit(self, *args, **kwargs):
    if not kwargs.get("validation_split") and kwargs.get("steps_per_epoch") is None:
      self._check_batches(args[0] if args else kwargs.get("x"),
                          kwargs.get("batch_size", args[2] if len(args) > 2 else None))
    callbacks = list(kwargs.pop("callbacks", None) or [])
    kwargs["callbacks"] = [_pull_at_epoch_end(self)] + callbacks
    try:
      return super().fit(*args, **kwargs)
    finally:
      if self._tfsplit.step is not None:
        self._use_model(asked=False)

  # evaluate, predict, test_on_batch and predict_on_batch go through the
  # test and predict functions above: split once a training step exists.

  def get_weights(self):
    self._use_model()
    return self.model.get_weights()

  def set_weights(self, weights):
    self._use_model()
    self.model.set_weights(weights)
    self._tfsplit.weights_at = MODEL

  def save_weights(self, *args, **kwargs):
    """Writes the full (unsplit) weights, in the wrapped model's layout: the
    file loads into the plain model."""
    self._use_model()
    return self.model.save_weights(*args, **kwargs)

  def load_weights(self, *args, **kwargs):
    self._use_model()
    result = self.model.load_weights(*args, **kwargs)
    self._tfsplit.weights_at = MODEL
    return result

  def save(self, *args, **kwargs):
    """Saves the wrapped (plain) model with the trained weights."""
    self._use_model()
    return self.model.save(*args, **kwargs)


def _as_triple(data):
  """A batch as (x, y, sample_weight), absent parts None."""
  if not isinstance(data, tuple):
    data = (data,)
  return tuple(data) + (None,) * (3 - len(data))


def named_variables(flavor, model):
  """[(name in the split step, tf.Variable)]: the model's variables, then its
  optimizer's, in a fixed order (a plain model compiled the same way lists
  its own in the same order)."""
  named = [(flavor.variable_name(v), flavor.tf_variable(v)) for v in model.variables]
  named += [("optimizer/" + flavor.variable_name(v), flavor.tf_variable(v))
            for v in flavor.optimizer_variables(model.optimizer)]
  return named


def _written_variables(graph_def):
  """Names of the captured variables some op of the graph writes."""
  from tfsplit.graph import variables as variables_lib  # pylint: disable=import-outside-toplevel
  handles = {n.name: n.attr[variables_lib.VAR_NAME_ATTR].s.decode() for n in graph_def.node
             if variables_lib.VAR_NAME_ATTR in n.attr}
  written = set()
  for node in graph_def.node:
    if node.input and is_write_op(node.op):
      for text in node.input:
        source = input_node(text)
        if source in handles:
          written.add(handles[source])
  return written


def _layer_names(model):
  """Names of the model's layers at every depth (blocks inside a backbone)."""
  layers = model._flatten_layers(include_self=True, recursive=True)  # pylint: disable=protected-access
  return {layer.name for layer in layers}


def _layer_for_node(model, node_name):
  """The Keras name of the deepest layer among a graph node's name scopes
  (a layer called again in a trace gets a scope with a '_1' suffix)."""
  names = _layer_names(model)
  for part in reversed(node_name.split("/")[:-1]):
    for candidate in (part, re.sub(r"_\d+$", "", part)):
      if candidate in names:
        return candidate
  return None


def _pull_at_epoch_end(split_model):
  """A callback (of the model's Keras) that copies the trained weights into
  the wrapped model at each epoch's end, before the user's callbacks run."""
  base = split_model._tfsplit.flavor.module.callbacks.Callback  # pylint: disable=protected-access

  class PullWeights(base):

    def on_epoch_end(self, epoch, logs=None):
      del epoch, logs
      if split_model._tfsplit.step is not None:  # pylint: disable=protected-access
        split_model._use_model(asked=False)  # pylint: disable=protected-access

  return PullWeights()
