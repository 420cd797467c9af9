"""The planner's search space: the candidates it searches over, and the
Estimate of one priced with its stage cut.

A Candidate is one way to run the step on N devices: a mesh dp x ep x tp x
pp (laid out pp-major, tp fastest: a tensor-parallel group is tp consecutive
devices, inside one host when tp divides the host; ep only for a model
with experts), m micro-batches, a
pipeline schedule (gpipe, 1f1b, interleaved over v model chunks per
stage, or the zero-bubble zb-h1 and zb-h2), recomputation of the repeated blocks, and optimizer-state sharding (zero=1; zero=3 with the weights too)
over dp. The stage cut (which layers each chunk runs) is chosen by the
search (search.py); `costing.Costing.evaluate` prices a candidate with its
cut (the cost model and its formulas: costing.py) into an Estimate.

Two choices refine a candidate (search.py makes them, costing.py prices
them): replicate, the repeated blocks left whole on every device of the tp
group, and offload, the optimizer state and update on the devices' host
CPUs.

meshes and candidates_of enumerate the candidates of a device count;
even_ranges is the plain cut, fits the memory test of an Estimate.
"""
import dataclasses
from typing import List, Optional, Tuple

from tfsplit.constants import PIPELINE_SCHEDULES, ZERO_BUBBLE_SCHEDULES

# 'stages': the blocks of the pipeline stages that would not fit without it
# (1f1b keeps S - s micro-batches on stage s: the first stages need it most).
RECOMPUTE = ("none", "blocks", "stages")
SCHEDULES = PIPELINE_SCHEDULES
# The ZeRO stages plans may use: 1 (optimizer slots over dp; 2 differs only
# in memory with micro-batches, which the model does not price apart) and 3
# (the weights too).
ZERO_STAGES = (0, 1, 3)
VIRTUAL_STAGES = (2, 4)


@dataclasses.dataclass(frozen=True)
class Candidate:
  dp: int
  tp: int
  pp: int
  microbatches: int = 1
  schedule: str = "1f1b"
  virtual_stages: int = 1
  recompute: str = "none"    # a value of RECOMPUTE
  zero: int = 0
  replicate: Tuple[int, ...] = ()   # indices of blocks left whole over tp
  offload: bool = False      # optimizer state and update on the host
  ep: int = 1                # expert parallelism: whole experts over ep

  @property
  def devices(self):
    return self.dp * self.ep * self.tp * self.pp

  @property
  def replicas(self):
    """How many ways the batch is split: dp x ep (each ep rank computes its
    own tokens outside the experts)."""
    return self.dp * self.ep

  @property
  def chunks(self):
    return self.pp * self.virtual_stages

  @property
  def mesh(self):
    """'pp=2,dp=2,ep=2,tp=2' with the axes of size 1 left out ('dp=1' if all are)."""
    axes = [f"{a}={n}" for a, n in (("pp", self.pp), ("dp", self.dp), ("ep", self.ep),
                                    ("tp", self.tp)) if n > 1]
    return ",".join(axes) or "dp=1"

  def label(self):
    parts = [self.mesh, f"m={self.microbatches}"]
    if self.pp > 1:
      parts.append(self.schedule + (f" v={self.virtual_stages}"
                                    if self.virtual_stages > 1 else ""))
    if self.recompute != "none":
      parts.append(f"recompute={self.recompute}")
    if self.zero:
      parts.append(f"zero={self.zero}")
    if self.replicate:
      parts.append(f"replicate={len(self.replicate)}")
    if self.offload:
      parts.append("offload")
    return " ".join(parts)


