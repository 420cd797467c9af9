"""Checks a GraphDef the way TensorFlow's importer does, before Grappler sees it.

Grappler (shape inference through `grappler.item.Item`, `OptimizeGraph`)
trusts its input: a malformed GraphDef makes it raise an error naming
TensorFlow internals, or kill the process (a C++ check failure on a Const
without `value`, a segfault on a control input listed before a data input).
`validate_graph_def` therefore refuses, with one GraphValidationError naming
the node, every GraphDef that TensorFlow's importer would refuse:

- structure: nodes without a name or op, duplicate names, unknown ops,
  dangling inputs, control inputs before data inputs, cycles;
- attrs, against the op's OpDef (or the called function's signature): every
  attr without a default present, each attr value of the declared kind
  (type / int / list(type) / ...), types within `allowed_values`, strings
  within their allowed list, ints and list lengths at their minimum, valid
  DataType enums and shapes, no attr the op does not define. An attr present
  but unset takes its default, as in tf.graph_util.import_graph_def. Attrs
  starting with '_' are private and accepted, as by TF; tfsplit's own
  (variables.py) must hold the kind tfsplit reads, and text tfsplit decodes
  (variable names, einsum equations, colocation) must be UTF-8;
- inputs: the number of data inputs the OpDef asks for (number attrs and
  type-list attrs resolved), each input's port within its producer's outputs
  and each input's dtype equal to what the op expects there;
- Const / HostConst: a `value` whose dtype is the `dtype` attr and whose
  shape and content are consistent.

Last, the GraphDef (with its function library) is imported into a scratch
graph by TensorFlow's own importer, which also runs every op's shape
function; captured variables are given the dtype and shape tfsplit recorded
for them, so a read or an assign that disagrees with the record is refused
too. What the importer refuses becomes a GraphValidationError naming the node
taken from its message (tf_messages.py, which does the same for errors raised
later by Grappler or by TensorFlow running the graph's shape arithmetic).

This module owns the order of the checks and the whole-graph ones
(structure, cycles, the scratch import); what one node's OpDef asks of it is
opdef_checks.py's.
"""
from tensorflow.python.framework import op_def_registry

from tfsplit.errors import GraphValidationError, node_error, printable
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.ir import _LOOP_BACK_OPS, Graph, parse_input, without_gc
from tfsplit.graph.opdef_checks import (CONST_OPS, DANGLING, OutputTypes, check_attrs,
                                        check_const, check_inputs, spec_cache)
from tfsplit.graph.tf_messages import FIX, tf_error


@without_gc
def validate_graph_def(graph_def, source="graph", import_check=True):
  """Raises GraphValidationError if TF's importer would refuse `graph_def`.

  See the module doc for the checks; `import_check=False` skips the final
  import by TensorFlow (the checks written here still run). Returns None;
  `graph_def` is not modified.
  """
  nodes = {}
  for node in graph_def.node:
    name = node.name
    if not name:
      raise GraphValidationError(printable(f"{source}: a node (op {node.op}) has no name"))
    if name in nodes:
      raise node_error(GraphValidationError, node, "is defined twice; node names "
                       "must be unique in a GraphDef", source=source)
    nodes[name] = node

  spec_of = spec_cache(graph_def)
  specs = {}
  unset = []  # nodes with attrs present but unset: they take the default
  for name, node in nodes.items():
    op = node.op
    spec = spec_of(op)
    if spec is None:
      if not op:
        raise GraphValidationError(printable(f"{source}: node '{name}' has no op"))
      raise GraphValidationError(printable(
          f"{source}: node '{name}' uses op '{op}', which this "
          "TensorFlow does not know (a custom op? load its library with "
          "tf.load_op_library before tfsplit, or check the TF version)"))
    specs[name] = spec
    problem = check_attrs(spec, node, unset)
    if problem is None and op in CONST_OPS:
      problem = check_const(node)
    if problem:
      raise node_error(GraphValidationError, node, problem, FIX, source=source)

  outputs = OutputTypes(nodes, specs)
  earlier = set()
  late = []  # (source, reader) of inputs read from a later node (or itself)
  for name, node in nodes.items():
    problem = check_inputs(node, specs[name], outputs, earlier, late)
    if problem is DANGLING:
      _raise_dangling(nodes, source)
    if problem:
      raise node_error(GraphValidationError, node, problem, FIX, source=source)
    earlier.add(name)
  if late and _may_have_cycle(nodes, late):
    try:
      Graph(graph_def).topological_order()  # its message names a node on the cycle
    except GraphValidationError as e:
      raise GraphValidationError(printable(f"{source}: {e}")) from None

  if import_check:
    _import_check(graph_def, source, unset)


