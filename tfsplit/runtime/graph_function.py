"""Run a (rewritten) GraphDef as a TF2 callable on the caller's variables.

The graph is imported as one function, as `tf.compat.v1.wrap_function` over
import_graph_def makes it, not re-traced in a tf.function body: re-tracing
would add automatic control dependencies that order stateful ops across
devices, and would deadlock collectives. Captured variable placeholders are
fed the handles of real tf.Variables, matched by the variable name tfsplit
recorded when it loaded the graph.

A split graph is turned into a function in TF's C graph, without the Python
object per op that wrap_function builds (most of its time on a split graph),
and without its per-node records (`_runtime_copy`); other graphs go through
wrap_function. A split graph is called with its own Grappler config
(`grappler_config`); the caller's other functions keep theirs.
"""
import glob
import os
import re
import tempfile

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import config_pb2
from tensorflow.core.protobuf import rewriter_config_pb2
from tensorflow.python.eager import context
from tensorflow.python.framework import device as pydev
from tensorflow.python.framework import op_def_registry
from tensorflow.python.framework import ops
from tensorflow.python.util import compat

from tfsplit.errors import TfsplitError
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.endpoints import graph_inputs, graph_outputs
from tfsplit.graph.ir import Graph, input_node, parse_input, without_gc
from tfsplit.pipeline.schedules import SCHEDULE_BARRIER_ATTR
from tfsplit.sharding import builder as builder_lib
from tfsplit.layout.mesh import is_gpu


def has_schedule(graph_def):
  """True if `graph_def` carries pipeline-schedule barriers."""
  return any(SCHEDULE_BARRIER_ATTR in n.attr for n in graph_def.node)


def is_split(graph_def):
  """True if `graph_def` was made by a split (its nodes carry records)."""
  return any(builder_lib.SOURCE_ATTR in n.attr for n in graph_def.node)


def grappler_config(graph_def, config):
  """Sets in `config` (a ConfigProto, changed in place) what running
  `graph_def` needs from Grappler; returns it.

  A split graph gets one meta-optimizer round.

  A pipelined graph needs it. Its schedule edges reach every op of a block,
  and an op with control inputs is left alone by the arithmetic optimizer's
  re-association (MinimizeBroadcasts, AddOpsRewrite). But the round ends
  with the dependency optimizer's transitive reduction, which removes every
  edge a data path already implies; in a second round MinimizeBroadcasts
  then rebuilds Mul trees across the forward/backward boundary, reusing node
  names: Gelu's gradient (0.5 * dy) * erfc(x) becomes (0.5 * erfc(x)) * dy,
  and that backward node, now fed by forward values only, runs in the
  forward phase, out of the schedule's order.

  Any other split graph gets it unless `config` asks for rounds itself: the
  split multiplies the nodes Grappler works through before the first step,
  and its second round costs a third of that (3 s of a 12-block GPT's tp=2
  step on CPU) to remove under 1% more nodes; the step then runs as fast.
  """
  rewrite = config.graph_options.rewrite_options
  split = is_split(graph_def)
  if has_schedule(graph_def) or (
      rewrite.meta_optimizer_iterations == rewriter_config_pb2.RewriterConfig.DEFAULT_NUM_ITERS
      and split):
    rewrite.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
  if split:
    _skip_idle_optimizers(graph_def, rewrite)
  return config


# The ops Grappler's loop optimizer rewrites (loop_optimizer.cc: Switch
# branches, stack pushes), with the rest of TF1 control flow.
_LOOP_OPTIMIZER_OPS = frozenset([
    "Switch", "RefSwitch", "_SwitchN", "Merge", "RefMerge", "Enter", "RefEnter", "Exit",
    "RefExit", "NextIteration", "RefNextIteration", "LoopCond", "Stack", "StackV2",
    "StackPush", "StackPushV2", "StackPop", "StackPopV2", "StackClose", "StackCloseV2"])


