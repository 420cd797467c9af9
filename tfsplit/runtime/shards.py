"""Moving variable values between full tensors and per-device shards.

The manifest written by the splitting pass records, for each original
variable, its global shape and, per device, the shard's name, device,
offsets and shape. These helpers use it to create shard variables from full
values (or a checkpoint), and to put full values back together.
"""

import numpy as np
import tensorflow as tf

from tfsplit.errors import DivergedCopiesError, TfsplitError
from tfsplit.graph.ir import without_gc
from tfsplit.runtime import compare as compare_lib


def _slices(shard):
  return tuple(slice(o, o + s) for o, s in zip(shard["offsets"], shard["shape"]))


def shard_values(manifest, full_values):
  """{shard name: numpy value} from {variable name: full numpy value}."""
  out = {}
  for name, entry in manifest.items():
    if name not in full_values:
      raise TfsplitError(f"no value for variable '{name}'; give every variable the "
                         "graph uses")
    value = np.asarray(full_values[name])
    if list(value.shape) != list(entry["shape"]):
      raise TfsplitError(f"variable '{name}': value has shape {list(value.shape)}, the "
                         f"graph expects {entry['shape']}")
    for shard in entry["shards"]:
      out[shard["name"]] = value[_slices(shard)]
  return out


def full_values(manifest, shard_values_by_name, rtol=compare_lib.DEFAULT_RTOL):
  """{variable name: full numpy value} assembled from shard values.

  Every copy of a block (data-parallel replicas, tensor-parallel replicated
  variables) must agree with the first within `rtol` of the block's scale;
  a divergent copy raises DivergedCopiesError naming the variable and devices.
  """
  out = {}
  for name, entry in manifest.items():
    first = np.asarray(shard_values_by_name[entry["shards"][0]["name"]])
    full = np.zeros(entry["shape"], first.dtype)
    blocks = {}
    for shard in entry["shards"]:
      value = np.asarray(shard_values_by_name[shard["name"]])
      blocks.setdefault(tuple(shard["offsets"]), []).append((shard["device"], value))
      full[_slices(shard)] = value
    for copies in blocks.values():
      for c in compare_lib.compare_copies(name, copies, rtol):
        if not c.ok:
          raise DivergedCopiesError(
              f"variable '{c.what}': the copies differ by {c.max_abs:.3e} "
              f"({c.rel:.3e} of its scale{', ' + c.note if c.note else ''}); the split "
              "graph does not keep its replicas in step, which is a tfsplit bug: please "
              "report it with the graph and mesh")
    out[name] = full
  return out


_SHARD_VARIABLE_NAME = "tfsplit_shard"


def create_shard_variables(manifest, full_values_by_name):
  """{shard name: tf.Variable on its device} initialised from full values."""
  return create_variables(manifest, shard_values(manifest, full_values_by_name))


@without_gc
def create_variables(manifest, values):
  """{shard name: tf.Variable on its device} initialised from `values`
  ({shard name: value} for every shard of `manifest`, or an iterable of
  such chunks, each made into variables before the next is taken)."""
  device_of = {s["name"]: s["device"] for e in manifest.values() for s in e["shards"]}
  made = {}
  # One name for all: an eager variable's name is its VarHandleOp's debug_name
  # attr, part of TF's kernel cache key, so a name per shard would build a
  # kernel per shard (0.4 ms each, most of a first split's variable time).
  # The shards are told apart by their key in the dict returned.
  for chunk in [values] if isinstance(values, dict) else values:
    for name, value in chunk.items():
      with tf.device(device_of[name]):
        made[name] = tf.Variable(value, name=_SHARD_VARIABLE_NAME)
  missing = sorted(set(device_of) - set(made))
  if missing:
    raise TfsplitError(f"no value for shard '{missing[0]}'")
  return {name: made[name] for name in device_of}


def check_same_layout(manifest, other):
  """Raises PlanError unless every shard of `manifest` is a shard of manifest
  `other` (another split of the same model) with the same device, offsets and
  shape: a forward-only step may read a subset of a training step's."""
  from tfsplit.errors import PlanError  # pylint: disable=import-outside-toplevel
  theirs = {s["name"]: s for e in other.values() for s in e["shards"]}
  for name, entry in manifest.items():
    for shard in entry["shards"]:
      their = theirs.get(shard["name"])
      if their is None or any(their[k] != shard[k] for k in ("device", "offsets", "shape")):
        def where(s):
          return f"shape {list(s['shape'])} at {list(s['offsets'])} on {s['device']}"
        there = where(their) if their is not None else "no such shard"
        raise PlanError(
            f"variable '{name}' would be split another way by this step than by the step "
            f"whose shards it shares (shard '{shard['name']}': {where(shard)} here, {there} "
            f"there; sharding {list(entry['sharding'])} here, "
            f"{list(other[name]['sharding']) if name in other else 'none'} there); give "
            "every call the input shapes of the first one, or pin the variable's split with "
            "annotations")


def full_values_from_checkpoint(path, names):
  """{name: value} read from a TF checkpoint (keys as saved by tf.train.Checkpoint
  or Keras: the variable name or object path)."""
  try:
    reader = tf.train.load_checkpoint(path)
  except (tf.errors.NotFoundError, tf.errors.DataLossError, ValueError) as e:
    raise TfsplitError(f"{path}: cannot read the checkpoint "
                       f"({str(e).splitlines()[0][:200]})") from None
  keys = reader.get_variable_to_shape_map()
  out = {}
  for name in names:
    candidates = [k for k in keys if k == name or k.startswith(name + "/.ATTRIBUTES")
                  or k.endswith("/" + name + "/.ATTRIBUTES/VARIABLE_VALUE")]
    if not candidates:
      raise TfsplitError(f"checkpoint {path} has no variable '{name}'")
    out[name] = reader.get_tensor(candidates[0])
  return out
