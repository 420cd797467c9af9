"""The operator-splitting pass: GraphDef -> per-device GraphDef + manifest.

    result = split_graph(graph_def, Mesh.parse("tp=4"), strategy="megatron")
    result.graph_def   # runs on the mesh's devices, computes the same thing
    result.manifest    # variable -> its shards (device, offsets, shape)

Steps: fold static shape arithmetic into constants (global values), pick
variable shardings (strategy), propagate shardings through every op,
infer optimizer-slot shardings from the gradients that update them, then
materialize one copy of each op per device with the collectives needed.
"""
import dataclasses
import fnmatch
import json
from typing import Dict, List

from absl import logging

from tfsplit.errors import GraphValidationError, PlanError
from tfsplit.graph import Graph, find_variables, infer_shapes
from tfsplit.graph.fold import expand_identity_n, fold_static_shapes
from tfsplit.graph.ir import parse_input, without_gc
from tfsplit.graph.layers import detect_layers
from tfsplit.sharding.materialize import Materializer
from tfsplit.sharding.propagate import propagate
from tfsplit.sharding.spec import Sharding

_WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")
_MAX_ROUNDS = 4


@dataclasses.dataclass
class SplitResult:
  graph_def: object
  manifest: Dict[str, dict]
  collectives: list
  fallbacks: List[str]
  variable_specs: Dict[str, tuple]   # variable name -> dims
  # output -> [[device, local tensor name]]: every device's whole copy
  output_copies: Dict[str, list] = dataclasses.field(default_factory=dict)

  def manifest_json(self):
    return json.dumps({"variables": self.manifest, "outputs": self.output_copies},
                      indent=1, sort_keys=True)

  def count(self, kind, axis=None):
    return sum(1 for c in self.collectives
               if c.kind == kind and (axis is None or c.axis == axis))


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


def _inferred_specs(graph, prop, variables, explicit):
  """Shardings for variables the plan left open, read off the ops using them.

  A bias added to a column-split activation is required split by its
  BiasAdd; an Adam moment is updated with a split gradient. Adopting that
  sharding keeps the variable local instead of gathering its updates.
  """
  candidates = {}
  for v in variables:
    if v.node in explicit or not v.shape:
      continue
    candidates[v.node] = set()
  for node in graph.nodes:
    decision = prop.decisions.get(node.name)
    if decision is None:
      continue
    data = [t for t in node.input if not t.startswith("^")]
    for j, text in enumerate(data):
      src, port = parse_input(text)
      src_node = graph.node(src)
      if src_node.op == "ReadVariableOp":
        handle = prop.handle_source.get(parse_input(src_node.input[0])[0])
        if handle in candidates and j < len(decision.inputs) and decision.inputs[j]:
          candidates[handle].add(decision.inputs[j].dims)
      if node.op in _WRITES and j == 1:
        handle = prop.handle_source.get(parse_input(data[0])[0])
        value = prop.spec(text)
        if handle in candidates and value is not None:
          candidates[handle].add(value.dims)
  found = {}
  for handle, dims_set in candidates.items():
    split = {d for d in dims_set if any(a is not None for a in d)}
    if len(split) == 1:
      found[handle] = split.pop()
  return found


def _batch_specs(graph, shapes, mesh, batch_axis):
  """Input placeholders split along dimension 0 (the batch) over `batch_axis`."""
  from tfsplit.runtime.graph_function import graph_inputs  # pylint: disable=import-outside-toplevel
  specs = {}
  n = mesh.size_of(batch_axis)
  for name in graph_inputs(graph):
    info = shapes[name][0]
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


def _after_updates(graph, report):
  """Nodes that (through control edges) wait for an update op."""
  waiting = set()
  for name in graph.topological_order():
    node = graph.node(name)
    for text in node.input:
      src = parse_input(text)[0]
      if (text.startswith("^") and report.role.get(src) == "update") or src in waiting:
        waiting.add(name)
        break
  return waiting


