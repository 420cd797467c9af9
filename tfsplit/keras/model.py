"""The split Keras model: a Model subclass wrapping the user's model.

Its `call` is the wrapped model's, so evaluate / predict / summary / save see
the plain model. `make_train_function` (Keras' documented hook) returns a
function that runs each batch through a tfsplit.split of one Keras training
step (forward, compute_loss, gradients, optimizer.apply_gradients), traced
once from the first batch; the loss metric and the compiled metrics are
updated by Keras' own code, on this process's default device, from the
step's loss and predictions. Nothing of Keras is patched.

Where the weights live: between fits the wrapped model's variables hold them;
during fit the split step's shard variables do. `_use_shards` / `_use_model`
copy one way or the other only when the other side is behind: pushed when a
fit starts after the weights changed (set_weights, load_weights, another
fit of the plain model), pulled at each epoch's end (callbacks that read
weights see the trained ones), before evaluate / predict / save, and when
fit returns.
"""
import re

import numpy as np
import tensorflow as tf

from tfsplit.errors import PlanError, TfsplitError, printable
from tfsplit.graph.prune import drop_variable_writes
from tfsplit.keras.flavors import wants_predictions
from tfsplit.runtime.split_function import SplitFunction

# Where the current weights are (see the module doc).
MODEL, SHARDS, BOTH = "model", "shards", "both"
_METRIC_PREFIX = "keras_metric/"


class _State(object):
  """The wrapper's own bookkeeping, kept out of Keras' attribute tracking."""

  def __init__(self, flavor, options, mesh_axes):
    self.flavor = flavor
    self.options = options
    self.mesh_axes = mesh_axes
    self.step = None          # the SplitFunction, built from the first batch
    self.steps = {}           # batch shapes -> SplitFunction (shared shards)
    self.trace = None         # the tf.function every split is traced from
    self.names = None         # [(tf.Variable, name)] for load_graph
    self.metric_names = set()  # metric variables whose updates are dropped
    self.structure = None     # (x, y, sample_weight) structure of a batch
    self.pred_structure = None
    self.fetch_predictions = False
    self.host_scalars = {}    # {name: tf.Variable} the step reads, never writes
    self.pushed_scalars = {}
    self.metrics_fn = None    # tf.function of the loss and metric updates
    self.weights_at = MODEL


