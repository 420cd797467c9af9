"""Benchmark: activation memory of in-graph micro-batching (gradient accumulation).

For each model (default: the whole real-structure corpus and the raw GPT),
in a fresh Python process of its own, splits the example's training step with
`tfsplit.split(..., mesh="dp=2", microbatches=m)` for each m (default 1, 4) and
measures the allocator peak of one step: tf.config.experimental.reset_memory_stats,
the memory in use just before the step (`current`: variables, inputs; the
baseline), the step, then `peak`. Activation memory = peak - baseline; the
median over --steps steps after a warm-up step is printed as a ratio to m = 1,
beside 1/m (the target: one micro-batch's activations alive at a time). The original,
unsplit tf.function training step is measured first as a sanity baseline.

One process per model: all CPU devices of a process share one BFC allocator,
and the chunks and fragmentation that earlier models leave in it move a later
model's peak (vit_tfkeras's m=4 ratio read 0.21 to 0.50 depending on the
models measured before it in the same process). The script runs itself with
--one=MODEL for each model, bounded by --timeout, echoes that process's output
and reads its ratios back from one result line; a model whose process fails
or times out gets one FAILED line among the summary lines, the others still
run, and the exit status is 1.

Memory statistics on CPU need TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow
is imported (set below). TensorFlow runs with one inter-op thread: ops then
run one at a time in a fixed order; with parallel inter-op threads ready ops
run in a scheduling-dependent order (those of different micro-batches side by
side where the graph leaves them unordered), and the peak wanders from step
to step.

The `waits` column checks the rewritten graph: how many micro-batches wait
(control inputs on their first ops that depend on a weight) for the previous
micro-batch's gradient contributions, out of those that should (m - 1 per
replica). --explain profiles one more step per m and prints the tensors alive
at its peak. The last lines give each model's m=4 / m=1 ratio (target: at
most 0.4).

    python tools/bench_microbatch.py [--models causallm_keras3,gpt_raw] [--size small]
        [--batch 128] [--mesh dp=2] [--microbatches 1,4] [--steps 7] [--explain]
        [--timeout 900]
"""
import gc
import os
import re
import sys

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # before TensorFlow is imported
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

from benchlib import (buffers_at_peak, define_example_flags, memory_events,  # pylint: disable=g-import-not-at-top,wrong-import-position
                      print_peak, print_result, run_script, step_memory)

FLAGS = flags.FLAGS
define_example_flags("small")
flags.DEFINE_list("models", ["causallm_keras3", "causallm_tfkeras", "llama_keras3",
                             "llama_tfkeras", "bert_keras3", "bert_tfkeras", "vit_keras3",
                             "vit_tfkeras", "gpt_raw"],
                  "Example models to measure (overrides --model when given).")
flags.DEFINE_integer("batch", 128, "Batch size (divisible by every m).", lower_bound=1)
flags.DEFINE_list("microbatches", ["1", "4"], "Micro-batch counts m.")
flags.DEFINE_integer("steps", 7, "Measured steps per m (median).", lower_bound=1)
flags.DEFINE_integer("warmup", 1, "Unmeasured steps first.", lower_bound=0)
flags.DEFINE_string("mesh", "dp=2", "Mesh to split over (before the micro-batch axis).")
flags.DEFINE_integer("inter_op_threads", 1, "TensorFlow inter-op threads.", lower_bound=1)
flags.DEFINE_boolean("explain", False,
                     "Profile one step per m and print the tensors alive at its peak.")
flags.DEFINE_integer("explain_top", 12, "Live tensors to print per m with --explain.")
flags.DEFINE_float("timeout", 900, "Seconds each model's process may run.", lower_bound=1)
flags.DEFINE_string("one", None, "Internal: measure this model here and print one "
                    "result line.")

_MIB = 2.0**20
_SHARD_RE = re.compile(r"/shard_(\d+)$")


def _device():
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def _waits(graph_def, mesh, m):
  """(micro-batches whose ops wait for the previous micro-batch on the same
  replica; those that should)."""
  from tfsplit.pipeline.microbatches import ordered_microbatches  # pylint: disable=import-outside-toplevel
  from tfsplit.sharding.builder import read_records  # pylint: disable=import-outside-toplevel
  waiting = ordered_microbatches(graph_def, read_records(graph_def), mesh)
  return len(waiting), mesh.size // m * (m - 1)


def _explain(fn, inputs, top):
  """Prints the allocations alive at the peak of one profiled step."""
  events = memory_events(fn, inputs)
  peak, live = buffers_at_peak(events)
  first_seen, last_seen = {}, {}
  for t, kind, st in events:
    m = _SHARD_RE.search(st.get("tf_op") or "?")
    if kind == "MemoryAllocation" and m and \
        st.get("allocator_name") == peak.get("allocator_name"):
      first_seen.setdefault(int(m.group(1)), t)
      last_seen[int(m.group(1))] = t

  def shard_of(op):
    m = _SHARD_RE.search(op)
    return f"shard_{m.group(1)}" if m else "unsharded"
  print_peak(peak, live, top, shard_of, "micro-batch copy")
  if first_seen:
    t0 = events[0][0]
    order = sorted(first_seen, key=first_seen.get)
    print("  micro-batch copies by first allocation (ms from step start, first-last): " +
          ", ".join(f"shard_{k} {(first_seen[k] - t0) / 1e9:.1f}-"
                    f"{(last_seen[k] - t0) / 1e9:.1f}" for k in order))


