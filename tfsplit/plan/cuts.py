"""The stage cut: a dynamic program over contiguous layer ranges.

`min_max_cut` is the program as written down: over the n layers, the
`chunks` contiguous ranges that minimise the largest chunk cost, every
range [j, i) of an (n + 1) x (n + 1) matrix tried for every chunk,
O(chunks n^2). It is the reference. The planner's cuts (`fastest_cut`,
`capped_cut`, `stage_choice_cut`) return the very cut it returns (the same
ranges, not only the same slowest chunk: its tie-breaks are kept) from a
band of ranges no longer than a bound, laid out by their end (a `Band`),
each range's terms computed by the same sums as the matrices' so that
every comparison comes out the same. What leaves the band can be on no
optimal cut, nor decide the program's choice anywhere on one:

- ranges slower than a known cut's slowest chunk (a balanced cut bounds
  the unconstrained program);
- ranges over the memory cap: a range holds at least the sum of its
  layers' bytes, so it is no longer than the most of the smallest layers
  that fit (with a margin far above the sums' rounding), and a cut whose
  chunks' longest ranges do not add up to the layers fits nowhere: it is
  refused before any range is priced;
- rows no chunk can end at (k + 1 ranges behind it, the rest to come).

Memory caps come as the most micro-batches in flight each range can keep
(`fit_counts`, decided by the cap's own sum), so one band serves every
stage of a schedule.
"""
import numpy as np

_INDEX = {}   # (n, width) -> (rows, starts, valid) of a band's entries
# Relative slack of the bounds on a range's length (its sums' rounding is
# some 1e-14 of them).
_SLACK = 1e-9


def chunk_cost_matrix(fb, cut_t, n):
  """C[j, i]: seconds of a chunk running layers [j, i), inf where i <= j."""
  prefix = np.concatenate([[0.0], np.cumsum(fb)])
  cin = np.concatenate([[0.0], cut_t, [0.0]])    # by cut index 0..n
  cost = prefix[None, :] - prefix[:, None] + cin[:, None] + cin[None, :]
  cost[np.tril_indices(n + 1)] = np.inf
  return cost


def range_sums(values, n):
  prefix = np.concatenate([[0.0], np.cumsum(values)])
  return prefix[None, :] - prefix[:, None]


def threshold(cap, static, kept, again):
  """Per range: the most micro-batches in flight that fit `cap`."""
  room = cap - static - again
  out = np.full(room.shape, np.inf)
  np.divide(room, kept, out=out, where=kept > 0)
  out[room < 0] = -1.0
  return out


def range_max(values, n):
  out = np.zeros((n + 1, n + 1))
  for j in range(n):
    out[j, j + 1:] = np.maximum.accumulate(values[j:])
  return out


def min_max_cut(cost, chunks, feasible=None):
  """[(start, end)] of `chunks` contiguous ranges over cost's n layers that
  minimise the largest cost[start, end]; cost may be a list, one matrix per
  chunk; feasible[k] (optional): a boolean matrix of the ranges chunk k may
  take. None when no cut is feasible."""
  n = (cost[0] if isinstance(cost, list) else cost).shape[0] - 1
  if chunks > n:
    return None
  best = np.full(n + 1, np.inf)
  best[0] = 0.0
  back = []
  for k in range(chunks):
    c = cost[k] if isinstance(cost, list) else cost
    if feasible is not None:
      c = np.where(feasible[k], c, np.inf)
    total = np.maximum(best[:, None], c)
    arg = np.argmin(total, axis=0)
    best = total[arg, np.arange(n + 1)]
    back.append(arg)
  if not np.isfinite(best[n]):
    return None
  ranges, i = [], n
  for k in reversed(range(chunks)):
    j = int(back[k][i])
    ranges.append((j, i))
    i = j
  return list(reversed(ranges))


