"""Starting a split from weights in a file, read by slices: each shard is
read as its block of the stored tensor, so no process holds the model whole
(with tfsplit.deferred_init(), nor was it ever built whole).

    source = open_weights(path, variables, model=None)
    source.keys                     {variable name: where the file holds it}
    source.chunks(manifest)         {shard name: value}, a few variables at a time

Files:
- a TF checkpoint (a prefix, or a directory with TF's `checkpoint` file; a
  tfsplit checkpoint directory too): a variable is found under its own name
  (tfsplit's and name-based checkpoints), else through the checkpoint's
  object graph, whose attributes record each variable's name when it was
  saved (tf.train.Checkpoint(model=...) of a Keras 3 or tf_keras model);
  RestoreV2 reads each block.
- a Keras `.weights.h5` (model.save_weights): a variable is found at the
  path Keras 3's own saving walk gives it in `model` (layers/dense/vars/0),
  else at a dataset path ending in its name (tf_keras' .h5 files:
  layer/weight names); h5py reads each block.

Every variable of the model the file does not hold is one line; one of its
optimizer (slots, step counter) starts from its initializer. A variable
whose shape differs is one line; the file's own variables nothing matched
are one warning.
"""
import os

import numpy as np
import tensorflow as tf
from absl import logging

from tfsplit.errors import TfsplitError
from tfsplit.runtime import checkpoint as checkpoint_lib
from tfsplit.runtime import slices

_OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"
_BOOKKEEPING = ("save_counter/", _OBJECT_GRAPH)


class WeightsError(TfsplitError):
  """Weights that cannot start the split: missing, another shape, unreadable."""


def _tf_name(variable):
  return variable.name.split(":")[0]


def open_weights(path, variables, model=None, required=None):
  """The source of `variables` ({name: tf.Variable}) in the file at `path`.
  required: the names that must be there (default: every trainable one)."""
  path = os.fspath(path)
  if path.endswith(".h5") or path.endswith(".keras"):
    source = _H5Weights(path, variables, model)
  else:
    source = _TfWeights(path, variables)
  if required is None:
    required = [n for n, v in variables.items() if getattr(v, "trainable", True)]
  missing = [n for n in required if n not in source.keys]
  if missing:
    raise WeightsError(
        f"'{path}' holds no value for variable '{missing[0]}'"
        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        + f"; it holds {', '.join(repr(k) for k in source.names()[:3])}"
        + (" ..." if len(source.names()) > 3 else "")
        + "; give the weights of this model (its own save_weights / checkpoint)"
        + ("; a tf_keras model's .weights.h5 is matched by name only: save it as "
           "'model.h5' or with tf.train.Checkpoint(model=model)"
           if model is not None and type(model).__module__.startswith("tf_keras") and
           path.endswith(".weights.h5") else ""))
  for name, key in source.keys.items():
    stored = source.shape(key)
    if list(stored) != list(variables[name].shape):
      raise WeightsError(f"variable '{name}' has shape {list(stored)} in '{path}' (as "
                         f"'{key}') but {list(variables[name].shape)} in the model")
  used = set(source.keys.values())
  unused = [k for k in source.names() if k not in used]
  if unused:
    logging.warning("%d variable(s) of '%s' match nothing in the model and are not "
                    "loaded, the first: '%s'", len(unused), path, unused[0])
  return source


