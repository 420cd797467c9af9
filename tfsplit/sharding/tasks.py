"""One task's part of a split graph, for jobs where every worker runs the
same script (one client per task, as MultiWorkerMirroredStrategy and DTensor
multi-client do).

Independent clients cannot pair Send/Recv rendezvous keys, but they do share
collective groups. So `task_graph` keeps the nodes placed on one task and
turns every edge between tasks into a collective:

- a tensor read on other tasks is broadcast from its device
  (CollectiveBcastSendV2) to one device of each task that reads it (the
  first by name; CollectiveBcastRecvV2): one collective per tensor. Group
  keys are fixed by the member devices (as sharding/reshard.py keys its
  groups); an instance key is a hash of the group and the tensor's name,
  moved past the keys the group already uses in the order of the tensors'
  names. Every task derives the same keys from the same plan without
  talking, from what any member of the group sees: the edges between tasks
  run between the devices of one pipeline group (a stage boundary), and a
  task's graph is made from the whole pipeline groups of its devices;
- a control edge between tasks is dropped; the node it waited on becomes a
  control input of the task's first output instead, so each task still runs
  everything the one-client step ran on it, and a broadcast's sender always
  runs (its receiver is never gated, so a sender never waits on a cycle);
- each graph input becomes the task's share of the batch: a placeholder of
  the block its devices read (`input_shares`), the Slices that read it
  made relative to that block;
- every output is returned on every task (a train step's loss is the global
  one): the task's own copy, or one broadcast from a copy in the pipeline
  group of the task's first device (`output_routes`, from the mesh alone).

The constants and broadcasts added are made by sharding/builder.py's
NodeMaker, as every split's nodes are.
"""
import dataclasses
import re
import zlib
from typing import Dict, List

import numpy as np
from tensorflow.core.framework import graph_pb2
from tensorflow.core.framework import node_def_pb2
from tensorflow.core.framework import tensor_shape_pb2
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import tensor_util

from tfsplit.errors import PlanError
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.ir import parse_input
from tfsplit.sharding.builder import NodeMaker, tensor

_TASK_RE = re.compile(r"/task:(\d+)")
_KEY_BIT = 0x40000000   # sharding/buckets.py's range: hashed keys
_COLLECTIVES = ("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveReduceScatterV2",
                "CollectiveAllToAllV2", "CollectiveBcastSendV2", "CollectiveBcastRecvV2")


def task_of(device):
  """The task index a device string names, or None."""
  found = _TASK_RE.search(device or "")
  return int(found.group(1)) if found else None


@dataclasses.dataclass(frozen=True)
class TaskPart:
  """What one task's graph is, beside the graph itself."""
  task: int
  devices: List[str]              # this task's devices the graph uses, sorted
  inputs: Dict[str, dict]         # input -> {"begin", "shape", "global_shape"}: its share
  sends: int                      # tensors this task broadcasts to others
  receives: int                   # tensors it receives
  dropped_controls: int           # control edges between tasks it no longer has


def input_shares(inputs, mesh, task):
  """{input: (begin, shape)}: the block of each input the mesh's devices on
  `task` read. inputs: {name: (global shape, Sharding or None)}; the block is
  the bounding box of theirs, which must be filled by them (a data axis laid
  over tasks in order gives each task a contiguous part of the batch)."""
  ids = [d for d in range(mesh.size) if task_of(mesh.devices[d]) == task]
  if not ids:
    raise PlanError(f"task {task} holds no device of mesh {mesh}; run as many workers "
                    "as the mesh needs, or a larger mesh")
  shares = {}
  for name, (shape, spec) in inputs.items():
    shape = list(shape)
    if spec is None or spec.is_replicated:
      shares[name] = ([0] * len(shape), shape)
      continue
    local = spec.local_shape(shape, mesh, f"input '{name}'")
    blocks = {tuple(mesh.coord_of(d, axis) * local[i] if axis is not None else 0
                    for i, axis in enumerate(spec.dims)) for d in ids}
    begin = [min(b[i] for b in blocks) for i in range(len(shape))]
    size = [max(b[i] for b in blocks) + local[i] - begin[i] for i in range(len(shape))]
    if len(blocks) * int(np.prod(local)) != int(np.prod(size)):
      raise PlanError(f"input '{name}': the devices of task {task} read blocks that do "
                      "not form one block of the batch; lay the data axes across tasks "
                      "(--across-tasks dp,pp)")
    shares[name] = (begin, size)
  return shares


