"""Search over the candidates of space.py for the fastest plan that fits.

For each mesh, micro-batch count, schedule and recomputation choice, the
stage cut comes from a dynamic program over contiguous layer ranges (as
PipeDream and Alpa cut stages): the S x v chunks that minimise the slowest
chunk, each chunk's cost its layers' forward + backward time plus the
activations crossing its cuts. When that cut does not fit the memory cap,
the program runs again with the cap as a constraint on each stage (the
activations a stage keeps depend on its position in the schedule), which
finds the fastest cut that fits, if any. With recompute='stages' each
stage of the program picks, per layer range, recomputation of its blocks
only when the range does not fit without it. Every candidate is then priced
by Costing.evaluate and the fastest that fits wins.

With tp > 1 each candidate also gets its set of replicated blocks
(`replicas`): the blocks whose step time drops when replicated (their
all-reduces cost more than the compute tp saves, net of the larger update
and gradient sync); when all of them do not fit, the most seconds saved
per byte first, as many as fit (a binary search over that order). A
candidate that does not fit the cap is tried again with its optimizer
state offloaded to the host: offload is chosen only where it is needed to
fit (it is never faster on its own).

The program (cuts.py) is vectorised over the layer ranges (numpy) and
runs on a band of them: the ranges no slower than a balanced cut's slowest
chunk, or short enough to fit the cap, which returns the cut the whole
program returns; a cut under the cap whose stages' longest fitting ranges
cannot cover the layers is refused before the program runs. Its cut is
shared by the candidates that differ only in ZeRO and schedule, and the
per-layer terms by those of one micro-batch size and tp group; branch and
bound skips a candidate whose lower bounds (m micro-batches of the average
stage; the average stage's memory) cannot rank or fit. Planning a 96-block
model for 1024 devices so takes about a second, and a 128-block one for
3072 devices a few (tools/bench_planner.py), not a simulation per
candidate.
`exhaustive` tries every cut instead (tests hold the search to it), and
`hand_rule` is the common manual plan the benchmarks compare with.
"""
import bisect
import dataclasses
import itertools
import time
from typing import List, Optional

import numpy as np

from tfsplit.errors import PlanError
from tfsplit.plan import costing as costing_lib
from tfsplit.plan import cuts, space
from tfsplit.units import format_bytes


@dataclasses.dataclass
class SearchResult:
  best: Optional[space.Estimate]     # fastest that fits; None if none fits
  ranked: List[space.Estimate]       # fitting candidates, fastest first (top k)
  smallest: Optional[space.Estimate]  # the candidate needing the least memory
  fastest: Optional[space.Estimate]   # the fastest candidate, fitting or not
  evaluated: int
  seconds: float
  devices: int
  device_memory: Optional[int]       # the memory cap per device
  costing: Optional[costing_lib.Costing] = None   # what priced them (for reports)
  reserve: float = 0.0               # fraction of the cap kept free
  # Of a model with experts: the fastest fitting plan priced with and
  # without an ep axis ({True: ..., False: ...}; why ep did or did not win).
  best_by_ep: dict = dataclasses.field(default_factory=dict)
  # Of the pipelined plans that fit: the fastest per schedule (why the
  # winner's schedule, and not 1f1b or a zero-bubble one).
  best_by_schedule: dict = dataclasses.field(default_factory=dict)

  @property
  def usable(self):
    """Bytes per device a plan may take: the cap less the reserve."""
    return usable_memory(self.device_memory, self.reserve)


# The cut's dynamic program (cuts.py); the names tests and callers know.
_chunk_cost_matrix = cuts.chunk_cost_matrix
min_max_cut = cuts.min_max_cut


# Kept free by default: the memory model counts weights, gradients,
# optimizer state and activations, not workspaces or the allocator's
# fragmentation (its peak is 0.7-1.2x an allocator's on the examples).
DEFAULT_RESERVE = 0.1
# Blocks tried one by one after the longest prefix that fits (replicas).
_GREEDY_TRIES = 16


