"""The split-rule registry and what a rule sees.

A rule is a function `rule(ctx) -> Decision`. It gets the op's node, the
sharding of each data input as produced upstream, global static shapes and
constant inputs, and decides:
- the sharding it *requires* of each data input (the engine inserts the
  cheapest reshard where the producer's sharding differs), and
- the sharding of each of its outputs.
Optionally it supplies `localize(node, device_id)`, called on each device's
copy of the node to turn global shape constants and attrs into local ones.

Rules live one module per op family (matmul, elementwise, reduce, shape, nn,
and variables: reads, writes and gathers) and register themselves with
`@register("Op", ...)`.
"""
import dataclasses
from typing import Callable, List, Optional

from tfsplit.layout.spec import Sharding

RULES = {}


def register(*ops):
  def wrap(fn):
    for op in ops:
      RULES[op] = fn
    return fn
  return wrap


@dataclasses.dataclass
class Decision:
  inputs: List[Optional[Sharding]]      # required sharding per data input
  outputs: List[Optional[Sharding]]     # sharding per output
  localize: Optional[Callable] = None   # (local NodeDef, device_id, engine) -> None
  fallback: Optional[str] = None        # why this op was forced to replicate


@dataclasses.dataclass
class OpContext:
  node: object
  mesh: object
  in_specs: List[Optional[Sharding]]    # as produced (None: resource/unknown)
  in_infos: list                        # TensorInfo per data input
  out_infos: list                       # TensorInfo per output
  const_inputs: list                    # numpy value per data input or None
  handle_specs: list                    # variable Sharding behind resource inputs
  # Per data input, whether it is a variable's value (its read, through
  # Identity / Cast / Reshape): a weight, not an activation.
  weight_inputs: tuple = ()

  def rank(self, i):
    info = self.in_infos[i]
    return len(info.shape) if info is not None and info.shape is not None else None

  def in_shape(self, i):
    return self.in_infos[i].shape

  def out_shape(self, k=0):
    return self.out_infos[k].shape

  def out_rank(self, k=0):
    return len(self.out_infos[k].shape)

  def axis_size(self, axis):
    return self.mesh.size_of(axis)


def replicated_like(ctx):
  """Everything replicated, every partial reduced: always correct."""
  ins = [None if s is None else Sharding.replicated(s.rank) for s in ctx.in_specs]
  outs = [Sharding.replicated(len(o.shape)) if o is not None and o.shape is not None
          else None for o in ctx.out_infos]
  return ins, outs


def fallback(ctx, why):
  ins, outs = replicated_like(ctx)
  return Decision(ins, outs, fallback=why)


def divisible(size, ctx, axis):
  return size is not None and size % ctx.axis_size(axis) == 0
