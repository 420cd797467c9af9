"""The planner's cost model at layer granularity: Costing prices a
Candidate of space.py cut into stages (search.py chooses the cut) and
returns its Estimate: step time, its parts, and memory per device.

Per micro-batch (1 / (dp m) of the global batch), layer i on its tp group:

  forward   F_i = forward_i / tp_i + 2 all-reduces of its input (split layers)
  backward  B_i = backward_i / tp_i + 2 all-reduces (+ F_i when recomputed)

(forward_i scaled to the micro-batch, plus the per-op overhead, which is not)
(tp_i = tp for a repeated block, the megatron preset's unit, else 1). A
chunk's cost is its layers' F + B plus sending the activations crossing its
cuts and their gradients back. With stage costs c_s the pipeline takes

  S = 1         m c_0
  gpipe, 1f1b   (m - 1) max c + sum c       ((m + S - 1) c on equal stages)
  interleaved   m max c + (sum c - max c) / v     ((m + (S - 1) / v) c)
  zb-h1, zb-h2  m max c + sum g - g of the slowest stage (+ (S - m) W of it
                when m < S)

with c = F + B + W (W: the weight-gradient share of B, LayerRow.weight_share)
and a zero-bubble stage's fill and drain g = max(F, B, F + B - W) for zb-h1,
max(F, F + B - 2 W) for zb-h2 with m >= 2S - 1 (zb-h1's below): what the
event simulator gives on equal stages for m >= S, (S - 1)(F + B - W) and
(S - 1) F at equal F, B and W (fewer micro-batches: at most that)
(the bubbles of tfsplit.cost.pipeline_sim), then the gradient all-reduce
over dp (reduce-scatter + all-gather with ZeRO: the same bytes), one per
25 MiB bucket, the optimizer update (1/dp of it with ZeRO) and, with a
calibration table, the step's launch cost and what each further stage
adds to it beyond its transfers (ModelProfile.launch; calibrate measures
it on small MLP steps cut into 2 and 4 stages).

On logical devices that share one machine's cores (a profile calibrated
with a concurrency, as `tfsplit calibrate` measures for this machine's
logical CPUs) the devices do not compute side by side: the step is at
least all devices' work over the concurrency of that many devices (with
a table that measured them apart, the per-op gaps inside that work over
the gaps' concurrency and the rest over the kernels': the executor's gaps
between small ops overlap on the cores further than the ops' work), plus
the fixed cost of each collective, which grows with its group (per micro-batch and tensor-parallel group, an all-reduce per
weight matrix of a split layer, 4 in a transformer block; per step, a
gradient all-reduce per bucket and group, and with ZeRO an all-gather per
weight; groups that run theirs at the same moments, as a dp=2,tp=2 split's
pairs do, each add part of one: the table's collective_overlap) and of each tensor sent across a stage cut (forward and back, per
micro-batch and device). Every device pays the fixed time of each of its
ops (a split layer's ops run on every tp device, a replica's on every dp
device, each micro-batch's again): that, not the FLOPs, is what splitting
a small model multiplies. A pipeline's stages share the cores as well:
every stage updates at the same moment (the update is at least all
devices' update over their concurrency), and the min(S, m) stages of the
steady state slow each other as that many devices' work does (the
(m - 1) max c term), fill and drain only by their own dp x tp group.

Per device of stage s: weights and gradients of its layers (1/tp of a
split layer's), optimizer state (also 1/dp with ZeRO), and the activations
of the micro-batches in flight, counted as the schedule keeps them
(pipeline_sim.theoretical_peak_activations: m for gpipe, S - s for 1f1b,
chunk activations for interleaved, min(S, m) for zb-h1 and up to 2S - 1 for
zb-h2 on every stage, a micro-batch's activations counted whole until its
weight gradients have run; 1 without a pipeline); a recomputed
block keeps only its input, plus one block's activations while it is
recomputed. recompute='stages' recomputes the blocks of the stages that
would not fit otherwise, and only theirs.

Expert parallelism (ep > 1, a model with mixture-of-experts layers): the
batch is split over dp x ep everywhere (a micro-batch is 1 / (dp ep m) of
it), each device keeps 1/ep of every expert weight and of its gradient,
optimizer state and update; each MoE layer adds per micro-batch two
all-to-alls of its tokens over the ep group forward and two backward (the
row's expert_exchange), and the gradients not of experts are all-reduced
over ep after dp (two collectives, as the rewrite emits them).

Two choices refine a candidate (search.py makes them):
- replicate: repeated blocks left whole on every device of the tp group
  (weights annotated replicated in the rewrite): tp_i = 1 and no
  all-reduces for them; their compute, weights, optimizer state and
  activations are whole on each tp device. It pays for a block whose
  4 all-reduces per micro-batch cost more than (1 - 1/tp) of its compute.
- offload: the optimizer state and the update ops on the devices' host
  CPUs (memory/offload.py): no optimizer state on the device; the update
  becomes the gradients sent to the host and the new weights sent back
  over the host link (HOST_LINK, which cluster specs do not describe),
  plus the update on the host, the device's update time scaled by the
  device's memory bandwidth over the host's share of HOST_MEMORY_BANDWIDTH
  (the update reads and writes memory; it does no heavy math). Not tried
  with ZeRO, nor on CPU devices (their host is themselves).
"""
import math

