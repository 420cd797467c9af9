"""What the planner knows of a model: one row per layer with parameters.

Searching over GraphDef operators explodes; searching over layers is
tractable. A ModelProfile holds, per model layer (the layers with parameters
of tfsplit.graph.layers, the units a pipeline cuts), at the graph's global
batch on one device of the cluster:

  forward / backward   seconds of its ops (layers without parameters, such
                       as the loss, join the layer before them), split
                       between forward and backward by the layer's FLOPs;
                       the part of each op's time that does not shrink with
                       the batch (the per-op overhead and, with a calibration
                       table, its op type's fixed time) is kept apart
                       (forward_fixed / backward_fixed)
  update               seconds of its optimizer update ops, and of its ops
                       that read nothing computed from the batch (they run
                       once per step, not per micro-batch); update_fixed
  variables, tp_collectives   its weight tensors, and its matrices (an
                       all-reduce each when split over tp)
  params / slots       bytes of its weights and of their optimizer state
  activations          bytes its backward pass reads (kept, or recomputed)
  input_bytes          bytes of the forward tensors entering it (what a
                       recomputed block keeps, and what each tensor-parallel
                       all-reduce of a block moves)
  splittable           a repeated block: the megatron preset splits it over
                       'tp' (2 all-reduces forward, 2 backward) unless the
                       plan replicates it; the other layers (embedding,
                       head) stay replicated

and, per cut between layers k and k + 1, the bytes of forward activations
crossing it. A calibration table made on this machine adds what its
logical devices pay apart from ops (concurrency, collective and transfer
overheads: see costing.py). Everything but the per-op overhead scales linearly with the
batch, so a candidate's micro-batch only rescales the row. `from_graph` measures a GraphDef;
`synthetic_gpt` builds the same table from a GPT's sizes (benchmarks of
models too large to trace here).
"""
import dataclasses
import math
from typing import List, Optional

from tfsplit import constants
from tfsplit.errors import PlanError


@dataclasses.dataclass
class LayerRow:
  name: str
  forward: float            # seconds at the global batch, one device
  backward: float
  update: float
  params: int               # bytes
  slots: int                # bytes
  activations: int          # bytes at the global batch
  input_bytes: int          # bytes at the global batch
  splittable: bool
  max_tp: int = 1 << 30     # tensor-parallel sizes above this cannot split it
  # Seconds of per-op overhead inside forward / backward: paid per op run,
  # whatever the micro-batch size (a calibrated cost model's op_overhead).
  forward_fixed: float = 0.0
  backward_fixed: float = 0.0
  update_fixed: float = 0.0  # the part of `update` that ZeRO's sharding keeps
  # Ops priced in forward / backward / update (each pays the profile's op_gap).
  forward_ops: int = 0
  backward_ops: int = 0
  update_ops: int = 0
  variables: int = 0        # weight tensors (ZeRO gathers each one)
  # All-reduces per micro-batch when split over tp (a row-parallel matrix
  # all-reduces its output, a column-parallel one its input's gradient, once
  # per input): 4 in a transformer block.
  tp_collectives: int = 4
  # Split over tp by the megatron preset: the blocks (unless the plan
  # replicates them), and any other layer whose weight contractions the
  # preset pairs (an MLP's first and last dense layers: priced whole, the
  # example MLPs' tp=2 steps were predicted with 2 of the 3 all-reduces
  # the rewrite emits, at 0.78-0.81 of their time). None: splittable.
  tp_split: Optional[bool] = None
  # A mixture-of-experts layer: its expert count, the bytes of its stacked
  # expert weights (in params; an 'ep' axis splits them, their gradients
  # and their optimizer state by whole experts), and the bytes of tokens one
  # forward at the global batch sends to the experts and back (an
  # all-to-all each way over ep, the same again in the backward).
  experts: int = 0
  expert_params: int = 0
  expert_exchange: int = 0
  # The share of `backward` that computes weight gradients (what the
  # zero-bubble schedules run apart, after the input gradients).
  weight_share: float = constants.DEFAULT_WEIGHT_FRACTION

  def __post_init__(self):
    if self.tp_split is None:
      self.tp_split = self.splittable


