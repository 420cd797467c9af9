"""Per-op cost of a GraphDef: FLOPs and bytes moved, turned into seconds.

Every node gets a NodeCost: FLOPs (tfsplit.graph.flops: exact for MatMul,
BatchMatMul, Einsum and convolutions, per element for elementwise math),
bytes read and written (from the ShapeMap; views such as Reshape or
ReadVariableOp move nothing), and, for collectives and _Send/_Recv, the kind
of communication, its bytes and its group size.

CostModel turns that into time on a device of a ClusterSpec:

  compute op     overhead + factor * max(flops / peak_flops(dtype),
                                         bytes / memory_bandwidth)
  collective     the alpha-beta time of tfsplit.cost.collectives

A CostTable (written by `tfsplit calibrate`) holds times measured on a real
machine. A measured entry for the node's op and shapes wins over the model;
otherwise the table's per-op-type efficiency factor and per-op overhead
correct the roofline (Alpa's rule: measured costs override analytic ones).
"""
import dataclasses
import json
import statistics

from tfsplit.cost import collectives
from tfsplit.errors import ClusterSpecError, CostTableError
from tfsplit.fileio import write_atomically
from tfsplit.graph.flops import op_flops

TABLE_VERSION = 1

# Ops whose outputs alias an input buffer (or a variable): no bytes move and
# nothing is allocated.
VIEW_OPS = frozenset([
    "Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
    "ReadVariableOp", "EnsureShape", "PreventGradient", "CheckNumerics",
    "Bitcast", "Snapshot"])
# Ops that produce no tensor work at run time (their outputs are static or
# bookkeeping): only the per-op overhead is charged.
METADATA_OPS = frozenset([
    "Const", "Placeholder", "PlaceholderWithDefault", "VarHandleOp", "NoOp",
    "Shape", "ShapeN", "Size", "Rank", "BroadcastGradientArgs", "_Arg",
    "_Retval"])
# Ops whose output may take over an input's buffer when that input has no
# other reader (TF's forward_input_or_allocate_output): cwise math, BiasAdd,
# Relu and friends, AddN.
FORWARDING_OPS = frozenset([
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum",
    "Minimum", "SquaredDifference", "Pow", "Neg", "Square", "Sqrt", "Rsqrt",
    "Exp", "Log", "Log1p", "Tanh", "Sigmoid", "Erf", "Erfc", "Abs", "Sign",
    "Reciprocal", "Relu", "Relu6", "Elu", "Selu", "Gelu", "ReluGrad",
    "TanhGrad", "SigmoidGrad", "RsqrtGrad", "SqrtGrad", "BiasAdd", "AddN",
    "Softmax", "LogSoftmax", "SelectV2", "Select", "ZerosLike", "OnesLike",
    "FloorMod", "FloorDiv", "Floor", "Ceil", "Round", "Cos", "Sin"])
_INT_DTYPES = frozenset(["int8", "uint8", "int16", "uint16", "int32", "uint32",
                         "int64", "uint64", "bool"])
# Attrs that change an op's work for the same shapes; part of the signature.
_SIGNATURE_ATTRS = ("transpose_a", "transpose_b", "adj_x", "adj_y", "equation",
                    "data_format", "strides", "padding", "axis", "perm")


@dataclasses.dataclass(frozen=True)
class NodeCost:
  """What one node does: arithmetic, memory traffic, communication."""
  name: str
  op: str
  flops: int = 0
  bytes_read: int = 0
  bytes_written: int = 0
  dtype: str = "float32"
  comm: str = None          # a value of collectives.OP_COLLECTIVE, or None
  comm_bytes: int = 0
  group_size: int = 1

  @property
  def bytes_moved(self):
    return self.bytes_read + self.bytes_written


def _tensor_bytes(shapes, text):
  info = shapes.get(text)
  if info is None:
    return 0
  return info.num_bytes or 0


