"""Variables that hold no memory until a split creates their shards.

    with tfsplit.deferred_init():
      model = build_model()                # Keras 3, tf_keras or tf.Variables
      optimizer.build(model.trainable_variables)
    step = tfsplit.split(train_step, mesh="tp=4", input_signature=[...])

Inside the scope every variable whose initial value is a function
(initializer) of a known shape, or a large constant, is a DeferredVariable:
an UninitializedVariable (no memory; shape, dtype and name kept) that traces
into a tf.function like any variable, carrying a Record of how to make its
value. A split then makes each shard on its device from the record, one
variable at a time (`stream`): a constant fill per shard, anything else from
the initializer's full value (the transient: one variable, never the
model), sliced. The values equal what the same code outside the scope gives
under the same seed: initializers run in the order the variables were made,
and an initializer whose result may depend on that order (a stateful random
op, an unknown function) is run, and dropped, for every variable made before
a needed one that has not run yet.

Keras 3 computes a variable's initial value inside its own Variable class;
inside the scope that class makes a DeferredVariable instead (restored on
leaving). Reading a deferred variable's value outside a traced function is
one line naming the variable and what to do.
"""
import contextlib
import itertools
import threading
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.ops import resource_variable_ops

from tfsplit.errors import TfsplitError
from tfsplit.runtime import shards as shards_lib

# A constant below this many bytes (a step counter, a scalar) is made a
# real variable: deferring it saves nothing.
_SMALL_BYTES = 1 << 16


class DeferredValueError(TfsplitError):
  """A variable made under deferred_init() was read outside a split."""


class Record(object):
  """How to make one deferred variable's value.

  make: () -> its full value; fill: the scalar every element holds, when
  known (each shard is made without the full value); ordered: the value may
  depend on when `make` runs relative to the other variables' (a stateful
  random op), so they run in creation order."""

  def __init__(self, seq, make=None, fill=None, ordered=True):
    self.seq, self.make, self.fill, self.ordered = seq, make, fill, ordered
    self.drawn = False


class _Guarded(object):
  """Reads of a variable that holds no value here are one line (`_empty_why`
  says why), outside a traced function; in one they trace as usual."""

  def _check_value(self):
    if not context.executing_eagerly():
      if isinstance(self, DeferredVariable):
        _STATE.seen = True     # a traced step reads a deferred model (following)
      return
    why = self._empty_why()
    if why:
      raise DeferredValueError(f"variable '{self.name.split(':')[0]}' {why}")

  def _read_variable_op(self, no_copy=False):
    self._check_value()
    return super()._read_variable_op(no_copy=no_copy)

  def sparse_read(self, indices, name=None):
    self._check_value()
    return super().sparse_read(indices, name=name)

  def gather_nd(self, indices, name=None):
    self._check_value()
    return super().gather_nd(indices, name=name)


class DeferredVariable(_Guarded, resource_variable_ops.UninitializedVariable):
  """An UninitializedVariable with the record of its initial value."""

  def __init__(self, record, **kwargs):
    super().__init__(**kwargs)
    self.tfsplit_record = record

  def _empty_why(self):
    if self.is_initialized():
      return None
    return ("was made under tfsplit.deferred_init() and holds no value in this process: "
            "split a step over it (tfsplit.split or tfsplit.keras.split), whose shards "
            "hold its values, or build the model outside deferred_init() to use it "
            "whole here")


_RELEASED_CLASSES = {}


def _released_class(cls):
  if cls not in _RELEASED_CLASSES:
    _RELEASED_CLASSES[cls] = type(f"Released{cls.__name__}", (_Guarded, cls), {
        "_empty_why": lambda self: (
            "was released to the shards of a split (split(release=True)) and holds no "
            "value: use the split, or step.assign_back() to fill it again")})
  return _RELEASED_CLASSES[cls]


def empty(variable):
  """Frees a variable's memory: it holds an empty tensor, and reading it
  outside a traced function is one line, until `refill`."""
  tf.raw_ops.AssignVariableOp(resource=variable.handle,
                              value=tf.zeros([0], variable.dtype), validate_shape=False)
  variable.tfsplit_class = type(variable)
  variable.__class__ = _released_class(type(variable))


def release_one(variable):
  """Empties `variable` (its shards hold its value) unless it is small (a
  step counter, a learning rate: emptying it saves nothing, and a training
  loop may read it) or empty already."""
  if getattr(variable, "tfsplit_class", None) is None and \
      int(np.prod(variable.shape)) * variable.dtype.size >= _SMALL_BYTES:
    empty(variable)


