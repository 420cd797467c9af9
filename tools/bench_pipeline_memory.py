"""Benchmark: per-stage activation memory and bubble of a pipelined step,
gpipe vs 1f1b vs interleaved 1F1B (--virtual_stages model chunks per stage).

Splits the example's training step into S pipeline stages (`pp=S`) over m
micro-batches and runs it with one stage per worker process: S TF gRPC
servers on loopback (`/job:worker/task:i`, a subprocess of this script with
--worker=i), driven by a Session from this process (which runs no server).
All logical CPU devices of one process share one allocator (docs/tf-facts.md, fact 4),
so each worker reports its own allocator's statistics: the memory in use
after `reset_memory_stats` (baseline: the stage's variables, optimizer slots)
and the peak of the step. Activation memory = peak - baseline, the median
over --steps steps after a warm-up step, for each schedule on a fresh
cluster (variables live in the servers' resource managers).

Targets: stage 0's activation memory under 1f1b <= 0.6 x gpipe (theory
min(S, m) / m), and stage i holds at most min(S - i, m) micro-batches' worth
of activations. One micro-batch's activations on stage i is estimated from a
reference run with one micro-batch of the same size (m = 1, batch B / m):
unit_i = (gpipe_i - ref_i) / (m - 1) (gpipe keeps all m alive), and a
schedule holds 1 + (act_i - ref_i) / unit_i micro-batches.

A traced step gives each stage's forward/backward block order (step stats),
checked against the schedule's order (blocks of the interleaved schedule
carry their chunk), and the measured bubble: per stage, the share of the
traced step (first op to last op over all stages) in which none of its ops
runs for at least --min_gap_us (it waits on another stage; the shorter gaps
between ops are the executor's per-op overhead, shown apart as idle), the
median over --trace_steps traced steps; theory on uniform stages
is (S - 1) / (m + S - 1), (S - 1) / (v m + S - 1) interleaved. With fewer
CPU cores than stages the workers share cores, so ops run slower while more
stages are busy: the measured bubbles then compare schedules, not hardware. With --explain (default) every worker
also profiles one step, and the allocator events give what is alive at the
stage's peak: bytes per forward/backward block of each micro-batch (so the
micro-batches whose activations are alive are counted directly), requested
bytes against BFC chunk sizes (BFC does not split a chunk less than twice
the request, so the allocator's totals include internal fragmentation), and
bytes from other stages' ops (0: each worker's allocator serves its stage).

The batch default (256, micro-batches of 32) makes activations dominate; at
small batches per-stage constants (gradient accumulators, one micro-batch's
backward temporaries) weigh more and the 1f1b/gpipe ratios rise above theory.

Workers run with TF_CPU_ALLOCATOR_USE_BFC=true (CPU memory statistics) and,
by default, one inter-op thread (ops of a stage run one at a time); the
client runs the graph with one Grappler round, as `session_config` does for
pipelined graphs, so the schedule's control edges survive. The cluster spec
names only 127.0.0.1 ports, so all traffic stays on loopback (TF's gRPC
server itself listens on 0.0.0.0:port; it has no bind-address option). Each
worker exits on "quit" or when its stdin closes; the client kills any still
running after a bounded wait.

    python tools/bench_pipeline_memory.py [--model causallm_keras3,llama_keras3]
        [--size small] [--batch 256] [--stages 4] [--microbatches 8] [--steps 5]
        [--schedules gpipe,1f1b,interleaved] [--virtual_stages 2] [--explain_top 20]
"""
import os
import statistics
import sys
import tempfile
import time

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # before TensorFlow is imported
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

from benchlib import allocator_events, define_example_flags, live_at_peak  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfsplit.runtime import workers as workers_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
define_example_flags("small", "examples/models names, comma-separated")
FLAGS.set_default("model", "causallm_keras3,llama_keras3")
flags.DEFINE_integer("batch", 256, "Batch size (divisible by --microbatches).", lower_bound=1)
flags.DEFINE_integer("stages", 4, "Pipeline stages S (one worker process each).",
                     lower_bound=1)
