"""Train the GPT example split across worker processes, with checkpoints.

    tfsplit launch --workers 2 --each -- python examples/train_multiworker.py --mesh dp=2 --steps 3 --compare
    tfsplit launch --workers 2 -- python examples/train_multiworker.py --mesh dp=2 --steps 3 --compare

With --each every worker runs this script: TF_CONFIG names its task, and
tfsplit.split builds and runs that task's part of the split alone, on its
share of each global batch (step.local_batch), returning the global loss.
Without --each (any TF_CONFIG naming a cluster but no task of it) this
process drives every task as one client. Without TF_CONFIG it runs on this
process's logical CPU devices. Step i trains on the batch seeded with --seed + i, so a
run resumed from a checkpoint sees the same data as an uninterrupted one.

--checkpoint-dir: every --save-every steps the shards (one file per device)
and the manifest are written there atomically; a restarted run resumes from
the latest checkpoint (of this mesh or another: converted through full
values). --compare: afterwards, the same steps of the unsplit step on this
process's CPU, and the loss and every parameter compared (relative 1e-4 of
each tensor's scale). --output: the losses and final full values (.npz).
A worker that dies mid-step ends the run with one line naming it, exit 2.
"""
import json
import os
import sys
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/models

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "gpt_raw", "examples/models name.")
flags.DEFINE_string("size", "tiny", "Model size: tiny or small.")
flags.DEFINE_integer("batch", None, "Batch size (default: the model's).")
flags.DEFINE_string("mesh", "dp=2", "Mesh axes, e.g. dp=2, tp=2, pp=2, dp=2,tp=2.")
flags.DEFINE_integer("microbatches", 1, "Micro-batches per step.")
flags.DEFINE_integer("steps", 3, "Training steps in all (a resumed run does the rest).")
flags.DEFINE_integer("seed", 11, "Step i trains on the batch seeded with seed + i.")
flags.DEFINE_float("timeout", 60.0, "Seconds a collective or a step may take on the "
                   "cluster before the run fails naming the worker that stopped.")
flags.DEFINE_string("checkpoint_dir", None, "Checkpoint (and resume) directory.")
flags.DEFINE_integer("save_every", 1, "Steps between checkpoints.")
flags.DEFINE_float("step_delay", 0.0, "Seconds to sleep after each step (tests kill a "
                   "worker between steps).")
flags.DEFINE_boolean("compare", False, "Compare with the unsplit step on this CPU.")
flags.DEFINE_string("output", None, "Write the losses and final full values (.npz; "
                    "when every worker runs the script, each its task's shards to "
                    "OUTPUT.task<k>.npz).")


