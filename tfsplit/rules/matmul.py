"""Contractions: MatMul, BatchMatMul(V2/V3) and Einsum, as one einsum rule.

Each input dimension gets a letter; a letter split over a mesh axis in an
input keeps that split in the output, and a split *contracted* letter makes
the output a partial sum over that axis (Megatron's row-parallel matmul).
The op is linear in each input separately, so one partial input may pass.
"""
from tfsplit import constants
from tfsplit.rules.base import Decision, divisible, register
from tfsplit.layout.spec import Sharding, axis_parts, overlaps, without_part


def contraction_decision(ctx, in_letters, out_letters):
  """in_letters: per input a list of letters (None for broadcast size-1 dims)."""
  sizes = {}
  for letters, info in zip(in_letters, ctx.in_infos):
    for letter, size in zip(letters, info.shape):
      if letter is not None:
        sizes[letter] = max(sizes.get(letter, 1), size)
  specs = _expert_dims(ctx, in_letters, out_letters)
  # Letter -> axis, first input first; one axis per letter and each mesh axis
  # (compound axes taken apart) on one letter.
  axis_of, used = {}, set()
  for letters, dims in zip(in_letters, specs):
    for letter, axis in zip(letters, dims):
      if letter is None or axis is None or letter in axis_of or overlaps(axis, used):
        continue
      if not divisible(sizes[letter], ctx, axis):
        continue
      axis_of[letter] = axis
      used.update(axis_parts(axis))
  partials = [s.partial for s in ctx.in_specs]
  keep = [False] * len(partials)
  candidates = [i for i, p in enumerate(partials) if p]
  out_partial = frozenset()
  if len(candidates) == 1 and not any(overlaps(a, used) for a in partials[candidates[0]]):
    keep[candidates[0]] = True
    out_partial = partials[candidates[0]]
  required = []
  for k, (letters, info) in enumerate(zip(in_letters, ctx.in_infos)):
    # Broadcast (size-1) dims stay replicated.
    dims = tuple(None if l is None or info.shape[i] != sizes[l] else axis_of.get(l)
                 for i, l in enumerate(letters))
    required.append(Sharding(dims, partials[k] if keep[k] else frozenset()))
  contracted = {axis_of[l] for l in axis_of if l not in out_letters}
  out_dims = tuple(axis_of.get(l) for l in out_letters)
  return Decision(required, [Sharding(out_dims, out_partial | frozenset(contracted))])


def _expert_dims(ctx, in_letters, out_letters):
  """The inputs' dims, with the expert axis given to one letter.

  Under expert parallelism the batch is split over dp*mb*ep and stacked
  expert weights over 'ep' along their expert dimension. A contraction that
  sees 'ep' both ways (the tokens' batch letter over a compound holding it,
  another letter over 'ep' alone) sends 'ep' to one of them, and the
  reshard moves the other input by an all-to-all:
  - to the expert letter when a weight holds it (the experts never move:
    tokens go to their experts, GShard's dispatch), or when the batch letter
    is contracted and the expert letter kept (an expert weight's gradient);
  - else to the batch letter (the experts' outputs return to their tokens:
    the combine and the gradients of the dispatch)."""
  dims = [list(s.dims) for s in ctx.in_specs]
  ep = constants.EXPERT_AXIS
  if ctx.mesh.axes.get(ep, 1) <= 1:
    return dims
  alone, compound = set(), set()
  for letters, spec_dims in zip(in_letters, dims):
    for letter, axis in zip(letters, spec_dims):
      if letter is None or axis is None:
        continue
      if axis == ep:
        alone.add(letter)
      elif ep in axis_parts(axis):
        compound.add(letter)
  if not alone or not compound or alone & compound:
    return dims
  weights = ctx.weight_inputs or ()
  to_expert = any(
      k < len(weights) and weights[k] and ep in spec_dims
      for k, spec_dims in enumerate(dims)) or (
          all(l not in out_letters for l in compound) and
          any(l in out_letters for l in alone))
  # Every input's batch split alike: dp*mb*ep when the tokens keep 'ep',
  # dp*mb when the experts take it.
  whole = {}
  for letters, spec_dims in zip(in_letters, dims):
    for letter, axis in zip(letters, spec_dims):
      if letter in compound and axis is not None and ep in axis_parts(axis):
        whole.setdefault(letter, axis)
  for letters, spec_dims in zip(in_letters, dims):
    for i, (letter, axis) in enumerate(zip(letters, spec_dims)):
      if letter in compound:
        spec_dims[i] = without_part(whole[letter], ep) if to_expert else whole[letter]
      elif letter in alone and not to_expert and axis == ep:
        spec_dims[i] = None
  return dims


@register("MatMul")
def matmul(ctx):
  a = ["m", "k"] if not ctx.node.attr["transpose_a"].b else ["k", "m"]
  b = ["k", "n"] if not ctx.node.attr["transpose_b"].b else ["n", "k"]
  return contraction_decision(ctx, [a, b], ["m", "n"])


@register("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
def batch_matmul(ctx):
  ra, rb, ro = ctx.rank(0), ctx.rank(1), ctx.out_rank()
  nb = ro - 2
  batch = [f"b{i}" for i in range(nb)]
  a_batch = batch[nb - (ra - 2):] if ra > 2 else []
  b_batch = batch[nb - (rb - 2):] if rb > 2 else []
  adj_x = ctx.node.attr["adj_x"].b
  adj_y = ctx.node.attr["adj_y"].b
  a = a_batch + (["k", "m"] if adj_x else ["m", "k"])
  b = b_batch + (["n", "k"] if adj_y else ["k", "n"])
  return contraction_decision(ctx, [a, b], batch + ["m", "n"])


def _einsum_letters(equation, ranks):
  lhs, out = equation.replace(" ", "").split("->")
  terms = lhs.split(",")
  n_ell = 0
  for term, rank in zip(terms, ranks):
    if "..." in term:
      n_ell = max(n_ell, rank - len(term.replace("...", "")))
  ell = [f"e{i}" for i in range(n_ell)]

  def expand(term, rank):
    if "..." not in term:
      return list(term)
    head, tail = term.split("...")
    k = rank - len(head) - len(tail)
    return list(head) + ell[n_ell - k:] + list(tail)
  ins = [expand(t, r) for t, r in zip(terms, ranks)]
  out_letters = expand(out, len(ell) + len(out.replace("...", "")))
  return ins, out_letters


@register("Einsum")
def einsum(ctx):
  equation = ctx.node.attr["equation"].s.decode()
  ranks = [ctx.rank(i) for i in range(len(ctx.in_specs))]
  ins, out = _einsum_letters(equation, ranks)
  return contraction_decision(ctx, ins, out)