def _skip_idle_optimizers(graph_def, rewrite):
  """Turns off, in `rewrite` (a RewriterConfig), the Grappler optimizers that
  find nothing to change on a split graph but walk all of it before its first
  step, changing no node (a large share of Grappler's time on a split graph;
  BUILD_NOTES has the measurement). Settings the caller made (not DEFAULT) are kept.

  - The TFG (MLIR) passes: shape inference, topological sort and control-flow
    sinking; a split graph is already sorted and has no control flow to sink.
  - Without TF1 control flow or stacks in the graph, and no functions (whose
    If / While TF lowers to Switch and Merge before Grappler): the loop
    optimizer. It removes Switch branches a constant predicate kills and
    unread stack pushes, and has nothing else to do (its loop-invariant
    motion is off by default), but first indexes the whole graph.
  - Without a GPU in the graph: the layout optimizer (it converts layouts
    for GPUs only unless `cpu_layout_conversion` asks) and the memory
    optimizer (its swapping targets GPU memory; on the host, tfsplit's own
    recompute and offload passes are the memory rewrites the user chose).
  """
  default = rewriter_config_pb2.RewriterConfig
  rewrite.disable_tfg_optimizer = True
  if rewrite.loop_optimization == default.DEFAULT and not graph_def.library.function and (
      not any(node.op in _LOOP_OPTIMIZER_OPS for node in graph_def.node)):
    rewrite.loop_optimization = default.OFF
  if any(is_gpu(node.device) for node in graph_def.node):
    return
  if rewrite.layout_optimizer == default.DEFAULT and (
      rewrite.cpu_layout_conversion == default.NO_CONVERSION_ON_CPU):
    rewrite.layout_optimizer = default.OFF
  if rewrite.memory_optimization == default.DEFAULT_MEM_OPT:
    rewrite.memory_optimization = default.NO_MEM_OPT


class GraphFunction(object):
  """An imported graph: its function (`concrete`: a ConcreteFunction, or a
  _Function for a split graph), called with the Grappler config the graph
  needs (`grappler_config`) on top of the calling thread's own, which is
  restored after the call. TF instantiates a function once per config, so
  other calls of the same function are not affected."""

  def __init__(self, concrete, graph_def):
    self.concrete = concrete
    self.graph_def = graph_def
    self._own_config = is_split(graph_def) or has_schedule(graph_def)
    self._options = {}  # caller's serialized config -> FunctionCallOptions

  def _call_options(self, current):
    key = (current.config_proto_serialized, current.executor_type)
    if key not in self._options:
      config = config_pb2.ConfigProto()
      if current.config_proto_serialized:
        config.ParseFromString(current.config_proto_serialized)
      self._options[key] = context.FunctionCallOptions(
          executor_type=current.executor_type,
          config_proto=grappler_config(self.graph_def, config))
    return self._options[key]

  def __call__(self, *args):
    if not self._own_config:
      return self.concrete(*args)
    ctx = context.context()
    current = ctx.function_call_options
    ctx.function_call_options = self._call_options(current)
    try:
      return self.concrete(*args)
    finally:
      ctx.function_call_options = current

  def __getattr__(self, name):
    concrete = self.__dict__.get("concrete")
    if concrete is None:
      raise AttributeError(name)
    return getattr(concrete, name)


def _xplane_pb2():
  try:
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel
  except ImportError:  # older TF
    from tensorflow.core.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel
  return xplane_pb2


# A kernel's profiler event: 'node:OpType', optionally '#key=value,...#'.
_KERNEL_EVENT = re.compile(r"^([^:#\s]+):([A-Za-z_]\w*)(#.*)?$")


def traced_call(fn, args, graph_def):
  """(outputs, op events) of one call fn(*args), read from TF's profiler.

  Events are [(device, node name, start_us, end_us)] (like
  session.op_events), for the kernels of nodes of `graph_def` (Grappler's own
  nodes and Send/Recv are left out). Eager calls have no step stats, so this
  is how a TF2 step is traced; it fails if a profiler session is running.
  """
  devices = {n.name: n.device for n in graph_def.node}
  options = tf.profiler.experimental.ProfilerOptions(
      host_tracer_level=2, python_tracer_level=0, device_tracer_level=0)
  xplane_pb2 = _xplane_pb2()
  with tempfile.TemporaryDirectory() as logdir:
    tf.profiler.experimental.start(logdir, options=options)
    try:
      outputs = fn(*args)
    finally:
      tf.profiler.experimental.stop()
    events = []
    for path in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True):
      space = xplane_pb2.XSpace()
      with open(path, "rb") as f:
        space.ParseFromString(f.read())
      for plane in space.planes:
        for line in plane.lines:
          for event in line.events:
            match = _KERNEL_EVENT.match(plane.event_metadata[event.metadata_id].name)
            if match is None or match.group(1) not in devices:
              continue
            start_ps = line.timestamp_ns * 1000 + event.offset_ps
            events.append((devices[match.group(1)], match.group(1), start_ps / 1e6,
                           (start_ps + max(event.duration_ps, 1)) / 1e6))
  return outputs, sorted(events, key=lambda e: (e[2], e[3]))


