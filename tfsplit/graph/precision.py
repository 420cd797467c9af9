"""A graph's computing precision, and the graph with it raised to float32.

A mixed-precision step (bf16 or fp16 compute, float32 weights) cannot be
checked for exactness in its own precision: the split rounds partial sums
the original never forms, and Adam turns that rounding into visible steps.
The same graph with every 16-bit float type raised to float32 computes the
same mathematics at float32 rounding, where a split is exact to 1e-4; a
defect in the split (a wrong shard, a missing reduction) is a defect in
both. runtime/verify.py checks the raised pair for exactness and the graphs
as they are against the precision's own spread.
"""
import numpy as np
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.framework import graph_pb2
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import tensor_util

# 16-bit float types, lowest precision first, and their names.
REDUCED = {types_pb2.DT_BFLOAT16: "bfloat16", types_pb2.DT_HALF: "float16"}


def compute_precision(graph_def):
  """'bfloat16' or 'float16' if some op of the graph (or of its functions)
  computes in that type (bfloat16 first: the coarser), else 'float32'."""
  found = set()
  for node in _all_nodes(graph_def):
    for value in node.attr.values():
      found.update(t for t in _types(value) if t in REDUCED)
  for dtype in REDUCED:
    if dtype in found:
      return REDUCED[dtype]
  return "float32"


def promoted(graph_def):
  """A copy of `graph_def` with every bfloat16 and float16 type raised to
  float32: op type attributes, constants' values, function signatures."""
  out = graph_pb2.GraphDef()
  out.CopyFrom(graph_def)
  for node in _all_nodes(out):
    for value in node.attr.values():
      _promote_attr(value)
  for fdef in out.library.function:
    for arg in list(fdef.signature.input_arg) + list(fdef.signature.output_arg):
      if arg.type in REDUCED:
        arg.type = types_pb2.DT_FLOAT
  _rekey_collectives(out)
  return out


# Where each collective reads its instance key (its OpDef's input order).
_INSTANCE_KEY_INPUT = {"CollectiveReduceV2": 3, "CollectiveGatherV2": 3,
                       "CollectiveBcastSendV2": 3, "CollectiveAllToAllV2": 3,
                       "CollectiveReduceScatterV2": 3, "CollectiveBcastRecvV2": 2}


def _rekey_collectives(graph_def):
  """Other instance keys for the raised graph's collectives: TF keeps a
  key's type for the whole process, so the raised graph may not reuse the
  keys the graph as it is runs with. Each key maps to a hash of itself (the
  same on every member), read from a constant of its own."""
  import zlib  # pylint: disable=import-outside-toplevel
  nodes = {n.name: n for n in graph_def.node}
  made = {}
  for node in list(graph_def.node):
    at = _INSTANCE_KEY_INPUT.get(node.op)
    if at is None or at >= len(node.input):
      continue
    source = nodes.get(node.input[at].split(":")[0])
    if source is None or source.op != "Const":
      continue
    key = int(tensor_util.MakeNdarray(source.attr["value"].tensor))
    new_key = zlib.crc32(f"float32 {key}".encode()) & 0x3FFFFFFF
    name = f"{source.name}/float32_{new_key}"
    if name not in made:
      const = graph_def.node.add()
      const.CopyFrom(source)
      const.name = name
      const.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(
          np.array(new_key, tensor_util.MakeNdarray(source.attr["value"].tensor).dtype)))
      made[name] = const
    node.input[at] = name


def _all_nodes(graph_def):
  yield from graph_def.node
  for fdef in graph_def.library.function:
    yield from fdef.node_def


def _types(value):
  if value.HasField("type"):
    yield value.type
  elif value.HasField("list"):
    yield from value.list.type
  elif value.HasField("tensor"):
    yield value.tensor.dtype


def _promote_attr(value: attr_value_pb2.AttrValue):
  if value.HasField("type"):
    if value.type in REDUCED:
      value.type = types_pb2.DT_FLOAT
  elif value.HasField("list"):
    for i, t in enumerate(value.list.type):
      if t in REDUCED:
        value.list.type[i] = types_pb2.DT_FLOAT
  elif value.HasField("tensor") and value.tensor.dtype in REDUCED:
    array = tensor_util.MakeNdarray(value.tensor).astype(np.float32)
    value.tensor.CopyFrom(tensor_util.make_tensor_proto(array, types_pb2.DT_FLOAT))
