"""Materialization: one copy of every op per device, with local shapes, and
the collectives that move tensors between shardings.

For every tensor that reaches a consumer in another sharding than the one it
was produced in, the cheapest correct transition is inserted once and shared
by all consumers: all-reduce (partial -> whole), all-gather (split ->
replicated), local slice (replicated -> split, no communication). Control
edges are only ever copied within one device, so the members of a collective
are never ordered against each other across devices.

Names: the copy of node `n` on logical device d is `n/shard_d`; the graph's
outputs keep their original names (on device 0) so callers see the same
signature. Variables become one variable per device, recorded in a manifest.
"""
import dataclasses
import zlib

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.core.framework import graph_pb2
from tensorflow.core.framework import node_def_pb2
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import tensor_util

from tfsplit.errors import GraphValidationError, PlanError
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.ir import Graph, parse_input
from tfsplit.graph.layers import graph_outputs
from tfsplit.rules.base import Decision
from tfsplit.sharding.collectives import collective_node
from tfsplit.sharding.spec import Sharding


_WRITE_PREFIXES = ("Assign", "ResourceApply", "ResourceSparseApply", "ResourceScatter")


def _safe(axis):
  """Axis names in node names ('dp*mb' is not a valid node-name character)."""
  return axis.replace("*", "_x_")


def local_name(name, device_id):
  return f"{name}/shard_{device_id}"


def shard_variable_name(var_name, device_id):
  return f"{var_name}/shard_{device_id}"


def _tensor(name, port):
  return name if port == 0 else f"{name}:{port}"


@dataclasses.dataclass
class CollectiveRecord:
  kind: str          # all_reduce / all_gather
  axis: str
  tensor: str        # the original tensor it moves
  consumer: str      # the op that required it first
  num_elements: int  # global elements of the tensor


class _LocalizeContext(object):
  """What a rule's `localize` may do to one device's copy of a node."""

  def __init__(self, mat, node, original, decision, device_id, data_positions, in_infos):
    self.mat, self.node, self.original = mat, node, original
    self.decision, self.device_id = decision, device_id
    self._positions, self._in_infos = data_positions, in_infos

  def local_out_shape(self, k=0):
    info = self.mat.shapes[self.original.name][k]
    return self.decision.outputs[k].local_shape(
        info.shape, self.mat.mesh, f"node '{self.original.name}' (op {self.original.op})")

  def input_dtype(self, i):
    return tf.as_dtype(self._in_infos[i].dtype).as_numpy_dtype

  def const_input(self, i, value):
    name = self.mat.unique(f"{self.node.name}/local_input_{i}")
    self.mat.add(_const(name, np.asarray(value), self.node.device))
    self.node.input[self._positions[i]] = name

  def scale_output(self, factor):
    """Renames the local node and multiplies its output 0 by `factor`."""
    final = self.node.name
    self.node.name = self.mat.unique(final + "/unscaled")
    dtype = self.mat.shapes[self.original.name][0].dtype
    c = _const(self.mat.unique(final + "/scale"),
               np.asarray(factor, tf.as_dtype(dtype).as_numpy_dtype), self.node.device)
    self.mat.add(c)
    mul = node_def_pb2.NodeDef(name=final, op="Mul", device=self.node.device,
                               input=[self.node.name, c.name])
    mul.attr["T"].type = dtype
    self.mat.deferred.append(mul)


def _const(name, value, device):
  node = node_def_pb2.NodeDef(name=name, op="Const", device=device)
  node.attr["dtype"].type = tf.as_dtype(value.dtype).as_datatype_enum
  node.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(value))
  return node


