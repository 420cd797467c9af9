"""Pipeline schedules on uniform stages, as task DAGs for the simulator.

Stage s (0-based) of S runs forward F(s, j) and backward B(s, j) of every
micro-batch j < m. Data edges: F(s, j) reads F(s-1, j); B(s, j) reads F(s, j)
(its saved activations, which it frees) and B(s+1, j). The schedules add only
control edges, as the graph pass does:

- gpipe: B(s, j) waits for F(s, m-1); every stage holds m activations.
- 1f1b (DAPPLE early backward): stage s runs K_s = min(S - s, m) warm-up
  forwards, then alternates one backward and one forward; F(s, j) waits for
  B(s, j - K_s), so stage s never holds more than K_s activations.

On uniform stages without communication both have the bubble fraction
(S - 1) / (m + S - 1); 1f1b only lowers the activation memory.

- interleaved (Megatron-LM's interleaved 1F1B): each stage holds v >= 2
  model chunks (chunk c on stage c % S, 1/v of a stage's work each). Tasks
  are per chunk: F(c, j) reads F(c-1, j), B(c, j) reads F(c, j) and
  B(c+1, j), and each stage runs its chunk tasks in the schedule's order
  (every task waits for the previous one, as the graph pass orders blocks).
  The bubble becomes (S - 1) / (v m + S - 1): (S - 1) / (v m) of the ideal
  step instead of (S - 1) / m; stage s holds at most
  min(2 (S - s - 1) + (v - 1) S + 1, v m) chunk activations
  (activation_bytes / v each).

- zb-h1, zb-h2 (zero bubble): each backward is two tasks, B(s, j) (the
  input gradient: reads F(s, j) and B(s+1, j)) and W(s, j) (the weight
  gradient, weight_fraction of the backward time: reads B(s, j) and F(s, j),
  whose activations it frees), run in the schedule's order on each stage.
  With equal F, B and W, zb-h1's bubble is (S - 1)(F + B - W), a third of
  1f1b's (S - 1)(F + B + W), at 1f1b's peak (min(S, m) on every stage);
  zb-h2 leaves no idle time between a stage's first and last task (the
  steady bubble, what a stage loses when consecutive steps overlap) for up
  to 2S - 1 micro-batches in flight. Within one synchronous step the last
  stage still waits (S - 1) F for its first forward under every schedule.
"""
import dataclasses

from tfsplit import constants
from tfsplit.cost.simulator import TaskGraph
from tfsplit.errors import PlanError

SCHEDULES = constants.PIPELINE_SCHEDULES
DEFAULT_WEIGHT_FRACTION = constants.DEFAULT_WEIGHT_FRACTION


def theoretical_bubble(stages, microbatches, chunks=1):
  """Idle share of the step on uniform stages: (S - 1) / (v m + S - 1)."""
  return (stages - 1) / (chunks * microbatches + stages - 1)


def theoretical_peak_activations(schedule, stages, microbatches, chunks=1):
  """Live activations per stage: m for gpipe, min(S - s, m) for 1f1b; chunk
  activations (1/v of a micro-batch's each) for interleaved; for the
  zero-bubble schedules the most micro-batches between an F and its W
  (min(S, m) for zb-h1, min(2S - 1, m) for zb-h2, on every stage)."""
  # The zero-bubble orders hold these on every stage (tests count them from
  # the orders); no order is built here, the planner asks for large m.
  if schedule == "zb-h1":
    return [min(stages, microbatches)] * stages
  if schedule == "zb-h2":
    return [min(2 * stages - 1, microbatches)] * stages
  if schedule == "gpipe":
    return [microbatches] * stages
  if schedule == "interleaved":
    return [min(2 * (stages - s - 1) + (chunks - 1) * stages + 1, chunks * microbatches)
            for s in range(stages)]
  return [min(stages - s, microbatches) for s in range(stages)]


def stage_order(schedule, stages, microbatches, stage, chunks=1):
  """The order stage `stage` runs its tasks: [('F' or 'B', micro-batch)]
  ([('F' or 'B', micro-batch, chunk on the stage)] for interleaved) — the
  same schedule classes that order a real pipelined graph."""
  from tfsplit.pipeline.schedules import get_schedule  # pylint: disable=import-outside-toplevel
  return get_schedule(schedule, chunks).order(stage, stages, microbatches)


