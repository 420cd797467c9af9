"""What the user asked of one split: mesh, strategy and every option.

One record, checked once, read by every pass. Options of passes still to
come (recomputation, optimizer-state sharding, offload, gradient buckets)
get their field here, so a pass never grows its own keyword plumbing.
"""
import dataclasses
import numbers
from typing import Dict, List, Optional, Tuple

from tfsplit import constants
from tfsplit.errors import PlanError
from tfsplit.layout.mesh import Mesh
from tfsplit.memory import offload as offload_lib
from tfsplit.memory import recompute as recompute_lib
from tfsplit.pipeline.schedules import Interleaved

STRATEGIES = ("megatron", "none")
SCHEDULES = constants.PIPELINE_SCHEDULES
BALANCES = ("cost", "flops")
# What float32 gradients may travel in over the data axis instead (off by
# default: the dtype the graph accumulates them in).
GRADIENT_REDUCE_DTYPES = ("bfloat16",)
# The gradient bucket cap lives in constants (the planner prices it without
# importing the passes); passes.config.DEFAULT_BUCKET_BYTES stays its name here.
DEFAULT_BUCKET_BYTES = constants.DEFAULT_BUCKET_BYTES


def exact_pattern(name):
  """Variable name `name` as an annotation pattern (an fnmatch glob)
  matching only itself."""
  return "".join(f"[{ch}]" if ch in "*?[" else ch for ch in name)


def check_mesh_axes(names, axis=None):
  """Refuse a mesh axis without a meaning: a typo ('pd=2') must not split tensors."""
  known = ", ".join(constants.USER_MESH_AXES)
  for name in list(names) + ([axis] if axis else []):
    if name == constants.MICROBATCH_AXIS:
      raise PlanError(f"mesh axis '{name}' is the micro-batch axis the rewrite adds "
                      f"itself; drop it from the mesh and pass microbatches=N "
                      f"(--microbatches N); the axes are {known}")
    if name not in constants.USER_MESH_AXES:
      raise PlanError(f"unknown mesh axis '{name}': the axes are {known} (data, tensor, "
                      "pipeline and expert parallelism); rename it, e.g. --mesh tp=2")