@dataclasses.dataclass
class ModelProfile:
  layers: List[LayerRow]
  cuts: List[int]           # bytes crossing the cut after layer k, k < n - 1
  batch: int                # global batch (dimension 0 of the inputs)
  other_update: float = 0.0  # seconds of update ops shared by all layers
  static_bytes: int = 0     # inputs and constants, on every device
  step_overhead: float = 0.0  # seconds a step costs before its first op
  # Seconds each further pipeline stage adds beyond its transfers (the
  # table's stage_overhead); None (a table from before it was measured):
  # step_overhead.
  stage_overhead: Optional[float] = None
  source: Optional[str] = None
  # Logical devices sharing one machine's cores (a calibration table's
  # measurements): how many compute at once (None: every device is its own
  # hardware), and the fixed seconds of one collective and of one tensor
  # sent between devices.
  concurrency: Optional[float] = None
  collective_overhead: float = 0.0
  transfer_overhead: float = 0.0
  # The same two measured over more devices: {devices: value}.
  concurrency_at: dict = dataclasses.field(default_factory=dict)
  collective_at: dict = dataclasses.field(default_factory=dict)
  # Seconds every op pays inside a step beyond its line (the table's
  # op_overhead, inside the fixed parts), and per device count how many
  # devices' kernels and how many devices' gaps run at once (the gaps, not
  # the ops' work, overlap on the shared cores); {}: all at the concurrency.
  op_gap: float = 0.0
  kernel_concurrency: dict = dataclasses.field(default_factory=dict)
  gap_concurrency: dict = dataclasses.field(default_factory=dict)
  other_update_ops: int = 0
  # The share of a collective's cost each further group running one at
  # the same moment adds (CostTable.collective_overlap).
  collective_overlap: float = 1.0
  # Data parallelism adds per step: an all-reduce of each step output
  # computed from the batch (the loss), and per gradient bucket a concat
  # before its all-reduce and a split after it on every replica, priced
  # as (fixed seconds, seconds per byte) by the cost model.
  step_outputs: int = 1
  bucket_copy: tuple = (0.0, 0.0)

  def __post_init__(self):
    if not self.layers:
      raise PlanError(f"{self.source or 'the model'} has no layers with parameters: "
                      "nothing to plan; give a training step that updates weights")
    if len(self.cuts) != len(self.layers) - 1:
      raise PlanError(f"model profile: {len(self.cuts)} cuts for {len(self.layers)} "
                      "layers; expected one cut between each pair of layers")

  def concurrency_for(self, devices):
    """How many of `devices` logical devices compute at once."""
    from tfsplit.cost import op_cost  # pylint: disable=import-outside-toplevel
    return op_cost.concurrency_for({2: self.concurrency, **self.concurrency_at}, devices)

  def kernel_and_gap_concurrency(self, devices):
    """(kernels' concurrency, gaps' concurrency) of `devices` logical
    devices; None where the table measured no split."""
    if not self.op_gap or not self.gap_concurrency:
      return None
    from tfsplit.cost import op_cost  # pylint: disable=import-outside-toplevel
    return (op_cost.concurrency_for(self.kernel_concurrency, devices),
            op_cost.concurrency_for(self.gap_concurrency, devices))

  def launch(self, stages):
    """Fixed seconds of a step cut into `stages` pipeline stages: the
    launch, and what each further stage adds (its transfers apart)."""
    further = self.step_overhead if self.stage_overhead is None else self.stage_overhead
    return self.step_overhead + (stages - 1) * further

  def collective_for(self, group, groups=1):
    """Fixed seconds of one collective over `group` logical devices; with
    `groups`, of that many groups' collectives at the same moment."""
    from tfsplit.cost import op_cost  # pylint: disable=import-outside-toplevel
    return op_cost.collectives_at_once(
        op_cost.collective_for({2: self.collective_overhead, **self.collective_at}, group),
        groups, self.collective_overlap)

  @property
  def names(self):
    return [l.name for l in self.layers]

  @property
  def has_blocks(self):
    return any(l.splittable for l in self.layers)

  @property
  def experts(self):
    """The expert count every MoE layer's divides by (the 'ep' sizes that
    fit all of them), 0 without experts."""
    g = 0
    for layer in self.layers:
      if layer.experts:
        g = math.gcd(g, layer.experts)
    return g

  @property
  def experts_bytes(self):
    """Bytes of every stacked expert weight."""
    return sum(l.expert_params for l in self.layers)

  @property
  def max_tp(self):
    """Largest tensor-parallel size every splittable layer divides by."""
    return min([l.max_tp for l in self.layers if l.splittable] or [1])

  def summary(self):
    return {"layers": len(self.layers), "blocks": sum(l.splittable for l in self.layers),
            "batch": self.batch,
            "params_bytes": sum(l.params for l in self.layers),
            "slot_bytes": sum(l.slots for l in self.layers),
            "compute_seconds": sum(l.forward + l.backward for l in self.layers)}


