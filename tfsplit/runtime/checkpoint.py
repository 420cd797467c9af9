"""Checkpoints of a split step: one file per device's shards plus the manifest.

    DIR/checkpoint                 {"latest": "ckpt-00000003"} (written last)
    DIR/ckpt-00000003/manifest.json  the shard manifest, mesh, devices, step,
                                     and which file holds which shard
    DIR/ckpt-00000003/shards-<device>.npz   that device's shards

When every worker runs the script, each task writes its own part
(`save_task`: its devices' files under ckpt-*/task-<k>/, renamed into place
whole) and task 0 the manifest, which lists the parts; the checkpoint is
complete, and named in DIR/checkpoint by the task that completes it, once
every part is there.

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
from tfsplit.sharding.tasks import task_of

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
    files = _write_device_files(tmp, _by_device(manifest), shard_values)
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
  _name_latest(directory, name, keep)
  return final


def _complete(path):
  """Whether the checkpoint at `path` has its manifest and every part."""
  try:
    with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
      parts = json.load(f).get("parts") or []
  except (OSError, ValueError, AttributeError):
    return False
  return all(os.path.isdir(os.path.join(path, p)) for p in parts)


def latest(directory):
  """Path of the latest complete checkpoint in `directory`, or None."""
  try:
    with open(os.path.join(directory, POINTER), encoding="utf-8") as f:
      name = json.load(f)["latest"]
  except (OSError, ValueError, KeyError, TypeError):
    return None
  path = os.path.join(directory, name)
  return path if _complete(path) else None


def _by_device(manifest):
  by_device = {}
  for entry in manifest.values():
    for shard in entry["shards"]:
      by_device.setdefault(shard["device"], []).append(shard["name"])
  return by_device


def _write_device_files(where, by_device, shard_values, prefix=""):
  """Each device's shards into `where`; {shard: [file, key]} (file under prefix)."""
  files = {}
  for device, names in sorted(by_device.items()):
    fname = _device_file(device)
    if shard_values is not None:
      arrays = {f"s{i}": np.asarray(shard_values[n]) for i, n in enumerate(names)}
      with open(os.path.join(where, fname), "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    for i, n in enumerate(names):
      files[n] = [prefix + fname, f"s{i}"]
  return files


def _name_latest(directory, name, keep):
  write_atomically(os.path.join(directory, POINTER), json.dumps({"latest": name}) + "\n")
  if keep:
    done = sorted(d for d in os.listdir(directory)
                  if d.startswith("ckpt-") and os.path.isdir(os.path.join(directory, d)))
    for old in done[:-keep]:
      if old != name:
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)


def save_task(directory, manifest, shard_values, step, task, mesh=None, keep=2):
  """Task `task`'s part of DIR/ckpt-<step> (its devices' shards from
  `shard_values`), written by that task alone; task 0 also writes the
  manifest of every part. Returns the checkpoint's path."""
  final = os.path.join(directory, f"ckpt-{int(step):08d}")
  os.makedirs(final, exist_ok=True)
  by_device = _by_device(manifest)
  tasks = sorted({task_of(d) for d in by_device})
  part = os.path.join(final, f"task-{task}")
  tmp = tempfile.mkdtemp(prefix=f".task-{task}.", dir=final)
  try:
    _write_device_files(tmp, {d: n for d, n in by_device.items() if task_of(d) == task},
                        shard_values)
    _fsync_dir(tmp)
    if os.path.exists(part):
      shutil.rmtree(part)
    os.rename(tmp, part)
    if task == tasks[0]:
      files = {}
      for t in tasks:
        files.update(_write_device_files(
            None, {d: n for d, n in by_device.items() if task_of(d) == t}, None,
            f"task-{t}/"))
      meta = {"format": FORMAT, "step": int(step), "mesh": mesh, "variables": manifest,
              "files": files, "parts": [f"task-{t}" for t in tasks]}
      write_atomically(os.path.join(final, MANIFEST), json.dumps(meta, sort_keys=True))
    _fsync_dir(final)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  if _complete(final):   # the last part written names it
    _name_latest(directory, os.path.basename(final), keep)
  return final


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
