"""Where the nodes of a GraphDef run, as the graph simulator reads it: each
distinct `node.device` string maps to a cluster device index (given, or in
natural sorted order; an empty device is 0), and place_by_layers spreads an
unsplit graph's layers over devices in contiguous runs, a pipeline-style
placement for benchmarks and `tfsplit estimate --place-layers`. It stands
apart from the task graph so that a caller can place a graph and name its
devices without building a simulation."""
import re

from tfsplit.errors import PlanError
from tfsplit.graph.ir import Graph


def _natural_key(text):
  return [int(p) if p.isdigit() else p.lower()
          for p in re.split(r"(\d+)", text)]


def device_names(graph):
  """Distinct non-empty device strings of `graph`, in natural sorted order."""
  return sorted({n.device for n in graph.nodes if n.device}, key=_natural_key)


def device_indices(graph, mapping=None):
  """(node name -> device index, index -> device name).

  mapping: device string -> cluster device index; by default the distinct
  device strings in natural order (CPU:2 before CPU:10). An empty device is
  device 0.
  """
  names = device_names(graph)
  if mapping is None:
    mapping = {name: i for i, name in enumerate(names)}
  else:
    missing = [n for n in names if n not in mapping]
    if missing:
      raise PlanError(f"device '{missing[0]}' of the graph is not in the "
                      "device mapping; map every device string to a cluster "
                      "device index")
  count = max(list(mapping.values()) + [0]) + 1
  labels = [f"device {i}" for i in range(count)]
  for name, i in mapping.items():
    if labels[i].startswith("device "):
      labels[i] = name
  device_of = {n.name: mapping[n.device] if n.device else 0
               for n in graph.nodes}
  return device_of, labels


def place_by_layers(graph_def, num_devices, device_fn=None, report=None):
  """A copy of `graph_def` with each layer on one device, in layer order.

  Layers with parameters (their forward, backward and update ops, and their
  variables) are cut into `num_devices` contiguous runs, so parameter layer
  i of L goes to device i * num_devices // L: a pipeline-style placement
  for benchmarks.
  device_fn(i) gives device i's string (default '/device:CPU:i').
  """
  from tfsplit.graph.layers import OPTIMIZER_LAYER, detect_layers  # pylint: disable=import-outside-toplevel
  from tensorflow.core.framework import graph_pb2  # pylint: disable=import-outside-toplevel
  if num_devices < 1:
    raise PlanError(f"place_by_layers needs at least 1 device, got "
                    f"{num_devices}")
  device_fn = device_fn or (lambda i: f"/device:CPU:{i}")
  out = graph_pb2.GraphDef()
  out.CopyFrom(graph_def)
  graph = Graph(out)
  if report is None:
    report = detect_layers(graph)
  layers = sorted(report.layers, key=lambda l: l.index)
  model = [l for l in layers if l.variables]
  where = {l.name: i * num_devices // len(model) for i, l in enumerate(model)}
  # Layers without parameters (the loss, reshapes between blocks) go with
  # the parameter layer before them; shared optimizer ops with device 0.
  current = where[model[0].name] if model else 0
  for layer in layers:
    if layer.name in where:
      current = where[layer.name]
    elif layer.name != OPTIMIZER_LAYER:
      where[layer.name] = current
  names = [device_fn(i) for i in range(num_devices)]
  for node in graph.nodes:
    node.device = names[where.get(report.layer_of.get(node.name), 0)]
  return out
