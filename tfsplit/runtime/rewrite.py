"""`tfsplit rewrite` on files: load a graph, split it over a mesh, write the
rewritten graph and its shard manifest.

Both files are serialized before either is written, and each is written
atomically, so a failed rewrite leaves no output.
"""
import collections
import time

from tfsplit import constants
from tfsplit.passes import coverage


def rewrite_file(source, output, config, signature=None, variables=None, graph_def=None):
  """Splits the graph at `source` under `config` (a SplitConfig) and writes
  it to `output` with its manifest; returns the summary lines of what was
  done. signature / variables: how to load it (graph.load_graph);
  graph_def: the graph already loaded from `source`."""
  from tfsplit.fileio import write_atomically  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import manifest as manifest_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import split_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import save_graph  # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  if graph_def is None:
    graph_def = load_source(source, signature, variables)
  result = split_graph(graph_def, config)
  manifest_text = result.manifest_json(source=source)
  save_graph(result.graph_def, output)
  write_atomically(manifest_lib.manifest_path(output), manifest_text)
  lines = [f"rewrote {source} over mesh {config.mesh} ({config.strategy}) in "
           f"{time.perf_counter() - t0:.2f} s"]
  lines += summary(graph_def, result)
  lines.append(f"wrote {output} and {manifest_lib.manifest_path(output)}")
  return lines


def load_source(source, signature=None, variables=None):
  """The graph at `source`, its variables' shapes required."""
  from tfsplit.graph import load_graph, recover  # pylint: disable=import-outside-toplevel
  graph_def = load_graph(source, signature=signature, variables_from=variables)
  recover.require_variable_shapes(graph_def, source, variables)
  return graph_def


def summary(graph_def, result):
  """The lines saying what a split of `graph_def` did."""
  config = result.config
  split_vars = sum(1 for e in result.manifest.values() if any(e["sharding"]))
  lines = [f"  {len(graph_def.node)} -> {len(result.graph_def.node)} nodes, {split_vars} "
           f"of {len(result.manifest)} variables split"]
  lines.append(_ops_per_device_line(graph_def, result))
  lines.append(coverage.axis_line(result))
  if result.partition and config.virtual_stages > 1:
    lines.append(f"  pipeline: {config.stages} stages x {config.virtual_stages} virtual "
                 f"stages, chunks {result.partition}, {config.schedule} over "
                 f"{config.microbatches} micro-batches")
  elif result.partition:
    lines.append(f"  pipeline: {len(result.partition)} stages {result.partition}, "
                 f"{config.schedule} over {config.microbatches} micro-batches")
  lines.append(f"  collectives: {result.count('all_reduce')} all-reduce, "
               f"{result.count('local_sum')} micro-batch sums, "
               f"{result.count('all_gather')} all-gather; {len(result.fallbacks)} "
               "fallback(s) to replication")
  if result.experts:
    lines.append(expert_summary(result))
  moved = _bytes_by_dtype(result.collectives)
  if moved:
    lines.append("  collective tensors: " + "; ".join(
        f"{kind} {', '.join(f'{mb:.3g} MB {dtype}' for dtype, mb in by_dtype)}"
        for kind, by_dtype in moved))
  boundary = stage_boundary_bytes(graph_def, result.stage_of)
  if boundary:
    count, by_dtype = boundary
    lines.append(f"  stage boundaries: {count} tensors, "
                 + ", ".join(f"{mb:.3g} MB {dtype}" for dtype, mb in by_dtype)
                 + " per step (forward and backward, all micro-batches)")
  lines += _bucket_lines(result)
  if config.recompute_mode is not None:
    from tfsplit.memory import recompute as recompute_lib  # pylint: disable=import-outside-toplevel
    lines.append("  " + recompute_lib.graph_summary(result.graph_def, config.recompute_mode))
  if config.offload:
    from tfsplit.memory import offload as offload_lib  # pylint: disable=import-outside-toplevel
    lines.append(offload_lib.summary(result.manifest, result.offloaded_nodes))
  lines += [f"  fallback: {msg}" for msg in result.fallbacks]
  return lines


