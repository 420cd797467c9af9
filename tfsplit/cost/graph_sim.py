"""Simulate a (rewritten) GraphDef over its devices: time and memory per device.

The graph becomes a TaskGraph (tfsplit.cost.simulator):

- every node that does work is a task on its device's compute stream, priced
  by a CostModel; among the ready tasks of a device the one TF's executor
  would run first goes first (executor_order below: the order one inter-op
  thread runs the graph in, which is what decides how long tensors live);
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
What TF prunes from a step before running it (pruned_nodes: nodes that no
output and no stateful op depends on, constants included) is left out: an
unused gradient or a layer's extra output would otherwise hold its inputs
until it ran, which in the executor's order can be the end of the step.

Order (executor_order): TF's executor does not run ready ops in graph order.
With one inter-op thread (how the allocator's peak is measured: with more,
the order and the peak change from step to step), a node that finishes
readies the consumers whose last input it was, in the order of its out
edges. Inexpensive kernels among them (views and metadata: INLINE_OPS) join
the thread's inline queue (first in, first out); of the expensive ones, each
but the last is pushed to the thread pool's queue, and the last runs next on
this thread unless inline work is waiting (then it is pushed too). A worker
pushes to and pops from the front of its own queue (Eigen's thread pool), so
with one thread that queue is a stack: what was pushed first runs last. In a
backward pass the gradient chain runs on inline while the ops readied beside
it are pushed under it; those that wait for nothing else (a bias's
BiasAddGrad, a LayerNorm's parameter Sums, a weight gradient whose
activation already exists) run at the end of the step, and their inputs
(upstream gradients, recomputed activations) stay allocated until then. In
graph order they would run at once: with blocks recomputation, where the
peak is in the last block's backward, that order under-estimated the
allocator's peak by 10-40% (a small GPT's step: 0.83-0.92 of it, a small
BERT's: 0.62; in the executor's order 0.97-1.07 and 1.03-1.04).

Which consumer runs on and which are pushed depends on the order of a node's
out edges in TF's runtime graph, which Grappler's and the oneDNN pass's
rewrites reshuffle and the GraphDef does not record; a profile of a step
shows neither graph order nor its reverse. simulate_graph therefore runs the
model with each node's out edges shuffled by a few fixed seeds and keeps the
run with the median shared peak (the spread over seeds is about +-10% on
small transformers; their median is within 8% of the simulation in the
profiled order). The choice repeats in every block, so where it decides
whether each block's largest gradient waits for the end of the step, the
runtime's order sits at one end of that spread: with blocks recomputation a
small Keras 3 BERT peaks 20-30% under the median (its tf_keras twin, the
GPTs, Llama, ViT and a causal LM: within 7%). Not modelled: the executor's cost estimates, which start
every kernel as expensive and let cheap ones run inline only after ~90 runs
of a step (KernelStats); a thread queue's capacity (1024 tasks, past which a
push runs the task at once); Grappler's changes to the graph.
"""
import collections
import dataclasses
import random
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
# Kernels whose OpKernel::IsExpensive() is false: TF's executor runs them
# inline on the thread that readied them instead of queueing them (a
# profile shows them only at its verbose trace level).
INLINE_OPS = frozenset([
    "Const", "HostConst", "Placeholder", "_Arg", "_Retval", "_DeviceArg",
    "_DeviceRetval", "Identity", "IdentityN", "StopGradient",
    "PreventGradient", "Reshape", "Squeeze", "ExpandDims", "Shape", "ShapeN",
    "Size", "Rank", "NoOp", "ControlTrigger", "Switch", "RefSwitch", "Merge",
    "RefMerge", "Enter", "RefEnter", "Exit", "RefExit", "NextIteration",
    "RefNextIteration", "LoopCond"])
SCHEDULES = ("executor", "graph")
_FLOW_OPS = frozenset(["Switch", "RefSwitch", "Merge", "RefMerge", "Enter",
                       "RefEnter", "Exit", "RefExit", "NextIteration",
                       "RefNextIteration", "LoopCond", "ControlTrigger"])