def _measure_model(name, ms, device):
  """Prints the table of one model; returns {m: activation ratio to m=1}."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import tfsplit  # pylint: disable=import-outside-toplevel
  import models  # pylint: disable=import-outside-toplevel
  ex = models.build(name, size=FLAGS.size, seed=0, batch_size=FLAGS.batch)
  names = list(zip(ex.all_variables(), ex.variable_names()))
  inputs = [tf.constant(x) for x in ex.make_inputs("train", seed=1)]
  var_bytes = sum(v.numpy().nbytes for v in ex.all_variables())
  print(f"{name}/{FLAGS.size} batch {FLAGS.batch} on {device}: "
        f"{len(names)} variables ({var_bytes / _MIB:.2f} MiB with optimizer slots); "
        f"mesh {FLAGS.mesh}; {FLAGS.inter_op_threads} inter-op thread(s); median of "
        f"{FLAGS.steps} steps after {FLAGS.warmup} warm-up")
  rows = []
  fn = ex.train_step
  rows.append(("unsplit", 1, step_memory(fn, inputs, device, FLAGS.steps, FLAGS.warmup),
               "", len(ex.concrete("train").graph.as_graph_def().node)))
  if FLAGS.explain:
    print("[unsplit] tf.function train step")
    _explain(fn, inputs, FLAGS.explain_top)
  for m in ms:
    step = tfsplit.split(ex.train_step, mesh=FLAGS.mesh, microbatches=m,
                         input_signature=ex.train_signature, variable_names=names)
    waits = "-"
    if m > 1:
      waits = "%d/%d" % _waits(step.graph_def, step.result.mesh, m)
    rows.append((f"m={m}", m, step_memory(step, inputs, device, FLAGS.steps, FLAGS.warmup),
                 waits, len(step.graph_def.node)))
    if FLAGS.explain:
      print(f"[m={m}] split step")
      _explain(step, inputs, FLAGS.explain_top)
    # Each split creates its own shard variables: free them before the next.
    del step
    gc.collect()

  ref = next((r[2][2] for r in rows if r[0] == "m=1"), rows[0][2][2])
  header = (f"{'step':>8} {'nodes':>6} {'waits':>6} {'peak MiB':>9} {'base MiB':>9} "
            f"{'act MiB':>8} {'min-max':>13} {'ratio':>6} {'1/m':>6} {'loss':>8}")
  print(header)
  print("-" * len(header))
  for label, m, (peak, base, act, lo, hi, loss), waits, nodes in rows:
    print(f"{label:>8} {nodes:>6} {waits:>6} {peak / _MIB:>9.2f} {base / _MIB:>9.2f} "
          f"{act / _MIB:>8.2f} {lo / _MIB:>6.2f}-{hi / _MIB:<6.2f} {act / ref:>6.3f} "
          f"{1.0 / m:>6.3f} {loss:>8.4f}")
  print()
  return {m: act / ref for label, m, (_, _, act, _, _, _), _, _ in rows
          if label.startswith("m=")}


def _measure_here(name):
  """Measures one model in this process (a fresh one); returns {m: ratio}."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  # Before any op runs (the thread pools are created with the context).
  tf.config.threading.set_inter_op_parallelism_threads(FLAGS.inter_op_threads)
  mesh_size = 1
  for part in FLAGS.mesh.split(","):
    mesh_size *= int(part.split("=")[1])
  cpu = tf.config.list_physical_devices("CPU")[0]
  if not tf.config.list_physical_devices("GPU") and mesh_size > 1:
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * mesh_size)
  ms = [int(m) for m in FLAGS.microbatches]
  return _measure_model(name, ms, _device())


def main(argv):
  del argv
  if FLAGS.one:
    ratios = _measure_here(FLAGS.one)
    print_result({str(m): ratio for m, ratio in ratios.items()})
    return 0
  models_to_run = FLAGS.models if FLAGS.models else [FLAGS.model]
  results = {}  # name: {m: ratio} or the reason its process failed
  for name in models_to_run:
    try:
      by_m = run_script(__file__, sys.argv[1:] + [f"--one={name}"], FLAGS.timeout)
      results[name] = {int(m): ratio for m, ratio in by_m.items()}
    except RuntimeError as e:
      results[name] = str(e)
  print("act = peak - base (bytes in use just before the step: variables of the "
        "model, optimizer and live split step, and inputs); ratio = act / act(m=1); "
        "waits = micro-batches ordered after the previous one, out of those that "
        "should be; loss = first loss of the step (the split steps start from the "
        "same values)")
  for name, by_m in results.items():
    if isinstance(by_m, str):
      print(f"[{name} {FLAGS.size} b={FLAGS.batch} {FLAGS.mesh}] FAILED: {by_m} "
            f"(its output is above)")
      continue
    for m, ratio in by_m.items():
      if m > 1:
        print(f"[{name} {FLAGS.size} b={FLAGS.batch} {FLAGS.mesh} m={m}] activation "
              f"memory / m=1: {ratio:.3f} (target 1/m = {1.0 / m:.3f}, at most 0.4)")
  return 1 if any(isinstance(r, str) for r in results.values()) else 0


if __name__ == "__main__":
  app.run(main)
