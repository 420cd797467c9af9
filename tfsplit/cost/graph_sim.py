"""Simulate a (rewritten) GraphDef over its devices: time and memory per device.

The graph becomes a TaskGraph (tfsplit.cost.simulator):

- every node that does work is a task on its device's compute stream, priced
  by a CostModel, in topological order (which is also its priority, as TF's
  executor runs ready ops roughly in graph order);
- placement comes from `node.device`: each distinct device string maps to a
  cluster device index (given, or in sorted order), an empty device is 0;
- a data edge between devices becomes a transfer task on the link between
  the two devices (alpha-beta), once per tensor and destination; the copy is
  allocated on the destination;
- the members of one collective instance (same op, group key, instance key)
  wait for one task on their group's link, priced with the alpha-beta model;
  _Send/_Recv pairs (same tensor_name, send and recv device) likewise;
- control edges order tasks and hold no memory.

Memory: variables, constants and fed inputs are static (held all step); every
other output is allocated when its op starts and freed when its last reader
ends. Views (Reshape, Identity, ReadVariableOp, ...) allocate nothing and
keep their source alive; an elementwise op whose input has no other reader
takes over that input's buffer, as TF's forward_input_or_allocate_output
does. Allocations are rounded up to the allocator's 256-byte granularity.
"""
import collections
import dataclasses
import re
import time

from absl import logging

from tfsplit.cost import collectives
from tfsplit.cost import op_cost
from tfsplit.cost.simulator import TaskGraph
from tfsplit.errors import PlanError
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.ir import Graph, parse_input
from tfsplit.memory import graph_memory

_NO_TASK_OPS = frozenset(["Const", "Placeholder", "VarHandleOp", "_Arg"])
_RECV_OPS = frozenset(["_Recv", "_HostRecv"])
_SEND_OPS = frozenset(["_Send", "_HostSend"])
_ROLE_KIND = {"forward": "forward", "backward": "backward",
              "update": "optimizer"}


def _natural_key(text):
  return [int(p) if p.isdigit() else p.lower()
          for p in re.split(r"(\d+)", text)]


def device_names(graph):
  """Distinct non-empty device strings of `graph`, in natural sorted order."""
  return sorted({n.device for n in graph.nodes if n.device}, key=_natural_key)


def device_indices(graph, mapping=None):
  """(node name -> device index, index -> device name).

  mapping: device string -> cluster device index; by default the distinct
  device strings in natural order (CPU:2 before CPU:10). An empty device is
  device 0.
  """
  names = device_names(graph)
  if mapping is None:
    mapping = {name: i for i, name in enumerate(names)}
  else:
    missing = [n for n in names if n not in mapping]
    if missing:
      raise PlanError(f"device '{missing[0]}' of the graph is not in the "
                      "device mapping; map every device string to a cluster "
                      "device index")
  count = max(list(mapping.values()) + [0]) + 1
  labels = [f"device {i}" for i in range(count)]
  for name, i in mapping.items():
    if labels[i].startswith("device "):
      labels[i] = name
  device_of = {n.name: mapping[n.device] if n.device else 0
               for n in graph.nodes}
  return device_of, labels


