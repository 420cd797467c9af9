"""Benchmark: estimated vs measured memory and step time of training steps.

For each example model (default: mlp_raw, gpt_raw and gpt_keras3, size
small), in a fresh Python process:

- measured memory: the CPU allocator's peak over one training step
  (tf.config.experimental.get_memory_info('CPU:0')['peak'] after a
  warm-up step and reset_memory_stats), the median over 15 steps; TF_CPU_ALLOCATOR_USE_BFC=true makes
  the CPU allocator a BFC allocator that keeps these statistics. One process
  per model: all CPU devices of a process share one allocator;
- measured time: the median of --steps calls of the training step's
  ConcreteFunction (the graph's time; the tf.function's, which adds Python
  dispatch, is printed beside it), in three windows (before, between and
  after the calibrations); the median window counts;
- estimated memory: tfsplit's single-device simulation of the step's graph
  (variables, constants and inputs, plus the simulated peak of tensors);
- estimated time: the simulation priced by a cost table that `calibrate`
  measured in the same process (the micro-benchmark, plus the graph's ops
  when --calibrate_graph), and by the micro-benchmark alone.

With --passes, each model's step rewritten by tfsplit.split with each memory
pass instead, memory only, one process per model and pass (measure_pass): recompute (recompute='blocks' over
dp=1: one device, the allocator's peak is the device's) and zero (zero=1
over dp=2: both logical devices draw on the process's one CPU allocator, so
the measured peak is the sum over devices, compared with the simulated peak
of that sum, GraphSimResult.shared_peak, not with the sum of per-device
peaks, which would count the devices' peaks as if they coincided). Beside
the peak: the step's shard variables as created (the state ZeRO shards,
exact in any process) against the estimate's, and the estimate of the same mesh
without the pass (a comparison that passes for it too cannot see the pass).
offload (offload='optimizer' over dp=1 on CPU:1, its host CPU:0: two logical
devices on the one allocator, compared as zero's): the shared peak hardly
moves (the slots change device, not allocator), so the state per device is
printed beside it, estimated against the manifest's shards: the host holds
the slots, the mesh device the weights. Beside the estimate (the ops in the
order TF's executor runs them, graph_sim.executor_order), the same graph's
estimate with its ops in graph order: what the order alone changes.

    python tools/bench_estimate.py [--models mlp_raw:small,gpt_raw:small]
    python tools/bench_estimate.py --models gpt_raw:small --passes \
        none,recompute,zero,offload [--batch 2]
"""
import json
import os
import subprocess
import sys

from absl import app
from absl import flags

import benchlib  # sys.path: repo root, examples/ (pylint: disable=unused-import)

_MEMORY_STEPS = 15
FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mlp_raw:small", "gpt_raw:small",
                             "gpt_keras3:small"], "NAME:SIZE of each model.")
flags.DEFINE_integer("steps", 20, "Timed training steps per model (median).")
flags.DEFINE_boolean("time", True, "Also measure and estimate step time "
                     "(calibration takes a few seconds per model).")
flags.DEFINE_list("passes", [], "Instead, measure each model rewritten by "
                  "each of these: none (split over dp=1, no pass), recompute "
                  "(recompute='blocks', dp=1), zero (zero=1, dp=2), offload "
                  "(offload='optimizer', dp=1 on CPU:1, host CPU:0); memory "
                  "only.")
flags.DEFINE_integer("batch", 0, "Batch size of every model (0: the size's "
                     "default).", lower_bound=0)
flags.DEFINE_string("one", None, "Internal: measure NAME:SIZE here and print "
                    "one JSON line.")
flags.DEFINE_string("one_pass", "", "Internal: the pass --one measures "
                    "(a PASSES key; none: split over dp=1 without a pass).")

# Each memory pass as tfsplit.split's arguments. One process holds one CPU
# allocator for all its logical devices, so a multi-device split (zero over
# dp=2) is measured as the sum over its devices, and compared with the
# estimate of the same sum (graph_sim's shared_peak).
PASSES = {
    "none": None,
    "recompute": {"mesh": "dp=1", "recompute": "blocks"},
    "zero": {"mesh": "dp=2", "zero": 1},
    # FSDP: the weights split over dp too, gathered layer by layer.
    "zero3": {"mesh": "dp=2", "zero": 3},
    # The mesh on CPU:1 (an accelerator's stand-in), its host CPU:0 apart
    # from it: the slots and their updates on the host, the weights on CPU:1.
    "offload": {"mesh": "dp=1", "offload": "optimizer"},
}
# Passes whose mesh sits on CPU:1.. with CPU:0 its host (a device apart).
HOSTED = ("offload",)


