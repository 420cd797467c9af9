"""Names, roles and trainability of the captured variables of a plain graph,
which keeps none of them: they are read from the scopes of each variable's
forward reads and from the ops those reads feed, the way Keras names its
weights, so that what tfsplit reports, and matches against a checkpoint,
looks like the model's own names.

Names (a heuristic; deterministic, unique):
- the *scope* of a variable is that of its first read in the forward pass
  (the read's name without its own last component, and without the op it
  was created for when that op exists: `.../fc1/MatMul/ReadVariableOp` ->
  `.../fc1`), without trailing scopes that name an op or a TF helper
  (`batchnorm`, `Tensordot`, `einsum`, `moments`, `embedding_lookup`, any
  registered op name); when every component of every forward scope ends in
  `_<n>` (Keras 3 re-enters its layer scopes: `gpt_1/block_0_1/mlp_1/...`),
  one `_<n>` is dropped from each;
- the last component is the variable's role, named as Keras names it:
  `kernel` (an operand of MatMul / BatchMatMul / Einsum / Conv, through
  Identity / Cast / Reshape), `embeddings` (the table of a gather, or added
  to a gather's output), `bias` (BiasAdd, or added to a contraction's
  output), `gamma` (multiplies), `beta` (added, in a scope whose other
  variable multiplies), else `variable`;
- a variable not read in the forward pass whose reads feed the update of
  exactly one trainable variable W is an optimizer slot of W, named
  `<its scope>/<W's name>/slot_<k>` (k in node order); an integer scalar that
  is updated is `<scope>/iteration`; anything else `<scope>/variable`;
- clashes get `_1`, `_2`, ... in node order (forward variables first).
Trainable: read in the forward pass and updated from a gradient (an update
depends, through data or control edges, on a `gradient_tape/` op).
"""
import collections
import re

from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import op_def_registry

from tfsplit.graph.ir import parse_input
from tfsplit.graph.recover_structure import GRADIENT_PREFIX

_SUFFIX = re.compile(r"_\d+$")
_MAX_GRADIENT_SEARCH = 4096

_VIEWS = frozenset(["Identity", "Cast", "StopGradient", "Snapshot", "PreventGradient",
                    "Reshape", "ExpandDims", "Squeeze", "Transpose"])
_CONTRACTIONS = frozenset(["MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3",
                           "Einsum", "Conv1D", "Conv2D", "Conv3D",
                           "DepthwiseConv2dNative", "Conv2DBackpropInput"])
_GATHERS = frozenset(["GatherV2", "Gather", "ResourceGather"])
# Scopes TF's own Python helpers open inside a layer's scope.
_HELPER_SCOPES = frozenset(["batchnorm", "Tensordot", "tensordot", "einsum", "moments",
                            "embedding_lookup", "dropout", "normalize", "truediv"])


def _is_op_scope(component):
  base = _SUFFIX.sub("", component)
  if base in _HELPER_SCOPES:
    return True
  return any(op_def_registry.get(c) is not None
             for c in {base, base[:1].upper() + base[1:]} if c)


def _read_scope(graph, read):
  parts = read.name.split("/")[:-1]
  if read.op == "ReadVariableOp" and parts and "/".join(parts) in graph:
    parts = parts[:-1]  # the op the read was made for: '.../fc1/MatMul/ReadVariableOp'
  while parts and _is_op_scope(parts[-1]):
    parts = parts[:-1]
  return parts


def _role(st, read):
  """(priority, role) of one forward read: lower priority wins."""
  if read.op in ("ResourceGather", "ResourceGatherNd"):
    return 0, "embeddings"
  best = (9, "variable")
  for node, index, _ in st.view_consumers(read, _VIEWS):
    if node.op in _GATHERS and index == 0:
      found = (0, "embeddings")
    elif node.op in _CONTRACTIONS:
      found = (1, "kernel")
    elif node.op == "BiasAdd" and index == 1:
      found = (2, "bias")
    elif (node.op in ("Add", "AddV2") and index in (0, 1)) or (
        node.op == "Sub" and index == 0):
      other = _producer_kind(st.graph, node.input[1 - index])
      found = {"gather": (0, "embeddings"), "contraction": (2, "bias")}.get(other, (4, "add"))
    elif node.op == "Mul":
      found = (3, "gamma")
    else:
      continue
    best = min(best, found)
  return best