def variable_key(variable):
  """The name tfsplit records for a tf.Variable or Keras variable."""
  name = getattr(variable, "path", None) or variable.name
  return name[:-2] if name.endswith(":0") else name


def _strip_records(nodes):
  """Deletes the per-node records (sharding/builder.py) from NodeDefs `nodes`."""
  for node in nodes:
    attr = node.attr
    for key in builder_lib.RECORD_ATTRS:
      if key in attr:
        del attr[key]


def _runtime_copy(graph_def, leave_out=()):
  """Split graph `graph_def` as TF runs it, without the per-node records
  (sharding/builder.py) and the nodes in `leave_out`.

  The records name each node's original, so two identical copies of one op
  on a device would differ by an attr, and Grappler's common-subgraph
  elimination, which the original function gets, would keep both. The split
  itself drops unread constants and merges identical ones
  (passes/split.py); what else no output reads TF prunes from the function
  body before running it.
  """
  copy = graph_pb2.GraphDef()
  copy.versions.CopyFrom(graph_def.versions)
  copy.library.CopyFrom(graph_def.library)
  if leave_out:
    leave_out = set(leave_out)
    copy.node.extend(n for n in graph_def.node if n.name not in leave_out)
  else:
    copy.node.extend(graph_def.node)
  _strip_records(copy.node)
  return copy


def _canonical_device(device, cache):
  """The device string TF's Python importer would give an op placed on `device`."""
  if device not in cache:
    cache[device] = pydev.canonical_name(device) if device else ""
  return cache[device]


def _import_into_default_graph(graph_def, input_map, return_elements):
  """tf.graph_util.import_graph_def(graph_def, input_map, return_elements,
  name="") into the default graph, with the same result, but without
  entering a device scope per op (which costs ~0.1 ms an op in Python), and
  without adding default attrs to `graph_def` in place. Falls back to the
  public function where its per-op pass does more: device functions in scope,
  functions in the library, or TF internals moved."""
  graph = ops.get_default_graph()
  try:
    from tensorflow.python.client import pywrap_tf_session as c_api  # pylint: disable=import-outside-toplevel
    from tensorflow.python.framework import c_api_util  # pylint: disable=import-outside-toplevel
    from tensorflow.python.framework import importer  # pylint: disable=import-outside-toplevel
    fast = (not len(graph._device_function_stack)  # pylint: disable=protected-access
            and not graph_def.library.function)
    populate = importer._PopulateTFImportGraphDefOptions  # pylint: disable=protected-access
    gather = importer._GatherReturnElements  # pylint: disable=protected-access
    colocation_names = importer._GetColocationNames  # pylint: disable=protected-access
  except (ImportError, AttributeError):
    fast = False
  if not fast:
    return tf.graph_util.import_graph_def(graph_def, input_map=input_map,
                                          return_elements=return_elements, name="")
  scoped = c_api_util.ScopedTFImportGraphDefOptions()
  populate(scoped.options, "", input_map, return_elements, True)
  devices = {n.name: n.device for n in graph_def.node}
  colocated = {n.name for n in graph_def.node if "_class" in n.attr}
  with graph._mutation_lock():  # pylint: disable=protected-access
    buffer = c_api.TF_NewBufferFromString(graph_def.SerializeToString())
    try:
      with graph._c_graph.get() as c_graph:  # pylint: disable=protected-access
        results = c_api.TF_GraphImportGraphDefWithResults(c_graph, buffer, scoped.options)
      results = c_api_util.ScopedTFImportGraphDefResults(results)
    except tf.errors.InvalidArgumentError as e:
      raise ValueError(str(e)) from None  # as import_graph_def raises it
    finally:
      c_api.TF_DeleteBuffer(buffer)
    new_ops = graph._add_new_tf_operations(compute_devices=False)  # pylint: disable=protected-access
    # The devices the public importer gives: the NodeDef's own, canonical;
    # an op colocated with another takes that op's device (or none).
    canonical, pairs = {}, []
    for op in new_ops:
      name = op.name
      if name in colocated:
        names = colocation_names(op)
        if names:
          op._set_device("")  # pylint: disable=protected-access
          pairs.append((op, names))
          continue
      device = devices.get(name, "")
      wanted = _canonical_device(device, canonical)
      if wanted != device:
        op._set_device_from_string(wanted)  # pylint: disable=protected-access
    for op, names in pairs:
      for other in names:
        try:
          other_op = graph._get_operation_by_name(other)  # pylint: disable=protected-access
        except KeyError:
          continue
        if other_op.device:
          op._set_device(pydev.DeviceSpec.from_string(other_op.device))  # pylint: disable=protected-access
          break
  missing = c_api.TF_ImportGraphDefResultsMissingUnusedInputMappings_wrapper(
      results.results)
  if missing:
    raise ValueError("Attempted to map inputs that were not found in graph_def: "
                     f"[{', '.join(compat.as_str(s) for s in missing)}]")
  return gather(return_elements, graph, results.results)