def _dims_gcd(shapes):
  """The gcd of every dimension of the weights of rank 2 or more: the
  megatron preset splits one of them (output features, input features, or
  the heads of a [hidden, heads, head size] kernel), and tensor-parallel
  sizes must divide it."""
  g = 0
  for shape in shapes:
    if shape and len(shape) >= 2 and all(d for d in shape):
      for d in shape:
        g = math.gcd(g, d)
  return g or 1


def _max_tp(dims_gcd):
  """Largest power of two dividing `dims_gcd` (tp sizes the planner tries)."""
  return dims_gcd & -dims_gcd


def global_batch(graph, shapes):
  """Dimension 0 shared by every input: the batch data parallelism splits."""
  from tfsplit.graph.endpoints import graph_inputs  # pylint: disable=import-outside-toplevel
  batch = 0
  for name in graph_inputs(graph):
    info = shapes[name][0] if name in shapes else None
    if info is None or not info.shape or info.shape[0] is None:
      raise PlanError(f"input '{name}' has no static batch dimension; planning splits the "
                      "batch, so trace the step with a fixed batch size "
                      "(tf.TensorSpec([BATCH, ...]))")
    batch = math.gcd(batch, int(info.shape[0]))
  if not batch:
    raise PlanError("the graph has no inputs: planning splits the batch; give a training "
                    "step that takes its batch as input")
  return batch


def _weight_shares(analysis, report, owner, count):
  """Per model layer: the share of its backward FLOPs that compute weight
  gradients (graph.weight_gradients; the default share for a layer without
  backward FLOPs)."""
  from tfsplit.graph import flops as flops_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.weight_gradients import weight_gradient_nodes  # pylint: disable=import-outside-toplevel
  graph, roles = analysis.graph, analysis.roles
  backward = {n for n, r in roles.items() if r == constants.BACKWARD}
  in_blocks = {n for n, r in roles.items() if r in (constants.FORWARD, constants.BACKWARD)}
  weights = weight_gradient_nodes(graph, backward, in_blocks)
  totals = [[0.0, 0.0] for _ in range(count)]
  for layer in report.layers:
    if layer.name not in owner:
      continue
    for name in layer.backward:
      node = graph.node(name)
      f = 0 if node.op in flops_lib.ZERO_FLOP_OPS else flops_lib.op_flops(node, analysis.shapes)
      totals[owner[layer.name]][0] += f if name in weights else 0
      totals[owner[layer.name]][1] += f
  return [w / t if t else constants.DEFAULT_WEIGHT_FRACTION for w, t in totals]


