"""Recomputation (activation checkpointing) as a GraphDef rewrite.

A training step keeps, between its forward and backward passes, every forward
tensor that a gradient op reads. Recomputation keeps fewer: for each segment
of the forward pass (a model block, a group of blocks, an attention core, a
name scope) only what enters it (the checkpoint) is kept; its forward ops are
copied for the backward pass, the segment's gradient ops read the copies, and
the copies wait, through control edges, for the gradient that starts the
segment's backward (Chen et al. 2016, "Training Deep Nets with Sublinear
Memory Cost"). The originals' outputs are then freed once the forward pass has
used them.

Modes (`recompute=` of tfsplit.split, `--recompute` of `tfsplit rewrite`):
- 'blocks': one segment per repeated block (LayerReport's `Layer.block`).
- 'auto': sqrt(n) checkpoints: segments of k = round(sqrt(n)) consecutive
  blocks; a segment's forward is recomputed at once when its backward starts.
- 'selective': per block, the attention core only (the scores matmul,
  scaling, masking, softmax, dropout, up to the matmul with the values):
  large (batch x heads x seq x seq) and cheap to recompute (Korthikanti et al.
  2022, "Reducing Activation Recomputation in Large Transformer Models").
- name scopes: a list (or a string with ',' or '/'): each distinct scope
  they match (globs allowed: 'gpt/block_*') is one segment.

What is copied: a segment's forward ops that lead, inside the segment, to a
tensor its own backward (the gradient ops of its layers) reads. Not copied,
and read by the copies as they are: constants and variable reads (the same
weight value: updates come after the backward), shape ops (tiny), what depends
on no variable (masks and position ids built from the inputs; dropout's mask,
drawn from a constant shape), and stateful ops. A stateful op is kept, not
rerun: a random draw from an activation (Multinomial) would differ on a
rerun, so the copies read the original's output, which stays alive. Stateless
random ops (Keras 3's dropout) are recomputed exactly: their seeds are inputs,
and the copies read the same seed values.

The gate: the copies that read no other copy wait (control edges) for every
gradient op that feeds the segment's backward consumers from outside it
(i.e. that does not itself depend on those consumers): the gradient with
respect to the segment's output. Nothing else orders them, so without the
gate TF would run them as soon as their inputs exist, during the forward
pass. The gate also keeps them apart from their originals under TF's
Grappler: common-subexpression elimination compares control inputs (without
the gate, and without the attr below, it merges half of a GPT block's copies
back into their originals), and the dependency optimizer's transitive
reduction only drops a control edge that a data path already implies (none
does here). The copies also wait for the rest of the backward that comes
before theirs (the later blocks' weight gradients: `drains`), which TF's
executor otherwise defers to the end of the step when no thread is idle,
every block's activation-sized gradients alive until then (causallm_keras3
small at dp=2 on two cores kept 0.53 of no recomputation's activation memory
without them, 0.20 with them). Each copy carries RECOMPUTE_OF_ATTR naming its
original: layer detection makes it a backward op of the original's layer, so
the passes after this one (tensor and data parallelism, micro-batches,
pipeline stages) copy and order it as the backward pass.
"""
import collections
import dataclasses
import fnmatch
import math
from typing import Dict, List, Optional, Tuple

from tfsplit import constants
from tfsplit.errors import GraphValidationError, PlanError
from tfsplit.graph.ir import Graph, control_input, parse_input, tensor_name
from tfsplit.graph.layers import RECOMPUTE_OF_ATTR
from tfsplit.sharding.builder import unique_name

MODES = ("blocks", "selective", "auto")
NONE = "none"
# Ops whose outputs are kept as they are: no activation worth recomputing.
_KEPT_OPS = frozenset(["Const", "Placeholder", "VarHandleOp", "Shape", "ShapeN",
                       "Size", "Rank", "NoOp"]) | constants.VARIABLE_READ_OPS
_MATMUL_OPS = frozenset(["MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3",
                         "Einsum"])
_SOFTMAX_OPS = frozenset(["Softmax", "LogSoftmax"])
_SUFFIX = "recompute"


