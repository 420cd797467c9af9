"""The shard manifest: one schema, written by `rewrite`, read by `verify`,
`trace` and `tfsplit.split`.

    {"mesh": {"dp": 2, "tp": 2},          # the axes asked for
     "devices": [...],                    # one device name per mesh position
     "microbatches": 2, "schedule": "1f1b" | null, "stages": [[layer, ...], ...] | null,
     "virtual_stages": 1,                 # model chunks per stage; "stages" lists
                                          # the layers of each chunk (chunk c on stage c % S)
     "source": "/abs/path/in.pb" | null,
     "zero": 0 | 1 | 2,                   # optimizer-state sharding stage over dp
     "offload": null | "optimizer",       # CPU offload (memory/offload.py)
     "sequence_parallel": false | true,   # strategies/sequence_parallel.py
     "gradient_reduce": null | {"dtype": "bfloat16", "tensors": [...]},
                                          # float32 gradients (original tensors)
                                          # reduced over dp in a lower dtype
     "variables": {name: {"dtype", "shape", "sharding", "shards": [
         {"name", "device", "device_id", "offsets", "shape"}],
         # with zero: an optimizer slot names its weight, and one kept
         # whole over dp says why (sharding/zero.py)
         "optimizer_slot_of": weight, "zero_kept": why}},
         # with offload: a slot's shard lives on its device's host
         # ("device") and names the mesh device it serves ("offloaded_from")
     "outputs": {output: [[device, local tensor], ...]},   # every whole copy
     "experts": {weight: experts},        # expert weights split over 'ep' (their
                                          # slots follow them), experts stacked in each
     "config": {option: value}}           # every SplitConfig option of the split

Each shard says which block of its variable it holds (offsets, shape) on
which device; an optimizer slot split over dp is one block per replica, and
checkpoint conversion (runtime/shards.py) puts the blocks back together.
"""
import json
import os

import numpy as np

from tfsplit.errors import TfsplitError
from tfsplit.fileio import write_atomically

SUFFIX = ".manifest.json"


def manifest_path(graph_path):
  """Where the manifest of a rewritten graph lives: beside it."""
  base, _ = os.path.splitext(graph_path)
  return base + SUFFIX


def build(result, source=None):
  """The manifest dict of a SplitResult."""
  config = result.config
  return {"mesh": dict(config.mesh.axes), "devices": list(config.mesh.devices),
          "microbatches": int(config.microbatches),
          "schedule": config.schedule if config.stages > 1 else None,
          "stages": result.partition,
          "virtual_stages": int(config.virtual_stages),
          "zero": int(getattr(config, "zero", 0)),
          "offload": getattr(config, "offload", None),
          "sequence_parallel": bool(getattr(config, "sequence_parallel", False)),
          "gradient_reduce": gradient_reduce(result),
          "source": os.path.abspath(source) if source else None,
          "variables": result.manifest, "outputs": result.output_copies,
          "experts": {e.variable: e.experts for e in getattr(result, "experts", ())},
          "config": config.to_json()}


def bytes_per_device(variables, names=None):
  """{device id: bytes of the variables' shards it holds} from a manifest's
  "variables" (only those in `names`, if given)."""
  held = {}
  for name, entry in variables.items():
    if names is not None and name not in names:
      continue
    size = np.dtype(entry["dtype"]).itemsize
    for shard in entry["shards"]:
      d = shard["device_id"]
      held[d] = held.get(d, 0) + int(np.prod(shard["shape"], dtype=np.int64)) * size
  return held


def gradient_reduce(result):
  """{'dtype', 'tensors'}: the original gradient tensors a SplitResult
  reduces over the data axis in config.gradient_reduce_dtype, or None."""
  dtype = getattr(result.config, "gradient_reduce_dtype", None)
  if not dtype:
    return None
  from tensorflow.python.framework import dtypes  # pylint: disable=import-outside-toplevel
  enum = dtypes.as_dtype(dtype).as_datatype_enum
  tensors = sorted({c.tensor for c in result.collectives
                    if c.kind in ("all_reduce", "reduce_scatter") and c.dtype == enum})
  return {"dtype": dtype, "tensors": tensors}


def dumps(manifest):
  return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


def write(path, manifest):
  write_atomically(path, dumps(manifest))


def read(path):
  """The whole manifest file (a bare {variable: entry} mapping is accepted)."""
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError) as e:
    raise TfsplitError(f"{path}: cannot read the shard manifest ({e})") from None
  if not isinstance(data, dict) or not isinstance(data.get("variables", data), dict):
    raise TfsplitError(f"{path}: not a shard manifest (no 'variables' mapping); give the "
                       "'.manifest.json' written by tfsplit rewrite")
  if "variables" not in data:
    data = {"variables": data}
  return data


def find(graph_path, explicit=None):
  """The manifest for a rewritten graph: `explicit`, else the one beside it, else None."""
  if explicit:
    return read(explicit)
  candidate = manifest_path(graph_path)
  return read(candidate) if os.path.exists(candidate) else None