def from_analysis(analysis, cost_model, source=None):
  """The ModelProfile of a training step (an Analysis of its GraphDef) with
  times from `cost_model` (a tfsplit.cost.op_cost.CostModel) on device 0."""
  from tfsplit.cost import layer_cost  # pylint: disable=import-outside-toplevel
  from tfsplit.cost import op_cost  # pylint: disable=import-outside-toplevel
  graph, shapes, report = analysis.graph, analysis.shapes, analysis.layers
  model = report.model_layers
  if not model:
    raise PlanError(f"{source or 'the graph'} has no layers with parameters: nothing to "
                    "plan; give a training step that updates weights")
  cuts = layer_cost.boundary_bytes(graph, shapes, report)
  # Layers without parameters (the loss) run with the model layer before them:
  # their saved activations live there too.
  owner = layer_cost.owner_index(report)
  acts = [0] * len(model)
  for layer in report.layers:
    if layer.name in owner:
      acts[owner[layer.name]] += layer.activation_bytes

  # Ops that read nothing computed from the batch (weight reads, casts and
  # transposes of weights, shapes) run once per step, not per micro-batch.
  from tfsplit.graph.endpoints import graph_inputs  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.ir import Graph  # pylint: disable=import-outside-toplevel
  batch_dependent = set(graph_inputs(graph))
  for name in graph.topological_order():
    if any(port >= 0 and src in batch_dependent
           for src, port in Graph.inputs(graph.node(name))):
      batch_dependent.add(name)

  def parts(names, per_step=None):
    """(fixed, total) seconds and the count of the compute ops among
    `names`; with per_step (a [fixed, total, ops] list), ops that do not
    depend on the batch go there instead."""
    fixed = total = 0.0
    ops = 0
    for name in names:
      node = graph.node(name)
      cost = op_cost.node_cost(node, shapes, graph)
      if not cost.comm:  # a signature only matters to a table's measured entries
        f, w = cost_model.compute_parts(cost, 0, op_cost.signature(node, shapes)
                                        if cost_model.table is not None else None)
        if per_step is not None and name not in batch_dependent:
          per_step[0] += f
          per_step[1] += f + w
          per_step[2] += 1
          continue
        fixed += f
        total += f + w
        ops += 1
    return fixed, total, ops

  # The repeated blocks have the same ops and parameter shapes: price one
  # block's update for all (the update is most of a training graph's ops).
  block_update = {}

  def layer_update(layer):
    if not layer.block:
      return parts(layer.update)
    key = (len(layer.update), layer.param_bytes, layer.slot_bytes)
    if key not in block_update:
      block_update[key] = parts(layer.update)
    return block_update[key]

  # Ops run per micro-batch: each pays its fixed time (the per-op overhead
  # and its op type's set-up) whatever the micro-batch; the rest scales.
  fixed_f, fixed_b, seconds = [0.0] * len(model), [0.0] * len(model), [0.0] * len(model)
  ops_f, ops_b = [0] * len(model), [0] * len(model)
  once = [[0.0, 0.0, 0] for _ in model]   # per layer: ops that run once per step
  for layer in report.layers:
    if layer.name in owner:
      k = owner[layer.name]
      f, total_f, n_f = parts(layer.forward, once[k])
      b, total_b, n_b = parts(layer.backward, once[k])
      fixed_f[k] += f
      fixed_b[k] += b
      ops_f[k] += n_f
      ops_b[k] += n_b
      seconds[k] += total_f + total_b
  var_shape = {v.node: v.shape for v in analysis.variables}
  # The all-reduces the megatron preset's split of each block adds, counted
  # as the rewrite emits them.
  from tfsplit.strategies.megatron import split_all_reduces  # pylint: disable=import-outside-toplevel
  all_reduces = split_all_reduces(graph, shapes, analysis.variables, analysis.roles,
                                  analysis.variable_free)
  tp_collectives, split_by_preset = [0] * len(model), [False] * len(model)
  for layer in report.layers:
    if layer.name in owner:
      tp_collectives[owner[layer.name]] += sum(all_reduces.get(n, 0) for n in layer.forward)
      split_by_preset[owner[layer.name]] |= any(n in all_reduces for n in layer.forward)
  experts = _expert_rows(analysis, model)
  weight_share = _weight_shares(analysis, report, owner, len(model))
  rows = []
  for k, layer in enumerate(model):
    flops = layer.forward_flops + layer.backward_flops
    fshare = layer.forward_flops / flops if flops else 1 / 3
    work = max(0.0, seconds[k] - fixed_f[k] - fixed_b[k])
    upd_fixed, upd, upd_ops = layer_update(layer)
    upd_fixed, upd, upd_ops = upd_fixed + once[k][0], upd + once[k][1], upd_ops + once[k][2]
    rows.append(LayerRow(
        name=layer.name, forward=work * fshare, backward=work * (1 - fshare),
        forward_fixed=fixed_f[k], backward_fixed=fixed_b[k],
        update=upd, update_fixed=upd_fixed, variables=len(layer.variables),
        forward_ops=ops_f[k], backward_ops=ops_b[k], update_ops=upd_ops,
        tp_collectives=tp_collectives[k],
        params=layer.param_bytes,
        slots=layer.slot_bytes, activations=acts[k],
        input_bytes=cuts[k - 1] if k > 0 else 0, splittable=layer.block,
        tp_split=layer.block or split_by_preset[k],
        max_tp=_max_tp(_dims_gcd(var_shape.get(v) for v in layer.variables)),
        weight_share=weight_share[k], **experts.get(k, {})))
  shared = [l for l in report.layers if not l.variables]
  _, other, other_ops = parts([n for l in shared for n in l.update])
  table = cost_model.table
  from tfsplit.graph.endpoints import graph_outputs  # pylint: disable=import-outside-toplevel
  step_outputs = sum(1 for name in graph_outputs(graph) if name in batch_dependent)
  bucket_copy = _bucket_copy(cost_model)
  # Constants and inputs sit on every device (the memory estimator's static
  # part without the variables, which the rows hold).
  from tfsplit.memory import graph_memory  # pylint: disable=import-outside-toplevel
  whole = graph_memory.static_memory(graph, shapes, [], {}, ["all"])[0]
  return ModelProfile(rows, cuts, global_batch(graph, shapes), other_update=other,
                      other_update_ops=other_ops,
                      op_gap=cost_model.op_overhead,
                      kernel_concurrency=dict(table.kernel_concurrency)
                      if table is not None else {},
                      gap_concurrency=dict(table.gap_concurrency) if table is not None else {},
                      static_bytes=whole.constants + whole.inputs,
                      step_overhead=table.step_overhead + table.graph_call_overhead(graph)
                      if table is not None else 0.0,
                      stage_overhead=table.stage_overhead if table is not None else None,
                      source=source,
                      concurrency=table.concurrency if table is not None else None,
                      collective_overhead=table.collective_overhead
                      if table is not None else 0.0,
                      transfer_overhead=table.transfer_overhead
                      if table is not None else 0.0,
                      concurrency_at=dict(table.concurrency_at) if table is not None else {},
                      collective_at=dict(table.collective_at) if table is not None else {},
                      collective_overlap=table.collective_overlap if table is not None
                      else 1.0,
                      step_outputs=step_outputs, bucket_copy=bucket_copy)


