"""What each detected layer costs a pipeline stage: op time and boundary bytes.

Stage balancing needs, per layer with parameters (what a pipeline cuts):
- its forward + backward time, from the cost model (measured op times of a
  calibration table when given, else the roofline on the mesh's devices);
  layers without parameters (a task model's head over a tied embedding, the
  loss) run on the stage of the layer before them, so their time joins it;
- the bytes of forward activations that cross each possible cut (the
  residual stream, a padding mask): a stage receives them on entry and sends
  their gradients back, so a cut where little crosses is cheaper.
"""
import collections

from tfsplit.constants import FORWARD
from tfsplit.cost import op_cost
from tfsplit.graph.ir import Graph


def owner_index(report):
  """{layer name: index of the model layer whose stage runs it}, for every
  layer of `report` (a tfsplit.graph.layers report): a layer with parameters
  is its own owner; one without (the loss, a head over a tied embedding)
  belongs to the layer with parameters before it, whose pipeline stage runs
  it and keeps its activations (the first layers, before any with
  parameters, belong to model layer 0)."""
  model = [l.name for l in report.model_layers]
  owner, current = {}, 0
  for layer in sorted(report.layers, key=lambda l: l.index):
    if layer.name in model:
      current = model.index(layer.name)
    owner[layer.name] = current
  return owner


def layer_seconds(graph, shapes, report, cost_model, device=0):
  """[seconds of forward + backward work] per model layer, in order."""
  owner = owner_index(report)
  seconds = [0.0] * len(report.model_layers)
  for layer in report.layers:
    for name in layer.forward + layer.backward:
      node = graph.node(name)
      cost = op_cost.node_cost(node, shapes, graph)
      if cost.comm:
        continue
      seconds[owner[layer.name]] += cost_model.compute_time(
          cost, device, op_cost.signature(node, shapes))
  return seconds


def boundary_bytes(graph, shapes, report):
  """[bytes of forward tensors crossing the cut after model layer k], k < n - 1."""
  owner = owner_index(report)
  n = len(report.model_layers)
  produced = collections.defaultdict(int)  # (src, port) -> last consuming layer
  for name in graph.topological_order():
    if report.role.get(name) != FORWARD or name not in report.layer_of:
      continue
    b = owner[report.layer_of[name]]
    for src, port in Graph.inputs(graph.node(name)):
      if report.role.get(src) == FORWARD and src in report.layer_of and port >= 0:
        produced[(src, port)] = max(produced[(src, port)], b)
  diff = [0] * (n + 1)
  for (src, port), last in produced.items():
    first = owner[report.layer_of[src]]
    info = shapes.get(f"{src}:{port}")
    if last > first and info is not None and info.num_bytes:
      diff[first] += info.num_bytes
      diff[last] -= info.num_bytes
  crossing, running = [0] * n, 0
  for k in range(n):
    running += diff[k]
    crossing[k] = running
  return crossing[:max(0, n - 1)]