def parse(value):
  """None (no recomputation), a mode ('blocks', 'selective', 'auto') or a
  tuple of name scopes, from what a user passed as `recompute`.

  A string is a mode, 'none', or scopes when it holds ',' or '/'
  ('gpt/block_0,gpt/block_1', 'encoder/'); a list or tuple is scopes.
  """
  if value is None or value is False:
    return None
  if isinstance(value, str):
    text = value.strip()
    if text in ("", NONE):
      return None
    if text in MODES:
      return text
    if "," not in text and "/" not in text:
      raise PlanError(
          f"unknown recompute mode '{value}'; choose none, blocks, selective or auto, "
          "or give name scopes as a list or a string with ',' or '/' (e.g. "
          "'gpt/block_0,gpt/block_1', 'gpt/block_*' or 'encoder/')")
    value = text.split(",")
  if isinstance(value, (list, tuple)):
    scopes = tuple(s.strip().strip("/") for s in value if isinstance(s, str))
    if len(scopes) != len(value) or not scopes or not all(scopes):
      raise PlanError(f"recompute scopes must be non-empty strings, got {value!r}")
    return scopes
  raise PlanError(f"recompute must be none, blocks, selective, auto or a list of name "
                  f"scopes, got {value!r}")


def describe(mode):
  """How a parsed mode is written on the command line."""
  if mode is None:
    return NONE
  return mode if isinstance(mode, str) else ",".join(mode)


@dataclasses.dataclass
class Segment:
  """One recomputed stretch of the forward pass."""
  name: str
  layers: Tuple[str, ...]              # the layers whose backward reads the copies
  roots: List[str] = dataclasses.field(default_factory=list)   # gated copies
  gates: List[str] = dataclasses.field(default_factory=list)   # the gradient they wait for
  # The later backward they wait for too: its last ops (weight gradients), so
  # what those read is freed before this segment's copies are made.
  drains: List[str] = dataclasses.field(default_factory=list)
  tensors: List[str] = dataclasses.field(default_factory=list)  # recomputed tensors
  bytes: int = 0                        # of those tensors (static shapes)


@dataclasses.dataclass
class Recomputed:
  graph_def: object
  known_shapes: Dict[str, list]         # node -> [TensorInfo] (copies: the original's)
  copies: Dict[str, str]                # copy -> original
  segments: List[Segment]
  mode: object

  @property
  def saved_bytes(self):
    return sum(s.bytes for s in self.segments)


# --- segments ------------------------------------------------------------------------
def _blocks(report):
  return [l for l in report.layers if l.block]


def _no_blocks(mode):
  return PlanError(
      f"recompute='{mode}' needs the model's repeated blocks, but layer detection found "
      "none in this graph (sibling name scopes with the same ops and parameter shapes, "
      "e.g. block_0, block_1); name the blocks' scopes instead: recompute="
      "'net/layer_0,net/layer_1' (--recompute net/layer_0,net/layer_1) or a glob "
      "such as 'net/layer_*'")


def _block_segments(report, mode):
  blocks = _blocks(report)
  if not blocks:
    raise _no_blocks(mode)
  if mode == "blocks":
    return [(b.name, (b.name,), list(b.forward)) for b in blocks]
  k = max(1, int(round(math.sqrt(len(blocks)))))
  out = []
  for i in range(0, len(blocks), k):
    group = blocks[i:i + k]
    name = group[0].name if len(group) == 1 else f"{group[0].name}..{group[-1].name}"
    out.append((name, tuple(b.name for b in group), [n for b in group for n in b.forward]))
  return out


def _attention_core(graph, block, skip):
  """The forward ops of `block`'s attention core(s): from the scores matmul
  through the softmax (and dropout, casts, reshapes) up to the matmul with
  the values, that one excluded."""
  members = set(block.forward)
  core = set()
  for name in block.forward:
    if graph.node(name).op not in _SOFTMAX_OPS:
      continue
    core.add(name)
    stack = [name]
    while stack:  # up to (and with) the scores matmul
      for src, _ in graph.data_inputs(stack.pop()):
        if src in members and src not in core and src not in skip:
          core.add(src)
          if graph.node(src).op not in _MATMUL_OPS:
            stack.append(src)
    stack = [name]
    while stack:  # down to (without) the matmul with the values
      for consumer, _ in graph.consumers(stack.pop()):
        if consumer in members and consumer not in core and consumer not in skip and \
            graph.node(consumer).op not in _MATMUL_OPS:
          core.add(consumer)
          stack.append(consumer)
  return [n for n in block.forward if n in core]


def _selective_segments(graph, report, skip):
  blocks = _blocks(report)
  if not blocks:
    raise _no_blocks("selective")
  out = []
  for block in blocks:
    core = _attention_core(graph, block, skip)
    if core:
      out.append((f"{block.name} attention", (block.name,), core))
  if not out:
    raise PlanError(
        "recompute='selective' recomputes the attention core (the softmax of the "
        "attention scores), but no block of this graph has a Softmax op; use "
        "recompute='blocks' to recompute whole blocks")
  return out


