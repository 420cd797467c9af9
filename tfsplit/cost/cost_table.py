"""The measured op costs of one machine, as `tfsplit calibrate` writes them: a
CostTable's measured time per signature, its fitted line per op type or form
(a fixed time per call plus an efficiency factor times the roofline, fitted
here by least squares), what a step pays apart from kernels (its launch,
further arguments, outputs and pipeline stages, collectives and transfers
between logical devices, how many devices run at once) with the
interpolation of those over device counts, and the table's versioned JSON.
It is data about one machine, kept apart from the counting (op_work) and the
pricing (op_cost.CostModel), so a table can be read, written and refitted
without a cluster spec or any op counting."""

# An op type whose cost per call depends on its form has a line per form
# (op_form: an einsum without batch labels runs as one MatMul, a batched one
# transposes its inputs; a batched matmul of a matrix by a batch of them is one
# MatMul over the rows; a transpose of more than two dimensions is Eigen's
# generic shuffle). The fixed part matters on CPUs: a small Transpose or
# BatchMatMul costs tens of microseconds whatever its size (kernel set-up, the
# intra-op thread pool), and it does not shrink when a split makes the tensors
# smaller. The table also holds what a step on this machine's logical devices
# pays apart from kernels: how many devices run at once (they share the
# machine's cores), and the fixed cost of one collective and of one
# cross-device transfer.

import dataclasses
import json
import statistics

from tfsplit.errors import CostTableError
from tfsplit.fileio import read_json, write_atomically

TABLE_VERSION = 1