def measure_one(name, size, steps, with_time, precision=None):
  """Measured and estimated figures of one model, as a dict (precision: a
  corpus model's Keras mixed policy, e.g. mixed_bfloat16)."""
  import statistics  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import models  # pylint: disable=import-outside-toplevel
  from tfsplit.cost import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.cost import graph_sim, op_cost  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import Graph, find_variables, infer_shapes, load_graph  # pylint: disable=import-outside-toplevel

  if not with_time:
    # Memory only: one inter-op thread, so ops run one at a time in a fixed
    # order, as the simulator models them; with two threads the peak wanders
    # with scheduling (the MLP's by +-25% between runs on a loaded 2-core
    # machine). Timing runs keep TF's default threads, as training would.
    tf.config.threading.set_inter_op_parallelism_threads(1)
  ex = models.build(name, size, seed=0, precision=precision)
  inputs = [tf.constant(x) for x in ex.make_inputs("train", seed=1)]
  ex.train_step(*inputs)  # trace, Grappler, kernels
  # The peak depends on the order TF's inter-op threads run ready ops in,
  # which changes from step to step: keep the median of several steps.
  peaks = []
  for _ in range(_MEMORY_STEPS):
    tf.config.experimental.reset_memory_stats("CPU:0")
    ex.train_step(*inputs).numpy()
    peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
  out = {"model": f"{name}:{size}" + (f":{precision}" if precision else ""),
         "measured_peak": int(
      statistics.median(peaks)), "measured_peaks": peaks}
  graph_def = load_graph(ex.concrete("train"))
  graph = Graph(graph_def)
  variables = find_variables(graph)
  shapes = infer_shapes(graph, variables)
  cluster = cluster_lib.from_preset("cpu-host", 1)
  res = graph_sim.simulate_graph(graph, cluster, shapes=shapes,
                                 variables=variables)
  out["estimated_peak"] = res.memory[0].peak
  out["memory"] = res.memory[0].as_dict()
  if with_time:
    # The graph's own time: a call of its ConcreteFunction. A tf.function
    # call adds Python dispatch (argument binding, trace-cache lookup) on
    # top, which no graph estimate can see; it is printed beside it. Steps
    # are timed in three windows, before, between and after the two
    # calibrations, and the median window counts: a burst of other work on
    # the machine spoils one window, not the figure.
    from tfsplit.calibration.run import calibrate  # pylint: disable=import-outside-toplevel
    timed = {"measured_step": (ex.concrete("train"), inputs),
             "function_step": (ex.train_step, inputs)}
    windows = {key: [] for key in timed}

    def time_window():
      _, medians = benchlib.take_turns(timed, warmup=0, rounds=1, steps=steps)
      for key, median in medians.items():
        windows[key] += median

    time_window()
    for key, graphs in (("micro", []), ("calibrated", [graph_def])):
      table = calibrate(graphs)
      res = graph_sim.simulate_graph(
          graph, cluster, op_cost.CostModel(cluster, table), shapes=shapes,
          variables=variables)
      out[f"{key}_step"] = res.step_time
      time_window()
    for key, medians in windows.items():
      out[key] = statistics.median(medians)
      out[f"{key}_windows"] = medians
  return out


def _mesh_size(mesh):
  size = 1
  for part in mesh.split(","):
    size *= int(part.split("=")[1])
  return size


