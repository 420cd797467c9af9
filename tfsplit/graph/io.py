"""Loading graphs from every place a TF user keeps them, and saving atomically.

`load_graph(source)` accepts a path to a binary GraphDef (.pb), a text
GraphDef (.pbtxt), a SavedModel directory (one signature), a ConcreteFunction,
a tf.function (with an input signature), or a GraphDef; it returns a GraphDef
that is validated (no dangling input, no cycle, only ops TF knows), flat
(function calls inlined) and annotated (captured variables carry their name,
shape and dtype; inputs and outputs are marked). Every failure is a
GraphLoadError / GraphValidationError naming the file or node.
"""
import os

from absl import logging
from google.protobuf import message as proto_message
from google.protobuf import text_format
from tensorflow.core.framework import graph_pb2
from tensorflow.core.framework import types_pb2

from tfsplit.errors import GraphLoadError
from tfsplit.fileio import write_atomically
from tfsplit.graph import validate as validate_lib
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.functions import INLINED_OPS, inline_functions
from tfsplit.graph.ir import without_gc

TEXT_SUFFIXES = (".pbtxt", ".pbtext", ".txt", ".prototxt")


# --- validation ----------------------------------------------------------------
# The checks live in validate.py (everything TF's importer refuses, then the
# importer itself); re-exported here for load_graph and older callers.
validate_graph_def = validate_lib.validate_graph_def


# --- files -----------------------------------------------------------------------
def _read_graph_file(path):
  if not os.path.exists(path):
    raise GraphLoadError(f"{path}: no such file or directory")
  if os.path.isdir(path):
    if os.path.exists(os.path.join(path, "saved_model.pb")) or os.path.exists(
        os.path.join(path, "saved_model.pbtxt")):
      return None  # a SavedModel; handled by the caller
    raise GraphLoadError(f"{path}: is a directory but not a SavedModel "
                         "(no saved_model.pb inside)")
  with open(path, "rb") as f:
    data = f.read()
  if not data:
    raise GraphLoadError(f"{path}: the file is empty; expected a GraphDef")
  graph_def = graph_pb2.GraphDef()
  if path.endswith(TEXT_SUFFIXES):
    try:
      text_format.Merge(data.decode("utf-8"), graph_def)
    except (text_format.ParseError, UnicodeDecodeError) as e:
      raise GraphLoadError(f"{path}: not a valid text GraphDef: {e}") from None
  else:
    try:
      graph_def.ParseFromString(data)
    except (proto_message.DecodeError, RuntimeError, ValueError) as e:
      raise GraphLoadError(
          f"{path}: not a valid binary GraphDef ({e}); the file is truncated "
          "or corrupt, or it is a text GraphDef (name it .pbtxt)") from None
  if not graph_def.node:
    raise GraphLoadError(f"{path}: the GraphDef holds no nodes (is it a "
                         "GraphDef, not another protobuf?)")
  for node in graph_def.node:
    # Garbage bytes can parse as a GraphDef; real nodes have a name and an op.
    if not node.name or not node.op:
      raise GraphLoadError(f"{path}: a node without a name or op; the file is "
                           "corrupt or not a GraphDef")
  return graph_def


def _load_saved_model(path, signature):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  try:
    loaded = tf.saved_model.load(path)
  except Exception as e:  # pylint: disable=broad-except
    raise GraphLoadError(f"{path}: cannot load the SavedModel: "
                         f"{str(e).splitlines()[0]}") from None
  signatures = dict(loaded.signatures)
  if not signatures:
    raise GraphLoadError(f"{path}: the SavedModel has no signatures; export it "
                         "with signatures= or pass a ConcreteFunction instead")
  key = signature or ("serving_default" if "serving_default" in signatures
                      else sorted(signatures)[0])
  if key not in signatures:
    raise GraphLoadError(f"{path}: no signature '{key}'; it has: "
                         f"{', '.join(sorted(signatures))}")
  fn = signatures[key]
  # Keep the loaded object alive as long as the function (it owns the vars).
  fn._tfsplit_owner = loaded  # pylint: disable=protected-access
  return fn


# --- tf.function / ConcreteFunction ------------------------------------------------
def _from_concrete_function(fn, variable_names=None):
  """GraphDef of a ConcreteFunction with captures annotated.

  variable_names: optional [(variable, name)] giving each captured variable
  its unique name (Keras 3 names the tf.Variable behind every Dense kernel
  'kernel'; its unique path lives only on the Keras object). Names still
  shared by several variables get a '_1', '_2', ... suffix in capture order.
  """
  graph = fn.graph
  explicit = {}
  for var, name in (variable_names or ()):
    handle = getattr(var, "handle", None)
    if handle is None and getattr(var, "value", None) is not None:
      handle = var.value.handle  # a Keras 3 variable
    explicit[id(handle)] = name
  graph_def = graph.as_graph_def()
  nodes = {n.name: n for n in graph_def.node}
  variables_by_handle = {}
  for var in graph.variables:
    handle = getattr(var, "handle", None)
    if handle is not None:
      variables_by_handle[id(handle)] = var
  for external, internal in graph.captures:
    node = nodes.get(internal.op.name)
    if node is None:
      continue
    var = variables_by_handle.get(id(external))
    if internal.dtype == types_pb2.DT_RESOURCE or internal.dtype.name == "resource":
      if var is None:
        logging.warning("captured resource '%s' is not a known variable; its "
                        "shape stays unknown", node.name)
        continue
      variables_lib.annotate_captured_variable(node, var, explicit.get(id(external)))
    else:
      # A captured eager constant: make the graph self-contained.
      value = getattr(external, "numpy", None)
      if value is None:
        continue
      from tensorflow.python.framework import tensor_util  # pylint: disable=import-outside-toplevel
      dtype = node.attr["dtype"].type
      node.op = "Const"
      node.ClearField("attr")
      node.attr["dtype"].type = dtype
      node.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(value()))
  _uniquify_variable_names(graph_def)
  for index, tensor in enumerate(fn.inputs):
    node = nodes.get(tensor.op.name)
    if node is not None and node.op == "Placeholder" and (
        variables_lib.VAR_SHAPE_ATTR not in node.attr) and (
            node.attr["dtype"].type != types_pb2.DT_RESOURCE):
      node.attr[variables_lib.INPUT_INDEX_ATTR].i = index
  for index, tensor in enumerate(fn.outputs):
    node = nodes.get(tensor.op.name)
    if node is not None and variables_lib.OUTPUT_INDEX_ATTR not in node.attr:
      node.attr[variables_lib.OUTPUT_INDEX_ATTR].i = index
  return graph_def


