"""Event-driven simulation of a task DAG over devices and links.

The simulator knows nothing of TensorFlow: a task is a name, a resource (a
device's compute stream, a link's comm stream, or none), a duration, data and
control dependencies, and optionally bytes it allocates on a device. A later
pass turns a rewritten GraphDef into such a DAG; pipeline_sim builds one for a
pipeline schedule on uniform stages.

Semantics:
- A resource runs one task at a time. When it is free it starts, among its
  ready tasks, the one with the lowest priority (default: insertion order), as
  TF's executor runs whatever is ready. Tasks without a resource start as soon
  as they are ready (zero-cost sync points, host-side bookkeeping).
- Data and control dependencies both order tasks; only data dependencies keep
  memory alive. A task's `alloc` bytes are taken on its device when it starts
  and given back when its last data consumer finishes (at its own end if it
  has none), unless it is `persistent`. Each device also has static bytes
  (weights, gradients, optimizer state) held for the whole step.
- A collective is one task on one link resource per communicator group: TF
  runs the collectives of a group in order, and a device's compute stream
  overlaps its communication.

The inner loop uses plain lists, ints and heapq and no per-task objects, so a
48-layer step split over 64 devices (~150k tasks) simulates in well under a
second.
"""
import gc
import heapq
import time

from absl import logging

from tfsplit.errors import PlanError

COMPUTE = "compute"
COMM = "comm"
NO_RESOURCE = -1


