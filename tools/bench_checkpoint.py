"""Benchmark: saving and restoring a split's checkpoint by slices (TF's
checkpoint format, runtime/checkpoint.py) against the first format's writer
(one .npz per device, every copy of every shard), measured in the same run.

The model is examples/models/seeded.py's GPT-2-style decoder (Keras 3, Adam;
--preset gpt2-small: 124 M parameters, 1.38 GiB of weights and moments).
It is split over --mesh (default dp=2,tp=2 with zero=1) on logical CPUs,
trained one step, then, --repeats times each (medians printed):
- save: step.save (each distinct block once, into one TF bundle) against
  np.savez of every device's shards (the first format), both fsynced, and
  how long an asynchronous save holds the step up;
- restore: step.restore of that checkpoint into a split over --restore-mesh
  (default pp=2, every shard read as its slice), its time and the bytes it
  read (rchar of /proc/self/io) against the bytes of state its shards hold.

    python tools/bench_checkpoint.py [--preset gpt2-small|tiny] [--repeats 3]
"""
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "examples"))

FLAGS = flags.FLAGS
flags.DEFINE_enum("preset", "gpt2-small", ["gpt2-small", "tiny"], "Model size.")
flags.DEFINE_string("mesh", "dp=2,tp=2", "The mesh the checkpoint is saved from.")
flags.DEFINE_integer("zero", 1, "ZeRO stage of the saving split.")
flags.DEFINE_string("restore_mesh", "pp=2", "The mesh the checkpoint is restored into.")
flags.DEFINE_integer("repeats", 3, "Times each measurement runs (medians).", lower_bound=1)


def _bytes_read():
  with open("/proc/self/io", encoding="utf-8") as f:
    return next(int(l.split()[1]) for l in f if l.startswith("rchar:"))


def _save_npz(directory, manifest, values):
  """The first format's writer: one .npz per device, every shard of it."""
  os.makedirs(directory)
  by_device = {}
  for entry in manifest.values():
    for shard in entry["shards"]:
      by_device.setdefault(shard["device"], []).append(shard["name"])
  for i, (_, names) in enumerate(sorted(by_device.items())):
    with open(os.path.join(directory, f"shards-{i}.npz"), "wb") as f:
      import numpy as np  # pylint: disable=import-outside-toplevel
      np.savez(f, **{f"s{k}": np.asarray(values[n]) for k, n in enumerate(names)})
      f.flush()
      os.fsync(f.fileno())


def _state_bytes(manifest):
  import numpy as np  # pylint: disable=import-outside-toplevel
  return sum(int(np.prod(e["shape"])) * np.dtype(e["dtype"]).itemsize
             for e in manifest.values())


def main(argv):
  del argv
  from tfsplit.runtime.devices import ensure_logical_devices  # pylint: disable=import-outside-toplevel
  ensure_logical_devices(4)
  import keras  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tfsplit  # pylint: disable=import-outside-toplevel
  from models import seeded  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import slices  # pylint: disable=import-outside-toplevel
  cfg = {"gpt2-small": seeded.GPT2_SMALL, "tiny": seeded.TINY}[FLAGS.preset]
  gpt = seeded.build(keras, cfg, seed=0)
  step = tfsplit.split(gpt.train_step, mesh=FLAGS.mesh, zero=FLAGS.zero,
                       split_embeddings=True, input_signature=gpt.signature,
                       variable_names=gpt.variable_names(), release=True)
  step(*gpt.inputs(100))
  manifest = step.manifest
  copies = sum(int(np.prod(s["shape"])) * np.dtype(e["dtype"]).itemsize
               for e in manifest.values() for s in e["shards"])
  blocks = sum(int(np.prod(s["shape"])) * np.dtype(manifest[n]["dtype"]).itemsize
               for n, chosen in slices.blocks(manifest).items() for s in chosen)
  print(f"model state {_state_bytes(manifest) / 2**30:.2f} GiB; split over {FLAGS.mesh} "
        f"zero={FLAGS.zero}: every copy of every shard {copies / 2**30:.2f} GiB, distinct "
        f"blocks {blocks / 2**30:.2f} GiB")
  root = tempfile.mkdtemp(prefix="bench_checkpoint.")
  try:
    sliced, npz = [], []
    for i in range(FLAGS.repeats):
      t = time.perf_counter()
      path = step.save(os.path.join(root, "sliced"), i + 1, keep=1)
      sliced.append(time.perf_counter() - t)
      t = time.perf_counter()
      _save_npz(os.path.join(root, f"npz{i}"), manifest, step.shard_values())
      npz.append(time.perf_counter() - t)
      shutil.rmtree(os.path.join(root, f"npz{i}"))
    blocked = []
    for i in range(FLAGS.repeats):
      t = time.perf_counter()
      pending = step.save(os.path.join(root, "async"), i + 1, keep=1, asynchronous=True)
      blocked.append(time.perf_counter() - t)
      pending.wait()
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    print(f"save: sliced {statistics.median(sliced):.2f} s ({size / 2**30:.2f} GiB on disk), "
          f"one .npz per device {statistics.median(npz):.2f} s; ratio "
          f"{statistics.median(sliced) / statistics.median(npz):.2f}; asynchronous: the step "
          f"waits {statistics.median(blocked):.3f} s")
    other = seeded.build(keras, cfg, seed=1)
    target = tfsplit.split(other.train_step, mesh=FLAGS.restore_mesh,
                           input_signature=other.signature,
                           variable_names=other.variable_names(), release=True)
    held = _state_bytes(target.manifest)
    times, reads = [], []
    for _ in range(FLAGS.repeats):
      before, t = _bytes_read(), time.perf_counter()
      target.restore(os.path.join(root, "sliced"))
      times.append(time.perf_counter() - t)
      reads.append(_bytes_read() - before)
    print(f"restore into {FLAGS.restore_mesh}: {statistics.median(times):.2f} s, read "
          f"{statistics.median(reads) / 2**30:.2f} GiB for {held / 2**30:.2f} GiB of state "
          f"(ratio {statistics.median(reads) / held:.3f})")
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == "__main__":
  app.run(main)
