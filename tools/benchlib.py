"""Small helpers shared by the benchmarks in tools/ (not part of the package).

Importing it puts the repository root (tfsplit, uninstalled) and examples/
(the example model zoo: `import models`) on sys.path, so every tool imports
benchlib before tfsplit or models.
"""
import collections
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (ROOT, os.path.join(ROOT, "examples")):
  if _path not in sys.path:
    sys.path.insert(0, _path)

# Steps are timed in turns as calibration times its own (one home for it).
from tfsplit.runtime import timing  # noqa: E402  pylint: disable=wrong-import-position

take_turns = timing.take_turns


def define_example_flags(size, what="examples/models name"):
  """--model and --size: which example of examples/models a benchmark builds."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string("model", "gpt_raw", f"Example model ({what}).")
  flags.DEFINE_string("size", size, "Example size: tiny, small or large.")


def cpu_times():
  """(steal, total) jiffies of this machine's CPUs since boot (/proc/stat),
  or None where there is no such file. Steal is the time a virtual
  machine's CPUs were ready but the host ran other guests: a shared cloud
  machine's steps slow down with it, by minutes, whatever they run."""
  try:
    with open("/proc/stat", encoding="ascii") as f:
      fields = [int(x) for x in f.readline().split()[1:]]
  except (OSError, ValueError):
    return None
  return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_share(before, after):
  """Share of CPU time stolen between two cpu_times() readings (None if
  either is None or no time passed)."""
  if before is None or after is None or after[1] <= before[1]:
    return None
  return (after[0] - before[0]) / (after[1] - before[1])


RESULT_MARK = "@bench-result "  # prefix of the line print_result writes


def print_result(result):
  """Prints `result` (JSON-serializable) as the one machine-readable line that
  run_script reads back from the process running this."""
  print(RESULT_MARK + json.dumps(result), flush=True)


def run_script(script, args, timeout):
  """Runs `python script *args` in a fresh process (its own TensorFlow runtime
  and allocators) and returns what it passed to print_result. Its other stdout
  lines are echoed as they come; its stderr goes straight to ours. Raises
  RuntimeError when it runs past `timeout` seconds (it is killed), exits
  non-zero or prints no result."""
  env = dict(os.environ, PYTHONUNBUFFERED="1")  # lines as they are printed
  proc = subprocess.Popen([sys.executable, os.path.abspath(script), *args],
                          stdout=subprocess.PIPE, text=True, env=env)
  results = []

  def pump():
    for line in proc.stdout:
      if line.startswith(RESULT_MARK):
        results.append(line[len(RESULT_MARK):])
      else:
        sys.stdout.write(line)
        sys.stdout.flush()

  reader = threading.Thread(target=pump, daemon=True)
  reader.start()
  try:
    code = proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    code = None
  finally:
    if proc.poll() is None:  # timed out, or interrupted here
      proc.kill()
      proc.wait()
    reader.join(timeout=10)
  if code is None:
    raise RuntimeError(f"timed out after {timeout:g} s")
  if code < 0:
    raise RuntimeError(f"killed by signal {-code}")
  if code:
    raise RuntimeError(f"exit status {code}")
  if not results:
    raise RuntimeError("exited without a result line")
  return json.loads(results[-1])


def best_of(fn, repeats):
  """(best seconds, last result) of calling fn() `repeats` times."""
  best, result = None, None
  for _ in range(repeats):
    # The last call's result is freed before the clock starts: freeing a
    # split function (its graph, its shard variables) is not the next call's.
    result = None
    t0 = time.perf_counter()
    result = fn()
    dt = time.perf_counter() - t0
    best = dt if best is None else min(best, dt)
  return best, result


