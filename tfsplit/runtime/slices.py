"""A split's variables as slices of their full tensors, in TF's own
checkpoint format (a tensor bundle: PREFIX.index + PREFIX.data-*).

Each distinct block of a variable (its offsets and shape; data-parallel
replicas and other copies of one block are written once) is stored under
the variable's name as a slice of the full tensor (SaveV2's
shape_and_slices, e.g. "4 6 0,2:-"), a variable held whole as a plain
tensor. Writers of different blocks (one per task) are merged into one
bundle (MergeV2Checkpoints moves their data files, nothing is copied).
Plain TF reads every full tensor back (`tf.train.load_checkpoint(PREFIX)
.get_tensor(name)`), and any slice of it is read alone (RestoreV2), also
of a tensor stored whole: restoring reads, per variable, only the blocks a
process's shards need, never a full tensor set.

    spec(shape, offsets, size)      the slice string of one block
    blocks(manifest)                {variable: [shard]}: one shard per block
    write(prefix, manifest, values, devices=None)  the blocks (those whose
                                    first copy is on `devices`) into a bundle
    merge(prefixes, prefix)         several writers' bundles into one
    read(prefix, manifest, keys)    {shard: value}, a few variables at a time
"""
import numpy as np
import tensorflow as tf

from tfsplit.errors import TfsplitError


def spec(shape, offsets, size):
  """SaveV2/RestoreV2's slice string of the block at `offsets` of `size` in a
  tensor of `shape`; "" for the whole tensor (a scalar included)."""
  shape, offsets, size = list(shape), list(offsets), list(size)
  if not shape or (not any(offsets) and size == shape):
    return ""
  dims = " ".join(str(int(d)) for d in shape)
  parts = ":".join("-" if (o == 0 and s == d) else f"{int(o)},{int(s)}"
                   for d, o, s in zip(shape, offsets, size))
  return f"{dims} {parts}"


def blocks(manifest):
  """{variable: [shard]}: of each distinct block (offsets and shape) the
  first shard holding it, in manifest order; its other copies (replicas
  over dp, a replicated variable's devices) are not written."""
  out = {}
  for name, entry in manifest.items():
    seen = {}
    for shard in entry["shards"]:
      seen.setdefault((tuple(shard["offsets"]), tuple(shard["shape"])), shard)
    out[name] = list(seen.values())
  return out


def _dtype(entry):
  return tf.as_dtype(entry["dtype"])


def stored_bytes(manifest):
  """Bytes of the distinct blocks of `manifest`'s numeric variables: what
  a bundle of them holds in its data files."""
  total = 0
  for name, chosen in blocks(manifest).items():
    dtype = _dtype(manifest[name])
    if dtype.is_numpy_compatible and dtype not in (tf.string, tf.resource, tf.variant):
      total += sum(int(np.prod(s["shape"], dtype=np.int64)) for s in chosen) * dtype.size
  return total


# A variable up to this size whose blocks one writer holds is stored whole:
# TF's reader reads each stored slice through a buffer of its own (1 MiB),
# so many small slices would cost a buffer each on restore.
WHOLE_BYTES = 4 << 20


def write(prefix, manifest, values, devices=None):
  """Writes the blocks of `manifest` into the bundle at `prefix`; returns
  the number of entries written. values: {shard name: value} (numpy or
  tensors) of the blocks written; devices: only the blocks whose first
  copy is on one of them (a task's part), else all. A small variable (WHOLE_BYTES) all of
  whose blocks are written here is assembled and stored whole."""
  entries = []   # (name, slice string, [(block shard, its slices)] or one shard)
  for name, chosen in blocks(manifest).items():
    entry = manifest[name]
    mine = [s for s in chosen if devices is None or s["device"] in devices]
    if not mine:
      continue
    size = int(np.prod(entry["shape"], dtype=np.int64)) * _dtype(entry).size
    if len(mine) > 1 and len(mine) == len(chosen) and size <= WHOLE_BYTES:
      entries.append((name, "", mine))
      continue
    for shard in mine:
      entries.append((name, spec(entry["shape"], shard["offsets"], shard["shape"]), [shard]))
  if not entries:
    return 0
  entries.sort(key=lambda e: (e[0], e[1]))
  tensors = []
  for name, slice_spec, shards in entries:
    dtype = _dtype(manifest[name])
    if slice_spec == "" and len(shards) > 1:   # a small variable, assembled
      full = np.zeros(manifest[name]["shape"], dtype.as_numpy_dtype)
      for s in shards:
        full[tuple(slice(o, o + n) for o, n in zip(s["offsets"], s["shape"]))] = \
            np.asarray(values[s["name"]])
      tensors.append(tf.constant(full, dtype=dtype))
      continue
    value = values[shards[0]["name"]]
    tensors.append(value if isinstance(value, tf.Tensor)
                   else tf.constant(np.asarray(value), dtype=dtype))
  with tf.device("/cpu:0"):
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=[e[0] for e in entries],
                      shape_and_slices=[e[1] for e in entries], tensors=tensors)
  return len(entries)