class Band(object):
  """The ranges [i - d, i) of n layers, 1 <= d <= width: entry [i, width - d]
  (by end, the longest first); `valid` where i - d >= 0. Each method gives
  an entry the value the (n + 1) x (n + 1) matrix of the same name gives
  range [i - d, i), by the same arithmetic."""

  def __init__(self, n, width):
    self.n, self.width = n, width
    key = (n, width)
    if key not in _INDEX:
      rows = np.arange(n + 1)[:, None]
      starts = rows - np.arange(width, 0, -1)[None, :]
      valid = starts >= 0
      _INDEX[key] = (np.broadcast_to(rows, starts.shape), np.where(valid, starts, 0), valid)
    self.rows, self.starts, self.valid = _INDEX[key]

  def sums(self, values):
    """range_sums (junk where not valid)."""
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    return prefix[self.rows] - prefix[self.starts]

  def maxes(self, values):
    """range_max (junk where not valid)."""
    # A range's maximum is its first layer's or that of the range one shorter.
    return np.maximum.accumulate(values[self.starts][:, ::-1], axis=1)[:, ::-1]

  def costs(self, fb, cut_t):
    """chunk_cost_matrix (inf where not valid)."""
    prefix = np.concatenate([[0.0], np.cumsum(fb)])
    cin = np.concatenate([[0.0], cut_t, [0.0]])
    out = prefix[self.rows] - prefix[self.starts] + cin[self.starts] + cin[self.rows]
    out[~self.valid] = np.inf
    return out

  def longest(self, allowed):
    """The longest range `allowed` (boolean, by entry) holds; 0 if none."""
    hit = np.flatnonzero((allowed & self.valid).any(axis=0))
    return self.width - int(hit[0]) if len(hit) else 0

  def lengths(self, limits, need):
    """Per value of `need`: the longest range whose limit is at least it."""
    by_length = np.where(self.valid, limits, -np.inf).max(axis=0)[::-1]  # d = 1, 2, ...
    most = np.maximum.accumulate(by_length[::-1])[::-1]   # over ranges at least d long
    return [int(x) for x in (most[None, :] >= np.asarray(need)[:, None]).sum(axis=1)]

  def first(self, limits, count):
    """The longest range [0, i) whose limit is at least `count` (0 if none)."""
    ends = np.arange(1, min(self.width, self.n) + 1)
    hit = np.flatnonzero(limits[ends, self.width - ends] >= count)
    return int(ends[hit[-1]]) if len(hit) else 0

  def last(self, limits, count):
    """The longest range [j, n) whose limit is at least `count` (0 if none)."""
    d = np.arange(1, min(self.width, self.n) + 1)
    hit = np.flatnonzero(limits[self.n, self.width - d] >= count)
    return int(d[hit[-1]]) if len(hit) else 0

  def narrow(self, width, *arrays):
    """The Band of the ranges up to `width` long, and `arrays` cut to it."""
    return (Band(self.n, width),) + tuple(a[:, self.width - width:] for a in arrays)


def banded_cut(band, costs, chunks):
  """min_max_cut over `band`: costs[k] is chunk k's cost of each range of the
  band (inf where it may not be taken); one array may serve several chunks.
  None when no cut is feasible within the band."""
  n, width = band.n, band.width
  if chunks > n or width < 1:
    return None
  # best[width + i]: the slowest chunk of the best cut of layers [0, i) so
  # far; a row's window best[i:i + width] is its ranges' starts, the
  # longest first.
  best = np.full(n + 1 + width, np.inf)
  best[width] = 0.0
  windows = np.lib.stride_tricks.sliding_window_view(best, width)
  back = []
  before = 0   # the rows the last chunk ended at start here
  for k in range(chunks):
    # Rows a chunk k of a cut can end at: k + 1 ranges of at most `width`
    # layers behind, chunks - k - 1 still to come.
    left = chunks - 1 - k
    lo, hi = max(k + 1, n - left * width), min(n - left, (k + 1) * width)
    if lo > hi:
      return None
    total = np.maximum(windows[lo:hi + 1], costs[k][lo:hi + 1])
    values = total.min(axis=1)
    if k % 4 == 3 and not values.min() < np.inf:
      return None
    best[width + before:width + lo] = np.inf   # rows this chunk cannot end at
    best[width + lo:width + hi + 1] = values
    before = lo
    back.append((lo, total))   # the choice is read on the cut's rows only
  if not best[width + n] < np.inf:
    return None
  ranges, i = [], int(n)
  for k in reversed(range(chunks)):
    lo, total = back[k]
    j = i - (width - int(total[i - lo].argmin()))   # the first start of the least
    ranges.append((j, i))
    i = j
  return list(reversed(ranges))