def _out_bytes(shapes, name):
  if name not in shapes:
    return 0
  return sum(i.num_bytes or 0 for i in shapes[name])


def _dtype_name(node, shapes):
  for key in ("T", "dtype"):
    if key in node.attr and node.attr[key].type:
      from tensorflow.python.framework import dtypes  # pylint: disable=import-outside-toplevel
      return dtypes.as_dtype(node.attr[key].type).name
  outs = shapes[node.name] if node.name in shapes else []
  for info in outs:
    if info.dtype:
      return info.dtype_name
  return "float32"


def _itemsize(dtype):
  return {"float64": 8, "int64": 8, "complex64": 8, "float16": 2,
          "bfloat16": 2, "int16": 2, "int8": 1, "uint8": 1,
          "bool": 1}.get(dtype, 4)


def const_int(graph, text):
  """The integer value of a scalar Const feeding `text`, or None."""
  if graph is None:
    return None
  node = graph.get(text.lstrip("^").split(":")[0])
  while node is not None and node.op == "Identity" and node.input:
    node = graph.get(node.input[0].split(":")[0])
  if node is None or node.op != "Const":
    return None
  tensor = node.attr["value"].tensor
  if tensor.int_val:
    return int(tensor.int_val[0])
  if tensor.int64_val:
    return int(tensor.int64_val[0])
  if tensor.tensor_content:
    import numpy as np  # pylint: disable=import-outside-toplevel
    dtype = np.int64 if tensor.dtype == 9 else np.int32
    values = np.frombuffer(tensor.tensor_content, dtype=dtype)
    return int(values[0]) if values.size else None
  return None


def group_size(node, graph=None):
  """Members of a collective: its group_size attr (V1) or input 1 (V2+)."""
  if "group_size" in node.attr:
    return max(1, node.attr["group_size"].i)
  data = [t for t in node.input if not t.startswith("^")]
  if len(data) > 1:
    value = const_int(graph, data[1])
    if value:
      return value
  return 1


def node_cost(node, shapes, graph=None):
  """NodeCost of one NodeDef; `graph` (a tfsplit Graph) resolves group sizes."""
  op = node.op
  data = [t for t in node.input if not t.startswith("^")]
  written = _out_bytes(shapes, node.name)
  dtype = _dtype_name(node, shapes)
  kind = collectives.OP_COLLECTIVE.get(op)
  if kind is not None:
    if op in ("_Recv", "_HostRecv"):
      nbytes = written
    elif kind in ("all_gather",):
      nbytes = written
    else:
      nbytes = _tensor_bytes(shapes, data[0]) if data else 0
    size = 2 if kind == "send_recv" else group_size(node, graph)
    return NodeCost(node.name, op, 0, nbytes if data else 0, written, dtype,
                    kind, nbytes, size)
  if op in VIEW_OPS or op in METADATA_OPS:
    return NodeCost(node.name, op, 0, 0, 0, dtype)
  flops = op_flops(node, shapes)
  if op.startswith(("ResourceApply", "ResourceSparseApply")):
    # Reads every state tensor and the gradient, writes the state back.
    grad = _tensor_bytes(shapes, data[-1]) if data else 0
    states = sum(1 for t in data if (shapes.get(t) is not None and
                                     shapes.get(t).dtype == 20))  # DT_RESOURCE
    elements = grad // _itemsize(dtype)
    return NodeCost(node.name, op, 5 * max(states, 1) * elements,
                    (states + 1) * grad, states * grad, dtype)
  if op in ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"):
    value = _tensor_bytes(shapes, data[1]) if len(data) > 1 else 0
    reads = value if op == "AssignVariableOp" else 2 * value
    adds = 0 if op == "AssignVariableOp" else value // _itemsize(dtype)
    return NodeCost(node.name, op, adds, reads, value, dtype)
  read = 0
  for t in data:
    info = shapes.get(t)
    if info is not None and info.dtype != 20:
      read += info.num_bytes or 0
  if op in ("ResourceGather", "Gather", "GatherV2"):
    # Only the gathered rows are read, not the whole table.
    read = written + (_tensor_bytes(shapes, data[1]) if len(data) > 1 else 0)
  return NodeCost(node.name, op, flops, read, written, dtype)


