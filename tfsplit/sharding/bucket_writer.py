"""Writing gradient buckets into a materialized graph: on each device of its
group a bucket's members are flattened (or cut into the blocks each member
owns), concatenated, carried by one collective with the members' group, attrs
and a new instance key (cast to the bucket's travelling dtype before it and
back after, if it travels in a lower one), and split back, and each member's
result node becomes the Reshape of its piece under its own name and record, so its consumers,
control edges and output copies stay valid and nothing else is rewired. Nodes
are made and added through builder.DeviceGraph (names, records), the
bucket's collective as a copy of its first member's; the members'
collectives and the constants only they read are dropped at the end. Which
collectives form a bucket, and its key, is sharding/buckets.py's.
"""
from tensorflow.python.framework import dtypes

from tfsplit.graph.ir import input_node
from tfsplit.sharding.builder import NodeRecord, redefine

_INT32 = dtypes.int32


class BucketWriter(object):
  """Writes buckets (lists of buckets._Instance, every member of a group the
  same, in the same order) through `builder`, a DeviceGraph extending the
  materialized graph; `consumers`: {node: [(consumer, is data edge)]} of the
  graph before any bucket."""

  def __init__(self, builder, consumers):
    self.b, self.nodes, self.consumers = builder, builder.created, consumers
    self.dead_inputs, self.kept, self.rewritten = set(), set(), set()
    self.removed = set()   # nodes of collectives a bucket replaced
    self.travels = None    # the DType the bucket being written travels in, if lower

  def emit(self, bucket, key, base, travels=None):
    """travels: None, or the DataType enum the bucket's collective carries
    (the members' dtype otherwise; gradients only, never an all-gather)."""
    emit_on = {"all_reduce": self.emit_on, "reduce_scatter": self.emit_scatter_on,
               "all_gather": self.emit_gather_on}[bucket[0].kind]
    self.travels = dtypes.as_dtype(travels) if travels else None
    for d in bucket[0].here:
      emit_on(d, bucket, key, f"{base}/shard_{d}")

  def _collective(self, first, inputs, name, record=()):
    """Name of an added copy of collective member `first` (its op and
    attrs) over `inputs`, carrying the bucket's travelling dtype, recorded
    as `record` says (source, device id, shared)."""
    self.kept.update(input_node(t) for t in first.input[1:3])
    return self.b.collective_copy(first, name, inputs, self.travels, *record).name

  def _lower(self, where, x, dtype, device, record):
    """`x` cast to the travelling dtype (x itself if there is none)."""
    if self.travels is None:
      return x
    return self.b.op(f"{where}/to_{self.travels.name}", "Cast", device, [x],
                     {"SrcT": dtype, "DstT": self.travels, "Truncate": False}, *record)

  def _raise(self, where, x, dtype, device, record):
    """`x` cast back from the travelling dtype to the members' `dtype`."""
    if self.travels is None:
      return x
    return self.b.op(f"{where}/to_{dtype.name}", "Cast", device, [x],
                     {"SrcT": self.travels, "DstT": dtype, "Truncate": False}, *record)

  def _become_piece(self, member, piece, shape, dtype, device, where, k, dying=0):
    """Member result node `member` becomes the Reshape of its bucket piece,
    under its name and record: consumers and control edges stay valid. Its
    inputs from `dying` on are no longer read by it."""
    self.dead_inputs.update(input_node(t) for t in member.input[dying:])
    self.rewritten.add(member.name)
    shape_const = self.b.int_val_const(f"{where}/shape_{k}", list(shape), device)
    redefine(member, "Reshape", [piece, shape_const], {"T": dtype, "Tshape": _INT32})

  def _remove_unit(self, inst, d):
    """The member's nodes from its collective up to (not including) its
    result node: dropped (with the constants only they read)."""
    name = inst.nodes[d]
    result = inst.outputs[d]
    while name != result:
      node = self.nodes[name]
      self.removed.add(name)
      self.dead_inputs.update(input_node(t) for t in node.input)
      following = [c for c, data in self.consumers.get(name, ()) if data]
      if len(following) != 1:
        raise AssertionError(f"collective unit of '{name}' is not a chain")
      name = following[0]

  def _reshape(self, where, x, shape, device, dtype, record=()):
    """A Reshape of `x` to `shape` (a new Const named `where`/shape)."""
    return self.b.op(where, "Reshape", device,
                     [x, self.b.int_val_const(f"{where}/shape", shape, device)],
                     {"T": dtype, "Tshape": _INT32}, *record)

  def _axis(self, where, axis, device):
    """`axis`: a dimension (a new Const named `where`/axis) or a Const's name."""
    return self.b.int_val_const(f"{where}/axis", axis, device) if isinstance(axis, int) \
        else axis

  def _concat(self, where, parts, axis, device, dtype, record=()):
    if len(parts) == 1:   # a bucket of one tensor (it travels in a lower dtype)
      return parts[0]
    return self.b.op(where, "ConcatV2", device, parts + [self._axis(where, axis, device)],
                     {"T": dtype, "N": len(parts), "Tidx": _INT32}, *record)

  def _split(self, where, x, sizes, axis, device, dtype, record=()):
    """A SplitV of `x` into `sizes` along `axis` (as _axis takes it)."""
    if len(sizes) == 1:
      return x
    inputs = [x, self.b.int_val_const(f"{where}/sizes", sizes, device)]
    inputs.append(self._axis(where, axis, device))
    return self.b.op(where, "SplitV", device, inputs,
                     {"T": dtype, "Tlen": _INT32, "num_split": len(sizes)}, *record)

  def emit_scatter_on(self, d, bucket, key, where):
    """Device d's part of a bucket of reduce-scatters over n members: each
    member [n * b_k, ...] cut to [n, b_k...] rows, concatenated along
    dimension 1 (row i: every member's block i), scattered once, split back."""
    dtype = dtypes.as_dtype(bucket[0].dtype)
    n = len(bucket[0].group)
    colls = [self.nodes[i.nodes[d]] for i in bucket]
    first, device = colls[0], colls[0].device
    last = (bucket[-1].source, d, any(self.b.records.get(c.name, NodeRecord("", d)).shared
                                      for c in colls))
    rows = [self._reshape(f"{where}/rows_{k}", coll.input[0], [n, inst.elements // n], device,
                          dtype, (inst.source, d, last[2]))
            for k, (inst, coll) in enumerate(zip(bucket, colls))]
    concat = self._concat(f"{where}/concat", rows, 1, device, dtype, last)
    total = sum(i.elements for i in bucket) // n
    key_const = self.b.int_val_const(f"{where}/instance_key", key, device)
    sent = self._lower(where, concat, dtype, device, last)
    if first.op == "CollectiveAllToAllV2":
      exchange = self._collective(first, [sent, first.input[1], first.input[2], key_const],
                                  f"{where}/all_to_all", last)
      # The blocks received are summed in the members' dtype.
      reduced = self.b.op(f"{where}/sum", "Sum", device,
                          [self._raise(where, exchange, dtype, device, last),
                           self.b.int_val_const(f"{where}/sum/axis", 0, device)],
                          {"T": dtype, "Tidx": _INT32, "keep_dims": False}, *last)
    else:  # CollectiveReduceScatterV2: [1, total]
      scatter = self._collective(first, [sent, first.input[1], first.input[2], key_const],
                                 f"{where}/reduce_scatter", last)
      reduced = self._reshape(f"{where}/flat",
                              self._raise(where, scatter, dtype, device, last), [total],
                              device, dtype, last)
    split = self._split(f"{where}/split", reduced, [i.elements // n for i in bucket], 0,
                        device, dtype, last)
    for k, inst in enumerate(bucket):
      self._remove_unit(inst, d)
      shape = [inst.local_shape[0] // n] + list(inst.local_shape[1:])
      self._become_piece(self.nodes[inst.outputs[d]], f"{split}:{k}" if k else split, shape,
                         dtype, device, where, k)

  def emit_gather_on(self, d, bucket, key, where):
    """Device d's part of a bucket of all-gathers: the members' blocks
    flattened and concatenated, gathered once ([n * total]), cut to
    [n, total] and split along dimension 1 into each member's [n, elements]."""
    dtype = dtypes.as_dtype(bucket[0].dtype)
    n = len(bucket[0].group)
    colls = [self.nodes[i.nodes[d]] for i in bucket]
    first, device = colls[0], colls[0].device
    flats = [self._reshape(f"{where}/flat_{k}", coll.input[0], [inst.elements], device, dtype)
             for k, (inst, coll) in enumerate(zip(bucket, colls))]
    concat = self._concat(f"{where}/concat", flats, 0, device, dtype)
    gather = self._collective(first, [concat, first.input[1], first.input[2],
                                      self.b.int_val_const(f"{where}/instance_key", key,
                                                           device)],
                              f"{where}/all_gather")
    total = sum(i.elements for i in bucket)
    cut = self._reshape(f"{where}/blocks", gather, [n, total], device, dtype)
    split = self._split(f"{where}/split", cut, [i.elements for i in bucket], 1, device, dtype)
    for k, (inst, coll) in enumerate(zip(bucket, colls)):
      shape = [inst.local_shape[0] * n] + list(inst.local_shape[1:])
      self._become_piece(coll, f"{split}:{k}" if k else split, shape, dtype, device, where, k)

  def emit_on(self, d, bucket, key, where):
    """Device d's part of a bucket of all-reduces: the members flattened,
    concatenated, reduced once and split back."""
    dtype = dtypes.as_dtype(bucket[0].dtype)
    records = self.b.records
    members = [self.nodes[i.nodes[d]] for i in bucket]
    first, device = members[0], members[0].device
    last = (bucket[-1].source, d, any(records[m.name].shared for m in members))
    flats = []
    for k, (inst, member) in enumerate(zip(bucket, members)):
      mine = records[member.name]
      flats.append(self._reshape(f"{where}/flat_{k}", member.input[0], [inst.elements],
                                 device, dtype, (mine.source, d, mine.shared)))
    axis = self.b.int_val_const(f"{where}/axis", 0, device)
    concat = self._concat(f"{where}/concat", flats, axis, device, dtype, last)
    reduced = self._collective(first, [self._lower(where, concat, dtype, device, last),
                                       first.input[1], first.input[2],
                                       self.b.int_val_const(f"{where}/instance_key", key,
                                                            device)], f"{where}/all_reduce",
                               last)
    split = self._split(f"{where}/split", self._raise(where, reduced, dtype, device, last),
                        [i.elements for i in bucket], axis, device, dtype, last)
    for k, (inst, member) in enumerate(zip(bucket, members)):
      self._become_piece(member, f"{split}:{k}" if k else split, inst.local_shape, dtype,
                         device, where, k, dying=1)

  def finish(self):
    """Drops the members' now unused key constants (and the collectives a
    bucket replaced) with their records."""
    gone = self.rewritten | self.removed
    dead = {n for n in self.dead_inputs - self.kept if self.nodes[n].op == "Const" and
            all(c in gone for c, _ in self.consumers.get(n, ()))} | self.removed
    self.b.remove(dead)
