"""The split's constant sweeps (sharding/materialize.py lean_constants, run
as the lean_constants pass): unread device copies dropped, identical
constants on one device made one."""
import types

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tfsplit.graph import Graph
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.ir import inputs_come_first
from tfsplit.passes import split as split_lib
from tfsplit.sharding import builder as builder_lib

D0 = "/job:localhost/replica:0/task:0/device:CPU:0"
D1 = "/job:localhost/replica:0/task:0/device:CPU:1"


def _const(graph_def, name, value, device, inputs=()):
  node = graph_def.node.add(name=name, op="Const", device=device, input=list(inputs))
  node.attr["dtype"].type = tf.int32.as_datatype_enum
  node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.array(value, np.int32)))
  return node


def _add(graph_def, name, inputs, device):
  node = graph_def.node.add(name=name, op="AddV2", device=device, input=inputs)
  node.attr["T"].type = tf.int32.as_datatype_enum
  return node


def _state():
  """A split's state: constants on two devices, some identical, read across
  devices; 'c5' is a copy of the graph's output 'out'."""
  g = graph_pb2.GraphDef()
  _const(g, "c4", [2], D1)          # c1's value on another device
  _const(g, "c1", [2], D0)
  _const(g, "c2", [2], D0)          # as c1: merged into it
  _const(g, "c3", [3], D0)          # another value
  _const(g, "c5", [2], D0)          # an output's copy: stays
  _const(g, "c6", [2], D0, ["^c3"])  # gated: stays
  _const(g, "c7", [2], D0)          # read by nothing: dropped
  _add(g, "a", ["c2", "c3", "^c1", "^c2"], D0)
  _add(g, "b", ["c4", "c2:0"], D1)   # reads a constant of the other device
  _add(g, "c", ["c6", "c5"], D0)
  records = {n.name: builder_lib.NodeRecord(n.name, 1 if n.device == D1 else 0)
             for n in g.node}
  records["c5"] = builder_lib.NodeRecord("out", 0)
  builder_lib.stamp_records(g, records)
  original = graph_pb2.GraphDef()
  out = original.node.add(name="out", op="Const")
  out.attr[variables_lib.OUTPUT_INDEX_ATTR].i = 0
  return types.SimpleNamespace(
      materialized=types.SimpleNamespace(graph_def=g, records=records),
      analysis=types.SimpleNamespace(graph=Graph(original)))


def _reads(graph_def):
  """{(reader, input index): (device, value) of the constant it reads}."""
  nodes = {n.name: n for n in graph_def.node}
  out = {}
  for node in graph_def.node:
    for i, text in enumerate(node.input):
      if text.startswith("^"):
        continue
      source = nodes[text.split(":")[0]]
      out[(node.name, i)] = (source.device,
                             tf.make_ndarray(source.attr["value"].tensor).tolist())
  return out


def test_constant_sweeps_keep_what_every_op_reads():
  state = _state()
  graph_def = state.materialized.graph_def
  before = _reads(graph_def)
  split_lib.lean_constants(state)
  assert _reads(graph_def) == before   # the same device's same value, for every read
  nodes = {n.name: n for n in graph_def.node}
  assert sorted(nodes) == ["a", "b", "c", "c1", "c3", "c4", "c5", "c6"]
  assert list(nodes["a"].input) == ["c1", "c3", "^c1"]
  assert list(nodes["b"].input) == ["c4", "c1"]
  assert sorted(state.materialized.records) == sorted(nodes)
  assert inputs_come_first(graph_def)
  assert state.inputs_come_first is True   # the sweep's finding, kept for check_acyclic


def _constant_reads(graph_def):
  """[(reader, its device, the constant's device)] and the constants' keys
  per device, of a split graph."""
  nodes = {n.name: n for n in graph_def.node}
  reads = [(n.name, n.device, nodes[t.lstrip("^").split(":")[0]].device)
           for n in graph_def.node for t in n.input
           if nodes[t.lstrip("^").split(":")[0]].op == "Const"]
  keys = [(n.device, builder_lib.constant_key(n)) for n in graph_def.node
          if n.op == "Const" and not n.input]
  return reads, keys


def test_split_graph_reads_one_constant_per_value_on_its_own_device():
  """The materialized copies share constants per device, never across them."""
  import os  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.layout.mesh import Mesh  # pylint: disable=import-outside-toplevel
  train = os.path.join(os.path.dirname(__file__), "..", "examples", "gpt_raw_train_tiny.pb")
  graph_def = load_graph(train)
  for mesh, microbatches in (("tp=2", 1), ("dp=2", 2)):
    result = split_lib.split_graph(graph_def, Mesh.parse(mesh), microbatches=microbatches)
    reads, keys = _constant_reads(result.graph_def)
    assert reads
    crossing = [r for r in reads if r[1] != r[2]]
    assert not crossing, crossing[:3]
    assert len(keys) == len(set(keys))
    devices = {k[0] for k in keys}
    assert len(devices) == 2, devices
