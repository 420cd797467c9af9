"""What a split rule's `localize` may do to one device's copy of a node:
read local shapes, replace a constant input (a shape or size) by its local
value, or scale the node's output (a mean over a split dimension)."""
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from tfsplit.sharding.builder import const_node


class LocalizeContext(object):
  """What a rule's `localize` may do to one device's copy of a node."""

  def __init__(self, mat, node, original, decision, device_id, positions, in_infos):
    self.mat, self.node, self.original = mat, node, original
    self.decision, self.device_id = decision, device_id
    self._positions, self._in_infos = positions, in_infos

  def local_out_shape(self, k=0):
    info = self.mat.shapes[self.original.name][k]
    return self.decision.outputs[k].local_shape(
        info.shape, self.mat.mesh, f"node '{self.original.name}' (op {self.original.op})")

  def input_dtype(self, i):
    return tf.as_dtype(self._in_infos[i].dtype).as_numpy_dtype

  def const_input(self, i, value):
    name = self.mat.b.unique(f"{self.node.name}/local_input_{i}")
    self.mat.b.add(const_node(name, value, self.node.device))
    self.node.input[self._positions[i]] = name

  def scale_output(self, factor):
    """Renames the local node and multiplies its output 0 by `factor`."""
    final, b = self.node.name, self.mat.b
    self.node.name = b.unique(final + "/unscaled")
    dtype = self.mat.shapes[self.original.name][0].dtype
    c = b.add(const_node(b.unique(final + "/scale"),
                         np.asarray(factor, tf.as_dtype(dtype).as_numpy_dtype),
                         self.node.device))
    mul = node_def_pb2.NodeDef(name=final, op="Mul", device=self.node.device,
                               input=[self.node.name, c.name])
    mul.attr["T"].type = dtype
    self.mat.deferred.append(mul)