def fit_counts(cap, static, kept, again, most):
  """Per range: the most micro-batches in flight, at most `most`, for which
  static + count * kept + again <= cap (0 when not even one), decided by
  that very sum: a stage keeping `count` fits the range iff count <= it."""
  room = cap - static - again
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    guess = np.floor(room / np.where(kept > 0, kept, 1.0))
  # Nothing kept per micro-batch: every count fits, or none does.
  guess = np.where(kept > 0, guess, np.where(room >= 0, most, 0))
  counts = np.clip(np.nan_to_num(guess, nan=0.0, posinf=most, neginf=0.0), 0,
                   most).astype(np.int64)
  # The sum grows with the count (kept >= 0), so the exact entry is where
  # count fits and count + 1 does not: steps up or down from the estimate.
  while True:
    up = (counts < most) & (static + (counts + 1) * kept + again <= cap)
    down = (counts > 0) & ~(static + counts * kept + again <= cap)
    if not up.any() and not down.any():
      return counts
    counts = counts + up - down


def _reach(per_layer, room, slack=0.0):
  """The most layers whose `per_layer` values (rows: one per count; >= 0)
  can add up to at most `room` plus `slack` and _SLACK of it (bounds a
  range's length from above)."""
  ordered = np.sort(per_layer, axis=1)
  sums = np.cumsum(ordered, axis=1)
  return (sums <= room + abs(room) * _SLACK + slack).sum(axis=1)


def _memory_band(n, terms, room, stage_counts):
  """(Band, {count: longest range}) bounding the ranges a stage keeping
  each of stage_counts may take with terms = (static, kept) bytes per layer
  in `room` bytes; None where those bounds cannot cover the n layers."""
  static, kept = terms
  need = sorted(set(stage_counts))
  per_layer = static[None, :] + np.array(need, dtype=float)[:, None] * kept[None, :]
  reach = dict(zip(need, (int(x) for x in _reach(per_layer, room, slack=1.0))))
  lengths = [reach[c] for c in stage_counts]
  if min(lengths) < 1 or sum(lengths) < n:
    return None
  return Band(n, max(lengths)), need


def _covers(band, limits, stage_counts, need):
  """The narrowest width of `band` that holds every range some chunk may
  take (stage_counts[k] <= limits), or None where the chunks' longest
  ranges cannot cover the layers (the first starts at 0, the last ends at n)."""
  reach = dict(zip(need, band.lengths(limits, need)))
  lengths = [reach[c] for c in stage_counts]
  width = max(lengths)
  lengths[0] = min(lengths[0], band.first(limits, stage_counts[0]))
  lengths[-1] = min(lengths[-1], band.last(limits, stage_counts[-1]))
  if min(lengths) < 1 or sum(lengths) < band.n:
    return None
  return width


def _balanced_edges(prefix, chunks):
  """Edges of `chunks` non-empty contiguous ranges over the layers whose
  weights add up to `prefix` (0 first), each near an equal share of them."""
  n = len(prefix) - 1
  ends = np.searchsorted(prefix[1:], prefix[-1] * np.arange(1, chunks) / chunks) + 1
  k = np.arange(chunks - 1)
  ends = np.maximum.accumulate(np.minimum(np.maximum(ends - k, 1), n - chunks + 1)) + k
  return np.concatenate([[0], ends, [n]])