@dataclasses.dataclass
class PipelineResult:
  schedule: str
  stages: int
  microbatches: int
  sim: object                 # SimResult
  bubble_fraction: float      # mean idle share of the stages' compute streams
  stage_bubble: list          # idle share per stage
  peak_activations: list      # live activations per stage (micro-batches;
                              # chunk activations for interleaved)
  peak_memory: list           # bytes per stage, static bytes included
  chunks: int = 1             # model chunks per stage (interleaved: v)
  span_idle: list = None      # seconds per stage idle between its first and last task

  @property
  def bubble_time(self):
    """Seconds the most idle stage waits within the step (its bubble)."""
    return max(self.stage_bubble) * self.sim.step_time

  @property
  def steady_bubble_time(self):
    """Seconds the most idle stage waits between its own first and last
    task: the bubble per step when consecutive steps overlap (a stage
    starts the next step as soon as it has finished this one, as the
    zero-bubble paper counts it); the step's bubble adds the wait of the
    later stages for their first forward."""
    return max(self.span_idle)

  def summary(self):
    return {
        "schedule": self.schedule, "stages": self.stages,
        "microbatches": self.microbatches, "virtual_stages": self.chunks,
        "step_time": self.sim.step_time,
        "bubble_fraction": self.bubble_fraction,
        "bubble_time": self.bubble_time,
        "steady_bubble_time": self.steady_bubble_time,
        "theoretical_bubble_fraction": theoretical_bubble(
            self.stages, self.microbatches, self.chunks),
        "comm_time": self.sim.comm_time,
        "stage_bubble": self.stage_bubble,
        "peak_activations": self.peak_activations,
        "theoretical_peak_activations": theoretical_peak_activations(
            self.schedule, self.stages, self.microbatches, self.chunks),
        "peak_memory": self.peak_memory,
    }


def build_pipeline(stages, microbatches, schedule="1f1b", forward_time=1.0,
                   backward_time=2.0, activation_bytes=1, p2p_time=0.0,
                   static_bytes=0, chunks=1, weight_fraction=DEFAULT_WEIGHT_FRACTION):
  """The task DAG of one training step; returns (TaskGraph, devices).

  `p2p_time` > 0 puts each activation and gradient transfer between
  neighbouring stages on its own link (one per direction per stage pair).
  chunks: model chunks per stage (the interleaved schedule's v).
  weight_fraction: the share of backward_time that is weight gradients
  (the W tasks of the zero-bubble schedules).
  """
  _check(stages, microbatches, schedule, forward_time, backward_time, p2p_time, chunks)
  if schedule == "interleaved":
    return _build_interleaved(stages, microbatches, chunks, forward_time, backward_time,
                              activation_bytes, p2p_time, static_bytes)
  if schedule in constants.ZERO_BUBBLE_SCHEDULES:
    if not 0 < weight_fraction < 1:
      raise PlanError(f"the weight-gradient share of the backward must be in (0, 1), "
                      f"got {weight_fraction!r}")
    return _build_split_backward(stages, microbatches, schedule, forward_time,
                                 backward_time * (1 - weight_fraction),
                                 backward_time * weight_fraction, activation_bytes,
                                 p2p_time, static_bytes)
  S, m = stages, microbatches
  g = TaskGraph()
  devices = [g.add_device(f"stage{s}", static_bytes=static_bytes)
             for s in range(S)]
  fwd_link = [g.add_link(f"stage{s}->stage{s + 1}", (devices[s], devices[s + 1]))
              for s in range(S - 1)] if p2p_time else []
  bwd_link = [g.add_link(f"stage{s + 1}->stage{s}", (devices[s + 1], devices[s]))
              for s in range(S - 1)] if p2p_time else []
  # Priority = position in the stage's schedule, so a stage with both a
  # forward and a backward ready runs the one its schedule names first.
  prio = {}
  for s in range(S):
    for pos, (phase, j) in enumerate(stage_order(schedule, S, m, s)):
      prio[(phase, s, j)] = pos

  fwd = [[0] * m for _ in range(S)]
  for s in range(S):
    for j in range(m):
      deps = []
      if s > 0:
        src = fwd[s - 1][j]
        if p2p_time:
          src = g.add_task(f"send F{j} s{s - 1}->s{s}", fwd_link[s - 1],
                           p2p_time, deps=[src], kind="comm")
        deps.append(src)
      fwd[s][j] = g.add_task(f"F{j}", devices[s], forward_time, deps=deps,
                             kind="forward", alloc=activation_bytes,
                             priority=prio[("F", s, j)])
  bwd = [[0] * m for _ in range(S)]
  for s in reversed(range(S)):
    for j in range(m):
      deps = [fwd[s][j]]
      if s < S - 1:
        src = bwd[s + 1][j]
        if p2p_time:
          src = g.add_task(f"send B{j} s{s + 1}->s{s}", bwd_link[s], p2p_time,
                           deps=[src], kind="comm")
        deps.append(src)
      control = [fwd[s][m - 1]] if schedule == "gpipe" and j != m - 1 else []
      bwd[s][j] = g.add_task(f"B{j}", devices[s], backward_time, deps=deps,
                             control_deps=control, kind="backward",
                             priority=prio[("B", s, j)])
  if schedule == "1f1b":
    for s in range(S):
      warmup = min(S - s, m)
      for j in range(warmup, m):
        g.add_control_dep(fwd[s][j], bwd[s][j - warmup])
  return g, devices