flags.DEFINE_integer("microbatches", 8, "Micro-batches m.", lower_bound=1)
flags.DEFINE_list("schedules", ["gpipe", "1f1b", "interleaved"], "Schedules to compare.")
flags.DEFINE_integer("virtual_stages", 2, "Model chunks per stage of the interleaved "
                     "schedule.", lower_bound=2)
flags.DEFINE_integer("trace_steps", 3, "Traced steps per schedule (block order, "
                     "measured bubble: median).", lower_bound=1)
flags.DEFINE_float("min_gap_us", 500.0, "A stage waits (bubble) when none of its ops "
                   "runs for at least this long; shorter gaps are the executor's "
                   "per-op overhead (about 50 us an op on CPU, traced).", lower_bound=0.0)
flags.DEFINE_integer("steps", 5, "Measured steps per schedule (median).", lower_bound=1)
flags.DEFINE_integer("warmup", 1, "Unmeasured steps first.", lower_bound=0)
flags.DEFINE_integer("inter_op_threads", 1, "Inter-op threads of each worker.",
                     lower_bound=0)
flags.DEFINE_integer("intra_op_threads", 0, "Intra-op threads of each worker (0: TF's "
                     "default).", lower_bound=0)
flags.DEFINE_boolean("reference", True, "Also run m = 1 at batch B / m (one "
                     "micro-batch's activations per stage).")
flags.DEFINE_boolean("trace", True, "Run one traced step per schedule and check "
                     "each stage's block order.")
flags.DEFINE_integer("timeout", 300, "Seconds to wait for a worker reply or a step.",
                     lower_bound=1)
flags.DEFINE_float("target", 0.6, "Stage 0 target: 1f1b <= target x gpipe.")
flags.DEFINE_boolean("explain", True, "Profile one more step per schedule on every "
                     "worker and print what is alive at each stage's peak.")
flags.DEFINE_integer("explain_top", 0, "Largest live buffers to print per stage.",
                     lower_bound=0)
# Worker mode (internal).
flags.DEFINE_integer("worker", -1, "Internal: run as worker task i.")
flags.DEFINE_list("ports", [], "Internal: the workers' loopback ports.")

_MIB = 2.0**20
_HOST = workers_lib.HOST


# ---------------------------------------------------------------- worker side