@dataclasses.dataclass
class Estimate:
  """A priced candidate with its cut."""
  candidate: Candidate
  ranges: List[Tuple[int, int]]   # per model chunk: [start, end) over the layers
  step_time: float
  pipeline_time: float
  sync_time: float
  update_time: float
  bubble: float
  stage_memory: List[int]
  stage_time: List[float]         # seconds of one micro-batch per stage
  recomputed: Optional[List[bool]] = None   # recompute='stages': per stage

  @property
  def memory(self):
    return max(self.stage_memory)

  def label(self):
    """The candidate's label, naming the stages recompute='stages' recomputes."""
    text = self.candidate.label()
    if self.recomputed is not None:
      which = ",".join(str(s) for s, r in enumerate(self.recomputed) if r) or "none"
      text = text.replace("recompute=stages", f"recompute=stages:{which}")
    return text

  def to_json(self):
    c = self.candidate
    return {"mesh": c.mesh, "dp": c.dp, "tp": c.tp, "pp": c.pp, "ep": c.ep,
            "microbatches": c.microbatches, "schedule": c.schedule,
            "virtual_stages": c.virtual_stages, "recompute": c.recompute, "zero": c.zero,
            "replicate": list(c.replicate), "offload": c.offload,
            "layer_ranges": [list(r) for r in self.ranges],
            "step_time": self.step_time, "pipeline_time": self.pipeline_time,
            "sync_time": self.sync_time, "update_time": self.update_time,
            "bubble": self.bubble, "per_device_memory": self.memory,
            "stage_memory": list(self.stage_memory),
            "stage_time": list(self.stage_time),
            "recomputed_stages": [s for s, r in enumerate(self.recomputed or []) if r]}


def divisors(n):
  return [d for d in range(1, n + 1) if n % d == 0]


def meshes(devices, profile, max_tp=None, host_size=None):
  """(dp, tp, pp, ep) over `devices`: tp a power of two the blocks divide by
  (and within a host), pp at most the layers, ep dividing every MoE layer's
  experts (1 without experts), dp x ep dividing the batch."""
  n = len(profile.layers)
  limit = min(profile.max_tp if profile.has_blocks else 1, max_tp or devices,
              host_size or devices)
  out = []
  for tp in divisors(devices):
    if tp > limit or tp & (tp - 1):
      continue
    for pp in divisors(devices // tp):
      for ep in divisors(devices // (tp * pp)):
        if ep > 1 and (not profile.experts or profile.experts % ep):
          continue
        dp = devices // (tp * pp * ep)
        if pp <= n and profile.batch % (dp * ep) == 0:
          out.append((dp, tp, pp, ep))
  return out


def candidates_of(mesh, profile, max_microbatches=None, schedules=SCHEDULES,
                  zero_stages=ZERO_STAGES):
  """Every Candidate on one mesh (dp, tp, pp, ep), with the pipeline
  schedules among `schedules` (1f1b is always tried: without a pipeline it
  is the plain step) and the ZeRO stages among `zero_stages` (0 always)."""
  dp, tp, pp, ep = mesh
  n = len(profile.layers)
  rcs = (RECOMPUTE if pp > 1 else RECOMPUTE[:2]) if profile.has_blocks else ("none",)
  zeros = (0,) + tuple(z for z in zero_stages if z) if dp > 1 else (0,)
  for m in divisors(profile.batch // (dp * ep)):
    if max_microbatches and m > max_microbatches:
      break
    scheds = [("1f1b", 1)]
    if pp > 1:
      scheds += [(s, 1) for s in ("gpipe",) + ZERO_BUBBLE_SCHEDULES if s in schedules]
      if "interleaved" in schedules:
        scheds += [("interleaved", v) for v in VIRTUAL_STAGES
                   if m % pp == 0 and pp * v <= n]
    for rc in rcs:
      for schedule, v in scheds:
        if rc == "stages" and v > 1:  # a chunk per stage only
          continue
        for zero in zeros:
          yield Candidate(dp, tp, pp, m, schedule, v, rc, zero, ep=ep)


def even_ranges(n, chunks):
  """[start, end) ranges cutting n layers into `chunks` of near-equal count."""
  bounds = [round(k * n / chunks) for k in range(chunks + 1)]
  return list(zip(bounds, bounds[1:]))


def fits(estimate, device_memory: Optional[int]):
  return device_memory is None or estimate.memory <= device_memory