def _flat(data):
  """(flat non-None tensors, structure) of a batch (x, y, sample_weight)."""
  flat = tf.nest.flatten(data)
  return [t for t in flat if t is not None], data


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
  def _use_shards(self):
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
          for shard in state.step.manifest[name]["shards"]:
            state.step.variables[shard["name"]].assign(value)
          state.pushed_scalars[name] = value
    state.weights_at = SHARDS

  def _use_model(self):
    state = self._tfsplit
    if state.weights_at == SHARDS:
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

  # --- building the split step ----------------------------------------------------
  def _step_for(self, data):
    """The split step for this batch's shapes: the first batch traces and
    splits the step; a batch of other shapes (a smaller last batch) gets its
    own split, over the same shard variables."""
    state = self._tfsplit
    flat, structure = _flat(data)
    key = tuple((tuple(t.shape), t.dtype) for t in flat)
    if key in state.steps:
      return state.steps[key], flat
    self._check_batch(data[0])
    if state.step is None:
      self._prepare_first(data[0], structure)
    signature = [tf.TensorSpec(t.shape, t.dtype) for t in flat]
    concrete = state.trace.get_concrete_function(*signature)
    try:
      step = SplitFunction(
          concrete, variable_names=state.names,
          prepare=lambda g: drop_variable_writes(g, state.metric_names)[0],
          shared_variables=None if state.step is None else state.step.variables,
          **state.options)
    except TfsplitError as e:
      raise type(e)(self._in_keras_terms(str(e))) from None
    if state.step is None:
      state.step = step
      written = _written_variables(step.original_graph_def)
      state.host_scalars = {name: var for name, var in step.original_variables.items()
                            if name not in written and int(np.prod(var.shape)) <= 1}
      state.weights_at = MODEL
    state.steps[key] = step
    return step, flat

  def _prepare_first(self, x, structure):
    """Builds what every split of the step shares: the traced function, the
    variable names, the metric variables whose updates are dropped."""
    state, flavor = self._tfsplit, self._tfsplit.flavor
    if not self.model.built:
      self.model(x, training=False)
    flavor.build_optimizer(self)
    state.structure = structure
    state.fetch_predictions = wants_predictions(self)

    def step(*args):
      x_, y_, sw_ = _unflatten(state.structure, args)
      loss, y_pred = flavor.train(self, x_, y_, sw_)
      if not state.fetch_predictions:
        return [loss]
      state.pred_structure = y_pred
      return [loss] + tf.nest.flatten(y_pred)

    state.trace = tf.function(step)
    # Tracing once creates what the trace itself builds (tf_keras' loss
    # metric) before the metric variables are listed.
    flat, _ = _flat((x,) if structure is None else structure)
    state.trace.get_concrete_function(*[tf.TensorSpec(t.shape, t.dtype) for t in flat])
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
    dp = self._tfsplit.mesh_axes.get("dp", 1)
    m = int(self._tfsplit.options.get("microbatches", 1) or 1)
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    batch = int(first.shape[0])
    if batch % (dp * m):
      raise PlanError(
          f"a batch of {batch} examples does not divide over dp={dp} x microbatches={m}: "
          f"use a global batch size that is a multiple of {dp * m}, and a last batch "
          "that is one too (batch a tf.data dataset with drop_remainder=True)")

  def _in_keras_terms(self, message):
    """`message` naming the Keras layer whose graph node it names."""
    found = re.search(r"node '([^']+)'", message)
    layer = _layer_for_node(self.model, found.group(1)) if found else None
    prefix = f"Keras layer '{layer}': " if layer else ""
    return printable(prefix + message)

  # --- the train function Keras' fit calls ---------------------------------------------
  def make_train_function(self, force=False):
    if self.train_function is not None and not force:
      return self.train_function
    flavor = self._tfsplit.flavor

    def train_function(iterator):
      logs = None
      for _ in range(flavor.steps_per_execution(self)):
        try:
          data = next(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
          if logs is None:
            raise StopIteration() from None
          break
        logs = self._train_batch(data)
      flavor.count_execution(self)
      return logs

    self.train_function = train_function
    return train_function

  def _train_batch(self, data):
    state = self._tfsplit
    if not isinstance(data, tuple):
      data = (data,)
    data = tuple(data) + (None,) * (3 - len(data))
    step, flat = self._step_for(data)
    self._use_shards()
    # The step runs as its own function (with the Grappler settings the
    # split chose, runtime/graph_function.py), not inlined into the metrics'.
    outputs = step(*flat)
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    y_pred = (tf.nest.pack_sequence_as(state.pred_structure, outputs[1:])
              if state.fetch_predictions else None)
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
  def fit(self, *args, **kwargs):
    callbacks = list(kwargs.pop("callbacks", None) or [])
    kwargs["callbacks"] = [_pull_at_epoch_end(self)] + callbacks
    try:
      return super().fit(*args, **kwargs)
    finally:
      if self._tfsplit.step is not None:
        self._use_model()

  def evaluate(self, *args, **kwargs):
    self._use_model()
    return super().evaluate(*args, **kwargs)

  def predict(self, *args, **kwargs):
    self._use_model()
    return super().predict(*args, **kwargs)

  def test_on_batch(self, *args, **kwargs):
    self._use_model()
    return super().test_on_batch(*args, **kwargs)

  def predict_on_batch(self, *args, **kwargs):
    self._use_model()
    return super().predict_on_batch(*args, **kwargs)

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
  from tfsplit.graph.prune import WRITE_OPS  # pylint: disable=import-outside-toplevel
  handles = {n.name: n.attr[variables_lib.VAR_NAME_ATTR].s.decode() for n in graph_def.node
             if variables_lib.VAR_NAME_ATTR in n.attr}
  written = set()
  for node in graph_def.node:
    if node.input and (node.op in WRITE_OPS or node.op.startswith("ResourceApply")):
      for text in node.input:
        source = text.lstrip("^").split(":")[0]
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
        split_model._use_model()  # pylint: disable=protected-access

  return PullWeights()