def _worker_main(index, ports):
  """One TF server (task `index`) answering memory commands on stdin."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  workers_lib.start_server(workers_lib.cluster_spec(ports), workers_lib.JOB, index,
                           inter_op_threads=FLAGS.inter_op_threads,
                           intra_op_threads=FLAGS.intra_op_threads)
  device = "CPU:0"

  def info(_arg=None):
    mem = tf.config.experimental.get_memory_info(device)
    return {"task": index, "current": int(mem["current"]), "peak": int(mem["peak"])}

  def reset(_arg):
    tf.config.experimental.reset_memory_stats(device)
    return info()

  def profile(logdir):
    options = tf.profiler.experimental.ProfilerOptions(
        host_tracer_level=3, python_tracer_level=0, device_tracer_level=0)
    tf.profiler.experimental.start(logdir, options=options)
    return info()

  def endprofile(_arg):
    tf.profiler.experimental.stop()
    return info()

  workers_lib.serve_forever(info(), {"reset": reset, "peak": info, "profile": profile,
                                     "endprofile": endprofile})


# ---------------------------------------------------------------- client side

class _Workers(workers_lib.WorkerGroup):
  """S worker processes (one TF server each, this script with --worker=i)
  on free loopback ports, and their command channels."""

  def __init__(self, n, logdir, timeout):
    self.ports = workers_lib.free_ports(n)
    script = os.path.abspath(__file__)
    cmds = [[sys.executable, script, f"--worker={i}",
             "--ports=" + ",".join(str(p) for p in self.ports),
             f"--inter_op_threads={FLAGS.inter_op_threads}",
             f"--intra_op_threads={FLAGS.intra_op_threads}"] for i in range(n)]
    super().__init__(cmds, logdir=logdir, timeout=timeout)


def _client_config(graph_def):
  """Session config: one Grappler round (keeps schedule edges), bounded ops."""
  from tensorflow.core.protobuf import rewriter_config_pb2  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import session as session_lib  # pylint: disable=import-outside-toplevel
  config = session_lib.session_config(graph_def)
  config.graph_options.rewrite_options.meta_optimizer_iterations = (
      rewriter_config_pb2.RewriterConfig.ONE)
  config.operation_timeout_in_ms = FLAGS.timeout * 1000
  return config


def _measure(label, ex, graph_def, schedule, microbatches, logdir):
  """{stage: activation bytes (median)}, loss, partition, block orders."""
  from tfsplit.graph import Graph  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.layers import detect_layers  # pylint: disable=import-outside-toplevel
  from tfsplit.pipeline.schedules import get_schedule  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import session as session_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import trace as trace_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.sharding.builder import read_records  # pylint: disable=import-outside-toplevel
  from tfsplit.layout.mesh import Mesh  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import split_graph  # pylint: disable=import-outside-toplevel
  stages = FLAGS.stages
  t0 = time.time()
  workers = _Workers(stages, logdir, FLAGS.timeout)
  runner = None
  try:
    devices = [f"/job:worker/replica:0/task:{s}/device:CPU:0" for s in range(stages)]
    mesh = Mesh({"pp": stages}, devices)
    chunks = FLAGS.virtual_stages if schedule == "interleaved" else 1
    result = split_graph(graph_def, mesh, microbatches=microbatches, schedule=schedule,
                         timeout_seconds=FLAGS.timeout, virtual_stages=chunks)
    values = session_lib.seeded_values(result.graph_def, result.manifest)
    runner = session_lib.SessionRunner(
        result.graph_def, values, target=f"grpc://{_HOST}:{workers.ports[0]}",
        config=_client_config(result.graph_def))
    inputs = ex.make_inputs("train", seed=1)
    first = None
    for _ in range(FLAGS.warmup):
      out, _ = runner.run(inputs)
      first = float(out[0]) if first is None else first
    acts, bases, peaks, times = [], [], [], []
    for _ in range(FLAGS.steps):
      base = workers.command("reset")
      t1 = time.perf_counter()
      out, _ = runner.run(inputs)
      times.append(time.perf_counter() - t1)
      first = float(out[0]) if first is None else first
      peak = workers.command("peak")
      bases.append([b["current"] for b in base])
      peaks.append([p["peak"] for p in peak])
      acts.append([p["peak"] - b["current"] for b, p in zip(base, peak)])
    med = lambda rows, s: statistics.median(r[s] for r in rows)
    stats = {s: {"act": med(acts, s), "base": med(bases, s), "peak": med(peaks, s),
                 "lo": min(r[s] for r in acts), "hi": max(r[s] for r in acts)}
             for s in range(stages)}
    orders = bubble = idle = None
    if FLAGS.trace:
      roles = detect_layers(Graph(graph_def)).block_roles()
      want = get_schedule(schedule, chunks)
      bubbles, idles = [], []
      for i in range(FLAGS.trace_steps):
        _, metadata = runner.run(inputs, trace=True)
        events = trace_lib.op_events(metadata)
        bubbles.append(trace_lib.stage_waits(events, devices, FLAGS.min_gap_us))
        idles.append(trace_lib.stage_waits(events, devices))
        if i == 0:
          blocks = trace_lib.microbatch_blocks(
              events, roles, mesh.with_microbatches(microbatches), result.graph_def,
              chunk_of=result.stage_of if chunks > 1 else None)
          orders = {s: ([b[0] for b in blocks.get(s, [])],
                        want.order(s, stages, microbatches)) for s in range(stages)}
      bubble = [statistics.median(b[s] for b in bubbles) for s in range(stages)]
      idle = [statistics.median(b[s] for b in idles) for s in range(stages)]
    explained = None
    if FLAGS.explain:
      dirs = [os.path.join(logdir, f"profile_{schedule}_{microbatches}_{s}")
              for s in range(stages)]
      workers.command("reset")
      workers.command([f"profile {d}" for d in dirs])
      try:
        runner.run(inputs)
      finally:
        workers.command("endprofile")
      roles = detect_layers(Graph(graph_def)).block_roles()
      records = read_records(result.graph_def)
      explained = [_explain_stage(d, s, roles, mesh.with_microbatches(microbatches),
                                  records)
                   for s, d in enumerate(dirs)]
    per_stage = "" if bubble is None else ", bubble per stage " + " ".join(
        f"{100 * b:.1f}%" for b in bubble)
    print(f"[{label}] {len(result.graph_def.node)} nodes, loss {first:.6f}, "
          f"step {1e3 * statistics.median(times):.1f} ms{per_stage}, "
          f"{time.time() - t0:.1f}s", flush=True)
    return {"stats": stats, "loss": first, "partition": result.partition,
            "orders": orders, "explained": explained, "bubble": bubble, "idle": idle,
            "step": statistics.median(times), "chunks": chunks}
  finally:
    if runner is not None:
      runner.session.close()
    workers.stop()



def _explain_stage(logdir, stage, roles, mesh, records):
  """What is alive at the peak of one profiled step on one worker (`stage`).

  Returns a dict: peak bytes in use, the op running at the peak, bytes
  allocated by ops of other stages (0 if the worker's allocator serves only
  its own stage's ops), per
  (F|B|other, micro-batch) the [allocated, requested] bytes alive, the
  micro-batches whose forward activations are alive, and the largest buffers.
  Allocated bytes are BFC chunk sizes: a chunk less than twice the request is
  not split, so a buffer may hold up to twice what its op asked for.
  """
  peak, alive = live_at_peak(allocator_events(logdir))
  if peak is None:
    return None
  live = {addr: (st.get("allocation_bytes", 0), st.get("requested_bytes", 0),
                 st.get("tf_op") or "?", st.get("shape", "")) for addr, st in alive.items()}
  groups, foreign = {}, 0
  for size, requested, op, _ in live.values():
    record = records.get(op.split(":")[0])  # the split's record of the op
    origin = (record.source, record.device_id) if record else None
    key = ("other", -1)
    if origin is not None and origin[1] < mesh.size:
      if "pp" in mesh.axes and mesh.coord(origin[1], "pp") != stage:
        foreign += size
      role = roles.get(origin[0])
      j = mesh.coord(origin[1], "mb") if "mb" in mesh.axes else 0
      key = ({"forward": "F", "backward": "B"}.get(role, "other"), j)
    total = groups.setdefault(key, [0, 0])
    total[0] += size
    total[1] += requested
  forward = {k[1]: v[1] for k, v in groups.items() if k[0] == "F"}
  big = max(forward.values(), default=0)
  return {"peak": peak.get("bytes_allocated", 0),
          "allocated": sum(v[0] for v in live.values()),
          "requested": sum(v[1] for v in live.values()),
          "op": peak.get("tf_op"), "groups": groups, "foreign": foreign,
          # Micro-batches with forward activations alive (ignoring small
          # leftovers such as a tensor received from the previous stage).
          "alive": sorted(j for j, b in forward.items() if b >= 0.25 * big),
          "top": sorted(live.values(), key=lambda x: -x[0])[:FLAGS.explain_top]}


def _print_explained(label, explained):
  print(f"[{label}] alive at each stage's peak (profiled step; F/B j = buffers "
        "allocated by forward/backward ops of micro-batch j, requested MiB):")
  for s, info in enumerate(explained):
    if info is None:
      print(f"  stage {s}: no allocator events in the profile")
      continue
    print(f"  stage {s}: peak {info['peak'] / _MIB:.2f} MiB in use while running "
          f"{info['op']}; step buffers alive {info['requested'] / _MIB:.2f} MiB requested "
          f"in {info['allocated'] / _MIB:.2f} MiB of BFC chunks; forward activations of "
          f"micro-batches {info['alive']}; {info['foreign'] / _MIB:.2f} MiB from ops of "
          "other stages")
    parts = []
    for kind in ("F", "B", "other"):
      keys = sorted(k for k in info["groups"] if k[0] == kind)
      if keys:
        parts.append(f"{kind} " + " ".join(
            f"{k[1] if k[1] >= 0 else '-'}:{info['groups'][k][1] / _MIB:.2f}"
            for k in keys))
    print("    " + "; ".join(parts))
    for size, requested, op, shape in info["top"]:
      print(f"    {size / _MIB:8.3f} MiB chunk ({requested / _MIB:.3f} requested)  {op}  "
            f"{shape}")


def _order_text(seq):
  """'F0 B0', or 'F0.1 B0.1' (micro-batch.chunk) for interleaved blocks."""
  return " ".join(f"{b[0]}{b[1]}" + (f".{b[2]}" if len(b) > 2 else "") for b in seq)


def _theory_bubble(schedule, stages, m):
  v = FLAGS.virtual_stages if schedule == "interleaved" else 1
  return (stages - 1) / (v * m + stages - 1)


def _theory_held(schedule, stage, stages, m):
  """Micro-batches' activations stage `stage` holds at its peak, on uniform
  stages (interleaved: chunk activations / v)."""
  if schedule == "gpipe":
    return m
  if schedule == "interleaved":
    v = FLAGS.virtual_stages
    return min(2 * (stages - stage - 1) + (v - 1) * stages + 1, v * m) / v
  return min(stages - stage, m)


def _bench_model(model):
  """Runs every schedule (and the m = 1 reference) on `model`; prints its
  tables; returns its summary rows."""
  import models  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel

  s_count, m = FLAGS.stages, FLAGS.microbatches

  def graph_for(batch):
    ex = models.build(model, size=FLAGS.size, seed=0, batch_size=batch)
    names = list(zip(ex.all_variables(), ex.variable_names()))
    return ex, load_graph(ex.concrete("train"), variable_names=names)

  ex, graph_def = graph_for(FLAGS.batch)
  print(f"{model}/{FLAGS.size} batch {FLAGS.batch}, S={s_count} stages (one "
        f"worker process each, loopback gRPC), m={m}; {FLAGS.inter_op_threads} "
        f"inter-op thread(s) per worker; median of {FLAGS.steps} steps after "
        f"{FLAGS.warmup} warm-up", flush=True)
  runs = {}
  with tempfile.TemporaryDirectory(prefix="bench_pipeline_memory_") as logdir:
    for schedule in FLAGS.schedules:
      runs[schedule] = _measure(f"{model} {schedule}", ex, graph_def, schedule, m, logdir)
    ref = None
    if FLAGS.reference and m > 1:
      ref_ex, ref_graph = graph_for(FLAGS.batch // m)
      ref = _measure(f"{model} reference m=1 batch {FLAGS.batch // m}", ref_ex, ref_graph,
                     "gpipe", 1, logdir)

  names = list(runs)
  gp, ob = runs.get("gpipe"), runs.get("1f1b")
  explained = FLAGS.explain and all(runs[n]["explained"] for n in names)
  print()
  header = f"{'stage':>5} {'layers':<28} {'base MiB':>8}"
  header += "".join(f" {n + ' MiB':>10}" for n in names)
  if gp:
    header += "".join(f" {n + '/gpipe':>10} {'theory':>6}" for n in names if n != "gpipe")
  if ref and gp:
    header += f" {'m=1 MiB':>8} {'1 mb MiB':>8}"
    header += "".join(f" {n + ' held':>10}" for n in names)
  if explained:
    header += "".join(f" {n + ' live':>10}" for n in names)
  header += f" {'bound':>5}"
  print(header)
  print("-" * len(header))
  for s in range(s_count):
    # The layers of every chunk on the stage ('|' between chunks).
    partition = runs[names[0]]["partition"]
    layers = "|".join(",".join(l.split("/")[-1] for l in partition[c])
                      for c in range(s, len(partition), s_count))
    row = f"{s:>5} {layers:<28} {runs[names[0]]['stats'][s]['base'] / _MIB:>8.2f}"
    row += "".join(f" {runs[n]['stats'][s]['act'] / _MIB:>10.2f}" for n in names)
    if gp:
      for n in names:
        if n != "gpipe":
          ratio = runs[n]["stats"][s]["act"] / gp["stats"][s]["act"]
          row += f" {ratio:>10.3f} {_theory_held(n, s, s_count, m) / m:>6.3f}"
    if ref and gp:
      r = ref["stats"][s]["act"]
      unit = (gp["stats"][s]["act"] - r) / (m - 1)
      row += f" {r / _MIB:>8.2f} {unit / _MIB:>8.2f}"
      for n in names:
        held = 1 + (runs[n]["stats"][s]["act"] - r) / unit if unit > 0 else float("nan")
        row += f" {held:>10.2f}"
    if explained:
      row += "".join(f" {len(runs[n]['explained'][s]['alive']):>10}" for n in names)
    row += f" {min(s_count - s, m):>5}"
    print(row)
  print()
  for n in names:
    spread = ", ".join(
        f"{runs[n]['stats'][s]['lo'] / _MIB:.2f}-{runs[n]['stats'][s]['hi'] / _MIB:.2f}"
        for s in range(s_count))
    print(f"{n}: loss {runs[n]['loss']:.6f}; activation MiB min-max per stage: {spread}")
  if len(names) > 1:
    losses = [runs[n]["loss"] for n in names]
    print(f"losses equal: {all(l == losses[0] for l in losses)} "
          f"(max difference {max(losses) - min(losses):.3g})")
  if FLAGS.trace:
    for n in names:
      for s, (got, want) in runs[n]["orders"].items():
        status = "matches schedule" if got == want else f"SCHEDULE {_order_text(want)}"
        print(f"{n} stage {s} block order: {_order_text(got)}  ({status})")
  if FLAGS.explain:
    print()
    for n in names:
      _print_explained(n, runs[n]["explained"])
    if ref:
      _print_explained("reference m=1", ref["explained"])
  print()
  print("base = allocator bytes in use on the stage's worker after reset_memory_stats "
        "(variables, optimizer slots); act = peak - base over one step (activations, "
        "gradient accumulators, received tensors); theory = micro-batches held on "
        "uniform stages / m (1f1b min(S - i, m), interleaved "
        "min(2 (S - i - 1) + (v - 1) S + 1, v m) chunks / v); "
        "1 mb = one micro-batch's activations on the stage = (gpipe - m=1) / (m - 1); "
        "held = 1 + (act - m=1) / (1 mb), from allocator totals (BFC chunk sizes, "
        "so it includes internal fragmentation); live = micro-batches whose forward "
        "activations are alive at the stage's peak (profiled step); bound = "
        "min(S - i, m) for 1f1b")
  tag = f"[{model} {FLAGS.size} b={FLAGS.batch} S={s_count} m={m}]"
  if gp and ob:
    ratio = ob["stats"][0]["act"] / gp["stats"][0]["act"]
    verdict = "PASS" if ratio <= FLAGS.target else "FAIL"
    print(f"{tag} stage 0 activation memory 1f1b/gpipe: {ratio:.3f} (target <= "
          f"{FLAGS.target}, theory {min(s_count, m) / m:.3f}): {verdict}")
  if ob and explained:
    live = [len(ob["explained"][s]["alive"]) for s in range(s_count)]
    bound = [min(s_count - s, m) for s in range(s_count)]
    verdict = "PASS" if all(l <= b for l, b in zip(live, bound)) else "FAIL"
    print(f"{tag} 1f1b micro-batches alive per stage at its peak: {live} (bound "
          f"min(S - i, m) = {bound}): {verdict}")
  il = runs.get("interleaved")
  if ob and il and ob["bubble"] and il["bubble"]:
    b1, bi = (sum(r["bubble"]) / len(r["bubble"]) for r in (ob, il))
    print(f"{tag} bubble interleaved/1f1b: {100 * bi:.1f}% / {100 * b1:.1f}% "
          f"(step {1e3 * il['step']:.1f} / {1e3 * ob['step']:.1f} ms): "
          f"{'PASS' if bi < b1 else 'FAIL'}")
  rows = []
  for n in names:
    run = runs[n]
    bubble = run["bubble"]
    rows.append({
        "model": model, "schedule": n, "v": run["chunks"], "step_ms": run["step"] * 1e3,
        "bubble": sum(bubble) / len(bubble) if bubble else float("nan"),
        "idle": sum(run["idle"]) / len(run["idle"]) if run["idle"] else float("nan"),
        "theory": _theory_bubble(n, s_count, m),
        "act0": run["stats"][0]["act"],
        "act0_gpipe": run["stats"][0]["act"] / gp["stats"][0]["act"] if gp else
                      float("nan"),
        "held0_theory": _theory_held(n, 0, s_count, m) / m,
        "order_ok": all(g == w for g, w in run["orders"].values()) if run["orders"]
                    else None})
  return rows


def main(argv):
  del argv
  if FLAGS.worker >= 0:
    _worker_main(FLAGS.worker, [int(p) for p in FLAGS.ports])
    return
  m = FLAGS.microbatches
  if FLAGS.batch % m:
    raise app.UsageError(f"--batch {FLAGS.batch} is not divisible by --microbatches {m}")
  if "interleaved" in FLAGS.schedules and m % FLAGS.stages:
    raise app.UsageError(f"the interleaved schedule needs --microbatches {m} to be a "
                         f"multiple of --stages {FLAGS.stages}")
  rows = []
  for model in FLAGS.model.split(","):
    rows += _bench_model(model.strip())
    print()
  print(f"summary: S={FLAGS.stages} m={m} batch {FLAGS.batch} ({FLAGS.size}); bubble = "
        "mean over stages of the share of the traced step (median of "
        f"{FLAGS.trace_steps}) in which the stage waits (no op of it runs for >= "
        f"{FLAGS.min_gap_us:g} us); idle = every gap between its ops; theory "
        "(S-1)/(vm+S-1); stage-0 act = its activation memory (peak - base), / gpipe "
        "with its uniform-stage theory")
  header = (f"{'model':<18} {'schedule':<11} {'v':>2} {'step ms':>9} {'bubble':>7} "
            f"{'idle':>7} {'theory':>7} {'stage-0 act MiB':>15} {'/gpipe':>7} {'theory':>7} "
            f"{'order':>6}")
  print(header)
  print("-" * len(header))
  for r in rows:
    order = {True: "ok", False: "WRONG", None: "-"}[r["order_ok"]]
    print(f"{r['model']:<18} {r['schedule']:<11} {r['v']:>2} {r['step_ms']:>9.1f} "
          f"{100 * r['bubble']:>6.1f}% {100 * r['idle']:>6.1f}% {100 * r['theory']:>6.1f}% "
          f"{r['act0'] / _MIB:>15.2f} {r['act0_gpipe']:>7.3f} {r['held0_theory']:>7.3f} "
          f"{order:>6}")


if __name__ == "__main__":
  app.run(main)
