"""The per-device GraphDef under construction, and what it records per node.

Every node a split adds goes through `DeviceGraph.add`, which keeps names
unique and records, for each local copy, the original node it copies, its
logical device and whether it serves every micro-batch. Later passes
(schedules, micro-batch order, the Session runner) read those records instead
of parsing node names.

The nodes themselves (ops, constants, collectives and the copies of a
collective that gradient buckets make) are made by `NodeMaker`, under names
new in the graph; a DeviceGraph adds what its maker makes, and a pass that
assembles a graph of its own (one task's part, sharding/tasks.py) uses a
maker alone.

The records also travel inside the GraphDef, as private attrs on each node
(written as nodes are added, or by `stamp_records`; read by `read_records`),
so a rewritten graph read back from a file still says which original node and
device each of its nodes serves.

Names: the copy of node `n` on logical device d is `n/shard_d`; a variable
`v`'s shard on device d is the variable `v/shard_d`.
"""
import dataclasses
import functools
from typing import Optional

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.core.framework import node_def_pb2
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import tensor_util

from tfsplit.graph import variables as variables_lib
from tfsplit.graph.ir import delete_positions
from tfsplit.sharding.collectives import collective_node


@dataclasses.dataclass(frozen=True)
class NodeRecord:
  source: str                # the original node this node was made for
  device_id: Optional[int]   # its logical device in the mesh (None: not device-local)
  shared: bool = False       # serves every micro-batch (not part of one)


SOURCE_ATTR = "_tfsplit_source"
DEVICE_ID_ATTR = "_tfsplit_device_id"
SHARED_ATTR = "_tfsplit_shared"
RECORD_ATTRS = (SOURCE_ATTR, DEVICE_ID_ATTR, SHARED_ATTR)   # a node's record, all of it


def stamp_records(graph_def, records):
  """Writes each node's record into its attrs (in place)."""
  for node in graph_def.node:
    record = records.get(node.name)
    if record is None or record.device_id is None:
      continue
    node.attr[SOURCE_ATTR].s = record.source.encode()
    node.attr[DEVICE_ID_ATTR].i = record.device_id
    if record.shared:
      node.attr[SHARED_ATTR].b = True


def _stamp(node, source, device_id, shared=False):
  """stamp_records for one node as it is added (`shared` may come later)."""
  if device_id is not None:
    node.attr[SOURCE_ATTR].s = source.encode()
    node.attr[DEVICE_ID_ATTR].i = device_id
    if shared:
      node.attr[SHARED_ATTR].b = True


def read_records(graph_def):
  """{node: NodeRecord} from the attrs stamp_records wrote."""
  return {n.name: NodeRecord(n.attr[SOURCE_ATTR].s.decode(), n.attr[DEVICE_ID_ATTR].i,
                             SHARED_ATTR in n.attr and n.attr[SHARED_ATTR].b)
          for n in graph_def.node if SOURCE_ATTR in n.attr}


def unique_name(names, base):
  """`base`, or `base_i` for the first i making it new in `names` (added to it)."""
  name, i = base, 0
  while name in names:
    i += 1
    name = f"{base}_{i}"
  names.add(name)
  return name


def local_name(name, device_id):
  return f"{name}/shard_{device_id}"


def shard_variable_name(var_name, device_id):
  return f"{var_name}/shard_{device_id}"


def shard_variable_node(node, name, device, shard_name, local_shape):
  """A copy of variable node `node` (VarHandleOp or a captured-variable
  Placeholder) that holds shard `shard_name` of `local_shape` on `device`."""
  new = node_def_pb2.NodeDef()
  new.CopyFrom(node)
  new.name, new.device = name, device
  if "_class" in new.attr:
    del new.attr["_class"]
  if node.op == "VarHandleOp":
    new.attr["shared_name"].s = shard_name.encode()
    new.attr["shape"].CopyFrom(variables_lib.make_shape_attr(local_shape))
  else:
    new.attr[variables_lib.VAR_NAME_ATTR].s = shard_name.encode()
    new.attr[variables_lib.VAR_SHAPE_ATTR].CopyFrom(variables_lib.make_shape_attr(local_shape))
  return new


def tensor(name, port):
  return name if port == 0 else f"{name}:{port}"


def safe_axis(axis):
  """Axis names in node names ('dp*mb' is not a valid node-name character)."""
  return axis.replace("*", "_x_")


_PLAIN_CONST_ATTRS = frozenset(("dtype", "value") + RECORD_ATTRS)


