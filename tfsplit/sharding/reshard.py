"""Reshard: move a tensor from one sharding to another with the cheapest
collectives (GSPMD's `Reshard`). The one place that emits communication.

    current = resharder.reshard(current, ids, info, have, want, src, port, consumer)

`current` holds the tensor's local name on every logical device. In order:
1. partial sums (`have.partial - want.partial`) are reduced: over micro-batches
   (a local axis) by a running sum on the device; over a real axis by a
   reduce-scatter straight into the split `want` asks for, else
   CollectiveReduceV2 (all-reduce). A reduce-scatter is
   CollectiveReduceScatterV2 on GPUs (NCCL; TF has no CPU kernel for it) and
   elsewhere CollectiveAllToAllV2 plus a local sum of the n pieces received:
   the same (n-1)/n of the tensor sent per device as a ring reduce-scatter,
   half a ring all-reduce's. The micro-batch sum comes first (one collective
   per step), or, with `scatter_microbatches` (ZeRO stage 2), each
   micro-batch is reduce-scattered and the running sum holds only the shard;
2. a dimension split over an axis that `want` splits another dimension over
   is exchanged with CollectiveAllToAllV2 (each device sends every other
   device the block it will own);
3. other split dimensions `want` has whole are gathered (CollectiveGatherV2;
   a ConcatV2 over micro-batches);
4. dimensions `want` splits that are whole by now are sliced locally (no
   communication).

Collective group keys are fixed by the member devices (TF keys groups per
process); instance keys count up from a seed fingerprinting graph and plan, so
the output is deterministic and one process can run several split graphs.
"""
import dataclasses
import zlib
from typing import Dict, Optional, Tuple

import numpy as np
from absl import logging
from tensorflow.core.framework import node_def_pb2
from tensorflow.core.framework import types_pb2

from tfsplit.errors import PlanError
from tfsplit.sharding.builder import safe_axis, tensor
from tfsplit.layout.spec import Sharding, axis_parts, join_parts, without_part


@dataclasses.dataclass
class CollectiveRecord:
  kind: str          # all_reduce / reduce_scatter / all_to_all / all_gather /
                     # local_sum / local_concat (over micro-batches, one device)
  axis: str
  tensor: str        # the original tensor it moves
  consumer: str      # the op that required it first
  num_elements: int  # global elements of the tensor
  # What gradient buckets repack (sharding/buckets.py), none for bools: per
  # member device id, (the collective node, the node giving its result), of
  # every all-reduce, and of each reduce-scatter and all-gather whose local
  # input shape (the split dimension moved to the front; the result along
  # dimension 0) is known and recorded with them.
  units: Optional[Dict[int, Tuple[str, str]]] = None
  unit_shape: Optional[Tuple[int, ...]] = None
  dtype: int = 0     # DataType enum of what travels (0: not recorded)