def measure_pass(name, size, pass_name, batch=0):
  """Measured and estimated peak of one model's training step rewritten by
  tfsplit.split with PASSES[pass_name] ('none': split over dp=1, no pass).

  The process also holds the original model (its variables and optimizer
  slots, built by one step of the original before anything is measured):
  what is in use then is subtracted from every peak, so the measured peak is
  the split step's own (its shard variables, constants, inputs, and the
  step's transient tensors), as the estimate counts it. Every logical device
  draws on the process's one CPU allocator: the measured peak is the sum over
  devices, compared with the simulated peak of that sum (shared_peak); the
  per-device estimates are reported beside it.
  """
  import gc  # pylint: disable=import-outside-toplevel
  import statistics  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import models  # pylint: disable=import-outside-toplevel
  import tfsplit  # pylint: disable=import-outside-toplevel
  from tfsplit.cost import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.cost import graph_sim  # pylint: disable=import-outside-toplevel
  from tfsplit.layout.mesh import Mesh, local_cpu_devices  # pylint: disable=import-outside-toplevel

  kwargs = dict(PASSES[pass_name] or {"mesh": "dp=1"})
  mesh_text = kwargs["mesh"]
  hosted = pass_name in HOSTED
  ndev = _mesh_size(mesh_text) + hosted  # and the host, CPU:0
  if hosted:
    kwargs["mesh"] = Mesh.parse(mesh_text, local_cpu_devices(ndev)[1:])
  tf.config.threading.set_inter_op_parallelism_threads(1)  # see measure_one
  if ndev > 1:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * ndev)
  ex = models.build(name, size, seed=0, batch_size=batch or None)
  ex.train_step(*[tf.constant(x) for x in ex.make_inputs("train", seed=1)])
  gc.collect()
  other = tf.config.experimental.get_memory_info("CPU:0")["current"]
  step = tfsplit.split(
      ex.train_step, input_signature=ex.train_signature,
      variable_names=list(zip(ex.all_variables(), ex.variable_names())),
      **kwargs)
  # The split step's variables (its shards, from the manifest) as allocated,
  # each rounded up to the allocator's 256 bytes: exact in any process,
  # where a peak moves with the order the devices' ops interleave in.
  state = sum(-(-v.dtype.size * v.shape.num_elements() // 256) * 256
              for v in step.variables.values())
  # The same per device, from the manifest: which shards each device holds.
  device_state = _manifest_device_state(step.manifest)
  inputs = [tf.constant(x) for x in ex.make_inputs("train", seed=1)]
  float(step(*inputs))  # kernels, constants
  peaks = []
  for _ in range(_MEMORY_STEPS):
    tf.config.experimental.reset_memory_stats("CPU:0")
    float(step(*inputs))
    peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] -
                 other)
  cluster = cluster_lib.from_preset("cpu-host", ndev)
  res = graph_sim.simulate_graph(step.graph_def, cluster)
  out = {"model": f"{name}:{size}", "pass": pass_name, "mesh": mesh_text,
         "batch": int(inputs[0].shape[0]), "state": state,
         "device_state": device_state,
         "devices": list(res.device_names),
         "measured_peak": int(statistics.median(peaks)),
         "measured_peaks": peaks, "estimated_peak": res.shared_peak,
         "device_peaks": [m.peak for m in res.memory],
         "memory": [m.as_dict() for m in res.memory],
         "estimated_state": sum(m.parameters + m.optimizer_state
                                for m in res.memory),
         "estimated_device_state": {m.device: m.parameters + m.optimizer_state
                                    for m in res.memory}}
  # The same graph with its ops run in graph order instead of the executor's:
  # what the order alone changes.
  out["estimated_graph_order"] = graph_sim.simulate_graph(
      step.graph_def, cluster, schedule="graph").shared_peak
  if PASSES[pass_name]:
    # The estimate as if the pass did nothing: the same mesh without it. A
    # comparison that this also passes could not tell a pass from none.
    from tfsplit.passes import split_graph  # pylint: disable=import-outside-toplevel
    plain = split_graph(step.original_graph_def, step.mesh).graph_def
    res = graph_sim.simulate_graph(plain, cluster)
    out["estimated_without_pass"] = res.shared_peak
    out["estimated_state_without_pass"] = sum(
        m.parameters + m.optimizer_state for m in res.memory)
    out["estimated_device_state_without_pass"] = {
        m.device: m.parameters + m.optimizer_state for m in res.memory}
  return out


