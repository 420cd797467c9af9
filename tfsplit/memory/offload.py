"""CPU offload of the optimizer state (offload='optimizer').

    plan = plan_offload(analysis, mesh, host=None)
    moved = apply_offload(materialized, plan)

Each optimizer slot (sharding/zero.optimizer_slots: a variable the forward
pass does not read, read by the update of exactly one trainable weight:
Adam's moments) lives on its device's host CPU, with the update ops that
compute only from slots and gradients (the m and v updates and the weight's
delta); the weight, its forward reads and its write stay on the
accelerator. TF inserts the Send/Recv between the two devices of one graph:
the gradient crosses to the host, the delta comes back.

The pass is record-driven: it runs on the split graph and moves every node
whose record (sharding/builder.NodeRecord) says it was made for one of the
plan's original nodes, except collectives, which must stay on their group's
devices. The manifest says where each slot's shards live, so shard
variables, checkpoints and assign_back follow it.

The host of device `/job:J/replica:0/task:T/device:GPU:k` is
`/job:J/replica:0/task:T/device:CPU:0` (or `host`, one device for all).
A host that is itself one of the mesh's devices (a mesh over this machine's
CPUs) is refused: nothing would leave the device.
"""
import collections
import dataclasses
from typing import Dict, FrozenSet

import numpy as np

from tfsplit import constants
from tfsplit.errors import PlanError
from tfsplit.graph import handles as handles_lib
from tfsplit.sharding import zero as zero_lib

MODES = ("optimizer",)
OFFLOADED_FROM_KEY = "offloaded_from"   # manifest shard: the mesh device it serves


@dataclasses.dataclass
class OffloadPlan:
  slot_of: Dict[str, str]            # slot handle -> weight handle
  nodes: FrozenSet[str]              # original nodes placed on the host
  host_of: Dict[str, str]            # mesh device -> its host device


def host_device(device, host=None):
  """The host CPU of `device` (same job, replica and task, CPU:0), or `host`."""
  if host:
    return host
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  spec = tf.DeviceSpec.from_string(device)
  return spec.replace(device_type="CPU", device_index=0).to_string()


def check_hosts(devices, host=None):
  """{mesh device: host}; PlanError when a host is one of the mesh's devices."""
  hosts = {d: host_device(d, host) for d in devices}
  names = {_canonical(d) for d in devices}
  for d, h in hosts.items():
    if _canonical(h) in names:
      raise PlanError(
          f"offload='optimizer' needs a host CPU apart from the mesh's devices, but the "
          f"host of '{d}' is '{h}', itself a mesh device; put the mesh on GPUs "
          "(--devices gpu) or on CPU:1.. leaving CPU:0 as the host, or name another host "
          "with offload_device= (--offload-device)")
  return hosts


def plan_offload(analysis, mesh, host=None):
  """OffloadPlan of the analysis' graph: slots, their reads and writes, and
  the update ops computing only from slots and gradients."""
  graph, roles = analysis.graph, analysis.roles
  var_nodes = {v.node for v in analysis.variables}
  slot_of = zero_lib.optimizer_slots(analysis)
  slots = set(slot_of)
  nodes = set(slots)
  reads, writes, other = set(), set(), set()
  for node in graph.nodes:
    if node.name in var_nodes or not node.input or node.input[0].startswith("^"):
      continue
    handle = handles_lib.handle_of(graph, node.input[0], var_nodes)
    if handle is None:
      continue
    if handle in slots:
      nodes.add(node.name)  # a read, a write or a handle passthrough of a slot
      if node.op in constants.VARIABLE_READ_OPS:
        reads.add(node.name)
      elif constants.is_write_op(node.op):
        writes.add(node.name)
    elif node.op in constants.VARIABLE_READ_OPS or constants.is_write_op(node.op) or \
        node.op in handles_lib.IDENTITY:
      other.add(node.name)  # another variable's op: never offloaded

  def movable(name):
    return roles.get(name) == constants.UPDATE and name not in var_nodes and \
        name not in other and name not in nodes

  order = graph.topological_order()
  # Down: update ops fed by a slot's value.
  down = set()
  for name in order:
    if movable(name) and any(src in reads or src in down
                             for src, _ in graph.data_inputs(name)):
      down.add(name)
  # Up: update ops all of whose consumers are on the host (the gradient's
  # scaling, the step size from the iteration count): a scalar or the
  # gradient crosses, not a weight-sized intermediate.
  data_consumers = collections.defaultdict(set)
  for name in order:
    for src, _ in graph.data_inputs(name):
      data_consumers[src].add(name)
  up = set()
  for name in reversed(order):
    users = data_consumers.get(name)
    if movable(name) and name not in down and users and \
        all(u in writes or u in up or u in down for u in users):
      up.add(name)
  nodes |= down | up
  return OffloadPlan(slot_of, frozenset(nodes), check_hosts(mesh.devices, host))