# Orders of the out edges simulate_graph tries (see executor_order).
EXECUTOR_SAMPLES = 7


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


def pruned_nodes(graph):
  """Names of the nodes TF leaves out of a step: what no output, stateful op
  (a variable update, a collective, a send), control-flow op or placeholder
  depends on, as TF prunes a function's body before running it. Such a node
  (a gradient nobody reads, a layer's unused extra output) would otherwise
  hold its inputs until it ran."""
  from tensorflow.python.framework import op_def_registry  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.endpoints import graph_outputs  # pylint: disable=import-outside-toplevel
  kept = {}

  def is_root(op):
    if op not in kept:
      op_def = op_def_registry.get(op)
      kept[op] = (op_def is None or op_def.is_stateful or op in _FLOW_OPS or
                  op in ("Placeholder", "_Arg"))
    return kept[op]
  live = set()
  stack = list(graph_outputs(graph)) + [n.name for n in graph.nodes
                                        if is_root(n.op)]
  while stack:
    name = stack.pop()
    if name in live or name not in graph:
      continue
    live.add(name)
    for text in graph.node(name).input:
      stack.append(text[1:] if text[:1] == "^" else parse_input(text)[0])
  return frozenset(n for n in graph.node_names() if n not in live)


class _ExecutorModel:
  """TF's executor on one inter-op thread over one graph (see the module
  docstring); order(seed) runs it with the out edges in one order."""

  def __init__(self, graph, order):
    self.names = order
    index = {name: i for i, name in enumerate(order)}
    self.data_out = [[] for _ in order]
    self.control_out = [[] for _ in order]
    self.pending = [0] * len(order)
    self.inline_op = [False] * len(order)
    for i, name in enumerate(order):
      node = graph.node(name)
      self.inline_op[i] = node.op in INLINE_OPS
      for text in node.input:
        if text[:1] == "^":
          self.control_out[index[text[1:]]].append(i)
        else:
          self.data_out[index[parse_input(text)[0]]].append(i)
        self.pending[i] += 1

  def order(self, seed=None):
    data_out, control_out = self.data_out, self.control_out
    if seed is not None:
      shuffle = random.Random(seed).shuffle
      data_out = [list(e) for e in data_out]
      control_out = [list(e) for e in control_out]
      for edges in data_out + control_out:
        if len(edges) > 1:
          shuffle(edges)
    inline_op = self.inline_op
    pending = list(self.pending)
    ran = []
    stack = []  # the thread's queue: pushed to and popped from its end

    def process(ready):
      inline = collections.deque()
      while True:
        # ScheduleReady: inexpensive ops inline; every expensive one but the
        # last queued, and the last too if inline work is waiting.
        current = None
        for j in ready:
          if inline_op[j]:
            inline.append(j)
          else:
            if current is not None:
              stack.append(current)
            current = j
        if current is not None:
          if inline:
            stack.append(current)
          else:
            inline.append(current)
        if not inline:
          return
        i = inline.popleft()
        ran.append(i)
        ready = []
        for j in data_out[i]:
          pending[j] -= 1
          if not pending[j]:
            ready.append(j)
        for j in control_out[i]:
          pending[j] -= 1
          if not pending[j]:
            ready.append(j)

    # The executor's source readies every node without inputs, in order.
    process([i for i, count in enumerate(pending) if not count])
    while stack:
      process([stack.pop()])
    if len(ran) != len(self.names):
      return list(self.names)
    return [self.names[i] for i in ran]


