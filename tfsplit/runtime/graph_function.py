"""Run a (rewritten) GraphDef as a TF2 callable on the caller's variables.

The graph is imported with `tf.compat.v1.wrap_function`, not re-traced in a
tf.function body: re-tracing would add automatic control dependencies that
order stateful ops across devices, and would deadlock collectives. Captured
variable placeholders are fed the handles of real tf.Variables, matched by
the variable name tfsplit recorded when it loaded the graph.

A pipelined graph is called with its own Grappler config (`grappler_config`);
the caller's other functions keep theirs.
"""
import glob
import os
import re
import tempfile

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.core.protobuf import rewriter_config_pb2
from tensorflow.python.eager import context

from tfsplit.errors import TfsplitError
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.endpoints import graph_inputs, graph_outputs
from tfsplit.graph.ir import Graph
from tfsplit.pipeline.schedules import SCHEDULE_BARRIER_ATTR


def has_schedule(graph_def):
  """True if `graph_def` carries pipeline-schedule barriers."""
  return any(SCHEDULE_BARRIER_ATTR in n.attr for n in graph_def.node)


def grappler_config(graph_def, config):
  """Sets in `config` (a ConfigProto, changed in place) what running
  `graph_def` needs from Grappler; returns it.

  A pipelined graph gets one meta-optimizer round. Its schedule edges reach
  every op of a block, and an op with control inputs is left alone by the
  arithmetic optimizer's re-association (MinimizeBroadcasts, AddOpsRewrite).
  But the round ends with the dependency optimizer's transitive reduction,
  which removes every edge a data path already implies; in a second round
  MinimizeBroadcasts then rebuilds Mul trees across the forward/backward
  boundary, reusing node names: Gelu's gradient (0.5 * dy) * erfc(x) becomes
  (0.5 * erfc(x)) * dy, and that backward node, now fed by forward values
  only, runs in the forward phase, out of the schedule's order.
  """
  if has_schedule(graph_def):
    config.graph_options.rewrite_options.meta_optimizer_iterations = (
        rewriter_config_pb2.RewriterConfig.ONE)
  return config


class GraphFunction(object):
  """An imported graph: its ConcreteFunction (`concrete`), called with the
  Grappler config the graph needs (`grappler_config`) on top of the calling
  thread's own, which is restored after the call. TF instantiates a function
  once per config, so other calls of the same function are not affected."""

  def __init__(self, concrete, graph_def):
    self.concrete = concrete
    self.graph_def = graph_def
    self._own_config = has_schedule(graph_def)
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


def import_graph(graph_def, variables=(), inputs=None, outputs=None):
  """A GraphFunction (a callable ConcreteFunction) running `graph_def` on `variables`.

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
    node = graph.node(name.split(":")[0])
    shape = tf.TensorShape(node.attr["shape"].shape) if "shape" in node.attr else None
    specs.append(tf.TensorSpec(shape, tf.as_dtype(node.attr["dtype"].type), name=None))

  def tensor(name):
    return name if ":" in name else name + ":0"

  def body(*args):
    default_graph = tf.compat.v1.get_default_graph()
    input_map = {tensor(n): a for n, a in zip(inputs, args)}
    for placeholder, var in captures.items():
      input_map[placeholder] = default_graph.capture(var.handle)
    return tf.graph_util.import_graph_def(
        graph_def, input_map=input_map,
        return_elements=[tensor(o) for o in outputs], name="")

  return GraphFunction(tf.compat.v1.wrap_function(body, specs), graph_def)
