"""Keras 3's distribution API (`keras.distribution`) on TensorFlow, run by
tfsplit: a `ModelParallel` or `DataParallel` becomes a mesh, annotations
and options of a split.

    mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"),
                                         keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense.*kernel"] = (None, "model")
    layout_map[".*dense.*bias"] = ("model",)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map,
                                                    batch_dim_name="batch")
    split_model = tfsplit.keras.split(model, distribution=distribution)
    # or, for a tf.function over a Keras 3 model's variables:
    step = tfsplit.split(train_step, distribution=distribution)

What maps to what:
- the device mesh's batch axis (`batch_dim_name`; the first axis when it is
  unset, as Keras takes it) is tfsplit's data-parallel axis `dp`; the one
  other axis of size 2 or more is `tp` (a mesh with two such model axes is
  refused in one line);
- each variable's layout is the layout map's by Keras's own rules (an exact
  key, then every key as a regular expression `re.fullmatch`ed against
  `variable.path`; two matching keys are Keras's error), its model axis
  `tp` on that dimension, as `annotations=` gives it;
- the batch axis on a weight's dimension (how layout maps published for
  Gemma- and Llama-style models shard weights over data parallelism too)
  is fully sharded data parallelism: `zero=3` (every weight and its slots
  split over dp, gathered just before use), which picks each weight's
  dimension itself: the bytes per device are the layout's;
- variables no key matches stay replicated, unless `strategy="megatron"` is
  asked: its preset then splits them over `tp`; a line says which;
- `DataParallel` is `mesh="dp=N"`.
Pipeline stages, micro-batches, recomputation and offload stay tfsplit's
keywords beside `distribution=`.
"""
import math
import re

from absl import logging

from tfsplit import constants
from tfsplit.errors import PlanError


def _glob(path):
  """A glob matching exactly `path` (annotations' keys are globs)."""
  return "".join(f"[{c}]" if c in "*?[]" else c for c in path)


class KerasDistribution(object):
  """A keras.distribution.Distribution read as tfsplit's mesh and options.

  mesh: the mesh string; zero: 3 when a layout puts the batch axis on a
  variable, else None; annotations(variables) gives the layout map's
  shardings of the model's variables, once they exist."""

  def __init__(self, distribution):
    import keras  # pylint: disable=import-outside-toplevel
    kd = keras.distribution
    if not isinstance(distribution, (kd.ModelParallel, kd.DataParallel)):
      raise PlanError(f"distribution must be a keras.distribution.ModelParallel or "
                      f"DataParallel, got {type(distribution).__name__}")
    self.distribution = distribution
    mesh = distribution.device_mesh
    axes, shape = list(mesh.axis_names), [int(n) for n in mesh.shape]
    batch = distribution.batch_dim_name or axes[0]
    if batch not in axes:
      raise PlanError(f"batch_dim_name '{batch}' is not an axis of the device mesh "
                      f"{tuple(axes)}; name one of them")
    self.batch = batch
    self.size_of = dict(zip(axes, shape))
    model = [(a, n) for a, n in zip(axes, shape) if a != batch]
    wide = [a for a, n in model if n > 1]
    if len(wide) > 1:
      raise PlanError(f"the device mesh {dict(zip(axes, shape))} has {len(wide)} model axes "
                      f"of size 2 or more ({', '.join(wide)}); tfsplit maps one to tensor "
                      "parallelism (tp): merge them into one axis, or give pipeline stages "
                      "with pp= beside the distribution")
    self.axis_of = {batch: constants.DATA_AXIS}
    self.axis_of.update({a: constants.TENSOR_AXIS if n > 1 else None for a, n in model})
    dp, tp = shape[axes.index(batch)], math.prod(n for _, n in model)
    self.mesh = ",".join(f"{a}={n}" for a, n in ((constants.DATA_AXIS, dp),
                                                  (constants.TENSOR_AXIS, tp)) if n > 1) \
        or f"{constants.DATA_AXIS}=1"
    self.layout_map = getattr(distribution, "_layout_map", None) \
        if isinstance(distribution, kd.ModelParallel) else None
    self.zero = 3 if self.layout_map is not None and dp > 1 and any(
        batch in (getattr(layout, "axes", layout) or ())
        for layout in self.layout_map.values()) else None

  def annotations(self, variables, strategy, quiet=False):
    """{glob: dims} of each variable of `variables` ([(variable, path)]) the
    layout map has a layout for; logs one line saying what it splits and
    what stays replicated (or is left to `strategy`), unless `quiet`."""
    if self.layout_map is None:
      return {}
    out, split, unmatched = {}, [], []
    used = set()
    for var, path in variables:
      try:
        layout = self.layout_map[path]
      except ValueError as e:    # two keys match: Keras's own error
        raise PlanError(str(e).replace("\n", " ")) from None
      if layout is None:
        unmatched.append(path)
        continue
      used.update(k for k in self.layout_map if k == path or _fullmatch(k, path))
      dims = self._dims(path, tuple(getattr(layout, "axes", layout)), var.shape)
      out[_glob(path)] = dims
      if any(dims):
        split.append(path)
    if quiet:
      return out
    for key in self.layout_map:
      if key not in used:
        logging.warning("keras distribution: layout map key '%s' matches no variable of the "
                        "model (keys are re.fullmatch'ed against variable.path, e.g. '%s')",
                        key, variables[0][1] if variables else "model/dense/kernel")
    rest = ("are left to the megatron strategy" if strategy == "megatron" else
            "stay whole over tp (strategy='megatron' would split them)")
    if self.zero:
      rest += "; zero=3 splits every weight over dp"
    logging.warning("keras distribution: mesh %s as %s; the layout map splits %d of %d "
                    "variables over tp%s; %d match no key and %s", self.mesh_text(),
                    self.mesh, len(split), len(variables),
                    " and every weight over dp (zero=3)" if self.zero else "",
                    len(unmatched), rest)
    return out

  def mesh_text(self):
    return ", ".join(f"{a}={n}" for a, n in self.size_of.items())

  def _dims(self, path, axes, shape):
    """tfsplit dims of a layout's `axes` for the variable at `path`: its model
    axis is tp; the batch axis and axes of size 1 leave the dimension to
    zero=3 or whole."""
    if len(axes) != len(shape):
      raise PlanError(f"layout {axes} for variable '{path}' has {len(axes)} dimensions, "
                      f"the variable {len(shape)} (shape {list(shape)}); give one axis or "
                      "None per dimension")
    dims = []
    for axis, size in zip(axes, shape):
      if axis is None:
        dims.append(None)
        continue
      if not isinstance(axis, str) or axis not in self.axis_of:
        raise PlanError(f"layout {axes} for variable '{path}' names {axis!r}, not an axis of "
                        f"the device mesh ({', '.join(self.axis_of)}); use one of those or "
                        "None")
      ours = self.axis_of[axis]
      if ours == constants.TENSOR_AXIS:
        n = self.size_of[axis]
        if size is not None and size % n:
          raise PlanError(f"layout {axes} for variable '{path}' splits dimension "
                          f"{len(dims)} (size {size}) over '{axis}' of size {n}, which does "
                          "not divide it; use a layout that splits a dimension it divides")
        dims.append(ours)
      else:
        dims.append(None)   # over the batch axis: zero=3 places it; size 1: whole
    return tuple(dims)


def _fullmatch(pattern, path):
  try:
    return re.fullmatch(pattern, path) is not None
  except re.error:
    return False


def global_distribution():
  """The distribution keras.distribution.set_distribution set, or None."""
  try:
    import keras  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  return keras.distribution.distribution()

