"""Parsing and printing of byte sizes and counts given on the command line.

Units are decimal unless the binary suffix is spelled out: 16GB (and 16G) is
16e9 bytes, 16GiB is 16 * 2**30 bytes, and 1 TB is 1e12 bytes. Vendors quote
device memory in decimal GB (an "80 GB" H100 has about 80e9 usable bytes),
and so do the ZeRO and Megatron papers whose numbers the estimator reproduces.
"""
import math
import re

from tfsplit.errors import UnitsError


_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12, "p": 10**15, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}

# Parameter counts: B is billion here, as in "7B model", never bytes.
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9,
                "t": 10**12}

_NUMBER_RE = re.compile(
    r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?|[0-9]+\.)\s*([a-zA-Z]*)\s*$")


def _scaled(text, what, example, scales, unknown):
  """A number (or a string: a number and an optional unit from `scales`)
  times its unit's scale; `unknown`: the error's end for an unknown unit."""
  if isinstance(text, (int, float)) and not isinstance(text, bool):
    return float(text)
  match = _NUMBER_RE.match(str(text))
  if not match:
    raise UnitsError(f"cannot read {what} '{text}': expected a number with an "
                     f"optional unit, e.g. {example}")
  value, unit = float(match.group(1)), match.group(2)
  if unit.lower() not in scales:
    raise UnitsError(f"unknown {what} {unknown.format(unit=unit, text=text)}")
  return value * scales[unit.lower()]


def parse_bytes(text):
  """'16GB' -> 16000000000 (decimal), '16GiB' -> 17179869184; returns an int.

  A bare number is bytes. Accepted units: B, KB/K, MB/M, GB/G, TB/T, PB/P
  (powers of 1000) and KiB, MiB, GiB, TiB, PiB (powers of 1024).
  """
  size = _scaled(text, "size", "16GB, 80GB or 16GiB", _BYTE_UNITS,
                 "unit '{unit}' in '{text}'; use B, KB, MB, GB, TB (decimal, "
                 "1 GB = 1e9 bytes) or KiB, MiB, GiB, TiB")
  if not math.isfinite(size) or size <= 0:
    raise UnitsError(f"size '{text}' must be a positive number of bytes")
  return int(round(size))


def parse_count(text):
  """'100e9', '175B', '1.5M' -> an int count (B = billion, T = trillion)."""
  count = _scaled(text, "count", "100e9, 175B or 1.5M", _COUNT_UNITS,
                  "suffix '{unit}' in '{text}'; use K, M, B (billion) or T "
                  "(trillion), or write it out as 100e9")
  if not math.isfinite(count) or count < 1:
    raise UnitsError(f"count '{text}' must be a positive number")
  return int(round(count))


def format_bytes(n):
  """Decimal, four significant digits: 1.2e12 -> '1.2 TB', 412e9 -> '412 GB'."""
  n = float(n)
  for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6),
                      ("KB", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.4g} {unit}"
  return f"{n:.4g} B"


def format_count(n):
  """1e11 -> '100 B' (billion), 1.5e6 -> '1.5 M'."""
  n = float(n)
  for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.4g} {unit}"
  return f"{n:.4g}"
