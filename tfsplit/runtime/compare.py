"""The one comparison of a split run against the original.

Used by `tfsplit verify`, the tests and the benchmarks. Per tensor it checks:

- **values**: max|got - want| against `rtol` times the tensor's own scale
  (max|want|), never against 1: a weight of size 1e-3 gets a 1e-7 absolute
  limit, not 1e-4. The scale has a floor tied to the dtype's precision (its
  smallest normal number), so a tensor that must stay zero stays zero.
- **updates** (variables of a training step): the same difference measured
  against the largest update of that tensor, max|want_after - start|. Adam
  normalises its step, so a gradient summed where it should be averaged, or a
  10% wrong step on one shard, moves a weight by far less than its size but
  by 10% of its update.
- **every copy**: each device's shard of a variable (data-parallel replicas,
  tensor-parallel replicated tensors) and each device's copy of an output is
  compared against the reference, and the copies against each other, so one
  replica that never trains cannot hide behind another that does.
- **shapes** must match.

Rounding noise: a split graph sums in another order than the original, and a
few tensors are pure rounding noise (an attention key bias has an identically
zero gradient, so Adam moves it by noise). The reference is therefore run a
second time on the batch in reverse order, which changes every reduction order
over the batch but not the mathematics; the difference between the two
reference runs is that tensor's noise, and `NOISE_FACTOR` times it is added to
its tolerance. Breaks worth catching are orders of magnitude above it.
A tensor the reference cannot reproduce to a tenth of its own size
(`NOISE_DOMINATED`) is that noise and nothing else: Adam's second moment of
such a gradient is the noise squared, so two runs' values differ by the
square of their noises' ratio (a tp=2 GPT's key-bias velocity: 5x the
reference's size where the reversed batch gave half of it). It must stay
within `NOISE_FACTOR` times its own size.

Reduced precision (REDUCED_PRECISIONS): a bf16 / fp16 step is checked twice
by runtime/verify.py. Raised to float32, as above. As it is, against the
precision's own spread (the float32 reference minus the reference): each
shard's update by RMS (compare_rms), within `RMS_NOISE_FACTOR` times the
spread's RMS; outputs within one `UNIT_ROUNDOFF` of their scale besides the
spread; values only to within one largest update; copies as in float32.
"""
import dataclasses
from typing import Dict, List, Optional

import numpy as np

# The computing precisions below float32: a training step in them is
# compared the reduced-precision way (REDUCED_PRECISION in the module doc).
REDUCED_PRECISIONS = ("bfloat16", "float16")
# Unit roundoff of each (half an ulp at 1: 8 and 11 significand bits).
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
# How many times the precision's own spread (the reference in float32
# against the reference in its precision, RMS over the shard) a split run's
# RMS update error may be. Seen on Keras 3 mixed_bfloat16 decoders: up to
# ~9x on one tensor at tp=2 (the split's extra roundings of partial sums,
# amplified by Adam on a near-cancelled gradient), median 1x; a shard 10%
# wrong is 20x or more on every tensor with signal.
RMS_NOISE_FACTOR = 12.0

DEFAULT_RTOL = 1e-4
# Updates are compared against the tensor's largest update. Adam divides by
# sqrt(v) + eps, so an element with a near-zero, cancellation-heavy gradient
# amplifies summation-order noise into its step (seen: 1e-3 of the largest
# step after 3 steps at tp=2); a 1% wrong step still fails.
DEFAULT_UPDATE_RTOL = 1e-2
# How many times the reference's own rounding noise a split run may differ by.
NOISE_FACTOR = 10.0
# A tensor whose reference noise is at least this share of its size is
# rounding noise alone (see the module doc); float32 signal tensors show
# 1e-7-1e-5.
NOISE_DOMINATED = 0.1
# The reversed-batch reference only estimates noise if the graph is
# batch-order invariant: its typical tensor must then agree to about float
# precision. A graph whose results depend on batch order gets no noise term.
_MAX_TYPICAL_NOISE = 1e-4

KINDS = ("output", "value", "update", "copy")


def _floor(dtype):
  dtype = np.dtype(dtype)
  if np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.complexfloating):
    return float(np.finfo(dtype).tiny)
  return 0.0