def refill(variable, value):
  """Assigns `value` to a variable, emptied by `empty` or not."""
  original = getattr(variable, "tfsplit_class", None)
  if original is None:
    variable.assign(value)
    return
  variable.__class__ = original
  del variable.tfsplit_class
  value = tf.convert_to_tensor(value, variable.dtype)
  if not variable.shape.is_compatible_with(value.shape):
    raise TfsplitError(f"variable '{variable.name}': value of shape {value.shape}, the "
                       f"variable's is {variable.shape}")
  tf.raw_ops.AssignVariableOp(resource=variable.handle, value=value, validate_shape=False)


_STATE = threading.local()
_SEQ = itertools.count()
_MADE = []   # weak references to every DeferredVariable, in creation order


def _depth():
  return getattr(_STATE, "depth", 0)


def any_made():
  """True once a deferred variable made in this process still exists."""
  return any(ref() is not None for ref in _MADE)


def following(variables=None):
  """The scope in which tfsplit makes variables for a user's model (the
  optimizer slots it builds, or a step makes while traced): deferred when
  the model is. With `variables` (the model's): deferred_init() if one of
  them is deferred, else nothing. Without: while a function is traced,
  variables made after it read a deferred variable are deferred (a step's
  optimizer builds its slots after the forward pass read the weights)."""
  if variables is not None:
    deferred = any(record_of(getattr(v, "value", v)) is not None or
                   record_of(v) is not None for v in variables)
    return deferred_init() if deferred else contextlib.nullcontext()
  if not any_made():
    return contextlib.nullcontext()
  return _scope(conditional=True)


def _deferring():
  return not getattr(_STATE, "conditional", False) or getattr(_STATE, "seen", False)


def record_of(variable):
  """The Record of a deferred variable, or None for a variable with memory."""
  return getattr(variable, "tfsplit_record", None)


def _make(shape, dtype, name, record, trainable=True, **kwargs):
  if len(_MADE) > 1024 and len(_MADE) & (len(_MADE) - 1) == 0:
    _MADE[:] = [ref for ref in _MADE if ref() is not None]
  variable = DeferredVariable(record, shape=shape, dtype=dtype, name=name,
                              trainable=trainable, **kwargs)
  _MADE.append(weakref.ref(variable))
  return variable


def _constant_fill(value):
  """The scalar every element of numpy `value` equals, or None."""
  flat = value.reshape(-1)
  if flat.size == 0 or not np.all(flat == flat[0]):
    return None
  return flat[0]


def _creator(next_creator, **kwargs):
  """tf.Variable creator of the scope (see the module doc)."""
  if not _deferring():
    return next_creator(**kwargs)
  initial = kwargs.get("initial_value")
  shape, dtype = kwargs.get("shape"), kwargs.get("dtype")
  passed = {k: kwargs[k] for k in ("trainable", "constraint", "synchronization",
                                   "aggregation", "caching_device") if k in kwargs}
  name = kwargs.get("name")
  if callable(initial) and shape is not None and tf.TensorShape(shape).is_fully_defined() \
      and dtype is not None:
    return _make(tf.TensorShape(shape), tf.as_dtype(dtype), name,
                 Record(next(_SEQ), make=initial), **passed)
  if callable(initial) or initial is None:
    return next_creator(**kwargs)
  value = initial
  if isinstance(value, tf.Tensor) and hasattr(value, "numpy"):
    value = value.numpy()
  elif not isinstance(value, np.ndarray):
    return next_creator(**kwargs)
  if value.nbytes < _SMALL_BYTES:
    return next_creator(**kwargs)
  fill = _constant_fill(value)
  if fill is None:
    return next_creator(**kwargs)
  dtype = tf.as_dtype(dtype) if dtype is not None else tf.as_dtype(value.dtype)
  return _make(tf.TensorShape(value.shape), dtype, name,
               Record(next(_SEQ), fill=fill, ordered=False), **passed)