def _uniquify_variable_names(graph_def):
  seen = {}
  for node in graph_def.node:
    if variables_lib.VAR_NAME_ATTR not in node.attr:
      continue
    name = node.attr[variables_lib.VAR_NAME_ATTR].s.decode()
    count = seen.get(name, 0)
    seen[name] = count + 1
    if count:
      unique = f"{name}_{count}"
      while unique in seen:
        count += 1
        unique = f"{name}_{count}"
      seen[unique] = 1
      logging.warning("two captured variables are both named '%s'; calling the "
                      "one read by '%s' '%s' (pass variable_names= to load_graph "
                      "to name them)", name, node.name, unique)
      node.attr[variables_lib.VAR_NAME_ATTR].s = unique.encode()


def _is_tf_function(obj):
  return hasattr(obj, "get_concrete_function") and callable(obj)


@without_gc
def load_graph(source, signature=None, input_signature=None, inline=True,
               validate=True, variable_names=None, variables_from=None):
  """Loads `source` as a flat, validated, annotated GraphDef (see module doc).

  variable_names: [(variable, unique name)] for functions whose variables do
  not have unique names (Keras 3 models: use `var.path`).
  variables_from: a checkpoint prefix or SavedModel directory to take the
  shapes and names of a graph file's unannotated captured variables from
  (graph/recover.py; without it they are recovered from the graph alone).
  """
  label = "graph"
  from_file = False
  if isinstance(source, graph_pb2.GraphDef):
    graph_def = graph_pb2.GraphDef()
    graph_def.CopyFrom(source)
  elif isinstance(source, (str, os.PathLike)):
    path = os.fspath(source)
    label = path
    graph_def = _read_graph_file(path)
    from_file = graph_def is not None
    if graph_def is None:
      graph_def = _from_concrete_function(_load_saved_model(path, signature))
  elif _is_tf_function(source):
    try:
      fn = (source.get_concrete_function(*input_signature) if input_signature
            else source.get_concrete_function())
    except (TypeError, ValueError) as e:
      raise GraphLoadError(
          "cannot trace the tf.function: pass input_signature=[tf.TensorSpec"
          f"(...), ...] matching its arguments ({str(e).splitlines()[0]})") from None
    graph_def = _from_concrete_function(fn, variable_names)
  elif hasattr(source, "graph") and hasattr(source, "captured_inputs"):
    graph_def = _from_concrete_function(source, variable_names)
  else:
    raise GraphLoadError(
        f"cannot load a graph from {type(source).__name__}; pass a path "
        "(.pb, .pbtxt, SavedModel dir), a GraphDef, a ConcreteFunction or a "
        "tf.function")
  # A function TF just traced passed TF's own graph construction: the checks
  # written here run once, on what inlining makes of it, and TF's importer is
  # not asked again. Graphs read from disk get every check, before and after.
  traced = not from_file and not isinstance(source, (graph_pb2.GraphDef, str, os.PathLike))
  if validate and not traced:
    validate_graph_def(graph_def, label)
  if inline and any(n.op in INLINED_OPS for n in graph_def.node):
    graph_def = inline_functions(graph_def)
    if validate and not traced:
      validate_graph_def(graph_def, label)
  if validate and traced:
    validate_graph_def(graph_def, label, import_check=False)
  if from_file:
    # A graph written the plain TF way: recover what tfsplit would have recorded.
    from tfsplit.graph import recover  # pylint: disable=import-outside-toplevel
    if variables_from is not None or recover.needs_recovery(graph_def):
      recover.recover(graph_def, variables_from)
  return graph_def


# --- saving ----------------------------------------------------------------------
def save_graph(graph_def, path, as_text=None):
  """Writes `graph_def` to `path` atomically (temp file in the same dir + rename).

  Text format if `as_text`, or if None and the path ends in .pbtxt. A crash
  mid-write leaves the old file (or none), never a partial one.
  """
  path = os.fspath(path)
  if as_text is None:
    as_text = path.endswith(TEXT_SUFFIXES)
  data = (text_format.MessageToString(graph_def).encode("utf-8") if as_text
          else graph_def.SerializeToString(deterministic=True))
  write_atomically(path, data)

