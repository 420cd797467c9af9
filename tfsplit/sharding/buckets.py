"""Gradient buckets: one all-reduce per bucket of gradients, not per tensor.

    records = bucket_gradients(materialized, analysis, propagation, mesh,
                               data_axes=["dp"], bucket_bytes=25 * 2**20)

After materialization every gradient is all-reduced over the data axis by a
CollectiveReduceV2 of its own, and each collective has a fixed cost (launch,
rendezvous, a ring of its own), which dominates for the many small tensors of
a model. As DDP's buckets, Horovod's tensor fusion and MirroredStrategy's
packing do, the gradients are packed: per collective group, in the order
backward produces them, into buckets of at most `bucket_bytes` (one dtype
each). A bucket flattens its members, concatenates them, all-reduces once
(same group, merge and final op, timeout and hint) and splits the result back
into the members' shapes; the original collective node becomes the Reshape
that gives its consumers their tensor, so nothing else is rewired.

Every member of a group must issue the same buckets in the same order, or
the collectives deadlock or mix tensors up. So every decision is made per
collective instance ((group key, instance key), shared by the group's
members), from what all members share: the original tensor reduced, its
global shape and sharding, its place in the original graph, the instance key.

A bucket launches when its last member is ready: no ordering is added. An
all-reduce whose input depends on the result of another gradient all-reduce
stays alone (packing the two would make a cycle).

With optimizer-state sharding (sharding/zero.py) the gradients are
reduce-scattered over the data axis and the updates all-gathered; those are
packed the same way, each kind in buckets of its own. A reduce-scatter
bucket cuts each member into the n blocks its members own ([n, elements/n])
and concatenates them block by block, so block i of the bucket holds every
member's block i; an all-gather bucket concatenates the members' blocks and
cuts the gathered [n, elements] back per member. The members' own records
stay, as for all-reduces.
"""
import collections
import dataclasses
import types
import zlib
from typing import Tuple

import numpy as np
from tensorflow.core.framework import node_def_pb2
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import dtypes
from tensorflow.python.framework import tensor_util

from tfsplit import constants
from tfsplit.errors import PlanError
from tfsplit.graph.ir import input_node, parse_input
from tfsplit.sharding.builder import NodeRecord, safe_axis, stamp_records, unique_name
from tfsplit.sharding.reshard import CollectiveRecord

BUCKET = "bucket"   # CollectiveRecord.kind of a bucket of all-reduces
# ... of reduce-scatters and of all-gathers (optimizer-state sharding)
REDUCE_SCATTER_BUCKET = "reduce_scatter_bucket"
ALL_GATHER_BUCKET = "all_gather_bucket"
_BUCKET_KIND = {"all_reduce": BUCKET, "reduce_scatter": REDUCE_SCATTER_BUCKET,
                "all_gather": ALL_GATHER_BUCKET}
_OP = "CollectiveReduceV2"
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
  local_bytes: int = 0             # bytes each device puts in


@dataclasses.dataclass
class _Instance:
  """One gradient all-reduce, as every member of its group sees it."""
  axis: str
  group: Tuple[int, ...]           # member logical device ids
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
  outputs: dict = None             # device id -> the node giving the result (units)
  elements: int = 0                # local elements
  bytes: int = 0                   # local bytes

  def __post_init__(self):
    self.elements = int(np.prod(self.local_shape, dtype=np.int64))
    self.bytes = self.elements * dtypes.as_dtype(self.dtype).size