def apply_offload(materialized, plan, variables):
  """Moves the plan's nodes of the split graph (by their records) to their
  device's host, and marks the slots' manifest entries; returns the number
  of nodes moved."""
  moved = 0
  for node in materialized.graph_def.node:
    record = materialized.records.get(node.name)
    if record is None or record.device_id is None or record.source not in plan.nodes or \
        _is_collective(node.op) or node.device not in plan.host_of:
      continue
    node.device = plan.host_of[node.device]
    moved += 1
  names = {v.node: v.name for v in variables}
  for slot, weight in plan.slot_of.items():
    entry = materialized.manifest.get(names.get(slot))
    if entry is None:
      continue
    entry[zero_lib.SLOT_OF_KEY] = names.get(weight, weight)
    for shard in entry["shards"]:
      if shard["device"] in plan.host_of:
        shard[OFFLOADED_FROM_KEY] = shard["device"]
        shard["device"] = plan.host_of[shard["device"]]
  return moved


def misplaced(graph_def, records, manifest, plan):
  """Lines naming each node against the offload placement: a plan node
  (slot, its reads and writes, its update ops) not on its host, or a weight's
  handle on a host. Empty when the placement holds."""
  hosts = set(plan.host_of.values())
  weights = set(plan.slot_of.values())
  problems = []
  for node in graph_def.node:
    record = records.get(node.name)
    if record is None or record.device_id is None or _is_collective(node.op):
      continue
    if record.source in plan.nodes and node.device not in hosts:
      problems.append(f"'{node.name}' (op {node.op}, for '{record.source}') is on "
                      f"'{node.device}', not on a host")
    elif record.source in weights and node.device in hosts:
      problems.append(f"'{node.name}' (weight '{record.source}') is on the host "
                      f"'{node.device}'")
  for name, entry in manifest.items():
    if zero_lib.SLOT_OF_KEY in entry:
      problems += [f"slot '{name}' shard '{s['name']}' is on '{s['device']}'"
                   for s in entry["shards"] if s["device"] not in hosts]
  return problems


def offloaded_bytes(manifest):
  """{mesh device: bytes of optimizer slots it keeps on its host}."""
  out = collections.Counter()
  for entry in manifest.values():
    size = np.dtype(entry["dtype"]).itemsize
    for shard in entry["shards"]:
      if OFFLOADED_FROM_KEY in shard:
        out[shard[OFFLOADED_FROM_KEY]] += int(np.prod(shard["shape"], dtype=np.int64)) * size
  return dict(out)


def summary(manifest, moved):
  """rewrite's summary line: slot bytes moved to the host per device."""
  per_device = offloaded_bytes(manifest)
  slots = sum(1 for e in manifest.values()
              if any(OFFLOADED_FROM_KEY in s for s in e["shards"]))
  if not per_device:
    return ("  offload (optimizer): no optimizer slots found (a fused optimizer update "
            "keeps its slots with its weight); nothing moved")
  values = sorted(per_device.values())
  amount = (f"{values[0] / 2**20:.2f} MiB" if values[0] == values[-1] else
            f"{values[0] / 2**20:.2f}-{values[-1] / 2**20:.2f} MiB")
  return (f"  offload (optimizer): {slots} optimizer slots, {amount} per device moved to "
          f"its host CPU, with {moved} ops (reads, updates, writes)")


def _is_collective(op):
  return op.startswith("Collective") or op.startswith("Nccl")


def _canonical(device):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return tf.DeviceSpec.from_string(device).to_string()
