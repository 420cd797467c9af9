"""Writers for simulated schedules: Chrome-trace / Perfetto JSON and a PNG Gantt.

Files are written whole or not at all (tfsplit.fileio.write_atomically), so a
failed run never leaves a partial trace behind.
matplotlib is an optional extra (`pip install tfsplit[plot]`), imported only
when a chart is asked for.
"""
import io
import json

from tfsplit.errors import TfsplitError
from tfsplit.fileio import write_atomically

# 'backward' is a whole backward, or its input gradients (B) where a
# zero-bubble schedule runs the weight gradients ('weight', W) apart.
_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "weight": "#da8bc3",
           "comm": "#55a868", "compute": "#8172b3", "optimizer": "#c44e52"}
_OTHER_COLOR = "#937860"


def chrome_trace(sim):
  """The schedule as a Chrome trace dict (chrome://tracing, ui.perfetto.dev).

  One process for the devices' compute streams and one for the links, one
  thread per stream, times in microseconds; plus a memory counter per device.
  """
  g = sim.graph
  pids = {"compute": 1, "comm": 2}
  events = [
      {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "devices"}},
      {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "links"}},
  ]
  for r, (name, kind) in enumerate(zip(g.resource_names, g.resource_kinds)):
    events.append({"ph": "M", "name": "thread_name", "pid": pids[kind],
                   "tid": r, "args": {"name": name}})
    events.append({"ph": "M", "name": "thread_sort_index", "pid": pids[kind],
                   "tid": r, "args": {"sort_index": r}})
  for t, r in enumerate(g.resources):
    if r < 0:
      continue
    events.append({"name": g.names[t], "cat": g.kinds[t], "ph": "X",
                   "pid": pids[g.resource_kinds[r]], "tid": r,
                   "ts": sim.start[t] * 1e6,
                   "dur": (sim.end[t] - sim.start[t]) * 1e6})
  for d in g.devices:
    for time, level in sim.memory_timeline(d):
      events.append({"name": f"memory {g.resource_names[d]}", "ph": "C",
                     "pid": 1, "ts": time * 1e6, "args": {"bytes": level}})
  return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(sim, path):
  trace = chrome_trace(sim)
  write_atomically(path, json.dumps(trace, separators=(",", ":")) + "\n")


def require_matplotlib():
  """Fails early, before any file is written, when charts cannot be drawn."""
  _import_pyplot()


def _import_pyplot():
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise TfsplitError(
        "a PNG Gantt chart needs matplotlib, which is not installed; run "
        "'pip install tfsplit[plot]' (or 'pip install matplotlib'), or write "
        "a Chrome trace with --trace instead") from None
  return plt


def write_gantt(sim, path, title=None):
  """A PNG Gantt chart: one row per device and link, coloured by task kind."""
  plt = _import_pyplot()
  g = sim.graph
  rows = list(range(len(g.resource_names)))
  bars = {r: {} for r in rows}  # resource -> kind -> [(start, width)]
  labels = []
  for t, r in enumerate(g.resources):
    if r < 0:
      continue
    bars[r].setdefault(g.kinds[t], []).append(
        (sim.start[t], sim.end[t] - sim.start[t]))
    labels.append(t)
  scale, unit = (1e3, "ms") if sim.step_time < 10 else (1.0, "s")
  fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.5))
  seen = set()
  order = list(_COLORS)
  for y, r in enumerate(rows):
    for kind, spans in sorted(bars[r].items(), key=lambda kv: (
        order.index(kv[0]) if kv[0] in order else len(order), kv[0])):
      ax.broken_barh([(s * scale, w * scale) for s, w in spans], (y - 0.4, 0.8),
                     facecolors=_COLORS.get(kind, _OTHER_COLOR),
                     edgecolor="white", linewidth=0.5,
                     label=None if kind in seen else kind)
      seen.add(kind)
  if len(labels) <= 200:  # names are unreadable beyond that
    for t in labels:
      if sim.end[t] - sim.start[t] < 0.02 * sim.step_time:
        continue  # too narrow to hold a name
      y = rows.index(g.resources[t])
      ax.text((sim.start[t] + sim.end[t]) / 2 * scale, y, g.names[t],
              ha="center", va="center", fontsize=6, color="white")
  ax.set_yticks(range(len(rows)))
  ax.set_yticklabels([g.resource_names[r] for r in rows])
  ax.invert_yaxis()
  ax.set_xlabel(f"time ({unit})")
  ax.set_xlim(0, sim.step_time * scale)
  ax.set_title(title or f"simulated step: {sim.step_time * scale:.4g} {unit}")
  handles, names = ax.get_legend_handles_labels()
  rank = {k: i for i, k in enumerate(order)}
  pairs = sorted(zip(names, handles), key=lambda p: rank.get(p[0], len(order)))
  ax.legend([h for _, h in pairs], [n for n, _ in pairs], fontsize=8,
            loc="upper left", bbox_to_anchor=(1.0, 1.0))
  fig.tight_layout()
  png = io.BytesIO()
  try:
    fig.savefig(png, format="png", dpi=120)
  finally:
    plt.close(fig)
  write_atomically(path, png.getvalue())


def write_schedule(sim, trace=None, gantt=None, title=None):
  """Writes the simulated schedule as a Chrome trace and/or a PNG Gantt chart
  (each when its path is given); returns {'trace'|'gantt': path} written."""
  if gantt:
    require_matplotlib()
  if trace:
    write_chrome_trace(sim, trace)
  if gantt:
    write_gantt(sim, gantt, title=title)
  return {name: path for name, path in (("trace", trace), ("gantt", gantt)) if path}
