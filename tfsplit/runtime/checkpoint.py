"""Checkpoints of a split step: one file per device's shards plus the manifest.

    DIR/checkpoint                 {"latest": "ckpt-00000003"} (written last)
    DIR/ckpt-00000003/manifest.json  the shard manifest, mesh, devices, step,
                                     and which file holds which shard
    DIR/ckpt-00000003/shards-<device>.npz   that device's shards

A checkpoint is written into a temporary directory beside its final name,
fsynced and renamed into place, and only then named in DIR/checkpoint
(atomically): a crash at any moment leaves the previous checkpoint the
latest, complete one. Restoring into a step split over another mesh goes
through full values (the saved manifest assembles them, the new one cuts
them); a checkpoint of other variables is refused in one line.
"""
import json
import os
import re
import shutil
import tempfile

import numpy as np

from tfsplit.errors import TfsplitError
from tfsplit.fileio import write_atomically

POINTER = "checkpoint"
MANIFEST = "manifest.json"
FORMAT = 1


class CheckpointError(TfsplitError):
  """A checkpoint that is missing, incomplete or does not fit the step."""


def _device_file(device):
  return "shards-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", device.strip("/")) + ".npz"


def _fsync_dir(path):
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def save(directory, manifest, shard_values, step, mesh=None, keep=2):
  """Writes a checkpoint of `shard_values` ({shard name: value}) described by
  `manifest` ({variable: entry}) as DIR/ckpt-<step>; returns its path.
  mesh: {'axes': {...}, 'devices': [...]} to record; keep: how many of the
  latest checkpoints to keep (older ones are removed; 0 keeps all)."""
  os.makedirs(directory, exist_ok=True)
  name = f"ckpt-{int(step):08d}"
  final = os.path.join(directory, name)
  tmp = tempfile.mkdtemp(prefix=f".{name}.", dir=directory)
  try:
    by_device, files = {}, {}
    for entry in manifest.values():
      for shard in entry["shards"]:
        by_device.setdefault(shard["device"], []).append(shard["name"])
    for device, names in sorted(by_device.items()):
      fname = _device_file(device)
      arrays = {f"s{i}": np.asarray(shard_values[n]) for i, n in enumerate(names)}
      with open(os.path.join(tmp, fname), "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
      for i, n in enumerate(names):
        files[n] = [fname, f"s{i}"]
    meta = {"format": FORMAT, "step": int(step), "mesh": mesh, "variables": manifest,
            "files": files}
    with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
      json.dump(meta, f, sort_keys=True)
      f.flush()
      os.fsync(f.fileno())
    _fsync_dir(tmp)
    if os.path.exists(final):
      shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(directory)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  write_atomically(os.path.join(directory, POINTER), json.dumps({"latest": name}) + "\n")
  if keep:
    done = sorted(d for d in os.listdir(directory)
                  if d.startswith("ckpt-") and os.path.isdir(os.path.join(directory, d)))
    for old in done[:-keep]:
      if old != name:
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)
  return final


def latest(directory):
  """Path of the latest complete checkpoint in `directory`, or None."""
  try:
    with open(os.path.join(directory, POINTER), encoding="utf-8") as f:
      name = json.load(f)["latest"]
  except (OSError, ValueError, KeyError, TypeError):
    return None
  path = os.path.join(directory, name)
  return path if os.path.exists(os.path.join(path, MANIFEST)) else None


def load(path):
  """(meta, {shard name: value}) of the checkpoint at `path` (a ckpt-*
  directory, or a directory whose latest checkpoint is taken)."""
  if not os.path.exists(os.path.join(path, MANIFEST)):
    found = latest(path)
    if found is None:
      raise CheckpointError(f"no checkpoint in '{path}' (no {POINTER} file naming a "
                            "complete checkpoint)")
    path = found
  try:
    with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
      meta = json.load(f)
    values, opened = {}, {}
    for shard, (fname, key) in meta["files"].items():
      if fname not in opened:
        with np.load(os.path.join(path, fname)) as data:
          opened[fname] = {k: data[k] for k in data.files}
      values[shard] = opened[fname][key]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"checkpoint '{path}' cannot be read ({type(e).__name__}: "
                          f"{e}); it is incomplete or not a tfsplit checkpoint") from None
  return meta, values


def _layout(manifest):
  return {name: (list(entry["shape"]), sorted((s["name"], tuple(s["offsets"]),
                                               tuple(s["shape"])) for s in entry["shards"]))
          for name, entry in manifest.items()}


def convert(meta, saved_values, manifest):
  """{shard name: value} for a step described by `manifest`, from a loaded
  checkpoint: the same shards directly, another mesh's through full values.
  Raises CheckpointError (one line) if the variables do not match."""
  from tfsplit.runtime import shards as shards_lib  # pylint: disable=import-outside-toplevel
  saved = meta["variables"]
  if set(saved) != set(manifest):
    missing = sorted(set(manifest) - set(saved))
    extra = sorted(set(saved) - set(manifest))
    raise CheckpointError(
        "the checkpoint holds other variables than the step ("
        + (f"missing: {', '.join(missing[:3])}" if missing else "")
        + ("; " if missing and extra else "")
        + (f"not in the step: {', '.join(extra[:3])}" if extra else "") + ")")
  for name, entry in manifest.items():
    if list(saved[name]["shape"]) != list(entry["shape"]):
      raise CheckpointError(f"variable '{name}' has shape {saved[name]['shape']} in the "
                            f"checkpoint but {entry['shape']} in the step")
  if _layout(saved) == _layout(manifest):
    return {s["name"]: saved_values[s["name"]] for e in manifest.values()
            for s in e["shards"]}
  full = shards_lib.full_values(saved, saved_values)
  return shards_lib.shard_values(manifest, full)
