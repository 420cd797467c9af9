"""Materialization: one copy of every op per device, with local shapes.

Each node is expanded on the devices that hold it (all of them, or its
pipeline stage's): a variable becomes one shard variable per device (recorded
in the manifest), a graph input each device's block of the batch, an op a
local copy whose inputs are resharded (sharding/reshard.py) to what its rule
asked for, and each graph output keeps its name (on device 0, whole, after
every device's copy). Control edges are only copied within one device, so the
members of a collective are never ordered against each other across devices.
Micro-batch copies of an op that does not depend on the micro-batch (an
optimizer update) are shared: one per device, and so are identical constants:
a device's copies of constants with the same value are one node, as they are
made here and, once later passes have added theirs, by `lean_constants`
(which also drops the copies nothing reads).
"""
import dataclasses
import zlib
from typing import Dict, List, Optional

from tensorflow.core.framework import node_def_pb2
from tensorflow.core.framework import types_pb2

from tfsplit import constants
from tfsplit.errors import PlanError
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.ir import delete_positions, parse_input
from tfsplit.graph.endpoints import graph_outputs
from tfsplit.rules.base import Decision
from tfsplit.sharding.builder import (DeviceGraph, constant_key, local_name,
                                      shard_variable_name, shard_variable_node, tensor)
from tfsplit.sharding.localize import LocalizeContext
from tfsplit.sharding.placement import Placement
from tfsplit.sharding.reshard import Resharder
from tfsplit.layout.spec import Sharding

# Attrs naming global shapes, colocation with (now absent) original nodes, or
# the original function's signature: wrong on a local copy.
_DROPPED_ATTRS = ("_output_shapes", "_class", variables_lib.INPUT_INDEX_ATTR,
                  variables_lib.OUTPUT_INDEX_ATTR)


@dataclasses.dataclass
class Materialized:
  graph_def: object
  manifest: Dict[str, dict]        # variable -> {"dtype", "shape", "sharding", "shards"}
  collectives: list                # reshard.CollectiveRecord
  output_copies: Dict[str, list]   # output -> [[device, local tensor]]
  records: Dict[str, object]       # local node -> builder.NodeRecord
  local_sums: List[dict]           # per running gradient sum: {device id: member}
  only: Optional[frozenset] = None  # the device ids made (one task's), None: all
  # output -> the device ids with a copy of it, made or not (every task's)
  output_holders: Dict[str, List[int]] = dataclasses.field(default_factory=dict)