def _import_copy(graph_def, unset):
  """What TF's importer checks: `graph_def`, or a copy of it in which

  - annotated captured-variable placeholders are VarHandleOps of the
    recorded dtype and shape, so that TF's shape functions check every read
    and write of the variable against what tfsplit recorded (a read of the
    wrong dtype, an assign of the wrong shape), as shapes.py will see them;
  - attrs present but unset (nodes named in `unset`) hold their default, as
    tf.graph_util.import_graph_def sets them before the C++ importer runs.
  """
  handles = [i for i, node in enumerate(graph_def.node)
             if node.op == "Placeholder" and variables_lib.VAR_SHAPE_ATTR in node.attr
             and variables_lib.VAR_DTYPE_ATTR in node.attr
             and node.attr[variables_lib.VAR_DTYPE_ATTR].type]
  if not handles and not unset:
    return graph_def
  from tensorflow.core.framework import graph_pb2  # pylint: disable=import-outside-toplevel
  copy = graph_pb2.GraphDef()
  copy.CopyFrom(graph_def)
  for i in handles:
    node = copy.node[i]
    dtype = node.attr[variables_lib.VAR_DTYPE_ATTR].type
    shape = node.attr[variables_lib.VAR_SHAPE_ATTR].shape
    node.op = "VarHandleOp"
    node.ClearField("attr")
    node.attr["dtype"].type = dtype
    node.attr["shape"].shape.CopyFrom(shape)
    node.attr["shared_name"].s = node.name.encode()
    node.attr["container"].s = b""
  if unset:
    unset = set(unset)
    for node in copy.node:
      if node.name in unset:
        op_def = op_def_registry.get(node.op)
        for attr in op_def.attr if op_def is not None else ():
          value = node.attr.get(attr.name)
          if (value is not None and value.WhichOneof("value") is None and
              attr.HasField("default_value")):
            value.CopyFrom(attr.default_value)
  return copy


_MAX_LATE_INPUTS = 64


def _may_have_cycle(nodes, late):
  """False if `nodes` (in GraphDef order) surely have no cycle, edges out of
  NextIteration (TF1 while loops) aside; `late`: every (source, reader) edge
  whose source does not come before its reader.

  A cycle's first node in GraphDef order reads a later node on it: so a
  cycle exists iff, for some late edge, the reader is reached from the
  source by walking inputs through nodes not before the reader. TF writes
  graphs in order (a traced function has one late control edge), so this
  looks at a few nodes where sorting the graph would look at all of them;
  with many late edges, the caller sorts.
  """
  late = [(src, reader) for src, reader in late if nodes[src].op not in _LOOP_BACK_OPS]
  if len(late) > _MAX_LATE_INPUTS:
    return True
  position = {name: i for i, name in enumerate(nodes)}
  for src, reader in late:
    first = position[reader]
    seen, stack = {src}, [src]
    while stack:
      name = stack.pop()
      if name == reader:
        return True
      for text in nodes[name].input:
        s = parse_input(text)[0]
        if s not in seen and position[s] >= first and nodes[s].op not in _LOOP_BACK_OPS:
          seen.add(s)
          stack.append(s)
  return False


def _raise_dangling(nodes, source):
  dangling = [(node, text) for node in nodes.values() for text in node.input
              if parse_input(text)[0] not in nodes]
  node, text = dangling[0]
  raise node_error(
      GraphValidationError, node,
      f"reads '{text}', but no node '{parse_input(text)[0]}' exists "
      f"({len(dangling)} dangling input(s))", "the graph is incomplete",
      source=source)


def _tf_import(graph_def):
  """Imports `graph_def` into a scratch tf.Graph; raises what TF raises.

  The C importer alone (what tf.graph_util.import_graph_def runs first) is
  used when reachable: it does every check, including the shape functions,
  without building a Python Operation per node, which dominates the public
  path's time on large graphs.
  """
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  graph = tf.Graph()
  try:
    from tensorflow.python.client import pywrap_tf_session as c_api  # pylint: disable=import-outside-toplevel
    from tensorflow.python.framework import c_api_util  # pylint: disable=import-outside-toplevel
    options = c_api_util.ScopedTFImportGraphDefOptions()
    c_api.TF_ImportGraphDefOptionsSetPrefix(options.options, "")
    c_api.TF_ImportGraphDefOptionsSetValidateColocationConstraints(
        options.options, False)
    c_graph = graph._c_graph  # pylint: disable=protected-access
  except (ImportError, AttributeError):  # TF moved its internals: the public way
    with graph.as_default():
      tf.graph_util.import_graph_def(graph_def, name="")
    return
  buffer = c_api.TF_NewBufferFromString(graph_def.SerializeToString())
  try:
    with c_graph.get() as handle:
      results = c_api.TF_GraphImportGraphDefWithResults(handle, buffer, options.options)
      c_api_util.ScopedTFImportGraphDefResults(results)
  finally:
    c_api.TF_DeleteBuffer(buffer)


def _import_check(graph_def, source, unset=()):
  from tensorflow.python.framework import errors as tf_errors  # pylint: disable=import-outside-toplevel
  try:
    _tf_import(_import_copy(graph_def, unset))
  except (tf_errors.OpError, ValueError, RuntimeError, TypeError) as e:
    error = e
  else:
    return
  raise tf_error(error, graph_def, "TensorFlow's importer rejected it", source)