@without_gc
def split_graph(graph_def, mesh, strategy="megatron", annotations=None,
                timeout_seconds=None, axis=None, microbatches=1, schedule="1f1b",
                layer_ranges=None):
  """Splits `graph_def` over `mesh` (see module doc).

  mesh: its 'dp' axis (if any) splits the batch over replicas; 'tp' (or the
    last axis) is the strategy's axis.
  microbatches: m > 1 cuts each replica's batch into m micro-batches run one
    after the other on the same device, gradients summed in the graph.
  strategy: 'megatron' (found from the graph), 'none' (annotations only).
  A 'pp' mesh axis cuts the layers into that many pipeline stages (balanced by
  FLOPs, or `layer_ranges` [(start, end), ...]) run under `schedule`
  ('1f1b' or 'gpipe') over the micro-batches.
  annotations: {variable-name glob: dims tuple}, e.g. {'*/fc1/kernel': (None, 'tp')};
    they override the strategy for the variables they match.
  """
  graph = Graph(graph_def)
  variables = find_variables(graph)
  shapes = infer_shapes(graph, variables)
  folded = expand_identity_n(fold_static_shapes(graph_def, shapes))
  graph = Graph(folded)
  variables = find_variables(graph)
  shapes = infer_shapes(graph, variables)
  for var in variables:
    if var.shape is None:
      raise PlanError(f"variable '{var.name}' (node '{var.node}') has no known shape; "
                      "load the graph from its tf.function so shapes are recorded")

  if microbatches < 1:
    raise PlanError(f"microbatches must be >= 1, got {microbatches}")
  mesh = mesh.with_microbatches(int(microbatches))
  batch_parts = [a for a in ("dp", "mb") if a in mesh.axes]
  batch_axis = "*".join(batch_parts) if batch_parts else None
  input_specs = _batch_specs(graph, shapes, mesh, batch_axis) if batch_axis else {}
  model_axes = [a for a in mesh.axis_names if a not in ("dp", "mb", "pp")]
  axis = axis or ("tp" if "tp" in mesh.axes else (model_axes[-1] if model_axes else None))
  plan = {}
  if strategy == "megatron" and axis is not None:
    from tfsplit.strategies.megatron import megatron_plan  # pylint: disable=import-outside-toplevel
    roles = detect_layers(graph, shapes, variables).role
    plan.update(megatron_plan(graph, shapes, variables, axis=axis, mesh=mesh, roles=roles))
  elif strategy not in ("none", "megatron", None):
    raise PlanError(f"unknown strategy '{strategy}'; use 'megatron' or 'none'")
  if annotations:
    plan.update(_annotation_plan(variables, annotations, mesh))
  explicit = dict(plan)
  specs = {}
  for var in variables:
    dims = plan.get(var.node, (None,) * len(var.shape))
    specs[var.node] = Sharding(tuple(dims))
    specs[var.node].local_shape(var.shape, mesh, f"variable '{var.name}'")

  hint = ()
  for _ in range(_MAX_ROUNDS):
    prop = propagate(graph, shapes, mesh, specs, input_specs, hint)
    hint = set(prop.reduced_at_source)
    inferred = _inferred_specs(graph, prop, variables, explicit)
    changed = {h: d for h, d in inferred.items() if specs[h].dims != tuple(d)}
    if not changed:
      break
    for handle, dims in changed.items():
      specs[handle] = Sharding(tuple(dims))
      explicit[handle] = dims
  else:
    raise PlanError("variable shardings did not settle; annotate the variables")

  stage_of, report, partition = None, None, None
  if "pp" in mesh.axes:
    from tfsplit.pipeline import partition as partition_lib  # pylint: disable=import-outside-toplevel
    from tfsplit.pipeline import schedules as schedules_lib  # pylint: disable=import-outside-toplevel
    sched = schedules_lib.get_schedule(schedule)
    report = detect_layers(graph, shapes, variables)
    partition = partition_lib.partition_layers(report, mesh.axes["pp"], layer_ranges)
    stage_of = partition_lib.assign_stages(graph, report, partition)
  mat = Materializer(graph, shapes, mesh, prop, variables, timeout_seconds, stage_of)
  out = mat.run()
  if stage_of is not None:
    sets = schedules_lib.micro_batch_sets(out, mat.meta, mat.shared_nodes, report.role,
                                          stage_of, mesh, _after_updates(graph, report))
    schedules_lib.apply_schedule(out, sched, sets, mesh, mesh.axes["pp"], microbatches)
    try:
      Graph(out).topological_order()
    except GraphValidationError as e:
      raise PlanError(f"the {schedule} schedule would make the graph cyclic ({e}); "
                      "try another schedule or partition") from None
  by_node = {v.node: v.name for v in variables}
  var_specs = {by_node[h]: s.dims for h, s in specs.items() if not s.is_replicated}
  logging.info("split over %s: %d variables split, %d all-reduces, %d all-gathers, "
               "%d fallbacks", mesh, len(var_specs), sum(c.kind == "all_reduce" for c in
                                                         mat.collectives),
               sum(c.kind == "all_gather" for c in mat.collectives), len(prop.fallbacks))
  result = SplitResult(out, mat.manifest, mat.collectives, prop.fallbacks, var_specs,
                       mat.output_copies)
  result.partition = partition
  result.stage_of = stage_of
  return result