def bucket_gradients(out, analysis, propagation, mesh, data_axes, bucket_bytes):
  """Packs the gradient all-reduces over `data_axes` of `out` (a Materialized)
  into buckets of at most `bucket_bytes`, in place; returns a BucketRecord per
  bucket of two or more tensors (single ones stay as they are)."""
  if bucket_bytes <= 0 or not data_axes:
    return []
  nodes = {n.name: n for n in out.graph_def.node}
  consumers = collections.defaultdict(list)   # name -> [(consumer, is data edge)]
  for node in out.graph_def.node:
    for text in node.input:
      consumers[input_node(text)].append((node.name, text[0] != "^"))
  instances = _gradient_instances(out, nodes, consumers, analysis, propagation, mesh,
                                  data_axes)
  instances += _unit_instances(out, nodes, consumers, analysis, mesh, data_axes)
  if not instances:
    return []
  used_keys = {_int_const(nodes, n.input[3]) for n in nodes.values()
               if n.op.startswith("Collective") and len(n.input) > 3}
  names = set(nodes)
  by_group = collections.defaultdict(list)
  for inst in instances:
    by_group[(inst.axis, inst.group, inst.kind)].append(inst)
  emitter = _Emitter(out, nodes, names, consumers)
  records = []
  groups = sorted({(axis, group) for axis, group, _ in by_group})
  for axis, group, kind in sorted(by_group, key=lambda k: (k[2] != "all_reduce", k)):
    group_index = groups.index((axis, group))
    prefix = "gradient_buckets" if kind == "all_reduce" else f"{kind}_buckets"
    for index, bucket in enumerate(pack(by_group[(axis, group, kind)], bucket_bytes)):
      key = _instance_key(bucket, used_keys)
      base = f"{prefix}/{safe_axis(axis)}/group_{group_index}/bucket_{index}"
      emitter.emit(bucket, key, base)
      records.append(BucketRecord(
          _BUCKET_KIND[kind], axis, base, "", sum(i.global_elements for i in bucket),
          members=tuple(i.tensor for i in bucket), devices=group,
          local_bytes=sum(i.bytes for i in bucket)))
  emitter.finish()
  return records


def pack(instances, bucket_bytes):
  """Buckets (lists of 2 or more instances) of `instances` of one group, in
  the order backward produces them; a tensor over the cap stays alone."""
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
  buckets = [b for b in buckets if len(b) > 1]
  buckets.sort(key=lambda b: (b[-1].position, b[-1].key))
  return buckets


def _gradient_instances(out, nodes, consumers, analysis, propagation, mesh, data_axes):
  """[_Instance] of the all-reduces over `data_axes` of gradients whose
  results feed variable updates and whose inputs depend on no other of them."""
  groups = {a: {tuple(m) for m in mesh.groups(a)} for a in data_axes}
  by_key = collections.defaultdict(list)
  for node in out.graph_def.node:
    if node.op != _OP or len(node.input) != 4:  # no ordering tokens, no control inputs
      continue
    record = out.records.get(node.name)
    group_key, key = _int_const(nodes, node.input[2]), _int_const(nodes, node.input[3])
    if record is None or record.device_id is None or group_key is None or key is None:
      continue
    by_key[(group_key, key)].append((record.device_id, node.name))
  ports = collections.defaultdict(set)   # (source, axis) -> ports all-reduced
  for c in out.collectives:
    if c.kind == "all_reduce" and c.axis in data_axes:
      src, port = parse_input(c.tensor)
      ports[(src, c.axis)].add(port)
  position = _positions(analysis.graph)
  candidates = []
  for (group_key, key), members in sorted(by_key.items()):
    group = tuple(sorted(d for d, _ in members))
    axis = next((a for a in data_axes if group in groups[a]), None)
    if axis is None or len(set(group)) != len(members):
      continue
    member_nodes = {d: name for d, name in members}
    first = nodes[member_nodes[group[0]]]
    sources = {out.records[name].source for name in member_nodes.values()}
    if len(sources) != 1 or _int_const(nodes, first.input[1]) != len(group):
      continue
    source = sources.pop()
    if source not in position or analysis.roles.get(source) not in (constants.BACKWARD, constants.UPDATE) or \
        len(ports[(source, axis)]) != 1 or \
        not all(_feeds_update(name, nodes, consumers) for name in member_nodes.values()):
      continue
    port = next(iter(ports[(source, axis)]))
    shape = _local_shape(analysis, propagation, mesh, source, port, axis)
    dtype = first.attr["T"].type
    if shape is None or dtype != analysis.shapes[source][port].dtype or \
        dtype in (types_pb2.DT_BOOL, types_pb2.DT_RESOURCE, types_pb2.DT_VARIANT):
      continue
    attrs = _attrs(first)
    if any(_attrs(nodes[n]) != attrs for n in member_nodes.values()):
      continue
    candidates.append(_Instance(
        axis, group, group_key, key, member_nodes, source,
        source if port == 0 else f"{source}:{port}", shape, dtype, attrs,
        position[source], analysis.shapes[source][port].num_elements or 0))
  # Packing an all-reduce with one whose result it depends on is a cycle:
  # such an all-reduce is left alone.
  after = _descendants([n for c in candidates for n in c.nodes.values()], consumers)
  return [c for c in candidates
          if not any(input_node(t) in after for n in c.nodes.values()
                     for t in nodes[n].input)]