def place_by_layers(graph_def, num_devices, device_fn=None, report=None):
  """A copy of `graph_def` with each layer on one device, in layer order.

  Layers with parameters (their forward, backward and update ops, and their
  variables) are cut into `num_devices` contiguous runs, so parameter layer
  i of L goes to device i * num_devices // L: a pipeline-style placement
  for benchmarks.
  device_fn(i) gives device i's string (default '/device:CPU:i').
  """
  from tfsplit.graph.layers import OPTIMIZER_LAYER, detect_layers  # pylint: disable=import-outside-toplevel
  from tensorflow.core.framework import graph_pb2  # pylint: disable=import-outside-toplevel
  if num_devices < 1:
    raise PlanError(f"place_by_layers needs at least 1 device, got "
                    f"{num_devices}")
  device_fn = device_fn or (lambda i: f"/device:CPU:{i}")
  out = graph_pb2.GraphDef()
  out.CopyFrom(graph_def)
  graph = Graph(out)
  if report is None:
    report = detect_layers(graph)
  layers = sorted(report.layers, key=lambda l: l.index)
  model = [l for l in layers if l.variables]
  where = {l.name: i * num_devices // len(model) for i, l in enumerate(model)}
  # Layers without parameters (the loss, reshapes between blocks) go with
  # the parameter layer before them; shared optimizer ops with device 0.
  current = where[model[0].name] if model else 0
  for layer in layers:
    if layer.name in where:
      current = where[layer.name]
    elif layer.name != OPTIMIZER_LAYER:
      where[layer.name] = current
  names = [device_fn(i) for i in range(num_devices)]
  for node in graph.nodes:
    node.device = names[where.get(report.layer_of.get(node.name), 0)]
  return out


@dataclasses.dataclass
class GraphSimResult:
  """A simulated step of a graph: the SimResult plus graph-level reports."""
  sim: object                       # SimResult
  device_names: list
  memory: list                      # [DeviceMemory] per device
  task_of: dict                     # node name -> task id (None: no task)
  transfers: int
  collectives: int
  build_seconds: float
  simulate_seconds: float
  measured_ops: int = 0
  modelled_ops: int = 0

  @property
  def step_time(self):
    return self.sim.step_time

  @property
  def shared_peak(self):
    """Peak bytes summed over all devices at each instant: what one allocator
    serving every device (one process's logical CPU devices) reaches."""
    return self.sim.shared_peak()

  def summary(self):
    rows = self.sim.device_summary()
    for row, mem in zip(rows, self.memory):
      row["memory"] = mem.as_dict()
    return {"step_time": self.sim.step_time, "tasks": len(self.sim.graph),
            "transfers": self.transfers, "collectives": self.collectives,
            "comm_time": self.sim.comm_time,
            "measured_ops": self.measured_ops,
            "modelled_ops": self.modelled_ops,
            "simulate_seconds": self.simulate_seconds,
            "devices": rows}


def _collective_key(node, graph):
  if "instance_key" in node.attr:
    return (node.op, node.attr["group_key"].i, node.attr["instance_key"].i)
  data = [t for t in node.input if not t.startswith("^")]
  group = op_cost.const_int(graph, data[2]) if len(data) > 2 else None
  instance = op_cost.const_int(graph, data[3]) if len(data) > 3 else None
  if group is None or instance is None:
    return (node.op, node.name)  # unresolved: a group of its own
  return (node.op, group, instance)


def _send_key(node):
  a = node.attr
  return (a["tensor_name"].s, a["send_device"].s, a["recv_device"].s,
          a["send_device_incarnation"].i)


class _Builder:
  """Turns one Graph into a TaskGraph; see the module docstring."""

  def __init__(self, graph, shapes, variables, cluster, cost_model,
               device_of, labels, roles, granularity):
    self.graph = graph
    self.shapes = shapes
    self.cost = cost_model
    self.cluster = cluster
    self.device_of = device_of
    self.roles = roles or {}
    self.granularity = granularity
    self.tg = TaskGraph()
    if len(labels) > cluster.num_devices:
      raise PlanError(f"the graph uses {len(labels)} devices but the cluster "
                      f"'{cluster.name}' has {cluster.num_devices}; give a "
                      "bigger cluster or map devices onto fewer indices")
    self.labels = labels
    self.dev = [self.tg.add_device(name) for name in labels]
    self.links = {}
    self.task_of = {}
    self.owner = {}       # (node, port) -> task owning the buffer, or None
    self.uses = collections.Counter()   # owner task -> readers of its buffer
    self.copies = {}      # (node, port, device) -> transfer task
    self.readers = collections.Counter()  # (node, port) -> data readers
    for node in graph.nodes:
      for text in node.input:
        if not text.startswith("^"):
          self.readers[parse_input(text)] += 1
    self.var_nodes = {v.node for v in variables}
    self.transfers = 0
    self.collectives = 0

  # --- resources -------------------------------------------------------------
  def link(self, key, devices, name):
    rid = self.links.get(key)
    if rid is None:
      rid = self.links[key] = self.tg.add_link(name, [self.dev[d] for d in
                                                      devices])
    return rid

  def p2p(self, a, b):
    return self.link(("p2p", a, b), (a, b), f"{self.labels[a]} -> "
                     f"{self.labels[b]}")

  # --- tensors ---------------------------------------------------------------
  def nbytes(self, name, port):
    info = self.shapes.get(f"{name}:{port}")
    return 0 if info is None else (info.num_bytes or 0)

  def read(self, src, port, device):
    """(deps, owner) for reading output `port` of `src` on `device`."""
    task = self.task_of.get(src)
    src_dev = self.device_of.get(src, 0)
    if task is None and (src_dev == device or src in self.var_nodes):
      return [], None  # static (input, constant) or a variable's handle
    owner = self.owner.get((src, port))
    if task is None:
      deps = [self.start] if self.start is not None else []
    else:
      deps = [task] if owner is None or owner == task else [task, owner]
    if src_dev == device:
      return deps, owner
    key = (src, port, device)
    copy = self.copies.get(key)
    if copy is None:
      nbytes = self.nbytes(src, port)
      copy = self.tg.add_task(
          f"copy {src}:{port} -> {self.labels[device]}",
          self.p2p(src_dev, device),
          collectives.send_recv_time(self.cluster, src_dev, device, nbytes),
          deps=deps, kind="comm",
          alloc=graph_memory.round_up(nbytes, self.granularity),
          mem_device=self.dev[device])
      self.copies[key] = copy
      self.uses[copy] = 0
      self.transfers += 1
    self.uses[copy] += 1
    return [copy], copy

  # --- nodes -----------------------------------------------------------------
  def inputs(self, node, device):
    deps, owners = [], []
    for text in node.input:
      if text.startswith("^"):
        continue
      src, port = parse_input(text)
      d, owner = self.read(src, port, device)
      deps.extend(d)
      owners.append((src, port, owner))
    controls = []
    for text in node.input:
      if text.startswith("^"):
        task = self.task_of.get(text[1:])
        if task is not None:
          controls.append(task)
    return list(dict.fromkeys(deps)), controls, owners

  def outputs(self, node, owners):
    """Bytes to allocate and the owner of each output (None: its own)."""
    outs = self.shapes[node.name] if node.name in self.shapes else []
    alias = {}
    if node.op in op_cost.VIEW_OPS:
      for p in range(len(outs)):
        i = p if node.op == "IdentityN" else 0
        if i < len(owners):
          alias[p] = owners[i][2]
          if owners[i][2] is not None:
            self.uses[owners[i][2]] += self.readers[(node.name, p)] - 1
    elif node.op in op_cost.FORWARDING_OPS and outs:
      out_bytes = outs[0].num_bytes
      for src, port, owner in owners[:2]:
        if owner is None or self.uses[owner] != 1 or not out_bytes:
          continue
        info = self.shapes.get(f"{src}:{port}")
        if info is not None and info.num_bytes == out_bytes and \
            info.dtype == outs[0].dtype:
          alias[0] = owner
          self.uses[owner] = self.readers[(node.name, 0)]
          break
    alloc = 0
    for p, info in enumerate(outs):
      if p in alias:
        self.owner[(node.name, p)] = alias[p]
      else:
        alloc += graph_memory.round_up(info.num_bytes or 0, self.granularity)
    return alloc, alias

  def add_node(self, node, index):
    device = self.device_of.get(node.name, 0)
    deps, controls, owners = self.inputs(node, device)
    cost = op_cost.node_cost(node, self.shapes, self.graph)
    if cost.comm is not None and node.op not in _SEND_OPS | _RECV_OPS:
      return self.add_collective_member(node, device, deps, controls, owners,
                                        cost)
    sig = op_cost.signature(node, self.shapes) if self.cost.table else None
    duration = self.cost.compute_time(cost, device, sig)
    resource = self.dev[device]
    if node.op in _RECV_OPS:
      resource, duration = None, 0.0  # waits for its _Send (added later)
    elif node.op in _SEND_OPS:
      dst = self.device_index(node.attr["recv_device"].s.decode(), device)
      resource = self.p2p(device, dst)
      duration = self.cost.comm_time("send_recv", (device, dst),
                                     cost.comm_bytes)
      self.transfers += 1
    alloc, alias = self.outputs(node, owners)
    if not deps and not controls and self.start is not None:
      controls = [self.start]
    task = self.tg.add_task(
        node.name, resource, duration, deps=deps, control_deps=controls,
        kind=self.kind(node), alloc=alloc, mem_device=self.dev[device],
        priority=index)
    self.set_owners(node, task, alias)
    return task

  def device_index(self, name, default):
    for i, label in enumerate(self.labels):
      if label == name:
        return i
    return default

  def set_owners(self, node, task, alias):
    outs = self.shapes[node.name] if node.name in self.shapes else []
    for p in range(len(outs)):
      if p not in alias:
        self.owner[(node.name, p)] = task
        self.uses[task] += self.readers[(node.name, p)]

  def kind(self, node):
    role = self.roles.get(node.name)
    return _ROLE_KIND.get(role, "compute")

  def add_collective_member(self, node, device, deps, controls, owners, cost):
    """A zero-time member task; the collective itself is added in finish()."""
    alloc, alias = self.outputs(node, [])
    task = self.tg.add_task(node.name, None, 0.0, deps=deps,
                            control_deps=controls, kind="comm", alloc=alloc,
                            mem_device=self.dev[device])
    self.set_owners(node, task, alias)
    key = _collective_key(node, self.graph)
    self.pending.setdefault(key, []).append((task, device, deps, controls,
                                             cost))
    return task

  def finish(self):
    """Adds collective tasks and Send->Recv edges (they need every member)."""
    for key, members in self.pending.items():
      devices = [m[1] for m in members]
      cost = members[0][4]
      if len(members) == 1 and cost.group_size > 1:
        n = self.cluster.num_devices
        devices = [(devices[0] + i) % n for i in range(cost.group_size)]
      group = tuple(sorted(set(devices)))
      rid = self.link(("group", group), group,
                      f"collective {','.join(str(d) for d in group)}")
      deps = list(dict.fromkeys(d for m in members for d in m[2]))
      controls = list(dict.fromkeys(c for m in members for c in m[3]))
      nbytes = max(m[4].comm_bytes for m in members)
      task = self.tg.add_task(
          f"{cost.comm} {cost.op} {key[1:]}", rid,
          self.cost.comm_time(cost.comm, list(group), nbytes),
          deps=deps, control_deps=controls, kind="comm")
      for member in members:
        self.tg.add_control_dep(member[0], task)
      self.collectives += 1
    sends = {}
    for node in self.graph.nodes:
      if node.op in _SEND_OPS:
        sends[_send_key(node)] = self.task_of[node.name]
    for node in self.graph.nodes:
      if node.op in _RECV_OPS:
        send = sends.get(_send_key(node))
        if send is None:
          raise PlanError(f"node '{node.name}' (op {node.op}) receives "
                          f"'{node.attr['tensor_name'].s.decode()}', which no "
                          "_Send in the graph sends; simulate the whole "
                          "partitioned graph, not one partition")
        self.tg.add_control_dep(self.task_of[node.name], send)

  def build(self, order):
    self.pending = {}
    table = self.cost.table
    self.start = None
    if table is not None and table.step_overhead:
      # The runtime's fixed cost of launching a step, before any op runs.
      self.start = self.tg.add_task("step launch", None, table.step_overhead,
                                    kind="sync")
    for index, name in enumerate(order):
      node = self.graph.node(name)
      if node.op in _NO_TASK_OPS or name in self.var_nodes:
        self.task_of[name] = None
        continue
      self.task_of[name] = self.add_node(node, index)
    self.finish()
    return self.tg


def simulate_graph(graph, cluster, cost_model=None, shapes=None,
                   variables=None, device_map=None, roles=None,
                   granularity=graph_memory.GRANULARITY):
  """Simulates one step of `graph` (a GraphDef or Graph) on `cluster`.

  cost_model: a CostModel (default: the roofline on `cluster`).
  device_map: device string -> cluster device index (see device_indices).
  roles: node -> 'forward'/'backward'/'update' (LayerReport.role), to label
    tasks in traces. Returns a GraphSimResult.
  """
  t0 = time.perf_counter()
  if not isinstance(graph, Graph):
    graph = Graph(graph)
  if variables is None:
    variables = variables_lib.find_variables(graph)
  if shapes is None:
    from tfsplit.graph.shapes import infer_shapes  # pylint: disable=import-outside-toplevel
    shapes = infer_shapes(graph, variables)
  if cost_model is None:
    cost_model = op_cost.CostModel(cluster)
  device_of, labels = device_indices(graph, device_map)
  builder = _Builder(graph, shapes, variables, cluster, cost_model, device_of,
                     labels, roles, granularity)
  measured0, modelled0 = cost_model.measured, cost_model.modelled
  tg = builder.build(graph.topological_order())
  memory = graph_memory.static_memory(graph, shapes, variables, device_of,
                                      labels, granularity)
  for dev, row in zip(builder.dev, memory):
    tg.set_static_bytes(dev, row.static)
  t1 = time.perf_counter()
  sim = tg.simulate()
  t2 = time.perf_counter()
  for dev, row in zip(builder.dev, memory):
    row.peak = sim.peak_memory[dev]
    row.transient_peak = row.peak - row.static
  logging.info("graph simulation: %d nodes -> %d tasks (%d transfers, %d "
               "collectives); build %.3f s, simulate %.3f s", len(graph),
               len(tg), builder.transfers, builder.collectives, t1 - t0,
               t2 - t1)
  return GraphSimResult(
      sim=sim, device_names=labels, memory=memory, task_of=builder.task_of,
      transfers=builder.transfers, collectives=builder.collectives,
      build_seconds=t1 - t0, simulate_seconds=t2 - t1,
      measured_ops=cost_model.measured - measured0,
      modelled_ops=cost_model.modelled - modelled0)