def fastest_cut(fb, cut_t, chunks):
  """min_max_cut(chunk_cost_matrix(fb, cut_t, n), chunks): ranges slower
  than a balanced cut's slowest chunk left out."""
  n = len(fb)
  if chunks > n:
    return None
  if chunks == 1:
    return [(0, n)]
  prefix = np.concatenate([[0.0], np.cumsum(fb)])
  cin = np.concatenate([[0.0], cut_t, [0.0]])
  bound = np.inf
  # Two cuts, by cost and by layer count: the slowest chunk of the better
  # one, priced as chunk_cost_matrix prices it, bounds the program's.
  for edges in (_balanced_edges(prefix, chunks),
                np.array([round(k * n / chunks) for k in range(chunks + 1)])):
    starts, ends = edges[:-1], edges[1:]
    if (ends > starts).all():
      bound = min(bound, float((prefix[ends] - prefix[starts] + cin[starts] +
                                cin[ends]).max()))
  # A range costs at least its layers' fb (the cuts' transfers add to it).
  width = int(_reach(np.asarray(fb, dtype=float)[None, :], bound)[0]) if \
      np.isfinite(bound) else n
  band = Band(n, max(1, width))
  costs = band.costs(fb, cut_t)
  costs[costs > bound] = np.inf
  band, costs = band.narrow(band.longest(costs < np.inf), costs)
  return banded_cut(band, [costs] * chunks, chunks)


def capped_cut(fb, cut_t, memory, static_bytes, cap, stage_counts):
  """min_max_cut(chunk_cost_matrix(fb, cut_t, n), len(stage_counts),
  feasible) where chunk k may take range r only while
  static[r] + stage_counts[k] * kept[r] + again[r] <= cap, each of them
  range_sums(static) + static_bytes, range_sums(kept) and range_max(again)
  (or 0 where again is 0) of memory = (static, kept, again) per layer."""
  n, chunks = len(fb), len(stage_counts)
  if chunks > n:
    return None
  static, kept, again = memory
  found = _memory_band(n, (static, kept), cap - static_bytes, stage_counts)
  if found is None:
    return None
  band, need = found
  s_again = band.maxes(again) if again.any() else 0.0
  fits = fit_counts(cap, band.sums(static) + static_bytes, band.sums(kept), s_again,
                    max(stage_counts))
  fits[~band.valid] = -1
  width = _covers(band, fits, stage_counts, need)
  if width is None:
    return None
  band, fits, costs = band.narrow(width, fits, band.costs(fb, cut_t))
  per_count = {c: np.where(fits >= c, costs, np.inf) for c in need}
  return banded_cut(band, [per_count[c] for c in stage_counts], chunks)


def stage_choice_cut(options, cut_t, static_bytes, cap, stage_counts):
  """recompute='stages': min_max_cut where chunk k takes a range at the cost
  of the first option (fb, (static, kept, again)) per layer whose threshold
  (the most micro-batches in flight that fit `cap`, as `threshold` finds it
  from the option's range sums) holds stage_counts[k], inf where none
  does; None when no cut is feasible."""
  n, chunks = len(options[0][0]), len(stage_counts)
  if chunks > n:
    return None
  static, kept = options[0][1][:2]
  for _, terms in options[1:]:
    static, kept = np.minimum(static, terms[0]), np.minimum(kept, terms[1])
  found = _memory_band(n, (static, kept), cap - static_bytes, stage_counts)
  if found is None:
    return None
  band, need = found
  taken = []
  for fb, (static, kept, again) in options:
    s_again = band.maxes(again) if again.any() else 0.0
    limit = threshold(cap, band.sums(static) + static_bytes, band.sums(kept), s_again)
    limit[~band.valid] = -1.0
    taken.append((band.costs(fb, cut_t), limit))
  most = taken[0][1]
  for _, limit in taken[1:]:
    most = np.maximum(most, limit)
  width = _covers(band, most, stage_counts, need)
  if width is None:
    return None
  narrowed = [band.narrow(width, cost, limit) for cost, limit in taken]
  band = narrowed[0][0]
  per_count = {}
  for count in need:
    out = np.full(narrowed[0][1].shape, np.inf)
    for _, cost, limit in reversed(narrowed):
      out = np.where(count <= limit, cost, out)
    per_count[count] = out
  return banded_cut(band, [per_count[c] for c in stage_counts], chunks)