class _TfWeights(object):
  """A TF checkpoint: keys by name, or by the object graph's recorded names."""

  def __init__(self, path, variables):
    prefix = path
    if os.path.isdir(path):   # a checkpoint's folder, or one split checkpoint's
      whole = os.path.join(path, checkpoint_lib.PREFIX)
      prefix = whole if os.path.exists(whole + ".index") else tf.train.latest_checkpoint(path)
    if prefix is None:
      raise WeightsError(f"'{path}': no TF checkpoint there (no 'checkpoint' file naming "
                         "one); give the checkpoint's prefix (.../ckpt-1) or its folder")
    try:
      self.reader = tf.train.load_checkpoint(prefix)
    except (tf.errors.OpError, ValueError) as e:
      raise WeightsError(f"'{path}': cannot read the checkpoint "
                         f"({str(e).splitlines()[0][:200]})") from None
    self.prefix = prefix
    self.stored = self.reader.get_variable_to_shape_map()
    recorded = self._recorded_names()
    self.keys = {}
    for name, variable in variables.items():
      for candidate in (name, recorded.get(name), recorded.get(_tf_name(variable))):
        if candidate in self.stored:
          self.keys[name] = candidate
          break

  def _recorded_names(self):
    """{a variable's name when saved: its key} from the object graph."""
    if _OBJECT_GRAPH not in self.stored:
      return {}
    from tensorflow.core.protobuf import trackable_object_graph_pb2  # pylint: disable=import-outside-toplevel
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(self.reader.get_tensor(_OBJECT_GRAPH))
    found = {}
    for node in graph.nodes:
      for attribute in node.attributes:
        if attribute.name == "VARIABLE_VALUE" and attribute.full_name:
          # Two variables saved under one name: neither is matched by it.
          found[attribute.full_name] = None if attribute.full_name in found \
              else attribute.checkpoint_key
    return {k: v for k, v in found.items() if v is not None}

  def names(self):
    return sorted(k for k in self.stored if not k.startswith(_BOOKKEEPING))

  def shape(self, key):
    return self.stored[key]

  def chunks(self, manifest):
    try:
      yield from slices.read(self.prefix, manifest, self.keys)
    except TfsplitError as e:
      raise WeightsError(str(e)) from None


class _H5Weights(object):
  """A Keras weights file: keys from Keras's own saving walk of `model`."""

  def __init__(self, path, variables, model):
    try:
      import h5py  # pylint: disable=import-outside-toplevel
      self.file = h5py.File(path, "r")
    except (ImportError, OSError) as e:
      raise WeightsError(f"'{path}': cannot read the weights file ({e})") from None
    self.path = path
    self.datasets = {}

    def visit(name, obj):   # a value returned would end the visit
      if hasattr(obj, "shape"):
        self.datasets[name] = obj.shape
    self.file.visititems(visit)
    walked = _keras_paths(model) if model is not None else {}
    self.keys = {}
    for name, variable in variables.items():
      key = walked.get(id(variable))
      if key is None:
        ends = [d for d in self.datasets if d == name or d.endswith("/" + name) or
                d.endswith("/" + _tf_name(variable) + ":0")]
        key = ends[0] if len(ends) == 1 else None
      if key in self.datasets:
        self.keys[name] = key

  def names(self):
    return sorted(self.datasets)

  def shape(self, key):
    return self.datasets[key]

  def chunks(self, manifest):
    for name, chosen in slices.blocks(manifest).items():
      dataset = self.file[self.keys[name]]
      values = {}
      for s in chosen:
        block = tuple(slice(o, o + n) for o, n in zip(s["offsets"], s["shape"]))
        try:
          values[slices.block_key(name, s)] = np.asarray(dataset[block] if block
                                                         else dataset[()])
        except (OSError, ValueError) as e:
          raise WeightsError(f"'{self.path}': variable '{name}' cannot be read ({e})") \
              from None
      yield slices.spread({name: manifest[name]}, values)


def _keras_paths(model):
  """{id(tf.Variable): its dataset path in model.save_weights' .weights.h5},
  from Keras 3's own saving walk of `model`, run with a store that records
  where each variable would go and reads or writes nothing; {} for a
  tf_keras model (its walk reads every value: its variables are found by
  name, as in its .h5 files) or when the walk fails."""
  if type(model).__module__.startswith("tf_keras"):
    return {}   # its walk reads every value (tf_keras stores numpy copies)
  try:
    from keras.src.saving import saving_lib  # pylint: disable=import-outside-toplevel
  except ImportError:
    return {}
  found = {}

  class _Recorder(saving_lib.H5IOStore):
    """Records where each variable would be written."""

    def __init__(self):  # pylint: disable=super-init-not-called
      self.at = ""

    def make(self, path, metadata=None):
      del metadata
      self.at = path
      return self

    def __setitem__(self, key, value):
      inner = getattr(value, "value", value)
      where = f"{self.at}/vars/{key}" if self.at else f"vars/{key}"
      found[id(inner if isinstance(inner, tf.Variable) else value)] = where

    def __bool__(self):
      return True

  try:
    # (saveable, weights_store, assets_store, inner_path, visited saveables)
    saving_lib._save_state(model, _Recorder(), None, "", set())  # pylint: disable=protected-access
  except (TypeError, AttributeError, ValueError, TfsplitError) as e:
    logging.warning("the Keras saving walk of '%s' failed (%s): variables are matched "
                    "by name", getattr(model, "name", model), e)
    return {}
  return found
