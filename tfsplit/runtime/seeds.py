"""Seeded values: the variables and inputs a check or a trace runs on.

One generator for `verify`, `trace`, the Session runner and the tests, so a
value means the same thing everywhere.
"""
import numpy as np
import tensorflow as tf

from tfsplit.errors import TfsplitError
from tfsplit.graph import find_variables
from tfsplit.runtime import shards as shards_lib
from tfsplit.graph.endpoints import graph_inputs

_GATHERS = ("ResourceGather", "GatherV2", "Gather")


def seeded_variable_values(graph, seed=0):
  """{variable name: value} that make every part of a step matter.

  Weight matrices ~ N(0, 0.1); vectors (LayerNorm scales and shifts, biases)
  ~ 1 + N(0, 0.1), so normalised activations are not squashed to zero and
  attention is far from uniform; other state (optimizer slots, learning rate)
  ~ U(0, 1e-3), small enough that the gradient decides each update instead of
  the seeded moments; integers 0. A loss scale (a float scalar named like
  Keras's `dynamic_scale` or tf_keras's `current_loss_scale`) is 2**10, the
  scale a float16 step starts near: a scale of 1e-3 would flush the
  float16 gradients it scales to zero.
  """
  rng = np.random.RandomState(seed)
  values = {}
  for var in find_variables(graph):
    if var.shape is None or not var.dtype:
      raise TfsplitError(f"variable '{var.name}' (node '{var.node}') has no known shape "
                         "or dtype; cannot make values for it")
    dtype = tf.as_dtype(var.dtype)
    if is_loss_scale(var.name, var.shape, dtype):
      values[var.name] = np.full(var.shape, LOSS_SCALE, dtype.as_numpy_dtype)
      continue
    values[var.name] = _value(rng, var.shape, dtype, var.trainable)
  return values


LOSS_SCALE = 2.0 ** 10
_LOSS_SCALE_NAMES = ("dynamic_scale", "loss_scale")


def is_loss_scale(name, shape, dtype):
  """Whether a variable holds a mixed-precision loss scale."""
  last = name.rsplit("/", 1)[-1]
  return dtype.is_floating and not list(shape) and last.endswith(_LOSS_SCALE_NAMES)


def seeded_manifest_values(manifest, seed=0):
  """{shard name: value}: shards of seeded full values for a manifest's
  variables (same distributions as seeded_variable_values)."""
  rng = np.random.RandomState(seed)
  full = {}
  for name, entry in sorted(manifest.items()):
    dtype = tf.as_dtype(entry["dtype"] if entry["dtype"] != "unknown" else "float32")
    if is_loss_scale(name, entry["shape"], dtype):
      full[name] = np.full(entry["shape"], LOSS_SCALE, dtype.as_numpy_dtype)
      continue
    full[name] = _value(rng, entry["shape"], dtype, entry.get("trainable"))
  return shards_lib.shard_values(manifest, full)


def _value(rng, shape, dtype, trainable):
  shape = list(shape)
  if dtype.is_integer or dtype == tf.bool:
    return np.zeros(shape, dtype.as_numpy_dtype)
  if trainable is False:
    return rng.uniform(0, 1e-3, shape).astype(dtype.as_numpy_dtype)
  if len(shape) <= 1:
    # randn() of no shape is a Python float: asarray keeps scalars arrays.
    return np.asarray(1 + rng.randn(*shape) * 0.1).astype(dtype.as_numpy_dtype)
  return (rng.randn(*shape) * 0.1).astype(dtype.as_numpy_dtype)


def _int_bound(graph):
  """Ids must index every table they reach; use the smallest gather table."""
  bounds = []
  from tfsplit.graph.shapes import infer_shapes  # pylint: disable=import-outside-toplevel
  shapes = infer_shapes(graph)
  for node in graph.nodes:
    if node.op in _GATHERS:
      info = shapes.get(node.input[0])
      if node.op == "ResourceGather":
        var = next((v for v in find_variables(graph) if v.node == node.input[0]), None)
        if var is not None and var.shape:
          bounds.append(var.shape[0])
      elif info is not None and info.shape and info.shape[0]:
        bounds.append(info.shape[0])
  return min(bounds) if bounds else 8


def seeded_inputs(graph, seed=0, int_max=None):
  rng = np.random.RandomState(seed + 1000)
  int_max = int_max or _int_bound(graph)
  out = []
  for name in graph_inputs(graph):
    node = graph.node(name)
    dtype = tf.as_dtype(node.attr["dtype"].type)
    shape = tf.TensorShape(node.attr["shape"].shape)
    if not shape.is_fully_defined():
      raise TfsplitError(f"input '{name}' has shape {shape}; verification needs static "
                         "input shapes")
    if dtype.is_integer:
      out.append(rng.randint(0, int_max, shape.as_list()).astype(dtype.as_numpy_dtype))
    else:
      out.append(rng.randn(*shape.as_list()).astype(dtype.as_numpy_dtype))
  return out
