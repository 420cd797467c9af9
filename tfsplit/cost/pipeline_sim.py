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
"""
import dataclasses

from tfsplit.cost.simulator import TaskGraph
from tfsplit.errors import PlanError

SCHEDULES = ("gpipe", "1f1b")


def theoretical_bubble(stages, microbatches):
  return (stages - 1) / (microbatches + stages - 1)


def theoretical_peak_activations(schedule, stages, microbatches):
  """Live activations per stage: m for gpipe, min(S - s, m) for 1f1b."""
  if schedule == "gpipe":
    return [microbatches] * stages
  return [min(stages - s, microbatches) for s in range(stages)]


def stage_order(schedule, stages, microbatches, stage):
  """The order stage `stage` runs its tasks: [('F' or 'B', micro-batch)] — the
  same schedule classes that order a real pipelined graph."""
  from tfsplit.pipeline.schedules import get_schedule  # pylint: disable=import-outside-toplevel
  return get_schedule(schedule).order(stage, stages, microbatches)


@dataclasses.dataclass
class PipelineResult:
  schedule: str
  stages: int
  microbatches: int
  sim: object                 # SimResult
  bubble_fraction: float      # mean idle share of the stages' compute streams
  stage_bubble: list          # idle share per stage
  peak_activations: list      # live micro-batch activations per stage
  peak_memory: list           # bytes per stage, static bytes included

  def summary(self):
    return {
        "schedule": self.schedule, "stages": self.stages,
        "microbatches": self.microbatches, "step_time": self.sim.step_time,
        "bubble_fraction": self.bubble_fraction,
        "theoretical_bubble_fraction": theoretical_bubble(self.stages,
                                                          self.microbatches),
        "comm_time": self.sim.comm_time,
        "stage_bubble": self.stage_bubble,
        "peak_activations": self.peak_activations,
        "theoretical_peak_activations": theoretical_peak_activations(
            self.schedule, self.stages, self.microbatches),
        "peak_memory": self.peak_memory,
    }


def build_pipeline(stages, microbatches, schedule="1f1b", forward_time=1.0,
                   backward_time=2.0, activation_bytes=1, p2p_time=0.0,
                   static_bytes=0):
  """The task DAG of one training step; returns (TaskGraph, devices).

  `p2p_time` > 0 puts each activation and gradient transfer between
  neighbouring stages on its own link (one per direction per stage pair).
  """
  _check(stages, microbatches, schedule, forward_time, backward_time, p2p_time)
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


def simulate_pipeline(stages, microbatches, schedule="1f1b", forward_time=1.0,
                      backward_time=2.0, activation_bytes=1, p2p_time=0.0,
                      static_bytes=0):
  """Simulates one step; returns a PipelineResult."""
  g, devices = build_pipeline(stages, microbatches, schedule, forward_time,
                              backward_time, activation_bytes, p2p_time,
                              static_bytes)
  sim = g.simulate()
  stage_bubble = [sim.idle_fraction(d) for d in devices]
  peak_memory = [sim.peak_memory[d] for d in devices]
  peak_acts = [(p - static_bytes) // activation_bytes if activation_bytes
               else 0 for p in peak_memory]
  return PipelineResult(
      schedule=schedule, stages=stages, microbatches=microbatches, sim=sim,
      bubble_fraction=sum(stage_bubble) / len(stage_bubble),
      stage_bubble=stage_bubble, peak_activations=peak_acts,
      peak_memory=peak_memory)


def _check(stages, microbatches, schedule, forward_time, backward_time,
           p2p_time):
  if schedule not in SCHEDULES:
    raise PlanError(f"unknown pipeline schedule '{schedule}'; choose one of: "
                    f"{', '.join(SCHEDULES)}")
  for name, value in (("stages", stages), ("micro-batches", microbatches)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise PlanError(f"number of {name} must be a positive integer, got "
                      f"{value!r}")
  if not forward_time > 0 or not backward_time > 0 or not p2p_time >= 0:
    raise PlanError("forward and backward times must be > 0 and the p2p time "
                    f">= 0, got {forward_time}, {backward_time}, {p2p_time}")