def main(argv):
  del argv
  import numpy as np  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import devices  # pylint: disable=import-outside-toplevel
  from tfsplit.layout.mesh import Mesh  # pylint: disable=import-outside-toplevel
  from tfsplit.errors import TfsplitError  # pylint: disable=import-outside-toplevel
  try:
    on_cluster = cluster_lib.resolve() is not None
    if not on_cluster:  # logical CPUs of this process, before TF starts
      devices.ensure_logical_devices(Mesh.parse(FLAGS.mesh).size)
    import models  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tfsplit  # pylint: disable=import-outside-toplevel
    from tfsplit.runtime import compare  # pylint: disable=import-outside-toplevel
    ex = models.build(FLAGS.model, size=FLAGS.size, seed=0, batch_size=FLAGS.batch)
    names = list(zip(ex.all_variables(), ex.variable_names()))
    start_values = {n: v.numpy().copy() for v, n in names}
    t0 = time.time()
    step = tfsplit.split(ex.train_step, mesh=FLAGS.mesh, input_signature=ex.train_signature,
                         variable_names=names, timeout_seconds=FLAGS.timeout,
                         microbatches=FLAGS.microbatches)
    where = step.cluster.describe() if step.cluster else "this process"
    print(f"split {FLAGS.model}/{FLAGS.size} over {step.mesh} on {where} in "
          f"{time.time() - t0:.1f} s", flush=True)
    first = 0
    if FLAGS.checkpoint_dir:
      from tfsplit.runtime import checkpoint  # pylint: disable=import-outside-toplevel
      if checkpoint.latest(FLAGS.checkpoint_dir):
        first = step.restore(FLAGS.checkpoint_dir)
        print(f"resumed from step {first} ({checkpoint.latest(FLAGS.checkpoint_dir)})",
              flush=True)
    losses = []
    for i in range(first, FLAGS.steps):
      t1 = time.time()
      # Each worker's share of the global batch when every worker runs this
      # script (as a tf.data pipeline sharded by task gives it); else the batch.
      inputs = step.local_batch(*ex.make_inputs("train", seed=FLAGS.seed + i))
      loss = float(np.asarray(step(*inputs)))
      losses.append(loss)
      print(f"step {i + 1} loss {loss:.6f} ({1e3 * (time.time() - t1):.1f} ms)", flush=True)
      if FLAGS.checkpoint_dir and (i + 1) % FLAGS.save_every == 0:
        step.save(FLAGS.checkpoint_dir, i + 1)
      if FLAGS.step_delay:
        time.sleep(FLAGS.step_delay)
    per_task = step.task is not None
    # Every worker running the script holds its own task's shards only.
    final = step.shard_values() if per_task else step.full_values()
    if FLAGS.output:
      # One file per worker when each holds its own shards: OUTPUT.task<k>.npz.
      output = FLAGS.output if not per_task else \
          f"{os.path.splitext(FLAGS.output)[0]}.task{step.task}.npz"
      np.savez(output, **{f"var:{k}": v for k, v in final.items()},
               losses=np.asarray(losses, np.float64),
               first=np.asarray(first))
    if FLAGS.compare:
      if first:
        raise TfsplitError("--compare needs a run from step 0, not a resumed one")
      from tfsplit.runtime.verify import batch_size_of, reverse_batch  # pylint: disable=import-outside-toplevel

      def reference(reverse):
        """The unsplit step's losses and final values (on the batches reversed:
        its own rounding noise, added to each tolerance as `tfsplit verify` does)."""
        for v, n in names:
          v.assign(start_values[n])
        out = []
        for i in range(FLAGS.steps):
          inputs = ex.make_inputs("train", seed=FLAGS.seed + i)
          if reverse:
            inputs = reverse_batch(inputs, batch_size_of(inputs))
          out.append(float(np.asarray(ex.train_step(*[tf.constant(x) for x in inputs]))))
        return out, {n: v.numpy().copy() for v, n in names}

      alt, alt_values = reference(True)
      want, want_values = reference(False)
      pairs = [(want_values[n], alt_values[n]) for n in want_values] + list(zip(want, alt))
      if not compare.typical_noise_is_small(pairs):
        alt, alt_values = [None] * len(want), {n: None for n in want_values}
      checks = [compare.compare("output", f"step {i + 1} loss", g, w, 1e-4,
                                compare.noise(w, a))
                for i, (g, w, a) in enumerate(zip(losses, want, alt))]
      if per_task:  # this task's shards against the same blocks of the reference
        from tfsplit.runtime import shards  # pylint: disable=import-outside-toplevel
        own = {n: e for n, e in step.manifest.items()
               if any(s["name"] in final for s in e["shards"])}
        want_shards = shards.shard_values(own, want_values)
        alt_shards = shards.shard_values(own, {n: want_values[n] if alt_values[n] is None
                                               else alt_values[n] for n in own})
        for n, entry in sorted(own.items()):
          scale = float(np.abs(want_values[n]).max()) if want_values[n].size else 0.0
          checks += [compare.compare("value", s["name"], final[s["name"]],
                                     want_shards[s["name"]], 1e-4,
                                     compare.noise(want_shards[s["name"]],
                                                   alt_shards[s["name"]]), scale=scale)
                     for s in entry["shards"] if s["name"] in final]
      else:
        checks += [compare.compare("value", n, final[n], want_values[n], 1e-4,
                                   compare.noise(want_values[n], alt_values[n]))
                   for n in want_values]
      bad = [c for c in checks if not c.ok]
      share = lambda c: c.max_abs / c.tolerance if c.tolerance else float(c.max_abs > 0)
      worst = max(checks, key=share)
      print(json.dumps({"compared": len(checks), "mismatches": len(bad),
                        "worst": worst.what, "worst_rel": float(worst.rel),
                        "worst_of_tolerance": float(share(worst))}), flush=True)
      if bad:
        print(f"MISMATCH: {bad[0].what} error {bad[0].rel:.3e} of its scale",
              file=sys.stderr)
        return 1
      where = f" on task {step.task}" if per_task else ""
      print(f"OK: {len(checks)} comparisons (loss of every step, every parameter"
            f"{' shard' if per_task else ''}){where} within 1e-4 of the one-device run")
    return 0
  except TfsplitError as e:
    print(f"train_multiworker: error: {e}", file=sys.stderr, flush=True)
    return 2


if __name__ == "__main__":
  app.run(lambda argv: sys.exit(main(argv)))