@without_gc
def import_graph(graph_def, variables=(), inputs=None, outputs=None):
  """A GraphFunction (a callable function) running `graph_def` on `variables`.

  variables: tf.Variables (or Keras variables) whose names match the graph's
    captured-variable annotations, or a dict {recorded name: variable};
    extra ones are ignored.
  inputs / outputs: node or tensor names; default: the ones tfsplit marked
    when loading (the original function's arguments and results).
  """
  graph = Graph(graph_def)
  inputs = list(inputs) if inputs is not None else graph_inputs(graph)
  outputs = list(outputs) if outputs is not None else graph_outputs(graph)
  pairs = variables.items() if isinstance(variables, dict) else [
      (variable_key(v), v) for v in variables]
  by_key = {}
  for key, var in pairs:
    # Keras 3 variables wrap a tf.Variable in `.value`.
    by_key[key] = var if hasattr(var, "handle") else var.value
  captures = {}
  for info in variables_lib.find_variables(graph):
    if info.kind != "captured":
      continue
    if info.name not in by_key:
      raise TfsplitError(
          f"node '{info.node}' (op Placeholder) reads variable '{info.name}', "
          "which is not among the variables given; pass every variable the "
          "graph uses (model and optimizer variables)")
    captures[info.node + ":0"] = by_key[info.name]

  specs = []
  for name in inputs:
    node = graph.node(input_node(name))
    shape = tf.TensorShape(node.attr["shape"].shape) if "shape" in node.attr else None
    specs.append(tf.TensorSpec(shape, tf.as_dtype(node.attr["dtype"].type), name=None))

  def tensor(name):
    return name if ":" in name else name + ":0"

  def body(*args):
    default_graph = tf.compat.v1.get_default_graph()
    input_map = {tensor(n): a for n, a in zip(inputs, args)}
    for placeholder, var in captures.items():
      input_map[placeholder] = default_graph.capture(var.handle)
    return _import_into_default_graph(runtime_graph_def, input_map,
                                      [tensor(o) for o in outputs])

  split = is_split(graph_def)
  if split:  # every op is TF's own: no Python object per op needed
    fn = _function_from_graph_def(graph_def, [tensor(n) for n in inputs],
                                  [tensor(o) for o in outputs], captures, specs)
    if fn is not None:
      return GraphFunction(fn, graph_def)
  runtime_graph_def = _runtime_copy(graph_def) if split else graph_def
  return GraphFunction(tf.compat.v1.wrap_function(body, specs), graph_def)


class _Function(object):
  """A GraphDef run as one TF function: called with the graph's inputs, it
  feeds the captured placeholders the variables' handles and returns the
  list of outputs, as wrap_function over import_graph_def does."""

  def __init__(self, atomic, specs, variables):
    self._atomic = atomic
    self._specs = specs
    self._variables = variables  # kept alive as long as the function
    self._handles = [v.handle for v in variables]

  def __call__(self, *args):
    if len(args) != len(self._specs):
      raise TypeError(f"the graph takes {len(self._specs)} input(s) "
                      f"({', '.join(str(s) for s in self._specs)}), got {len(args)}")
    flat = [ops.convert_to_tensor(a, s.dtype) for a, s in zip(args, self._specs)]
    return self._atomic.call_flat(*flat, *self._handles)