@dataclasses.dataclass(frozen=True)
class SplitConfig:
  """mesh: a sharding.Mesh (its 'dp' axis splits the batch, 'pp' cuts stages,
  'tp' or the last other axis is the strategy's axis).
  strategy: 'megatron' (found from the graph) or 'none' (annotations only).
  annotations: {variable-name glob: dims tuple}; they override the strategy.
  microbatches: m > 1 runs each replica's batch as m micro-batches.
  schedule / layer_ranges: the pipeline schedule and explicit stage ranges
    (with virtual stages, one range per model chunk).
  virtual_stages: model chunks per pipeline stage (v): the layers are cut
    into S * v chunks, chunk c on stage c % S; the 'interleaved' schedule
    needs v >= 2, the others v = 1.
  timeout_seconds: collectives give up after this long (a dead peer is an
    error, not a hang); None: no timeout (devices of one process).
  axis: the strategy's mesh axis (default: 'tp', else the last model axis).
  balance: how stages are balanced without layer_ranges: 'cost' (op times
    from the cost model plus the activations crossing each cut) or 'flops'.
  bucket_bytes: gradient all-reduces over the data axis are packed into
    buckets of at most this many bytes per device, one collective each
    (sharding/buckets.py); 0 keeps one all-reduce per gradient.
  recompute: recomputation of forward activations for the backward pass
    (memory/recompute.py): None/'none', 'blocks', 'selective', 'auto', or name
    scopes (a list, or a string with ',' or '/'); read through
    `recompute_mode`.
  zero: optimizer-state sharding over the 'dp' axis (sharding/zero.py): 0
    off; 1 each replica keeps 1/dp of the optimizer slots (gradients
    reduce-scattered into them, updates all-gathered); 2 also keeps each
    micro-batch's gradient sum as its block only; 3 (FSDP) also splits
    the trainable weights over dp, each gathered whole just before its
    forward readers and again for its backward readers.
  zero_prefetch: zero=3 only: how many layers ahead a weight gather may run
    (1: layer i+1's gather while layer i computes; about prefetch + 2
    layers' weights are whole at once); without micro-batches or stages.
  zero_gather_compute_dtype: zero=3 only: a weight the forward reads only
    cast to float16 (mixed precision) is cast on its block and gathered in
    float16, half the bytes (bfloat16, which TF's CollectiveGatherV2 does
    not take, is gathered in float32; one line says so).
  offload: None or 'optimizer': the optimizer slots and the update ops that
    compute only from them and the gradients live on each device's host CPU
    (memory/offload.py); offload_device names one host for every device
    instead (default: CPU:0 of the device's own task).
  gradient_reduce_dtype: None (gradients are reduced over the data axis in
    the dtype the graph accumulates them in: exact), or 'bfloat16': float32
    gradients travel in bfloat16 (sharding/buckets.py), half the bytes, at
    the price of rounding each device's partial gradient and each partial
    sum to 8 significant bits; updates then agree with the original to the
    bfloat16 precision's spread, not to float32's (runtime/verify.py checks
    it so).
  sequence_parallel: in the megatron preset's tensor-parallel regions, the
    ops between a row-parallel output and the next column-parallel input
    (norms, dropout, residual and bias adds) run on 1/tp of the sequence:
    each forward all-reduce becomes a reduce-scatter there and an
    all-gather before the column-parallel contractions
    (strategies/sequence_parallel.py).
  split_embeddings: with the megatron preset, embedding tables (trainable
    [vocabulary, hidden] variables whose rows are gathered) are split along
    their hidden dimension over the tensor axis, each lookup gathered whole
    once after it, so a large (tied) table is not held by every device
    (strategies/megatron.embedding_tables); off by default (replicated).
  batch_size: the global batch of a step traced with an unknown batch
    dimension (TensorSpec([None, ...])): its inputs are bound to it before
    the split, which needs static sizes; None: the traced batch.
  strict: a split that does less than its mesh asked (a tp or ep axis that
    splits no variable; the megatron preset's tp axis splitting under half
    of what its weight contractions read) is refused (PlanError) instead of warned about
    (passes/coverage.py).
  task: None (the graph of the whole mesh), or the index of the cluster task
    whose part alone is written (sharding/tasks.py): its nodes, the edges to
    other tasks made broadcasts, its inputs its share of the batch.
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
  virtual_stages: int = 1
  bucket_bytes: int = DEFAULT_BUCKET_BYTES
  recompute: object = None
  zero: int = 0
  zero_prefetch: int = 1
  zero_gather_compute_dtype: bool = False
  offload: Optional[str] = None
  offload_device: Optional[str] = None
  task: Optional[int] = None
  gradient_reduce_dtype: Optional[str] = None
  sequence_parallel: bool = False
  split_embeddings: bool = False
  batch_size: Optional[int] = None
  strict: bool = False

  def __post_init__(self):
    # One spelling per option: "none" (the CLI's word) is None, mappings and
    # lists are copied into the frozen record.
    if self.offload == "none":
      object.__setattr__(self, "offload", None)
    if self.recompute == "none":
      object.__setattr__(self, "recompute", None)
    object.__setattr__(self, "annotations",
                       {k: tuple(v) for k, v in dict(self.annotations or {}).items()})
    if self.layer_ranges is not None:
      object.__setattr__(self, "layer_ranges", [tuple(r) for r in self.layer_ranges])
    check_mesh_axes(self.mesh.axis_names, self.axis)
    recompute_lib.parse(self.recompute)
    if int(self.microbatches) < 1:
      raise PlanError(f"microbatches must be >= 1, got {self.microbatches}")
    if self.strategy not in STRATEGIES + (None,):
      raise PlanError(f"unknown strategy '{self.strategy}'; use 'megatron' or 'none'")
    if self.schedule not in SCHEDULES:
      raise PlanError(f"unknown pipeline schedule '{self.schedule}'; choose one of: "
                      f"{', '.join(sorted(SCHEDULES))}")
    v = self.virtual_stages
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise PlanError(f"virtual_stages must be a positive integer, got {v!r}")
    if self.schedule == "interleaved" and v < 2:
      raise PlanError(f"the interleaved schedule needs virtual_stages >= 2 model chunks "
                      f"per stage, got {v}; pass virtual_stages=2 (--virtual-stages 2) "
                      "or use the 1f1b schedule")
    if self.schedule != "interleaved" and v != 1:
      raise PlanError(f"virtual_stages={v} needs the interleaved schedule, not "
                      f"'{self.schedule}'; pass schedule='interleaved' (--schedule "
                      "interleaved) or virtual_stages=1")
    if v > 1 and self.stages < 2:
      raise PlanError(f"virtual_stages={v} interleaves model chunks over pipeline "
                      "stages, but the mesh has no 'pp' axis of 2 or more; add one "
                      "(pp=2, --stages 2) or use virtual_stages=1")
    if v > 1 and int(self.microbatches) % self.stages:
      Interleaved.check(self.stages, int(self.microbatches))
    b = self.bucket_bytes
    if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 0:
      raise PlanError(f"bucket_bytes must be a non-negative integer (0: one all-reduce "
                      f"per gradient), got {b!r}")
    if self.balance not in BALANCES:
      raise PlanError(f"unknown stage balance '{self.balance}'; choose one of: "
                      f"{', '.join(BALANCES)}")
    z = self.zero
    if isinstance(z, bool) or not isinstance(z, numbers.Integral) or z not in (0, 1, 2, 3):
      raise PlanError(f"zero must be 0, 1, 2 or 3 (optimizer-state sharding stage; 3: "
                      f"weights too), got {z!r}")
    p = self.zero_prefetch
    if isinstance(p, bool) or not isinstance(p, numbers.Integral) or p < 0:
      raise PlanError(f"zero_prefetch must be a non-negative integer (layers a weight "
                      f"gather may run ahead), got {p!r}")
    if z and self.mesh.axes.get(constants.DATA_AXIS, 1) < 2:
      raise PlanError(f"zero={z} shards optimizer state over the data axis, but mesh "
                      f"{self.mesh} has no '{constants.DATA_AXIS}' axis of 2 or more; add "
                      f"one (mesh 'dp=2,...', --mesh dp=2,...) or use zero=0")
    if self.offload not in (None,) + offload_lib.MODES:
      raise PlanError(f"unknown offload '{self.offload}'; use offload='optimizer' "
                      "(--offload optimizer) or leave it unset")
    if self.offload_device and not self.offload:
      raise PlanError(f"offload_device '{self.offload_device}' is set but offload is not; "
                      "add offload='optimizer' (--offload optimizer) or drop the device")
    if self.offload:
      offload_lib.check_hosts(self.mesh.devices, self.offload_device)
    g = self.gradient_reduce_dtype
    if g is not None and g not in GRADIENT_REDUCE_DTYPES:
      raise PlanError(f"unknown gradient reduce dtype {g!r}; use 'bfloat16' "
                      "(--gradient-reduce-dtype bfloat16) or leave it unset (the "
                      "graph's own dtype, exact)")
    if g and self.mesh.axes.get(constants.DATA_AXIS, 1) < 2:
      raise PlanError(f"gradient_reduce_dtype='{g}' lowers the gradients' all-reduce over "
                      f"the data axis, but mesh {self.mesh} has no '{constants.DATA_AXIS}' "
                      "axis of 2 or more; add one (--mesh dp=2,...) or leave it unset")

    n = self.batch_size
    if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1):
      raise PlanError(f"batch_size must be a positive integer (the global batch), got {n!r}")
    if not isinstance(self.strict, bool):
      raise PlanError(f"strict must be True or False, got {self.strict!r}")
    if not isinstance(self.sequence_parallel, bool):
      raise PlanError(f"sequence_parallel must be True or False, got {self.sequence_parallel!r}")
    if self.sequence_parallel:
      axis = self.split_axis(self.mesh)
      if self.strategy != "megatron" or axis is None or self.mesh.axes.get(axis, 1) < 2:
        raise PlanError(
            f"sequence_parallel splits the megatron preset's tensor-parallel regions over "
            f"the sequence, but mesh {self.mesh} with strategy '{self.strategy}' has none; "
            "add a tensor axis (--mesh tp=2,...) with the megatron strategy, or drop "
            "sequence_parallel (--sequence-parallel)")
      if self.schedule in constants.ZERO_BUBBLE_SCHEDULES and self.stages > 1:
        raise PlanError(
            f"sequence_parallel does not combine with the {self.schedule} schedule yet (its "
            "weight-gradient blocks would wait for input gradients through the sequence "
            "gathers); use schedule='1f1b' (--schedule 1f1b) or drop sequence_parallel")

  @classmethod
  def options(cls):
    """The names of every option (each field but the mesh)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.name != "mesh")

  def replace(self, **options):
    """A copy with `options` changed, checked again."""
    return dataclasses.replace(self, **options)

  def to_json(self):
    """Every option as JSON values (the manifest's record of the split);
    the mesh by its axes (its devices are the manifest's own entry)."""
    out = {"mesh": dict(self.mesh.axes)}
    for name in self.options():
      value = getattr(self, name)
      if isinstance(value, tuple):
        value = list(value)
      elif name == "layer_ranges" and value is not None:
        value = [list(r) for r in value]
      elif name == "annotations":
        value = {k: list(v) for k, v in sorted(value.items())}
      out[name] = value
    return out

  @property
  def recompute_mode(self):
    """None, 'blocks', 'selective', 'auto' or a tuple of name scopes."""
    return recompute_lib.parse(self.recompute)

  @property
  def stages(self):
    return self.mesh.axes.get(constants.PIPELINE_AXIS, 1)

  def split_mesh(self):
    """The mesh the passes split over: the config's, plus the micro-batch
    axis, plus (expert parallelism without 'dp') a 'dp' of size 1 in front,
    so the batch split is always a compound holding 'ep' (dp*ep, dp*mb*ep)
    and an experts' split over 'ep' alone is never mistaken for it."""
    mesh = self.mesh
    if mesh.axes.get(constants.EXPERT_AXIS, 1) > 1 and constants.DATA_AXIS not in mesh.axes:
      mesh = Mesh({constants.DATA_AXIS: 1, **mesh.axes}, mesh.devices)
    return mesh.with_microbatches(int(self.microbatches))

  def split_axis(self, mesh):
    """The axis the strategy splits weights over, or None."""
    if self.axis:
      return self.axis
    if constants.TENSOR_AXIS in mesh.axes:
      return constants.TENSOR_AXIS
    model = [a for a in mesh.axis_names if a not in constants.NON_MODEL_AXES]
    return model[-1] if model else None

  def batch_axis(self, mesh):
    """'dp', 'mb', 'ep' or the compound ('dp*mb', 'dp*mb*ep', ...) that
    splits the batch, or None."""
    parts = [a for a in constants.BATCH_AXES if a in mesh.axes]
    return "*".join(parts) if parts else None