@dataclasses.dataclass
class CostTable:
  """Measured op costs of one machine (see `tfsplit calibrate`).

  entries: signature -> seconds of the ops of the graphs calibrated
    (`tfsplit calibrate GRAPH`): the median over its nodes of each one's
    fastest traced run inside that graph's step.
  op_factor: line (an op type, or 'op:form' for the forms of op_form) ->
    measured / roofline time, for shapes not measured.
  default_factor: the factor for op types never measured.
  op_overhead: seconds every op that runs costs on top of its kernel (the
    executor's dispatch gap between ops).
  time_scale: untraced / traced kernel time; profiling slows each kernel a
    little, this takes it back out.
  step_overhead: seconds every step costs before its first op (launch:
    a call of one argument and one output).
  argument_overhead / output_overhead: seconds each further argument /
    output of a call adds to it (call_overhead).
  stage_overhead: seconds each further pipeline stage adds to a step,
    beyond its transfers (fitting.further_stage_seconds); None: not measured
    (tables from before it was), each stage then priced at step_overhead.
  flops / bandwidth: the machine's measured best MatMul FLOP/s and copy
    bytes/s; the roofline of a calibrated device uses these.
  op_fixed: line -> seconds per call that do not scale with its tensors
    (the intercept of its fitted line); default_fixed for other op types.
  graph_scale: a whole training step's time over the sum of its ops' times
    by the fitted lines (gaps between ops, ops side by side on the cores);
    scales the lines.
  concurrency: how many of two of this machine's logical devices compute at
    once (they share its cores); None: devices are independent.
  collective_overhead: seconds of one collective (one group's all-reduce of
    a small tensor) between two logical devices; transfer_overhead: seconds
    of one tensor sent to another logical device.
  concurrency_at / collective_at: the same measured over more devices
    ({devices: value}; see concurrency_for and collective_for).
  kernel_concurrency / gap_concurrency: {devices: how many devices' ops'
    work, and how many devices' per-op gaps (op_overhead), run at once}
    (fitting.kernel_and_gap_concurrency); {}: not measured.
  collective_overlap: the share of one group's collective cost that each
    further group running one at the same moment adds (two tensor-parallel
    pairs of a dp=2,tp=2 split all-reduce side by side; their waits partly
    overlap): 0 fully, 1 (unmeasured) not at all; see collectives_at_once.
  machine: where it was measured (platform, cores, TensorFlow), and
    'training_steps': seconds of each of the calibration's small synthetic
    training steps then, the machine's level (a benchmark times them again
    to see how much faster or slower the machine runs now:
    fitting.machine_level).
  """
  entries: dict = dataclasses.field(default_factory=dict)
  op_factor: dict = dataclasses.field(default_factory=dict)
  default_factor: float = 1.0
  op_overhead: float = 0.0
  time_scale: float = 1.0
  step_overhead: float = 0.0
  argument_overhead: float = 0.0
  output_overhead: float = 0.0
  stage_overhead: float = None
  flops: float = None
  bandwidth: float = None
  machine: dict = dataclasses.field(default_factory=dict)
  op_fixed: dict = dataclasses.field(default_factory=dict)
  default_fixed: float = 0.0
  graph_scale: float = 1.0
  concurrency: float = None
  collective_overhead: float = 0.0
  transfer_overhead: float = 0.0
  concurrency_at: dict = dataclasses.field(default_factory=dict)
  collective_at: dict = dataclasses.field(default_factory=dict)
  collective_overlap: float = 1.0
  kernel_concurrency: dict = dataclasses.field(default_factory=dict)
  gap_concurrency: dict = dataclasses.field(default_factory=dict)

  def concurrency_for(self, devices):
    """How many of `devices` logical devices compute at once (None: they
    are independent hardware)."""
    if self.concurrency is None:
      return None
    return concurrency_for({2: self.concurrency, **self.concurrency_at}, devices)

  def call_overhead(self, arguments, outputs):
    """Seconds a call of `arguments` inputs and `outputs` outputs pays
    beyond step_overhead (whose call has one of each)."""
    return (self.argument_overhead * max(0, arguments - 1) +
            self.output_overhead * max(0, outputs - 1))

  def graph_call_overhead(self, graph):
    """call_overhead of a call of `graph` (a tfsplit Graph) as a function:
    its inputs and outputs."""
    from tfsplit.graph.endpoints import graph_inputs, graph_outputs  # pylint: disable=import-outside-toplevel
    return self.call_overhead(len(graph_inputs(graph)), len(graph_outputs(graph)))

  def collective_for(self, group):
    """Seconds of one collective over a group of `group` logical devices."""
    return collective_for({2: self.collective_overhead, **self.collective_at}, group)

  def fixed(self, line):
    """Seconds of a call on an op type's line ('op' or 'op:form', see
    NodeCost.line) that do not scale with its tensors; a form the table has
    no line for takes its op type's."""
    return _on_line(self.op_fixed, line, self.default_fixed)

  def factor(self, line):
    """The roofline factor of a line, as `fixed`."""
    return _on_line(self.op_factor, line, self.default_factor)

  def lookup(self, sig):
    """Seconds for a measured signature (None if not measured).

    A 0 entry is an op Grappler fused away or folded: it costs nothing.
    """
    value = self.entries.get(sig)
    if value is None:
      return None
    return value * self.time_scale + self.op_overhead if value else 0.0

  def to_json(self):
    return {"version": TABLE_VERSION, "machine": self.machine,
            "flops": self.flops, "bandwidth": self.bandwidth,
            "op_overhead": self.op_overhead, "time_scale": self.time_scale,
            "step_overhead": self.step_overhead,
            "argument_overhead": self.argument_overhead,
            "output_overhead": self.output_overhead,
            "stage_overhead": self.stage_overhead,
            "default_factor": self.default_factor,
            "op_factor": dict(sorted(self.op_factor.items())),
            "default_fixed": self.default_fixed,
            "op_fixed": dict(sorted(self.op_fixed.items())),
            "graph_scale": self.graph_scale,
            "concurrency": self.concurrency,
            "collective_overhead": self.collective_overhead,
            "transfer_overhead": self.transfer_overhead,
            "concurrency_at": {str(k): v for k, v in sorted(self.concurrency_at.items())},
            "collective_at": {str(k): v for k, v in sorted(self.collective_at.items())},
            "collective_overlap": self.collective_overlap,
            "kernel_concurrency": {str(k): v for k, v in sorted(self.kernel_concurrency.items())},
            "gap_concurrency": {str(k): v for k, v in sorted(self.gap_concurrency.items())},
            "entries": dict(sorted(self.entries.items()))}

  def save(self, path):
    """Writes the table as JSON atomically (temp file, then rename)."""
    write_atomically(path, json.dumps(self.to_json(), indent=1) + "\n")

  @classmethod
  def load(cls, path):
    obj = read_json(path, CostTableError,
                    f"calibration table '{path}' does not exist; write "
                    "one with 'tfsplit calibrate -o FILE'",
                    f"cannot read calibration table '{path}': {{error}}; it "
                    "must be the JSON 'tfsplit calibrate' writes")
    if not isinstance(obj, dict) or obj.get("version") != TABLE_VERSION:
      raise CostTableError(f"calibration table '{path}': not a version "
                           f"{TABLE_VERSION} table; rerun 'tfsplit calibrate'")
    try:
      return cls(entries={str(k): float(v) for k, v in obj["entries"].items()},
                 op_factor={str(k): float(v)
                            for k, v in obj["op_factor"].items()},
                 default_factor=float(obj["default_factor"]),
                 op_overhead=float(obj["op_overhead"]),
                 time_scale=float(obj["time_scale"]),
                 step_overhead=float(obj.get("step_overhead", 0.0)),
                 argument_overhead=float(obj.get("argument_overhead", 0.0)),
                 output_overhead=float(obj.get("output_overhead", 0.0)),
                 stage_overhead=(float(obj["stage_overhead"])
                                 if obj.get("stage_overhead") is not None else None),
                 flops=obj.get("flops"), bandwidth=obj.get("bandwidth"),
                 machine=dict(obj.get("machine") or {}),
                 op_fixed={str(k): float(v)
                           for k, v in (obj.get("op_fixed") or {}).items()},
                 default_fixed=float(obj.get("default_fixed", 0.0)),
                 graph_scale=float(obj.get("graph_scale", 1.0)),
                 concurrency=(float(obj["concurrency"]) if obj.get("concurrency")
                              else None),
                 collective_overhead=float(obj.get("collective_overhead", 0.0)),
                 transfer_overhead=float(obj.get("transfer_overhead", 0.0)),
                 concurrency_at={int(k): float(v) for k, v in
                                 (obj.get("concurrency_at") or {}).items()},
                 collective_at={int(k): float(v) for k, v in
                                (obj.get("collective_at") or {}).items()},
                 collective_overlap=float(obj.get("collective_overlap", 1.0)),
                 kernel_concurrency={int(k): float(v) for k, v in
                                     (obj.get("kernel_concurrency") or {}).items()},
                 gap_concurrency={int(k): float(v) for k, v in
                                  (obj.get("gap_concurrency") or {}).items()})
    except (KeyError, TypeError, ValueError, AttributeError) as e:
      raise CostTableError(f"calibration table '{path}': malformed ({e}); "
                           "rerun 'tfsplit calibrate'") from None

  def fit_factors(self, costs, seconds=None, fixed=None):
    """Sets op_factor / op_fixed and their defaults from measured entries.

    costs: signature -> (line, roofline seconds) for the measured signatures.
    Per line (an op type or one of its forms), seconds = fixed + factor *
    roofline, fitted by least squares over its measured sizes (both kept
    >= 0); one size gives the ratio alone.
    seconds: signature -> measured seconds to fit instead of the entries.
    fixed: line -> fixed seconds to keep (only the factor is fitted).
    """
    by_op = {}
    for sig, measured in (self.entries if seconds is None else seconds).items():
      if sig not in costs:
        continue
      op, roof = costs[sig]
      if roof <= 0:
        continue
      work = max(measured * self.time_scale - self.op_overhead, 0.0)
      by_op.setdefault(op, []).append((roof, work))
    self.op_factor, self.op_fixed = {}, {}
    for op, points in by_op.items():
      if fixed is not None and op in fixed:
        self.op_fixed[op] = fixed[op]
        self.op_factor[op] = _fit_factor(points, fixed[op])
      else:
        self.op_fixed[op], self.op_factor[op] = _fit_line(points)
    if self.op_factor:
      self.default_factor = statistics.median(self.op_factor.values())
      self.default_fixed = statistics.median(self.op_fixed.values())


