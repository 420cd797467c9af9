"""Variables saved in a checkpoint or SavedModel (`--variables`), read and
paired with those recovered from a plain graph: where the graph leaves a
shape open the saved variable has it, and its saved name is the model's
own. The pairing rule is `match_saved_variables`'s; it lives apart from the
graph's rules because it reads files, not the graph.
"""
import collections
import dataclasses
import os
import re
from typing import Tuple

from tfsplit.errors import TfsplitError
from tfsplit.graph.recover_shapes import SOURCE_SAVED, compatible, full


@dataclasses.dataclass
class SavedVariable:
  name: str
  key: str
  shape: Tuple[int, ...]
  dtype: int
  named: bool = True   # False: `name` is an object path, not the variable's name


def read_saved_variables(path):
  """[SavedVariable] of a checkpoint prefix or SavedModel directory."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tensorflow.core.protobuf import trackable_object_graph_pb2  # pylint: disable=import-outside-toplevel
  path = os.fspath(path)
  prefix = path
  if os.path.isdir(path):
    if os.path.exists(os.path.join(path, "saved_model.pb")):
      prefix = os.path.join(path, "variables", "variables")
    else:
      found = tf.train.latest_checkpoint(path)
      if found is None:
        raise TfsplitError(f"--variables {path}: a directory that is neither a SavedModel "
                           "nor holds a checkpoint")
      prefix = found
  try:
    reader = tf.train.load_checkpoint(prefix)
  except (tf.errors.OpError, ValueError) as e:
    raise TfsplitError(f"--variables {path}: cannot read the checkpoint "
                       f"({str(e).splitlines()[0][:200]})") from None
  shapes = reader.get_variable_to_shape_map()
  dtypes = reader.get_variable_to_dtype_map()
  full_names = {}
  if "_CHECKPOINTABLE_OBJECT_GRAPH" in shapes:
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    for node in graph.nodes:
      for attr in node.attributes:
        if attr.full_name:
          full_names[attr.checkpoint_key] = attr.full_name
  out = []
  for key in sorted(shapes, key=_natural_key):
    if key == "_CHECKPOINTABLE_OBJECT_GRAPH" or key.startswith("save_counter/"):
      continue
    if "/.ATTRIBUTES/" in key and not key.endswith("/.ATTRIBUTES/VARIABLE_VALUE"):
      continue
    name = full_names.get(key) or key.replace("/.ATTRIBUTES/VARIABLE_VALUE", "")
    if name.endswith(":0"):
      name = name[:-2]
    out.append(SavedVariable(name, key, tuple(shapes[key]), dtypes[key].as_datatype_enum,
                             key in full_names or "/.ATTRIBUTES/" not in key))
  counts = collections.Counter(v.name for v in out)
  for v in out:  # names several variables share (Keras 3: 'gpt/kernel') say nothing
    if counts[v.name] > 1:
      v.name, v.named = v.key.replace("/.ATTRIBUTES/VARIABLE_VALUE", ""), False
  return out


def _natural_key(text):
  return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def _flat(name):
  return re.sub(r"[/:.]", "_", name)


def match_saved_variables(variables, saved):
  """Pairs graph variables with saved ones; returns the number matched.

  The rule, in order, each step over the still unmatched variables:
  1. same name (the recovered one) and dtype, compatible shape;
  2. same scope (the saved name without its last part equals the recovered
     scope), same dtype, compatible shape, and only one such saved variable
     (or only one whose last part is the recovered role, or only one of
     exactly the recovered shape);
  3. optimizer slots: saved variables whose name, '/' read as '_', ends with
     the name of the slot's own variable (as matched, else as recovered),
     optionally followed by '_<n>' and '_<word>' (Keras: 'm/<var>',
     'adam/<var>_momentum'), same dtype and compatible shape, in saved order
     (checkpoint keys in natural order; Adam's m before v, as in the graph);
  4. what is left: a saved variable that is the only one compatible (dtype and
     shape) with one graph variable, itself the only compatible graph variable.
  A match gives the variable the saved shape, and the saved name unless the
  checkpoint only has an object path for it ('model/head/_kernel', when
  several variables share one name, as Keras 3's do); a variable left
  unmatched keeps what the graph gave it.
  """
  free = list(saved)
  pairs = {}

  def ok(v, s):
    return (not v.dtype or v.dtype == s.dtype) and compatible(v.shape, s.shape)

  def take(v, s):
    pairs[v.node] = s
    free.remove(s)

  for v in variables:  # 1
    s = next((s for s in free if s.name == v.name and ok(v, s)), None)
    if s is not None:
      take(v, s)
  for v in variables:  # 2
    if v.node in pairs or v.role in ("slot",):
      continue
    same = [s for s in free if s.name.rpartition("/")[0] == v.scope and ok(v, s)]
    if len(same) > 1:
      same = [s for s in same if s.name.rpartition("/")[2] == v.role] or same
    if len(same) > 1 and full(v.shape):
      same = [s for s in same if s.shape == v.shape]
    if len(same) == 1:
      take(v, same[0])
  by_node = {v.node: v for v in variables}
  for v in variables:  # 3
    if v.node in pairs or v.owner is None:
      continue
    owner = by_node[v.owner]
    owner_name = pairs[owner.node].name if owner.node in pairs else owner.name
    pattern = re.compile(r"(^|_)" + re.escape(_flat(owner_name)) + r"(_\d+)?(_[A-Za-z]+)?$")
    same = [s for s in free if pattern.search(_flat(s.name)) and ok(v, s)]
    if same:
      take(v, same[0])
  changed = True
  while changed:  # 4
    changed = False
    rest = [v for v in variables if v.node not in pairs]
    for v in rest:
      fits = [s for s in free if ok(v, s)]
      if len(fits) == 1 and [w for w in rest if ok(w, fits[0])] == [v]:
        take(v, fits[0])
        changed = True
        break
  used = {v.name for v in variables if v.node not in pairs}
  for v in variables:
    s = pairs.get(v.node)
    if s is None:
      continue
    if not v.known:
      v.source = SOURCE_SAVED
    v.shape, v.dtype = tuple(s.shape), v.dtype or s.dtype
    if s.named and s.name not in used:
      v.name = s.name  # an object path ('model/head/_kernel') says less than ours
    used.add(v.name)
  seen = collections.Counter()
  for v in variables:  # a kept name may equal a saved one taken by another
    seen[v.name] += 1
    if seen[v.name] > 1:
      k = seen[v.name] - 1
      while f"{v.name}_{k}" in used:
        k += 1
      v.name = f"{v.name}_{k}"
      used.add(v.name)
  return len(pairs)