class Resharder(object):
  """Emits the transitions between shardings into a DeviceGraph."""

  def __init__(self, builder, mesh, timeout_seconds, instance_seed,
               scatter_microbatches=False):
    self.b, self.mesh, self.timeout = builder, mesh, timeout_seconds
    self.scatter_microbatches = scatter_microbatches
    if scatter_microbatches:
      # Other collectives than for the same plan without it: other keys (TF
      # keeps a key's kind and shape for the whole process).
      instance_seed = zlib.crc32(b"scatter_microbatches", instance_seed)
    self.instance_key = (instance_seed & 0x0FFFFFFF) << 2
    # Local axes (micro-batches): all members of a group on one device.
    self.local_axes = [a for a in mesh.axis_names if mesh.is_local(a) and mesh.axes[a] > 1]
    self._rep_table = None
    self.collectives = []
    self.local_sums = []   # per running sum to order micro-batches by: {device id: tensor}
    # CollectiveReduceScatterV2 has an NCCL kernel only; elsewhere a
    # reduce-scatter is an all-to-all and a local sum.
    self.nccl = mesh.on_gpus

  # --- micro-batch sharing ------------------------------------------------------
  def rep(self, device_id):
    """The device id with every local-axis coordinate 0."""
    if not self.local_axes:
      return device_id
    return self._reps()[0][device_id]

  def _reps(self):
    """(rep of each device, the devices sharing each rep): made once, every
    transition asking for each device of a mesh as large as a cluster."""
    if self._rep_table is None:
      reps = []
      for d in range(self.mesh.size):
        coords = self.mesh.coords(d)
        for a in self.local_axes:
          coords[a] = 0
        reps.append(self.mesh.device_id(coords))
      sharers = {}
      for d, r in enumerate(reps):
        sharers.setdefault(r, []).append(d)
      self._rep_table = (reps, sharers)
    return self._rep_table

  def uses_local_axis(self, spec):
    if spec is None:
      return False
    axes = {p for a in spec.axes_used for p in self.mesh.axis_parts(a)}
    return bool(axes & set(self.local_axes))

  def _same_for_all_microbatches(self, current, d):
    if not self.local_axes:
      return False
    r = self.rep(d)
    return all(current[x] == current[r] for x in self._reps()[1][r])

  def _note_shared(self, current, d, name):
    if self._same_for_all_microbatches(current, d):
      self.b.mark_shared(name)

  def _shared(self, current, out, d):
    """out[d] if device d's copy would repeat its micro-batch 0 copy."""
    r = self.rep(d)
    return out[r] if r != d and current[d] == current[r] else None

  # --- the transition ------------------------------------------------------------
  def reshard(self, current, ids, info, have, want, src, port, consumer, ordered=True):
    """Local names (per device) of src:port moved from `have` to `want`.

    ids: the devices holding the tensor; ordered: running sums over
    micro-batches order the micro-batches (false for the step's outputs).
    """
    if want.partial - have.partial:
      raise PlanError(f"node '{consumer}': cannot make a partial sum of a whole tensor")
    spec, what = have, (src, port, consumer)
    for axis in sorted(have.partial - want.partial):
      # Local parts (micro-batches: a plain sum) before the real collective,
      # unless each micro-batch is reduce-scattered (then summed as shards).
      for part in sorted(self.mesh.axis_parts(axis), key=lambda a: (
          0 if self._scatters_first(spec, want, a, info) else
          1 if a in self.local_axes else 2)):
        if self.mesh.axes[part] == 1:
          continue  # a sum over one member is the member
        if part in self.local_axes:
          current = self._local_reduce(current, ids, info, part, what, ordered)
          continue
        dim = self._scatter_dim(spec, want, part, info)
        if dim is not None:
          current = self._reduce_scatter(current, ids, info, spec, dim, part, what)
          dims = list(spec.dims)
          dims[dim] = _appended(dims[dim], part)
          spec = Sharding(tuple(dims), spec.partial)
        else:
          current = self._all_reduce(current, ids, info, part, what, spec)
      spec = Sharding(spec.dims, spec.partial - {axis})
    for dim in range(spec.rank):
      axis = spec.dims[dim]
      if axis is None or want.dims[dim] == axis:
        continue
      target = self._exchange_dim(spec, want, dim, axis, info)
      if target is not None:
        # The minor part of `axis` moves to `target` (all of it for a plain axis).
        part = axis_parts(axis)[-1]
        current = self._all_to_all(current, ids, info, spec, dim, target, part, what)
        dims = list(spec.dims)
        dims[dim], dims[target] = without_part(axis, part), _appended(dims[target], part)
        spec = Sharding(tuple(dims), spec.partial)
        axis = spec.dims[dim]
        if axis is None or want.dims[dim] == axis:
          continue
      # The parts `want` does not keep (it may split finer: the slice below),
      # minor part first, so blocks end up in compound-coordinate order.
      kept = _common_prefix(axis, want.dims[dim])
      for part in reversed(axis_parts(axis)[len(kept):]):
        if self.mesh.axes[part] == 1:
          continue
        if part in self.local_axes:
          current = self._local_concat(current, ids, info, dim, part, what)
        else:
          current = self._all_gather(current, ids, info, dim, part, what,
                                     spec if part == axis else None)
      dims = list(spec.dims)
      dims[dim] = join_parts(kept)
      spec = Sharding(tuple(dims), spec.partial)
    if any(w is not None and w != s for w, s in zip(want.dims, spec.dims)):
      current = self.slice(current, ids, info, spec, want, what)
    return current

  def _scatters_first(self, spec, want, part, info):
    """True for a real axis reduce-scattered before the micro-batch sum."""
    return self.scatter_microbatches and part not in self.local_axes and \
        self._scatter_dim(spec, want, part, info) is not None

  def _scatter_dim(self, spec, want, axis, info):
    """The dimension a reduce-scatter over `axis` can split straight away
    (whole there, or split over what `want` splits it over less `axis`, its
    minor part: the experts' partial output of a dense-routed layer going
    back to the batch split dp*mb*ep)."""
    if axis in self.local_axes or any(
        d is not None and axis in axis_parts(d) for d in spec.dims):
      return None
    for dim, w in enumerate(want.dims):
      if w is not None and w == _appended(spec.dims[dim], axis):
        local = spec.local_shape(info.shape, self.mesh)
        return dim if local[dim] % self.mesh.axes[axis] == 0 else None
    return None

  def _exchange_dim(self, spec, want, dim, axis, info):
    """The dimension an all-to-all over the minor part of `axis` can move the
    split of `dim` to: one `want` splits over that part (after what splits it
    now), while `want` keeps no part of it on `dim`."""
    part = axis_parts(axis)[-1]
    if part not in self.mesh.axes or part in self.local_axes or self.mesh.axes[part] == 1:
      return None
    if want.dims[dim] is not None and part in axis_parts(want.dims[dim]):
      return None
    local = spec.local_shape(info.shape, self.mesh)
    for target, w in enumerate(want.dims):
      if target != dim and w is not None and w == _appended(spec.dims[target], part) \
          and local[target] % self.mesh.axes[part] == 0:
        return target
    return None

  # --- collectives -------------------------------------------------------------
  def _group_key(self, axis, device_id):
    """A key fixed by the group's device names: TF keys groups per process,
    so one key must always mean the same members (and size)."""
    _, members = self.mesh.group_of(device_id, axis)
    names = ",".join(self.mesh.devices[m] for m in members)
    return (zlib.crc32(names.encode()) & 0x3FFFFFFF) + 1, members

  def _instance(self, keys, current, d, axis):
    """Instance key of this collective for device d: one per distinct set of
    inputs (copies serving different micro-batches run separate instances)."""
    members = tuple(current[m] for m in self.mesh.group_of(d, axis)[1])
    if members not in keys:
      self.instance_key += 1
      keys[members] = self.instance_key
    return keys[members]

  def _collective(self, op, kind, current, ids, info, axis, what, pre=None, post=None,
                  record=True, finish=None, unit_shape=None):
    """One `op` member per device (pre/post: local reshapes around it;
    finish: local ops completing the collective's result, before post).
    unit_shape: the collective's local input shape; with it (and for every
    all-reduce) the members are recorded (CollectiveRecord.units) so
    buckets can repack them."""
    src, port, consumer = what
    keys, out, units = {}, [None] * self.mesh.size, {}
    for d in ids:
      shared = self._shared(current, out, d)
      if shared is not None:
        out[d] = shared
        continue
      device = self.mesh.devices[d]
      base = f"{src}/port_{port}/{kind}_{safe_axis(axis)}/shard_{d}"
      x = pre(current[d], base, device) if pre else current[d]
      if info.dtype == types_pb2.DT_BOOL:  # collectives have no bool kernels
        x = self.b.cast(x, types_pb2.DT_BOOL, types_pb2.DT_INT32, base + "/to_int", device)
      group_key, members = self._group_key(axis, d)
      inputs = [x, self.b.int_const(base + "/group_size", len(members), device),
                self.b.int_const(base + "/group_key", group_key, device),
                self.b.int_const(base + "/instance_key",
                                 self._instance(keys, current, d, axis), device)]
      carried = types_pb2.DT_INT32 if info.dtype == types_pb2.DT_BOOL else info.dtype
      node = self.b.add(self.b.make.collective(op, base, device, inputs, carried, self.timeout),
                        *((src, d) if record else ()))
      y = node.name
      if carried != info.dtype:
        y = self.b.cast(y, carried, info.dtype, base + "/to_bool", device)
      y = finish(y, base, device, d) if finish else y
      units[d] = (node.name, y)
      for made in dict.fromkeys((node.name, y)):  # serving every micro-batch: no block
        self._note_shared(current, d, made)
      y = post(y, base, device) if post else y
      self._note_shared(current, d, y)
      out[d] = y
    shape = tuple(unit_shape) if unit_shape is not None else None
    bucketable = (shape is not None or kind == "all_reduce") and \
        info.dtype != types_pb2.DT_BOOL and units
    self.collectives.append(CollectiveRecord(
        kind, axis, tensor(src, port), consumer, info.num_elements or 0,
        units if bucketable else None, shape if bucketable else None,
        types_pb2.DT_INT32 if info.dtype == types_pb2.DT_BOOL else info.dtype))
    return out

  def _all_reduce(self, current, ids, info, axis, what, spec=None):
    """spec: the sharding the partial sum has here (recorded as its local
    shape: an earlier reduce-scatter over another part of a compound axis,
    dp of dp*ep under ZeRO, has split it)."""
    shape = None
    if spec is not None and info.shape is not None and None not in info.shape:
      shape = spec.local_shape(info.shape, self.mesh)
    return self._collective("CollectiveReduceV2", "all_reduce", current, ids, info, axis,
                            what, unit_shape=shape)

  def _to_front(self, dim, rank, dtype):
    """(pre, post) moving dimension `dim` to the front and back."""
    if dim == 0:
      return None, None
    perm = [dim] + [i for i in range(rank) if i != dim]
    inverse = [int(i) for i in np.argsort(perm)]
    return (lambda x, base, dev: self.b.transpose(x, perm, base + "/to_front", dev, dtype),
            lambda y, base, dev: self.b.transpose(y, inverse, base + "/from_front", dev, dtype))

  def _front_shape(self, spec, dim, info):
    """Static local shape of a tensor in `spec`, dimension `dim` moved to
    the front, or None."""
    if info.shape is None or any(s is None for s in info.shape):
      return None
    local = list(spec.local_shape(info.shape, self.mesh))
    return [local[dim]] + local[:dim] + local[dim + 1:]

  def _all_gather(self, current, ids, info, dim, axis, what, spec=None):
    """Gathers dimension `dim` (CollectiveGatherV2 concatenates along dim 0)."""
    logging.info("all-gather of %s:%d dim %d over %s for '%s'", what[0], what[1], dim, axis,
                 what[2])
    pre, post = self._to_front(dim, len(info.shape), info.dtype)
    shape = self._front_shape(spec, dim, info) if spec is not None else None
    return self._collective("CollectiveGatherV2", "all_gather", current, ids, info, axis,
                            what, pre, post, record=False, unit_shape=shape)

  def _reduce_scatter(self, current, ids, info, spec, dim, axis, what):
    """Sums over `axis` and keeps this device's block of dimension `dim`.

    CollectiveReduceScatterV2 (GPUs) scatters along dim 0. Elsewhere
    CollectiveAllToAllV2 (on CPUs: of an [n, elements/n] tensor) sends block
    i to member i, and the n blocks received (one per member, in member
    order) are summed locally.
    """
    pre, post = self._to_front(dim, len(info.shape), info.dtype)
    shape = self._front_shape(spec, dim, info)
    if self.nccl:
      return self._collective("CollectiveReduceScatterV2", "reduce_scatter", current, ids,
                              info, axis, what, pre, post, unit_shape=shape)
    n = self.mesh.axes[axis]
    local = list(spec.local_shape(info.shape, self.mesh))
    pieces = [n, local[dim] // n] + local[:dim] + local[dim + 1:]
    rows = [n, int(np.prod(local, dtype=np.int64)) // n]  # all-to-all wants [n, ...]

    def cut(x, base, device):
      x = pre(x, base, device) if pre else x
      return self.b.reshape(x, rows, base + "/rows", device, info.dtype)

    def finish(y, base, device, d):
      cut = self.b.reshape(y, pieces, base + "/pieces", device, info.dtype)
      return self.b.add(self.sum_node(self.b.unique(base + "/sum"), cut, 0, info.dtype,
                                      device), what[0], d).name
    return self._collective("CollectiveAllToAllV2", "reduce_scatter", current, ids, info,
                            axis, what, cut, post, finish=finish, unit_shape=shape)

  def sum_node(self, name, x, axis, dtype, device):
    """A Sum of `x` over dimension `axis` (a new int32 Const), keep_dims false."""
    node = node_def_pb2.NodeDef(name=name, op="Sum", device=device,
                                input=[x, self.b.int_const(name + "/axis", axis, device)])
    node.attr["T"].type = dtype
    node.attr["Tidx"].type = types_pb2.DT_INT32
    node.attr["keep_dims"].b = False
    return node

  def _all_to_all(self, current, ids, info, spec, dim, target, axis, what):
    """Moves the split of `dim` (over `axis`) to `target`: each device cuts
    its block into n pieces along `target`, sends piece i to member i, and
    concatenates what it receives along `dim`."""
    n, dtype = self.mesh.axes[axis], info.dtype
    local = list(spec.local_shape(info.shape, self.mesh))
    rank = len(local)
    # [.., T, ..] -> [.., n, T/n, ..] -> [n, .., T/n, ..]
    cut = local[:target] + [n, local[target] // n] + local[target + 1:]
    front = [target] + [i for i in range(rank + 1) if i != target]

    def pre(x, base, dev):
      return self.b.transpose(self.b.reshape(x, cut, base + "/cut", dev, dtype), front,
                              base + "/pieces", dev, dtype)
    # [n, .., D/n, .., T/n, ..] -> [.., n, D/n, .., T/n, ..] -> [.., D, .., T/n, ..]
    order = [i + 1 for i in range(rank)]
    order.insert(dim, 0)
    merged = list(local)
    merged[dim], merged[target] = local[dim] * n, local[target] // n

    def post(y, base, dev):
      moved = self.b.transpose(y, order, base + "/blocks", dev, dtype)
      return self.b.reshape(moved, merged, base + "/merged", dev, dtype)
    return self._collective("CollectiveAllToAllV2", "all_to_all", current, ids, info,
                            axis, what, pre, post)

  # --- micro-batches (local axes) ------------------------------------------------
  def _local_reduce(self, current, ids, info, axis, what, ordered):
    """Partial sums over micro-batches: a running sum in micro-batch order.

    One AddN at the end would keep every micro-batch's gradient alive until
    the last one is done; a chain adds each as soon as it exists, so only
    one accumulator lives (the next micro-batch waits for it, which also
    stops Grappler from merging the chain back into an AddN).
    """
    src, port, _ = what
    out, accumulated = [None] * self.mesh.size, {}
    for index, members in enumerate(self.mesh.groups(axis)):
      if members[0] not in ids:
        continue
      inputs = [current[m] for m in members]
      device = self.mesh.devices[members[0]]
      if len(set(inputs)) == 1:
        raise PlanError(f"tensor '{src}:{port}' is partial over micro-batches but the "
                        "same in each; this is a bug in a split rule")
      acc = inputs[0]
      accumulated[members[0]] = acc
      for j in range(1, len(members)):
        node = node_def_pb2.NodeDef(
            name=self.b.unique(f"{src}/port_{port}/sum_{safe_axis(axis)}/group_{index}/acc_{j}"),
            op="AddV2", device=device, input=[acc, inputs[j]])
        node.attr["T"].type = info.dtype
        self.b.add(node, src, members[j])
        acc = node.name
        accumulated[members[j]] = acc
      for m in members:
        out[m] = acc
    if ordered:
      self.local_sums.append(accumulated)
    self.collectives.append(CollectiveRecord("local_sum", axis, tensor(src, port), what[2],
                                             info.num_elements or 0))
    return out

  def _local_concat(self, current, ids, info, dim, axis, what):
    """Gathering over micro-batches: a ConcatV2 per group."""
    src, port, _ = what
    out = [None] * self.mesh.size
    for index, members in enumerate(self.mesh.groups(axis)):
      if members[0] not in ids:
        continue
      device = self.mesh.devices[members[0]]
      base = f"{src}/port_{port}/concat_{safe_axis(axis)}/group_{index}"
      axis_const = self.b.int_const(base + "/axis", dim, device)
      node = node_def_pb2.NodeDef(name=self.b.unique(base), op="ConcatV2", device=device,
                                  input=[current[m] for m in members] + [axis_const])
      node.attr["N"].i = len(members)
      node.attr["T"].type = info.dtype
      node.attr["Tidx"].type = types_pb2.DT_INT32
      self.b.add(node)
      for m in members:
        out[m] = node.name
    self.collectives.append(CollectiveRecord("local_concat", axis, tensor(src, port), what[2],
                                             info.num_elements or 0))
    return out

  def slice(self, current, ids, info, have, want, what, names=None):
    """Local slice (no communication) from `have` to the finer `want`.

    names: {device id: name} for the slices (default: derived from the tensor).
    """
    src, port, _ = what
    out = [None] * self.mesh.size
    want_local = want.local_shape(info.shape, self.mesh, f"tensor '{src}:{port}'")
    for d in ids:
      shared = self._shared(current, out, d)
      if shared is not None and not self.uses_local_axis(want):
        out[d] = shared
        continue
      device = self.mesh.devices[d]
      base = names[d] if names else (
          f"{src}/port_{port}/slice_"
          f"{'_'.join(safe_axis(a) if a else 'r' for a in want.dims)}/shard_{d}")
      begin = [0] * len(info.shape)
      for i, axis in enumerate(want.dims):
        if axis is not None and have.dims[i] != axis:
          # Within the block `have` holds: the coordinate of the parts `want` adds.
          added = join_parts(axis_parts(axis)[len(_common_prefix(axis, have.dims[i])):])
          begin[i] = self.mesh.coord_of(d, added) * want_local[i]
      node = node_def_pb2.NodeDef(
          name=base if names else self.b.unique(base), op="Slice", device=device,
          input=[current[d], self.b.int_const(base + "/begin", begin, device),
                 self.b.int_const(base + "/size", list(want_local), device)])
      node.attr["T"].type = info.dtype
      node.attr["Index"].type = types_pb2.DT_INT32
      self.b.add(node, src, d)
      if not self.uses_local_axis(want):  # else each micro-batch has its own block
        self._note_shared(current, d, node.name)
      out[d] = node.name
    return out


def _appended(axis, part):
  """`axis` with mesh axis `part` as its new minor part ('dp*mb' + 'ep')."""
  return part if axis is None else f"{axis}*{part}"


def _common_prefix(axis, other):
  """The leading parts of `axis` that `other` starts with too."""
  if other is None:
    return []
  kept = []
  for mine, theirs in zip(axis_parts(axis), axis_parts(other)):
    if mine != theirs:
      break
    kept.append(mine)
  return kept
