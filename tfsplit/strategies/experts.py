"""Expert parallelism: stacked expert weights split over 'ep', found from the graph.

A mixture-of-experts layer keeps its E experts' matrices stacked, [E, d, f],
and meets the tokens by an einsum or batched matmul in which the expert
dimension survives into the output (`becd,edf->becf` after a GShard
dispatch, `btd,edf->btef` when every expert computes every token). Such a
weight is an *expert weight*: its dimension 0 is split over 'ep', so each
device holds E/ep whole experts (and, through the propagation, their
gradients and optimizer slots). Everything else is data-parallel over
dp*mb*ep; the contraction rule (rules/matmul.py) sends each token to its
experts' devices by an all-to-all and brings the results back.

With 'tp' as well, an expert's own matrices are split by the megatron preset
inside each expert (a column split of [E, d, f] moves from E to f).
"""
import dataclasses
import os
from typing import Dict, List, Tuple

from tfsplit import constants
from tfsplit.errors import PlanError
from tfsplit.strategies.megatron import _operand_letters, find_weight_contractions


@dataclasses.dataclass(frozen=True)
class ExpertWeight:
  variable: str          # the variable's name
  node: str              # its handle node
  experts: int           # size of its expert dimension (0)
  rank: int
  contractions: Tuple[str, ...]  # the forward contractions reading it
  operands: Tuple[int, ...] = ()  # its operand index in each of them


def find_expert_weights(graph, shapes, variables, roles=None) -> List[ExpertWeight]:
  """The expert weights of the graph (rank >= 3 trainable variables whose
  dimension 0 a forward contraction keeps in its output), in graph order."""
  found: Dict[str, list] = {}
  info = {}
  for name, operand, var, chain in find_weight_contractions(graph, shapes, variables, roles):
    if len(var.shape) < 3 or None in var.shape:
      continue
    node = graph.node(name)
    data = [t for t in node.input if not t.startswith("^")]
    operand_info = shapes.get(data[operand])
    if operand_info is None or operand_info.shape is None or \
        tuple(operand_info.shape) != tuple(var.shape):
      continue  # read through a reshape: its dimension 0 is not known to be E
    letters, out_letters = _operand_letters(node, shapes)
    if letters[operand][0] not in out_letters:
      continue
    found.setdefault(var.node, []).append((name, operand))
    info[var.node] = var
  return [ExpertWeight(info[h].name, h, int(info[h].shape[0]), len(info[h].shape),
                       tuple(n for n, _ in reads), tuple(i for _, i in reads))
          for h, reads in found.items()]


def token_exchange_bytes(graph, shapes, experts, position):
  """Bytes the tokens of one forward of the layer the `experts` belong to
  take to and from their experts' devices (at the graph's batch): the
  tokens entering its first expert contraction and the expert outputs
  leaving its last one (each one all-to-all over ep, or for dense routing
  an all-gather in). 0 where a shape is unknown. position: {node: index}
  in topological order (one map for every layer of the graph)."""
  reads = sorted({(c, i) for e in experts for c, i in zip(e.contractions, e.operands)},
                 key=lambda r: position.get(r[0], 0))
  if not reads:
    return 0
  first, operand = reads[0]
  data = [t for t in graph.node(first).input if not t.startswith("^")]
  tokens = shapes.get(data[1 - operand]) if len(data) == 2 else None
  out = shapes.get(f"{reads[-1][0]}:0")
  sizes = [t.num_bytes if t is not None else None for t in (tokens, out)]
  return 0 if None in sizes else sum(sizes)


def expert_layers(experts, layer_of, variables):
  """[{layer, scope, experts, weights, bytes}]: the expert weights grouped by
  the layer whose contractions read them (`inspect`'s expert table). scope is
  the name scope the layer's expert contractions share (block_0/moe)."""
  size = {v.node: v.num_bytes for v in variables}
  groups: Dict[str, dict] = {}
  for expert in experts:
    layer = layer_of.get(expert.contractions[0], "")
    group = groups.setdefault(layer, {"layer": layer, "scopes": [], "experts": set(),
                                      "weights": [], "bytes": 0})
    group["scopes"].extend(c.rsplit("/", 1)[0] for c in expert.contractions)
    group["experts"].add(expert.experts)
    group["weights"].append(expert.variable)
    group["bytes"] += size.get(expert.node) or 0
  out = []
  for group in groups.values():
    # commonprefix compares lists element by element: whole scope names.
    common = os.path.commonprefix([s.split("/") for s in group.pop("scopes")])
    counts = sorted(group["experts"])
    group["experts"] = counts[0] if len(counts) == 1 else counts
    out.append(dict(group, scope="/".join(common)))
  return out


def expert_plan(experts, mesh, tensor_plan=None, axis=constants.EXPERT_AXIS):
  """{variable handle: dims}: dimension 0 of each expert weight over `axis`,
  on top of the tensor plan's split of it (moved off dimension 0 if the
  tensor plan put it there: a column split of stacked experts)."""
  n = mesh.axes.get(axis, 1)
  plan = {}
  tensor_plan = tensor_plan or {}
  for expert in experts:
    if expert.experts % n:
      raise PlanError(
          f"variable '{expert.variable}' stacks {expert.experts} experts (dimension 0, "
          f"read by node '{expert.contractions[0]}'), which do not divide by {axis}={n}; "
          f"use an {axis} size that divides {expert.experts}")
    dims = list(tensor_plan.get(expert.node) or (None,) * expert.rank)
    if dims[0] is not None:
      # The tensor axis splits the expert's output features instead: the
      # last dimension of a stacked [E, d, f] column weight.
      moved = dims[0]
      dims[0] = None
      if dims[-1] is None:
        dims[-1] = moved
    dims[0] = axis
    plan[expert.node] = tuple(dims)
  return plan
