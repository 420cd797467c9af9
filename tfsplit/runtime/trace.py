"""Traces of one real step: per-op events from a Session's FULL_TRACE step
stats, the gaps a pipeline stage waits, which micro-batch and block each op
of a split graph ran for, and Chrome-trace files of them (`tfsplit trace`)."""
import json
import os

from tfsplit import constants
from tfsplit.fileio import write_atomically
from tfsplit.graph import Graph, load_graph
from tfsplit.pipeline.schedules import SCHEDULE_BLOCK_ATTR
from tfsplit.runtime import seeds
from tfsplit.runtime.devices import ensure_logical_devices, required_devices
from tfsplit.runtime.session import SessionRunner, seeded_values
from tfsplit.sharding.builder import read_records


def op_events(metadata):
  """[(device, node name, start_us, end_us)] from a RunMetadata's step stats."""
  events = []
  for dev in metadata.step_stats.dev_stats:
    if "/device:" not in dev.device or "stream" in dev.device or "memcpy" in dev.device:
      continue
    for ns in dev.node_stats:
      start = ns.all_start_micros
      end = start + max(ns.all_end_rel_micros, 1)
      events.append((dev.device, ns.node_name, start, end))
  return events


def stage_waits(events, devices, min_gap_us=0.0):
  """Per device of `devices` (a pipeline stage each), from op events (see
  op_events): the share of the step (first to last op over all stages) in
  which none of its ops runs, counting only stretches of at least
  `min_gap_us` (0: every gap between ops, the executor's own per-op
  overhead included)."""
  if not events:
    return [float("nan")] * len(devices)
  lo, hi = min(e[2] for e in events), max(e[3] for e in events)
  index = {d: i for i, d in enumerate(devices)}
  spans = [[] for _ in devices]
  for device, _, start, end in events:
    if device in index:
      spans[index[device]].append((start, end))
  out = []
  for intervals in spans:
    idle, reach = 0, lo
    for start, end in sorted(intervals):
      if start - reach >= min_gap_us:
        idle += start - reach
      reach = max(reach, end)
    if hi - reach >= min_gap_us:
      idle += hi - reach
    out.append(idle / (hi - lo) if hi > lo else 0.0)
  return out


def chrome_trace(events, labels=None):
  """Chrome-trace / Perfetto JSON dict of op events (one track per device).

  labels: optional {node name: (category, label)} (e.g. ('F', 'mb 3')).
  """
  t0 = min((e[2] for e in events), default=0)
  devices = sorted({e[0] for e in events})
  pid = {d: i for i, d in enumerate(devices)}
  out = [{"name": "process_name", "ph": "M", "pid": pid[d], "args": {"name": d}}
         for d in devices]
  for device, name, start, end in events:
    cat, label = (labels or {}).get(name, ("op", name))
    out.append({"name": label, "cat": cat, "ph": "X", "ts": start - t0,
                "dur": end - start, "pid": pid[device], "tid": 0,
                "args": {"node": name}})
  return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(events, path, labels=None):
  write_atomically(path, json.dumps(chrome_trace(events, labels)))


def scheduled_kinds(graph_def):
  """{node: 'F'|'B'|'W'} of the ops a schedule's barriers end, read from the
  barriers' block attribute: the only record of which backward ops a
  zero-bubble schedule ran as weight gradients (W)."""
  kinds = {}
  for node in graph_def.node:
    if SCHEDULE_BLOCK_ATTR in node.attr:
      kind = node.attr[SCHEDULE_BLOCK_ATTR].s.decode()
      for text in node.input:
        kinds[text.lstrip("^")] = kind
  return kinds


def _block_of(name, record, roles, kinds):
  """'F', 'B' or 'W' (a zero-bubble schedule's weight gradients), or None."""
  block = constants.BLOCK_OF_ROLE.get(roles.get(record.source))
  return kinds.get(name, block) if block is not None else None


