"""Plain-text tables and human-readable numbers for command output."""
from tfsplit.units import format_bytes, format_count


def human_bytes(n):
  return "?" if n is None else format_bytes(n)


def human_count(n):
  return "?" if n is None else format_count(n)


def format_table(header, rows):
  """Left-aligned first column, right-aligned others; one header rule."""
  cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
  widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(len(header))]

  def line(row):
    parts = []
    for i, cell in enumerate(row):
      parts.append(cell.ljust(widths[i]) if i <= 1 else cell.rjust(widths[i]))
    return "  ".join(parts).rstrip()
  return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] +
                   [line(r) for r in cells[1:]])