def concurrency_for(points, devices):
  """Concurrency of `devices` logical devices from measured {devices:
  concurrency}: that of the largest count measured up to `devices` (beyond
  the cores, more devices add no parallelism)."""
  below = [k for k in points if k <= devices]
  return points[max(below)] if below else 1.0


def collectives_at_once(seconds, groups, overlap):
  """Seconds that `groups` groups' collectives add when each runs one at
  the same moment, one alone taking `seconds`: each further group adds
  `overlap` of it (1: as many collectives one after another)."""
  return seconds * (1.0 + max(0, groups - 1) * overlap)


def collective_for(points, group):
  """Seconds of one collective over `group` devices from measured {group:
  seconds}: linear in group - 1 (a ring's steps grow with its members)
  between the points and beyond the last two; through the origin from a
  single point."""
  keys = sorted(k for k, v in points.items() if v is not None and k >= 2)
  if not keys:
    return 0.0
  if len(keys) == 1 or group <= keys[0]:
    return points[keys[0]] * max(1.0, (group - 1) / (keys[0] - 1))
  lo, hi = next(((a, b) for a, b in zip(keys, keys[1:]) if group <= b),
                (keys[-2], keys[-1]))
  slope = (points[hi] - points[lo]) / (hi - lo)
  return max(0.0, points[lo] + slope * (group - lo))