def _expert_rows(analysis, model):
  """{model layer index: LayerRow expert fields} of the layers holding
  stacked expert weights (strategies/experts.py finds them as the rewrite
  does)."""
  from tfsplit.strategies import experts as experts_lib  # pylint: disable=import-outside-toplevel
  found = experts_lib.find_expert_weights(analysis.graph, analysis.shapes,
                                          analysis.variables, analysis.roles)
  if not found:
    return {}
  size = {v.node: v.num_bytes or 0 for v in analysis.variables}
  position = {n: i for i, n in enumerate(analysis.graph.topological_order())}
  by_layer = {}
  for k, layer in enumerate(model):
    mine = [e for e in found if e.node in layer.variables]
    if mine:
      by_layer[k] = {
          "experts": math.gcd(*[e.experts for e in mine]),
          "expert_params": sum(size[e.node] for e in mine),
          "expert_exchange": experts_lib.token_exchange_bytes(
              analysis.graph, analysis.shapes, mine, position)}
  return by_layer


def _bucket_copy(cost_model, nbytes=1 << 20):
  """(fixed seconds, seconds per byte) of packing a gradient bucket of
  float32 gradients (ConcatV2) and unpacking it (SplitV), on device 0."""
  from tfsplit.cost import op_cost  # pylint: disable=import-outside-toplevel

  def seconds(size):
    return sum(cost_model.compute_time(op_cost.NodeCost("bucket", op, 0, size, size))
               for op in ("ConcatV2", "SplitV"))
  fixed = seconds(4)
  return fixed, max(0.0, seconds(nbytes) - fixed) / nbytes