def _bucket_lines(result):
  """The gradient buckets' line, and optimizer-state sharding's lines."""
  config, lines = result.config, []
  buckets = [c for c in result.collectives if c.kind == "bucket"]
  if buckets:
    per_group = collections.Counter(c.devices for c in buckets)
    packed = {t for c in buckets for t in c.members}
    lines.append(f"  gradient buckets: {len(packed)} all-reduces over "
                 f"{'/'.join(sorted({c.axis for c in buckets}))} packed into "
                 f"{max(per_group.values())} bucket(s) per group ({len(per_group)} "
                 f"group(s), at most {config.bucket_bytes / 2**20:g} MiB each)")
  if config.zero:
    from tfsplit.sharding import zero as zero_lib  # pylint: disable=import-outside-toplevel
    scattered = [c for c in result.collectives
                 if c.kind in ("reduce_scatter_bucket", "all_gather_bucket")]
    lines.append(f"  optimizer-state sharding: {result.count('reduce_scatter')} "
                 f"reduce-scatters, {result.count('all_gather')} all-gathers, in "
                 f"{len(scattered)} bucket(s)")
    lines += zero_lib.summary(result.manifest, config.mesh.axes, config.zero)
  return lines


def expert_summary(result):
  """One line: the expert weights split over 'ep' and the expert bytes
  (weights and their optimizer slots) each device holds, against one device
  holding them all."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import manifest as manifest_lib  # pylint: disable=import-outside-toplevel
  ep = result.mesh.axes.get(constants.EXPERT_AXIS, 1)
  names = {name for name, e in result.manifest.items()
           if e["sharding"] and e["sharding"][0] == constants.EXPERT_AXIS}
  held = manifest_lib.bytes_per_device(result.manifest, names)
  whole = sum(int(np.prod(result.manifest[n]["shape"], dtype=np.int64)) *
              np.dtype(result.manifest[n]["dtype"]).itemsize for n in names)
  counts = sorted({e.experts for e in result.experts})
  most = max(held.values()) if held else 0
  return (f"  experts: {len(result.experts)} expert weights ("
          f"{'/'.join(map(str, counts))} experts each) split over {constants.EXPERT_AXIS}={ep}"
          f", {result.count('all_to_all', constants.EXPERT_AXIS)} token all-to-alls; expert weights and slots "
          f"{most / 2**20:.3g} MiB per device of {whole / 2**20:.3g} MiB "
          f"({most / max(whole, 1):.2f}x)")


def _ops_per_device(counts):
  low, high = min(counts.values()), max(counts.values())
  return f"{high}" if low == high else f"{low}-{high}"


def _bytes_by_dtype(collectives):
  """[(kind, [(dtype name, MB)])]: the global size of the tensors each kind
  of collective moves, per dtype (a bf16 activation half a float32 one)."""
  from tensorflow.python.framework import dtypes  # pylint: disable=import-outside-toplevel
  totals = collections.defaultdict(lambda: collections.defaultdict(float))
  for c in collectives:
    if getattr(c, "dtype", 0) and c.kind in ("all_reduce", "reduce_scatter", "all_gather",
                                             "all_to_all"):
      dtype = dtypes.as_dtype(c.dtype)
      totals[c.kind][dtype.name] += c.num_elements * dtype.size / 1e6
  return [(kind, sorted(by.items())) for kind, by in sorted(totals.items())]


def stage_boundary_bytes(graph_def, stage_of):
  """(number of tensors, [(dtype name, MB)]) that cross pipeline stages in a
  step of `graph_def` (the original) cut by `stage_of` ({node: model
  chunk}), in each tensor's own dtype: a bf16 activation half the bytes of
  a float32 one. None without a pipeline."""
  if not stage_of:
    return None
  from tensorflow.python.framework import dtypes  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import Graph  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.shapes import infer_shapes  # pylint: disable=import-outside-toplevel
  graph = Graph(graph_def)
  crossing = set()
  for node in graph.nodes:
    stage = stage_of.get(node.name)
    if stage is None:
      continue
    for src, port in graph.data_inputs(node.name):
      if stage_of.get(src, stage) != stage:
        crossing.add((src, port))
  shapes = infer_shapes(graph)
  totals = collections.defaultdict(float)
  for src, port in crossing:
    info = shapes.tensor(src, port)
    if info is None or info.num_elements is None or not info.dtype:
      continue
    dtype = dtypes.as_dtype(info.dtype)
    if dtype == dtypes.resource:
      continue
    totals[dtype.name] += info.num_elements * dtype.size / 1e6
  return len(crossing), sorted(totals.items())


def _ops_per_device_line(graph_def, result):
  """Ops on each device against the original's, in all and without constants:
  what a split adds per device (collectives, local shapes, bucket packing)."""
  original = len(graph_def.node)
  original_ops = sum(1 for n in graph_def.node if n.op != "Const")
  counts, ops = result.ops_per_device(), result.ops_per_device(skip=("Const",))
  if not counts:
    return "  ops per device: none placed"
  return (f"  ops per device: {_ops_per_device(counts)} of the original's {original} "
          f"({max(counts.values()) / original:.2f}x); without constants "
          f"{_ops_per_device(ops)} of {original_ops} "
          f"({max(ops.values()) / max(original_ops, 1):.2f}x)")
