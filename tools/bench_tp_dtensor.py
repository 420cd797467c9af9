"""Benchmark: training-step time of tfsplit's tensor parallelism (Megatron,
tp=4) against TensorFlow's DTensor on the same Megatron MLP.

In one process, on 4 logical devices configured before TensorFlow starts (CPUs
by default), one model written once in TF ops (--layers residual blocks
h + relu(h @ W1 + b1) @ W2 + b2, a mean squared loss, an update written by
hand: SGD with momentum, or Adam) is stepped as:

  one device     a tf.function over ordinary tf.Variables on device 0
  dtensor tp=4   the same step over DTensor DVariables on a 4-device mesh with
                 Megatron layouts: W1 [unsharded, x], b1 [x], W2 [x, unsharded],
                 b2 replicated (optimizer state as its weight); inputs replicated
  tfsplit tp=4   the one-device step split by tfsplit.split(strategy="megatron")

All three first run --check_steps steps from the same initial values; the
losses and every variable of the tp=4 runs must match the one-device run to
--rtol (of each tensor's largest value). Then they are timed as in
bench_step.py (warm-up, --rounds rounds of --steps steps taking turns; median,
p10/p90, round medians): tfsplit as a ratio to DTensor, DTensor to one device,
beside the ops (no Const, Placeholder, Identity, NoOp) and all-reduces per
device of each step's graph before Grappler (DTensor's: the per-device
function its SPMD expansion registers on the first call).

    python tools/bench_tp_dtensor.py [--layers 2] [--hidden 512] [--ffn 2048]
        [--batch 64] [--optimizer momentum] [--steps 20] [--rounds 5] [--warmup 3]
        [--device_type CPU] [--collective_timeout 0]
"""
import collections
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top
from absl import logging  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

import benchlib  # pylint: disable=g-import-not-at-top,wrong-import-position
from benchlib import best_of  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_integer("layers", 2, "MLP blocks.", lower_bound=1)
flags.DEFINE_integer("hidden", 512, "Model width (the residual stream).", lower_bound=1)
flags.DEFINE_integer("ffn", 2048, "Inner width of a block (divisible by 4).", lower_bound=4)
flags.DEFINE_integer("batch", 64, "Batch (rows of the input).", lower_bound=1)
flags.DEFINE_enum("optimizer", "momentum", ["momentum", "adam"],
                  "Update: SGD with momentum 0.9, or Adam.")
flags.DEFINE_float("learning_rate", None, "Default 0.01 (momentum), 0.001 (Adam).")
flags.DEFINE_integer("seed", 0, "Seed of the initial values and inputs.")
flags.DEFINE_integer("check_steps", 3, "Steps of the exactness check.", lower_bound=1)
flags.DEFINE_float("rtol", 1e-5, "Exactness tolerance, relative to a tensor's largest value.")
flags.DEFINE_integer("steps", 20, "Measured steps per configuration and round.", lower_bound=1)
flags.DEFINE_integer("rounds", 5, "Rounds; the configurations take turns in each.",
                     lower_bound=1)
flags.DEFINE_integer("warmup", 3, "Unmeasured steps per configuration first.", lower_bound=1)
flags.DEFINE_float("collective_timeout", 0.0,
                   "Timeout (s) of tfsplit's collectives; 0: none (see bench_step.py).",
                   lower_bound=0.0)
flags.DEFINE_enum("device_type", "CPU", ["CPU", "GPU"],
                  "Device type; logical CPUs, or the first GPU split into logical GPUs.")
flags.DEFINE_integer("gpu_memory_mb", 4096, "Memory per logical GPU.")

TP = 4
COLLECTIVES = ("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveReduceScatterV2",
               "CollectiveAllToAllV2")


def _initial_values():
  """[(name, value, DTensor sharding spec)] of the weights and inputs x, y."""
  rng = np.random.RandomState(FLAGS.seed)
  h, f = FLAGS.hidden, FLAGS.ffn
  weights = []
  for i in range(FLAGS.layers):
    weights += [(f"block{i}/w1", rng.randn(h, f) / np.sqrt(h), ("unsharded", "x")),
                (f"block{i}/b1", rng.randn(f) * 0.1, ("x",)),
                (f"block{i}/w2", rng.randn(f, h) / np.sqrt(f), ("x", "unsharded")),
                (f"block{i}/b2", rng.randn(h) * 0.1, ("unsharded",))]
  inputs = [rng.randn(FLAGS.batch, h).astype(np.float32) for _ in range(2)]
  return [(n, v.astype(np.float32), list(s)) for n, v, s in weights], inputs


