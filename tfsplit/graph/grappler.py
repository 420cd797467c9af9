"""TF's Grappler on a GraphDef: the item it sees, and a full optimization.

Grappler prunes what its fetch nodes do not need; every sink is fetched so
the whole graph stays (shape inference, benchmarks against OptimizeGraph).
"""
from tensorflow.core.protobuf import config_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from tfsplit.graph.ir import Graph


def metagraph_fetching_sinks(graph_def, graph=None, metagraph=None):
  """A MetaGraphDef of `graph_def` whose train_op collection holds every sink
  (of `graph`, its index, by default). `metagraph`: one whose graph_def the
  caller filled already (no copy of `graph_def` is made)."""
  graph = graph or Graph(graph_def)
  if metagraph is None:
    metagraph = meta_graph_pb2.MetaGraphDef()
    metagraph.graph_def.CopyFrom(graph_def)
  sinks = [n for n in graph.node_names() if not graph.has_consumers(n)]
  metagraph.collection_def["train_op"].node_list.value.extend(
      sinks or graph.node_names())
  return metagraph


def optimize(graph_def, config=None):
  """Grappler's OptimizeGraph (default config unless given) on the whole graph."""
  from tensorflow.python.framework import errors as tf_errors  # pylint: disable=import-outside-toplevel
  from tensorflow.python.grappler import tf_optimizer  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import tf_messages  # pylint: disable=import-outside-toplevel
  try:
    return tf_optimizer.OptimizeGraph(config or config_pb2.ConfigProto(),
                                      metagraph_fetching_sinks(graph_def))
  except (tf_errors.OpError, ValueError, RuntimeError, TypeError) as e:
    raise tf_messages.tf_error(e, graph_def, "Grappler's optimizer rejected it") from None
