"""`tfsplit rewrite` on files: load a graph, split it over a mesh, write the
rewritten graph and its shard manifest.

Both files are serialized before either is written, and each is written
atomically, so a failed rewrite leaves no output.
"""
import collections
import time

from tfsplit import constants
from tfsplit.errors import TfsplitError


def parse_annotation(text):
  """'VARIABLE_GLOB=DIMS' (e.g. '*/fc1/kernel=-,tp') -> (glob, dims)."""
  pattern, sep, dims = text.rpartition("=")
  if not sep or not pattern:
    raise TfsplitError(f"cannot read --annotate '{text}'; write VARIABLE_GLOB=DIMS, e.g. "
                       "'*/fc1/kernel=-,tp'")
  return pattern, tuple(None if d.strip() in ("-", "", "none") else d.strip()
                        for d in dims.split(","))


def parse_layer_ranges(text):
  """'0:3,3:6' -> [(0, 3), (3, 6)]; None for None."""
  if not text:
    return None
  try:
    return [tuple(int(x) for x in part.split(":")) for part in text.split(",")]
  except ValueError:
    raise TfsplitError(f"cannot read --layers '{text}'; write start:end ranges, "
                       "e.g. 0:3,3:6") from None


def make_mesh(mesh="tp=2", stages=1, devices="cpu", job="localhost", cluster=None,
              across=None, devices_per_task=None):
  """The Mesh of `mesh` axes (with a 'pp' axis of `stages` in front when > 1)
  over devices of type `devices` ('cpu' or 'gpu') of job `job`; with
  `cluster` ('TF_CONFIG', a spec file, a ClusterResolver: runtime/cluster.py)
  over its tasks, the `across` axes (default dp, pp) across tasks."""
  from tfsplit.layout.mesh import Mesh  # pylint: disable=import-outside-toplevel
  axes = Mesh.parse(mesh).axes
  if stages > 1:
    if constants.PIPELINE_AXIS in axes:
      raise TfsplitError("give the pipeline either as --stages or as pp= in --mesh, "
                         "not both")
    axes = {constants.PIPELINE_AXIS: stages, **axes}
  size = 1
  for s in axes.values():
    size *= s
  kind = devices.upper()
  if cluster is not None:
    from tfsplit.runtime import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
    found = cluster if isinstance(cluster, cluster_lib.Cluster) else cluster_lib.resolve(
        cluster, devices_per_task=devices_per_task, required=True)
    found.kind = kind if devices != "cpu" else found.kind
    return cluster_lib.mesh_on_cluster(axes, found, tuple(across or
                                                          cluster_lib.DEFAULT_ACROSS))
  return Mesh(axes, [f"/job:{job}/replica:0/task:0/device:{kind}:{i}" for i in range(size)])


