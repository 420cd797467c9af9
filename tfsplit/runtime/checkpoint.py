"""Checkpoints of a split step: its variables as slices of their full
tensors in TF's own checkpoint format, plus tfsplit's manifest.

    DIR/checkpoint                    TF's checkpoint state, naming
                                      ckpt-00000003/variables (written last)
    DIR/ckpt-00000003/variables.*     a TF tensor bundle (runtime/slices.py):
                                      each variable under its name, each
                                      distinct block of it written once
    DIR/ckpt-00000003/manifest.json   the shard manifest, mesh, devices, step

Plain TF reads it whole: `tf.train.load_checkpoint(DIR).get_tensor(name)`
is a variable's full value, and `tfsplit.load_into` puts them into an
unsplit model. Restoring, on this mesh or any other, reads each shard as
its slice of the stored tensor, a few variables at a time (`chunks`): no
process holds a full tensor set, and each reads only the stored blocks its
own shards overlap.

When every worker runs the script, each task writes the blocks whose first
copy it holds (`save_task`: under ckpt-*/task-<k>/, renamed into place
whole) and task 0 the manifest, which lists the parts; the task that finds
every part there merges them into ckpt-*/variables (their data files are
moved, not copied) and names the checkpoint in DIR/checkpoint.

A checkpoint is written into a temporary directory beside its final name,
fsynced and renamed into place, and only then named in DIR/checkpoint
(atomically): a crash at any moment leaves the previous checkpoint the
latest, complete one. A checkpoint of other variables, or of a variable
of another shape, is refused in one line. Checkpoints of the first format
(one .npz file per device) still load.
"""
import json
import os
import re
import shutil
import tempfile

import numpy as np

from tfsplit.errors import TfsplitError
from tfsplit.fileio import write_atomically
from tfsplit.runtime import slices
from tfsplit.sharding.tasks import task_of

POINTER = "checkpoint"
MANIFEST = "manifest.json"
PREFIX = "variables"
FORMAT = 2
_MERGING = ".merging"


class CheckpointError(TfsplitError):
  """A checkpoint that is missing, incomplete or does not fit the step."""


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
  """Writes a checkpoint of the shards described by `manifest` ({variable:
  entry}) as DIR/ckpt-<step>; returns its path. shard_values: {shard name:
  value} (of the blocks written at least: slices.blocks). mesh: {'axes': {...}, 'devices': [...]} to record; keep: how
  many of the latest checkpoints to keep (older ones are removed; 0 keeps
  all)."""
  os.makedirs(directory, exist_ok=True)
  name = f"ckpt-{int(step):08d}"
  final = os.path.join(directory, name)
  tmp = tempfile.mkdtemp(prefix=f".{name}.", dir=directory)
  try:
    slices.write(os.path.join(tmp, PREFIX), manifest, shard_values)
    _write_manifest(tmp, manifest, step, mesh)
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


def _write_manifest(where, manifest, step, mesh, parts=None):
  meta = {"format": FORMAT, "step": int(step), "mesh": mesh, "variables": manifest,
          "prefix": PREFIX}
  if parts:
    meta["parts"] = parts
  write_atomically(os.path.join(where, MANIFEST), json.dumps(meta, sort_keys=True))


def _read_meta(path):
  try:
    with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
      meta = json.load(f)
  except (OSError, ValueError):
    return None
  return meta if isinstance(meta, dict) else None


def _complete(path):
  """Whether the checkpoint at `path` has its manifest and all its values
  (the merged bundle; the first format: every part)."""
  meta = _read_meta(path)
  if meta is None:
    return False
  if meta.get("format", 1) >= 2:
    return os.path.exists(os.path.join(path, meta.get("prefix", PREFIX) + ".index"))
  return all(os.path.isdir(os.path.join(path, p)) for p in meta.get("parts") or [])


def latest(directory):
  """Path of the latest complete checkpoint in `directory`, or None."""
  try:
    with open(os.path.join(directory, POINTER), encoding="utf-8") as f:
      text = f.read()
  except OSError:
    return None
  found = re.search(r'^model_checkpoint_path:\s*"([^"]+)"', text, re.M)
  if found:   # TF's checkpoint state: the bundle's prefix
    name = os.path.dirname(found.group(1))
  else:       # the first format's {"latest": name}
    try:
      name = json.loads(text)["latest"]
    except (ValueError, KeyError, TypeError):
      return None
  path = os.path.join(directory, name)
  return path if name and _complete(path) else None