def _build_interleaved(S, m, v, forward_time, backward_time, activation_bytes,
                       p2p_time, static_bytes):
  """Tasks per model chunk c (on stage c % S); each stage runs its tasks in
  the interleaved schedule's order, one after the other."""
  g = TaskGraph()
  devices = [g.add_device(f"stage{s}", static_bytes=static_bytes)
             for s in range(S)]
  links = {}

  def link(a, b):  # one link per direction per stage pair
    if (a, b) not in links:
      links[(a, b)] = g.add_link(f"stage{a}->stage{b}", (devices[a], devices[b]))
    return links[(a, b)]

  orders = [stage_order("interleaved", S, m, s, v) for s in range(S)]
  prio = {(kind, k * S + s, j): pos for s in range(S)
          for pos, (kind, j, k) in enumerate(orders[s])}
  chunk_alloc = _chunk_bytes(activation_bytes, v)
  fwd = [[0] * m for _ in range(S * v)]
  for c in range(S * v):
    s = c % S
    for j in range(m):
      deps = []
      if c > 0:
        src = fwd[c - 1][j]
        if p2p_time:
          src = g.add_task(f"send F{j} c{c - 1}->c{c}", link((c - 1) % S, s), p2p_time,
                           deps=[src], kind="comm")
        deps.append(src)
      fwd[c][j] = g.add_task(f"F{j}c{c // S}", devices[s], forward_time / v, deps=deps,
                             kind="forward", alloc=chunk_alloc, priority=prio[("F", c, j)])
  bwd = [[0] * m for _ in range(S * v)]
  for c in reversed(range(S * v)):
    s = c % S
    for j in range(m):
      deps = [fwd[c][j]]
      if c < S * v - 1:
        src = bwd[c + 1][j]
        if p2p_time:
          src = g.add_task(f"send B{j} c{c + 1}->c{c}", link((c + 1) % S, s), p2p_time,
                           deps=[src], kind="comm")
        deps.append(src)
      bwd[c][j] = g.add_task(f"B{j}c{c // S}", devices[s], backward_time / v, deps=deps,
                             kind="backward", priority=prio[("B", c, j)])
  task = {"F": fwd, "B": bwd}
  for s in range(S):
    seq = [task[kind][k * S + s][j] for kind, j, k in orders[s]]
    for before, after in zip(seq, seq[1:]):
      g.add_control_dep(after, before)
  return g, devices