def _shape_text(info):
  if info is None or info.shape is None:
    return "?"
  return "[" + ",".join("?" if d is None else str(d) for d in info.shape) + "]"


def signature(node, shapes):
  """'op|dtype|input shapes|output shapes|attrs': the key of a measured cost.

  Two nodes with the same signature do the same work, so one measurement
  serves both (the layers of a model repeat their signatures).
  """
  ins = []
  for t in node.input:
    if t.startswith("^"):
      continue
    info = shapes.get(t)
    ins.append(_shape_text(info))
  outs = [_shape_text(i) for i in (shapes[node.name] if node.name in shapes
                                   else [])]
  attrs = []
  for key in _SIGNATURE_ATTRS:
    if key in node.attr:
      value = node.attr[key]
      which = value.WhichOneof("value")
      if which == "b":
        attrs.append(f"{key}={int(value.b)}")
      elif which == "s":
        attrs.append(f"{key}={value.s.decode(errors='replace')}")
      elif which == "i":
        attrs.append(f"{key}={value.i}")
      elif which == "list":
        attrs.append(f"{key}={list(value.list.i)}")
  dtype = _dtype_name(node, shapes)
  return "|".join([node.op, dtype, ",".join(ins), ",".join(outs),
                   ",".join(attrs)])


@dataclasses.dataclass
class CostTable:
  """Measured op costs of one machine (see `tfsplit calibrate`).

  entries: signature -> seconds (the median of the runs measured).
  op_factor: op type -> measured / roofline time, for shapes not measured.
  default_factor: the factor for op types never measured.
  op_overhead: seconds every op that runs costs on top of its kernel (the
    executor's dispatch gap between ops).
  time_scale: untraced / traced kernel time; profiling slows each kernel a
    little, this takes it back out.
  step_overhead: seconds every step costs before its first op (launch).
  flops / bandwidth: the machine's measured best MatMul FLOP/s and copy
    bytes/s; the roofline of a calibrated device uses these.
  """
  entries: dict = dataclasses.field(default_factory=dict)
  op_factor: dict = dataclasses.field(default_factory=dict)
  default_factor: float = 1.0
  op_overhead: float = 0.0
  time_scale: float = 1.0
  step_overhead: float = 0.0
  flops: float = None
  bandwidth: float = None
  machine: dict = dataclasses.field(default_factory=dict)

  def lookup(self, sig):
    """Seconds for a measured signature (None if not measured).

    A 0 entry is an op Grappler fused away or folded: it costs nothing.
    """
    value = self.entries.get(sig)
    if value is None:
      return None
    return value * self.time_scale + self.op_overhead if value else 0.0

  def to_json(self):
    return {"version": TABLE_VERSION, "machine": self.machine,
            "flops": self.flops, "bandwidth": self.bandwidth,
            "op_overhead": self.op_overhead, "time_scale": self.time_scale,
            "step_overhead": self.step_overhead,
            "default_factor": self.default_factor,
            "op_factor": dict(sorted(self.op_factor.items())),
            "entries": dict(sorted(self.entries.items()))}

  def save(self, path):
    """Writes the table as JSON atomically (temp file, then rename)."""
    write_atomically(path, json.dumps(self.to_json(), indent=1) + "\n")

  @classmethod
  def load(cls, path):
    try:
      with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    except FileNotFoundError:
      raise CostTableError(f"calibration table '{path}' does not exist; write "
                           "one with 'tfsplit calibrate -o FILE'") from None
    except (OSError, ValueError) as e:
      raise CostTableError(f"cannot read calibration table '{path}': {e}; it "
                           "must be the JSON 'tfsplit calibrate' writes") \
          from None
    if not isinstance(obj, dict) or obj.get("version") != TABLE_VERSION:
      raise CostTableError(f"calibration table '{path}': not a version "
                           f"{TABLE_VERSION} table; rerun 'tfsplit calibrate'")
    try:
      return cls(entries={str(k): float(v) for k, v in obj["entries"].items()},
                 op_factor={str(k): float(v)
                            for k, v in obj["op_factor"].items()},
                 default_factor=float(obj["default_factor"]),
                 op_overhead=float(obj["op_overhead"]),
                 time_scale=float(obj["time_scale"]),
                 step_overhead=float(obj.get("step_overhead", 0.0)),
                 flops=obj.get("flops"), bandwidth=obj.get("bandwidth"),
                 machine=dict(obj.get("machine") or {}))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
      raise CostTableError(f"calibration table '{path}': malformed ({e}); "
                           "rerun 'tfsplit calibrate'") from None

  def fit_factors(self, costs):
    """Sets op_factor / default_factor from measured entries.

    costs: signature -> (op, roofline seconds) for the measured signatures.
    """
    by_op = {}
    for sig, seconds in self.entries.items():
      if sig not in costs:
        continue
      op, roof = costs[sig]
      if roof <= 0:
        continue
      work = max(seconds * self.time_scale - self.op_overhead, 0.0)
      by_op.setdefault(op, []).append(work / roof)
    self.op_factor = {op: statistics.median(v) for op, v in by_op.items()}
    if self.op_factor:
      self.default_factor = statistics.median(self.op_factor.values())