def _keras_record(initializer, shape, dtype):
  """The Record of a Keras 3 variable from its initializer: a fill for
  Zeros / Ones / a scalar Constant; an order-free make for a random
  initializer with an integer seed (Keras draws it statelessly)."""
  from keras import initializers  # pylint: disable=import-outside-toplevel
  make = lambda: initializer(shape, dtype=dtype)  # pylint: disable=unnecessary-lambda-assignment
  if isinstance(initializer, initializers.Zeros):
    return Record(next(_SEQ), fill=0, ordered=False)
  if isinstance(initializer, initializers.Ones):
    return Record(next(_SEQ), fill=1, ordered=False)
  if isinstance(initializer, initializers.Constant) and \
      np.ndim(getattr(initializer, "value", None)) == 0:
    return Record(next(_SEQ), fill=initializer.value, ordered=False)
  seeded = isinstance(getattr(initializer, "seed", None), int)
  return Record(next(_SEQ), make=make, ordered=not seeded)


def _keras_variable_class():
  """Keras 3's TensorFlow Variable class, when Keras 3 runs on TensorFlow."""
  try:
    import keras  # pylint: disable=import-outside-toplevel
    if not keras.__version__.startswith("3") or keras.backend.backend() != "tensorflow":
      return None
    from keras.src.backend.tensorflow import core  # pylint: disable=import-outside-toplevel
    return core.Variable
  except ImportError:
    return None


def _keras_initialize(self, initializer):
  """Keras 3 Variable._initialize_with_initializer inside the scope."""
  if not _deferring():
    return _KERAS_ORIGINAL[0](self, initializer)
  record = _keras_record(initializer, tuple(self._shape), self._dtype)  # pylint: disable=protected-access
  self._initialize(_make(  # pylint: disable=protected-access
      tf.TensorShape(self._shape), tf.as_dtype(self._dtype), self.name, record,  # pylint: disable=protected-access
      trainable=self.trainable))


_KERAS_ORIGINAL = [None]


def deferred_init():
  """Variables made inside hold no memory until a split makes their shards
  (see the module doc)."""
  return _scope(conditional=False)


@contextlib.contextmanager
def _scope(conditional):
  outermost = _depth() == 0
  keras_variable = _keras_variable_class() if outermost else None
  if keras_variable is not None:
    _KERAS_ORIGINAL[0] = keras_variable._initialize_with_initializer  # pylint: disable=protected-access
  if outermost:
    _STATE.conditional, _STATE.seen = conditional, False
  _STATE.depth = _depth() + 1
  try:
    if keras_variable is not None:
      keras_variable._initialize_with_initializer = _keras_initialize  # pylint: disable=protected-access
    with tf.variable_creator_scope(_creator):
      yield
  finally:
    _STATE.depth -= 1
    if outermost:
      _STATE.conditional, _STATE.seen = False, False
    if keras_variable is not None:
      keras_variable._initialize_with_initializer = _KERAS_ORIGINAL[0]  # pylint: disable=protected-access


def _value(variable, record):
  """The full numpy value of a variable (made from its record when deferred)."""
  if record is None:
    return variable.numpy()
  record.drawn = True
  value = record.make()
  return value.numpy() if hasattr(value, "numpy") else np.asarray(value)


def _draw_before(record):
  """Runs (and drops) every ordered initializer made before `record` that
  has not run yet, so `record`'s own runs where it would have."""
  for ref in list(_MADE):
    other = ref()
    earlier = record_of(other) if other is not None else None
    if earlier is None or earlier.seq >= record.seq:
      continue
    if earlier.ordered and not earlier.drawn and earlier.make is not None:
      _value(other, earlier)


def stream(manifest, variables, release=False):
  """Yields {shard name: numpy value}, one variable of `manifest` at a time,
  from `variables` ({name: tf.Variable}): a deferred variable's from its
  record, any other's from its current value. With release=True, a
  variable with memory (of _SMALL_BYTES or more) is emptied once its chunk
  was taken (its shards hold the values now); reading it again is an
  error, assigning fills it."""
  def order(name):
    record = record_of(variables[name])
    return (0, record.seq) if record is not None else (1, 0)
  for name in sorted(manifest, key=order):
    entry, variable = manifest[name], variables[name]
    record = record_of(variable)
    if record is not None and record.fill is not None:
      dtype = variable.dtype.as_numpy_dtype
      yield {s["name"]: np.full(s["shape"], record.fill, dtype) for s in entry["shards"]}
      continue
    if record is not None and record.ordered:
      _draw_before(record)
    chunk = shards_lib.shard_values({name: entry}, {name: _value(variable, record)})
    yield chunk
    if release and record is None:
      release_one(variable)

