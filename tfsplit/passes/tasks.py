"""The passes of a split made for one cluster task (SplitConfig.task): which
devices materialize_devices makes, and the task's part cut out at the end
(sharding/tasks.py cuts; this module hands it what earlier passes recorded:
the layouts, the materialized records, the input shapes, the devices that
hold each output)."""
from tfsplit import constants
from tfsplit.errors import PlanError
from tfsplit.graph.endpoints import graph_inputs, graph_outputs
from tfsplit.graph.ir import parse_input
from tfsplit.sharding import builder as builder_lib
from tfsplit.sharding import tasks as tasks_lib

# Ops whose output 0 has the type and shape of their input 0.
_SAME_AS_FIRST_INPUT = frozenset(["Identity", "Snapshot", "CollectiveReduceV2"])
# Ops whose output has their inputs' shape when all inputs have one shape.
_ELEMENTWISE_SUMS = frozenset(["AddV2", "Add", "AddN"])


def extract_task(state):
  """One task's part of the whole-mesh graph (config.task; sharding/tasks.py)."""
  task = state.config.task
  if task is None:
    return
  analysis, out, prop, mesh = state.analysis, state.materialized, state.propagation, state.mesh
  inputs = {}
  for name in graph_inputs(analysis.graph):
    specs = prop.outputs.get(name)
    inputs[name] = (analysis.shapes[name][0].shape, specs[0] if specs else None)
  shares = tasks_lib.input_shares(inputs, mesh, task)

  def tensor_type(name, port):
    """(dtype, local shape) of a node's output that another task reads: the
    local copy of an original op, or found by TF's shape inference."""
    record = out.records.get(name)
    if record is not None and record.device_id is not None and \
        name == builder_lib.local_name(record.source, record.device_id):
      info = analysis.shapes[record.source][port]
      outs = prop.outputs.get(record.source) or []
      spec = outs[port] if port < len(outs) else None
      if info.shape is not None:
        shape = list(info.shape) if spec is None else \
            spec.local_shape(info.shape, mesh, f"tensor '{name}:{port}'")
        return info.dtype, shape
    if not nodes_found:
      nodes_found.update((n.name, n) for n in out.graph_def.node)
    node = nodes_found.get(name)
    if node is not None and port == 0 and node.input:
      # Resharding's reductions, forwards and micro-batch sums: their
      # inputs' type, found without importing the whole graph into TF.
      data = [parse_input(t) for t in node.input if not t.startswith("^")]
      if node.op in _SAME_AS_FIRST_INPUT:
        return tensor_type(*data[0])
      if node.op in _ELEMENTWISE_SUMS:
        found = [tensor_type(*t) for t in data]
        if found[0][1] is not None and all(f == found[0] for f in found):
          return found[0]
    if not imported:
      imported.append(_imported(out.graph_def))
    t = imported[0].get_tensor_by_name(f"{name}:{port}")
    return t.dtype.as_datatype_enum, (t.shape.as_list() if t.shape.rank is not None
                                      else None)

  imported = []   # the whole graph in TF, for shapes no record gives
  nodes_found = {}

  routes = tasks_lib.output_routes(mesh, out.output_holders, constants.PIPELINE_AXIS)
  graph_def, part = tasks_lib.task_graph(
      out.graph_def, task, shares, graph_outputs(analysis.graph), out.output_copies,
      routes, tensor_type, state.config.timeout_seconds)
  out.graph_def = graph_def
  out.records = {n.name: out.records[n.name] for n in graph_def.node if n.name in out.records}
  state.task_part = part
  state.inputs_come_first = None


def task_devices(state):
  """The device ids materialize_devices makes for config.task (None: every
  device): the task's own and, with a pipeline axis across tasks, the rest
  of their pipeline groups, whose nodes the stage boundaries read and write.
  Each task then sees every edge between tasks its broadcasts pair, and
  what it makes grows with one replica's model, not with the mesh."""
  task, mesh = state.config.task, state.mesh
  if task is None:
    return None
  ids = [d for d in range(mesh.size) if tasks_lib.task_of(mesh.devices[d]) == task]
  if not ids:
    raise PlanError(f"task {task} holds no device of mesh {mesh}; run as many workers "
                    "as the mesh needs, or a larger mesh")
  pp = constants.PIPELINE_AXIS
  if mesh.axes.get(pp, 1) <= 1:
    return ids
  made = set(ids)
  for d in ids:
    made.update(mesh.group_of(d, pp)[1])
  return sorted(made)


def _imported(graph_def):
  """`graph_def` imported into a tf.Graph (TF's shape inference over it)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(graph_def, name="")
  return graph