def _exact(dtype):
  dtype = np.dtype(dtype)
  return not (np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.complexfloating))


@dataclasses.dataclass
class Comparison:
  """One tensor compared: `max_abs` against `tolerance` (both absolute)."""
  kind: str          # output / value / update / copy
  what: str          # the tensor, and the device of the copy when it is one
  max_abs: float
  scale: float       # what the error is relative to
  tolerance: float
  note: str = ""

  @property
  def rel(self):
    if self.max_abs == 0:
      return 0.0
    if not np.isfinite(self.max_abs) or self.scale <= 0:
      return float("inf")
    return self.max_abs / self.scale

  @property
  def ok(self):
    return bool(np.isfinite(self.max_abs) and self.max_abs <= self.tolerance)


def noise(want, alternative):
  """max|want - alternative|, the reference's rounding noise (0 if unknown)."""
  if alternative is None:
    return 0.0
  want, alternative = np.asarray(want), np.asarray(alternative)
  if want.shape != alternative.shape or not want.size or _exact(want.dtype):
    return 0.0
  diff = np.abs(want.astype(np.float64) - alternative.astype(np.float64))
  return float(diff.max()) if np.isfinite(diff).all() else 0.0


def compare(kind, what, got, want, rtol=DEFAULT_RTOL, noise_abs=0.0, scale=None, note="",
            size=None):
  """Comparison of `got` with `want` (numpy-like). `scale` defaults to max|want|;
  `size` (default max|want|: the whole tensor's when `want` is a shard of it)
  is what noise_abs is weighed against (NOISE_DOMINATED)."""
  got, want = np.asarray(got), np.asarray(want)
  if got.shape != want.shape:
    return Comparison(kind, what, float("inf"), 0.0, 0.0,
                      f"shape {list(got.shape)}, expected {list(want.shape)}")
  if not want.size:
    return Comparison(kind, what, 0.0, 0.0, 0.0, note)
  if _exact(want.dtype):
    diff = float(np.max(got != want))
    return Comparison(kind, what, diff, 1.0, 0.0, note or "exact")
  g, w = got.astype(np.float64), want.astype(np.float64)
  diff = np.abs(g - w)
  max_abs = float(diff.max()) if not np.isnan(diff).any() else float("nan")
  own = float(np.abs(w).max())
  scale = max(own if scale is None else scale, _floor(want.dtype))
  tolerance = rtol * scale + NOISE_FACTOR * noise_abs
  size = own if size is None else size
  if noise_abs > 0 and noise_abs >= NOISE_DOMINATED * size:
    tolerance = max(tolerance, NOISE_FACTOR * size)
    note = note or "rounding noise"
  return Comparison(kind, what, max_abs, scale, tolerance, note)


def compare_copies(what, copies, rtol=DEFAULT_RTOL, noise_abs=0.0, size=None):
  """Comparisons of every copy after the first with the first.

  copies: [(device, value)] of one tensor (or one block of it) that every
  device must hold identically.
  """
  if len(copies) < 2:
    return []
  first_device, first = copies[0]
  return [compare("copy", f"{what} on {device} vs {first_device}", value, first, rtol,
                  noise_abs, size=size)
          for device, value in copies[1:]]


def typical_noise_is_small(pairs):
  """True if the reversed-batch reference agrees with the reference on the
  median tensor (pairs: [(want, alternative)]), i.e. the graph does not depend
  on batch order and the difference is rounding noise."""
  rel = []
  for want, alt in pairs:
    want = np.asarray(want)
    if not want.size or _exact(want.dtype):
      continue
    scale = float(np.abs(want).max())
    if scale > 0:
      rel.append(noise(want, alt) / scale)
  return bool(rel) and float(np.median(rel)) <= _MAX_TYPICAL_NOISE


def _slices(shard):
  return tuple(slice(o, o + s) for o, s in zip(shard["offsets"], shard["shape"]))


def _rms(x):
  x = np.asarray(x, np.float64)
  return float(np.sqrt(np.mean(np.square(x)))) if x.size else 0.0