def _scope_segments(graph, report, scopes):
  """One segment per distinct scope a pattern matches (its shortest match)."""
  forward = [n for n in graph.topological_order()
             if report.role.get(n) == constants.FORWARD]
  segments = collections.OrderedDict()   # scope -> forward ops
  for pattern in scopes:
    found = False
    for name in forward:
      parts = name.split("/")[:-1]
      for i in range(1, len(parts) + 1):
        prefix = "/".join(parts[:i])
        if prefix == pattern or fnmatch.fnmatchcase(prefix, pattern):
          segments.setdefault(prefix, []).append(name)
          found = True
          break
    if not found:
      raise PlanError(
          f"recompute scope '{pattern}' matches no forward op of the graph; give name "
          "scopes of the forward pass (e.g. 'gpt/block_0' or 'gpt/block_*'; `tfsplit "
          "inspect` lists the layers), or a mode: blocks, selective or auto")
  out, taken = [], set()
  for scope, ops in segments.items():
    ops = [n for n in dict.fromkeys(ops) if n not in taken]
    taken.update(ops)
    if ops:
      layers = tuple(dict.fromkeys(report.layer_of[n] for n in ops))
      out.append((scope, layers, ops))
  return out


# --- the rewrite -----------------------------------------------------------------------
def _is_stateful(op):
  from tensorflow.python.framework import op_def_registry  # pylint: disable=import-outside-toplevel
  op_def = op_def_registry.get(op)
  return op_def is None or op_def.is_stateful


def recompute(graph, shapes, report, mode, variables=()):
  """Recomputed: `graph` (a tfsplit Graph) with the segments of `mode` (see
  parse) recomputed for the backward pass. `report`: its LayerReport."""
  mode = parse(mode)
  if mode is None:
    raise ValueError("recompute() needs a mode")
  var_nodes = {v.node for v in variables}
  stateful = {}

  def copyable(name):
    node = graph.node(name)
    if node.op in _KEPT_OPS or name in var_nodes or name in report.variable_free or \
        RECOMPUTE_OF_ATTR in node.attr:
      return False
    if node.op not in stateful:
      stateful[node.op] = _is_stateful(node.op)
    return not stateful[node.op]

  kept = {n for n in report.role if report.role[n] == constants.FORWARD and not copyable(n)}
  if mode in ("blocks", "auto"):
    specs = _block_segments(report, mode)
  elif mode == "selective":
    specs = _selective_segments(graph, report, kept)
  else:
    specs = _scope_segments(graph, report, mode)

  order = graph.topological_order()
  position = {n: i for i, n in enumerate(order)}
  planned = [p for p in (_plan_segment(graph, shapes, report, name, layers, ops, copyable,
                                       position) for name, layers, ops in specs) if p]
  _plan_drains(graph, shapes, report, planned, order, position)
  new_nodes, rewires, segments, copies = [], [], [], {}
  used = set(graph.node_names())
  for seg, plan, consumers in planned:
    made = {}
    for original in plan:  # topological
      node = graph.node(original)
      copy = unique_name(used, f"{original}/{_SUFFIX}")
      made[original] = copy
      new = type(node)()
      new.CopyFrom(node)
      new.name = copy
      del new.input[:]
      reads_copy = False
      for text in node.input:
        src, port = parse_input(text)
        if port >= 0 and src in made:
          new.input.append(tensor_name(made[src], port))
          reads_copy = True
        else:
          new.input.append(text)
      if not reads_copy:
        new.input.extend(control_input(g) for g in seg.gates + seg.drains
                         if control_input(g) not in new.input)
        seg.roots.append(copy)
      new.attr[RECOMPUTE_OF_ATTR].s = original.encode()
      new_nodes.append(new)
      copies[copy] = original
    for consumer, index, src, port in consumers:
      rewires.append((consumer, index, tensor_name(made[src], port)))
    segments.append(seg)
  if not segments:
    raise PlanError(
        f"recompute='{describe(mode)}' found nothing to recompute: no tensor of its "
        "segments is read by their gradient ops; use another mode or other scopes")

  out = type(graph.graph_def)()
  out.CopyFrom(graph.graph_def)
  by_name = {n.name: n for n in out.node}
  for consumer, index, text in rewires:
    by_name[consumer].input[index] = text
  out.node.extend(new_nodes)
  try:
    Graph(out).topological_order()
  except GraphValidationError as e:
    raise PlanError(f"recompute='{describe(mode)}' would make the graph cyclic ({e}); "
                    "recompute fewer or other scopes") from None
  known = {n: shapes[n] for n in graph.node_names() if n in shapes}
  for copy, original in copies.items():
    if original in known:
      known[copy] = known[original]
  return Recomputed(out, known, copies, segments, mode)