def _manifest_device_state(manifest):
  """{device: {'slots': bytes, 'weights': bytes}} of the split step's shard
  variables, from the manifest (a slot: an entry naming the weight it serves;
  the rest: weights and other state), each shard rounded up to the
  allocator's 256 bytes."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from tfsplit.sharding import zero as zero_lib  # pylint: disable=import-outside-toplevel
  out = {}
  for entry in manifest.values():
    kind = "slots" if zero_lib.SLOT_OF_KEY in entry else "weights"
    size = np.dtype(entry["dtype"]).itemsize
    for shard in entry["shards"]:
      nbytes = int(np.prod(shard["shape"], dtype=np.int64)) * size
      row = out.setdefault(shard["device"], {"slots": 0, "weights": 0})
      row[kind] += -(-nbytes // 256) * 256
  return out


def run_one(spec, steps=20, with_time=True, timeout=600, pass_name=None,
            batch=0):
  """measure_one in a fresh process (its own allocator); returns the dict."""
  env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true",
             TF_CPP_MIN_LOG_LEVEL="2")
  cmd = [sys.executable, os.path.abspath(__file__), f"--one={spec}",
         f"--steps={steps}", f"--time={str(with_time).lower()}"]
  if pass_name:
    cmd += [f"--one_pass={pass_name}", f"--batch={batch}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                        timeout=timeout, check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if proc.returncode or not lines:
    raise RuntimeError(f"measuring {spec} failed (exit {proc.returncode}):\n"
                       f"{proc.stderr[-3000:]}")
  return json.loads(lines[-1])


def _ratio(est, real):
  return f"{est / real:.3f}" if real else "-"


def _device_state_text(device, estimated, manifest):
  kinds = " + ".join(f"{k} {v:,d}" for k, v in sorted(manifest.items()) if v)
  return (f"{device.rsplit('/', 1)[-1]} {estimated:,d} / "
          f"{sum(manifest.values()):,d} ({kinds or 'none'})")


def print_passes(rows):
  """The --passes table: each rewritten step's peak and state, measured and
  estimated, and the estimate of the same mesh without the pass."""
  print("memory of rewritten training steps (one process each; every device "
        "on its one CPU allocator: the sum over devices)")
  print(f"  {'model':18s} {'pass':10s} {'mesh':5s} {'batch':>5s} "
        f"{'measured':>12s} {'estimated':>12s} {'ratio':>6s} "
        f"{'min-max ratio':>13s} {'no pass':>6s} {'graph':>6s} {'state':>10s} "
        f"{'est':>10s} {'ratio':>6s} {'no pass':>7s}  per-device est")
  for r in rows:
    m, e = r["measured_peak"], r["estimated_peak"]
    lo, hi = min(r["measured_peaks"]), max(r["measured_peaks"])
    without = r.get("estimated_without_pass")
    state_without = r.get("estimated_state_without_pass")
    print(f"  {r['model']:18s} {r['pass']:10s} {r['mesh']:5s} {r['batch']:5d} "
          f"{m:12,d} {e:12,d} {_ratio(e, m):>6s} "
          f"{_ratio(e, hi) + '-' + _ratio(e, lo):>13s} "
          f"{_ratio(without, m) if without else '-':>6s} "
          f"{_ratio(r['estimated_graph_order'], m):>6s} "
          f"{r['state']:10,d} {r['estimated_state']:10,d} "
          f"{_ratio(r['estimated_state'], r['state']):>6s} "
          f"{_ratio(state_without, r['state']) if state_without else '-':>7s}  "
          + " + ".join(f"{p:,d}" for p in r["device_peaks"]))
    if r["pass"] in HOSTED:
      print("    state per device, estimated / manifest: " + "; ".join(
          _device_state_text(d, est, r["device_state"].get(d, {}))
          for d, est in r["estimated_device_state"].items()))
  print("  ratio: estimate / measured (median of the steps' peaks; min-max: "
        "over the steps); no pass: the estimate of the same mesh without the "
        "pass / measured; graph: the estimate with the ops run in graph order "
        "instead of TF's executor's / measured; state: the step's shard variables as created (from "
        "the manifest), against the estimate's parameters + optimizer state "
        "over all devices (from the graph); offload: the mesh on CPU:1, its "
        "host CPU:0, the state per device beside it (the host: the slots, "
        "the mesh device: the weights)")


def main(argv):
  del argv
  if FLAGS.one:
    name, _, size = FLAGS.one.partition(":")
    size, _, precision = size.partition(":")   # name:size[:mixed policy]
    if FLAGS.one_pass:
      print(json.dumps(measure_pass(name, size or "small", FLAGS.one_pass,
                                    FLAGS.batch)))
    else:
      print(json.dumps(measure_one(name, size or "small", FLAGS.steps,
                                   FLAGS.time, precision or None)))
    return
  if FLAGS.passes:
    print_passes([run_one(spec, with_time=False, pass_name=p, batch=FLAGS.batch)
                  for spec in FLAGS.models for p in FLAGS.passes])
    return
  rows = [run_one(spec, FLAGS.steps, FLAGS.time) for spec in FLAGS.models]
  print("memory (single device, training step; allocator peak vs estimate)")
  print(f"  {'model':18s} {'measured':>12s} {'estimated':>12s} {'ratio':>7s}")
  for r in rows:
    print(f"  {r['model']:18s} {r['measured_peak']:12,d} "
          f"{r['estimated_peak']:12,d} "
          f"{_ratio(r['estimated_peak'], r['measured_peak']):>7s}")
  if FLAGS.time:
    print("step time, ms (measured: median call of the step's "
          "ConcreteFunction; estimated: simulated with a cost table from the "
          "graph's ops, and from the micro-benchmark alone)")
    print(f"  {'model':18s} {'tf.function':>11s} {'measured':>9s} "
          f"{'calibrated':>10s} {'ratio':>7s} {'micro':>9s} {'ratio':>7s}")
    for r in rows:
      m = r["measured_step"]
      print(f"  {r['model']:18s} {r['function_step'] * 1e3:11.3f} "
            f"{m * 1e3:9.3f} {r['calibrated_step'] * 1e3:10.3f}"
            f" {_ratio(r['calibrated_step'], m):>7s} "
            f"{r['micro_step'] * 1e3:9.3f} {_ratio(r['micro_step'], m):>7s}")


if __name__ == "__main__":
  app.run(main)
