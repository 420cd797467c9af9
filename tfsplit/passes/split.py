"""The split: an explicit sequence of GraphDef -> GraphDef passes.

    result = split_graph(graph_def, Mesh.parse("dp=2,tp=2"), microbatches=4)

Passes, in order (PASSES), over one Analysis (graph, variables, shapes,
layers) and one SplitConfig; each reads what earlier passes recorded in the
SplitState, never another module's private fields:

bind_batch              inputs traced with an unknown batch take batch_size
                        examples (or one line says how to bind it)
fold_shapes             shape arithmetic -> constants (global values); IdentityN
                        split per output; gradients TF flattens over the batch
                        (TopKV2's) written row by row (graph/gradients.py)
recompute_activations   recompute= only: forward copies for the backward,
                        gated on the gradient that starts each segment
plan_variables          variable shardings: strategy (megatron) + annotations;
                        the batch split of the inputs
propagate_layouts       a sharding for every tensor; optimizer-slot and bias
                        shardings inferred from the ops that use them
split_sequence          sequence_parallel= only: the regions between
                        row- and column-parallel contractions split over
                        the sequence (reduce-scatter / all-gather
                        constraints), propagated again
shard_optimizer_state   zero= only: optimizer slots split over dp, gradients
                        constrained to their blocks, propagated again
assign_stages           pipeline only: every node's stage (its model chunk
                        with virtual stages: chunk c runs on stage c % S)
plan_offload            offload= only: the nodes that move to the host CPU
materialize_devices     one copy of each op per device, collectives between
                        shardings (sharding/reshard.py), per-node records
check_microbatch_independence
                        no micro-batch needs another's activations, directly
                        or through an op that runs on the whole batch
order_work              micro-batch j+1 waits for micro-batch j (no pipeline),
                        or the pipeline schedule's control edges (gpipe /
                        1f1b / interleaved)
bucket_gradients        gradient all-reduces over the data axis packed into
                        buckets, one collective each (sharding/buckets.py),
                        in bfloat16 if gradient_reduce_dtype says so
offload_optimizer       offload= only: optimizer slots and their update ops
                        on each device's host CPU (memory/offload.py)
lean_constants          device copies of constants nothing reads removed,
                        identical constants on one device made one
extract_task            task= only: the nodes of one cluster task, edges to
                        other tasks made broadcasts (sharding/tasks.py)
check_acyclic           the result can run
"""
import dataclasses
import fnmatch
from typing import Dict, Optional

from absl import logging

from tfsplit import constants
from tfsplit.cost import cluster as cluster_lib
from tfsplit.cost import layer_cost
from tfsplit.cost import op_cost
from tfsplit.errors import GraphValidationError, PlanError
from tfsplit.graph import Graph
from tfsplit.graph.fold import fold_and_expand
from tfsplit.graph.functions import CONTROL_FLOW_OPS
from tfsplit.graph.counted_reductions import counted_logical_reductions
from tfsplit.graph.gradients import rowwise_gradients
from tfsplit.graph.handles import gathers_as_reads
from tfsplit.graph.ir import inputs_come_first, without_gc
from tfsplit.memory import offload as offload_lib
from tfsplit.memory import recompute as recompute_lib
from tfsplit.passes import coverage
from tfsplit.passes.analysis import Analysis
from tfsplit.passes.config import SplitConfig
from tfsplit.passes.result import SplitResult
from tfsplit.passes.tasks import extract_task, task_devices
from tfsplit.pipeline import microbatches as microbatch_lib
from tfsplit.pipeline import partition as partition_lib
from tfsplit.pipeline import schedules as schedules_lib
from tfsplit.graph.endpoints import bind_batch as bind_batch_sizes
from tfsplit.graph.endpoints import (graph_inputs, graph_outputs, unbound_batch_inputs,
                                     unknown_input_dims)
from tfsplit.sharding import buckets as buckets_lib
from tfsplit.sharding import zero as zero_lib
from tfsplit.sharding import materialize as materialize_lib
from tfsplit.layout.mesh import is_gpu
from tfsplit.sharding.propagate import propagate
from tfsplit.layout.spec import Sharding, insert_constraints
from tfsplit.strategies import experts as experts_lib
from tfsplit.strategies.megatron import (embedding_constraints, embedding_tables,
                                         find_weight_contractions, megatron_plan)
from tfsplit.strategies import sequence_parallel as sequence_lib