def _reads_only_scalars(graph, shapes, name):
  """True when every tensor `name` reads is known to be a scalar: waiting
  for it keeps no activation-sized gradient from living on."""
  def scalar(src, port):
    info = shapes.tensor(src, port)
    return info is not None and info.shape is not None and len(info.shape) == 0
  return all(scalar(src, port) for src, port in graph.data_inputs(name))


def _plan_segment(graph, shapes, report, name, layers, ops, copyable, position):
  """(Segment, the originals to copy in topological order, [(consumer,
  input index, source, port)] to rewire), or None when the segment's
  backward reads nothing it could recompute."""
  members = {n for n in ops if copyable(n)}
  in_layers = set(layers)
  consumers, tensors = [], collections.OrderedDict()
  for src in sorted(members, key=position.get):
    for consumer, index in graph.consumers(src):
      text = graph.node(consumer).input[index]
      port = parse_input(text)[1]
      if port < 0 or report.role.get(consumer) != constants.BACKWARD or \
          report.layer_of.get(consumer) not in in_layers:
        continue
      consumers.append((consumer, index, src, port))
      tensors[(src, port)] = None
  if not consumers:
    return None
  # Candidate gates: the gradient ops feeding the consumers. One that depends
  # on a consumer would close a cycle: the consumers' descendants are walked,
  # but only up to the last candidate (a path only goes forward in `order`).
  consumer_names = {c for c, _, _, _ in consumers}
  candidates = {src for c in consumer_names for src, _ in graph.data_inputs(c)
                if src not in consumer_names and src not in report.variable_free and
                report.role.get(src) == constants.BACKWARD}
  limit = max((position[c] for c in candidates), default=-1)
  after, stack = set(), list(consumer_names)
  while stack:
    n = stack.pop()
    if n in after or position[n] > limit:
      continue
    after.add(n)
    stack.extend(c for c, _ in graph.consumers(n) if c not in after)
  gates = candidates - after
  if not gates:
    return None  # nothing would hold the copies back: they would run in the forward
  plan, stack = set(), [src for src, _ in tensors]
  while stack:
    n = stack.pop()
    if n in plan:
      continue
    plan.add(n)
    stack.extend(src for src, _ in graph.data_inputs(n) if src in members and src not in plan)
  seg = Segment(name, tuple(layers), gates=sorted(gates, key=position.get))
  for src, port in tensors:
    info = shapes.get(f"{src}:{port}")
    seg.tensors.append(tensor_name(src, port))
    seg.bytes += (info.num_bytes or 0) if info is not None else 0
  return seg, sorted(plan, key=position.get), consumers


def _plan_drains(graph, shapes, report, planned, order, position):
  """Sets each planned segment's `drains`: the gradient ops that must end
  before its copies start, besides its gates.

  The gate only waits for the gradient of the segment's output. The later
  backward's other branches (a bias's BiasAddGrad, a LayerNorm's Sum, each
  reading an activation-sized gradient) are off that path, and TF's executor
  defers them when no thread is idle (one inter-op thread, or dp=2 on two
  cores): its LIFO ready queues run them at the end of the step, and every
  block's gradients stay alive across the whole backward.

  A backward op that needs the backward of segments k.. (in forward order;
  of none: k = n) and of none before k can end before segment k-1 starts: it
  drains into k-1. The gradient ops of a drain that nothing else of it reads
  later (and that no gate waits for already) are enough to wait for. An op
  whose needs skip a segment (segment 2's backward but not segment 3's)
  drains into none: waiting for it there could close a cycle. An op that
  reads only scalars is not waited for: it keeps no activation-sized
  gradient alive, and one of an auxiliary loss over the whole batch (an MoE
  router's balance loss) would make each micro-batch's copies wait for
  every micro-batch's forward.
  """
  if not planned:
    return
  ranked = sorted(range(len(planned)), key=lambda i: min(
      position[n] for n in planned[i][1]))
  # bit r: the backward of the segment of rank r (its consumers) is needed.
  bit = collections.defaultdict(int)
  for rank, i in enumerate(ranked):
    for consumer, _, _, _ in planned[i][2]:
      bit[consumer] |= 1 << rank
  full = (1 << len(ranked)) - 1
  needs, drain = {}, {}   # node -> bits of the backward it needs; -> rank it drains into
  for name in order:
    bits = bit.get(name, 0)
    for src in _sources(graph, name):
      bits |= needs.get(src, 0)
    if bits:
      needs[name] = bits
    if bits == full or report.role.get(name) != constants.BACKWARD or \
        name in report.variable_free:
      continue
    first = (bits & -bits).bit_length() - 1 if bits else len(ranked)
    if bits == full & ~((1 << first) - 1):   # segments first.., no gaps
      drain[name] = first - 1
  # Waited for: gradient ops proper. The ops that the role rules add to the
  # backward for reading only gradients (Adam's Square(g), a constant
  # learning rate's Mul) are the optimizer's and read the gradient once
  # all-reduced: waiting for them would hold the copies behind the collective.
  # An op is implied by a later one of its drain that is waited for.
  implied = set()
  for name in reversed(order):
    if name in drain and any(
        drain.get(c) == drain[name] and (c in implied or constants.is_gradient_name(c))
        for c, _ in graph.consumers(name)):
      implied.add(name)
  for rank, i in enumerate(ranked):
    seg = planned[i][0]
    covered, stack = set(), [s for g in seg.gates for s in _sources(graph, g)]
    while stack:  # what a gate waits for already
      n = stack.pop()
      if n in covered or drain.get(n) != rank:
        continue
      covered.add(n)
      stack.extend(_sources(graph, n))
    seg.drains = sorted((n for n, r in drain.items() if r == rank and n not in covered and
                         n not in implied and n not in seg.gates and
                         constants.is_gradient_name(n) and
                         not _reads_only_scalars(graph, shapes, n)),
                        key=position.get)