def from_graph(graph_def, cost_model, source=None):
  """from_analysis of a GraphDef."""
  from tfsplit.passes.analysis import Analysis  # pylint: disable=import-outside-toplevel
  return from_analysis(Analysis(graph_def), cost_model, source)


def synthetic_gpt(blocks=96, hidden=12288, seq_len=2048, batch=1536, vocab=51200,
                  heads=96, peak_flops=989.4e12, memory_bandwidth=3.35e12,
                  efficiency=0.5, dtype_bytes=2, optimizer_bytes=12, experts=0, top_k=2,
                  capacity_factor=1.25):
  """The profile of a GPT training step from its sizes (GPT-3 175B at the
  defaults), on a device of `peak_flops` at `efficiency`.

  Per block: 24 s b h^2 (1 + s / 6h) forward FLOPs (Narayanan et al. 2021),
  backward twice that; 12 h^2 parameters; activations s b h (34 + 5 a s / h)
  bytes (Korthikanti et al. 2022). Mixed precision: 16-bit weights and
  gradients, `optimizer_bytes` per parameter of fp32 master copy and Adam
  moments. The update reads and writes 16 + optimizer_bytes bytes per
  parameter at `memory_bandwidth`.

  experts > 0: every block's MLP is a mixture of that many experts (8 h^2
  parameters each) with top_k routing at capacity_factor (GShard / Switch
  capacity dispatch): the MLP's 16 s b h^2 FLOPs run top_k * capacity_factor
  times, and the dispatched tokens, top_k * capacity_factor * s b h, go to
  the experts and back.
  """
  rate = peak_flops * efficiency

  def row(name, params, fwd_flops, acts, inp, splittable, **more):
    p = params * dtype_bytes
    return LayerRow(name=name, forward=fwd_flops / rate, backward=2 * fwd_flops / rate,
                    update=params * (2 * dtype_bytes + optimizer_bytes + 4) /
                    memory_bandwidth,
                    params=p, slots=params * optimizer_bytes, activations=acts,
                    input_bytes=inp, splittable=splittable,
                    max_tp=_max_tp(math.gcd(heads, hidden)) if splittable else 1 << 30,
                    **more)

  sbh = seq_len * batch * hidden
  stream = sbh * dtype_bytes
  block_flops = 24 * sbh * hidden * (1 + seq_len / (6 * hidden))
  block_acts = sbh * 34 + 5 * heads * seq_len * seq_len * batch
  block_params, moe = 12 * hidden * hidden, {}
  if experts:
    routed = top_k * capacity_factor
    block_flops += 16 * sbh * hidden * (routed - 1)
    block_params = 4 * hidden * hidden + 8 * hidden * hidden * experts
    moe = {"experts": experts, "expert_params": 8 * hidden * hidden * experts * dtype_bytes,
           "expert_exchange": int(2 * routed * stream)}
  rows = [row("embed", vocab * hidden + seq_len * hidden, 0, 0, 0, False)]
  rows[0] = dataclasses.replace(rows[0], forward=stream / memory_bandwidth,
                                backward=2 * stream / memory_bandwidth)
  # The weight matmuls' FLOPs again for their weight gradients; attention's
  # score and value products (4 s^2 b h) have input gradients only.
  block_weight_share = (block_flops - 4 * sbh * seq_len) / (2 * block_flops)
  rows += [row(f"block_{i}", block_params, block_flops, block_acts, stream, True,
               weight_share=block_weight_share, **moe)
           for i in range(blocks)]
  head_flops = 2 * seq_len * batch * hidden * vocab
  rows.append(row("head", hidden * vocab, head_flops,
                  seq_len * batch * (hidden + 2 * vocab) * dtype_bytes, stream, False))
  return ModelProfile(rows, [stream] * (len(rows) - 1), batch,
                      source=f"synthetic GPT ({blocks} blocks, hidden {hidden}"
                      + (f", {experts} experts" if experts else "") + ")")