def step_memory(fn, inputs, device, steps, warmup):
  """(median peak, median baseline, median activation bytes, least and most
  activation bytes, first loss) of `steps` calls fn(*inputs) after `warmup`
  unmeasured ones, from `device`'s allocator statistics: the memory in use
  just before a call is its baseline (variables, inputs), its peak minus
  that the activation memory. On CPU the statistics need
  TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow is imported."""
  import statistics  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  first = None
  for _ in range(warmup):
    out = fn(*inputs)
    first = float(out) if first is None else first
  peaks, bases, acts = [], [], []
  for _ in range(steps):
    tf.config.experimental.reset_memory_stats(device)
    base = tf.config.experimental.get_memory_info(device)["current"]
    out = fn(*inputs)
    loss = float(out)  # waits for the step
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    first = loss if first is None else first
    peaks.append(peak)
    bases.append(base)
    acts.append(peak - base)
  return (statistics.median(peaks), statistics.median(bases), statistics.median(acts),
          min(acts), max(acts), first)


def allocator_events(logdir):
  """Allocator events of a profile written under `logdir` (tf.profiler's
  xplane.pb): [(time ps, 'MemoryAllocation'|'MemoryDeallocation', {stat: value})]
  sorted by time; [] when no profile is there."""
  from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel
  paths = [os.path.join(d, f) for d, _, files in os.walk(logdir) for f in files
           if f.endswith(".xplane.pb")]
  if not paths:
    return []
  space = xplane_pb2.XSpace()
  with open(paths[0], "rb") as f:
    space.ParseFromString(f.read())
  events = []
  for plane in space.planes:
    names = {k: v.name for k, v in plane.event_metadata.items()}
    stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
    for line in plane.lines:
      for e in line.events:
        kind = names.get(e.metadata_id)
        if kind not in ("MemoryAllocation", "MemoryDeallocation"):
          continue
        stats = {}
        for st in e.stats:
          which = st.WhichOneof("value")
          value = getattr(st, which) if which else None
          if which == "ref_value":
            value = stat_names.get(value)
          stats[stat_names.get(st.metadata_id)] = value
        events.append((line.timestamp_ns * 1000 + e.offset_ps, kind, stats))
  events.sort(key=lambda x: x[0])
  return events


def memory_events(fn, inputs):
  """Allocator events (allocator_events) of one profiled call fn(*inputs)."""
  import tempfile  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory() as logdir:
    options = tf.profiler.experimental.ProfilerOptions(
        host_tracer_level=3, python_tracer_level=0, device_tracer_level=0)
    tf.profiler.experimental.start(logdir, options=options)
    try:
      float(fn(*inputs))
    finally:
      tf.profiler.experimental.stop()
    return allocator_events(logdir)


def live_at_peak(events):
  """(the peak's event stats, {address: its allocation's stats} of the
  buffers alive at it) of allocator events, on the allocator most of them
  come from; (None, {}) without events."""
  if not events:
    return None, {}
  allocators = [ev[2].get("allocator_name") for ev in events]
  allocator = max(set(allocators), key=allocators.count)
  events = [ev for ev in events if ev[2].get("allocator_name") == allocator]
  allocs = [i for i, ev in enumerate(events) if ev[1] == "MemoryAllocation"]
  peak_at = max(allocs, key=lambda i: events[i][2].get("bytes_allocated", 0))
  live = {}
  for _, kind, st in events[:peak_at + 1]:
    if kind == "MemoryAllocation":
      live[st.get("addr")] = st
    else:
      live.pop(st.get("addr"), None)
  return events[peak_at][2], live


def buffers_at_peak(events):
  """(the peak's event stats, {address: (bytes, op, shape, region)} of the
  buffers alive at it) of memory_events' events (live_at_peak). Buffers
  allocated before the call (variables, inputs) are not among them."""
  peak, live = live_at_peak(events)
  return peak, {addr: (st.get("allocation_bytes", 0), st.get("tf_op") or "?",
                       st.get("shape", ""), st.get("region_type", ""))
                for addr, st in live.items()}