def _unit_instances(out, nodes, consumers, analysis, mesh, data_axes):
  """[_Instance] of the reduce-scatters of gradients and the all-gathers of
  updates over `data_axes` (CollectiveRecord.units), whose results feed
  variable updates and whose inputs depend on no other of the same kind and
  group (one micro-batch's reduce-scatters may depend on the previous one's:
  they are other groups of logical devices)."""
  groups = {a: {tuple(m) for m in mesh.groups(a)} for a in data_axes}
  by_key = collections.defaultdict(list)
  for record in out.collectives:
    if record.kind not in ("reduce_scatter", "all_gather") or record.axis not in data_axes \
        or not record.units:
      continue
    for d, (coll, result) in record.units.items():
      node = nodes.get(coll)
      if node is None or len(node.input) != 4 or result not in nodes:
        continue
      group_key, key = _int_const(nodes, node.input[2]), _int_const(nodes, node.input[3])
      if group_key is not None and key is not None:
        by_key[(record.kind, group_key, key)].append((d, coll, result, record))
  position = _positions(analysis.graph)
  candidates = []
  for (kind, group_key, key), members in sorted(by_key.items(), key=lambda kv: kv[0]):
    group = tuple(sorted(d for d, _, _, _ in members))
    record = members[0][3]
    axis = record.axis
    if group not in groups[axis] or len(set(group)) != len(members) or \
        any(m[3] is not record for m in members):
      continue
    first = nodes[members[0][1]]
    source = parse_input(record.tensor)[0]
    n = len(group)
    shape = tuple(record.unit_shape)
    if _int_const(nodes, first.input[1]) != n or source not in position or \
        analysis.roles.get(source) not in (constants.BACKWARD, constants.UPDATE) or \
        (kind == "reduce_scatter" and shape[0] % n) or \
        not all(_feeds_update(result, nodes, consumers) for _, _, result, _ in members):
      continue
    dtype = first.attr["T"].type
    attrs = _attrs(first)
    if dtype in (types_pb2.DT_BOOL, types_pb2.DT_RESOURCE, types_pb2.DT_VARIANT) or \
        any(_attrs(nodes[c]) != attrs for _, c, _, _ in members):
      continue
    candidates.append(_Instance(
        axis, group, group_key, key, {d: c for d, c, _, _ in members}, source,
        record.tensor, shape, dtype, attrs, position[source], record.num_elements,
        kind, {d: r for d, _, r, _ in members}))
  kept = []
  by_group = collections.defaultdict(list)
  for c in candidates:
    by_group[(c.kind, c.axis, c.group)].append(c)
  for members in by_group.values():
    after = _descendants([n for c in members for n in c.nodes.values()], consumers)
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


def _instance_key(bucket, used):
  """An instance key fixed by the bucket's group, members and local shapes
  (TF caches a collective's shape per key in a process: a different bucket
  must get a different key), clear of every other key of the graph."""
  kind = () if bucket[0].kind == "all_reduce" else (bucket[0].kind,)
  text = repr((bucket[0].group_key, bucket[0].dtype,
               [(i.tensor, i.local_shape) for i in bucket]) + kind)
  key = _KEY_BIT | (zlib.crc32(text.encode()) & (_KEY_BIT - 1))
  while key in used:
    key = _KEY_BIT | ((key + 1) & (_KEY_BIT - 1))
  used.add(key)
  return key