@dataclasses.dataclass
class SplitState:
  """What the passes have recorded so far."""
  config: SplitConfig
  mesh: object                       # the config's mesh plus the 'mb' axis
  analysis: Analysis
  plan: Dict[str, tuple] = dataclasses.field(default_factory=dict)  # handle -> dims
  explicit: Dict[str, tuple] = dataclasses.field(default_factory=dict)
  input_specs: Dict[str, Sharding] = dataclasses.field(default_factory=dict)
  propagation: object = None
  partition: Optional[list] = None   # layer names per model chunk
  stage_of: Optional[Dict[str, int]] = None  # node -> model chunk (= stage when v = 1)
  materialized: object = None
  schedule_edges: int = 0
  # recompute_activations' record (memory/recompute.Recomputed: {copy:
  # original}, segments with their gates), or None
  recomputed: object = None
  zero: object = None   # shard_optimizer_state's sharding.zero.ZeroPlan, or None
  offload: object = None  # plan_offload's memory.offload.OffloadPlan, or None
  offloaded_nodes: int = 0
  # lean_constants' finding: every input of the result names an earlier node
  # (None: not known)
  inputs_come_first: Optional[bool] = None
  task_part: object = None  # extract_task's sharding.tasks.TaskPart, or None
  # plan_variables' strategies.experts.ExpertWeight list (an 'ep' axis), or ()
  experts: tuple = ()


# --- passes ----------------------------------------------------------------------
def bind_batch(state):
  """Inputs traced with an unknown batch dimension take config.batch_size
  examples (graph/endpoints.py); without it, one line says how to bind it,
  since every split rule needs static sizes. Any other unknown input
  dimension is one line too."""
  analysis = state.analysis
  unbound = unbound_batch_inputs(analysis.graph)
  if unbound and state.config.batch_size is None:
    name, shape = unbound[0]
    more = f" (and {len(unbound) - 1} more)" if len(unbound) > 1 else ""
    raise PlanError(
        f"input '{name}'{more} has shape {shape}: its batch dimension is unknown and a "
        "split needs static sizes; bind the global batch with batch_size=N (--batch N), "
        "or trace the step with a fixed batch (tf.TensorSpec([BATCH, ...]))")
  if unbound:
    analysis.replace(bind_batch_sizes(analysis.graph_def, state.config.batch_size))
  for name, shape in unknown_input_dims(analysis.graph):
    where = "its rank is unknown" if shape is None else \
        f"dimension {shape.index(None)} is unknown"
    raise PlanError(
        f"input '{name}' has shape {shape if shape is not None else '<unknown>'}: {where} "
        "and a split needs static sizes (each rule divides them); trace the step with "
        "fixed shapes, e.g. tf.TensorSpec([BATCH, SEQUENCE], ...)")


def fold_shapes(state):
  """Static shape arithmetic folded; gradients TF flattens over the whole
  batch (TopKV2's) written row by row (graph/gradients.py); All / Any as
  counts, which stay split (graph/counted_reductions.py)."""
  analysis = state.analysis
  analysis.replace(*fold_and_expand(analysis.graph, analysis.shapes))
  graph_def, rewritten = rowwise_gradients(analysis.graph, analysis.shapes)
  counted_def, counted = counted_logical_reductions(graph_def)
  if rewritten or counted:
    shapes = analysis.shapes
    # A rewritten All / Any keeps its name, shape and dtype.
    analysis.replace(counted_def, known_shapes={n.name: shapes[n.name] for n in counted_def.node
                                                if n.name in shapes})
  for var in analysis.variables:
    if var.shape is None:
      raise PlanError(f"variable '{var.name}' (node '{var.node}') has no known shape; "
                      "load the graph from its tf.function so shapes are recorded, or "
                      "give the shapes with --variables")


def recompute_activations(state):
  """Recomputation (config.recompute): on the global, folded graph, the
  forward ops of each segment are copied for its backward pass and gated on
  the gradient that starts it (memory/recompute.py); every later pass copies
  and orders the copies as backward ops of their original's layer."""
  mode = state.config.recompute_mode
  if mode is None:
    return
  analysis = state.analysis
  state.recomputed = recompute_lib.recompute(analysis.graph, analysis.shapes,
                                             analysis.layers, mode, analysis.variables)
  analysis.replace(state.recomputed.graph_def, known_shapes=state.recomputed.known_shapes)
  logging.info("%s", recompute_lib.summary(state.recomputed))