class Materializer(object):
  """Builds the per-device GraphDef from a Propagation."""

  def __init__(self, graph, shapes, mesh, propagation, variables, timeout_seconds=None,
               stage_of=None):
    self.graph, self.shapes, self.mesh = graph, shapes, mesh
    # Pipeline stages: node -> stage; each node lives only on the devices whose
    # 'pp' coordinate is its stage (TF sends tensors between stages).
    self.pp = "pp" if stage_of is not None and "pp" in mesh.axes else None
    self.stage_of = stage_of or {}
    self.meta = {}         # local node name -> (original node, device id)
    self._ids = list(range(mesh.size))
    self.prop = propagation
    self.variables = {v.node: v for v in variables}
    self.timeout = timeout_seconds
    self.out = graph_pb2.GraphDef()
    self.out.versions.CopyFrom(graph.versions)
    self.out.library.CopyFrom(graph.library)
    self.names = set()
    self.created = {}      # name -> the NodeDef in self.out
    self.deferred = []
    self.reshards = {}     # (tensor, target) -> [local tensor per device]
    self.collectives = []  # CollectiveRecord
    self.manifest = {}
    self.output_copies = {}  # output -> [[device, local tensor]], one per copy
    # Instance keys start from a fingerprint of the input graph: unique across
    # the different split graphs one process may run, yet deterministic.
    # The plan is part of the fingerprint: TF caches a collective's shape per
    # (group, instance) key, and the same graph split two ways must not reuse keys.
    plan = repr((sorted(mesh.axes.items()), mesh.devices,
                 sorted((k, str(v)) for k, v in propagation.variable_specs.items())))
    self.instance_key = (zlib.crc32(graph.graph_def.SerializeToString(
        deterministic=True) + plan.encode()) & 0x0FFFFFFF) << 2
    self.group_keys = {}
    # Local axes (micro-batches): all members of a group on one device.
    self.local_axes = [a for a in mesh.axis_names if mesh.is_local(a) and mesh.axes[a] > 1]
    self.alias = {}        # (node, device id) -> the local name it shares
    self.shared_nodes = set()  # local nodes serving every micro-batch
    self.local_members = []  # per local reduction: {device id: member tensor}
    self._record_members = True

  # --- bookkeeping -----------------------------------------------------------
  def lname(self, name, device_id):
    """Local name of node `name` as seen from `device_id`: its copy on the
    same coordinates of its own stage, shared across micro-batches when it
    does not depend on which micro-batch it serves."""
    device_id = self.on_stage(device_id, self.node_stage(name))
    return self.alias.get((name, device_id)) or local_name(name, device_id)

  def node_stage(self, name):
    return self.stage_of.get(name, 0) if self.pp else None

  def on_stage(self, device_id, stage):
    if self.pp is None or stage is None:
      return device_id
    coords = self.mesh.coords(device_id)
    if coords[self.pp] == stage:
      return device_id
    coords[self.pp] = stage
    return self.mesh.device_id(coords)

  def ids_for(self, name):
    """Device ids holding a copy of node `name` (its stage's, or all)."""
    if self.pp is None:
      return list(range(self.mesh.size))
    stage = self.node_stage(name)
    return [d for d in range(self.mesh.size) if self.mesh.coord(d, self.pp) == stage]

  def rep(self, device_id):
    """The device id with every local-axis coordinate 0."""
    if not self.local_axes:
      return device_id
    coords = self.mesh.coords(device_id)
    for a in self.local_axes:
      coords[a] = 0
    return self.mesh.device_id(coords)

  def _uses_local_axis(self, spec):
    if spec is None:
      return False
    axes = {p for a in spec.axes_used for p in self.mesh.axis_parts(a)}
    return bool(axes & set(self.local_axes))

  def unique(self, base):
    name, i = base, 0
    while name in self.names:
      i += 1
      name = f"{base}_{i}"
    self.names.add(name)
    return name

  def add(self, node, original=None, device_id=None):
    self.names.add(node.name)
    if original is not None:
      self.meta[node.name] = (original, device_id)
    added = self.out.node.add()
    added.CopyFrom(node)
    self.created[node.name] = added
    return added

  def _group_key(self, axis, device_id):
    """A key fixed by the group's device names: TF keys groups per process,
    so one key must always mean the same members (and size)."""
    _, members = self.mesh.group_of(device_id, axis)
    names = ",".join(self.mesh.devices[m] for m in members)
    return (zlib.crc32(names.encode()) & 0x3FFFFFFF) + 1, members

  def _int_const(self, base, value, device):
    node = _const(self.unique(base), np.asarray(value, np.int32), device)
    self.add(node)
    return node.name

  # --- resharding --------------------------------------------------------------
  def source(self, src, port, consumer):
    """(local tensor per device, sharding) of src:port as consumers see it."""
    produced = self.prop.reduced_at_source.get((src, port))
    if produced is None:
      have = self.prop.outputs[src][port] if port < len(self.prop.outputs[src]) else None
      return [_tensor(self.lname(src, d), port) for d in range(self.mesh.size)], have
    whole = produced.without_partial()
    return self.reshard(src, port, produced, whole, consumer, raw=True), whole

  def reshard(self, src, port, have, want, consumer, raw=False):
    """Local tensor names (per device) of tensor src:port in sharding `want`.

    Starts from the tensor as consumers see it (or, with raw=True, as its
    producer left it).
    """
    key = (src, port, want, raw)
    if key in self.reshards:
      return self.reshards[key]
    info = self.shapes[src][port]
    saved_ids, self._ids = self._ids, self.ids_for(src)
    if raw:
      current = [_tensor(self.lname(src, d), port) for d in range(self.mesh.size)]
    else:
      current, have = self.source(src, port, consumer)
    spec = have
    if want.partial - have.partial:
      raise PlanError(f"node '{consumer}': cannot make a partial sum of a whole tensor")
    for axis in sorted(have.partial - want.partial):
      # Local parts (micro-batches: a plain sum) before the real collective.
      parts = sorted(self.mesh.axis_parts(axis), key=lambda a: a not in self.local_axes)
      for part in parts:
        if self.mesh.axes[part] == 1:
          continue  # a sum over one member is the member
        if part in self.local_axes:
          current = self._local_reduce(current, info, part, src, port)
        else:
          current = self._all_reduce(current, info, part, src, port, consumer)
      spec = Sharding(spec.dims, spec.partial - {axis})
    for dim, axis in spec.split_dims():
      if want.dims[dim] != axis:
        # Minor part first, so blocks end up in compound-coordinate order.
        for part in reversed(self.mesh.axis_parts(axis)):
          if self.mesh.axes[part] == 1:
            continue
          if part in self.local_axes:
            current = self._local_concat(current, info, dim, part, src, port)
          else:
            current = self._all_gather(current, info, spec, dim, part, src, port, consumer)
        dims = list(spec.dims)
        dims[dim] = None
        spec = Sharding(tuple(dims), spec.partial)
    if any(w is not None and w != s for w, s in zip(want.dims, spec.dims)):
      current = self._slice(current, info, spec, want, src, port)
    stage = self.node_stage(src)
    current = [current[self.on_stage(d, stage)] for d in range(self.mesh.size)]
    self._ids = saved_ids
    self.reshards[key] = current
    return current

  def _instance(self, keys, current, d, axis):
    """Instance key of this collective for device d: one per distinct set of
    inputs (copies serving different micro-batches run separate instances)."""
    members = tuple(current[m] for m in self.mesh.group_of(d, axis)[1])
    if members not in keys:
      self.instance_key += 1
      keys[members] = self.instance_key
    return keys[members]

  def _same_for_all_microbatches(self, current, d):
    """True if device d's input is one tensor serving every micro-batch."""
    if not self.local_axes:
      return False
    r = self.rep(d)
    return all(current[x] == current[r] for x in range(self.mesh.size) if self.rep(x) == r)

  def _note_shared(self, current, d, name):
    if self._same_for_all_microbatches(current, d):
      self.shared_nodes.add(name)

  def _shared(self, current, out, d):
    """out[d] if device d's copy would repeat its micro-batch 0 copy."""
    r = self.rep(d)
    if r != d and current[d] == current[r]:
      return out[r]
    return None

  def _collective_inputs(self, x, base, axis, d, keys, current):
    """[x, group_size, group_key, instance_key] for device d's member."""
    group_key, members = self._group_key(axis, d)
    device = self.mesh.devices[d]
    return [x,
            self._int_const(base + "/group_size", len(members), device),
            self._int_const(base + "/group_key", group_key, device),
            self._int_const(base + "/instance_key",
                            self._instance(keys, current, d, axis), device)]

  def _all_reduce(self, current, info, axis, src, port, consumer):
    keys, out = {}, [None] * self.mesh.size
    for d in self._ids:
      shared = self._shared(current, out, d)
      if shared is not None:
        out[d] = shared
        continue
      device = self.mesh.devices[d]
      base = f"{src}/port_{port}/all_reduce_{_safe(axis)}/shard_{d}"
      inputs = self._collective_inputs(current[d], base, axis, d, keys, current)
      node = collective_node("CollectiveReduceV2", self.unique(base), device, inputs,
                             info.dtype, self.timeout)
      self.add(node, src, d)
      self._note_shared(current, d, node.name)
      out[d] = node.name
    self.collectives.append(CollectiveRecord("all_reduce", axis, _tensor(src, port),
                                             consumer, info.num_elements or 0))
    return out

  def _all_gather(self, current, info, spec, dim, axis, src, port, consumer):
    """Gathers dimension `dim` (CollectiveGatherV2 concatenates along dim 0)."""
    keys = {}
    logging.info("all-gather of %s:%d dim %d over %s for '%s'", src, port, dim, axis,
                 consumer)
    rank = len(info.shape)
    perm = [dim] + [i for i in range(rank) if i != dim]
    inverse = list(np.argsort(perm))
    out = [None] * self.mesh.size
    for d in self._ids:
      shared = self._shared(current, out, d)
      if shared is not None:
        out[d] = shared
        continue
      device = self.mesh.devices[d]
      base = f"{src}/port_{port}/all_gather_{_safe(axis)}_dim{dim}/shard_{d}"
      x = current[d]
      if dim != 0:
        x = self._transpose(x, perm, base + "/to_front", device, info.dtype)
      inputs = self._collective_inputs(x, base, axis, d, keys, current)
      node = collective_node("CollectiveGatherV2", self.unique(base), device, inputs,
                             info.dtype, self.timeout)
      self.add(node)
      y = node.name
      if dim != 0:
        y = self._transpose(y, inverse, base + "/from_front", device, info.dtype)
      self._note_shared(current, d, y)
      out[d] = y
    self.collectives.append(CollectiveRecord("all_gather", axis, _tensor(src, port),
                                             consumer, info.num_elements or 0))
    return out

  def _local_reduce(self, current, info, axis, src, port):
    """Partial sums over micro-batches: a running sum in micro-batch order.

    One AddN at the end would keep every micro-batch's gradient alive until
    the last one is done; a chain adds each as soon as it exists, so only
    one accumulator lives (the next micro-batch waits for it, which also
    stops Grappler from merging the chain back into an AddN).
    """
    out = [None] * self.mesh.size
    accumulated = {}
    for index, members in enumerate(self.mesh.groups(axis)):
      if members[0] not in self._ids:
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
            name=self.unique(f"{src}/port_{port}/sum_{_safe(axis)}/group_{index}/acc_{j}"),
            op="AddV2", device=device, input=[acc, inputs[j]])
        node.attr["T"].type = info.dtype
        self.add(node, src, members[j])
        acc = node.name
        accumulated[members[j]] = acc
      for m in members:
        out[m] = acc
    if self._record_members:
      self.local_members.append(accumulated)
    self.collectives.append(CollectiveRecord("local_sum", axis, _tensor(src, port), "",
                                             info.num_elements or 0))
    return out

  def _local_concat(self, current, info, dim, axis, src, port):
    """Gathering over micro-batches: a ConcatV2 per group."""
    if self.mesh.axes[axis] == 1:
      return current
    out = [None] * self.mesh.size
    for index, members in enumerate(self.mesh.groups(axis)):
      if members[0] not in self._ids:
        continue
      device = self.mesh.devices[members[0]]
      axis_const = self._int_const(f"{src}/port_{port}/concat_{_safe(axis)}/group_{index}/axis",
                                   dim, device)
      node = node_def_pb2.NodeDef(
          name=self.unique(f"{src}/port_{port}/concat_{_safe(axis)}/group_{index}"), op="ConcatV2",
          device=device, input=[current[m] for m in members] + [axis_const])
      node.attr["N"].i = len(members)
      node.attr["T"].type = info.dtype
      node.attr["Tidx"].type = types_pb2.DT_INT32
      self.add(node)
      for m in members:
        out[m] = node.name
    return out

  def _transpose(self, x, perm, base, device, dtype):
    perm_name = self._int_const(base + "/perm", perm, device)
    node = node_def_pb2.NodeDef(name=self.unique(base), op="Transpose", device=device,
                                input=[x, perm_name])
    node.attr["T"].type = dtype
    node.attr["Tperm"].type = types_pb2.DT_INT32
    self.add(node)
    return node.name

  def _slice(self, current, info, have, want, src, port):
    """Local slice (no communication) from `have` to the finer `want`."""
    out = [None] * self.mesh.size
    for d in self._ids:
      shared = self._shared(current, out, d)
      if shared is not None and not self._uses_local_axis(want):
        out[d] = shared
        continue
      device = self.mesh.devices[d]
      base = f"{src}/port_{port}/slice_{'_'.join(_safe(a) if a else 'r' for a in want.dims)}/shard_{d}"
      have_local = have.local_shape(info.shape, self.mesh)
      want_local = want.local_shape(info.shape, self.mesh, f"tensor '{src}:{port}'")
      begin = [0] * len(info.shape)
      for i, axis in enumerate(want.dims):
        if axis is not None and have.dims[i] is None:
          begin[i] = self.mesh.coord_of(d, axis) * want_local[i]
      node = node_def_pb2.NodeDef(
          name=self.unique(base), op="Slice", device=device,
          input=[current[d], self._int_const(base + "/begin", begin, device),
                 self._int_const(base + "/size", list(want_local), device)])
      node.attr["T"].type = info.dtype
      node.attr["Index"].type = types_pb2.DT_INT32
      del have_local
      self.add(node, src, d)
      self._note_shared(current, d, node.name)
      out[d] = node.name
    return out

  # --- nodes ---------------------------------------------------------------------
  def _variable(self, node):
    info = self.variables[node.name]
    spec = self.prop.variable_specs.get(node.name) or Sharding.replicated(len(info.shape))
    local_shape = spec.local_shape(info.shape, self.mesh, f"variable '{info.name}'")
    entry = {"dtype": info.dtype_name, "shape": list(info.shape),
             "sharding": [a for a in spec.dims], "shards": []}
    for d in self.ids_for(node.name):
      if self.rep(d) != d:  # micro-batches share their device's variables
        self.alias[(node.name, d)] = self.lname(node.name, self.rep(d))
        continue
      self.shared_nodes.add(local_name(node.name, d))
      new = node_def_pb2.NodeDef()
      new.CopyFrom(node)
      new.name = local_name(node.name, d)
      new.device = self.mesh.devices[d]
      if "_class" in new.attr:
        del new.attr["_class"]
      shard_name = shard_variable_name(info.name, d)
      if node.op == "VarHandleOp":
        new.attr["shared_name"].s = shard_name.encode()
        new.attr["shape"].CopyFrom(variables_lib.make_shape_attr(local_shape))
      else:
        new.attr[variables_lib.VAR_NAME_ATTR].s = shard_name.encode()
        new.attr[variables_lib.VAR_SHAPE_ATTR].CopyFrom(
            variables_lib.make_shape_attr(local_shape))
      self.add(new, node.name, d)
      entry["shards"].append({
          "name": shard_name, "device": self.mesh.devices[d], "device_id": d,
          "offsets": list(spec.offsets(info.shape, self.mesh, d)),
          "shape": list(local_shape)})
    self.manifest[info.name] = entry

  def _op(self, node):
    decision = self.prop.decisions.get(node.name)
    if decision is None:  # forwards a variable handle (an inlined call's argument)
      n_data = sum(1 for t in node.input if not t.startswith("^"))
      decision = Decision([None] * n_data, [None] * max(1, len(self.shapes[node.name])))
    data = [(i, parse_input(t)) for i, t in enumerate(node.input) if not t.startswith("^")]
    positions = [i for i, _ in data]
    in_infos = [self.shapes.get(f"{s}:{p}") for _, (s, p) in data]
    resolved = []
    for j, (_, (src, port)) in enumerate(data):
      want = decision.inputs[j]
      local, have = self.source(src, port, node.name)
      if want is None or have is None or have == want:
        resolved.append(local)
      else:
        resolved.append(self.reshard(src, port, have, want, node.name))
    controls = [t[1:] for t in node.input if t.startswith("^")]
    varies = any(self._uses_local_axis(o) for o in decision.outputs)
    for d in self.ids_for(node.name):
      r = self.rep(d)
      same_controls = all(self.lname(c, d) == self.lname(c, r) for c in controls)
      writes = node.op.startswith(_WRITE_PREFIXES)
      if r != d and not varies and all(res[d] == res[r] for res in resolved) and (
          same_controls or writes):
        # Same data as micro-batch 0's copy: share it (an optimizer update must
        # run once per step, not once per micro-batch). A shared update waits
        # for what each micro-batch's copy would have waited for (every
        # forward read of its variable); other ops with per-micro-batch control
        # inputs get a copy each, so no micro-batch waits on another's.
        shared = self.lname(node.name, r)
        self.alias[(node.name, d)] = shared
        self.shared_nodes.add(shared)
        extra = {"^" + self.lname(c, d) for c in controls} - {"^" + self.lname(c, r)
                                                               for c in controls}
        if extra and shared in self.created:
          self.created[shared].input.extend(sorted(extra - set(self.created[shared].input)))
        continue
      if r != d and node.op.startswith(_WRITE_PREFIXES) and \
          resolved and resolved[0][d] == resolved[0][r]:
        raise PlanError(
            f"node '{node.name}' (op {node.op}) would update the same variable once per "
            "micro-batch (its inputs differ between micro-batches: " +
            ", ".join(f"{res[d]} vs {res[r]}" for res in resolved if res[d] != res[r]) +
            "); this is a bug in tfsplit's micro-batching, please report it")
      new = node_def_pb2.NodeDef()
      new.CopyFrom(node)
      new.name = local_name(node.name, d)
      self.names.add(new.name)
      new.device = self.mesh.devices[d]
      for j, pos in enumerate(positions):
        new.input[pos] = resolved[j][d]
      for pos, text in enumerate(node.input):
        if text.startswith("^"):
          new.input[pos] = "^" + self.lname(text[1:], d)
      # Global shapes and colocation with original (now absent) node names
      # would be wrong here; devices are explicit instead.
      for attr in ("_output_shapes", "_class"):
        if attr in new.attr:
          del new.attr[attr]
      for attr in (variables_lib.INPUT_INDEX_ATTR, variables_lib.OUTPUT_INDEX_ATTR):
        if attr in new.attr:
          del new.attr[attr]
      if decision.localize is not None:
        decision.localize(_LocalizeContext(self, new, node, decision, d, positions,
                                           in_infos))
      self.add(new, node.name, d)
      for extra in self.deferred:
        self.add(extra, node.name, d)
      self.deferred = []

  def _input(self, node):
    """Graph inputs keep their name; each device reads its block of them."""
    self.add(node)
    spec = self.prop.outputs[node.name][0]
    info = self.shapes[node.name][0]
    self.input_slices = getattr(self, "input_slices", [])
    for d in self.ids_for(node.name):
      device = self.mesh.devices[d]
      if spec is None or spec.is_replicated:
        if self.rep(d) != d:
          self.alias[(node.name, d)] = self.lname(node.name, self.rep(d))
          continue
        self.shared_nodes.add(local_name(node.name, d))
        ident = node_def_pb2.NodeDef(name=local_name(node.name, d), op="Identity",
                                     device=device, input=[node.name])
        ident.attr["T"].type = node.attr["dtype"].type
        self.add(ident, node.name, d)
        continue
      local = spec.local_shape(info.shape, self.mesh, f"input '{node.name}'")
      base = local_name(node.name, d)
      begin = list(spec.offsets(info.shape, self.mesh, d))
      sl = node_def_pb2.NodeDef(
          name=base, op="Slice", device=device,
          input=[node.name, self._int_const(base + "/begin", begin, device),
                 self._int_const(base + "/size", list(local), device)])
      sl.attr["T"].type = node.attr["dtype"].type
      sl.attr["Index"].type = types_pb2.DT_INT32
      self.add(sl, node.name, d)
      self.input_slices.append((d, base))

  def _order_microbatches(self):
    """Micro-batch j+1 starts (its input slices) after micro-batch j's
    contributions have been added to every running gradient sum: one
    micro-batch's activations are freed before the next one's are made."""
    ordered = [a for a in self.local_axes if self.mesh.axes[a] > 1]
    if not ordered or not self.local_members:
      return
    axis = ordered[0]
    by_name = {n.name: n for n in self.out.node}
    added = []
    for d, slice_name in getattr(self, "input_slices", []):
      j = self.mesh.coord(d, axis)
      if j == 0:
        continue
      coords = self.mesh.coords(d)
      coords[axis] = j - 1
      prev = self.mesh.device_id(coords)
      deps = sorted({parse_input(m[prev])[0] for m in self.local_members if prev in m})
      node = by_name[slice_name]
      added.append((node, len(node.input)))
      node.input.extend("^" + t for t in deps)
    try:
      Graph(self.out).topological_order()
    except GraphValidationError as e:
      # A gradient contribution that itself needs every micro-batch (a batch
      # statistic): run micro-batches unordered rather than deadlock.
      logging.warning("micro-batches left unordered (ordering would make a cycle: %s)",
                      str(e)[:200])
      for node, n in added:
        del node.input[n:]

  def run(self):
    outputs = graph_outputs(self.graph)
    for name in self.prop.order:
      node = self.graph.node(name)
      if name in self.variables:
        self._variable(node)
      elif node.op == "Placeholder" and variables_lib.INPUT_INDEX_ATTR in node.attr or (
          node.op == "Placeholder" and node.attr["dtype"].type != types_pb2.DT_RESOURCE):
        self._input(node)
      else:
        self._op(node)
    # Reductions of the outputs come after the update ops (a train step's loss
    # waits for them): they must not order micro-batches.
    self._record_members = False
    for name in outputs:
      self._output(name)
    if self.pp is None:  # a pipeline schedule orders micro-batches instead
      self._order_microbatches()
    return self.out

  def _output(self, name):
    """The original output name, on device 0, whole, after every device's copy."""
    node = self.graph.node(name)
    info = self.shapes[name][0]
    whole = Sharding.replicated(len(info.shape)) if info.shape is not None else None
    local, spec = self.source(name, 0, name)
    if spec is not None and whole is not None and spec != whole:
      local = self.reshard(name, 0, spec, whole, name)
    # Every device's whole copy, so a check can compare each of them.
    seen = {}
    for d in self.ids_for(name):
      seen.setdefault(local[d], d)
    self.output_copies[name] = [[self.mesh.devices[d], t]
                                for d, t in sorted((d, t) for t, d in seen.items())]
    # Control inputs from every device's copy: a collective member that no
    # fetched node depends on is pruned, and its peers would wait forever.
    out = node_def_pb2.NodeDef(name=name, op="Identity", device=self.mesh.devices[0],
                               input=[local[0]] + [
                                   "^" + parse_input(t)[0]
                                   for t in sorted(set(local[1:]) - {local[0]})])
    out.attr["T"].type = info.dtype
    if variables_lib.OUTPUT_INDEX_ATTR in node.attr:
      out.attr[variables_lib.OUTPUT_INDEX_ATTR].CopyFrom(
          node.attr[variables_lib.OUTPUT_INDEX_ATTR])
    # The output name was used by the original node's copies' prefix only.
    self.add(out)
