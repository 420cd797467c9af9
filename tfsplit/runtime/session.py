"""Running a rewritten graph in a TF1-style Session: step stats and servers.

Step stats (per-op start and end times on every device) come from a Session
run with FULL_TRACE, and TF's gRPC runtime (tf.distribute.Server) is driven
through Sessions too. The graph's captured-variable placeholders become
VarHandleOps named after their variable (shard), initialised from values.
"""
import json
import os

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tfsplit import constants
from tfsplit.errors import TfsplitError
from tfsplit.fileio import write_atomically
from tfsplit.graph import Graph, find_variables, load_graph
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.endpoints import graph_inputs, graph_outputs
from tfsplit.runtime import seeds
from tfsplit.runtime.devices import ensure_logical_devices, required_devices
from tfsplit.runtime.graph_function import grappler_config
from tfsplit.sharding.builder import read_records


def with_variable_handles(graph_def):
  """GraphDef whose captured-variable placeholders are VarHandleOps.

  The handle's shared_name is the recorded variable name, so two graphs (or
  two runs) see the same variable by name.
  """
  out = graph_pb2.GraphDef()
  out.CopyFrom(graph_def)
  for node in out.node:
    if node.op != "Placeholder" or variables_lib.VAR_NAME_ATTR not in node.attr:
      continue
    name, device = node.name, node.device
    shared = node.attr[variables_lib.VAR_NAME_ATTR].s
    dtype = node.attr[variables_lib.VAR_DTYPE_ATTR].type
    shape = tf.TensorShape(node.attr[variables_lib.VAR_SHAPE_ATTR].shape)
    node.Clear()
    node.name, node.op, node.device = name, "VarHandleOp", device
    node.attr["dtype"].type = dtype
    node.attr["shape"].shape.CopyFrom(shape.as_proto())
    node.attr["shared_name"].s = shared
    node.attr["container"].s = b""
  return out


class SessionRunner(object):
  """A rewritten graph in a Session, with its variables initialised (values
  None: left as they are, made by another runner on the same servers)."""

  def __init__(self, graph_def, values, target="", num_cpus=None, config=None):
    self.graph_def = with_variable_handles(graph_def)
    graph = Graph(graph_def)
    self.inputs = graph_inputs(graph)
    self.outputs = graph_outputs(graph)
    self.graph = tf.Graph()
    with self.graph.as_default():
      tf.graph_util.import_graph_def(self.graph_def, name="")
      inits, self._placeholders = [], {}
      for info in find_variables(graph):
        if values is not None and info.name not in values:
          raise TfsplitError(f"no value for variable '{info.name}'")
        handle = self.graph.get_tensor_by_name(info.node + ":0")
        with tf.device(handle.device):
          value = tf.compat.v1.placeholder(tf.as_dtype(info.dtype), info.shape)
          inits.append(tf.raw_ops.AssignVariableOp(resource=handle, value=value))
        self._placeholders[info.name] = value
      self._init = tf.group(*inits)
    if config is None:
      config = session_config(graph_def, num_cpus)
    self.session = tf.compat.v1.Session(target, graph=self.graph, config=config)
    if values is not None:  # None: the variables live in the servers already
      self.assign(values)

  def assign(self, values):
    """Sets every variable (by recorded name) to values[name], in one run."""
    missing = sorted(set(self._placeholders) - set(values))
    if missing:
      raise TfsplitError(f"no value for variable '{missing[0]}'")
    self.session.run(self._init, feed_dict={p: values[n]
                                            for n, p in self._placeholders.items()})

  def _tensor(self, name):
    return self.graph.get_tensor_by_name(name if ":" in name else name + ":0")

  def run(self, inputs, trace=False, fetch=None):
    """Outputs of one step (or the tensors named in `fetch`); with trace=True
    also its RunMetadata."""
    feeds = {self._tensor(n): v for n, v in zip(self.inputs, inputs)}
    fetches = [self._tensor(n) for n in (self.outputs if fetch is None else fetch)]
    if not trace:
      return self.session.run(fetches, feed_dict=feeds), None
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    metadata = tf.compat.v1.RunMetadata()
    out = self.session.run(fetches, feed_dict=feeds, options=options,
                           run_metadata=metadata)
    return out, metadata

  def variable_values(self, names):
    """{variable (shard) name: numpy value}, read in one run (the read ops are
    made once per name)."""
    if not hasattr(self, "_reads"):
      self._reads = {}
    missing = [n for n in names if n not in self._reads]
    if missing:
      nodes = {n.attr["shared_name"].s.decode(): n for n in self.graph_def.node
               if n.op == "VarHandleOp"}
      with self.graph.as_default():
        for name in missing:
          node = nodes[name]
          handle = self.graph.get_tensor_by_name(node.name + ":0")
          with tf.device(handle.device):
            self._reads[name] = tf.raw_ops.ReadVariableOp(
                resource=handle, dtype=tf.as_dtype(node.attr["dtype"].type))
    names = list(names)
    return dict(zip(names, self.session.run([self._reads[n] for n in names])))


def session_config(graph_def, num_cpus=None):
  """ConfigProto for running `graph_def`: enough CPU devices, and the Grappler
  settings the graph needs (for a pipelined graph one round, so stages keep
  the schedule's order: see graph_function.grappler_config)."""
  config = tf.compat.v1.ConfigProto(
      device_count={"CPU": num_cpus or required_devices(graph_def, "CPU")},
      allow_soft_placement=False)
  return grappler_config(graph_def, config)


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


def microbatch_blocks(events, roles, mesh, graph_def, chunk_of=None):
  """{stage: [(('F'|'B', j), start, end)] sorted by start} from op events.

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
    block = constants.BLOCK_OF_ROLE.get(roles.get(record.source))
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
  """{node: ('F'|'B', 'F3')} for the ops of forward/backward micro-batch work."""
  mb = constants.MICROBATCH_AXIS
  records, labels = read_records(graph_def), {}
  for _, name, _, _ in events:
    record = records.get(name)
    block = constants.BLOCK_OF_ROLE.get(roles.get(record.source)) if record else None
    if block is None or record.device_id >= mesh.size:
      continue
    j = mesh.coord(record.device_id, mb) if mb in mesh.axes else 0
    labels[name] = (block, f"{block}{j}")
  return labels


def seeded_values(graph_def, manifest=None, seed=0):
  """Variable values for a rewritten graph: shards of seeded full values."""
  if manifest is None:
    return seeds.seeded_variable_values(Graph(graph_def), seed)
  return seeds.seeded_manifest_values(manifest, seed)


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
  from tfsplit.sharding.mesh import Mesh  # pylint: disable=import-outside-toplevel
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