def usable_memory(device_memory, reserve):
  """Bytes of `device_memory` a plan may take when `reserve` (a fraction) is
  kept free; None for None."""
  if device_memory is None:
    return None
  return int(device_memory * (1.0 - reserve))


def memory_needed(memory, reserve):
  """The least device memory whose usable part (usable_memory) holds
  `memory` bytes."""
  need = max(1, int(-(-memory // (1.0 - reserve))))
  while usable_memory(need, reserve) < memory:
    need += 1
  while need > 1 and usable_memory(need - 1, reserve) >= memory:
    need -= 1
  return need


def check_reserve(reserve):
  """PlanError unless 0 <= reserve < 1."""
  if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or \
      not 0 <= reserve < 1:
    raise PlanError(f"the memory reserve is a fraction of device memory in [0, 1), got "
                    f"{reserve!r}; e.g. 0.1 keeps 10% free")


class Planner(object):
  """Search state for one model on one cluster. device_memory: the cap per
  device; reserve: the fraction of it kept free for what the memory model
  does not count (workspaces, allocator fragmentation): plans fit
  device_memory * (1 - reserve)."""

  def __init__(self, profile, cluster, devices, device_memory=None, max_tp=None,
               max_microbatches=None, host_size=None, bucket_bytes=None, reserve=0.0,
               schedules=None, zero_stages=space.ZERO_STAGES):
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
      raise PlanError(f"the number of devices must be a positive integer, got {devices!r}")
    if cluster.num_devices < devices:
      raise PlanError(f"cluster '{cluster.name}' has {cluster.num_devices} devices, too few "
                      f"for {devices}; give a cluster spec with at least {devices}")
    check_reserve(reserve)
    self.profile = profile
    self.cluster = cluster
    self.devices = devices
    self.cap = device_memory
    self.reserve = reserve
    self.device_memory = usable_memory(device_memory, reserve)   # what plans must fit
    self.max_tp = max_tp
    self.max_microbatches = max_microbatches
    # The pipeline schedules plans may use (default: all of space.SCHEDULES).
    self.schedules = tuple(schedules) if schedules is not None else space.SCHEDULES
    unknown = [s for s in self.schedules if s not in space.SCHEDULES]
    if unknown:
      raise PlanError(f"unknown pipeline schedule '{unknown[0]}'; choose among: "
                      f"{', '.join(space.SCHEDULES)}")
    unknown = [z for z in zero_stages if z not in space.ZERO_STAGES]
    if unknown:
      raise PlanError(f"ZeRO stage {unknown[0]!r} is not one plans choose among; use some of "
                      f"{', '.join(str(z) for z in space.ZERO_STAGES)}")
    self.zero_stages = tuple(zero_stages)
    self.host_size = host_size if host_size is not None else _host_size(cluster)
    self.costing = costing_lib.Costing(profile, cluster, bucket_bytes, self.device_memory)
    self._cuts = {}
    self._blocks = None   # every repeated block (_all_replicated)
    self._work = {}
    self.evaluated = 0
    self.pruned = 0

  def meshes(self):
    return space.meshes(self.devices, self.profile, self.max_tp, self.host_size)

  def cut(self, c):
    """The fastest cut of candidate c, ignoring memory (shared by candidates
    that differ only in schedule order and ZeRO)."""
    if c.chunks == 1:
      return [(0, self.costing.n)]
    # The cut depends on the micro-batch size, not on how it is reached.
    key = (c.replicas * c.microbatches, c.tp, c.pp, c.ep, c.recompute, c.virtual_stages,
           self.costing.pipeline_link(c), c.replicate)
    if key not in self._cuts:
      f, b = self.costing.layer_times(c)
      self._cuts[key] = cuts.fastest_cut(f + b, self.costing.cut_times(c), c.chunks)
    return self._cuts[key]

  def cut_stages(self, c):
    """recompute='stages': the fastest cut when each stage recomputes its
    blocks only if it does not fit without (each stage's cost and memory
    follow its choice), or None."""
    # A range fits a stage keeping `count` micro-batches while count <= its
    # threshold (room left by the static bytes over the bytes per micro-batch).
    options = []
    for rc in ("none", "blocks"):
      f, b = self.costing.layer_times(c, rc)
      options.append((f + b, self.costing.memory_terms(c, rc)))
    return cuts.stage_choice_cut(options, self.costing.cut_times(c),
                                 self.profile.static_bytes, self.device_memory,
                                 self.costing.in_flight(c))

  def cut_under_cap(self, c):
    """The fastest cut of c whose every stage fits the memory cap (stages of
    one chunk only), or None."""
    # Some stage holds at least the average: skip the program when even that
    # is over the cap.
    if self.memory_bound(c) > self.device_memory:
      return None
    f, b = self.costing.layer_times(c)
    return cuts.capped_cut(f + b, self.costing.cut_times(c), self.costing.memory_terms(c),
                           self.profile.static_bytes, self.device_memory,
                           self.costing.in_flight(c))

  def lower_bound(self, c):
    """Seconds c takes at least: m micro-batches of its average stage (each
    block split or replicated, whichever is faster)."""
    key = (c.replicas * c.microbatches, c.tp, c.ep, c.recompute)
    if key not in self._work:
      f, b = self.costing.layer_times(c)
      fb = f + b
      if c.tp > 1 and self.costing.split.any():
        f, b = self.costing.layer_times(self._all_replicated(c))
        fb = np.minimum(fb, f + b)
      self._work[key] = float(fb.sum())
    return c.microbatches * self._work[key] / c.pp

  def _all_replicated(self, c):
    if self._blocks is None:
      self._blocks = tuple(int(i) for i in np.flatnonzero(self.costing.split))
    return dataclasses.replace(c, replicate=self._blocks)

  def can_offload(self, c):
    """Whether c may be tried with its optimizer state offloaded."""
    return self.costing.can_offload and not c.zero and self.device_memory is not None

  def memory_bound(self, c):
    """Bytes some device of c holds at least: the average stage's (its
    optimizer state offloaded, where that may be tried)."""
    if not c.offload and self.can_offload(c):
      c = dataclasses.replace(c, offload=True)
    static, kept, _ = self.costing.memory_terms(c)
    counts = self.costing.in_flight(c)
    return ((static.sum() + min(counts) * kept.sum() / c.virtual_stages) / c.pp +
            self.profile.static_bytes)

  def replication_gains(self, c):
    """(layer indices, seconds saved per step, bytes added per device) of
    the blocks whose replication over tp makes c's step faster, each alone:
    m micro-batches of its forward + backward, less its larger update (and
    with dp, its larger gradient all-reduce)."""
    if c.tp == 1 or not self.costing.split.any():
      return [], None, None
    whole = self._all_replicated(c)
    f, b = self.costing.layer_times(c)
    rf, rb = self.costing.layer_times(whole)
    costing = self.costing
    # Weights (and gradients) no longer split over tp.
    more = costing.params * costing.kept_over_ep(c) * (1 - 1 / c.tp)
    extra_update = costing.upd * costing.kept_over_ep(c) * (1 - 1 / c.tp) / (
        c.dp if c.zero else 1)
    if c.offload:
      extra_update = (extra_update * costing.host_update_scale +
                      2 * more / costing_lib.HOST_LINK.bandwidth)
    saved = c.microbatches * ((f + b) - (rf + rb)) - extra_update
    if c.dp > 1:
      link = costing.dp_link(c)
      saved = saved - 2 * (c.dp - 1) / c.dp * more / link.bandwidth
    chosen = np.flatnonzero(costing.split & (saved > 0))
    if not len(chosen):
      return [], None, None
    static, kept, _ = costing.memory_terms(c)
    r_static, r_kept, _ = costing.memory_terms(whole)
    most = max(costing.in_flight(c))
    added = (r_static - static) + most * (r_kept - kept)
    return list(chosen), saved, added

  def replicas(self, c, base):
    """The Estimate of c with its blocks worth replicating replicated (as
    many as fit, the most seconds saved per byte first), or None when none
    is worth it or fits; `base`: c's own Estimate."""
    chosen, saved, added = self.replication_gains(c)
    if not chosen:
      return None

    def with_blocks(blocks):
      replicate = tuple(sorted(int(i) for i in blocks))
      found = self.price(dataclasses.replace(c, replicate=replicate))
      return found if found is not None and space.fits(found, self.device_memory) else None

    order = sorted(chosen, key=lambda i: -saved[i] / max(added[i], 1.0))
    est = with_blocks(order)
    if est is None and self.device_memory is not None:
      # Memory adds up with each block: the longest prefix that fits (a
      # binary search), then each later block that still fits beside it (a
      # block's stage decides whether it fits, not only its bytes).
      lo, hi = 0, len(order) - 1
      while lo < hi:
        mid = (lo + hi + 1) // 2
        found = with_blocks(order[:mid])
        if found is not None:
          lo, est = mid, found
        else:
          hi = mid - 1
      kept = order[:lo]
      for i in order[lo + 1:lo + 1 + _GREEDY_TRIES]:  # order[lo] did not fit
        found = with_blocks(kept + [i])
        if found is not None:
          kept, est = kept + [i], found
    if est is None or (base is not None and space.fits(base, self.device_memory) and
                       _rank(base) <= _rank(est)):
      return None
    return est

  def offload_bound(self, c):
    """Seconds c with its state offloaded takes at least: `lower_bound`
    plus the average stage's update on the host (the slowest stage's is
    no less)."""
    div = self.costing.weights_divisor(c)
    costing = self.costing
    host = float((costing.upd / div * costing.host_update_scale +
                  2 * costing.params / div / costing_lib.HOST_LINK.bandwidth).sum())
    return self.lower_bound(c) + host / c.pp

  def variants(self, c, limit=None):
    """Estimates of c: its own, with the blocks worth replicating
    replicated, and (when those do not fit the cap) with its optimizer
    state offloaded, unless that is bound to be slower than `limit`
    seconds."""
    base = self.price(c)
    out = [base] if base is not None else []
    rep = self.replicas(c, base)
    if rep is not None:
      out.append(rep)
    if self.can_offload(c) and not any(space.fits(e, self.device_memory) for e in out):
      moved = dataclasses.replace(c, offload=True)
      if limit is not None and self.offload_bound(moved) > limit:
        self.pruned += 1
      elif self.memory_bound(moved) <= self.device_memory:
        off = self.price(moved)
        if off is not None:
          out.append(off)
        rep = self.replicas(moved, off)
        if rep is not None:
          out.append(rep)
    return out

  def price(self, c):
    """The Estimate of c as given (no blocks replicated or state offloaded
    but c's own): its fastest cut, or the fastest that fits."""
    if c.recompute == "stages":  # the choice per stage is made under the cap
      if self.device_memory is None or self.memory_bound(c) > self.device_memory:
        return None
      ranges = self.cut_stages(c)
      if ranges is None:
        return None
      self.evaluated += 1
      return self.costing.evaluate(c, ranges)
    ranges = self.cut(c)
    if ranges is None:
      return None
    est = self.costing.evaluate(c, ranges)
    self.evaluated += 1
    if not space.fits(est, self.device_memory) and c.pp > 1 and c.virtual_stages == 1:
      ranges = self.cut_under_cap(c)
      if ranges is not None:
        est = self.costing.evaluate(c, ranges)
        self.evaluated += 1
    return est

  def search(self, top=5, progress=None):
    """SearchResult of every candidate, the `top` fastest that fit."""
    t0 = time.perf_counter()
    meshes = self.meshes()
    if not meshes:
      raise PlanError(f"no mesh over {self.devices} devices suits the model: the batch of "
                      f"{self.profile.batch} does not divide over the data-parallel sizes "
                      f"and the {len(self.profile.layers)} layers cannot fill the pipeline; "
                      "use fewer devices or a larger batch")
    fitting, smallest, fastest, by_ep, by_schedule = [], None, None, {}, {}
    kept = []  # step times of the fastest fitting candidates so far (3 x top)
    fit = {}   # (candidate without recompute, recompute) -> whether it fits
    for done, mesh in enumerate(meshes):
      for c in space.candidates_of(mesh, self.profile, self.max_microbatches,
                                        self.schedules, self.zero_stages):
        if c.recompute == "stages":
          # Recomputing some stages fits only where recomputing every block
          # does (with the best cut under the cap).
          if fit.get((_but_recompute(c), "blocks")) is False:
            self.pruned += 1
            continue
        # Branch and bound: the pipeline takes at least m micro-batches of the
        # average stage, so a candidate whose bound is slower than the
        # 3 x top-th fitting one so far cannot rank.
        if len(kept) >= 3 * top and self.lower_bound(c) > kept[-1]:
          self.pruned += 1
          continue
        # Once a plan fits, one that cannot fit is of no use.
        if fitting and self.device_memory is not None and \
            self.memory_bound(c) > self.device_memory:
          self.pruned += 1
          continue
        found = self.variants(c, kept[-1] if len(kept) >= 3 * top else None)
        fit[(_but_recompute(c), c.recompute)] = any(
            space.fits(est, self.device_memory) for est in found)
        for est in found:
          if smallest is None or est.memory < smallest.memory:
            smallest = est
          if fastest is None or _rank(est) < _rank(fastest):
            fastest = est
          if space.fits(est, self.device_memory):
            split = est.candidate.ep > 1
            if split not in by_ep or _rank(est) < _rank(by_ep[split]):
              by_ep[split] = est
            sched = est.candidate.schedule
            if est.candidate.pp > 1 and (sched not in by_schedule or
                                         _rank(est) < _rank(by_schedule[sched])):
              by_schedule[sched] = est
            fitting.append(est)
            bisect.insort(kept, est.step_time)
            del kept[3 * top:]
      if progress is not None:
        progress(done + 1, len(meshes))
    fitting.sort(key=_rank)
    ranked = []
    for est in fitting:  # a plan no faster and no smaller than one above adds nothing
      if not any(_dominates(r, est) for r in ranked):
        ranked.append(est)
        if len(ranked) == top:
          break
    return SearchResult(best=ranked[0] if ranked else None, ranked=ranked,
                        smallest=smallest, fastest=fastest, evaluated=self.evaluated,
                        seconds=time.perf_counter() - t0, devices=self.devices,
                        device_memory=self.cap, costing=self.costing,
                        reserve=self.reserve,
                        best_by_ep=by_ep if self.profile.experts else {},
                        best_by_schedule=by_schedule)

  def exhaustive(self):
    """The fastest fitting Estimate over every candidate, every cut, every
    set of replicated blocks and offload or not (tests hold `search` to it;
    exponential in the layers). Two kinds of plan are left out, as no plan
    of theirs beats the same plan without: replicating a block whose
    forward + backward does not get faster replicated (it adds time to its
    stage, the update and the gradient sync, and memory), and offloading
    where the plan fits without (offload only adds update time, while the
    host is no faster than the device). A candidate whose lower bound
    (`lower_bound`, which holds for every cut) is slower than the best so
    far is skipped: none of its cuts could win."""
    best = None
    n = self.costing.n
    slower_host = self.costing.host_update_scale >= 1
    for mesh in self.meshes():
      for base in space.candidates_of(mesh, self.profile, self.max_microbatches,
                                        self.schedules, self.zero_stages):
        if best is not None and self.lower_bound(base) > best.step_time * (1 + 1e-6):
          continue
        for c in self._exhaustive_replicas(base):
          if best is not None and self._work_bound(c) > best.step_time * (1 + 1e-6):
            continue
          moved = dataclasses.replace(c, offload=True) if self.can_offload(c) else None
          for bounds in itertools.combinations(range(1, n), c.chunks - 1):
            edges = (0,) + bounds + (n,)
            ranges = list(zip(edges, edges[1:]))
            found = [self.costing.evaluate(c, ranges)]
            if moved is not None and not (slower_host and
                                          space.fits(found[0], self.device_memory)):
              found.append(self.costing.evaluate(moved, ranges))
            for est in found:
              if space.fits(est, self.device_memory) and (best is None or
                                                          _rank(est) < _rank(best)):
                best = est
    return best

  def _work_bound(self, c):
    """`lower_bound` of c with its own replicated blocks."""
    f, b = self.costing.layer_times(c)
    return c.microbatches * float((f + b).sum()) / c.pp

  def _exhaustive_replicas(self, c):
    """c with each set of the blocks that get faster replicated."""
    if c.tp == 1 or not self.costing.split.any():
      yield c
      return
    f, b = self.costing.layer_times(c)
    rf, rb = self.costing.layer_times(self._all_replicated(c))
    faster = [int(i) for i in np.flatnonzero(self.costing.split & (rf + rb < f + b))]
    for k in range(len(faster) + 1):
      for subset in itertools.combinations(faster, k):
        yield dataclasses.replace(c, replicate=subset)

  def hand_rule(self):
    """The usual manual plan: tensor parallel within a host, pipeline across
    hosts (the fewest stages that fit, 1f1b, an even cut by layer count, at
    least 4 micro-batches per stage, more if memory needs them), data
    parallel for the rest; recomputation only if nothing fits without it.
    None if nothing fits."""
    tp = 1
    while (tp * 2 <= min(self.host_size, self.profile.max_tp if self.profile.has_blocks
                         else 1, self.max_tp or self.devices)
           and self.devices % (tp * 2) == 0):
      tp *= 2
    n = self.costing.n
    for rc in ("none", "blocks"):
      for pp in space.divisors(self.devices // tp):
        dp = self.devices // (tp * pp)
        if pp > n or self.profile.batch % dp:
          continue
        counts = space.divisors(self.profile.batch // dp)
        fewest = min(4 * pp, counts[-1]) if pp > 1 else 1
        for m in [d for d in counts if d >= fewest]:
          c = space.Candidate(dp, tp, pp, m, "1f1b", 1, rc, 0)
          est = self.costing.evaluate(c, space.even_ranges(n, pp))
          if space.fits(est, self.device_memory):
            return est
    return None


def _but_recompute(c):
  """c's fields but its recomputation."""
  return (c.dp, c.tp, c.pp, c.ep, c.microbatches, c.schedule, c.virtual_stages, c.zero,
          c.replicate, c.offload)


def _rank(est):
  """Fastest first; on a tie (9 digits), the fewer micro-batches, then the
  smaller memory (without per-op overheads, micro-batches cost nothing in
  the model, but they do on a machine)."""
  return (float(f"{est.step_time:.9g}"), est.candidate.microbatches, est.memory)


def _dominates(a, b):
  return a.step_time <= b.step_time * (1 + 1e-9) and a.memory <= b.memory


def _host_size(cluster):
  """Devices of the largest host (tensor parallelism stays within one)."""
  sizes = {}
  for d in cluster.devices:
    sizes[d.host] = sizes.get(d.host, 0) + 1
  return max(sizes.values())


def no_plan_message(result, what="the model"):
  """The one-line error of a search where nothing fits."""
  need = result.smallest
  kept = (f" ({100 * result.reserve:g}% kept in reserve)" if result.reserve else "")
  hint = (f"; the smallest per-device memory that works is "
          f"{format_bytes(memory_needed(need.memory, result.reserve))}"
          + (f" ({format_bytes(need.memory)} planned + {100 * result.reserve:g}% reserve,"
             f" {need.label()})" if result.reserve else f" ({need.label()})")
          + ", or use more devices" if need is not None else "")
  return (f"{what} fits under no plan on {result.devices} devices with "
          f"{format_bytes(result.device_memory)} each{kept}{hint}")
