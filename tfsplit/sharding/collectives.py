"""NodeDefs for TF's collective ops (all-reduce, reduce-scatter, gather, all-to-all,
broadcast).

Templates are taken from TF itself once (so every required attr has its
current default), then filled in with names, devices, inputs and keys.
"""
import functools

import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from tfsplit.layout.mesh import is_gpu

# Without a timeout: with one, TF starts a watchdog thread per collective and
# step that lives for the whole timeout (a dp=2 step with a 600 s timeout and
# one all-reduce per gradient left 8,000 threads after 50 steps). Devices of
# one process cannot fail alone; graphs for other processes get a timeout
# from their caller (`tfsplit rewrite --collective-timeout`, timeout_seconds=).
DEFAULT_TIMEOUT_SECONDS = 0.0


@functools.lru_cache(maxsize=None)
def _template(op):
  with tf.Graph().as_default() as g:
    x = tf.compat.v1.placeholder(tf.float32, [2])
    if op == "CollectiveReduceV2":
      tf.raw_ops.CollectiveReduceV2(input=x, group_size=2, group_key=1, instance_key=1,
                                    ordering_token=[], merge_op="Add", final_op="Id",
                                    communication_hint="auto",
                                    timeout_seconds=DEFAULT_TIMEOUT_SECONDS)
    elif op == "CollectiveReduceScatterV2":
      tf.raw_ops.CollectiveReduceScatterV2(input=x, group_size=2, group_key=1,
                                           instance_key=1, ordering_token=[], merge_op="Add",
                                           final_op="Id", communication_hint="auto",
                                           timeout_seconds=DEFAULT_TIMEOUT_SECONDS)
    elif op in ("CollectiveGatherV2", "CollectiveAllToAllV2"):
      getattr(tf.raw_ops, op)(input=x, group_size=2, group_key=1, instance_key=1,
                              ordering_token=[], communication_hint="auto",
                              timeout_seconds=DEFAULT_TIMEOUT_SECONDS)
    elif op == "CollectiveBcastSendV2":
      tf.raw_ops.CollectiveBcastSendV2(input=x, group_size=2, group_key=1, instance_key=1,
                                       communication_hint="auto",
                                       timeout_seconds=DEFAULT_TIMEOUT_SECONDS)
    elif op == "CollectiveBcastRecvV2":
      tf.raw_ops.CollectiveBcastRecvV2(group_size=2, group_key=1, instance_key=1, shape=[2],
                                       T=tf.float32, communication_hint="auto",
                                       timeout_seconds=DEFAULT_TIMEOUT_SECONDS)
    else:
      raise ValueError(op)
    node = next(n for n in g.as_graph_def().node if n.op == op)
  return node.SerializeToString()


def communication_hint(device):
  """The implementation a collective on `device` asks for: NCCL on a GPU.

  TF's collectives use NCCL only when the hint or the session's ConfigProto
  (`experimental.collective_nccl`) asks for it; "auto" runs TF's ring
  implementation on GPUs too, staging through host memory. A build without
  NCCL (TF's CPU wheel) falls back to the ring for "nccl"."""
  return "nccl" if is_gpu(device) else "auto"


def collective_node(op, name, device, inputs, dtype_enum, timeout_seconds=None):
  """A collective NodeDef; `inputs` = [tensor, group_size, group_key, instance_key]
  (a broadcast's receiver: [group_size, group_key, instance_key, shape])."""
  node = node_def_pb2.NodeDef()
  node.ParseFromString(_template(op))
  node.name = name
  node.device = device
  node.attr["communication_hint"].s = communication_hint(device).encode()
  del node.input[:]
  node.input.extend(inputs)
  node.attr["T"].type = dtype_enum
  if timeout_seconds is not None:
    node.attr["timeout_seconds"].f = timeout_seconds
  return node