def _build_split_backward(S, m, schedule, forward_time, input_time, weight_time,
                          activation_bytes, p2p_time, static_bytes):
  """F, B and W tasks per stage and micro-batch, each stage running its
  tasks in the schedule's order, one after the other."""
  g = TaskGraph()
  devices = [g.add_device(f"stage{s}", static_bytes=static_bytes) for s in range(S)]
  links = {}

  def send(name, a, b, src):
    if not p2p_time:
      return src
    if (a, b) not in links:  # one link per direction per stage pair
      links[(a, b)] = g.add_link(f"stage{a}->stage{b}", (devices[a], devices[b]))
    return g.add_task(name, links[(a, b)], p2p_time, deps=[src], kind="comm")

  orders = [stage_order(schedule, S, m, s) for s in range(S)]
  prio = {(kind, s, j): pos for s in range(S) for pos, (kind, j) in enumerate(orders[s])}
  task = {"F": [[0] * m for _ in range(S)], "B": [[0] * m for _ in range(S)],
          "W": [[0] * m for _ in range(S)]}
  for s in range(S):
    for j in range(m):
      deps = [send(f"send F{j} s{s - 1}->s{s}", s - 1, s, task["F"][s - 1][j])] if s else []
      task["F"][s][j] = g.add_task(f"F{j}", devices[s], forward_time, deps=deps,
                                   kind="forward", alloc=activation_bytes,
                                   priority=prio[("F", s, j)])
  for s in reversed(range(S)):
    for j in range(m):
      deps = [task["F"][s][j]]
      if s < S - 1:
        deps.append(send(f"send B{j} s{s + 1}->s{s}", s + 1, s, task["B"][s + 1][j]))
      task["B"][s][j] = g.add_task(f"B{j}", devices[s], input_time, deps=deps,
                                   kind="backward", priority=prio[("B", s, j)])
      task["W"][s][j] = g.add_task(f"W{j}", devices[s], weight_time,
                                   deps=[task["B"][s][j], task["F"][s][j]],
                                   kind="weight", priority=prio[("W", s, j)])
  for s in range(S):
    seq = [task[kind][s][j] for kind, j in orders[s]]
    for before, after in zip(seq, seq[1:]):
      g.add_control_dep(after, before)
  return g, devices


def _chunk_bytes(activation_bytes, chunks):
  """Bytes one chunk's activations take (at least 1, so they are counted)."""
  if chunks == 1 or not activation_bytes:
    return activation_bytes
  return max(1, activation_bytes // chunks)


def simulate_pipeline(stages, microbatches, schedule="1f1b", forward_time=1.0,
                      backward_time=2.0, activation_bytes=1, p2p_time=0.0,
                      static_bytes=0, chunks=1, weight_fraction=DEFAULT_WEIGHT_FRACTION):
  """Simulates one step; returns a PipelineResult.

  chunks: model chunks per stage, v >= 2 for the interleaved schedule (which
  then counts live chunk activations of activation_bytes / v each).
  weight_fraction: the W share of backward_time (zero-bubble schedules).
  """
  g, devices = build_pipeline(stages, microbatches, schedule, forward_time,
                              backward_time, activation_bytes, p2p_time,
                              static_bytes, chunks, weight_fraction)
  sim = g.simulate()
  stage_bubble = [sim.idle_fraction(d) for d in devices]
  span_idle = []
  for d in devices:
    tasks = [t for t, r in enumerate(g.resources) if r == d]
    span = max(sim.end[t] for t in tasks) - min(sim.start[t] for t in tasks)
    idle = span - sim.busy[d]
    span_idle.append(idle if idle > 1e-9 * span else 0.0)  # not float round-off
  peak_memory = [sim.peak_memory[d] for d in devices]
  unit = _chunk_bytes(activation_bytes, chunks)
  peak_acts = [(p - static_bytes) // unit if unit else 0 for p in peak_memory]
  return PipelineResult(
      schedule=schedule, stages=stages, microbatches=microbatches, sim=sim,
      bubble_fraction=sum(stage_bubble) / len(stage_bubble),
      stage_bubble=stage_bubble, peak_activations=peak_acts,
      peak_memory=peak_memory, chunks=chunks, span_idle=span_idle)


def _check(stages, microbatches, schedule, forward_time, backward_time,
           p2p_time, chunks=1):
  if schedule not in SCHEDULES:
    raise PlanError(f"unknown pipeline schedule '{schedule}'; choose one of: "
                    f"{', '.join(SCHEDULES)}")
  if schedule == "interleaved":
    from tfsplit.pipeline.schedules import Interleaved  # pylint: disable=import-outside-toplevel
    Interleaved(chunks).check(stages, microbatches)
  elif chunks != 1:
    raise PlanError(f"the {schedule} schedule runs one model chunk per stage, got "
                    f"{chunks}; use the interleaved schedule or chunks=1")
  for name, value in (("stages", stages), ("micro-batches", microbatches)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise PlanError(f"number of {name} must be a positive integer, got "
                      f"{value!r}")
  if not forward_time > 0 or not backward_time > 0 or not p2p_time >= 0:
    raise PlanError("forward and backward times must be > 0 and the p2p time "
                    f">= 0, got {forward_time}, {backward_time}, {p2p_time}")
