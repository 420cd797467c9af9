"""Gradient buckets: which data-parallel collectives are packed into one,
and in what order. Every gradient leaves materialization with collectives of
its own over the data axis (an all-reduce; with optimizer-state sharding a
reduce-scatter, and an all-gather of its update), each paying a fixed cost
(launch, rendezvous, a ring of its own) that dominates for a model's many
small tensors, so, like DDP's buckets and Horovod's tensor fusion, this
module packs them per group and kind, in the order backward produces them,
into buckets of at most `bucket_bytes` of one dtype. On request
(`reduce_dtype`, SplitConfig.gradient_reduce_dtype) float32 gradients travel
in bfloat16: half the bytes, each device's partial gradient rounded once and
each partial sum of the reduction rounded again; an update's all-gather
(weights) always travels in the weights' dtype. Every member of a group
must issue the same buckets in the same order or the collectives deadlock, so
each choice is made per collective instance from what all members share (the
tensor, its global shape and sharding, its place in the original graph, the
instance key). The collectives are those reshard.py recorded
(CollectiveRecord.units); bucket_writer.py writes each bucket's nodes.
"""
import collections
import dataclasses
import zlib
from typing import Tuple

import numpy as np
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import dtypes
from tensorflow.python.framework import tensor_util

from tfsplit import constants
from tfsplit.errors import PlanError
from tfsplit.graph.ir import input_node, parse_input
from tfsplit.sharding import builder as builder_lib
from tfsplit.sharding.bucket_writer import BucketWriter
from tfsplit.sharding.reshard import CollectiveRecord

BUCKET = "bucket"   # CollectiveRecord.kind of a bucket of all-reduces
# ... of reduce-scatters and of all-gathers (optimizer-state sharding)
REDUCE_SCATTER_BUCKET = "reduce_scatter_bucket"
ALL_GATHER_BUCKET = "all_gather_bucket"
# The kinds that carry gradients: a lower reduce dtype applies to them alone.
_LOWERED_KINDS = ("all_reduce", "reduce_scatter")
_BUCKET_KIND = {"all_reduce": BUCKET, "reduce_scatter": REDUCE_SCATTER_BUCKET,
                "all_gather": ALL_GATHER_BUCKET}
# Attrs the members of one bucket must share (the bucket's collective copies them).
_SHARED_ATTRS = ("T", "merge_op", "final_op", "communication_hint", "timeout_seconds",
                 "Nordering_token")
# Bucket instance keys: bit 30 set keeps them apart from the Resharder's keys.
_KEY_BIT = 0x40000000


@dataclasses.dataclass
class BucketRecord(CollectiveRecord):
  """One bucket of one group: `tensor` is the prefix of the bucket's nodes,
  `num_elements` the global elements of its members, `consumer` empty. The
  members' own all-reduce records stay (each tensor is still all-reduced
  once, inside its bucket), so count('all_reduce') counts tensors reduced and
  count('bucket') the collectives that carry them."""
  members: Tuple[str, ...] = ()    # the original tensors, in bucket order
  devices: Tuple[int, ...] = ()    # the group's logical device ids
  local_bytes: int = 0             # bytes each device puts in (in `dtype`)


@dataclasses.dataclass
class _Instance:
  """One collective instance to pack (a gradient's all-reduce or
  reduce-scatter, an update's all-gather), as every member of its group sees
  it."""
  axis: str
  group: Tuple[int, ...]           # member logical device ids
  here: Tuple[int, ...]            # those materialized (one task's, or all)
  group_key: int
  key: int                         # instance key
  nodes: dict                      # device id -> collective node name
  source: str
  tensor: str
  local_shape: Tuple[int, ...]
  dtype: int
  attrs: tuple
  position: tuple                  # (depth, topological index) in the original graph
  global_elements: int
  kind: str = "all_reduce"         # or reduce_scatter / all_gather
  outputs: dict = None             # device id -> the node giving the result
  elements: int = 0                # local elements
  bytes: int = 0                   # local bytes
  record: object = None            # the reshard's CollectiveRecord of the tensor
  label: str = ""                  # packed only with its label's (FSDP's weight gathers)

  def __post_init__(self):
    self.elements = int(np.prod(self.local_shape, dtype=np.int64))
    self.bytes = self.elements * dtypes.as_dtype(self.dtype).size