def _sources(graph, name):
  """The nodes `name` reads, data and control."""
  node = graph.node(name)
  return [src for src, _ in graph.data_inputs(name)] + graph.control_inputs(node)


# --- checks ----------------------------------------------------------------------------
def copies_of(graph_def):
  """{copy: original} of a (rewritten) graph, read from RECOMPUTE_OF_ATTR."""
  return {n.name: n.attr[RECOMPUTE_OF_ATTR].s.decode() for n in graph_def.node
          if RECOMPUTE_OF_ATTR in n.attr}


def check(graph_def, roles=None):
  """Problems (strings) with the recomputation in `graph_def`; [] when every
  copy is held back to the backward pass (it has a gate: a control input its
  original lacks, on a backward op given `roles` ({node: role} of
  `graph_def`), or it reads, through any path, a copy that has one) and every
  copy is read, by other copies or (given `roles`) backward ops only."""
  from tfsplit.sharding.builder import read_records  # pylint: disable=import-outside-toplevel
  graph = Graph(graph_def)
  copies = copies_of(graph_def)
  if not copies:
    return ["no recomputed ops in the graph"]
  records = read_records(graph_def)  # a split graph: each node's original and device
  local = {(r.source, r.device_id): n for n, r in records.items()}

  def gated(copy):
    original = copies[copy]
    if copy in records:  # the original's copy on the same device
      original = local.get((original, records[copy].device_id), original)
    theirs = set(graph.control_inputs(graph.node(original))) if original in graph else set()
    return any(roles is None or roles.get(g) == constants.BACKWARD
               for g in set(graph.control_inputs(graph.node(copy))) - theirs)
  held = set()
  for name in graph.topological_order():
    if (name in copies and gated(name)) or any(
        parse_input(t)[0] in held for t in graph.node(name).input):
      held.add(name)
  problems = []
  for copy, original in sorted(copies.items()):
    if copy not in held:
      problems.append(f"copy '{copy}' of '{original}' is not gated: nothing holds it "
                      "back to the backward pass")
    if not graph.consumers(copy):
      problems.append(f"copy '{copy}' of '{original}' is read by nothing")
    elif roles is not None:
      for consumer, _ in graph.consumers(copy):
        if consumer not in copies and roles.get(consumer) != constants.BACKWARD:
          problems.append(f"copy '{copy}' is read by '{consumer}', which is no backward op")
  return problems


def graph_summary(graph_def, mode):
  """One line on the recomputation in a (split) graph, read from its nodes."""
  copies = copies_of(graph_def)
  return (f"recompute ({describe(mode)}): {len(set(copies.values()))} forward ops "
          f"recomputed in the backward pass ({len(copies)} copies over the devices)")


def summary(result: Optional[Recomputed]):
  """One line on what was recomputed."""
  if result is None:
    return "recompute: none"
  return (f"recompute ({describe(result.mode)}): {len(result.segments)} segment(s), "
          f"{len(result.copies)} ops copied, {result.saved_bytes / 2**20:.2f} MiB of "
          "activations recomputed instead of kept")