def output_routes(mesh, holders, pipeline_axis):
  """{output: {task: (copy's device, receiving device)}} for every task with
  no copy of an output: the copy it receives is the first holder (mesh
  order) in the pipeline group of the task's first device, received there.
  holders: {output: the mesh device ids with a copy}. Found from the mesh
  alone, so the sender and every receiver agree without seeing each other's
  graphs."""
  first = {}
  for d, device in enumerate(mesh.devices):
    first.setdefault(task_of(device), d)
  pipelined = mesh.axes.get(pipeline_axis, 1) > 1
  routes = {}
  for name, ids in holders.items():
    holding = {task_of(mesh.devices[d]) for d in ids}
    routes[name] = {}
    for task, d in first.items():
      if task in holding:
        continue
      peers = set(mesh.group_of(d, pipeline_axis)[1]) if pipelined else {d}
      source = next((h for h in ids if h in peers), None)
      if source is None:
        raise PlanError(f"output '{name}' has no copy in the pipeline group of task "
                        f"{task}'s first device; this is a bug in tfsplit's per-task "
                        "graphs, please report it")
      routes[name][task] = (mesh.devices[source], mesh.devices[d])
  return routes


class _Extraction(object):

  def __init__(self, graph_def, task, shares, outputs, output_copies, routes, tensor_type,
               timeout_seconds):
    self.src, self.task, self.shares = graph_def, task, shares
    self.outputs, self.output_copies, self.routes = list(outputs), output_copies, routes
    self.tensor_type, self.timeout = tensor_type, timeout_seconds
    self.nodes = {n.name: n for n in graph_def.node}
    self.where = {n.name: task_of(n.device) for n in graph_def.node}
    self.make = NodeMaker(set(self.nodes))   # the task's new nodes, named apart
    self.front, self.tail = [], []
    self.dropped = 0

  def const(self, base, value, device, dtype=np.int32):
    """Name of a new Const of `value` (as `dtype`) at the front of the graph."""
    node = self.make.const(base, np.asarray(value, dtype), device)
    self.front.append(node)
    return node.name

  # --- what crosses ------------------------------------------------------------------
  def crossings(self):
    """({tensor: {reading task: its reading device}}, nodes of this task that
    a node of another task waits on). A task's graph may hold other tasks'
    nodes (its devices' pipeline groups); every edge between tasks they show
    is counted, as every task seeing those groups counts it."""
    readers, waited_on = {}, set()
    outputs, inputs = set(self.outputs), set(self.shares)
    tasks = set()
    for node in self.src.node:
      if node.name in outputs or node.name in inputs:
        continue
      here = self.where[node.name]
      if here is None:
        raise PlanError(f"node '{node.name}' (op {node.op}) has no device; a per-task "
                        "graph needs every node placed on a task (a mesh on a cluster)")
      tasks.add(here)
      for text in node.input:
        src, port = parse_input(text)
        there = self.where.get(src)
        if src in inputs or there == here:
          continue
        if there is None:
          if here == self.task:
            raise PlanError(f"node '{node.name}' (op {node.op}) reads '{src}', which "
                            f"task {self.task}'s graph does not hold; this is a bug in "
                            "tfsplit's per-task graphs, please report it")
          continue
        if port < 0:
          if there == self.task:
            waited_on.add(src)
          continue
        by_task = readers.setdefault((src, port), {})
        by_task[here] = min(by_task.get(here, node.device), node.device)
    self.tasks = sorted(tasks)
    if self.task not in tasks:
      raise PlanError(f"task {self.task} runs no node of this graph (it uses tasks "
                      f"{', '.join(map(str, self.tasks))})")
    self.task_devices = sorted({n.device for n in self.src.node
                                if self.where[n.name] == self.task})
    # Every task returns every output: its own copy, or the routed one. The
    # broadcasts of the copies this task sends or receives are counted whole.
    self.chosen = {}
    for name in self.outputs:
      copies = {}
      for device, text in self.output_copies[name]:
        copies.setdefault(device, parse_input(text))
      own = next((c for d, c in copies.items() if task_of(d) == self.task), None)
      routes = self.routes.get(name, {})
      if own is None and self.task not in routes:
        raise PlanError(f"output '{name}' has no copy on task {self.task} and no route "
                        "to it; this is a bug in tfsplit's per-task graphs, please "
                        "report it")
      self.chosen[name] = own if own is not None else copies[routes[self.task][0]]
      by_copy = {}
      for task, (device, receiver) in routes.items():
        by_copy.setdefault(device, []).append((task, receiver))
      for device, receivers in by_copy.items():
        if task_of(device) != self.task and self.task not in dict(receivers):
          continue
        by_task = readers.setdefault(copies[device], {})
        for task, receiver in receivers:
          by_task[task] = min(by_task.get(task, receiver), receiver)
    return readers, waited_on

  def _used_instance_keys(self):
    """{group key: instance keys its collectives use in this graph}."""
    used = {}
    for node in self.src.node:
      if node.op not in _COLLECTIVES:
        continue
      at = 0 if node.op == "CollectiveBcastRecvV2" else 1
      group = self.nodes.get(parse_input(node.input[at + 1])[0])
      key = self.nodes.get(parse_input(node.input[at + 2])[0])
      if group is not None and key is not None and group.op == key.op == "Const":
        used.setdefault(int(tensor_util.MakeNdarray(group.attr["value"].tensor)),
                        set()).add(int(tensor_util.MakeNdarray(key.attr["value"].tensor)))
    return used

  # --- broadcasts ----------------------------------------------------------------------
  def broadcasts(self, readers):
    """({tensor: (the local tensor this task reads it as, its device)}, the
    sends' names, appended to the
    tail. One broadcast per tensor, keyed in the order of the tensors' names."""
    received, sends = {}, []
    used = self._used_instance_keys()
    for (src, port) in sorted(readers):
      by_task = readers[(src, port)]
      there = self.where[src]
      members = [self.nodes[src].device] + [by_task[t] for t in sorted(by_task)]
      if self.task != there and self.task not in by_task:
        continue
      group_key = (zlib.crc32(",".join(sorted(members)).encode()) & 0x3FFFFFFF) + 1
      instance = _instance_key(group_key, tensor(src, port), used.setdefault(group_key, set()))
      dtype, shape = self.tensor_type(src, port)
      what = f"tensor '{tensor(src, port)}' (op {self.nodes[src].op}) of task {there}"
      if dtype == types_pb2.DT_RESOURCE:
        raise PlanError(f"{what} is a variable handle read on task(s) "
                        f"{', '.join(map(str, sorted(by_task)))}; keep the variable's "
                        "readers on its task (lay that mesh axis within a task)")
      if shape is None or any(s is None or s < 0 for s in shape):
        raise PlanError(f"{what} is read on another task but its shape is not known; "
                        "trace the step with static shapes")
      device = members[0] if self.task == there else by_task[self.task]
      base = f"{src}/port_{port}/task_{'send' if self.task == there else 'recv'}"
      keys = [self.const(base + "/group_size", len(members), device),
              self.const(base + "/group_key", group_key, device),
              self.const(base + "/instance_key", instance, device)]
      if self.task == there:
        node = self.make.collective("CollectiveBcastSendV2", base, device,
                                    [tensor(src, port)] + keys, dtype, self.timeout)
        sends.append(node.name)
        self.tail.append(node)
      else:
        keys.append(self.const(base + "/shape", list(shape), device))
        node = self.make.collective("CollectiveBcastRecvV2", base, device, keys, dtype,
                                    self.timeout)
        self.front.append(node)
        received[(src, port)] = (node.name, device)
    return received, sends

  # --- inputs ------------------------------------------------------------------------
  def input_node(self, name, consumers):
    """The task's placeholder of input `name`: its share, on the device of
    its first reader here (the task's first device if none)."""
    begin, shape = self.shares[name]
    node = node_def_pb2.NodeDef()
    node.CopyFrom(self.nodes[name])
    node.device = consumers[0].device if consumers else self.task_devices[0]
    node.attr["shape"].shape.CopyFrom(_shape_proto(shape))
    node.attr.pop("_output_shapes", None)
    return node

  def relative_slice(self, node, name):
    """A Slice of input `name` made relative to this task's share of it."""
    begin, shape = self.shares[name]
    whole = self.nodes[name].attr["shape"].shape
    if list(shape) == [d.size for d in whole.dim]:
      return
    const = self.nodes.get(parse_input(node.input[1])[0]) if node.op == "Slice" else None
    size = self.nodes.get(parse_input(node.input[2])[0]) if node.op == "Slice" else None
    if const is None or const.op != "Const" or size is None or size.op != "Const":
      raise PlanError(f"node '{node.name}' (op {node.op}) reads input '{name}' of which "
                      f"task {self.task} holds a share only; this is a bug in tfsplit's "
                      "per-task graphs, please report it")
    at = tensor_util.MakeNdarray(const.attr["value"].tensor).astype(np.int64) - begin
    extent = tensor_util.MakeNdarray(size.attr["value"].tensor).astype(np.int64)
    if (at < 0).any() or (at + extent > np.asarray(shape)).any():
      raise PlanError(f"node '{node.name}' (op Slice) on task {self.task} reads input "
                      f"'{name}' outside the task's share; this is a bug in tfsplit's "
                      "per-task graphs, please report it")
    node.input[1] = self.const(node.name + "/task_begin", at, node.device,
                               tensor_util.MakeNdarray(const.attr["value"].tensor).dtype)

  # --- outputs -----------------------------------------------------------------------
  def output_node(self, name, received, extra_controls):
    whole = self.nodes[name]
    src, port = self.chosen[name]
    local, device = received.get((src, port), (tensor(src, port), self.nodes[src].device))
    controls = {parse_input(t)[0] for _, t in self.output_copies[name]
                if self.where[parse_input(t)[0]] == self.task} - {parse_input(local)[0]}
    controls |= {parse_input(t)[0] for t in whole.input[1:]
                 if self.where.get(parse_input(t)[0]) == self.task}
    controls |= set(extra_controls)
    node = node_def_pb2.NodeDef(name=name, op="Identity", device=device,
                                input=[local] + ["^" + c for c in sorted(controls)])
    node.attr["T"].CopyFrom(whole.attr["T"])
    if variables_lib.OUTPUT_INDEX_ATTR in whole.attr:
      node.attr[variables_lib.OUTPUT_INDEX_ATTR].CopyFrom(
          whole.attr[variables_lib.OUTPUT_INDEX_ATTR])
    return node

  def run(self):
    if not self.outputs:
      raise PlanError("a graph without outputs cannot be split per task (each task "
                      "fetches its outputs to run its part)")
    readers, waited_on = self.crossings()
    received, sends = self.broadcasts(readers)
    out = graph_pb2.GraphDef()
    out.versions.CopyFrom(self.src.versions)
    out.library.CopyFrom(self.src.library)
    body, consumers = [], {name: [] for name in self.shares}
    for node in self.src.node:
      if self.where[node.name] != self.task or node.name in self.chosen:
        continue
      new = node_def_pb2.NodeDef()
      new.CopyFrom(node)
      inputs = []
      for text in node.input:
        src, port = parse_input(text)
        if src in self.shares:
          consumers[src].append(new)
        if self.where.get(src, self.task) == self.task or src in self.shares:
          inputs.append(text)
        elif port < 0:
          self.dropped += 1
        else:
          inputs.append(received[(src, port)][0])
      del new.input[:]
      new.input.extend(inputs)
      body.append(new)
    for name, readers_here in consumers.items():
      for node in readers_here:
        self.relative_slice(node, name)
    inputs = [self.input_node(name, consumers[name]) for name in self.shares]
    outputs = [self.output_node(name, received, sorted(waited_on) + sends if i == 0 else ())
               for i, name in enumerate(self.outputs)]
    out.node.extend(inputs + self.front + body + self.tail + outputs)
    part = TaskPart(self.task, self.task_devices,
                    {name: {"begin": list(map(int, b)), "shape": list(map(int, s)),
                            "global_shape": [d.size for d in
                                             self.nodes[name].attr["shape"].shape.dim]}
                     for name, (b, s) in self.shares.items()},
                    len(sends), len(received), self.dropped)
    return out, part