def plan_variables(state):
  config, mesh, analysis = state.config, state.mesh, state.analysis
  if config.zero >= 3:
    # A gather straight from a weight's handle has no rule for a weight
    # split over dp: it reads the weight, then gathers (the same rows).
    params = {h for layer in analysis.layers.layers for h in layer.variables}
    graph_def, rewritten = gathers_as_reads(analysis.graph_def, analysis.graph, params)
    if rewritten:
      analysis.replace(graph_def, known_shapes=dict(analysis.shapes.by_node))
  axis = config.split_axis(mesh)
  if config.strategy == "megatron" and axis is not None:
    state.plan.update(megatron_plan(analysis.graph, analysis.shapes, analysis.variables,
                                    axis=axis, mesh=mesh, roles=analysis.roles,
                                    # A sequence-split LM head would gather a
                                    # table split along its hidden dimension.
                                    embeddings=config.split_embeddings and
                                    not config.sequence_parallel))
    gathers = embedding_constraints(analysis.graph, analysis.shapes, analysis.variables,
                                    state.plan, axis)
    if gathers:
      analysis.replace(*insert_constraints(analysis.graph_def, analysis.graph,
                                           analysis.shapes, gathers))
  if mesh.axes.get(constants.EXPERT_AXIS, 1) > 1:
    state.experts = experts_lib.find_expert_weights(analysis.graph, analysis.shapes,
                                                    analysis.variables, analysis.roles)
    annotated = _annotation_plan(analysis.variables, config.annotations, mesh)
    if not state.experts and not any(constants.EXPERT_AXIS in dims
                                     for dims in annotated.values()):
      raise PlanError(
          f"mesh {config.mesh} has an '{constants.EXPERT_AXIS}' axis but the graph has no "
          "expert weights (a trainable [experts, ...] variable whose dimension 0 an einsum "
          "or batched matmul keeps in its output); drop the axis, or annotate the expert "
          f"weights (--annotate 'NAME={constants.EXPERT_AXIS},-,-')")
    state.plan.update(experts_lib.expert_plan(state.experts, mesh, state.plan))
  state.plan.update(_annotation_plan(analysis.variables, config.annotations, mesh))
  state.explicit = dict(state.plan)
  batch_axis = config.batch_axis(mesh)
  if batch_axis:
    state.input_specs = _batch_specs(analysis, mesh, batch_axis)


def propagate_layouts(state):
  analysis, mesh = state.analysis, state.mesh
  specs = {}
  for var in analysis.variables:
    dims = state.plan.get(var.node, (None,) * len(var.shape))
    specs[var.node] = Sharding(tuple(dims))
    specs[var.node].local_shape(var.shape, mesh, f"variable '{var.name}'")
  state.propagation = propagate(analysis.graph, analysis.shapes, mesh, specs,
                                state.input_specs, analysis.variables, state.explicit)


def split_sequence(state):
  """Sequence parallelism (config.sequence_parallel): sharding constraints
  that split the norms, residual and bias adds between the preset's
  row- and column-parallel contractions over the sequence
  (strategies/sequence_parallel.py), then propagation again."""
  if not state.config.sequence_parallel:
    return
  analysis = state.analysis
  sp = sequence_lib.SequenceParallel(analysis, state.propagation, state.mesh,
                                     state.config.split_axis(state.mesh))
  if not sp.scattered:
    raise PlanError("sequence_parallel: the megatron preset found no row-parallel "
                    "contraction with a partial output over "
                    f"{state.config.split_axis(state.mesh)} (no tensor-parallel block); "
                    "drop sequence_parallel (--sequence-parallel)")
  analysis.replace(*sp.graph_def())
  propagate_layouts(state)