class TaskGraph:
  """A DAG of tasks over resources; build it, then call simulate()."""

  def __init__(self):
    # Resources, by id.
    self.resource_names = []
    self.resource_kinds = []      # COMPUTE (a device) or COMM (a link)
    self.resource_devices = []    # device ids a link connects; (id,) for a device
    self.static_bytes = []        # per resource; only devices hold memory
    # Tasks, by id (parallel lists: no per-task objects).
    self.names = []
    self.resources = []
    self.durations = []
    self.kinds = []
    self.data_deps = []
    self.control_deps = []
    self.alloc = []
    self.mem_device = []
    self.persistent = []
    self.priority = []
    # Kept up to date as edges are added, so simulate() need not rebuild them.
    self._succ = []       # consumers, data and control
    self._ndeps = []      # data + control dependency count
    self._nconsumers = []  # data consumers (they hold the allocation)
    self._frees = []      # data deps whose allocation this task may release

  def __len__(self):
    return len(self.names)

  @property
  def devices(self):
    return [r for r, k in enumerate(self.resource_kinds) if k == COMPUTE]

  def add_device(self, name, static_bytes=0):
    """A device with one compute stream; returns its resource id."""
    rid = len(self.resource_names)
    self.resource_names.append(name)
    self.resource_kinds.append(COMPUTE)
    self.resource_devices.append((rid,))
    self.static_bytes.append(int(static_bytes))
    return rid

  def add_link(self, name, devices=()):
    """A comm stream (a link, or a collective's group) between `devices`."""
    for d in devices:
      self._check_device(d, f"link '{name}'")
    rid = len(self.resource_names)
    self.resource_names.append(name)
    self.resource_kinds.append(COMM)
    self.resource_devices.append(tuple(devices))
    self.static_bytes.append(0)
    return rid

  def set_priority(self, task, priority):
    """Sets the priority `task` runs with (lower first among ready tasks on
    its resource), e.g. to simulate one graph in another order."""
    self._check_task(task)
    self.priority[task] = int(priority)

  def set_static_bytes(self, device, nbytes):
    self._check_device(device, "set_static_bytes")
    self.static_bytes[device] = int(nbytes)

  def add_task(self, name, resource, duration, deps=(), control_deps=(),
               kind=None, alloc=0, mem_device=None, persistent=False,
               priority=None):
    """Adds a task and returns its id.

    Args:
      name: for reports and traces.
      resource: a device or link id, or None for a task that needs neither.
      duration: seconds.
      deps: ids of tasks whose outputs it reads (they stay allocated until
        it finishes).
      control_deps: ids of tasks it must run after (no data).
      kind: a label for traces and Gantt charts ('forward', 'backward',
        'comm', ...); defaults to the resource's kind.
      alloc: bytes its output takes on `mem_device` (default: its device).
      persistent: the allocation is never freed within the step.
      priority: lower runs first among ready tasks on one resource.
    """
    tid = len(self.names)
    if resource is None:
      resource = NO_RESOURCE
    elif not 0 <= resource < len(self.resource_names):
      raise PlanError(f"task '{name}': unknown resource id {resource}; create "
                      "it with add_device or add_link first")
    if not duration >= 0:
      raise PlanError(f"task '{name}': duration must be >= 0 seconds, got "
                      f"{duration!r}")
    for d in deps:
      if not 0 <= d < tid:
        raise PlanError(f"task '{name}': dependency {d} does not exist yet; "
                        "add tasks in topological order or use add_data_dep")
    for d in control_deps:
      if not 0 <= d < tid:
        raise PlanError(f"task '{name}': control dependency {d} does not exist "
                        "yet; add tasks in order or use add_control_dep")
    if alloc:
      if mem_device is None:
        if resource == NO_RESOURCE or self.resource_kinds[resource] != COMPUTE:
          raise PlanError(f"task '{name}' allocates {alloc} bytes but runs on "
                          "no device; say where with mem_device")
        mem_device = resource
      else:
        self._check_device(mem_device, f"task '{name}'")
    self.names.append(name)
    self.resources.append(resource)
    self.durations.append(float(duration))
    if kind is None:
      kind = "sync" if resource == NO_RESOURCE else self.resource_kinds[resource]
    self.kinds.append(kind)
    self.data_deps.append(list(deps))
    self.control_deps.append(list(control_deps))
    self.alloc.append(int(alloc))
    self.mem_device.append(NO_RESOURCE if mem_device is None else mem_device)
    self.persistent.append(bool(persistent))
    self.priority.append(tid if priority is None else int(priority))
    self._succ.append([])
    self._ndeps.append(0)
    self._nconsumers.append(0)
    self._frees.append([])
    for d in deps:
      self._link(tid, d, True)
    for d in control_deps:
      self._link(tid, d, False)
    return tid

  def _link(self, task, dep, data):
    self._succ[dep].append(task)
    self._ndeps[task] += 1
    if data:
      self._nconsumers[dep] += 1
      if self.alloc[dep] and not self.persistent[dep]:
        self._frees[task].append(dep)

  def add_data_dep(self, task, dep):
    """`task` reads `dep`'s output: runs after it and keeps it allocated."""
    self._check_task(task)
    self._check_task(dep)
    self.data_deps[task].append(dep)
    self._link(task, dep, True)

  def add_control_dep(self, task, dep):
    """`task` may not start before `dep` has finished."""
    self._check_task(task)
    self._check_task(dep)
    self.control_deps[task].append(dep)
    self._link(task, dep, False)

  def _check_task(self, t):
    if not 0 <= t < len(self.names):
      raise PlanError(f"unknown task id {t} (the graph has {len(self.names)} "
                      "tasks)")

  def _check_device(self, d, where):
    if not (0 <= d < len(self.resource_kinds) and
            self.resource_kinds[d] == COMPUTE):
      raise PlanError(f"{where}: {d} is not a device id; use the id "
                      "add_device returned")

  def simulate(self):
    """Runs the DAG; returns a SimResult."""
    # The loop allocates many small acyclic lists and tuples; the cyclic
    # collector would otherwise rescan them and take a third of the time.
    was_enabled = gc.isenabled()
    gc.disable()
    t0 = time.perf_counter()
    try:
      result = SimResult(self, *self._run())
    finally:
      if was_enabled:
        gc.enable()
    logging.vlog(1, "simulated %d tasks on %d resources in %.3f s", len(self),
                 len(self.resource_names), time.perf_counter() - t0)
    return result

  def _run(self):
    """The event loop. Returns (start, end, memory logs per resource)."""
    n = len(self.names)
    nres = len(self.resource_names)
    res = self.resources
    dur = self.durations
    alloc = self.alloc
    memdev = self.mem_device
    succ = self._succ
    frees = self._frees
    indeg = list(self._ndeps)
    refs = list(self._nconsumers)
    # Memory held until the last data consumer ends; persistent never freed.
    freeable = [a > 0 and not p for a, p in zip(alloc, self.persistent)]
    if any(p != t for t, p in enumerate(self.priority)):
      pmin = min(self.priority)
      key = [(p - pmin) * n + t for t, p in enumerate(self.priority)]
    else:
      key = range(n)

    start = [0.0] * n
    end = [0.0] * n
    ready = [[] for _ in range(nres)]
    running = [False] * nres
    memlog = [[] for _ in range(nres)]
    events = []
    push, pop = heapq.heappush, heapq.heappop
    touched = []

    now = 0.0
    for t in range(n):
      if indeg[t] == 0:
        r = res[t]
        if r < 0:
          push(events, (dur[t], t))
          if alloc[t]:
            memlog[memdev[t]].append((0.0, alloc[t]))
        else:
          push(ready[r], key[t])
          touched.append(r)

    done = 0
    while True:
      # Start what can start at `now` on every resource something changed on.
      for r in touched:
        if not running[r] and ready[r]:
          t = pop(ready[r]) % n
          running[r] = True
          start[t] = now
          push(events, (now + dur[t], t))
          if alloc[t]:
            memlog[memdev[t]].append((now, alloc[t]))
      touched.clear()
      if not events:
        break
      now = events[0][0]
      # Finish everything that ends at `now` before choosing what starts next,
      # so priorities decide between tasks that became ready together.
      while events and events[0][0] == now:
        t = pop(events)[1]
        end[t] = now
        done += 1
        r = res[t]
        if r >= 0:
          running[r] = False
          touched.append(r)
        for s in succ[t]:
          indeg[s] -= 1
          if indeg[s] == 0:
            rs = res[s]
            if rs < 0:
              start[s] = now
              push(events, (now + dur[s], s))
              if alloc[s]:
                memlog[memdev[s]].append((now, alloc[s]))
            else:
              push(ready[rs], key[s])
              touched.append(rs)
        for d in frees[t]:
          refs[d] -= 1
          if refs[d] == 0:
            memlog[memdev[d]].append((now, -alloc[d]))
        if freeable[t] and refs[t] == 0:
          memlog[memdev[t]].append((now, -alloc[t]))

    if done < n:
      stuck = next(t for t in range(n) if indeg[t] > 0)
      raise PlanError(
          f"simulation stalled: {n - done} of {n} tasks never became ready, "
          f"e.g. '{self.names[stuck]}'; its dependencies form a cycle (check "
          "the dependencies added with add_control_dep / add_data_dep)")
    return start, end, memlog