def _function_from_graph_def(graph_def, inputs, outputs, captures, specs):
  """A _Function of split graph `graph_def` (inputs / outputs: tensor names;
  captures: {placeholder tensor: variable}), or None where TF's internals
  differ.

  What wrap_function makes, without its Python object per op (most of its
  time on a split graph): the graph is imported into a bare C graph and
  turned into a function there; the captured placeholders are created first,
  carrying their variable's dtype and shape as capture() gives them, and the
  graph's own are mapped onto them.
  """
  try:
    from tensorflow.python.client import pywrap_tf_session as c_api  # pylint: disable=import-outside-toplevel
    from tensorflow.python.eager.polymorphic_function import atomic_function  # pylint: disable=import-outside-toplevel
    from tensorflow.python.framework import c_api_util  # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops import handle_data_util  # pylint: disable=import-outside-toplevel
    from tensorflow.core.function.polymorphism import function_type as function_type_lib  # pylint: disable=import-outside-toplevel
    new_options = c_api_util.ScopedTFImportGraphDefOptions
    new_results = c_api_util.ScopedTFImportGraphDefResults
  except (ImportError, AttributeError):
    return None
  capture_names = [parse_input(t)[0] for t in captures]
  body = _runtime_copy(graph_def, leave_out=capture_names)
  graph = ops.Graph()
  with graph._c_graph.get() as c_graph:  # pylint: disable=protected-access
    # 1. The captured placeholders, with their variables' handle data.
    first = graph_pb2.GraphDef()
    first.versions.CopyFrom(graph_def.versions)
    nodes = {n.name: n for n in graph_def.node if n.op == "Placeholder"}
    first.node.extend(nodes[n] for n in capture_names)
    _strip_records(first.node)
    options = new_options()
    c_api.TF_ImportGraphDefOptionsSetPrefix(options.options, "")
    for name in capture_names:
      c_api.TF_ImportGraphDefOptionsAddReturnOutput(options.options, name, 0)
    results = _c_import(c_api, c_graph, first, options, new_results)
    placeholders = c_api.TF_ImportGraphDefResultsReturnOutputs(results.results)
    for output, var in zip(placeholders, captures.values()):
      handle_data = handle_data_util.get_handle_data(var.handle)
      if handle_data is not None and handle_data.is_set:
        c_api.SetHandleShapeAndType(c_graph, output, handle_data.SerializeToString())
    # 2. The graph, its captured placeholders mapped onto those.
    options = new_options()
    c_api.TF_ImportGraphDefOptionsSetPrefix(options.options, "")
    for name, output in zip(capture_names, placeholders):
      c_api.TF_ImportGraphDefOptionsAddInputMapping(options.options, name, 0, output)
      c_api.TF_ImportGraphDefOptionsRemapControlDependency(options.options, name, output.oper)
    for text in inputs + outputs:
      name, port = parse_input(text)
      c_api.TF_ImportGraphDefOptionsAddReturnOutput(options.options, name, port)
    results = _c_import(c_api, c_graph, body, options, new_results)
    returned = c_api.TF_ImportGraphDefResultsReturnOutputs(results.results)
    arg_outputs = list(returned[:len(inputs)]) + list(placeholders)
    ret_outputs = list(returned[len(inputs):])
    name = f"__inference_tfsplit_graph_{ops.uid()}"
    # The body: every op of the graph but the arguments' own (None: TF takes
    # them all, less the inputs' ops, one output each as a placeholder has).
    fn = c_api.TF_GraphToFunction_wrapper(c_graph, name, False, None,
                                          arg_outputs, ret_outputs, [], [], [], None, "")
  # The outputs' static shapes, as the imported graph's shape functions found them.
  out_specs, made = [], {}
  for output in ret_outputs:
    key = c_api.TF_OperationName(output.oper)
    if key not in made:
      made[key] = graph._create_op_from_tf_operation(output.oper, compute_device=False)  # pylint: disable=protected-access
    tensor = made[key].outputs[output.index]
    out_specs.append(tf.TensorSpec(tensor.shape, tensor.dtype))
  ctx = context.context()
  ctx.add_c_function(fn)
  c_api.TF_DeleteFunction(fn)
  stateful = False
  for node in body.node:
    op_def = op_def_registry.get(node.op)
    if op_def is None or op_def.is_stateful:
      stateful = True
      break
  function_type = function_type_lib.from_structured_signature(
      (tuple(specs), {}), out_specs, {})
  atomic = atomic_function.AtomicFunction(
      name, ctx, function_type, call_options=atomic_function.CallOptions(
          is_stateful=stateful))
  return _Function(atomic, specs, list(captures.values()))


def _c_import(c_api, c_graph, graph_def, options, new_results):
  """TF_GraphImportGraphDefWithResults of `graph_def`; raises as import_graph_def."""
  buffer = c_api.TF_NewBufferFromString(graph_def.SerializeToString())
  try:
    return new_results(c_api.TF_GraphImportGraphDefWithResults(c_graph, buffer,
                                                                options.options))
  except tf.errors.InvalidArgumentError as e:
    raise ValueError(str(e)) from None
  finally:
    c_api.TF_DeleteBuffer(buffer)