class _Materializer(object):

  def __init__(self, graph, shapes, mesh, propagation, variables, timeout, stage_of,
               scatter_microbatches=False, moved=frozenset(), only=None):
    self.graph, self.shapes, self.mesh, self.prop = graph, shapes, mesh, propagation
    self.variables = {v.node: v for v in variables}
    self.place = Placement(mesh, stage_of, only)
    self.b = DeviceGraph(graph.versions, graph.library)
    # TF caches a collective's shape per (group, instance) key: the same graph
    # split two ways must not reuse keys, so the plan is in the seed.
    plan = repr((sorted(mesh.axes.items()), mesh.devices,
                 sorted((k, str(v)) for k, v in propagation.variable_specs.items())))
    seed = zlib.crc32(graph.graph_def.SerializeToString(deterministic=True) + plan.encode())
    self.r = Resharder(self.b, mesh, timeout, seed, scatter_microbatches)
    self.alias = {}          # (node, device id) -> the local name it shares
    self.sources = {}        # (src, port) -> source()'s answer
    self.reshards = {}       # (src, port, want, raw) -> [local tensor per device]
    self.deferred, self.manifest, self.output_copies = [], {}, {}
    self.output_holders = {}
    # Constants whose copies stay apart: the outputs keep theirs, and moved
    # ones (to a host, after this) must not be read where they were.
    self.unmerged = frozenset(graph_outputs(graph)) | frozenset(moved)
    self.constants = {}      # (device, constant_key) -> the local copy made first
    self._block_cache = {}   # split axes -> each device's coordinates on them

  def lname(self, name, d):
    """Node `name`'s copy as device d sees it (its stage's; shared ones aliased)."""
    d = self.place.on_stage(d, self.place.stage(name))
    return self.alias.get((name, d)) or local_name(name, d)

  def copies(self, src, port):
    """src:port as each device's copy of src has it: one entry per mesh
    device, None on devices this split does not make (another task's)."""
    made = self.place.only
    if made is None:
      return [tensor(self.lname(src, d), port) for d in range(self.mesh.size)]
    found = [None] * self.mesh.size
    for d in made:
      found[d] = tensor(self.lname(src, d), port)
    return found

  # --- tensors as consumers see them ---------------------------------------------
  def source(self, src, port, consumer):
    """(local tensor per device, sharding) of src:port as consumers see it."""
    key = (src, port)
    found = self.sources.get(key)
    if found is None:
      # Final once src is materialized (its aliases are set by then), and
      # consumers come after their sources: computed once per tensor.
      produced = self.prop.reduced_at_source.get(key)
      if produced is None:
        outs = self.prop.outputs[src]
        have = outs[port] if port < len(outs) else None
        found = (self.copies(src, port), have)
      else:
        whole = produced.without_partial()
        found = (self.reshard(src, port, produced, whole, consumer, raw=True), whole)
      self.sources[key] = found
    return list(found[0]), found[1]

  def reshard(self, src, port, have, want, consumer, raw=False, ordered=True):
    key = (src, port, want, raw)
    if key not in self.reshards:
      if raw:
        current = self.copies(src, port)
      else:
        current, have = self.source(src, port, consumer)
      current = self.r.reshard(current, self.place.ids_for(src), self.shapes[src][port], have,
                               want, src, port, consumer, ordered)
      stage = self.place.stage(src)
      self.reshards[key] = current if stage is None else \
          [current[c] for c in self.place.stage_map(stage)]
    return self.reshards[key]

  # --- nodes ------------------------------------------------------------------------
  def variable(self, node):
    info = self.variables[node.name]
    spec = self.prop.variable_specs.get(node.name) or Sharding.replicated(len(info.shape))
    local_shape = spec.local_shape(info.shape, self.mesh, f"variable '{info.name}'")
    shards, offsets = [], {}
    split_axes = [axis for axis in spec.dims if axis is not None]
    made = set(self.place.ids_for(node.name))
    blocks = self._blocks(tuple(split_axes))
    devices, shard_shape = self.mesh.devices, list(local_shape)
    for d in self.place.all_ids_for(node.name):  # the manifest names every task's
      if self.r.rep(d) != d:  # micro-batches share their device's variables
        if d in made:
          self.alias[(node.name, d)] = self.lname(node.name, self.r.rep(d))
        continue
      shard_name = shard_variable_name(info.name, d)
      if d in made:
        new = shard_variable_node(node, local_name(node.name, d), self.mesh.devices[d],
                                  shard_name, local_shape)
        self.b.add(new, node.name, d)
        self.b.mark_shared(new.name)
      # A shard's offsets depend only on its coordinates on the split axes:
      # found once per block, not once per replica.
      block = blocks[d]
      if block not in offsets:
        offsets[block] = list(spec.offsets(info.shape, self.mesh, d, f"variable '{info.name}'"))
      # Shards of a block share its offsets and shape lists (read-only).
      shards.append({"name": shard_name, "device": devices[d], "device_id": d,
                     "offsets": offsets[block], "shape": shard_shape})
    self.manifest[info.name] = {"dtype": info.dtype_name, "shape": list(info.shape),
                                "trainable": info.trainable, "sharding": list(spec.dims),
                                "shards": shards}

  def _blocks(self, axes):
    """Each device's coordinates on `axes` (the block of a variable split
    over them), found once per set of axes rather than per variable."""
    found = self._block_cache.get(axes)
    if found is None:
      found = [tuple(self.mesh.coord_of(d, a) for a in axes) for d in range(self.mesh.size)]
      self._block_cache[axes] = found
    return found

  def graph_input(self, node):
    """Graph inputs keep their name; each device reads its block of them."""
    self.b.add(node)
    spec = self.prop.outputs[node.name][0]
    info = self.shapes[node.name][0]
    whole = [node.name] * self.mesh.size
    if spec is None or spec.is_replicated:
      for d in self.place.ids_for(node.name):
        if self.r.rep(d) != d:
          self.alias[(node.name, d)] = self.lname(node.name, self.r.rep(d))
          continue
        ident = node_def_pb2.NodeDef(name=local_name(node.name, d), op="Identity",
                                     device=self.mesh.devices[d], input=[node.name])
        ident.attr["T"].type = node.attr["dtype"].type
        self.b.add(ident, node.name, d)
        self.b.mark_shared(ident.name)
      return
    ids = self.place.ids_for(node.name)
    self.r.slice(whole, ids, info, Sharding.replicated(len(info.shape)), spec,
                 (node.name, 0, node.name), {d: local_name(node.name, d) for d in ids})

  def op(self, node):
    name = node.name
    texts = list(node.input)  # read once: each proto field read makes new strings
    positions, controls = [], []
    for pos, t in enumerate(texts):
      if t[:1] == "^":
        controls.append((pos, t[1:]))
      else:
        positions.append(pos)
    decision = self.prop.decisions.get(name)
    if decision is None:  # forwards a variable handle (an inlined call's argument)
      decision = Decision([None] * len(positions), [None] * max(1, len(self.shapes[name])))
    data = self.graph.data_inputs(name)
    resolved = []
    for j, (src, port) in enumerate(data):
      want = decision.inputs[j]
      local, have = self.source(src, port, name)
      resolved.append(local if want is None or have is None or have == want
                      else self.reshard(src, port, have, want, name))
    varies = writes = None  # what sharing a micro-batch copy asks: found once, if asked
    dropped = [a for a in _DROPPED_ATTRS if a in node.attr]
    devices = self.mesh.devices
    localize = decision.localize
    in_infos = None if localize is None else [self.shapes.tensor(s, p) for s, p in data]
    # One copy per device of each constant value (TF would merge them at the
    # first call; every tool before it would carry them).
    merged_as = constant_key(node) if node.op == "Const" and not texts and \
        localize is None and name not in self.unmerged else None
    for d in self.place.ids_for(name):
      r = self.r.rep(d)
      if r != d:
        if varies is None:
          varies = any(self.r.uses_local_axis(o) for o in decision.outputs)
          writes = constants.is_write_op(node.op)
        same_data = all(res[d] == res[r] for res in resolved)
        if not varies and same_data and (writes or all(
            self.lname(c, d) == self.lname(c, r) for _, c in controls)):
          self._share(node, d, r, [c for _, c in controls])
          continue
        if writes and resolved and resolved[0][d] == resolved[0][r]:
          raise PlanError(
              f"node '{name}' (op {node.op}) would update the same variable once per "
              "micro-batch (its inputs differ between micro-batches); this is a bug in "
              "tfsplit's micro-batching, please report it")
      local = local_name(name, d)
      if merged_as is not None:
        first = self.constants.setdefault((devices[d], merged_as), local)
        if first != local:
          self.alias[(name, d)] = first
          continue
      if localize is None:
        # Edited in place in the output: one copy of the NodeDef, not two.
        new = self.b.add_copy(node, local, devices[d], name, d)
      else:
        new = node_def_pb2.NodeDef()
        new.CopyFrom(node)
        new.name, new.device = local, devices[d]
        self.b.names.add(local)
      inputs = new.input
      for j, pos in enumerate(positions):
        inputs[pos] = resolved[j][d]
      for pos, c in controls:
        inputs[pos] = "^" + self.lname(c, d)
      for attr in dropped:
        del new.attr[attr]
      if localize is not None:
        localize(LocalizeContext(self, new, node, decision, d, positions, in_infos))
        self.b.add(new, name, d)
        for extra in self.deferred:
          self.b.add(extra, name, d)
        self.deferred = []

  def _share(self, node, d, r, controls):
    """Device d (micro-batch > 0) uses micro-batch 0's copy: an optimizer
    update runs once per step. The shared copy also waits for what d's copy
    would have waited for (every forward read of its variable)."""
    shared = self.lname(node.name, r)
    self.alias[(node.name, d)] = shared
    self.b.mark_shared(shared)
    extra = {"^" + self.lname(c, d) for c in controls} - {"^" + self.lname(c, r)
                                                           for c in controls}
    if extra and shared in self.b.created:
      target = self.b.created[shared]
      target.input.extend(sorted(extra - set(target.input)))

  def output(self, name):
    """The original output name, on device 0 (the first materialized one),
    whole, after every device's copy."""
    node, info = self.graph.node(name), self.shapes[name][0]
    whole = Sharding.replicated(len(info.shape)) if info.shape is not None else None
    local, spec = self.source(name, 0, name)
    if spec is not None and whole is not None and spec != whole:
      # Reductions of the outputs come after the updates (a train step's
      # loss waits for them): they must not order micro-batches.
      local = self.reshard(name, 0, spec, whole, name, ordered=False)
    seen = {}
    for d in self.place.ids_for(name):
      seen.setdefault(local[d], d)
    self.output_copies[name] = [[self.mesh.devices[d], t]
                                for d, t in sorted((d, t) for t, d in seen.items())]
    self.output_holders[name] = list(self.place.all_ids_for(name))
    # Control inputs from every device's copy: a collective member that no
    # fetched node depends on is pruned, and its peers would wait forever.
    ids = range(self.mesh.size) if self.place.only is None else sorted(self.place.only)
    copies = [local[d] for d in ids]
    out = node_def_pb2.NodeDef(name=name, op="Identity", device=self.mesh.devices[ids[0]],
                               input=[copies[0]] + ["^" + parse_input(t)[0] for t in
                                                    sorted(set(copies[1:]) - {copies[0]})])
    out.attr["T"].type = info.dtype
    if variables_lib.OUTPUT_INDEX_ATTR in node.attr:
      out.attr[variables_lib.OUTPUT_INDEX_ATTR].CopyFrom(
          node.attr[variables_lib.OUTPUT_INDEX_ATTR])
    self.b.add(out)

  def run(self):
    for name in self.prop.order:
      node = self.graph.node(name)
      if name in self.variables:
        self.variable(node)
      elif node.op == "Placeholder" and (variables_lib.INPUT_INDEX_ATTR in node.attr or
                                         node.attr["dtype"].type != types_pb2.DT_RESOURCE):
        self.graph_input(node)
      else:
        self.op(node)
    for name in graph_outputs(self.graph):
      self.output(name)
    return Materialized(self.b.graph_def, self.manifest, self.r.collectives,
                        self.output_copies, self.b.records, self.r.local_sums,
                        self.place.only, self.output_holders)


