"""What the user asked of one split: mesh, strategy and every option.

One record, checked once, read by every pass. Options of passes still to
come (recomputation, optimizer-state sharding, offload, gradient buckets)
get their field here, so a pass never grows its own keyword plumbing.
"""
import dataclasses
from typing import Dict, List, Optional, Tuple

from tfsplit import constants
from tfsplit.errors import PlanError

STRATEGIES = ("megatron", "none")
SCHEDULES = ("1f1b", "gpipe")
BALANCES = ("cost", "flops")


@dataclasses.dataclass(frozen=True)
class SplitConfig:
  """mesh: a sharding.Mesh (its 'dp' axis splits the batch, 'pp' cuts stages,
  'tp' or the last other axis is the strategy's axis).
  strategy: 'megatron' (found from the graph) or 'none' (annotations only).
  annotations: {variable-name glob: dims tuple}; they override the strategy.
  microbatches: m > 1 runs each replica's batch as m micro-batches.
  schedule / layer_ranges: the pipeline schedule and explicit stage ranges.
  timeout_seconds: collectives give up after this long (a dead peer is an
    error, not a hang).
  axis: the strategy's mesh axis (default: 'tp', else the last model axis).
  balance: how stages are balanced without layer_ranges: 'cost' (op times
    from the cost model plus the activations crossing each cut) or 'flops'.
  """
  mesh: object
  strategy: Optional[str] = "megatron"
  annotations: Dict[str, tuple] = dataclasses.field(default_factory=dict)
  microbatches: int = 1
  schedule: str = "1f1b"
  layer_ranges: Optional[List[Tuple[int, int]]] = None
  timeout_seconds: Optional[float] = None
  axis: Optional[str] = None
  balance: str = "cost"

  def __post_init__(self):
    if int(self.microbatches) < 1:
      raise PlanError(f"microbatches must be >= 1, got {self.microbatches}")
    if self.strategy not in STRATEGIES + (None,):
      raise PlanError(f"unknown strategy '{self.strategy}'; use 'megatron' or 'none'")
    if self.schedule not in SCHEDULES:
      raise PlanError(f"unknown pipeline schedule '{self.schedule}'; choose one of: "
                      f"{', '.join(sorted(SCHEDULES))}")
    if self.balance not in BALANCES:
      raise PlanError(f"unknown stage balance '{self.balance}'; choose one of: "
                      f"{', '.join(BALANCES)}")

  @property
  def stages(self):
    return self.mesh.axes.get(constants.PIPELINE_AXIS, 1)

  def split_axis(self, mesh):
    """The axis the strategy splits weights over, or None."""
    if self.axis:
      return self.axis
    if constants.TENSOR_AXIS in mesh.axes:
      return constants.TENSOR_AXIS
    model = [a for a in mesh.axis_names if a not in constants.NON_MODEL_AXES]
    return model[-1] if model else None

  def batch_axis(self, mesh):
    """'dp', 'mb' or the compound 'dp*mb' that splits the batch, or None."""
    parts = [a for a in constants.BATCH_AXES if a in mesh.axes]
    return "*".join(parts) if parts else None
