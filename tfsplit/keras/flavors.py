"""What differs between Keras 3 and tf_keras for a split training step.

Everything else in tfsplit.keras is written once against the Keras API both
share (compile, fit, compute_loss, compute_metrics, callbacks).
"""
import tensorflow as tf

from tfsplit.runtime import deferred as deferred_lib


def _strip_port(name):
  return name[:-2] if name.endswith(":0") else name


class Keras3(object):
  """Keras 3 on the TensorFlow backend."""
  name = "Keras 3"

  def __init__(self):
    import keras  # pylint: disable=import-outside-toplevel
    self.module = keras

  @staticmethod
  def tf_variable(var):
    """The tf.Variable behind a Keras 3 variable."""
    inner = getattr(var, "value", None)
    return inner if isinstance(inner, tf.Variable) else var

  @staticmethod
  def variable_name(var):
    return var.path

  @staticmethod
  def build_optimizer(model):
    if not model.optimizer.built:
      with deferred_lib.following(model.trainable_variables):
        model.optimizer.build(model.trainable_variables)

  @staticmethod
  def optimizer_variables(optimizer):
    return list(optimizer.variables)

  @staticmethod
  def train(model, x, y, sample_weight):
    """(loss as logged, predictions) of one training step, applied."""
    with tf.GradientTape() as tape:
      y_pred = model(x, training=True)
      loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                training=True)
      scaled = model.optimizer.scale_loss(loss)
    variables = model.trainable_variables
    gradients = tape.gradient(scaled, variables)
    model.optimizer.apply_gradients(zip(gradients, variables))
    return loss, y_pred

  @staticmethod
  def test(model, x, y, sample_weight):
    """(loss, predictions) of one evaluation step."""
    y_pred = model(x, training=False)
    return model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                              training=False), y_pred

  @staticmethod
  def steps_per_execution(model):
    return int(model.steps_per_execution or 1)

  @staticmethod
  def count_execution(model):
    del model  # Keras 3 counts steps in its loop


class TfKeras(object):
  """tf_keras (Keras 2) models."""
  name = "tf_keras"

  def __init__(self):
    import tf_keras  # pylint: disable=import-outside-toplevel
    self.module = tf_keras

  @staticmethod
  def tf_variable(var):
    return var

  @staticmethod
  def variable_name(var):
    return _strip_port(var.name)

  @staticmethod
  def build_optimizer(model):
    # The slots must exist before the step is traced (build() returns at once
    # when they do); legacy optimizers create theirs in the trace.
    if hasattr(model.optimizer, "build") and not getattr(model.optimizer, "_built", False):
      with deferred_lib.following(model.trainable_variables):
        model.optimizer.build(model.trainable_variables)

  @staticmethod
  def optimizer_variables(optimizer):
    variables = optimizer.variables
    variables = list(variables() if callable(variables) else variables)
    # The learning rate is a variable the step reads but variables() leaves out.
    rate = getattr(optimizer, "_learning_rate", None)
    if isinstance(rate, tf.Variable) and all(rate is not v for v in variables):
      variables.append(rate)
    return variables

  @staticmethod
  def train(model, x, y, sample_weight):
    with tf.GradientTape() as tape:
      y_pred = model(x, training=True)
      loss = model.compute_loss(x, y, y_pred, sample_weight)
    model.optimizer.minimize(loss, model.trainable_variables, tape=tape)
    return loss, y_pred

  @staticmethod
  def test(model, x, y, sample_weight):
    y_pred = model(x, training=False)
    return model.compute_loss(x, y, y_pred, sample_weight), y_pred

  @staticmethod
  def steps_per_execution(model):
    value = model.steps_per_execution
    return int(value.numpy()) if hasattr(value, "numpy") else int(value or 1)

  @staticmethod
  def count_execution(model):
    # tf_keras' own train function counts executions; TensorBoard reads it.
    counter = getattr(model, "_train_counter", None)
    if counter is not None:
      counter.assign_add(1)


def wants_predictions(model):
  """Whether compile() named metrics, which need the step's predictions (an
  LM's logits are worth not gathering every step when nothing reads them).
  A compile config Keras cannot serialize counts as yes."""
  try:
    config = model.get_compile_config() or {}
  except Exception:  # pylint: disable=broad-except
    return True
  return bool(config.get("metrics") or config.get("weighted_metrics"))


def flavor_of(model):
  """Keras3() or TfKeras() for a model; TypeError for anything else."""
  module = type(model).__module__ or ""
  for cls in type(model).__mro__:
    root = (cls.__module__ or "").split(".")[0]
    if root == "keras" and cls.__name__ == "Model":
      return Keras3()
    if root == "tf_keras" and cls.__name__ == "Model":
      return TfKeras()
  raise TypeError(f"tfsplit.keras.split needs a keras.Model or tf_keras.Model, got "
                  f"{type(model).__name__} (from {module})")


def compile_arguments(model, args, kwargs):
  """The arguments a model's own compile() resolves `args`/`kwargs` to, when
  its class overrides compile (a task model adding its default loss or
  metrics): it compiles itself, and Keras (both flavors) keeps what reached
  its base compile in `_compile_config.config`. None when the class does
  not override compile or Keras kept nothing: compile as given."""
  base = type(model).__mro__
  flavor = flavor_of(model)
  if type(model).compile is flavor.module.Model.compile or flavor.module.Model not in base:
    return None
  model.compile(*args, **kwargs)
  kept = getattr(getattr(model, "_compile_config", None), "config", None)
  return dict(kept) if isinstance(kept, dict) else None