def executor_order(graph, order=None, seed=None):
  """Names of `graph`'s nodes in the order TF's executor runs them on one
  inter-op thread (see the module docstring); a topological order.

  graph: a tfsplit Graph. order: its topological order, if already computed.
  seed: None lists each node's out edges in that order (data edges before
  control edges, as TF's executor walks them); an int shuffles each node's
  data edges and its control edges with random.Random(seed). TF's runtime
  graph lists them in an order that its rewrites (Grappler, the oneDNN pass)
  leave behind and the GraphDef does not record; simulate_graph takes the
  median peak over a few seeds. A graph the model cannot run through (a TF1
  while loop: a Merge runs on its first input) keeps `order`.
  """
  if order is None:
    order = graph.topological_order()
  return _ExecutorModel(graph, order).order(seed)


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
  schedule: str = "graph"           # see simulate_graph
  sampled_peaks: list = None        # shared peak of each simulated order

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
            "schedule": self.schedule, "sampled_peaks": self.sampled_peaks,
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
               device_of, labels, roles, granularity, pruned=frozenset()):
    self.graph = graph
    self.pruned = pruned  # nodes TF leaves out of the step (pruned_nodes)
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
      if node.name in pruned:
        continue
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
      # The runtime's fixed cost of launching a step (and passing its
      # arguments and outputs), before any op runs.
      launch = table.step_overhead + table.graph_call_overhead(self.graph)
      self.start = self.tg.add_task("step launch", None, launch, kind="sync")
    for index, name in enumerate(order):
      node = self.graph.node(name)
      if node.op in _NO_TASK_OPS or name in self.var_nodes or \
          name in self.pruned:
        self.task_of[name] = None
        continue
      self.task_of[name] = self.add_node(node, index)
    self.finish()
    return self.tg


def simulate_graph(graph, cluster, cost_model=None, shapes=None,
                   variables=None, device_map=None, roles=None,
                   granularity=graph_memory.GRANULARITY, schedule="executor",
                   samples=EXECUTOR_SAMPLES):
  """Simulates one step of `graph` (a GraphDef or Graph) on `cluster`.

  cost_model: a CostModel (default: the roofline on `cluster`).
  device_map: device string -> cluster device index (see device_indices).
  roles: node -> 'forward'/'backward'/'update' (LayerReport.role), to label
    tasks in traces.
  schedule: which ready task a device runs first: 'executor' (in the order
    TF's executor runs the graph on one inter-op thread: executor_order) or
    'graph' (topological order).
  samples: with 'executor', how many orders of the out edges are simulated
    (executor_order's seeds 0, 1, ...); the result is the run whose shared
    peak is their median, and `sampled_peaks` holds every run's.
  Returns a GraphSimResult.
  """
  if schedule not in SCHEDULES:
    raise PlanError(f"unknown schedule '{schedule}'; use one of "
                    f"{', '.join(SCHEDULES)}")
  if schedule == "executor" and samples < 1:
    raise PlanError(f"samples must be at least 1, got {samples}")
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
  pruned = pruned_nodes(graph)
  builder = _Builder(graph, shapes, variables, cluster, cost_model, device_of,
                     labels, roles, granularity, pruned)
  measured0, modelled0 = cost_model.measured, cost_model.modelled
  order = graph.topological_order()
  tg = builder.build(order)
  memory = graph_memory.static_memory(graph, shapes, variables, device_of,
                                      labels, granularity, skip=pruned)
  for dev, row in zip(builder.dev, memory):
    tg.set_static_bytes(dev, row.static)
  t1 = time.perf_counter()
  if schedule == "executor":
    model = _ExecutorModel(graph, [n for n in order if n not in pruned])

    def prioritize(seed):
      for index, name in enumerate(model.order(seed)):
        task = builder.task_of.get(name)
        if task is not None:
          tg.set_priority(task, index)
    runs = []
    for seed in range(samples):
      prioritize(seed)
      run = tg.simulate()
      runs.append((run.shared_peak(), seed, run))
    sampled = [r[0] for r in runs]
    _, seed, sim = sorted(runs, key=lambda r: r[:2])[(len(runs) - 1) // 2]
    if seed != samples - 1:
      prioritize(seed)  # the task graph as the run it returns simulated it
  else:
    sim = tg.simulate()
    sampled = [sim.shared_peak()]
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
      modelled_ops=cost_model.modelled - modelled0, schedule=schedule,
      sampled_peaks=sampled)