# Ops no calibration step runs, priced on the line of an op doing the same
# work: an optimizer's in-place update reads two tensors and writes one, as
# the elementwise op does. The calibration's steps feed their weights, so
# no variable update is ever timed, and the default line (a roofline over
# the variable's bytes) priced them well above what a traced step shows.
_SAME_WORK = {"AssignAddVariableOp": "AddV2", "AssignSubVariableOp": "Sub"}


def _on_line(values, line, default):
  if line in values:
    return values[line]
  op = line.partition(":")[0]
  if op in values:
    return values[op]
  return values.get(_SAME_WORK.get(op), default)


def _fit_factor(points, fixed):
  """factor >= 0 of seconds = fixed + factor * roofline, relative least
  squares over (roofline, seconds) points."""
  w = [1.0 / max(t, 1e-9) for _, t in points]
  num = sum(x * x * r * (t - fixed) for x, (r, t) in zip(w, points))
  den = sum(x * x * r * r for x, (r, _) in zip(w, points))
  return max(0.0, num / den) if den > 0 else 0.0


def _fit_line(points):
  """(fixed, factor) >= 0 of seconds = fixed + factor * roofline over
  (roofline, seconds) points, least squares relative to each point (small
  and large sizes count alike)."""
  if len({r for r, _ in points}) < 2:
    return 0.0, statistics.median(w / r for r, w in points)
  # Weighted by 1 / seconds: minimise the relative error.
  w = [1.0 / max(t, 1e-9) for _, t in points]
  sww = sum(x * x for x in w)
  swr = sum(x * x * r for x, (r, _) in zip(w, points))
  srr = sum(x * x * r * r for x, (r, _) in zip(w, points))
  swt = sum(x * x * t for x, (_, t) in zip(w, points))
  srt = sum(x * x * r * t for x, (r, t) in zip(w, points))
  det = sww * srr - swr * swr
  if det > 0:
    fixed = (swt * srr - swr * srt) / det
    factor = (sww * srt - swr * swt) / det
    if fixed >= 0 and factor >= 0:
      return fixed, factor
  # A bound is active: the better of a line through 0 and a constant.
  factor = srt / srr
  fixed = swt / sww
  err_factor = sum(x * x * (t - factor * r) ** 2 for x, (r, t) in zip(w, points))
  err_fixed = sum(x * x * (t - fixed) ** 2 for x, (_, t) in zip(w, points))
  return (0.0, factor) if err_factor <= err_fixed else (fixed, 0.0)