import numpy as np

from tfsplit.constants import DEFAULT_BUCKET_BYTES, ZERO_BUBBLE_SCHEDULES
from tfsplit.cost import collectives
from tfsplit.cost.cluster import Link
from tfsplit.cost.pipeline_sim import theoretical_peak_activations
from tfsplit.plan.space import Estimate

# Offload prices a device's host with these (cluster specs describe the
# devices and their links to each other only): a PCIe 4.0 x16 link's
# effective rate (about 25 of its 32 GB/s per direction, 10 us a transfer)
# and the DDR bandwidth of a two-socket server, shared by a host's devices.
HOST_LINK = Link(25e9, 10e-6)
# zero=3: layers whose whole weights a device holds at once during a step
# (zero_prefetch 1: the previous, the current and the next layer's, and a
# layer's whole gradient before its reduce-scatter), and its dp traffic
# against an all-reduce's (a reduce-scatter and two all-gathers).
FSDP_WINDOW = 4
FSDP_TRAFFIC = 1.5
HOST_MEMORY_BANDWIDTH = 200e9


class Costing(object):
  """Prices candidates of one model on one cluster (see the module doc)."""

  def __init__(self, profile, cluster, bucket_bytes=DEFAULT_BUCKET_BYTES,
               device_memory=None):
    self.profile = profile
    self.cluster = cluster
    self.device_memory = device_memory   # what recompute='stages' must fit
    self.bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES
    rows = profile.layers
    self.n = len(rows)
    col = lambda key: np.array([float(getattr(r, key)) for r in rows])  # pylint: disable=unnecessary-lambda-assignment
    self.fwd, self.bwd, self.upd = col("forward"), col("backward"), col("update")
    self.fwd_fixed, self.bwd_fixed = col("forward_fixed"), col("backward_fixed")
    self.weight_share = col("weight_share")
    self.upd_fixed, self.variables = col("update_fixed"), col("variables")
    self.fwd_ops, self.bwd_ops, self.upd_ops = (col("forward_ops"), col("backward_ops"),
                                                col("update_ops"))
    # Seconds of per-op gaps in one pass of every layer's forward and backward.
    self.fb_gaps = float((self.fwd_ops + self.bwd_ops).sum()) * profile.op_gap
    self.tp_collectives = col("tp_collectives")
    self.params, self.slots = col("params"), col("slots")
    self.acts, self.inp = col("activations"), col("input_bytes")
    self.split = np.array([r.splittable for r in rows])   # the repeated blocks
    self.tp_layers = np.array([r.tp_split for r in rows])  # the layers the preset splits over tp
    # The expert weights' share of each layer's weights (and so of its
    # gradients, optimizer state and update), and its tokens' exchange.
    self.expert_share = np.array([r.expert_params / r.params if r.params else 0.0
                                  for r in rows])
    self.exchange = col("expert_exchange")
    self.moe = self.exchange > 0
    self.cuts = np.array([float(c) for c in profile.cuts])
    self._links = {}
    self._masks = {}
    self._divisions = {}
    self._flight = {}
    self._memo = {}   # per-layer terms of the candidates priced last
    kinds = {d.kind.upper() for d in cluster.devices}
    # A CPU device's host is itself: nothing to offload to.
    self.can_offload = not any(k.startswith("CPU") for k in kinds)
    hosts = {}
    for d in cluster.devices:
      hosts[d.host] = hosts.get(d.host, 0) + 1
    device_bw = min(d.memory_bandwidth for d in cluster.devices)
    # How much slower an update runs on the host than on the device.
    self.host_update_scale = device_bw / (HOST_MEMORY_BANDWIDTH / max(hosts.values()))

  def tp_split(self, c):
    """Per layer: whether c splits it over tp (the layers the preset splits
    but the blocks c replicates)."""
    if c.tp == 1:
      return np.zeros(self.n, dtype=bool)
    if not c.replicate:
      return self.tp_layers
    if c.replicate not in self._masks:
      mask = self.tp_layers.copy()
      mask[list(c.replicate)] = False
      self._masks[c.replicate] = mask
    return self._masks[c.replicate]

  def tp_divisor(self, c):
    """Per layer: c.tp where c splits it over tp, else 1 (its compute and
    activations per device are 1/that)."""
    return np.where(self.tp_split(c), c.tp, 1)

  def weights_divisor(self, c):
    """Per layer: what its weights, gradients, optimizer state and update
    are divided by on a device of c (tp, and ep for its expert part)."""
    return self._divided(c)[0]

  def _divided(self, c):
    """(weights_divisor, params / it, upd / it) of c's tp size, replicated
    blocks and ep (callers never write into them)."""
    key = _split_key(c)
    if key not in self._divisions:
      div = self.tp_divisor(c) / self.kept_over_ep(c)
      self._divisions[key] = (div, self.params / div, self.upd / div)
    return self._divisions[key]

  def kept_over_ep(self, c):
    """Per layer: the share of its weights (gradients, optimizer state,
    update) a device of c keeps: all but (1 - 1/ep) of the expert weights."""
    return 1.0 - self.expert_share * (1.0 - 1.0 / c.ep)

  def dense_params(self, c):
    """Per layer: bytes of its non-expert weights on a device of c (the
    gradients summed over ep as well as dp)."""
    return self.params * (1.0 - self.expert_share) / self.tp_divisor(c)

  # --- links (pp-major layout, tp fastest) ---------------------------------------
  def _link(self, kind, c):
    key = (kind, c.dp, c.tp, c.pp, c.ep)
    if key not in self._links:
      inner = c.ep * c.tp   # devices of one data-parallel replica of a stage
      if kind == "tp":
        self._links[key] = self.cluster.group_link(range(c.tp))
      elif kind == "ep":
        self._links[key] = self.cluster.group_link(range(0, inner, c.tp))
      elif kind == "dp":
        self._links[key] = self.cluster.group_link(range(0, c.dp * inner, inner))
      else:  # one pipeline hop
        self._links[key] = self.cluster.link(0, c.dp * inner) if c.pp > 1 else None
    return self._links[key]

  def dp_link(self, c):
    """The link of c's data-parallel group (its gradient all-reduce)."""
    return self._link("dp", c)

  def pipeline_link(self, c):
    """The link one pipeline hop crosses (None without a pipeline)."""
    return self._link("pp", c)

  def _remember(self, key, compute):
    """compute() once per key: what decides the terms (exhaustive search
    prices one candidate over many cuts, and the candidates of one
    micro-batch size and tp group share them); callers never write into
    the arrays returned."""
    if key not in self._memo:
      if len(self._memo) > 4096:
        self._memo.clear()
      self._memo[key] = compute()
    return self._memo[key]

  def layer_times(self, c, recompute=None):
    """(F, B) per layer for one micro-batch of candidate c (numpy arrays);
    recompute: 'none' or 'blocks' instead of c's ('stages' prices as none)."""
    blocks = (recompute or c.recompute) == "blocks"
    return self._remember(("times", c.replicas * c.microbatches, _split_key(c), blocks),
                          lambda: self._layer_times(c, recompute))

  def _layer_times(self, c, recompute):
    frac = 1.0 / (c.replicas * c.microbatches)
    split = self.tp_split(c)
    tpdiv = self.tp_divisor(c)
    f = self.fwd * frac / tpdiv + self.fwd_fixed
    b = self.bwd * frac / tpdiv + self.bwd_fixed
    if c.tp > 1:
      link = self._link("tp", c)
      n = c.tp
      ar = (2 * (n - 1) * link.latency +
            2 * (n - 1) / n * self.inp * frac / link.bandwidth)
      f = f + np.where(split, 2 * ar, 0.0)
      b = b + np.where(split, 2 * ar, 0.0)
    if c.ep > 1 and self.moe.any():
      # The tokens to their experts and back: an all-to-all each way over
      # ep (forward, and the same bytes again in the backward).
      # Each tp rank of an expert exchanges the whole tokens.
      exchange = collectives.pairwise_all_to_all(c.ep, self.exchange / 2 * frac,
                                                 self._link("ep", c))
      f = f + np.where(self.moe, 2 * exchange, 0.0)
      b = b + np.where(self.moe, 2 * exchange, 0.0)
    if (recompute or c.recompute) == "blocks":
      b = b + np.where(self.split, f, 0.0)
    return f, b

  def cut_times(self, c):
    """Seconds per cut: the activations crossing it and their gradients."""
    return self._remember(("cuts", c.replicas * c.microbatches, self._link("pp", c)),
                          lambda: self._cut_times(c))

  def _cut_times(self, c):
    link = self._link("pp", c)
    if link is None or not len(self.cuts):
      return np.zeros(len(self.cuts))
    frac = 1.0 / (c.replicas * c.microbatches)
    # Nothing crossing a cut sends nothing (as the stage balancer prices it).
    return np.where(self.cuts > 0, 2 * (link.latency + self.cuts * frac / link.bandwidth),
                    0.0)

  def memory_terms(self, c, recompute=None):
    """Per layer: (static bytes, activation bytes per micro-batch in flight,
    bytes of one recomputation) for candidate c; recompute: 'none' or
    'blocks' instead of c's ('stages' counts as blocks: the least it can keep)."""
    blocks = (recompute or c.recompute) in ("blocks", "stages")
    return self._remember(("memory", c.replicas * c.microbatches, _split_key(c), c.offload,
                           c.dp if c.zero else 1, _fsdp(c), blocks),
                          lambda: self._memory_terms(c, recompute))

  def _memory_terms(self, c, recompute):
    frac = 1.0 / (c.replicas * c.microbatches)
    div = self.weights_divisor(c)
    weights = self.params / div
    slots = (0.0 if c.offload else self.slots / div / (c.dp if c.zero else 1))
    static = 2 * weights + slots   # weights + their gradients + optimizer state
    full = self.acts * frac / self.tp_divisor(c)
    if (recompute or c.recompute) in ("blocks", "stages"):
      kept = np.where(self.split, self.inp * frac, full)
      again = np.where(self.split, full, 0.0)
    else:
      kept, again = full, np.zeros(self.n)
    if c.zero >= 3:
      # FSDP: the weights and their gradient sums are 1/dp too; during the
      # step a window of whole layers (the one computing, the one before
      # it, the one gathered ahead, and one layer's whole gradient before
      # its reduce-scatter) is the transient working set. With micro-batches
      # or stages the gathers are not ordered: every weight of the stage is
      # whole once the step starts.
      static = 2 * weights / c.dp + slots
      if _fsdp(c) == "whole":
        static = static + weights
      else:
        again = again + FSDP_WINDOW * weights
    return static, kept, again

  def in_flight(self, c):
    """Live micro-batch activations per stage (chunk activations for interleaved)."""
    if c.pp == 1:
      return [1]
    key = (c.schedule, c.pp, c.microbatches, c.virtual_stages)
    if key not in self._flight:
      self._flight[key] = theoretical_peak_activations(c.schedule, c.pp, c.microbatches,
                                                       c.virtual_stages)
    return self._flight[key]

  def stage_recompute(self, c, ranges):
    """recompute='stages': per stage, whether it recomputes its blocks: only
    where its memory without would be over the cap."""
    if self.device_memory is None:
      return [False] * c.pp
    static, kept, again = self.memory_terms(c, "none")
    counts = self.in_flight(c)
    return [float(static[j:i].sum() + counts[s] * kept[j:i].sum() + again[j:i].max()) +
            self.profile.static_bytes > self.device_memory
            for s, (j, i) in enumerate(ranges)]

  def evaluate(self, c, ranges):
    """The Estimate of candidate c cut into `ranges` (one per model chunk:
    contiguous, non-empty, covering every layer)."""
    S, v, m = c.pp, c.virtual_stages, c.microbatches
    starts = np.array([j for j, _ in ranges])
    ends = np.array([i for _, i in ranges])
    chunk_stage = np.arange(len(ranges)) % S

    def per_chunk(values, reduce=np.add):
      return reduce.reduceat(values, starts)

    def per_stage(values):
      return np.bincount(chunk_stage, weights=values, minlength=S)

    recomputed = None
    if c.recompute == "stages":
      recomputed = self.stage_recompute(c, ranges)
      pick = np.array(recomputed)[chunk_stage]
      # (F + B, static, kept, recomputation) per layer, without and with
      # recomputation; each chunk takes its stage's choice.
      none, blocks = ([sum(self.layer_times(c, rc)), *self.memory_terms(c, rc)]
                      for rc in ("none", "blocks"))
      reducers = (np.add, np.add, np.add, np.maximum)
      fb, static, kept, again = (np.where(pick, per_chunk(b, r), per_chunk(a, r))
                                 for a, b, r in zip(none, blocks, reducers))
    else:
      f, b = self.layer_times(c)
      static, kept, again = self.memory_terms(c)
      fb, static, kept = per_chunk(f + b), per_chunk(static), per_chunk(kept)
      again = per_chunk(again, np.maximum)
    cin = np.concatenate([[0.0], self.cut_times(c), [0.0]])  # by cut index 0..n
    stage_cost = per_stage(fb + cin[starts] + cin[ends])
    _, params, upd = self._divided(c)
    stage_grads = per_stage(per_chunk(params))
    stage_update = per_stage(per_chunk(upd))
    if c.offload:  # gradients to the host, new weights back, the update there
      stage_vars = per_stage(per_chunk(self.variables))
      stage_update = (stage_update * self.host_update_scale + 2 * stage_grads /
                      HOST_LINK.bandwidth + 2 * stage_vars * HOST_LINK.latency)
    stage_again = np.zeros(S)
    np.maximum.at(stage_again, chunk_stage, again)
    top, total = float(stage_cost.max()), float(stage_cost.sum())
    # What the stages other than the slowest add to m of its micro-batches:
    # their whole c under gpipe and 1f1b, their fill and drain g under the
    # zero-bubble schedules.
    rest = total - top
    if S > 1 and c.schedule in ZERO_BUBBLE_SCHEDULES:
      fill_drain, weights = self.zero_bubble_fill(c, stage_cost, per_chunk, per_stage)
      slowest = int(np.argmax(stage_cost))
      # Fewer micro-batches than stages leave S - m of the slowest stage's
      # W blocks after its last B (nothing to hide them behind).
      rest = float(fill_drain.sum() - fill_drain[slowest] +
                   max(0, S - m) * weights[slowest])
    if S == 1:
      pipe = m * total
    elif v == 1:
      pipe = m * top + rest
    else:
      pipe = m * top + (total - top) / v
    bubble = 1.0 - m * total / (S * pipe) if S > 1 and pipe > 0 else 0.0
    if S > 1 and self.profile.concurrency:
      # On shared cores the steady state's min(S, m) stages (each its dp x
      # tp devices) slow each other, and a stage's own group does in the
      # fill and drain; the schedule's bubble is the same.
      steady = self.shared_slowdown(min(S, m) * c.replicas * c.tp, fb)
      fill = self.shared_slowdown(c.replicas * c.tp, fb)
      pipe = ((m - 1) * top * steady + (top + rest) * fill if v == 1 else
              m * top * steady + (total - top) / v * fill)
    # Per stage: its gradients' all-reduce over dp, one per bucket, and
    # the non-expert gradients' over ep (each ep rank owns its experts).
    sync = self._gradient_sync(c.dp, stage_grads, self._link("dp", c))
    if c.ep > 1:
      sync = sync + self._gradient_sync(c.ep, per_stage(per_chunk(self.dense_params(c))),
                                        self._link("ep", c))
    if c.zero >= 3:
      # Reduce-scatter + an all-gather for the forward and one for the
      # backward: 1.5x an all-reduce's bytes.
      sync = sync * FSDP_TRAFFIC
    sync = float(np.max(sync))
    update = float(stage_update.max()) / (c.dp if c.zero else 1) + self.profile.other_update
    if self.profile.concurrency:
      update = max(update, self.shared_update_time(c))
    counts = np.array(self.in_flight(c))
    memory = (per_stage(static) + counts * per_stage(kept) / v + stage_again +
              self.profile.static_bytes)
    step = pipe + sync + update
    if self.profile.concurrency:
      recompute = (np.array(recomputed)[chunk_stage] if recomputed is not None
                   else np.full(len(ranges), c.recompute == "blocks"))
      step = max(step, self.shared_host_time(c, ranges, recompute))
    return Estimate(candidate=c, ranges=[tuple(r) for r in ranges],
                    step_time=step + self.profile.launch(S),
                    pipeline_time=pipe, sync_time=sync,
                    update_time=update, bubble=bubble,
                    stage_memory=[int(x) for x in memory],
                    stage_time=[float(x) for x in stage_cost], recomputed=recomputed)

  def zero_bubble_fill(self, c, stage_cost, per_chunk, per_stage):
    """(g, W) per stage under a zero-bubble schedule: the seconds each
    stage adds to the step as fill and drain (the module doc's g) and its
    weight gradients' seconds per micro-batch (weight_share of the
    backward's scaling part, out of the critical path). zb-h2 gets its
    lower g only with 2S - 1 micro-batches to run ahead; with fewer it is
    priced as zb-h1 (the simulator's zb-h2 is no slower)."""
    f, b = self.layer_times(c)
    frac = 1.0 / (c.replicas * c.microbatches)
    w = np.minimum(self.bwd * frac / self.tp_divisor(c) * self.weight_share, b)
    F, W = per_stage(per_chunk(f)), per_stage(per_chunk(w))
    B = stage_cost - F - W  # the input gradients and the stage's transfers
    if c.schedule == "zb-h2" and c.microbatches >= 2 * c.pp - 1:
      return np.maximum(F, F + B - 2 * W), W
    return np.maximum(np.maximum(F, B), F + B - W), W

  def _gradient_sync(self, n, grads, link):
    """Seconds per stage of all-reducing `grads` bytes per stage (an array)
    over n devices, one all-reduce per bucket (0 for n = 1)."""
    if n == 1:
      return np.zeros(len(grads))
    buckets = np.maximum(1.0, np.ceil(grads / self.bucket_bytes))
    return (collectives.ring_all_reduce(n, grads, link) +
            2 * (n - 1) * link.latency * (buckets - 1))

  def on_shared_cores(self, work, gaps, devices):
    """Seconds of `work` seconds of compute, `gaps` of them per-op gaps,
    spread over `devices` logical devices that run at the same moment on
    one machine's shared cores: the gaps over the gaps' concurrency and
    the rest over the kernels' (with a table that measured them apart),
    else all of it over the devices' concurrency."""
    split_concurrency = self.profile.kernel_and_gap_concurrency(devices)
    if split_concurrency is None:
      return work / self.profile.concurrency_for(devices)
    kernels, gap = split_concurrency
    gaps = min(gaps, work)
    return (work - gaps) / kernels + gaps / gap

  def _update_work(self, c):
    """(seconds, ops) of the update on one device group of c: every
    layer's update ops (1/tp of a split layer's work, 1/dp with ZeRO) and
    the update ops all layers share."""
    return self._remember(("update", _split_key(c), c.dp if c.zero else 1),
                          lambda: self._priced_update(c))

  def _priced_update(self, c):
    work = (self.upd - self.upd_fixed) / self.weights_divisor(c) / (c.dp if c.zero else 1)
    return (float((work + self.upd_fixed).sum()) + self.profile.other_update,
            float(self.upd_ops.sum()) + self.profile.other_update_ops)

  def shared_update_time(self, c):
    """Seconds of the update on shared cores: every stage updates its
    weights at the same moment, after its last backward, so a pipeline's
    stages do not update side by side at full speed (the max over stages
    priced the example MLPs' pp=4 steps, whose update is most of their
    time, at 0.73-0.94 of their measured step)."""
    groups = c.replicas * c.tp
    seconds, ops = self._update_work(c)
    return self.on_shared_cores(groups * seconds, groups * ops * self.profile.op_gap,
                                c.devices)

  def shared_slowdown(self, devices, fb):
    """How many times longer the stages' forward and backward take when
    `devices` logical devices run them at the same moment on shared cores
    (1 for one device): a pipeline's stages overlap in its steady state
    (the gpipe / 1f1b formula's (m - 1) max c), each on the cores the
    others use too. fb: the chunks' seconds per micro-batch, their per-op
    gaps apart."""
    total = float(np.sum(fb))
    if devices <= 1 or total <= 0:
      return 1.0
    return max(1.0, self.on_shared_cores(devices * total, devices * self.fb_gaps,
                                         devices) / total)

  def shared_host_time(self, c, ranges, recompute):
    """Seconds of a step on logical devices sharing one machine's cores (see
    the module doc): every device's compute over the concurrency, plus the
    fixed cost of each collective and transfer. recompute: per chunk."""
    m, groups = c.microbatches, c.replicas * c.tp
    profile = self.profile
    frac = 1.0 / (c.replicas * m)
    split = self.tp_split(c)
    tpdiv = self.tp_divisor(c)
    f = self.fwd * frac / tpdiv + self.fwd_fixed
    b = self.bwd * frac / tpdiv + self.bwd_fixed
    again = np.zeros(self.n, dtype=bool)
    for (j, i), rc in zip(ranges, recompute):
      again[j:i] = rc
    per_micro = float((f + b + np.where(again & self.split, f, 0.0)).sum())
    per_step, update_ops = self._update_work(c)
    work = groups * (m * per_micro + per_step)
    # Seconds of the collectives' fixed costs: each over its group's size.
    launches = 0.0
    # The dp replicas' tensor-parallel groups all-reduce at the same
    # moments, and so do the tp ranks' data-parallel groups: a moment
    # costs one group's collective and part of one per further group.
    if c.tp > 1:   # per split layer and micro-batch (half again recomputed)
      per_layer = self.tp_collectives * np.where(again, 1.5, 1.0)
      launches += (m * float(np.where(split, per_layer, 0.0).sum()) *
                   profile.collective_for(c.tp, groups=c.replicas))
    if c.ep > 1:   # per MoE layer and micro-batch: 2 exchanges forward, 2 back
      per_layer = 4 * np.where(again, 1.5, 1.0)
      launches += (m * float(np.where(self.moe, per_layer, 0.0).sum()) *
                   profile.collective_for(c.ep, groups=c.dp * c.tp))
      dense = self.dense_params(c)
      ep_launches = 0
      for j, i in ranges:
        ep_launches += max(1, math.ceil(float(dense[j:i].sum()) / self.bucket_bytes))
      launches += ep_launches * profile.collective_for(c.ep, groups=c.dp * c.tp)
    weights_div = self.weights_divisor(c)
    if c.dp > 1:
      # The step's outputs (the loss), all-reduced over dp once per step.
      dp_launches = profile.step_outputs
      fixed, per_byte = profile.bucket_copy
      for j, i in ranges:
        grads = float((self.params[j:i] / weights_div[j:i]).sum())
        buckets = max(1, math.ceil(grads / self.bucket_bytes))
        dp_launches += buckets
        # Every replica packs and unpacks its buckets.
        work += c.tp * c.replicas * (buckets * fixed + grads * per_byte)
        if c.zero:
          dp_launches += float(self.variables[j:i].sum())
      launches += dp_launches * profile.collective_for(c.dp, groups=c.ep * c.tp)
    crossing = sum(1 for _, i in ranges[:-1] if self.cuts[i - 1] > 0)
    transfers = 2 * crossing * groups * m
    ops = (m * float((self.fwd_ops + self.bwd_ops +
                      np.where(again & self.split, self.fwd_ops, 0.0)).sum()) + update_ops)
    compute = self.on_shared_cores(work, groups * ops * profile.op_gap, c.devices)
    return compute + launches + transfers * profile.transfer_overhead


def _fsdp(c):
  """How zero=3 keeps the weights during a step: None (not zero=3), 'window'
  (gathers ordered layer by layer), 'whole' (with micro-batches or stages:
  not ordered)."""
  if c.zero < 3:
    return None
  return "whole" if c.microbatches > 1 or c.pp > 1 else "window"


def _split_key(c):
  """What of c decides which layers it splits over tp, and how far."""
  return ((c.tp, c.replicate) if c.tp > 1 else (1, ())) + (c.ep,)