def shard_optimizer_state(state):
  """Optimizer-state sharding (config.zero): each optimizer slot split over
  'dp' on top of the sharding propagation gave it, each weight's gradient
  constrained to that split (reduce-scattered into it), every variable's
  sharding then fixed and propagated again (sharding/zero.py)."""
  if not state.config.zero:
    return
  analysis, specs = state.analysis, state.propagation.variable_specs
  config = state.config
  state.zero = zero_lib.plan_zero(analysis, state.propagation, state.mesh, config.zero)
  prefetch = config.zero_prefetch
  if state.zero.weights and (config.stages > 1 or
                             state.mesh.axes.get(constants.MICROBATCH_AXIS, 1) > 1):
    # A gate on an earlier layer's readers would wait for every micro-batch's.
    logging.warning("zero=3: weight gathers are not ordered layer by layer with %s (each "
                    "runs when the step starts); zero_prefetch applies without them",
                    "pipeline stages" if config.stages > 1 else "micro-batches")
    prefetch = None
  # A zero-bubble schedule orders a layer's weight gradients after its
  # input gradients, which a gate on the gradient reaching a layer can
  # close into a cycle: its backward gathers run ungated.
  gated = config.stages <= 1 or \
      not schedules_lib.get_schedule(config.schedule, config.virtual_stages).splits_backward
  dtypes = (zero_lib.HALF,) if config.zero_gather_compute_dtype else ()
  analysis.replace(*zero_lib.constrain_gradients(analysis, state.zero, prefetch, gated,
                                                 dtypes))
  state.plan = {handle: tuple(spec.dims) for handle, spec in specs.items()}
  state.plan.update(state.zero.dims)
  state.plan.update(state.zero.weights)
  state.explicit = dict(state.plan)
  propagate_layouts(state)


def assign_stages(state):
  stages = state.config.stages
  if stages <= 1 and constants.PIPELINE_AXIS not in state.mesh.axes:
    return
  analysis = state.analysis
  layer_costs = boundary_costs = None
  if state.config.layer_ranges is None and state.config.balance == "cost":
    layer_costs, boundary_costs = _stage_costs(analysis, state.mesh)
  state.partition = partition_lib.partition_layers(analysis.layers, stages,
                                                   state.config.layer_ranges,
                                                   layer_costs, boundary_costs,
                                                   state.config.virtual_stages)
  state.stage_of = partition_lib.assign_stages(analysis.graph, analysis.layers,
                                               state.partition)


def materialize_devices(state):
  """One copy of each op per device (sharding/materialize.py); with task=
  and no pipeline stage boundary between tasks, only that task's devices
  (nothing but collectives crosses tasks then, and every task makes its
  collectives, and their keys, in the same order)."""
  analysis = state.analysis
  state.materialized = materialize_lib.materialize(
      analysis.graph, analysis.shapes, state.mesh, state.propagation, analysis.variables,
      state.config.timeout_seconds, state.stage_of,
      scatter_microbatches=state.config.zero >= 2,
      moved=state.offload.nodes if state.offload else (), only=task_devices(state))
  if state.zero is not None:
    zero_lib.annotate_manifest(state.materialized.manifest, state.zero, analysis.variables)


def check_microbatch_independence(state):
  """Refuses a micro-batch whose work needs another micro-batch's activations
  (pipeline/microbatches.py check_independence): micro-batching would then
  save no memory, or could not be ordered."""
  analysis, out = state.analysis, state.materialized
  microbatch_lib.check_independence(analysis.graph, analysis.roles, analysis.variable_free,
                                    out.records, out.collectives,
                                    state.propagation.fallbacks, state.mesh)


def order_work(state):
  """Micro-batch order without a pipeline; the schedule's order with one."""
  out, analysis = state.materialized, state.analysis
  if state.stage_of is None and (
      state.mesh.axes.get(constants.MICROBATCH_AXIS, 1) <= 1 or not out.local_sums):
    return  # nothing to order (order_microbatches would add no edge)
  schedule = (None if state.stage_of is None else
              schedules_lib.get_schedule(state.config.schedule, state.config.virtual_stages))
  sets = schedules_lib.micro_batch_sets(
      out.graph_def, out.records, analysis.layers.block_roles(), state.mesh,
      schedules_lib.waiting_for_updates(analysis.graph, analysis.roles), state.stage_of,
      split_backward=schedule is not None and schedule.splits_backward)
  if schedule is None:
    microbatch_lib.order_microbatches(out.graph_def, sets, out.local_sums, state.mesh)
    return
  state.schedule_edges = schedules_lib.apply_schedule(
      out.graph_def, schedule, sets, state.mesh, state.config.stages,
      state.config.microbatches)