def bucket_gradients(out, analysis, propagation, mesh, data_axes, bucket_bytes,
                     reduce_dtype=None, labels=None, skip=frozenset()):
  """Packs the collectives over `data_axes` of `out` (a Materialized) that
  its records name into buckets of at most `bucket_bytes`, in place; returns
  a BucketRecord per bucket of two or more tensors (single ones stay as they
  are). A bucket launches when its last member is ready: no ordering is
  added. reduce_dtype: None, or 'bfloat16': float32 gradients (all-reduces
  and reduce-scatters) travel in it, a bucket of one tensor as well, and
  their records say so (CollectiveRecord.dtype: what travels).

  With `labels` ({consumer node: label}), the all-gathers of weights those
  consumers read (FSDP's, sharding/zero.py weight_gather_labels) are packed
  instead, only with others of the same label (one layer's forward, or its
  backward), and never with one that depends on another's result. Without
  them, the all-gathers `skip` consumers read are left alone."""
  wire = dtypes.as_dtype(reduce_dtype).as_datatype_enum if reduce_dtype else None
  if (bucket_bytes <= 0 and wire is None) or not data_axes:
    return []
  if labels is not None:
    wire = None
    if bucket_bytes <= 0 or not labels:
      return []
  builder = builder_lib.DeviceGraph.extending(out.graph_def, out.records)
  nodes = builder.created
  consumers = collections.defaultdict(list)   # name -> [(consumer, is data edge)]
  for node in out.graph_def.node:
    for text in node.input:
      consumers[input_node(text)].append((node.name, text[0] != "^"))
  instances = _instances(out, nodes, consumers, analysis, propagation, mesh, data_axes,
                         labels, skip)
  if not instances:
    return []
  used_keys = {_int_const(nodes, n.input[3]) for n in nodes.values()
               if n.op.startswith("Collective") and len(n.input) > 3}
  by_group = collections.defaultdict(list)
  for inst in instances:
    by_group[(inst.axis, inst.group, inst.kind, inst.label)].append(inst)
  writer = BucketWriter(builder, consumers)
  records = []
  groups = sorted({(axis, group) for axis, group, _, _ in by_group})
  labelled = sorted({label for _, _, _, label in by_group})
  for axis, group, kind, label in sorted(by_group, key=lambda k: (k[2] != "all_reduce", k)):
    group_index = groups.index((axis, group))
    prefix = "gradient_buckets" if kind == "all_reduce" else f"{kind}_buckets"
    if labels is not None:
      prefix = f"weight_gathers/label_{labelled.index(label)}"
    lowered = wire if kind in _LOWERED_KINDS else None
    for index, bucket in enumerate(pack(by_group[(axis, group, kind, label)], bucket_bytes,
                                        lowered)):
      travels = lowered if bucket[0].dtype == types_pb2.DT_FLOAT else None
      key = _instance_key(bucket, used_keys, travels)
      base = f"{prefix}/{builder_lib.safe_axis(axis)}/group_{group_index}/bucket_{index}"
      writer.emit(bucket, key, base, travels)
      size = dtypes.as_dtype(travels or bucket[0].dtype).size
      records.append(BucketRecord(
          _BUCKET_KIND[kind], axis, base, "", sum(i.global_elements for i in bucket),
          dtype=travels or bucket[0].dtype, members=tuple(i.tensor for i in bucket),
          devices=group, local_bytes=sum(i.elements for i in bucket) * size))
      for inst in bucket if travels else ():
        inst.record.dtype = travels
  writer.finish()
  return records


def pack(instances, bucket_bytes, lowered=None):
  """Buckets (lists of 2 or more instances) of `instances` of one group, in
  the order backward produces them; a tensor over the cap stays alone.
  lowered: a float32 tensor alone is a bucket of one too (it travels in
  this dtype)."""
  buckets, open_buckets, filled = [], {}, {}
  for inst in sorted(instances, key=lambda i: (i.position, i.key)):
    current = open_buckets.get(inst.attrs)
    if current and filled[inst.attrs] + inst.bytes > bucket_bytes:
      buckets.append(current)
      current = None
    if current is None:
      current = open_buckets[inst.attrs] = []
      filled[inst.attrs] = 0
    current.append(inst)
    filled[inst.attrs] += inst.bytes
  buckets.extend(open_buckets.values())
  buckets = [b for b in buckets
             if len(b) > 1 or (lowered and b[0].dtype == types_pb2.DT_FLOAT)]
  buckets.sort(key=lambda b: (b[-1].position, b[-1].key))
  return buckets