class _Emitter(object):
  """Writes buckets into a Materialized graph and its records."""

  def __init__(self, out, nodes, names, consumers):
    self.out, self.nodes, self.names, self.consumers = out, nodes, names, consumers
    self.new_records, self.dead_inputs, self.kept, self.rewritten = {}, set(), set(), set()
    self.removed = set()   # nodes of collectives a bucket replaced

  def unique(self, base):
    return unique_name(self.names, base)

  def add(self, node, source=None, device_id=None, shared=False):
    self.out.graph_def.node.add().CopyFrom(node)
    self.nodes[node.name] = self.out.graph_def.node[-1]
    if source is not None:
      self.new_records[node.name] = NodeRecord(source, device_id, shared)
    return node.name

  def const(self, base, value, device):
    """An int32 Const (a scalar or a list), written without make_tensor_proto:
    a bucket adds a few per member."""
    node = node_def_pb2.NodeDef(name=self.unique(base), op="Const", device=device)
    node.attr["dtype"].type = types_pb2.DT_INT32
    proto = node.attr["value"].tensor
    proto.dtype = types_pb2.DT_INT32
    values = [int(v) for v in np.atleast_1d(value)]
    if np.ndim(value):
      proto.tensor_shape.dim.add().size = len(values)
    proto.int_val.extend(values)
    return self.add(node)

  def op(self, base, op, device, inputs, attrs, record):
    node = node_def_pb2.NodeDef(name=self.unique(base), op=op, device=device, input=inputs)
    for name, value in attrs.items():
      if isinstance(value, int):
        node.attr[name].i = value
      else:
        node.attr[name].type = value[0]
    return self.add(node, *record)

  def emit(self, bucket, key, base):
    emit_on = {"all_reduce": self.emit_on, "reduce_scatter": self.emit_scatter_on,
               "all_gather": self.emit_gather_on}[bucket[0].kind]
    for d in bucket[0].group:
      emit_on(d, bucket, key, f"{base}/shard_{d}")

  def _collective(self, first, inputs, name):
    """A copy of collective member `first` (its op and attrs) over `inputs`."""
    node = node_def_pb2.NodeDef()
    node.CopyFrom(first)
    node.name = self.unique(name)
    del node.input[:]
    node.input.extend(inputs)
    for attr in [a for a in node.attr if a.startswith("_tfsplit")]:
      del node.attr[attr]
    self.kept.update(input_node(t) for t in first.input[1:3])
    return node

  def _become_piece(self, member, piece, shape, dtype, device, where, k):
    """Member result node `member` becomes the Reshape of its bucket piece,
    under its name and record: consumers and control edges stay valid."""
    self.dead_inputs.update(input_node(t) for t in member.input)
    self.rewritten.add(member.name)
    shape_const = self.const(f"{where}/shape_{k}", list(shape), device)
    member.op = "Reshape"
    for attr in [a for a in member.attr if not a.startswith("_tfsplit")]:
      del member.attr[attr]
    member.attr["T"].type = dtype
    member.attr["Tshape"].type = types_pb2.DT_INT32
    del member.input[:]
    member.input.extend([piece, shape_const])

  def _remove_unit(self, inst, d):
    """The member's nodes from its collective up to (not including) its
    result node: dropped (with the constants only they read)."""
    name = inst.nodes[d]
    result = inst.outputs[d]
    while name != result:
      node = self.nodes[name]
      self.removed.add(name)
      self.dead_inputs.update(input_node(t) for t in node.input)
      following = [c for c, data in self.consumers.get(name, ()) if data]
      if len(following) != 1:
        raise AssertionError(f"collective unit of '{name}' is not a chain")
      name = following[0]

  def emit_scatter_on(self, d, bucket, key, where):
    """Device d's part of a bucket of reduce-scatters over n members: each
    member [n * b_k, ...] cut to [n, b_k...] rows, concatenated along
    dimension 1 (row i: every member's block i), scattered once, split back."""
    dtype, int32 = bucket[0].dtype, types_pb2.DT_INT32
    n = len(bucket[0].group)
    colls = [self.nodes[i.nodes[d]] for i in bucket]
    first, device = colls[0], colls[0].device
    last = (bucket[-1].source, d, any(self.out.records.get(c.name, NodeRecord("", d)).shared
                                      for c in colls))
    rows = []
    for k, (inst, coll) in enumerate(zip(bucket, colls)):
      rows.append(self.op(
          f"{where}/rows_{k}", "Reshape", device,
          [coll.input[0], self.const(f"{where}/rows_{k}/shape", [n, inst.elements // n],
                                     device)],
          {"T": (dtype,), "Tshape": (int32,)}, (inst.source, d, last[2])))
    concat = self.op(f"{where}/concat", "ConcatV2", device,
                     rows + [self.const(f"{where}/concat/axis", 1, device)],
                     {"T": (dtype,), "N": len(rows), "Tidx": (int32,)}, last)
    total = sum(i.elements for i in bucket) // n
    key_const = self.const(f"{where}/instance_key", key, device)
    if first.op == "CollectiveAllToAllV2":
      exchange = self._collective(first, [concat, first.input[1], first.input[2], key_const],
                                  f"{where}/all_to_all")
      self.add(exchange, *last)
      summed = node_def_pb2.NodeDef(name=self.unique(f"{where}/sum"), op="Sum", device=device,
                                    input=[exchange.name,
                                           self.const(f"{where}/sum/axis", 0, device)])
      summed.attr["T"].type = dtype
      summed.attr["Tidx"].type = int32
      summed.attr["keep_dims"].b = False
      reduced = self.add(summed, *last)
    else:  # CollectiveReduceScatterV2: [1, total]
      scatter = self._collective(first, [concat, first.input[1], first.input[2], key_const],
                                 f"{where}/reduce_scatter")
      self.add(scatter, *last)
      reduced = self.op(f"{where}/flat", "Reshape", device,
                        [scatter.name, self.const(f"{where}/flat/shape", [total], device)],
                        {"T": (dtype,), "Tshape": (int32,)}, last)
    split = self.op(f"{where}/split", "SplitV", device,
                    [reduced, self.const(f"{where}/split/sizes",
                                         [i.elements // n for i in bucket], device),
                     self.const(f"{where}/split/axis", 0, device)],
                    {"T": (dtype,), "Tlen": (int32,), "num_split": len(bucket)}, last)
    for k, inst in enumerate(bucket):
      self._remove_unit(inst, d)
      shape = [inst.local_shape[0] // n] + list(inst.local_shape[1:])
      self._become_piece(self.nodes[inst.outputs[d]], f"{split}:{k}" if k else split, shape,
                         dtype, device, where, k)

  def emit_gather_on(self, d, bucket, key, where):
    """Device d's part of a bucket of all-gathers: the members' blocks
    flattened and concatenated, gathered once ([n * total]), cut to
    [n, total] and split along dimension 1 into each member's [n, elements]."""
    dtype, int32 = bucket[0].dtype, types_pb2.DT_INT32
    n = len(bucket[0].group)
    colls = [self.nodes[i.nodes[d]] for i in bucket]
    first, device = colls[0], colls[0].device
    flats = []
    for k, (inst, coll) in enumerate(zip(bucket, colls)):
      flats.append(self.op(
          f"{where}/flat_{k}", "Reshape", device,
          [coll.input[0], self.const(f"{where}/flat_{k}/shape", [inst.elements], device)],
          {"T": (dtype,), "Tshape": (int32,)}, ()))
    concat = self.op(f"{where}/concat", "ConcatV2", device,
                     flats + [self.const(f"{where}/concat/axis", 0, device)],
                     {"T": (dtype,), "N": len(flats), "Tidx": (int32,)}, ())
    gather = self._collective(first, [concat, first.input[1], first.input[2],
                                      self.const(f"{where}/instance_key", key, device)],
                              f"{where}/all_gather")
    self.add(gather)
    total = sum(i.elements for i in bucket)
    cut = self.op(f"{where}/blocks", "Reshape", device,
                  [gather.name, self.const(f"{where}/blocks/shape", [n, total], device)],
                  {"T": (dtype,), "Tshape": (int32,)}, ())
    split = self.op(f"{where}/split", "SplitV", device,
                    [cut, self.const(f"{where}/split/sizes", [i.elements for i in bucket],
                                     device),
                     self.const(f"{where}/split/axis", 1, device)],
                    {"T": (dtype,), "Tlen": (int32,), "num_split": len(bucket)}, ())
    for k, (inst, coll) in enumerate(zip(bucket, colls)):
      shape = [inst.local_shape[0] * n] + list(inst.local_shape[1:])
      self._become_piece(coll, f"{split}:{k}" if k else split, shape, dtype, device, where, k)

  def emit_on(self, d, bucket, key, where):
    """Device d's part of `bucket` (every member the same, in the same order)."""
    dtype, int32 = bucket[0].dtype, types_pb2.DT_INT32
    members = [self.nodes[i.nodes[d]] for i in bucket]
    first, device = members[0], members[0].device
    last = (bucket[-1].source, d, any(self.out.records[m.name].shared for m in members))
    flats = []
    for k, (inst, member) in enumerate(zip(bucket, members)):
      mine = self.out.records[member.name]
      flats.append(self.op(
          f"{where}/flat_{k}", "Reshape", device,
          [member.input[0], self.const(f"{where}/flat_{k}/shape", [inst.elements], device)],
          {"T": (dtype,), "Tshape": (int32,)}, (mine.source, d, mine.shared)))
    axis = self.const(f"{where}/axis", 0, device)
    concat = self.op(f"{where}/concat", "ConcatV2", device, flats + [axis],
                     {"T": (dtype,), "N": len(flats), "Tidx": (int32,)}, last)
    reduce_node = node_def_pb2.NodeDef()
    reduce_node.CopyFrom(first)
    reduce_node.name = self.unique(f"{where}/all_reduce")
    del reduce_node.input[:]
    reduce_node.input.extend([concat, first.input[1], first.input[2],
                              self.const(f"{where}/instance_key", key, device)])
    for attr in [a for a in reduce_node.attr if a.startswith("_tfsplit")]:
      del reduce_node.attr[attr]
    self.add(reduce_node, *last)
    self.kept.update(input_node(t) for t in first.input[1:3])
    split = self.op(f"{where}/split", "SplitV", device,
                    [reduce_node.name,
                     self.const(f"{where}/split/sizes", _split_sizes(bucket), device), axis],
                    {"T": (dtype,), "Tlen": (int32,), "num_split": len(bucket)}, last)
    for k, (inst, member) in enumerate(zip(bucket, members)):
      self.dead_inputs.update(input_node(t) for t in member.input[1:])
      self.rewritten.add(member.name)
      # The collective node becomes its member's Reshape, under its name and
      # record: consumers, control edges and output copies stay valid.
      shape = self.const(f"{where}/shape_{k}", list(inst.local_shape), device)
      member.op = "Reshape"
      for attr in [a for a in member.attr if not a.startswith("_tfsplit")]:
        del member.attr[attr]
      member.attr["T"].type = dtype
      member.attr["Tshape"].type = int32
      del member.input[:]
      member.input.extend([f"{split}:{k}" if k else split, shape])

  def finish(self):
    """Drops the members' now unused key constants (and the collectives a
    bucket replaced); records the new nodes."""
    gone = self.rewritten | self.removed
    dead = {n for n in self.dead_inputs - self.kept if self.nodes[n].op == "Const" and
            all(c in gone for c, _ in self.consumers.get(n, ()))} | self.removed
    stamp_records(types.SimpleNamespace(node=[self.nodes[n] for n in self.new_records]),
                  self.new_records)
    self.out.records.update(self.new_records)
    graph_def = self.out.graph_def
    for i in reversed([i for i, n in enumerate(graph_def.node) if n.name in dead]):
      del graph_def.node[i]
    for name in dead:
      self.out.records.pop(name, None)


def _split_sizes(bucket):
  return [i.elements for i in bucket]