def bucket_gradients(state):
  """One all-reduce per bucket of gradients over the data axis, not per
  tensor (in config.gradient_reduce_dtype, if set)."""
  config, mesh = state.config, state.mesh
  batch_axis = config.batch_axis(mesh)
  if not (config.bucket_bytes or config.gradient_reduce_dtype) or batch_axis is None:
    return
  axes = [a for a in mesh.axis_parts(batch_axis)
          if mesh.axes[a] > 1 and not mesh.is_local(a)]
  out = state.materialized
  # zero=3: each layer's weight gathers of one pass packed together, apart
  # from the gradients' buckets.
  labels = zero_lib.weight_gather_labels(state.analysis, state.zero, out.collectives) \
      if state.zero is not None else {}
  out.collectives.extend(buckets_lib.bucket_gradients(
      out, state.analysis, state.propagation, mesh, axes, config.bucket_bytes,
      config.gradient_reduce_dtype, skip=frozenset(labels)))
  if labels:
    out.collectives.extend(buckets_lib.bucket_gradients(
        out, state.analysis, state.propagation, mesh, axes, config.bucket_bytes,
        labels=labels))


def plan_offload(state):
  """CPU offload (config.offload): which original nodes move to their
  device's host (optimizer slots, their reads and writes, and the update ops
  computing only from slots and gradients; memory/offload.py). Planned before
  materialization, which keeps their constants apart from those that stay."""
  if state.config.offload:
    state.offload = offload_lib.plan_offload(state.analysis, state.mesh,
                                             state.config.offload_device)


def offload_optimizer(state):
  """Moves the planned nodes' copies, by their records, to each device's host
  CPU; the manifest says where each slot's shards live."""
  if state.offload is None:
    return
  state.offloaded_nodes = offload_lib.apply_offload(state.materialized, state.offload,
                                                    state.analysis.variables)
  logging.info("%s", offload_lib.summary(state.materialized.manifest,
                                         state.offloaded_nodes).strip())


def lean_constants(state):
  """Removes the device copies of constants that nothing reads, and makes the
  identical constants on each device one (sharding/materialize.py
  lean_constants); records whether every input names an earlier node
  (state.inputs_come_first), which the acyclic check would otherwise scan
  for again."""
  state.inputs_come_first = materialize_lib.lean_constants(
      state.materialized, graph_outputs(state.analysis.graph))


def check_acyclic(state):
  if state.inputs_come_first or (state.inputs_come_first is None and
                                 inputs_come_first(state.materialized.graph_def)):
    return  # materialize adds nodes after their inputs; schedules may not
  try:
    Graph(state.materialized.graph_def).topological_order()
  except GraphValidationError as e:
    raise PlanError(f"the {state.config.schedule} schedule would make the graph cyclic "
                    f"({e}); try another schedule or partition") from None


PASSES = (bind_batch, fold_shapes, recompute_activations, plan_variables, propagate_layouts,
          split_sequence, shard_optimizer_state, assign_stages, plan_offload, materialize_devices,
          check_microbatch_independence, order_work, bucket_gradients, offload_optimizer,
          lean_constants, extract_task, check_acyclic)


@without_gc
def run_passes(graph_def, config):
  """SplitResult of running PASSES over `graph_def` under `config`."""
  state = SplitState(config, config.split_mesh(),
                     Analysis(graph_def))
  if not state.analysis.variables:   # inspect may still list a stateless graph's fallbacks
    raise PlanError("the graph has no variables (no VarHandleOp, no captured resource "
                    "placeholder): there is nothing to split or train; give the training "
                    "step's graph (tf.io.write_graph(fn.get_concrete_function(...).graph"
                    ".as_graph_def(), ...)), not a frozen or variable-free one")
  for pass_fn in PASSES:
    pass_fn(state)
  out, prop = state.materialized, state.propagation
  loops = _warn_whole_loops(state.analysis.graph)
  by_node = {v.node: v.name for v in state.analysis.variables}
  var_specs = {by_node[h]: s.dims for h, s in prop.variable_specs.items()
               if not s.is_replicated}
  logging.info("split over %s: %d variables split, %d all-reduces, %d all-gathers, "
               "%d fallbacks", state.mesh, len(var_specs),
               sum(c.kind == "all_reduce" for c in out.collectives),
               sum(c.kind == "all_gather" for c in out.collectives), len(prop.fallbacks))
  result = SplitResult(out.graph_def, out.manifest, out.collectives, prop.fallbacks,
                       var_specs, out.output_copies, out.records, config, state.mesh,
                       state.partition, state.stage_of, state.schedule_edges, state.offload,
                       state.offloaded_nodes, state.task_part, tuple(state.experts))
  logging.info("%s", coverage.axis_line(result).strip())
  coverage.check(result, loops, _contraction_weights(state))
  return result