def constant_key(node):
  """What makes Const `node` the same value as another on its device: its
  attrs, the per-node records aside."""
  attr = node.attr
  if _PLAIN_CONST_ATTRS.issuperset(attr):  # the usual Const: dtype and value say it all
    return (attr["dtype"].type, attr["value"].tensor.SerializeToString())
  return tuple((k, attr[k].SerializeToString(deterministic=True))
               for k in sorted(attr) if k not in RECORD_ATTRS)


def const_node(name, value, device):
  value = np.asarray(value)
  node = node_def_pb2.NodeDef(name=name, op="Const", device=device)
  node.attr["dtype"].type = tf.as_dtype(value.dtype).as_datatype_enum
  node.attr["value"].tensor.CopyFrom(_tensor_proto(value))
  return node


_CACHED_ELEMENTS = 64  # local shapes, sizes and axes: the same few on every device


def _tensor_proto(value):
  """make_tensor_proto(value); small numeric values made once (TF's maker
  costs more than the copy, and a split makes the same ones many times)."""
  if value.dtype.kind not in "biufc" or value.size > _CACHED_ELEMENTS:
    return tensor_util.make_tensor_proto(value)
  return _cached_tensor_proto(value.dtype.str, value.shape, value.tobytes())


@functools.lru_cache(maxsize=4096)
def _cached_tensor_proto(dtype, shape, data):
  """Read-only by convention: callers copy it (CopyFrom)."""
  return tensor_util.make_tensor_proto(np.frombuffer(data, np.dtype(dtype)).reshape(shape))


def set_attrs(node, attrs):
  """Sets `attrs` on NodeDef `node`, in order: {name: a DType, a bool or an int}."""
  for name, value in attrs.items():
    if isinstance(value, tf.DType):
      node.attr[name].type = value.as_datatype_enum
    elif isinstance(value, bool):
      node.attr[name].b = value
    else:
      node.attr[name].i = value


def redefine(node, op, inputs, attrs):
  """NodeDef `node` made an `op` over `inputs` in place: its name, device and
  private (`_tfsplit`) attrs stay, its other attrs become `attrs` (as
  set_attrs takes them). Its consumers and records stay valid."""
  node.op = op
  for attr in [a for a in node.attr if not a.startswith("_tfsplit")]:
    del node.attr[attr]
  set_attrs(node, attrs)
  del node.input[:]
  node.input.extend(inputs)


class NodeMaker(object):
  """Makes the NodeDefs a split adds, each under a name new in `names` (a
  set, which it extends): ops, constants and collectives. It adds them to
  no graph; DeviceGraph does."""

  def __init__(self, names):
    self.names = names

  def unique(self, base):
    return unique_name(self.names, base)

  def node(self, base, op, device, inputs, attrs):
    """A new `op` node named after `base` over `inputs`; `attrs` as
    set_attrs takes them."""
    node = node_def_pb2.NodeDef(name=self.unique(base), op=op, device=device, input=inputs)
    set_attrs(node, attrs)
    return node

  def const(self, base, value, device):
    """A new Const of numpy `value` (its dtype) named after `base`."""
    return const_node(self.unique(base), value, device)

  def int_val_const(self, base, value, device):
    """A new int32 Const (a scalar or a list), its values written as
    int_val, without make_tensor_proto: the same tensor to TF as an int32
    `const`'s, in the form gradient buckets write (a few per member)."""
    node = node_def_pb2.NodeDef(name=self.unique(base), op="Const", device=device)
    node.attr["dtype"].type = types_pb2.DT_INT32
    proto = node.attr["value"].tensor
    proto.dtype = types_pb2.DT_INT32
    values = [int(v) for v in np.atleast_1d(value)]
    if np.ndim(value):
      proto.tensor_shape.dim.add().size = len(values)
    proto.int_val.extend(values)
    return node

  def collective(self, op, base, device, inputs, dtype_enum, timeout_seconds=None):
    """A new collective `op` (TF's template, sharding/collectives.py) named
    after `base`; `inputs` = [tensor, group_size, group_key, instance_key]
    (a broadcast's receiver: [group_size, group_key, instance_key, shape])."""
    return collective_node(op, self.unique(base), device, inputs, dtype_enum, timeout_seconds)

  def collective_copy(self, member, base, inputs, dtype=None):
    """A copy of collective node `member` (its op, device and attrs, not its
    private `_tfsplit` ones) named after `base` over `inputs`, carrying
    `dtype` (a DType) if given."""
    node = node_def_pb2.NodeDef()
    node.CopyFrom(member)
    node.name = self.unique(base)
    del node.input[:]
    node.input.extend(inputs)
    for attr in [a for a in node.attr if a.startswith("_tfsplit")]:
      del node.attr[attr]
    if dtype is not None:
      node.attr["T"].type = dtype.as_datatype_enum
    return node