def microbatch_blocks(events, roles, mesh, graph_def, chunk_of=None):
  """{stage: [(('F'|'B'|'W', j), start, end)] sorted by start} from op events
  (W: the weight gradients a zero-bubble schedule runs as blocks of their own).

  roles: original node -> role; mesh: the materialized mesh (with its 'mb'
  axis); graph_def: the rewritten graph, whose node records (stamped by the
  split) give each op's original node and device. Only ops that do
  per-micro-batch work count: ops with data inputs that exist once per
  micro-batch (constants and ops shared by all micro-batches run whenever
  their inputs allow), on the first device of every other axis.
  chunk_of: original node -> model chunk (SplitResult.stage_of); with it a
  block is ('F'|'B', j, chunk on its stage), as Schedule.order gives it for
  the interleaved schedule.
  """
  mb, pp = constants.MICROBATCH_AXIS, constants.PIPELINE_AXIS
  records = read_records(graph_def)
  kinds = scheduled_kinds(graph_def)
  copies = {}
  for node in graph_def.node:
    record = records.get(node.name)
    if record is None or record.device_id >= mesh.size or node.op == "Const" or not any(
        not t.startswith("^") for t in node.input):
      continue
    copies.setdefault(record.source, set()).add(
        mesh.coord(record.device_id, mb) if mb in mesh.axes else 0)
  spans = {}
  for _, name, start, end in events:
    record = records.get(name)
    if record is None or record.device_id >= mesh.size:
      continue
    if record.source not in copies or (mb in mesh.axes and len(copies[record.source]) < 2):
      continue
    block = _block_of(name, record, roles, kinds)
    d = record.device_id
    if block is None or any(mesh.coord(d, a) != 0 for a in mesh.axis_names
                            if a not in (mb, pp)):
      continue
    stage = mesh.coord(d, pp) if pp in mesh.axes else 0
    label = (block, mesh.coord(d, mb) if mb in mesh.axes else 0)
    if chunk_of is not None:
      label += (chunk_of.get(record.source, stage) // mesh.axes.get(pp, 1),)
    key = (stage, label)
    lo, hi = spans.get(key, (start, end))
    spans[key] = (min(lo, start), max(hi, end))
  blocks = {}
  for (stage, block), (lo, hi) in spans.items():
    blocks.setdefault(stage, []).append((block, lo, hi))
  for stage in blocks:
    blocks[stage].sort(key=lambda b: (b[1], b[2]))
  return blocks


def microbatch_labels(events, roles, mesh, graph_def):
  """{node: ('F'|'B'|'W', 'F3')} for the ops of forward/backward micro-batch
  work (W: weight gradients run as blocks of their own)."""
  mb = constants.MICROBATCH_AXIS
  records, labels = read_records(graph_def), {}
  kinds = scheduled_kinds(graph_def)
  for _, name, _, _ in events:
    record = records.get(name)
    block = _block_of(name, record, roles, kinds) if record else None
    if block is None or record.device_id >= mesh.size:
      continue
    j = mesh.coord(record.device_id, mb) if mb in mesh.axes else 0
    labels[name] = (block, f"{block}{j}")
  return labels


def trace_file(path, output, manifest=None, original=None, seed=0, cluster=None,
               timeout_seconds=600.0):
  """Runs the graph at `path` once to warm up and once traced, in a Session
  on logical CPU devices (a graph placed on worker tasks: on `cluster`,
  default TF_CONFIG, see runtime/cluster.py), and writes a Chrome trace of
  every op to `output`.

  Ops of a split graph (one with a manifest, default: beside it) are labelled
  with their micro-batch and forward/backward role, the roles coming from
  `original` (default: the manifest's source). Returns (op executions, devices).
  """
  from tfsplit.graph.layers import detect_layers  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import manifest as manifest_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.layout.mesh import Mesh  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
  graph_def = load_graph(path)
  data = manifest_lib.find(path, manifest)
  on_cluster = cluster_lib.cluster_for_graph(graph_def, cluster)
  values = seeded_values(graph_def, data["variables"] if data else None, seed)
  if on_cluster is not None:
    runner = cluster_lib.ClusterRunner(graph_def, values, on_cluster, timeout_seconds)
  else:
    ensure_logical_devices(required_devices(graph_def))
    runner = SessionRunner(graph_def, values)
  original = original or (data or {}).get("source")
  source_graph = load_graph(original) if original and os.path.exists(original) else graph_def
  inputs = seeds.seeded_inputs(Graph(source_graph), seed)
  try:
    runner.run(inputs)
    _, metadata = runner.run(inputs, trace=True)
  finally:
    if on_cluster is not None:
      runner.close(reset=True)
  events = op_events(metadata)
  labels = {}
  if data:
    mesh = Mesh(data["mesh"], data["devices"]).with_microbatches(data.get("microbatches", 1))
    labels = microbatch_labels(events, detect_layers(Graph(source_graph)).block_roles(),
                               mesh, graph_def)
  write_chrome_trace(events, output, labels)
  return len(events), len({e[0] for e in events})
