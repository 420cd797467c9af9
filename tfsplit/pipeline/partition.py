"""Stage partition: contiguous layers into S pipeline stages (or S * v model
chunks, chunk c on stage c % S), and every node's stage (chunk).

Layers come from layer detection (tfsplit.graph.layers): each layer's forward
ops, its gradient ops and the updates of its variables go to its stage. The
default partition balances each stage's time: its layers' forward + backward
time from the cost model plus the activations crossing its two cuts (a linear
partition solved exactly by dynamic programming); FLOPs when no times are
given; explicit layer ranges override it. Nodes outside the layers follow their data: an op reading a
variable sits with the variable, a gradient op feeding only one stage's updates on that stage (a tied
weight's contributions are summed on its owner), other ops with their latest
input's stage (so the loss joins the last stage; for gradient ops, the
earliest: backward runs from the last stage to the first; inputs computed
from variables alone count only when there are no others), sources with
their earliest consumer.
"""
from tfsplit import constants
from tfsplit.errors import PlanError
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.ir import parse_input


def balanced_partition(costs, stages, boundary=None):
  """[(start, end)] contiguous ranges over `costs` minimising the largest stage cost.

  boundary[k]: what a cut between item k and k + 1 adds to both stages it
  separates (sending activations one way and their gradients the other).
  """
  n = len(costs)
  prefix = [0]
  for c in costs:
    prefix.append(prefix[-1] + c)
  cut_cost = [0.0] + list(boundary or [0.0] * max(0, n - 1)) + [0.0]  # by cut index
  inf = float("inf")
  # best[k][i]: smallest max-stage cost splitting the first i layers into k stages.
  best = [[inf] * (n + 1) for _ in range(stages + 1)]
  cut = [[0] * (n + 1) for _ in range(stages + 1)]
  best[0][0] = 0
  for k in range(1, stages + 1):
    for i in range(k, n + 1):
      for j in range(k - 1, i):
        stage = prefix[i] - prefix[j] + cut_cost[j] + (cut_cost[i] if i < n else 0)
        cost = max(best[k - 1][j], stage)
        if cost < best[k][i]:
          best[k][i], cut[k][i] = cost, j
  ranges, i = [], n
  for k in range(stages, 0, -1):
    j = cut[k][i]
    ranges.append((j, i))
    i = j
  return list(reversed(ranges))


def partition_layers(report, stages, layer_ranges=None, layer_costs=None,
                     boundary_costs=None, chunks=1):
  """[[layer name, ...] per model chunk] over the report's layers with
  parameters: stages * chunks contiguous chunks (chunk c runs on stage c % S;
  with one chunk per stage, one per stage).

  layer_costs / boundary_costs: per model layer and per cut between two of
  them (seconds, from the cost model); default: forward + backward FLOPs.
  """
  layers = report.model_layers
  if stages < 1:
    raise PlanError(f"stages must be >= 1, got {stages}")
  if chunks > 1 and stages * chunks > len(layers):
    raise PlanError(f"{stages} stages x {chunks} virtual stages need {stages * chunks} "
                    f"model chunks but the graph has only {len(layers)} layers with "
                    f"parameters ({', '.join(l.name for l in layers)}); use at most "
                    f"{len(layers) // stages} virtual stages, fewer stages, or a deeper "
                    "model")
  if stages > len(layers):
    raise PlanError(f"{stages} stages but the graph has only {len(layers)} layers with "
                    f"parameters ({', '.join(l.name for l in layers)}); use at most "
                    f"{len(layers)} stages")
  stages *= chunks
  if layer_ranges is None:
    if layer_costs is None:
      layer_costs = [max(1, l.forward_flops + l.backward_flops) for l in layers]
      boundary_costs = None
    layer_ranges = balanced_partition(layer_costs, stages, boundary_costs)
  else:
    layer_ranges = [tuple(r) for r in layer_ranges]
    if len(layer_ranges) != stages:
      what = f"{stages} stages" if chunks == 1 else \
          f"{stages} model chunks ({stages // chunks} stages x {chunks} virtual stages)"
      raise PlanError(f"{len(layer_ranges)} layer ranges given for {what}")
    expected = 0
    for start, end in layer_ranges:
      if start != expected or end <= start:
        raise PlanError(
            f"layer ranges {layer_ranges} are not contiguous: each stage must start "
            "where the previous one ended (ranges are [start, end) over the layers "
            f"0..{len(layers)}), and hold at least one layer")
      expected = end
    if expected != len(layers):
      raise PlanError(f"layer ranges {layer_ranges} cover layers 0..{expected}, but there "
                      f"are {len(layers)}; every layer needs a stage")
  return [[layers[i].name for i in range(start, end)] for start, end in layer_ranges]


def assign_stages(graph, report, partition, order=None):
  """{node name: stage} for every node of `graph`."""
  layer_stage = {name: s for s, names in enumerate(partition) for name in names}
  var_nodes = {n.name for n in graph.nodes if variables_lib.is_variable_node(n)}
  stage = {}
  for handle in var_nodes:
    layer = report.variable_layer.get(handle)
    stage[handle] = layer_stage.get(layer, 0)
  order = order or graph.topological_order()
  # A gradient op outside the layers whose result only feeds one stage's
  # updates (the AddN summing a tied embedding's two contributions) runs on
  # that stage: the contributions are summed on the weight's owner.
  for name in reversed(order):
    if name in stage or report.role.get(name) != constants.BACKWARD or \
        report.layer_of.get(name) in layer_stage:
      continue
    owners = set()
    for consumer in graph.consumer_nodes(name):
      c = consumer.name
      if c in stage:
        owners.add(stage[c])
      elif report.role.get(c) == constants.UPDATE and report.layer_of.get(c) in layer_stage:
        owners.add(layer_stage[report.layer_of[c]])
      else:
        owners.add(None)
    if len(owners) == 1 and None not in owners:
      stage[name] = owners.pop()
  undecided = []
  # Values computed from variables alone (a weight read, its cast): shared by
  # every micro-batch, so they do not say where a micro-batch's work runs.
  weights = set()
  for name in order:
    node = graph.node(name)
    data = [parse_input(t)[0] for t in node.input if not t.startswith("^")]
    staged = [d for d in data if d in stage]
    if node.op == "Const" or (data and all(d in weights or d in var_nodes for d in data)):
      weights.add(name)
    if name in stage:
      continue
    handles = [d for d in data if d in var_nodes]
    if handles:
      stage[name] = stage[handles[0]]
    elif report.layer_of.get(name) in layer_stage:
      stage[name] = layer_stage[report.layer_of[name]]
    else:
      # A tied weight's read sits with its owner; the head's input gradient
      # (dlogits x embedding) still runs where dlogits is, not on the
      # owner's stage, which would send it back and forth.
      known = [stage[d] for d in staged if d not in weights] or [stage[d] for d in staged]
      if known:
        # Forward flows to later stages, backward to earlier ones: a residual
        # stream's gradient sum joins the stage whose backward it continues.
        backward = report.role.get(name) == constants.BACKWARD
        stage[name] = min(known) if backward else max(known)
      else:
        undecided.append(name)
  for name in reversed(undecided):
    consumers = [stage[c.name] for c in graph.consumer_nodes(name) if c.name in stage]
    stage[name] = min(consumers) if consumers else 0
  return stage