def _instances(out, nodes, consumers, analysis, propagation, mesh, data_axes, labels=None,
               skip=frozenset()):
  """[_Instance] of the collectives over `data_axes` the records name
  (CollectiveRecord.units): all-reduces of gradients, reduce-scatters of
  gradients and all-gathers of updates, whose results feed variable updates
  and whose inputs depend on no other of them (_independent); with `labels`,
  the all-gathers those consumers read instead."""
  by_key = collections.defaultdict(list)   # (kind, group key, instance key) -> members
  ports = collections.defaultdict(set)     # (source, axis) -> ports all-reduced
  for record in out.collectives:
    if record.axis not in data_axes or record.kind not in _BUCKET_KIND:
      continue
    if labels is not None and (record.kind != "all_gather" or record.consumer not in labels):
      continue
    if record.consumer in skip:
      continue
    if record.kind == "all_reduce":
      src, port = parse_input(record.tensor)
      ports[(src, record.axis)].add(port)
    for d, (coll, result) in (record.units or {}).items():
      node = nodes.get(coll)
      # No ordering tokens, no control inputs.
      if node is None or len(node.input) != 4 or result not in nodes:
        continue
      group_key, key = _int_const(nodes, node.input[2]), _int_const(nodes, node.input[3])
      if group_key is not None and key is not None:
        by_key[(record.kind, group_key, key)].append((d, coll, result, record))
  position = _positions(analysis.graph)
  candidates = []
  for (kind, group_key, key), members in sorted(by_key.items(), key=lambda kv: kv[0]):
    members.sort(key=lambda m: m[0])
    here = tuple(d for d, _, _, _ in members)
    record = members[0][3]
    axis = record.axis
    # The whole group, of which one task's graph holds its own members only.
    group = tuple(mesh.group_of(here[0], axis)[1])
    n = len(group)
    source, port = parse_input(record.tensor)
    first = nodes[members[0][1]]
    if here != tuple(d for d in group if out.only is None or d in out.only) or \
        len(set(here)) != len(here) or any(m[3] is not record for m in members) or \
        _int_const(nodes, first.input[1]) != n or source not in position:
      continue
    if labels is None and (
        analysis.roles.get(source) not in (constants.BACKWARD, constants.UPDATE) or
        not all(_feeds_update(result, nodes, consumers) for _, _, result, _ in members)):
      continue
    dtype = first.attr["T"].type
    attrs = _attrs(first)
    if dtype in (types_pb2.DT_BOOL, types_pb2.DT_RESOURCE, types_pb2.DT_VARIANT) or \
        any(_attrs(nodes[c]) != attrs for _, c, _, _ in members):
      continue
    if kind == "all_reduce":
      # A source with several ports all-reduced over the axis stays alone.
      shape = None
      if len(ports[(source, axis)]) == 1:
        shape = tuple(record.unit_shape) if record.unit_shape is not None else \
            _local_shape(analysis, propagation, mesh, source, port, axis)
      if shape is None:
        continue
    else:
      shape = tuple(record.unit_shape)
      if kind == "reduce_scatter" and shape[0] % n:
        continue
    candidates.append(_Instance(
        axis, group, here, group_key, key, {d: c for d, c, _, _ in members}, source,
        record.tensor, shape, dtype, attrs, position[source], record.num_elements,
        kind, {d: r for d, _, r, _ in members}, record=record,
        label=labels[record.consumer] if labels is not None else ""))
  return _independent(candidates, nodes, consumers)


