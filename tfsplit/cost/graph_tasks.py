"""A Graph as the simulator's TaskGraph (tfsplit.cost.simulator): Builder makes
a task of every node that does work, priced by a CostModel on its device's
compute stream, a transfer task for each tensor a node reads from another
device, one task per collective instance and per _Send/_Recv pair on its
group's link, and the bytes each task allocates or shares with an input
(views, forwarded elementwise outputs). It is the translation from
TensorFlow's graph to tasks, apart from the order the tasks run in
(executor_model) and the step that is simulated over them (graph_sim)."""

# The graph becomes a TaskGraph (tfsplit.cost.simulator):
#
# - every node that does work is a task on its device's compute stream, priced
#   by a CostModel; among the ready tasks of a device the one TF's executor
#   would run first goes first (executor_model.executor_order: the order one
#   inter-op thread runs the graph in, which is what decides how long tensors
#   live);
# - placement comes from `node.device` (placement.device_indices): each
#   distinct device string maps to a cluster device index (given, or in sorted
#   order), an empty device is 0;
# - a data edge between devices becomes a transfer task on the link between
#   the two devices (alpha-beta), once per tensor and destination; the copy is
#   allocated on the destination;
# - the members of one collective instance (same op, group key, instance key)
#   wait for one task on their group's link, priced with the alpha-beta model;
#   _Send/_Recv pairs (same tensor_name, send and recv device) likewise;
# - control edges order tasks and hold no memory.
#
# Memory: variables, constants and fed inputs are static (held all step); every
# other output is allocated when its op starts and freed when its last reader
# ends. Views (Reshape, Identity, ReadVariableOp, ...) allocate nothing and
# keep their source alive; an elementwise op whose input has no other reader
# takes over that input's buffer, as TF's forward_input_or_allocate_output
# does. Allocations are rounded up to the allocator's 256-byte granularity.
# What TF prunes from a step before running it (executor_model.pruned_nodes:
# nodes that no output and no stateful op depends on, constants included) is
# left out: an unused gradient or a layer's extra output would otherwise hold
# its inputs until it ran, which in the executor's order can be the end of the
# step.

import collections

from tfsplit.cost import collectives
from tfsplit.cost import op_cost
from tfsplit.cost.simulator import TaskGraph
from tfsplit.errors import PlanError
from tfsplit.graph.ir import parse_input
from tfsplit.memory import graph_memory

_NO_TASK_OPS = frozenset(["Const", "Placeholder", "VarHandleOp", "_Arg"])
_RECV_OPS = frozenset(["_Recv", "_HostRecv"])
_SEND_OPS = frozenset(["_Send", "_HostSend"])
_ROLE_KIND = {"forward": "forward", "backward": "backward",
              "update": "optimizer"}


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


class Builder:
  """Turns one Graph into a TaskGraph; see the notes at the top of this
  module."""

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