def materialize(graph, shapes, mesh, propagation, variables, timeout_seconds=None,
                stage_of=None, scatter_microbatches=False, moved=frozenset(), only=None):
  """Materialized per-device graph of `graph` under `propagation` (see module doc).

  scatter_microbatches: a partial sum over micro-batches and a real axis
  wanted split over that axis is reduce-scattered per micro-batch, then
  summed as blocks (ZeRO stage 2; see sharding/reshard.py).
  moved: original nodes a later pass moves off their device (offload); their
  constants are not merged with the others.
  only: the device ids to make copies on (one task's part, when no edge but
  collectives crosses tasks; the manifest still lists every shard)."""
  return _Materializer(graph, shapes, mesh, propagation, variables, timeout_seconds,
                       stage_of, scatter_microbatches, moved, only).run()


def lean_constants(materialized, outputs):
  """Removes the device copies of constants that nothing reads from
  `materialized` (graph and records, in place), and makes the identical
  constants on each device one; returns whether every input of the graph
  names an earlier node. outputs: the original graph's outputs.

  A rule's localize gives a device its own shape or size constant, and
  folding leaves the leaves of shape arithmetic unread, so the global
  constant's copy on each device goes unread; and every device gets its own
  copy of every constant a copied op reads, most of them equal. TF would
  prune and merge them before the first step, but first every tool would
  carry them (about a third of a split graph's nodes): the acyclic check,
  the written graph, its import, Grappler at the first call.

  Constants are the same when their device, dtype, value and other attrs
  are (the per-node records aside, which name each copy's original). The
  copies of the graph's outputs stay (in a graph whose outputs are not
  marked, every unread node counts as one), and so do a constant with an
  input (a control edge) or one another node is colocated with. A removed
  duplicate's readers read the first of its kind, which keeps the node order
  topological; removed nodes' records go with them. One scan of the graph
  and one deletion, since a scan of a large split graph is not free. The
  scan also finds whether every input names an earlier node (the answer),
  which an acyclic check would otherwise scan for again."""
  graph_def, records = materialized.graph_def, materialized.records
  outputs = set(outputs)
  read, colocated, consts, const_readers = set(), set(), [], []
  seen = {}  # node so far -> whether it is a Const
  ordered = True
  for position, node in enumerate(graph_def.node):
    reads_constant = False
    for text in node.input:
      name = text[1:] if text[:1] == "^" else text.partition(":")[0]
      read.add(name)
      is_const = seen.get(name)
      if is_const is None:
        ordered = False
      elif is_const:
        reads_constant = True
    if reads_constant:
      const_readers.append(node)
    name = node.name
    if name in seen:
      ordered = False  # defined twice: Graph says so
    is_const = seen[name] = node.op == "Const"
    if is_const:
      consts.append((position, node))
    if "_class" in node.attr:
      colocated.update(s.decode()[len("loc:@"):] for s in node.attr["_class"].list.s)
  doomed, first, renamed = [], {}, {}
  for position, node in consts:
    name = node.name
    if getattr(records.get(name), "source", None) in outputs:
      continue
    if name not in read:
      doomed.append((position, name))
      continue
    if node.input or not node.device or name in colocated:
      continue
    twin = first.setdefault((node.device, constant_key(node)), name)
    if twin != name:
      doomed.append((position, name))
      # input texts naming the removed constant -> the texts naming its twin
      renamed[name] = renamed[name + ":0"] = twin
      renamed["^" + name] = "^" + twin
  if renamed:
    # In order, a constant's readers come after it, so were seen reading one.
    for node in const_readers if ordered else graph_def.node:
      if not renamed.keys().isdisjoint(node.input):
        inputs = []
        for text in node.input:
          text = renamed.get(text, text)
          if text[:1] != "^" or text not in inputs:   # one control edge per twin
            inputs.append(text)
        del node.input[:]
        node.input.extend(inputs)
  # Renaming to an earlier twin and deleting keep an order topological.
  delete_positions(graph_def, [position for position, _ in doomed])
  for _, name in doomed:
    records.pop(name, None)
  return ordered