def _producer_kind(graph, text):
  name = parse_input(text)[0]
  for _ in range(8):
    node = graph.node(name)
    if node.op in _GATHERS or node.op == "ResourceGather":
      return "gather"
    if node.op in _CONTRACTIONS:
      return "contraction"
    if node.op not in _VIEWS and node.op != "BiasAdd":
      return None
    name = parse_input(node.input[0])[0]
  return None


def name_variables(graph, st, variables, outputs):
  forward = graph.data_ancestors(outputs) if outputs else set()
  forward_reads = {v.node: [r for r in st.reads[v.node] if r.name in forward and
                            not GRADIENT_PREFIX.match(r.name)] for v in variables}
  # Scopes.
  scopes = {}
  for v in variables:
    reads = forward_reads[v.node] or st.reads[v.node] or [n for n in st.users[v.node]]
    scopes[v.node] = _read_scope(graph, reads[0]) if reads else v.node.split("/")[:-1]
  model_scopes = [scopes[v.node] for v in variables if forward_reads[v.node]]
  if model_scopes and all(_SUFFIX.search(c) for s in model_scopes for c in s) and any(
      model_scopes):
    for v in variables:
      if forward_reads[v.node]:
        scopes[v.node] = [_SUFFIX.sub("", c) for c in scopes[v.node]]
  # Roles and trainability of forward variables.
  for v in variables:
    v.scope = "/".join(scopes[v.node])
    if forward_reads[v.node]:
      v.role = min(_role(st, r) for r in forward_reads[v.node])[1]
      v.trainable = _updated_from_gradient(graph, st, v) if forward else None
    else:
      v.trainable = False if forward else None
  multiplied = {v.scope for v in variables if v.role == "gamma"}
  for v in variables:
    if v.role == "add":
      v.role = "beta" if v.scope in multiplied else "bias"
  # Forward variables first, then the others (slots are named after theirs).
  used, taken = set(), collections.Counter()

  def unique(base):
    name = base
    while name in used:
      taken[base] += 1
      name = f"{base}_{taken[base]}"
    used.add(name)
    return name

  for v in variables:
    if forward_reads[v.node]:
      v.name = unique(_join(v.scope, v.role))
  by_node = {v.node: v for v in variables}
  readers = st.update_readers()
  slot_count = collections.Counter()
  for v in variables:
    if forward_reads[v.node]:
      continue
    owners = [o for o in readers.get(v.node, ()) if by_node[o].trainable]
    if len(owners) == 1:
      v.owner = owners[0]
      k = slot_count[v.owner]
      slot_count[v.owner] += 1
      v.name = unique(_join(v.scope, by_node[v.owner].name, f"slot_{k}"))
      v.role = "slot"
    elif (v.dtype in (types_pb2.DT_INT32, types_pb2.DT_INT64) and v.shape == () and
          st.writers[v.node]):
      v.name = unique(_join(v.scope, "iteration"))
      v.role = "iteration"
    else:
      v.name = unique(_join(v.scope, "variable"))


def _join(*parts):
  return "/".join(p for p in parts if p)


def _updated_from_gradient(graph, st, var):
  """Whether an update of `var` depends on a gradient op (data or control)."""
  roots = [w.name for w, _ in st.writers[var.node]] + [
      n.name for n in st.appliers[var.node] + st.scatters[var.node]]
  if not roots:
    return False
  seen, queue = set(), collections.deque(roots)
  while queue and len(seen) < _MAX_GRADIENT_SEARCH:
    name = queue.popleft()
    if name in seen:
      continue
    seen.add(name)
    if GRADIENT_PREFIX.match(name):
      return True
    queue.extend(parse_input(t)[0] for t in graph.node(name).input)
  return False