def compare_rms(what, got, want, start, spread, update_rtol=DEFAULT_UPDATE_RTOL,
                size=None):
  """The reduced-precision update comparison of one shard: the RMS of
  got - want against `update_rtol` times the RMS of the shard's update
  (want - start) plus RMS_NOISE_FACTOR times the RMS of `spread` (the
  float32 reference minus the reference, over the shard). Elementwise
  maxima say nothing here: rounding a near-zero gradient in 8 bits flips
  the sign of that element's Adam step. A shard that is wrong as a whole
  moves the RMS by the share it is wrong by."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if got.shape != want.shape:
    return Comparison("update", what, float("inf"), 0.0, 0.0,
                      f"shape {list(got.shape)}, expected {list(want.shape)}")
  if not want.size:
    return Comparison("update", what, 0.0, 0.0, 0.0)
  err = _rms(got - want) if np.isfinite(got).all() else float("nan")
  scale = max(_rms(want - np.asarray(start, np.float64)),
              DEFAULT_RTOL * (size or 0.0), _floor(np.float32))
  noise_rms = _rms(spread) if spread is not None else 0.0
  tolerance = update_rtol * scale + RMS_NOISE_FACTOR * noise_rms
  return Comparison("update", what, err, scale, tolerance, "RMS over the shard")


def compare_variables(manifest, start, want, shard_values, alternative=None,
                      rtol=DEFAULT_RTOL, update_rtol=DEFAULT_UPDATE_RTOL, precision=None):
  """Comparisons of every shard of every variable with the reference.

  manifest: {variable: {"shape", "shards": [{"name", "device", "offsets",
    "shape"}]}} (None: variables were not split; shard name = variable name)
  start / want / alternative: {variable: full value} before the run, after the
    reference run, and after the reversed-batch reference run (or None).
  shard_values: {shard name: value} after the split run.
  precision: the step's computing precision; one of REDUCED_PRECISIONS
    compares updates by RMS per shard (compare_rms) against the spread
    `alternative` gives, which must then be the float32 reference's
    variables; elementwise values are only held to within one largest
    update (a gross error), copies as in float32.
  """
  reduced = precision in REDUCED_PRECISIONS
  if reduced and alternative is None:
    raise ValueError(f"comparing a {precision} step needs its float32 reference "
                     "(alternative)")
  out = []
  for name in sorted(want):
    if manifest is not None and name in manifest:
      entry = manifest[name]
      shards = [(s["device"], s["name"], _slices(s)) for s in entry["shards"]]
      full_shape = list(entry["shape"])
    else:
      shards = [("", name, ())]
      full_shape = list(np.shape(want[name]))
    w = np.asarray(want[name])
    if list(w.shape) != full_shape:
      out.append(Comparison("value", name, float("inf"), 0.0, 0.0,
                            f"shape {full_shape}, expected {list(w.shape)}"))
      continue
    s = np.asarray(start[name])
    alt = None if alternative is None else alternative.get(name)
    noise_abs = noise(w, alt)
    # The whole tensor's size and largest update (a shard's comparisons
    # weigh against them; integer tensors compare exactly).
    size = update_scale = None
    if w.size and not _exact(w.dtype):
      w64 = w.astype(np.float64)
      size = float(np.abs(w64).max())
      update_scale = float(np.abs(w64 - s.astype(np.float64)).max())
    by_block = {}
    for device, shard_name, sl in shards:
      where = f"{name} on {device}" if device else name
      got = np.asarray(shard_values[shard_name])
      value_scale = size
      if update_scale is not None and rtol:
        # A variable's value is its start plus its updates; the part that
        # moved is held to the update's tolerance, not 1e-4 of itself (a
        # bias or Adam moment that starts at zero is all update: Adam turns
        # rounding in a near-zero gradient into a visible part of its step).
        value_scale = max(value_scale, update_scale * update_rtol / rtol)
      if reduced and update_scale is not None:
        gross = compare("value", where, got, w[sl], rtol, noise_abs, scale=size, size=size)
        gross.tolerance += update_scale
        gross.note = gross.note or "within one largest update"
        out.append(gross)
        spread = None if alt is None else np.asarray(alt, np.float64)[sl] - w64[sl]
        out.append(compare_rms(where, got, w[sl], s[sl], spread, update_rtol, size))
        by_block.setdefault(tuple((x.start, x.stop) for x in sl), []).append((device, got))
        continue
      out.append(compare("value", where, got, w[sl], rtol, noise_abs, scale=value_scale,
                         size=size))
      if update_scale is not None:
        # got - want == (got - start) - (want - start): the update's error.
        out.append(compare("update", where, got, w[sl], update_rtol, noise_abs,
                           scale=update_scale, size=size))
      by_block.setdefault(tuple((x.start, x.stop) for x in sl), []).append((device, got))
    for copies in by_block.values():
      out.extend(compare_copies(name, copies, rtol, noise_abs, size))
  return out


@dataclasses.dataclass
class Report:
  """Every comparison of one run; `ok` if all hold."""
  comparisons: List[Comparison]
  rtol: float
  noise_estimated: bool = False
  update_rtol: float = DEFAULT_UPDATE_RTOL
  precision: str = "float32"   # a reduced one: comparisons of both runs (verify.py)

  @property
  def ok(self):
    return all(c.ok for c in self.comparisons)

  @property
  def failures(self):
    return [c for c in self.comparisons if not c.ok]

  def worst(self, kind=None):
    """The comparison nearest to (or furthest past) its tolerance."""
    pool = [c for c in self.comparisons if kind is None or c.kind == kind]
    if not pool:
      return None
    return max(pool, key=_badness)

  def worst_by_kind(self) -> Dict[str, Optional[Comparison]]:
    return {k: self.worst(k) for k in KINDS if self.worst(k) is not None}

  def first_divergent_copy(self):
    return next((c for c in self.comparisons if c.kind == "copy" and not c.ok), None)

  def table(self, show_all=False, worst=10):
    """Outputs, the worst variable comparisons, one line per kind, the verdict."""
    header = (f"{'kind':7s} {'compared':62s} {'max abs err':>11s} {'rel err':>10s} "
              f"{'tolerance':>10s}")
    lines = [header]
    rest = [c for c in self.comparisons if c.kind != "output"]
    shown = [c for c in self.comparisons if c.kind == "output"]
    shown += rest if show_all else sorted(rest, key=lambda c: -_badness(c))[:worst]
    for c in shown:
      flag = "" if c.ok else "  MISMATCH"
      note = f"  ({c.note})" if c.note and not c.ok else ""
      lines.append(f"{c.kind:7s} {c.what[-62:]:62s} {c.max_abs:11.3e} {c.rel:10.3e} "
                   f"{c.tolerance:10.3e}{flag}{note}")
    for kind, c in self.worst_by_kind().items():
      lines.append(f"worst {kind:7s}: {c.what} (error {c.rel:.3e} of its scale, "
                   f"{_badness(c):.3g} of its tolerance)")
    copy = self.first_divergent_copy()
    if copy is not None:
      lines.append(f"first divergent copy: {copy.what}")
    failures = self.failures
    noise_note = (f"tolerance: {self.rtol:g} of each tensor's scale, "
                  f"{self.update_rtol:g} of its largest update")
    if self.noise_estimated:
      noise_note += f", + {NOISE_FACTOR:g}x the reference's own rounding noise"
    if self.precision in REDUCED_PRECISIONS:
      noise_note += (f"; in {self.precision}, each shard's RMS update error within "
                     f"{RMS_NOISE_FACTOR:g}x the {self.precision} reference's RMS spread "
                     "from float32")
    if failures:
      lines.append(f"MISMATCH: {len(failures)} of {len(self.comparisons)} comparisons "
                   f"fail, worst {self.worst().what}; {noise_note}")
    else:
      lines.append(f"OK: {len(self.comparisons)} comparisons; {noise_note}")
    return "\n".join(lines)

  def assert_ok(self, context=""):
    """For tests: AssertionError listing the failures."""
    if not self.ok:
      lines = [f"{c.kind} {c.what}: error {c.max_abs:.3e} > tolerance {c.tolerance:.3e} "
               f"(scale {c.scale:.3e}) {c.note}" for c in self.failures[:20]]
      raise AssertionError(f"{context} {len(self.failures)} comparisons fail:\n"
                           + "\n".join(lines))


def _badness(c):
  if c.ok and c.max_abs == 0:
    return 0.0
  if c.tolerance <= 0 or not np.isfinite(c.max_abs):
    return float("inf")
  return c.max_abs / c.tolerance