def merge(prefixes, prefix):
  """Merges the bundles at `prefixes` (each its own blocks) into one at
  `prefix`; their data files are moved there."""
  with tf.device("/cpu:0"):
    tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=list(prefixes),
                                  destination_prefix=prefix, delete_old_dirs=False)


# What one RestoreV2 reads at most: the reader's buffer serves neighbouring
# small blocks from one read, and the values read at once stay bounded.
BATCH_BYTES = 64 << 20


def read(prefix, manifest, keys=None, batch_bytes=BATCH_BYTES):
  """Yields {shard name: numpy value} for the shards of `manifest`, a few
  variables at a time (about `batch_bytes` of blocks, one variable at
  least): each block read as a slice of the stored tensor (RestoreV2 reads
  only the stored blocks that overlap it). keys: {variable: its key in the
  bundle} (default: its name). Every variable is checked (present, same
  shape and dtype) before any is read: a mismatch is one line
  (TfsplitError)."""
  keys = keys or {}
  reader = _reader(prefix)
  stored = reader.get_variable_to_shape_map()
  kinds = reader.get_variable_to_dtype_map()
  for name, entry in manifest.items():
    key = keys.get(name, name)
    if key not in stored:
      raise TfsplitError(f"checkpoint '{prefix}' has no variable '{key}'"
                         + (f" (for '{name}')" if key != name else ""))
    if list(stored[key]) != list(entry["shape"]):
      raise TfsplitError(f"variable '{name}' has shape {list(stored[key])} in checkpoint "
                         f"'{prefix}' but {list(entry['shape'])} in the step")
    if kinds[key] != _dtype(entry):
      raise TfsplitError(f"variable '{name}' is {kinds[key].name} in checkpoint "
                         f"'{prefix}' but {_dtype(entry).name} in the step")
  batch, size = [], 0
  for name, chosen in blocks(manifest).items():
    batch.append(name)
    size += sum(int(np.prod(s["shape"])) for s in chosen) * _dtype(manifest[name]).size
    if size >= batch_bytes:
      yield _restore(prefix, {n: manifest[n] for n in batch}, keys)
      batch, size = [], 0
  if batch:
    yield _restore(prefix, {n: manifest[n] for n in batch}, keys)


def _restore(prefix, manifest, keys):
  """{shard name: value} of every shard of `manifest`, in one RestoreV2."""
  wanted = [(name, s) for name, chosen in blocks(manifest).items() for s in chosen]
  try:
    with tf.device("/cpu:0"):
      values = tf.raw_ops.RestoreV2(
          prefix=prefix, tensor_names=[keys.get(n, n) for n, _ in wanted],
          shape_and_slices=[spec(manifest[n]["shape"], s["offsets"], s["shape"])
                            for n, s in wanted],
          dtypes=[_dtype(manifest[n]) for n, _ in wanted])
  except (tf.errors.OpError, ValueError) as e:
    raise TfsplitError(f"checkpoint '{prefix}': variables {', '.join(sorted(manifest)[:3])}"
                       f"{' ...' if len(manifest) > 3 else ''} cannot be read "
                       f"({str(e).splitlines()[0][:200]})") from None
  return spread(manifest, {block_key(n, s): v.numpy() for (n, s), v in zip(wanted, values)})


def block_key(name, shard):
  """The key of the block `shard` of variable `name` holds (its copies share it)."""
  return name, tuple(shard["offsets"]), tuple(shard["shape"])


def spread(manifest, by_block):
  """{shard name: value} of every shard of `manifest`, from {block_key:
  value} of its distinct blocks (blocks()): each copy gets its block's."""
  return {s["name"]: by_block[block_key(n, s)]
          for n, entry in manifest.items() for s in entry["shards"]}


def _reader(prefix):
  try:
    return tf.train.load_checkpoint(prefix)
  except (tf.errors.OpError, ValueError) as e:
    raise TfsplitError(f"'{prefix}': cannot read the checkpoint "
                       f"({str(e).splitlines()[0][:200]})") from None