def split_graph(graph_def, config, **options):
  """Splits `graph_def` under `config`, a SplitConfig. A Mesh in its place
  with SplitConfig's fields as keywords is the short form
  (split_graph(g, mesh, microbatches=2)); keywords beside a SplitConfig
  replace its fields."""
  if not isinstance(config, SplitConfig):
    config = SplitConfig(config, **options)
  elif options:
    config = config.replace(**options)
  return run_passes(graph_def, config)


# --- helpers -----------------------------------------------------------------------
def _contraction_weights(state):
  """{variable name: 'table' | 'weight'} of what a tp axis could split (the
  trainable operands of forward weight contractions, embedding tables):
  what coverage.short_of measures the split against. Empty unless the
  megatron preset runs over a tp axis."""
  config, analysis = state.config, state.analysis
  if config.strategy != "megatron" or \
      config.mesh.axes.get(constants.TENSOR_AXIS, 1) < 2:
    return {}
  by_node = {v.node: v.name for v in analysis.variables}
  could = {var.name: "weight" for _, _, var, _ in find_weight_contractions(
      analysis.graph, analysis.shapes, analysis.variables, analysis.roles)}
  for var, _ in embedding_tables(analysis.graph, analysis.variables):
    could[by_node[var.node]] = "table"
  return could


def _warn_whole_loops(graph):
  """One warning naming the loops (and Case) kept whole: their bodies are
  not split, the ops around them are. Returns their names."""
  loops = [n for n in graph.nodes if n.op in CONTROL_FLOW_OPS]
  if loops:
    named = ", ".join(f"'{n.name}' (op {n.op})" for n in loops[:3])
    more = f" and {len(loops) - 3} more" if len(loops) > 3 else ""
    logging.warning("%s%s: functional control flow runs whole on each device (its body "
                    "is not split, its inputs gathered); the layers around it split as "
                    "usual", named, more)
  return [n.name for n in loops]


def _stage_costs(analysis, mesh):
  """(seconds per model layer, seconds per cut) on the mesh's kind of device:
  roofline op times, and activations plus their gradients over one link."""
  gpu = any(is_gpu(d) for d in mesh.devices)
  cluster = cluster_lib.from_preset("h100-80gb" if gpu else "cpu-host", num_devices=2,
                                    devices_per_host=2)
  model = op_cost.CostModel(cluster)
  seconds = layer_cost.layer_seconds(analysis.graph, analysis.shapes, analysis.layers, model)
  link = cluster.link(0, 1)
  cuts = [2 * link.transfer_time(b) if b else 0.0
          for b in layer_cost.boundary_bytes(analysis.graph, analysis.shapes,
                                             analysis.layers)]
  return seconds, cuts


def _annotation_plan(variables, annotations, mesh):
  """{handle node: dims} from {variable-name glob: dims}."""
  plan = {}
  for var in variables:
    for pattern, dims in annotations.items():
      if fnmatch.fnmatchcase(var.name, pattern):
        dims = tuple(dims)
        if len(dims) != len(var.shape):
          raise PlanError(f"annotation '{pattern}' gives {len(dims)} dims for variable "
                          f"'{var.name}' of rank {len(var.shape)}")
        for a in dims:
          if a is not None and a not in mesh.axes:
            raise PlanError(f"annotation '{pattern}' names axis '{a}', not in mesh {mesh}")
        plan[var.node] = dims
        break
  return plan


def _batch_specs(analysis, mesh, batch_axis):
  """Input placeholders split along dimension 0 (the batch) over `batch_axis`."""
  specs = {}
  n = mesh.size_of(batch_axis)
  for name in graph_inputs(analysis.graph):
    info = analysis.shapes[name][0]
    if info.shape is None or not info.shape or info.shape[0] is None:
      raise PlanError(
          f"input '{name}' has shape {info.shape}: data parallelism / micro-batching "
          "needs a static batch dimension first; trace the function with a fixed batch "
          "size (tf.TensorSpec([BATCH, ...]))")
    if info.shape[0] % n:
      parts = " x ".join(f"{a}={mesh.axes[a]}" for a in mesh.axis_parts(batch_axis))
      raise PlanError(
          f"input '{name}': global batch {info.shape[0]} does not divide by {parts} "
          f"(= {n}); use a batch that is a multiple of {n}, or fewer replicas / "
          "micro-batches")
    specs[name] = Sharding.split(len(info.shape), 0, batch_axis)
  return specs