class CostModel:
  """Seconds for nodes and collectives on the devices of a ClusterSpec."""

  def __init__(self, cluster, table=None, op_overhead=None):
    self.cluster = cluster
    self.table = table
    if op_overhead is None:
      op_overhead = table.op_overhead if table is not None else 0.0
    self.op_overhead = op_overhead
    self.measured = 0   # nodes priced from the table's entries
    self.modelled = 0   # nodes priced by the roofline

  def _peak(self, device, dtype):
    if self.table is not None and self.table.flops:
      return self.table.flops
    dev = self.cluster.device(device)
    try:
      return dev.flops(dtype)
    except ClusterSpecError:
      if dtype in _INT_DTYPES or "float32" in dev.peak_flops:
        return dev.flops("float32") if "float32" in dev.peak_flops else \
            max(dev.peak_flops.values())
      raise

  def roofline(self, cost, device=0):
    """max(compute time, memory time) at peak, no overhead."""
    if not cost.flops and not cost.bytes_moved:
      return 0.0
    bandwidth = (self.table.bandwidth if self.table is not None and
                 self.table.bandwidth else
                 self.cluster.device(device).memory_bandwidth)
    compute = cost.flops / self._peak(device, cost.dtype) if cost.flops else 0
    return max(compute, cost.bytes_moved / bandwidth)

  def compute_time(self, cost, device=0, sig=None):
    """Seconds of a non-communication node on `device`."""
    if self.table is not None and sig is not None:
      measured = self.table.lookup(sig)
      if measured is not None:
        self.measured += 1
        return measured
    self.modelled += 1
    roof = self.roofline(cost, device)
    if self.table is None:
      return self.op_overhead + roof
    factor = self.table.op_factor.get(cost.op, self.table.default_factor)
    return self.op_overhead + factor * roof

  def comm_time(self, kind, group, nbytes):
    """Seconds of collective `kind` over device indices `group`."""
    if not nbytes:
      return 0.0
    return collectives.collective_time(kind, self.cluster, group, nbytes)


def graph_costs(graph, shapes):
  """{node name: NodeCost} for every node of a tfsplit Graph."""
  return {n.name: node_cost(n, shapes, graph) for n in graph.nodes}


def total(costs):
  """(flops, bytes moved) summed over NodeCosts."""
  flops = sum(c.flops for c in costs)
  moved = sum(c.bytes_moved for c in costs)
  return flops, moved

