"""Per-op cost of a GraphDef in seconds, and the cost model's front door:
CostModel prices a node's NodeCost on a device of a ClusterSpec, from a
CostTable's measured time or fitted line where it has one and the device's
roofline otherwise, and a collective by the alpha-beta model of
tfsplit.cost.collectives; graph_costs and total count a whole graph. What an
op does is counted in op_work and what a machine measured is held in
cost_table; their public names are re-exported here, so callers import the
whole cost model from this one module."""

# CostModel turns a NodeCost into time on a device of a ClusterSpec:
#
#   compute op     overhead + factor * max(flops / peak_flops(dtype),
#                                          bytes / memory_bandwidth)
#   collective     the alpha-beta time of tfsplit.cost.collectives
#
# A CostTable (written by `tfsplit calibrate`) holds times measured on a real
# machine. A measured entry for the node's op and shapes (from a graph
# calibrated with the table) wins over the model; otherwise each op type's
# fitted line, a fixed time per call plus an efficiency factor times the
# roofline, corrects the roofline (Alpa's rule: measured costs override
# analytic ones).

from tfsplit.cost import collectives
from tfsplit.cost.cost_table import (TABLE_VERSION, CostTable, collective_for,
                                     collectives_at_once, concurrency_for)
from tfsplit.cost.op_work import (FORWARDING_OPS, METADATA_OPS, VIEW_OPS, NodeCost,
                                  const_int, group_size, node_cost, op_form, signature)
from tfsplit.errors import ClusterSpecError

__all__ = ["FORWARDING_OPS", "METADATA_OPS", "TABLE_VERSION", "VIEW_OPS", "CostModel",
           "CostTable", "NodeCost", "collective_for", "collectives_at_once",
           "concurrency_for", "const_int", "graph_costs", "group_size", "node_cost",
           "op_form", "signature", "total"]

_INT_DTYPES = frozenset(["int8", "uint8", "int16", "uint16", "int32", "uint32",
                         "int64", "uint64", "bool"])


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
    factor = self.table.factor(cost.line)
    # Views and metadata ops (no roofline time) launch no kernel to set up.
    fixed = self.table.fixed(cost.line) if roof > 0 else 0.0
    return self.op_overhead + self.table.graph_scale * (fixed + factor * roof)

  def compute_parts(self, cost, device=0, sig=None):
    """(fixed, scaling) seconds of compute_time: the part paid per call
    whatever the tensor sizes (per-op overhead and the op type's fixed
    time), and the part that grows with the tensors (the batch)."""
    seconds = self.compute_time(cost, device, sig)
    fixed = self.op_overhead
    if self.table is not None and (cost.flops or cost.bytes_moved):
      fixed += self.table.graph_scale * self.table.fixed(cost.line)
    fixed = min(fixed, seconds)
    return fixed, seconds - fixed

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