def _model(make_var):
  """(training step, [(variable, name)]): the same code for every configuration;
  make_var(name, value, spec) makes one variable."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  weights, _ = _initial_values()
  slots = ["m"] + (["v"] if FLAGS.optimizer == "adam" else [])
  params = [make_var(n, v, s) for n, v, s in weights]
  state = [[make_var(f"{n}/{k}", np.zeros_like(v), s) for k in slots] for n, v, s in weights]
  count = make_var("iterations", np.zeros([], np.float32), [])
  named = list(zip(params, [n for n, _, _ in weights]))
  named += [(var, f"{n}/{k}") for (n, _, _), vs in zip(weights, state) for var, k in zip(vs, slots)]
  named.append((count, "iterations"))
  lr = FLAGS.learning_rate or (0.01 if FLAGS.optimizer == "momentum" else 0.001)

  @tf.function(autograph=False)
  def step(x, y):
    with tf.GradientTape() as tape:
      h = x
      for w1, b1, w2, b2 in zip(*[iter(params)] * 4):
        h = h + tf.matmul(tf.nn.relu(tf.matmul(h, w1) + b1), w2) + b2
      loss = tf.reduce_mean(tf.square(h - y))
    grads = tape.gradient(loss, params)
    t = count.assign_add(1.0)
    rate = lr * tf.sqrt(1.0 - tf.pow(0.999, t)) / (1.0 - tf.pow(0.9, t))
    for p, g, s in zip(params, grads, state):
      if FLAGS.optimizer == "momentum":
        p.assign_sub(lr * s[0].assign(0.9 * s[0] + g))
      else:
        m = s[0].assign(0.9 * s[0] + 0.1 * g)
        v = s[1].assign(0.999 * s[1] + 0.001 * tf.square(g))
        p.assign_sub(rate * m / (tf.sqrt(v) + 1e-7))
    return loss
  return step, named


def _dtensor_value(tensor):
  """Numpy value of a DTensor of any layout."""
  from tensorflow.experimental import dtensor  # pylint: disable=import-outside-toplevel
  layout = dtensor.fetch_layout(tensor)
  replicated = dtensor.Layout.replicated(layout.mesh, layout.rank)
  return dtensor.unpack(dtensor.relayout(tensor, replicated))[0].numpy()


def _dtensor_expanded(step, args, known):
  """NodeDefs of the per-device function of DTensor's SPMD expansion of
  `step`, which its first call registered (beside names `known` before it): a
  wrapper named after the traced function calls it. None if not found."""
  from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
  ctx = context.context()
  traced = step.get_concrete_function(*args).name
  traced = traced.decode() if isinstance(traced, bytes) else traced
  calls = [n for f in set(ctx.list_function_names()) - known
           if f.startswith(traced + "__func_")
           for n in ctx.get_function_def(f).node_def if n.op == "StatefulPartitionedCall"]
  return ctx.get_function_def(calls[0].attr["f"].func.name).node_def if len(calls) == 1 else None


def _graph_counts(nodes, by_device=False):
  """(ops, collectives) of NodeDefs, by_device: the most of any device's."""
  if nodes is None:
    return "?", "?"
  ops, collectives = collections.Counter(), collections.Counter()
  for n in nodes:
    ops[n.device if by_device else ""] += n.op not in ("Const", "Placeholder", "Identity",
                                                       "NoOp")
    collectives[n.device if by_device else ""] += n.op in COLLECTIVES
  return max(ops.values()), max(collectives.values())