def _union_length(intervals):
  """Total length covered by (start, end) intervals."""
  total = 0.0
  cur_s = cur_e = None
  for s, e in sorted(intervals):
    if cur_e is None or s > cur_e:
      if cur_e is not None:
        total += cur_e - cur_s
      cur_s, cur_e = s, e
    elif e > cur_e:
      cur_e = e
  if cur_e is not None:
    total += cur_e - cur_s
  return total


class SimResult:
  """Times of every task, and per-device busy/idle, communication, memory."""

  def __init__(self, graph, start, end, memlog):
    self.graph = graph
    self.start = start
    self.end = end
    self.step_time = max(end) if end else 0.0
    self.busy = [0.0] * len(graph.resource_names)
    for r, d in zip(graph.resources, graph.durations):
      if r >= 0:
        self.busy[r] += d
    self._memlog = memlog
    self.peak_memory = {}
    for dev in graph.devices:
      level = peak = graph.static_bytes[dev]
      # Frees sort before allocations at the same instant.
      for _, delta in sorted(memlog[dev]):
        level += delta
        if level > peak:
          peak = level
      self.peak_memory[dev] = peak

  @property
  def comm_time(self):
    """Busy seconds summed over all comm resources."""
    g = self.graph
    return sum(b for b, k in zip(self.busy, g.resource_kinds) if k == COMM)

  def idle_fraction(self, device):
    """Share of the step the device's compute stream is idle (its bubble)."""
    if not self.step_time:
      return 0.0
    return 1.0 - self.busy[device] / self.step_time

  def shared_peak(self, devices=None):
    """Peak of the bytes in use summed over `devices` (default: all), as one
    allocator serving them all sees it (the logical CPU devices of one
    process share one); at most the sum of their own peaks."""
    devices = list(self.graph.devices if devices is None else devices)
    level = peak = sum(self.graph.static_bytes[d] for d in devices)
    merged = sorted(e for d in devices for e in self._memlog[d])
    for _, delta in merged:  # frees sort before allocations at one instant
      level += delta
      if level > peak:
        peak = level
    return peak

  def memory_timeline(self, device):
    """[(time, bytes in use)] after each change, static bytes included."""
    level = self.graph.static_bytes[device]
    out = [(0.0, level)]
    for when, delta in sorted(self._memlog[device]):
      level += delta
      if out[-1][0] == when:
        out[-1] = (when, level)
      else:
        out.append((when, level))
    return out

  def events(self):
    """[(resource name, task name, kind, start, end)] of tasks on resources."""
    g = self.graph
    order = sorted((r, self.start[t], t) for t, r in enumerate(g.resources)
                   if r >= 0)
    return [(g.resource_names[r], g.names[t], g.kinds[t], s, self.end[t])
            for r, s, t in order]

  def device_summary(self):
    """One dict per device: busy, idle, bubble, comm, exposed comm, peak."""
    g = self.graph
    compute = {d: [] for d in g.devices}
    comm = {d: [] for d in g.devices}
    for t, r in enumerate(g.resources):
      if r < 0:
        continue
      iv = (self.start[t], self.end[t])
      if g.resource_kinds[r] == COMPUTE:
        compute[r].append(iv)
      else:
        for d in g.resource_devices[r]:
          comm[d].append(iv)
    rows = []
    for d in g.devices:
      comm_busy = _union_length(comm[d])
      exposed = _union_length(compute[d] + comm[d]) - _union_length(compute[d])
      rows.append({
          "device": g.resource_names[d],
          "busy": self.busy[d],
          "idle": self.step_time - self.busy[d],
          "idle_fraction": self.idle_fraction(d),
          "comm": comm_busy,
          "exposed_comm": exposed,
          "peak_memory": self.peak_memory[d],
      })
    return rows

  def summary(self):
    """A JSON-able dict of the step."""
    return {"step_time": self.step_time, "tasks": len(self.graph),
            "comm_time": self.comm_time, "devices": self.device_summary()}
