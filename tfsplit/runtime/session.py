"""Running a rewritten graph in a TF1-style Session, with step stats on
request (runtime/trace.py reads them) and TF's gRPC runtime
(tf.distribute.Server) driven through Sessions too. The graph's captured-variable placeholders become
VarHandleOps named after their variable (shard), initialised from values.
"""

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tfsplit.errors import TfsplitError
from tfsplit.graph import Graph, find_variables
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.endpoints import graph_inputs, graph_outputs
from tfsplit.runtime import seeds
from tfsplit.runtime.devices import required_devices
from tfsplit.runtime.graph_function import grappler_config


def with_variable_handles(graph_def):
  """GraphDef whose captured-variable placeholders are VarHandleOps.

  The handle's shared_name is the recorded variable name, so two graphs (or
  two runs) see the same variable by name.
  """
  out = graph_pb2.GraphDef()
  out.CopyFrom(graph_def)
  for node in out.node:
    if node.op != "Placeholder" or variables_lib.VAR_NAME_ATTR not in node.attr:
      continue
    name, device = node.name, node.device
    shared = node.attr[variables_lib.VAR_NAME_ATTR].s
    dtype = node.attr[variables_lib.VAR_DTYPE_ATTR].type
    shape = tf.TensorShape(node.attr[variables_lib.VAR_SHAPE_ATTR].shape)
    node.Clear()
    node.name, node.op, node.device = name, "VarHandleOp", device
    node.attr["dtype"].type = dtype
    node.attr["shape"].shape.CopyFrom(shape.as_proto())
    node.attr["shared_name"].s = shared
    node.attr["container"].s = b""
  return out


class SessionRunner(object):
  """A rewritten graph in a Session, with its variables initialised (values
  None: left as they are, made by another runner on the same servers)."""

  def __init__(self, graph_def, values, target="", num_cpus=None, config=None):
    self.graph_def = with_variable_handles(graph_def)
    graph = Graph(graph_def)
    self.inputs = graph_inputs(graph)
    self.outputs = graph_outputs(graph)
    self.graph = tf.Graph()
    with self.graph.as_default():
      tf.graph_util.import_graph_def(self.graph_def, name="")
      self._placeholders, self._assigns = {}, {}
      for info in find_variables(graph):
        if isinstance(values, dict) and info.name not in values:
          raise TfsplitError(f"no value for variable '{info.name}'")
        handle = self.graph.get_tensor_by_name(info.node + ":0")
        with tf.device(handle.device):
          value = tf.compat.v1.placeholder(tf.as_dtype(info.dtype), info.shape)
          self._assigns[info.name] = tf.raw_ops.AssignVariableOp(resource=handle,
                                                                 value=value)
        self._placeholders[info.name] = value
      self._init = tf.group(*self._assigns.values())
    if config is None:
      config = session_config(graph_def, num_cpus)
    self.session = tf.compat.v1.Session(target, graph=self.graph, config=config)
    if isinstance(values, dict):
      self.assign(values)
    elif values is not None:  # None: the variables live in the servers already
      self.assign_stream(values)

  def assign(self, values):
    """Sets the variables named in `values` (by recorded name; a restore
    gives one variable's shards at a time) to their values, in one run."""
    unknown = sorted(set(values) - set(self._placeholders))
    if unknown:
      raise TfsplitError(f"no variable '{unknown[0]}' in the split graph")
    if len(values) == len(self._placeholders):
      self.session.run(self._init, feed_dict={p: values[n]
                                              for n, p in self._placeholders.items()})
    else:
      self.session.run([self._assigns[n] for n in values],
                       feed_dict={self._placeholders[n]: v for n, v in values.items()})

  def assign_stream(self, chunks):
    """Sets every variable from an iterable of {name: value} chunks (one
    variable's shards each), one run per chunk, so no more than one chunk's
    values exist at once; every variable must be set."""
    done = set()
    for chunk in chunks:
      self.assign(chunk)
      done.update(chunk)
    missing = sorted(set(self._placeholders) - done)
    if missing:
      raise TfsplitError(f"no value for variable '{missing[0]}'")

  def _tensor(self, name):
    return self.graph.get_tensor_by_name(name if ":" in name else name + ":0")

  def run(self, inputs, trace=False, fetch=None):
    """Outputs of one step (or the tensors named in `fetch`); with trace=True
    also its RunMetadata."""
    feeds = {self._tensor(n): v for n, v in zip(self.inputs, inputs)}
    fetches = [self._tensor(n) for n in (self.outputs if fetch is None else fetch)]
    if not trace:
      return self.session.run(fetches, feed_dict=feeds), None
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    metadata = tf.compat.v1.RunMetadata()
    out = self.session.run(fetches, feed_dict=feeds, options=options,
                           run_metadata=metadata)
    return out, metadata

  def variable_values(self, names):
    """{variable (shard) name: numpy value}, read in one run (the read ops are
    made once per name)."""
    if not hasattr(self, "_reads"):
      self._reads = {}
    missing = [n for n in names if n not in self._reads]
    if missing:
      nodes = {n.attr["shared_name"].s.decode(): n for n in self.graph_def.node
               if n.op == "VarHandleOp"}
      with self.graph.as_default():
        for name in missing:
          node = nodes[name]
          handle = self.graph.get_tensor_by_name(node.name + ":0")
          with tf.device(handle.device):
            self._reads[name] = tf.raw_ops.ReadVariableOp(
                resource=handle, dtype=tf.as_dtype(node.attr["dtype"].type))
    names = list(names)
    return dict(zip(names, self.session.run([self._reads[n] for n in names])))


def session_config(graph_def, num_cpus=None):
  """ConfigProto for running `graph_def`: enough CPU devices, and the Grappler
  settings the graph needs (for a pipelined graph one round, so stages keep
  the schedule's order: see graph_function.grappler_config)."""
  config = tf.compat.v1.ConfigProto(
      device_count={"CPU": num_cpus or required_devices(graph_def, "CPU")},
      allow_soft_placement=False)
  return grappler_config(graph_def, config)


def seeded_values(graph_def, manifest=None, seed=0):
  """Variable values for a rewritten graph: shards of seeded full values."""
  if manifest is None:
    return seeds.seeded_variable_values(Graph(graph_def), seed)
  return seeds.seeded_manifest_values(manifest, seed)