def _check(runs, steps):
  """Runs every (step, args, values_fn) `steps` times; SystemExit unless the
  losses and final values all match the first run's to --rtol."""
  results = {}
  for name, (fn, args, values) in runs.items():
    losses = [float(np.asarray(fn(*args))) for _ in range(steps)]
    results[name] = (losses, values())
  (ref_name, (ref_losses, ref)), *others = results.items()
  worst = []
  for name, (losses, got) in others:
    errs = [(abs(a - b) / max(abs(b), 1e-30), f"loss step {i + 1}")
            for i, (a, b) in enumerate(zip(losses, ref_losses))]
    errs += [(np.abs(got[k] - v).max() / max(np.abs(v).max(), 1e-30), k) for k, v in ref.items()]
    err, what = max(errs)
    worst.append(f"{name}: {err:.1e} ({what})")
    if err > FLAGS.rtol:
      raise SystemExit(f"{name} disagrees with {ref_name} after {steps} steps: relative "
                       f"error {err:.2e} in {what} > --rtol {FLAGS.rtol:g}")
  print(f"exactness, {steps} steps vs {ref_name}, largest relative error: "
        + "; ".join(worst) + f" (losses {', '.join(f'{x:.6f}' for x in ref_losses)})")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  devices = benchlib.logical_devices(FLAGS.device_type, TP, FLAGS.gpu_memory_mb)[:TP]
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tensorflow.experimental import dtensor  # pylint: disable=import-outside-toplevel
  from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
  import tfsplit  # pylint: disable=import-outside-toplevel

  weights, inputs = _initial_values()
  with tf.device(devices[0]):
    plain, plain_names = _model(lambda n, v, s: tf.Variable(v, name=n))
    placed = [tf.identity(tf.constant(x)) for x in inputs]
  signature = [tf.TensorSpec(x.shape, tf.float32) for x in inputs]
  split_s, split = best_of(lambda: tfsplit.split(
      plain, mesh=f"tp={TP}", strategy="megatron", input_signature=signature,
      variable_names=plain_names, timeout_seconds=FLAGS.collective_timeout), 1)

  mesh = dtensor.create_mesh([("x", TP)], devices=devices, device_type=FLAGS.device_type)

  def replicated(x):
    return dtensor.copy_to_mesh(tf.constant(x), dtensor.Layout.replicated(mesh, x.ndim))
  dstep, dnames = _model(lambda n, v, s: dtensor.DVariable(
      dtensor.relayout(replicated(v), dtensor.Layout(s, mesh)), name=n))
  dargs = [replicated(x) for x in inputs]
  print(f"layouts (dtensor | tfsplit, split in {split_s:.2f} s):")
  for var, name in dnames[:4]:
    spec = dtensor.fetch_layout(var).sharding_specs
    print(f"  {name:<14} {str(spec):<28} | {split.manifest[name]['sharding']}")
    if spec != [s for n, _, s in weights if n == name][0]:
      raise SystemExit(f"DTensor did not keep the layout of {name}: {spec}")

  known = set(context.context().list_function_names())  # before DTensor's first call
  _check({"one device": (plain, placed, lambda: {n: v.numpy() for v, n in plain_names}),
          "dtensor tp=4": (dstep, dargs, lambda: {n: _dtensor_value(v.read_value())
                                                  for v, n in dnames}),
          "tfsplit tp=4": (split, placed, split.full_values)}, FLAGS.check_steps)
  expanded = _dtensor_expanded(dstep, dargs, known)
  plain_graph = plain.get_concrete_function(*signature).graph.as_graph_def()
  # name: (step, args, (ops, collectives) per device of a step, baseline name)
  configs = {"one device": (plain, placed, _graph_counts(plain_graph.node), None),
             "dtensor tp=4": (dstep, dargs, _graph_counts(expanded), "one device"),
             "tfsplit tp=4": (split, placed, _graph_counts(split.graph_def.node, True),
                              "dtensor tp=4")}

  samples, round_medians = benchlib.take_turns(
      {name: (fn, args) for name, (fn, args, _, _) in configs.items()},
      FLAGS.warmup, FLAGS.rounds, FLAGS.steps)
  median = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
  print(f"{FLAGS.layers} Megatron MLP blocks {FLAGS.hidden}x{FLAGS.ffn}, batch {FLAGS.batch}, "
        f"{FLAGS.optimizer}, {FLAGS.device_type} logical devices, {FLAGS.rounds} rounds x "
        f"{FLAGS.steps} steps after {FLAGS.warmup} warm-up steps, {os.cpu_count()} cores, "
        f"tfsplit collective timeout {FLAGS.collective_timeout:g} s")
  header = (f"{'configuration':<14} {benchlib.TIMING_HEADER} {'ops/dev':>7} "
            f"{'AR/dev':>6}  ratio")
  print(header)
  print("-" * len(header))
  for name, (_, _, (nodes, coll), baseline) in configs.items():
    ratio = f"{median[name] / median[baseline]:.2f} x {baseline}" if baseline else ""
    print(f"{name:<14} {benchlib.timing_columns(samples[name], round_medians[name])} "
          f"{nodes:>7} {coll:>6}  {ratio}")

if __name__ == "__main__":
  app.run(main)