def _instance_key(group_key, name, used):
  """A broadcast's instance key: a hash of its group and tensor, moved past
  the keys `used` by that group (which it joins), in the bucket keys' range
  (bit 30 set, clear of the Resharder's counting keys)."""
  key = _KEY_BIT | (zlib.crc32(f"{group_key}:{name}".encode()) & (_KEY_BIT - 1))
  while key in used:
    key = _KEY_BIT | ((key + 1) & (_KEY_BIT - 1))
  used.add(key)
  return key


def task_graph(graph_def, task, shares, outputs, output_copies, routes, tensor_type,
               timeout_seconds=None):
  """(GraphDef, TaskPart): the part of the whole-mesh `graph_def` that `task`
  runs (see the module doc).

  shares: {input: (begin, shape)} from input_shares; outputs: the output
  names; output_copies: {output: [[device, local tensor]]} (materialize's
  record, of the devices made); routes: output_routes' answer;
  tensor_type(node, port) -> (dtype enum, local shape) of a tensor that
  crosses tasks."""
  return _Extraction(graph_def, task, shares, outputs, output_copies, routes, tensor_type,
                     timeout_seconds).run()


def _shape_proto(shape):
  proto = tensor_shape_pb2.TensorShapeProto()
  for s in shape:
    proto.dim.add().size = int(s)
  return proto