def _name_latest(directory, name, keep):
  """Names `name` the latest checkpoint (TF's checkpoint state, which plain
  TF reads too) and removes all but the `keep` latest (0: none)."""
  done = sorted(d for d in os.listdir(directory)
                if d.startswith("ckpt-") and os.path.isdir(os.path.join(directory, d)))
  old = [d for d in (done[:-keep] if keep else []) if d != name]
  kept = [d for d in done if d not in old and d != name and
          _complete(os.path.join(directory, d))] + [name]
  write_atomically(os.path.join(directory, POINTER),
                   f'model_checkpoint_path: "{name}/{PREFIX}"\n' +
                   "".join(f'all_model_checkpoint_paths: "{d}/{PREFIX}"\n' for d in kept))
  for d in old:
    shutil.rmtree(os.path.join(directory, d), ignore_errors=True)


def save_task(directory, manifest, shard_values, step, task, mesh=None, keep=2):
  """Task `task`'s part of DIR/ckpt-<step>: the blocks whose first copy is
  on its devices (values from `shard_values`, as in save), written by that
  task alone; task 0 also writes the manifest of every part; the task that
  finds every part there merges them. Returns the checkpoint's path."""
  final = os.path.join(directory, f"ckpt-{int(step):08d}")
  os.makedirs(final, exist_ok=True)
  devices = {s["device"] for e in manifest.values() for s in e["shards"]}
  tasks = sorted({task_of(d) for d in devices})
  part = os.path.join(final, f"task-{task}")
  tmp = tempfile.mkdtemp(prefix=f".task-{task}.", dir=final)
  try:
    slices.write(os.path.join(tmp, PREFIX), manifest, shard_values,
                 devices={d for d in devices if task_of(d) == task})
    _fsync_dir(tmp)
    if os.path.exists(part):
      shutil.rmtree(part)
    os.rename(tmp, part)
    if task == tasks[0]:
      _write_manifest(final, manifest, step, mesh, [f"task-{t}" for t in tasks])
    _fsync_dir(final)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  if _merge_parts(final):   # the task that completes it merges and names it
    _name_latest(directory, os.path.basename(final), keep)
  return final


