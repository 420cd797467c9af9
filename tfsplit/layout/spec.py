"""How one tensor is laid out over a mesh.

`Sharding(dims, partial)`: `dims[i]` is the mesh axis that splits tensor
dimension i into equal contiguous blocks (None: replicated along it);
`partial` is the set of mesh axes over which the local values are partial
sums (the result of a contraction over a split dimension): the true tensor is
the sum over that axis of the local tensors.

A sharding constraint (GSPMD's `with_sharding_constraint`) is an Identity
carrying `CONSTRAINT_ATTR`: its output has exactly that sharding, so the
tensor is resharded into it there, and its consumers see it so (the split
of optimizer state uses one to reduce-scatter a gradient straight into the
shards of its optimizer slots: sharding/zero.py).
"""
import dataclasses
from typing import FrozenSet, Optional, Tuple

from tfsplit.errors import PlanError

# A private attr (TF ignores it when running the graph): one string per
# tensor dimension, the mesh axis splitting it, "" (replicated) or KEEP (as
# the constraint's input has it: a batch split over dp stays).
CONSTRAINT_ATTR = "_tfsplit_sharding"
KEEP = "?"


def axis_parts(axis):
  """The mesh axes of a (possibly compound) axis: 'dp*mb*ep' -> ['dp', 'mb', 'ep'].

  A compound axis splits one dimension over several mesh axes, the first
  major (the batch over data-parallel replicas, micro-batches and experts)."""
  return axis.split("*")


def join_parts(parts):
  """The compound axis of `parts` in order, None for no parts."""
  return "*".join(parts) if parts else None


def without_part(axis, part):
  """`axis` less mesh axis `part` ('dp*mb*ep' less 'ep' -> 'dp*mb'; 'ep' -> None)."""
  return join_parts([p for p in axis_parts(axis) if p != part])


def overlaps(axis, parts):
  """Whether (possibly compound) `axis` uses a mesh axis in the set `parts`."""
  return any(p in parts for p in axis_parts(axis))


@dataclasses.dataclass(frozen=True)
class Sharding:
  dims: Tuple[Optional[str], ...]
  partial: FrozenSet[str] = frozenset()

  @classmethod
  def replicated(cls, rank):
    return cls((None,) * rank)

  @classmethod
  def split(cls, rank, dim, axis):
    dims = [None] * rank
    dims[dim] = axis
    return cls(tuple(dims))

  @property
  def rank(self):
    return len(self.dims)

  @property
  def is_replicated(self):
    return not self.partial and all(d is None for d in self.dims)

  @property
  def axes_used(self):
    return {d for d in self.dims if d is not None} | set(self.partial)

  @property
  def parts_used(self):
    """The mesh axes it uses, compound axes taken apart."""
    return {p for a in self.axes_used for p in axis_parts(a)}

  def split_dims(self):
    return [(i, a) for i, a in enumerate(self.dims) if a is not None]

  def with_dims(self, dims):
    return Sharding(tuple(dims), self.partial)

  def without_partial(self):
    return Sharding(self.dims)

  def with_partial(self, axes):
    return Sharding(self.dims, frozenset(axes))

  def __str__(self):
    body = ",".join(a or "-" for a in self.dims)
    part = f" partial({','.join(sorted(self.partial))})" if self.partial else ""
    return f"[{body}]{part}"

  def local_shape(self, shape, mesh, what="tensor"):
    """Per-device shape of a tensor of global `shape`; checks divisibility."""
    if shape is None:
      return None
    local = list(shape)
    for i, axis in self.split_dims():
      if local[i] is None:
        continue
      n = mesh.size_of(axis)
      if local[i] % n:
        raise PlanError(f"{what}: dimension {i} of size {local[i]} does not "
                        f"divide by mesh axis {axis}={n}; choose a mesh size "
                        "that divides it or leave this tensor replicated")
      local[i] //= n
    return tuple(local)

  def offsets(self, shape, mesh, device_id, what="variable"):
    """Start index of `device_id`'s block in each dimension."""
    out = []
    for i, axis in enumerate(self.dims):
      if axis is None:
        out.append(0)
      elif shape is None or shape[i] is None:
        raise PlanError(f"{what}: dimension {i} has an unknown size, so its shards "
                        f"over mesh axis {axis} have no known offsets; give it a "
                        "static shape or leave it replicated (--annotate)")
      else:
        out.append(mesh.coord_of(device_id, axis) * (shape[i] // mesh.size_of(axis)))
    return tuple(out)


def constraint_node(name, source, dtype, dims, device=""):
  """An Identity of `source` whose output must have sharding `dims`."""
  from tensorflow.core.framework import node_def_pb2  # pylint: disable=import-outside-toplevel
  node = node_def_pb2.NodeDef(name=name, op="Identity", input=[source], device=device)
  node.attr["T"].type = dtype
  node.attr[CONSTRAINT_ATTR].list.s.extend((a or "").encode() for a in dims)
  return node


def constraint_of(node):
  """The Sharding a constraint node asks for, or None for any other node."""
  if node.op != "Identity" or CONSTRAINT_ATTR not in node.attr:
    return None
  return Sharding(tuple(s.decode() or None for s in node.attr[CONSTRAINT_ATTR].list.s))


@dataclasses.dataclass(frozen=True)
class Constraint:
  """One sharding constraint to insert: node `name` (its scope gives its
  role and layer) reads tensor `source` ((node, port)) and has sharding
  `dims`; `readers` (node names) read it instead of the source (None: every
  consumer). With `after` (node names) it reads the source through an
  Identity that waits for them: its reshard is its own (collectives are
  shared per tensor read) and runs after them, not when the source is
  made (a gather for the backward pass kept out of the forward's memory)."""
  name: str
  source: Tuple[str, int]
  dims: Tuple[Optional[str], ...]
  readers: Optional[FrozenSet[str]] = None
  after: Tuple[str, ...] = ()


def insert_constraints(graph_def, graph, shapes, constraints):
  """(GraphDef, known shapes) of `graph_def` (indexed as `graph`, shaped as
  `shapes`) with each Constraint's Identity added and its readers rewired
  to it; names taken are made free by a numeric suffix."""
  from tensorflow.core.framework import graph_pb2  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.ir import parse_input  # pylint: disable=import-outside-toplevel
  out = graph_pb2.GraphDef()
  out.CopyFrom(graph_def)
  names = {n.name for n in out.node}
  known = dict(shapes.by_node)
  rewire = {}  # (source, port) -> [(readers or None, constraint node)]
  added = set()
  for c in constraints:
    name, i = c.name, 0
    while name in names:
      i += 1
      name = f"{c.name}_{i}"
    names.add(name)
    added.add(name)
    src, port = c.source
    info = shapes.tensor(src, port)
    device = graph.node(src).device
    read = src if port == 0 else f"{src}:{port}"
    if c.after:
      gate = constraint_node(f"{name}/after", read, info.dtype, (), device)
      del gate.attr[CONSTRAINT_ATTR]
      gate.input.extend(f"^{a}" for a in c.after)
      out.node.add().CopyFrom(gate)
      names.add(gate.name)
      added.add(gate.name)
      known[gate.name] = [info]
      read = gate.name
    out.node.add().CopyFrom(constraint_node(name, read, info.dtype, c.dims, device))
    rewire.setdefault((src, port), []).append((c.readers, name))
    known[name] = [info]
  for node in out.node:
    if node.name in added:
      continue
    for i, text in enumerate(node.input):
      if text.startswith("^"):
        continue
      for readers, new in rewire.get(parse_input(text), ()):
        if readers is None or node.name in readers:
          node.input[i] = new
          break
  return out, known