def rewrite_file(source, output, mesh="tp=2", stages=1, layers=None, devices="cpu",
                 job="localhost", strategy="megatron", annotate=(), microbatches=1,
                 schedule="1f1b", collective_timeout=600.0, signature=None,
                 variables=None, virtual_stages=1, bucket_mb=25.0, zero=0,
                 recompute="none", cluster=None, across_tasks=None, devices_per_task=None,
                 offload="none", offload_device=None, task=None, gradient_reduce_dtype=None,
                 sequence_parallel=False):
  """Splits the graph at `source` and writes it to `output` with its manifest.

  cluster / across_tasks / devices_per_task: place the mesh on a cluster's
  worker tasks (see make_mesh). task: with a cluster, write only that
  task's part (sharding/tasks.py); the manifest still lists every shard.

  bucket_mb: gradient bucket size in MiB (0: one all-reduce per gradient).
  recompute: none, blocks, selective, auto or 'scope1,scope2' (memory/recompute.py).
  zero: optimizer-state sharding stage over dp (0, 1 or 2).
  offload / offload_device: 'optimizer' keeps optimizer slots and their
  update ops on each device's host CPU, or on `offload_device` (memory/offload.py).
  gradient_reduce_dtype: 'bfloat16' reduces float32 gradients over dp in it
  (half the bytes, no longer float32-exact: see SplitConfig).
  sequence_parallel: split the regions between tensor-parallel blocks over
  the sequence (strategies/sequence_parallel.py).
  Returns the summary lines of what was done.
  """
  from tfsplit.fileio import write_atomically  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import load_graph, recover, save_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import manifest as manifest_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import split_graph  # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  graph_def = load_graph(source, signature=signature, variables_from=variables)
  recover.require_variable_shapes(graph_def, source)
  if task is not None and cluster is None:
    from tfsplit.errors import PlanError  # pylint: disable=import-outside-toplevel
    raise PlanError("--task needs --cluster: a task is one of the cluster's workers")
  the_mesh = make_mesh(mesh, stages, devices, job, cluster, across_tasks, devices_per_task)
  layer_ranges = parse_layer_ranges(layers)
  result = split_graph(graph_def, the_mesh, strategy=strategy,
                       annotations=dict(parse_annotation(a) for a in annotate),
                       timeout_seconds=collective_timeout, microbatches=microbatches,
                       schedule=schedule, layer_ranges=layer_ranges,
                       virtual_stages=virtual_stages,
                       bucket_bytes=int(round(bucket_mb * 2**20)), zero=zero,
                       recompute=recompute,
                       offload=None if offload in (None, "none") else offload,
                       offload_device=offload_device, task=task,
                       gradient_reduce_dtype=gradient_reduce_dtype,
                       sequence_parallel=sequence_parallel)
  manifest_text = result.manifest_json(source=source)
  save_graph(result.graph_def, output)
  write_atomically(manifest_lib.manifest_path(output), manifest_text)
  split_vars = sum(1 for e in result.manifest.values() if any(e["sharding"]))
  lines = [f"rewrote {source} over mesh {the_mesh} ({strategy}) in "
           f"{time.perf_counter() - t0:.2f} s",
           f"  {len(graph_def.node)} -> {len(result.graph_def.node)} nodes, {split_vars} "
           f"of {len(result.manifest)} variables split"]
  lines.append(_ops_per_device_line(graph_def, result))
  if result.partition and virtual_stages > 1:
    lines.append(f"  pipeline: {result.config.stages} stages x {virtual_stages} virtual "
                 f"stages, chunks {result.partition}, {schedule} over {microbatches} "
                 "micro-batches")
  elif result.partition:
    lines.append(f"  pipeline: {len(result.partition)} stages {result.partition}, "
                 f"{schedule} over {microbatches} micro-batches")
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
  buckets = [c for c in result.collectives if c.kind == "bucket"]
  if buckets:
    per_group = collections.Counter(c.devices for c in buckets)
    packed = {t for c in buckets for t in c.members}
    lines.append(f"  gradient buckets: {len(packed)} all-reduces over "
                 f"{'/'.join(sorted({c.axis for c in buckets}))} packed into "
                 f"{max(per_group.values())} bucket(s) per group ({len(per_group)} "
                 f"group(s), at most {bucket_mb:g} MiB each)")
  scattered = [c for c in result.collectives
               if c.kind in ("reduce_scatter_bucket", "all_gather_bucket")]
  if zero:
    from tfsplit.sharding import zero as zero_lib  # pylint: disable=import-outside-toplevel
    lines.append(f"  optimizer-state sharding: {result.count('reduce_scatter')} "
                 f"reduce-scatters, {result.count('all_gather')} all-gathers, in "
                 f"{len(scattered)} bucket(s)")
    lines += zero_lib.summary(result.manifest, the_mesh.axes, zero)
  if result.config.recompute_mode is not None:
    from tfsplit.memory import recompute as recompute_lib  # pylint: disable=import-outside-toplevel
    lines.append("  " + recompute_lib.graph_summary(result.graph_def,
                                                     result.config.recompute_mode))
  if result.config.offload:
    from tfsplit.memory import offload as offload_lib  # pylint: disable=import-outside-toplevel
    lines.append(offload_lib.summary(result.manifest, result.offloaded_nodes))
  lines += [f"  fallback: {msg}" for msg in result.fallbacks]
  lines.append(f"wrote {output} and {manifest_lib.manifest_path(output)}")
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
