"""What each mesh axis of a split really splits, and a split that does less
than its mesh asked: never silently.

    axis_splits(result)     one AxisSplit per mesh axis: the variables and
                            bytes a model axis (tp, ep) splits, the batch a
                            data axis splits, the stages of a pipeline axis
    shortfall(result)       one line when a model axis of size 2 or more
                            splits no variable, naming why (the strategy, an
                            op that fell back to replication, loops kept
                            whole, no weight contraction); None otherwise
    short_of(result, could) one line when the megatron preset's tp axis splits
                            less than half of the bytes its weight
                            contractions read (`could`, from the graph),
                            naming the largest weight left whole and why
    check(result)           that line as a warning, or (config.strict) as a
                            PlanError: the split refused
"""
import collections

import numpy as np
from absl import logging

from tfsplit import constants
from tfsplit.errors import PlanError
from tfsplit.layout.spec import axis_parts

AxisSplit = collections.namedtuple("AxisSplit", "axis size kind variables bytes "
                                                "total_variables total_bytes")
MODEL_AXES = (constants.TENSOR_AXIS, constants.EXPERT_AXIS)


def _bytes(entry):
  return int(np.prod(entry["shape"], dtype=np.int64)) * np.dtype(entry["dtype"]).itemsize


def axis_splits(result):
  """[AxisSplit] for every axis of the mesh asked for, in mesh order; kind is
  'weights' (variables split over it), 'batch' or 'stages'."""
  manifest = result.manifest
  total = sum(_bytes(e) for e in manifest.values())
  out = []
  for axis, size in result.config.mesh.axes.items():
    split = [e for e in manifest.values()
             if any(d and axis in axis_parts(d) for d in e["sharding"])]
    kind = ("stages" if axis == constants.PIPELINE_AXIS else
            "batch" if axis == constants.DATA_AXIS else "weights")
    out.append(AxisSplit(axis, size, kind, len(split), sum(_bytes(e) for e in split),
                         len(manifest), total))
  return out


def axis_line(result):
  """'  per axis: tp=2 splits 120 of 209 variables (3.1 of 4.2 MiB); ...'."""
  parts = []
  for a in axis_splits(result):
    what = f"{a.axis}={a.size} splits "
    if a.kind == "stages":
      what += f"the layers into {len(result.partition or ()) or a.size} model chunks"
    elif a.kind == "batch":
      what += "the batch" + (f" and {a.variables} variables "
                             f"({'weights and ' if result.config.zero >= 3 else ''}"
                             "optimizer state)" if a.variables else "")
    else:
      what += (f"{a.variables} of {a.total_variables} variables "
               f"({a.bytes / 2**20:.3g} of {a.total_bytes / 2**20:.3g} MiB)")
    parts.append(what)
  return "  per axis: " + "; ".join(parts)


def shortfall(result, loops=()):
  """One line naming a model axis of size 2+ that splits no variable and
  why, or None. `loops`: the names of loops kept whole."""
  config = result.config
  for a in axis_splits(result):
    if a.kind != "weights" or a.size < 2 or a.variables:
      continue
    annotated = any(a.axis in axis_parts(d) for dims in config.annotations.values()
                    for d in dims if d)
    if config.strategy != "megatron" and not annotated:
      why = f"strategy '{config.strategy}' and no annotation names {a.axis}"
    elif result.fallbacks:
      why = _fallbacks(result)
    elif loops:
      why = (f"no weight contraction outside the loops kept whole ("
             + ", ".join(f"'{l}'" for l in loops[:3]) + ")")
    else:
      why = ("the megatron preset found no weight contraction (a MatMul, BatchMatMul or "
             "Einsum reading a trainable variable of rank 2 or more)")
    return (f"mesh axis {a.axis}={a.size} splits no variable of {a.total_variables} "
            f"({a.total_bytes / 2**20:.3g} MiB): {why}; every device holds every weight")
  return None


def _fallbacks(result):
  """Why a split did less: its fallbacks to replication, the first named."""
  first = result.fallbacks[0]
  return (f"{len(result.fallbacks)} op(s) fell back to replication, first node "
          f"'{first.node}' (op {first.op}): {first.reason}")


# Below this share of the bytes its weight contractions read, a tp axis
# "splits much less than it could".
MUCH_LESS = 0.5


def short_of(result, could, loops=()):
  """One line when the megatron preset's tp axis (2+) splits some variables
  but under MUCH_LESS of the bytes its weight contractions could split, or
  None. could: {variable name: 'table' (an embedding table, which
  split_embeddings splits) or 'weight' (a weight contraction's operand)}."""
  config, manifest = result.config, result.manifest
  axis = constants.TENSOR_AXIS
  size = config.mesh.axes.get(axis, 1)
  if size < 2 or config.strategy != "megatron" or not could:
    return None
  entries = {n: manifest[n] for n in could if n in manifest}
  split = {n for n, e in entries.items() if any(d and axis in axis_parts(d)
                                               for d in e["sharding"])}
  total = sum(_bytes(e) for e in entries.values())
  done = sum(_bytes(entries[n]) for n in split)
  if not split or not total or done >= MUCH_LESS * total:
    return None
  largest = max((n for n in entries if n not in split), key=lambda n: _bytes(entries[n]))
  if could[largest] == "table" and not config.split_embeddings:
    why = "an embedding table: split_embeddings=True (--split-embeddings) splits it"
  elif could[largest] == "table":
    why = ("an embedding table split_embeddings leaves whole (its rows are updated "
           "sparsely, cast to a 16-bit type, or its width does not divide)")
  elif result.fallbacks:
    why = _fallbacks(result)
  elif loops:
    why = "loops kept whole (" + ", ".join(f"'{l}'" for l in loops[:3]) + ")"
  else:
    why = "the megatron preset pairs no contraction with it"
  return (f"mesh axis {axis}={size} splits {done / 2**20:.3g} of the {total / 2**20:.3g} "
          f"MiB its weight contractions read ({100.0 * done / total:.0f}%): the largest "
          f"left whole, '{largest}' ({_bytes(entries[largest]) / 2**20:.3g} MiB), is "
          f"{why}; every device holds it")


def check(result, loops=(), could=None):
  """Warns in one line when the split does less than the mesh asked; with
  config.strict, refuses it (PlanError) instead."""
  line = shortfall(result, loops) or short_of(result, could or {}, loops)
  if line is None:
    return
  if result.config.strict:
    raise PlanError(f"{line}; annotate the weights to split (--annotate), drop the axis, "
                    "or leave strict off to split anyway")
  logging.warning("%s (strict=True / --strict makes this an error)", line)