def print_peak(peak, live, top, group_of=None, what="group"):
  """Prints buffers_at_peak's result: the peak, the bytes alive at it per
  group_of(op) (when given) and its `top` largest buffers."""
  mib = 2.0**20
  if peak is None:
    print("  (no allocator events in the profile)")
    return
  in_use = peak.get("bytes_allocated", 0)
  traced = sum(b for b, _, _, _ in live.values())
  print(f"  peak {in_use / mib:.2f} MiB in use while running {peak.get('tf_op')}; "
        f"{traced / mib:.2f} MiB of it allocated in the step ({len(live)} buffers), the "
        "rest before it (variables, inputs)")
  if group_of is not None:
    groups = collections.Counter()
    for b, op, _, _ in live.values():
      groups[group_of(op)] += b
    print(f"  alive at peak by {what}: " + ", ".join(
        f"{k} {v / mib:.2f} MiB" for k, v in sorted(groups.items())))
  if top > 0:
    print("  largest buffers alive at peak:")
  for b, op, shape, region in sorted(live.values(), key=lambda x: -x[0])[:top]:
    print(f"    {b / mib:8.3f} MiB  {op}  {shape} ({region})")


def logical_devices(device_type, count, gpu_memory_mb=None):
  """`count` logical devices of `device_type` ('CPU', or the first GPU split
  with `gpu_memory_mb` each), set before anything starts TensorFlow's
  runtime; their names."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  physical = tf.config.list_physical_devices(device_type)
  if not physical:
    raise SystemExit(f"no {device_type} device")
  if device_type == "CPU":  # tfsplit would take logical GPUs first
    tf.config.set_visible_devices([], "GPU")
  extra = {"memory_limit": gpu_memory_mb} if device_type == "GPU" else {}
  tf.config.set_logical_device_configuration(
      physical[0], [tf.config.LogicalDeviceConfiguration(**extra)] * count)
  return [d.name for d in tf.config.list_logical_devices(device_type)]


def percentile(values, q):
  ordered = sorted(values)
  return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


TIMING_HEADER = f"{'ms/step':>8} {'p10':>7} {'p90':>7} {'rounds min-max':>15}"


def timing_columns(samples, round_medians):
  """ms/step (median), p10, p90 and the round medians' range, as TIMING_HEADER."""
  s = [t * 1e3 for t in samples]
  rounds = [t * 1e3 for t in round_medians]
  return (f"{statistics.median(s):>8.2f} {percentile(s, 0.1):>7.2f} "
          f"{percentile(s, 0.9):>7.2f} {min(rounds):>7.2f}-{max(rounds):<7.2f}")


def mesh_candidates(text):
  """Candidates of bench_planner.py's --meshes: 'dp=2,tp=2 m=2;pp=2' (1f1b,
  no ZeRO)."""
  from tfsplit.plan import space  # pylint: disable=import-outside-toplevel
  out = []
  for item in filter(None, (t.strip() for t in text.split(";"))):
    mesh, _, rest = item.partition(" ")
    axes = dict(a.split("=") for a in mesh.split(","))
    m = int(rest.strip().partition("=")[2] or 1) if rest.strip() else 1
    out.append(space.Candidate(int(axes.get("dp", 1)), int(axes.get("tp", 1)),
                               int(axes.get("pp", 1)), m, ep=int(axes.get("ep", 1))))
  return out


def example_model(text):
  """(ExampleModel, its training step's GraphDef, [(variable, name)]) of a
  --measure spec 'name[:size][/d]': the example zoo's model at `size`
  (default small), and with /d its batch divided by d. A dp=2 split runs
  each replica's ops on half the batch: 'gpt_raw:small/2' unsplit times
  that share whole, on one device, beside the split."""
  import models  # pylint: disable=import-outside-toplevel
  from tfsplit.errors import TfsplitError  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  name, _, rest = text.partition(":")
  size, _, divisor = rest.partition("/")
  size, batch = size or "small", None
  if divisor:
    batch = models.config_of(name, size).batch
    if not divisor.isdigit() or int(divisor) < 1 or batch % int(divisor):
      raise TfsplitError(f"{text}: the batch ({batch}) is divided by a "
                         f"positive divisor of it after '/' (e.g. {name}:{size}/2)")
    batch //= int(divisor)
  ex = models.build(name, size=size, seed=0, batch_size=batch)
  names = list(zip(ex.all_variables(), ex.variable_names()))
  graph_def = load_graph(ex.train_step.get_concrete_function(*ex.train_signature),
                         variable_names=names)
  return ex, graph_def, names
