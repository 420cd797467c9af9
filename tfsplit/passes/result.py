"""SplitResult: everything one split produced, complete at construction."""
import collections
import dataclasses
from typing import Dict, List, Optional


@dataclasses.dataclass(frozen=True)
class SplitResult:
  graph_def: object                    # the rewritten GraphDef
  manifest: Dict[str, dict]            # variable -> its shards (see passes/manifest.py)
  collectives: list                    # sharding.reshard.CollectiveRecord
  fallbacks: List[str]                 # ops forced to replicate, with why (propagate.Fallback)
  variable_specs: Dict[str, tuple]     # split variable -> dims
  output_copies: Dict[str, list]       # output -> [[device, local tensor]]
  records: Dict[str, object]           # local node -> sharding.materialize.NodeRecord
  config: object                       # the SplitConfig (mesh as asked)
  mesh: object                         # the mesh materialized (with 'mb')
  partition: Optional[List[List[str]]] = None   # pipeline: layer names per model chunk
  stage_of: Optional[Dict[str, int]] = None      # pipeline: original node -> model chunk
  schedule_edges: int = 0                        # control edges a schedule added
  offload: object = None                         # memory.offload.OffloadPlan, or None
  offloaded_nodes: int = 0                       # split-graph nodes moved to a host
  task: object = None                            # sharding.tasks.TaskPart, or None
  # expert parallelism: the strategies.experts.ExpertWeight split over 'ep'
  experts: tuple = ()

  def count(self, kind, axis=None):
    return sum(1 for c in self.collectives
               if c.kind == kind and (axis is None or c.axis == axis))

  def ops_per_device(self, skip=()):
    """{device: ops placed on it} of the rewritten graph, leaving out op types
    in `skip` (constants, say: TF folds and shares them before a step runs)."""
    return collections.Counter(n.device for n in self.graph_def.node
                               if n.device and n.op not in skip)

  def mesh_record(self):
    """{'axes', 'devices'} of the mesh asked for: what a checkpoint records."""
    return {"axes": dict(self.config.mesh.axes), "devices": list(self.config.mesh.devices)}

  def manifest_dict(self, source=None):
    from tfsplit.passes import manifest as manifest_lib  # pylint: disable=import-outside-toplevel
    return manifest_lib.build(self, source)

  def manifest_json(self, source=None):
    from tfsplit.passes import manifest as manifest_lib  # pylint: disable=import-outside-toplevel
    return manifest_lib.dumps(self.manifest_dict(source))