class DeviceGraph(object):
  """A GraphDef being built: unique names, per-node records."""

  def __init__(self, versions, library):
    graph_def = graph_pb2.GraphDef()
    graph_def.versions.CopyFrom(versions)
    graph_def.library.CopyFrom(library)
    self._attach(graph_def, {})

  @classmethod
  def extending(cls, graph_def, records):
    """A DeviceGraph adding to `graph_def` in place (a pass after
    materialization): its nodes' names are taken and its nodes are in
    `created`; records of new nodes go into `records`, the graph's own."""
    builder = cls.__new__(cls)
    builder._attach(graph_def, records)
    return builder

  def _attach(self, graph_def, records):
    self.graph_def = graph_def
    self.created = {n.name: n for n in graph_def.node}   # name -> the NodeDef in graph_def
    self.names = set(self.created)
    self.records = records   # name -> NodeRecord
    self.make = NodeMaker(self.names)

  def unique(self, base):
    return self.make.unique(base)

  def add(self, node, source=None, device_id=None, shared=False):
    """Adds a copy of `node`; records it as made for `source` on `device_id`
    (serving every micro-batch if `shared`)."""
    self.names.add(node.name)
    added = self.graph_def.node.add()
    added.CopyFrom(node)
    self.created[node.name] = added
    if source is not None:
      self.records[node.name] = NodeRecord(source, device_id, shared)
      _stamp(added, source, device_id, shared)
    return added

  def op(self, base, op, device, inputs, attrs, source=None, device_id=None, shared=False):
    """Name of a new `op` node named after `base` over `inputs`, recorded as
    `add` does; `attrs` in order: {name: a DType, a bool or an int}."""
    return self.add(self.make.node(base, op, device, inputs, attrs), source, device_id,
                    shared).name

  def collective_copy(self, member, base, inputs, dtype=None, source=None, device_id=None,
                      shared=False):
    """The added node of a copy of collective node `member` over `inputs`
    (NodeMaker.collective_copy), recorded as `add` does."""
    return self.add(self.make.collective_copy(member, base, inputs, dtype), source,
                    device_id, shared)

  def remove(self, names):
    """Deletes the nodes named in the set `names`, and their records."""
    delete_positions(self.graph_def, [i for i, n in enumerate(self.graph_def.node)
                                      if n.name in names])
    for name in names:
      self.created.pop(name, None)
      self.records.pop(name, None)

  def add_copy(self, node, name, device, source, device_id):
    """Adds a copy of `node` named `name` on `device`, recorded as made for
    `source` on `device_id`; returns the added NodeDef, to finish in place."""
    self.names.add(name)
    added = self.graph_def.node.add()
    added.CopyFrom(node)
    added.name, added.device = name, device
    self.created[name] = added
    self.records[name] = NodeRecord(source, device_id)
    _stamp(added, source, device_id)
    return added

  def mark_shared(self, name):
    record = self.records.get(name)
    self.records[name] = dataclasses.replace(record, shared=True) if record else \
        NodeRecord(name, None, True)
    if record is not None and record.device_id is not None and name in self.created:
      self.created[name].attr[SHARED_ATTR].b = True

  def is_shared(self, name):
    record = self.records.get(name)
    return bool(record and record.shared)

  def int_const(self, base, value, device):
    """Name of a new int32 Const on `device`."""
    return self.add(self.make.const(base, np.asarray(value, np.int32), device)).name

  def int_val_const(self, base, value, device):
    """Name of a new int32 Const on `device` (a scalar or a list), written
    as NodeMaker.int_val_const writes it."""
    return self.add(self.make.int_val_const(base, value, device)).name

  def _shaping(self, op, index_attr, x, operand, base, device, dtype):
    """`op`(x, int32 Const operand): a Transpose or a Reshape."""
    operand_name = self.int_const(f"{base}/{index_attr.lower()}", list(operand), device)
    return self.op(base, op, device, [x, operand_name],
                   {"T": tf.as_dtype(dtype), index_attr: tf.int32})

  def cast(self, x, src_dtype, dst_dtype, base, device):
    """Name of a new Cast of `x` (DataType enums), Truncate false."""
    return self.op(base, "Cast", device, [x], {"SrcT": tf.as_dtype(src_dtype),
                                               "DstT": tf.as_dtype(dst_dtype),
                                               "Truncate": False})

  def transpose(self, x, perm, base, device, dtype):
    return self._shaping("Transpose", "Tperm", x, perm, base, device, dtype)

  def reshape(self, x, shape, base, device, dtype):
    return self._shaping("Reshape", "Tshape", x, shape, base, device, dtype)
