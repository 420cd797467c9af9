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

from tfsplit.graph.ir import parse_input

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


def rounded_tensors(graph_def, tensors, precision):
  """A copy of `graph_def` in which each tensor named in `tensors` ('node'
  or 'node:port', float32) is rounded to `precision` ('bfloat16' or
  'float16') and back before any op reads it: the original as a split that
  carries those tensors in `precision` computes it (gradients reduced in
  bfloat16, SplitConfig.gradient_reduce_dtype), the reference of that
  precision's spread."""
  low = {name: dtype for dtype, name in REDUCED.items()}[precision]
  out = graph_pb2.GraphDef()
  out.CopyFrom(graph_def)
  wanted = {parse_input(t) for t in tensors}
  rounded, created = {}, set()
  devices = {node.name: node.device for node in graph_def.node}
  for source, port in sorted(wanted):
    if source not in devices:
      continue
    text = source if port == 0 else f"{source}:{port}"
    base = f"{source}/rounded_{port}"
    down, up = out.node.add(), out.node.add()
    for node, name, src, (a, b) in ((down, f"{base}/to_{precision}", text,
                                     (types_pb2.DT_FLOAT, low)),
                                    (up, f"{base}/to_float32", f"{base}/to_{precision}",
                                     (low, types_pb2.DT_FLOAT))):
      node.name, node.op = name, "Cast"
      node.input.append(src)
      node.attr["SrcT"].type, node.attr["DstT"].type = a, b
      node.attr["Truncate"].b = False
      node.device = devices[source]
      created.add(name)
    rounded[(source, port)] = up.name
  for node in out.node:
    if node.name in created:
      continue
    for k, text in enumerate(node.input):
      if not text.startswith("^") and parse_input(text) in rounded:
        node.input[k] = rounded[parse_input(text)]
  return out


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