def _merge_parts(path):
  """Merges the parts of the checkpoint at `path` into its bundle once all
  are there and its manifest too; True for the one task that did."""
  meta = _read_meta(path)
  parts = (meta or {}).get("parts") or []
  if not parts or not all(os.path.isdir(os.path.join(path, p)) for p in parts):
    return False
  try:
    fd = os.open(os.path.join(path, _MERGING), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
  except FileExistsError:
    return False   # another task is merging it
  os.close(fd)
  prefixes = [os.path.join(path, p, PREFIX) for p in parts
              if os.path.exists(os.path.join(path, p, PREFIX + ".index"))]
  slices.merge(prefixes, os.path.join(path, PREFIX))
  for p in parts:
    shutil.rmtree(os.path.join(path, p), ignore_errors=True)
  os.unlink(os.path.join(path, _MERGING))
  _fsync_dir(path)
  return True


def _find(path):
  """The checkpoint directory `path` names (itself, or the latest in it)."""
  if os.path.exists(os.path.join(path, MANIFEST)):
    return path
  found = latest(path)
  if found is None:
    raise CheckpointError(f"no checkpoint in '{path}' (no {POINTER} file naming a "
                          "complete checkpoint)")
  return found


class _Bundle(object):
  """A sliced checkpoint's tensor bundle, which `chunks` reads by slices."""

  def __init__(self, prefix):
    self.prefix = prefix


def load(path):
  """(meta, values) of the checkpoint at `path` (a ckpt-* directory, or a
  directory whose latest checkpoint is taken): values, {shard name: value}
  for the first format; for a sliced one, a handle on its bundle, which
  `chunks` reads shard by shard."""
  path = _find(path)
  meta = _read_meta(path)
  try:
    if meta is None:
      raise ValueError(f"{MANIFEST} cannot be parsed")
    if meta.get("format", 1) >= 2:
      meta["path"] = path
      return meta, _Bundle(os.path.join(path, meta.get("prefix", PREFIX)))
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


def _check_variables(saved, manifest):
  """One line (CheckpointError) unless the checkpoint holds the step's
  variables, each of the step's shape."""
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


def chunks(meta, saved_values, manifest, held=None):
  """Yields {shard name: value} for the shards of `held` (default: all of
  `manifest`, the step's), a few variables at a time (slices.BATCH_BYTES
  of blocks): a sliced checkpoint's read as slices of the stored tensors,
  whatever mesh wrote them; the first format's from the same shards, or
  another mesh's through each variable's full value. Raises CheckpointError (one line) if the
  variables do not match."""
  from tfsplit.runtime import shards as shards_lib  # pylint: disable=import-outside-toplevel
  saved = meta["variables"]
  _check_variables(saved, manifest)
  held = manifest if held is None else held
  if isinstance(saved_values, _Bundle):
    _check_complete(saved_values.prefix, saved)
    try:
      yield from slices.read(saved_values.prefix, held)
    except TfsplitError as e:
      raise CheckpointError(str(e)) from None
    return
  same = _layout(saved) == _layout(manifest)
  for name, entry in held.items():
    if same:
      yield {s["name"]: saved_values[s["name"]] for s in entry["shards"]}
    else:
      full = shards_lib.full_values({name: saved[name]}, saved_values)
      yield shards_lib.shard_values({name: entry}, full)


def _check_complete(prefix, saved):
  """One line (CheckpointError) unless the bundle's data files hold every
  block the saved manifest lists: a truncated or missing data file is found
  before any shard is assigned, so a failed restore changes nothing."""
  import glob  # pylint: disable=import-outside-toplevel
  want = slices.stored_bytes(saved)
  files = glob.glob(glob.escape(prefix) + ".data-*")
  have = sum(os.path.getsize(f) for f in files)
  if have < want:
    raise CheckpointError(
        f"checkpoint '{os.path.dirname(prefix)}' is incomplete: its data files hold {have} "
        f"bytes, its blocks {want}; nothing was restored (restore an earlier checkpoint)")


def convert(meta, saved_values, manifest):
  """{shard name: value} for a step described by `manifest`, from a loaded
  checkpoint (all of `chunks` at once)."""
  out = {}
  for chunk in chunks(meta, saved_values, manifest):
    out.update(chunk)
  return out


def load_into(variables, path):
  """Assigns each of `variables` its full value from the checkpoint at
  `path` (a split's checkpoint directory or ckpt-* path, or any TF
  checkpoint prefix keyed by these names), one variable at a time; returns
  the checkpoint's step (None for a plain TF checkpoint). variables:
  {name: tf.Variable} or [(tf.Variable, name)] (split()'s variable_names
  form). Every variable is checked (present, same shape) before any is
  assigned: a mismatch is one line and changes nothing."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import deferred as deferred_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import shards as shards_lib  # pylint: disable=import-outside-toplevel
  named = dict((n, v) if isinstance(n, str) else (v, n) for n, v in
               (variables.items() if isinstance(variables, dict) else variables))
  step, prefix, old = None, path, None
  if os.path.isdir(path):
    found = _find(path)
    meta = _read_meta(found)
    step = meta.get("step") if meta else None
    if meta and meta.get("format", 1) < 2:
      old = load(found)
    else:
      prefix = os.path.join(found, (meta or {}).get("prefix", PREFIX))
  if old is not None:   # the first format: per-device files
    _check_loadable(named, {n: e["shape"] for n, e in old[0]["variables"].items()}, path)
    for name, var in named.items():
      entry = old[0]["variables"][name]
      value = shards_lib.full_values({name: entry}, old[1])[name]
      deferred_lib.refill(var, value)
    return step
  try:
    reader = tf.train.load_checkpoint(prefix)
  except (tf.errors.OpError, ValueError) as e:
    raise CheckpointError(f"'{path}': cannot read the checkpoint "
                          f"({str(e).splitlines()[0][:200]})") from None
  _check_loadable(named, reader.get_variable_to_shape_map(), path)
  for name, var in named.items():
    deferred_lib.refill(var, reader.get_tensor(name))
  return step


def _check_loadable(named, stored, path):
  missing = [n for n in named if n not in stored]
  if missing:
    raise CheckpointError(
        f"checkpoint '{path}' has no variable '{missing[0]}'"
        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        + "; it holds " + ", ".join(f"'{k}'" for k in sorted(stored)[:3])
        + (" ..." if len(stored) > 3 else ""))
  for name, var in named.items():
    if list(stored[name]) != list(var.shape):
      raise CheckpointError(f"variable '{name}' has shape {list(stored[name])} in checkpoint "
                            f"'{path}' but {list(var.shape)} in the model")