def _independent(candidates, nodes, consumers):
  """The candidates whose inputs depend on no other's result (packing the
  two would make a cycle): all-reduces against every candidate of any kind
  (an all-reduce after a reduce-scatter, a dense gradient's over ep after
  its block's over dp, packed with one that reduce-scatter's own bucket
  waits for would close a cycle through the two buckets), reduce-scatters
  and all-gathers against their kind and group (one micro-batch's may
  depend on the previous one's: they are other groups of logical devices)."""
  sets = collections.defaultdict(list)
  for c in candidates:
    sets[(c.kind,) if c.kind == "all_reduce" else (c.kind, c.axis, c.group, c.label)].append(c)
  kept = []
  for key, members in sets.items():
    sources = candidates if key == ("all_reduce",) else members
    after = _descendants([n for c in sources for n in c.nodes.values()], consumers)
    kept += [c for c in members if not any(input_node(t) in after for n in c.nodes.values()
                                           for t in nodes[n].input)]
  return kept


def _attrs(node):
  return tuple(node.attr[a].SerializeToString() if a in node.attr else b""
               for a in _SHARED_ATTRS)


def _local_shape(analysis, propagation, mesh, source, port, axis):
  """Static per-device shape of the partial sum the all-reduce over `axis`
  takes, or None. It is reduced first (materialize.py, reshard.py), before
  any dimension moves, from the sharding the tensor is produced in."""
  spec = propagation.reduced_at_source.get((source, port))
  if spec is None:
    outs = propagation.outputs.get(source) or []
    spec = outs[port] if port < len(outs) else None
  info = analysis.shapes[source][port] if port < len(analysis.shapes[source]) else None
  if spec is None or info is None or not info.fully_defined:
    return None
  partial = sorted(spec.partial)
  mine = [a for a in partial if axis in mesh.axis_parts(a)]
  # A reduction over another real axis first could change the split (a
  # reduce-scatter on GPUs): then the shape is not known here.
  if not mine or any(mesh.axes.get(p, 1) > 1 and not mesh.is_local(p)
                     for a in partial[:partial.index(mine[0])]
                     for p in mesh.axis_parts(a)):
    return None
  try:
    return tuple(spec.local_shape(info.shape, mesh))
  except PlanError:
    return None


def _positions(graph):
  """{node: (longest path from an input, topological index)}: when backward
  produces a tensor, the same on every device."""
  depth, out = {}, {}
  for index, name in enumerate(graph.topological_order()):
    node = graph.node(name)
    depth[name] = 1 + max((depth.get(parse_input(t)[0], 0) for t in node.input), default=0)
    out[name] = (depth[name], index)
  return out


def _feeds_update(start, nodes, consumers):
  """True if `start`'s value flows (through data edges) into a variable write."""
  seen, stack = {start}, [start]
  while stack:
    for c, data in consumers.get(stack.pop(), ()):
      if data and c not in seen:
        if constants.is_write_op(nodes[c].op):
          return True
        seen.add(c)
        stack.append(c)
  return False


def _descendants(starts, consumers):
  seen, stack = set(), list(starts)
  while stack:
    for c, _ in consumers.get(stack.pop(), ()):
      if c not in seen:
        seen.add(c)
        stack.append(c)
  return seen


def _int_const(nodes, text):
  """The value of a scalar integer Const, or None."""
  node = nodes.get(input_node(text))
  if node is None or node.op != "Const":
    return None
  proto = node.attr["value"].tensor
  if proto.tensor_shape.dim:
    return None
  if proto.int_val:
    return int(proto.int_val[0])
  value = tensor_util.MakeNdarray(proto)
  return int(value) if value.size == 1 and value.dtype.kind in "iu" else None


def _instance_key(bucket, used, travels=None):
  """An instance key fixed by the bucket's group, members, local shapes and
  the dtype it travels in (TF caches a collective's shape and type per key
  in a process: a different bucket must get a different key), clear of
  every other key of the graph."""
  kind = () if bucket[0].kind == "all_reduce" else (bucket[0].kind,)
  kind += (travels,) if travels else ()
  text = repr((bucket[0].group_key, bucket[0].dtype,
               [(i.tensor, i.local_shape) for i in bucket]) + kind)
  key = _KEY_BIT | (zlib.crc32(text.encode()) & (_KEY_BIT - 1))
  while key in used:
    key = _KEY_BIT | ((key + 1) & (_KEY_BIT - 1))
  used.add(key)
  return key
