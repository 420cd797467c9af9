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
taken from its message; `tf_error` does the same for errors raised later by
Grappler or by TensorFlow running the graph's shape arithmetic.

On the 48-block GPT training step (41.8k nodes) the checks here take ~0.4 s
and TensorFlow's import ~0.5 s.
"""
import re

from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import dtypes
from tensorflow.python.framework import op_def_registry

from tfsplit.errors import GraphValidationError, node_error, printable
from tfsplit.graph import variables as variables_lib
from tfsplit.graph.ir import _LOOP_BACK_OPS, Graph, parse_input, without_gc

_FIX = "re-export the graph (the file was edited by hand or is corrupt)"
_VALID_DTYPES = frozenset(v for v in types_pb2.DataType.values()
                          if 0 < v < 100)  # no DT_INVALID, no reference types
_REF_OFFSET = 100
_MAX_RANK = 254  # TensorShape::MaxDimensions()
_MAX_MESSAGE = 400
_NO_VALUE = attr_value_pb2.AttrValue()
_USE_DEFAULT = object()  # _check_attr_value: unset, the OpDef's default applies
_MAX_LISTED_OUTPUTS = 4096

# OpDef attr type -> AttrValue oneof field ('list(x)' -> ListValue field x).
_KIND_FIELD = {"string": "s", "int": "i", "float": "f", "bool": "b",
               "type": "type", "shape": "shape", "tensor": "tensor",
               "func": "func"}
_FIELD_KIND = {v: k for k, v in _KIND_FIELD.items()}
_LIST_FIELDS = tuple(_KIND_FIELD.values())

# tfsplit's private attrs (variables.py) and the AttrValue field each holds.
_PRIVATE_ATTRS = {
    variables_lib.VAR_NAME_ATTR: "s",
    variables_lib.VAR_SHAPE_ATTR: "shape",
    variables_lib.VAR_DTYPE_ATTR: "type",
    variables_lib.VAR_TRAINABLE_ATTR: "b",
    variables_lib.INPUT_INDEX_ATTR: "i",
    variables_lib.OUTPUT_INDEX_ATTR: "i",
}

# The typed value field of a TensorProto for each dtype, and values per element.
_TENSOR_FIELDS = {
    types_pb2.DT_FLOAT: ("float_val", 1), types_pb2.DT_DOUBLE: ("double_val", 1),
    types_pb2.DT_HALF: ("half_val", 1), types_pb2.DT_BFLOAT16: ("half_val", 1),
    types_pb2.DT_INT32: ("int_val", 1), types_pb2.DT_INT16: ("int_val", 1),
    types_pb2.DT_INT8: ("int_val", 1), types_pb2.DT_UINT8: ("int_val", 1),
    types_pb2.DT_UINT16: ("int_val", 1), types_pb2.DT_QINT8: ("int_val", 1),
    types_pb2.DT_QUINT8: ("int_val", 1), types_pb2.DT_QINT16: ("int_val", 1),
    types_pb2.DT_QUINT16: ("int_val", 1), types_pb2.DT_QINT32: ("int_val", 1),
    types_pb2.DT_INT64: ("int64_val", 1), types_pb2.DT_UINT32: ("uint32_val", 1),
    types_pb2.DT_UINT64: ("uint64_val", 1), types_pb2.DT_BOOL: ("bool_val", 1),
    types_pb2.DT_STRING: ("string_val", 1), types_pb2.DT_COMPLEX64: ("scomplex_val", 2),
    types_pb2.DT_COMPLEX128: ("dcomplex_val", 2),
    types_pb2.DT_RESOURCE: ("resource_handle_val", 1),
    types_pb2.DT_VARIANT: ("variant_val", 1),
}
_CONST_OPS = frozenset(["Const", "HostConst"])
# String attrs that tfsplit reads as text (variable names, einsum equations).
_TEXT_ATTRS = {"VarHandleOp": "shared_name", "Einsum": "equation",
               "XlaEinsum": "equation"}


def _dtype_name(dtype):
  if dtype > _REF_OFFSET and dtype - _REF_OFFSET in _VALID_DTYPES:
    return dtypes.as_dtype(dtype - _REF_OFFSET).name + "_ref"
  if dtype in _VALID_DTYPES:
    return dtypes.as_dtype(dtype).name
  return f"<invalid dtype {dtype}>"


class _Arg(object):
  """One input or output arg of an OpDef, with what resolves its types."""
  __slots__ = ("name", "type", "type_attr", "number_attr", "type_list_attr",
               "is_ref")

  def __init__(self, arg):
    self.name = arg.name
    self.type = arg.type
    self.type_attr = arg.type_attr
    self.number_attr = arg.number_attr
    self.type_list_attr = arg.type_list_attr
    self.is_ref = arg.is_ref


class _OpSpec(object):
  """What validation needs from one OpDef, parsed once per op type."""

  def __init__(self, op_def, is_function=False):
    self.name = op_def.name
    self.is_function = is_function
    self.inputs = [_Arg(a) for a in op_def.input_arg]
    self.outputs = [_Arg(a) for a in op_def.output_arg]
    self.attrs = {}      # name -> AttrDef
    self.defaults = {}   # name -> default AttrValue
    self.required = []   # attrs without a default
    for attr in op_def.attr:
      self.attrs[attr.name] = attr
      if attr.HasField("default_value"):
        self.defaults[attr.name] = attr.default_value
      else:
        self.required.append(attr.name)
    self.required_set = frozenset(self.required)
    # attr -> (AttrValue field, allowed values or None, minimum or None) for
    # the common scalar kinds, checked inline; others take _check_attr_value.
    self.fast = {}
    for attr in op_def.attr:
      field = _KIND_FIELD.get(attr.type)
      if field in ("type", "s", "i", "f", "b", "tensor", "func"):
        allowed = None
        if field == "type":
          allowed = frozenset(t for t in attr.allowed_values.list.type
                              if t in _VALID_DTYPES) or _VALID_DTYPES
        elif field == "s" and attr.allowed_values.list.s:
          allowed = frozenset(attr.allowed_values.list.s)
        minimum = attr.minimum if field == "i" and attr.has_minimum else None
        self.fast[attr.name] = (field, allowed, minimum)
    self.single_output = None  # the one output arg, if one tensor, not a ref
    if len(self.outputs) == 1:
      arg = self.outputs[0]
      if not (arg.number_attr or arg.type_list_attr or arg.is_ref):
        self.single_output = arg
    # Ops whose inputs are all fixed: nothing to resolve per node.
    self.fixed_inputs = None
    # Ops with one tensor per input arg: the count is known without the
    # node; (type, type attr, ref offset) per arg, types read per node.
    self.single_inputs = None
    if all(not (a.type_attr or a.number_attr or a.type_list_attr)
           for a in self.inputs):
      self.fixed_inputs = [a.type + (_REF_OFFSET if a.is_ref else 0)
                           for a in self.inputs]
    elif all(not (a.number_attr or a.type_list_attr) for a in self.inputs):
      self.single_inputs = [(a.type, a.type_attr, _REF_OFFSET if a.is_ref else 0)
                            for a in self.inputs]

  def attr(self, node, key):
    value = node.attr.get(key)  # .get: [] would insert the key
    if value is None or value.WhichOneof("value") is None:
      return self.defaults.get(key, _NO_VALUE)
    return value

  def _count(self, node, arg):
    if arg.number_attr:
      return self.attr(node, arg.number_attr).i
    if arg.type_list_attr:
      return len(self.attr(node, arg.type_list_attr).list.type)
    return 1

  def num_inputs(self, node):
    return sum(self._count(node, a) for a in self.inputs)

  def output_types(self, node):
    """Tuple of output dtypes, or None if there are very many (use output_type)."""
    single = self.single_output
    if single is not None:
      if single.type:
        return (single.type,)
      return (self.attr(node, single.type_attr).type,)
    if sum(max(0, self._count(node, a)) for a in self.outputs) > _MAX_LISTED_OUTPUTS:
      return None
    return tuple(t for _, t in self.arg_types(node, self.outputs))

  def arg_types(self, node, args):
    """[(arg name, dtype)] per tensor; call only once the counts are known sane."""
    out = []
    for arg in args:
      if arg.type_list_attr:
        out.extend((arg.name, t) for t in self.attr(node, arg.type_list_attr).list.type)
        continue
      dtype = arg.type or self.attr(node, arg.type_attr).type
      if arg.is_ref:
        dtype += _REF_OFFSET
      count = self.attr(node, arg.number_attr).i if arg.number_attr else 1
      out.extend([(arg.name, dtype)] * count)
    return out

  def output_type(self, node, port):
    """dtype of output `port` of `node`, or the number of outputs if out of range."""
    index = 0
    for arg in self.outputs:
      if arg.type_list_attr:
        types = self.attr(node, arg.type_list_attr).list.type
        if port < index + len(types):
          return types[port - index], None
        index += len(types)
        continue
      count = self.attr(node, arg.number_attr).i if arg.number_attr else 1
      if port < index + count:
        dtype = arg.type or self.attr(node, arg.type_attr).type
        return dtype + (_REF_OFFSET if arg.is_ref else 0), None
      index += count
    return None, index


def _spec_cache(graph_def):
  functions = {f.signature.name: f.signature for f in graph_def.library.function}
  cache = {}

  def get(op):
    try:
      return cache[op]
    except KeyError:
      pass
    op_def = op_def_registry.get(op)
    if op_def is not None:
      spec = _OpSpec(op_def)
    elif op in functions:
      spec = _OpSpec(functions[op], is_function=True)
    else:
      spec = None
    cache[op] = spec
    return spec
  return get


# --- attrs ---------------------------------------------------------------------------
def _value_kind(value):
  """The AttrValue's kind as an OpDef type string ('list(int)'), or None if unset."""
  field = value.WhichOneof("value")
  if field is None:
    return None
  if field == "list":
    for name in _LIST_FIELDS:
      if len(getattr(value.list, name)):
        return f"list({_FIELD_KIND[name]})"
    return "list"
  if field == "placeholder":
    return "placeholder"
  return _FIELD_KIND[field]


def _check_shape(shape, what):
  """A problem with TensorShapeProto `shape`, or None."""
  if len(shape.dim) > _MAX_RANK:
    return f"{what} has {len(shape.dim)} dimensions (at most {_MAX_RANK})"
  if shape.unknown_rank and len(shape.dim):
    return f"{what} has unknown rank but lists dimensions"
  for d in shape.dim:
    if d.size < -1:
      return f"{what} has dimension {d.size} (sizes are >= 0, or -1 for unknown)"
  return None


def _check_dtype(dtype, what):
  if dtype not in _VALID_DTYPES:
    return f"{what} is {_dtype_name(dtype)}, not a valid (non-reference) dtype"
  return None


def _check_attr_value(spec, key, value, attr_def):
  """A problem with `value` for OpDef attr `attr_def`, or None."""
  expected = attr_def.type
  is_list = expected.startswith("list(")
  field = _KIND_FIELD.get(expected[5:-1] if is_list else expected)
  if field is None:
    return None  # 'any' and friends: nothing to check
  kind = _value_kind(value)
  if kind is None and attr_def.HasField("default_value"):
    return _USE_DEFAULT  # as tf.graph_util.import_graph_def does
  if is_list:
    if kind is None or kind == "list":
      items = ()
    elif kind != expected:
      return f"attr '{key}' holds a {kind} but op {spec.name} expects a {expected}"
    else:
      items = getattr(value.list, field)
    if attr_def.has_minimum and len(items) < attr_def.minimum:
      return (f"attr '{key}' lists {len(items)} value(s) but op {spec.name} needs "
              f"at least {attr_def.minimum}")
  else:
    if kind is None:
      return f"attr '{key}' has no value (op {spec.name} expects a {expected})"
    if kind != expected:
      return f"attr '{key}' holds a {kind} but op {spec.name} expects a {expected}"
    items = (getattr(value, field),)
    if field == "i" and attr_def.has_minimum and items[0] < attr_def.minimum:
      return (f"attr '{key}' is {items[0]} but op {spec.name} needs at least "
              f"{attr_def.minimum}")
  if field == "type":
    allowed = attr_def.allowed_values.list.type
    for dtype in items:
      problem = _check_dtype(dtype, f"attr '{key}'")
      if problem:
        return problem
      if allowed and dtype not in allowed:
        return (f"attr '{key}' is {_dtype_name(dtype)} but op {spec.name} allows only "
                f"{', '.join(_dtype_name(t) for t in allowed)}")
  elif field == "s":
    allowed = attr_def.allowed_values.list.s
    if allowed:
      for s in items:
        if s not in allowed:
          return (f"attr '{key}' is {s!r} but op {spec.name} allows only "
                  f"{', '.join(repr(a) for a in allowed)}")
  elif field == "shape":
    for shape in items:
      problem = _check_shape(shape, f"attr '{key}'")
      if problem:
        return problem
  return None


def _not_text(key, strings):
  """A problem if one of `strings` (bytes) is not UTF-8 text, else None."""
  for text in strings:
    try:
      text.decode("utf-8")
    except UnicodeDecodeError:
      return f"attr '{key}' holds {text[:40]!r}, which is not UTF-8 text"
  return None


def _check_private_attr(key, value):
  if key == "_class":  # colocation: ['loc:@node', ...]
    return _not_text(key, value.list.s)
  field = _PRIVATE_ATTRS.get(key)
  if field is None:
    if key.startswith("_tfsplit") and value.WhichOneof("value") == "s":
      return _not_text(key, (value.s,))
    return None
  kind = _value_kind(value)
  if kind != _FIELD_KIND[field]:
    return (f"tfsplit attr '{key}' holds a {kind or 'nothing'} instead of a "
            f"{_FIELD_KIND[field]}")
  if field == "shape":
    return _check_shape(value.shape, f"tfsplit attr '{key}'")
  if field == "type":
    return _check_dtype(value.type, f"tfsplit attr '{key}'")
  if field == "s":
    return _not_text(key, (value.s,))
  return None


def _check_attrs(spec, node, unset):
  """A problem with `node`'s attrs against `spec`, or None.

  Names of nodes with attrs present but unset, which take the OpDef's
  default (as TF's Python importer decides), are appended to `unset`.
  """
  fast = spec.fast
  required = spec.required_set
  found = 0
  attrs = node.attr
  for key in attrs:  # (items() iterates through a slower Python view)
    value = attrs[key]
    if key in required:
      found += 1
    check = fast.get(key)
    if check is not None:
      field, allowed, minimum = check
      if value.WhichOneof("value") == field:
        if field == "type":
          if value.type in allowed:
            continue
        elif field == "i":
          if minimum is None or value.i >= minimum:
            continue
        elif field == "s":
          if allowed is None or value.s in allowed:
            continue
        else:
          continue
    elif key.startswith("_"):
      problem = _check_private_attr(key, value)
      if problem:
        return problem
      continue
    attr_def = spec.attrs.get(key)
    if attr_def is None:
      if spec.is_function:
        continue  # calls of library functions may carry extra attrs
      return f"has attr '{key}', which op {spec.name} does not define"
    problem = _check_attr_value(spec, key, value, attr_def)
    if problem is _USE_DEFAULT:
      unset.append(node.name)
    elif problem:
      return problem
  text_attr = _TEXT_ATTRS.get(spec.name)
  if text_attr is not None and text_attr in node.attr:
    problem = _not_text(text_attr, (node.attr[text_attr].s,))
    if problem:
      return problem
  if found < len(required):
    for key in spec.required:
      if key not in node.attr:
        return (f"attr '{key}' (a {spec.attrs[key].type}) is missing; op "
                f"{spec.name} requires it")
  return None


def _check_const(node):
  """A problem with a Const's value, or None."""
  dtype = node.attr["dtype"].type
  tensor = node.attr["value"].tensor
  if tensor.dtype != dtype:
    return (f"its value is a {_dtype_name(tensor.dtype)} tensor but its dtype attr "
            f"says {_dtype_name(dtype)}")
  shape = tensor.tensor_shape
  if shape.unknown_rank:
    return "its value has an unknown shape"
  if len(shape.dim) > _MAX_RANK:
    return f"its value has {len(shape.dim)} dimensions (at most {_MAX_RANK})"
  count = 1
  for d in shape.dim:
    if d.size < 0:
      return f"its value has dimension {d.size} (a constant's shape is fully known)"
    count *= d.size
  if count >= 1 << 62:
    return f"its value's shape {[d.size for d in shape.dim]} is too large"
  field, per_element = _TENSOR_FIELDS.get(dtype, (None, 1))
  if tensor.tensor_content:
    if dtype in (types_pb2.DT_STRING, types_pb2.DT_RESOURCE, types_pb2.DT_VARIANT):
      return None  # encoded content: TF checks it when decoding
    size = dtypes.as_dtype(dtype).size
    if len(tensor.tensor_content) != count * size:
      return (f"its value holds {len(tensor.tensor_content)} bytes of content for "
              f"{count} {_dtype_name(dtype)} element(s) ({count * size} bytes)")
    return None
  if field is not None:
    n = len(getattr(tensor, field))
    if n % per_element or n // per_element > count:
      return (f"its value lists {n // per_element} {_dtype_name(dtype)} value(s) for "
              f"{count} element(s)")
  return None


# --- the whole graph -------------------------------------------------------------------
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

  spec_of = _spec_cache(graph_def)
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
    problem = _check_attrs(spec, node, unset)
    if problem is None and op in _CONST_OPS:
      problem = _check_const(node)
    if problem:
      raise node_error(GraphValidationError, node, problem, _FIX, source=source)

  outputs = _OutputTypes(nodes, specs)
  earlier = set()
  late = []  # (source, reader) of inputs read from a later node (or itself)
  for name, node in nodes.items():
    problem = _check_inputs(node, specs[name], outputs, earlier, late)
    if problem is _DANGLING:
      _raise_dangling(nodes, source)
    if problem:
      raise node_error(GraphValidationError, node, problem, _FIX, source=source)
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


_DANGLING = object()  # _check_inputs: an input names no node
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


class _OutputTypes(object):
  """Output dtypes of each node, resolved once per node on demand."""

  def __init__(self, nodes, specs):
    self.nodes = nodes
    self.specs = specs
    self.cache = {}

  def get(self, name, port):
    """(dtype, None), or (None, number of outputs) if `port` is out of range."""
    types = self.cache.get(name, False)
    if types is False:
      types = self.specs[name].output_types(self.nodes[name])
      self.cache[name] = types
    if types is None:
      return self.specs[name].output_type(self.nodes[name], port)
    if port < len(types):
      return types[port], None
    return None, len(types)


def _check_inputs(node, spec, outputs, earlier, late):
  """A problem with `node`'s inputs (count, order, ports, dtypes), or None.

  Appends (source, node name) to `late` for each input read from a node not
  in `earlier`.
  """
  nodes = outputs.nodes
  data = []
  seen_control = False
  for text in node.input:
    if text[:1] == "^":
      src = text[1:]
      if src not in earlier:
        if src not in nodes:
          return _DANGLING
        late.append((src, node.name))
      seen_control = True
    else:
      if text in nodes:
        data.append((text, text, 0))
        if text not in earlier:
          late.append((text, node.name))
      else:
        src, port = parse_input(text)
        if src not in earlier:
          if src not in nodes:
            return _DANGLING
          late.append((src, node.name))
        data.append((text, src, port))
      if seen_control:
        return (f"data input '{text}' comes after a control input; control "
                "inputs ('^name') must come last")
  expected = spec.fixed_inputs
  arg_names = None
  single = spec.single_inputs
  if single is not None:
    if len(single) != len(data):
      return _count_problem(spec, node, len(single), len(data))
    expected = [(dtype or spec.attr(node, type_attr).type) + ref
                for dtype, type_attr, ref in single]
  elif expected is None:
    count = spec.num_inputs(node)
    if count != len(data):
      return _count_problem(spec, node, count, len(data))
    typed = spec.arg_types(node, spec.inputs)
    arg_names = [name for name, _ in typed]
    expected = [t for _, t in typed]
  elif len(expected) != len(data):
    return _count_problem(spec, node, len(expected), len(data))
  for index, (text, src, port) in enumerate(data):
    actual, num_outputs = outputs.get(src, port)
    if actual is None:
      return (f"reads '{text}', but node '{src}' (op {outputs.nodes[src].op}) has "
              f"{num_outputs} output(s)")
    want = expected[index]
    if actual != want and actual != want + _REF_OFFSET:
      arg = arg_names[index] if arg_names else spec.inputs[index].name
      return (f"input {index} ('{text}', for arg '{arg}') is {_dtype_name(actual)} "
              f"but op {spec.name} expects {_dtype_name(want)} there")
  return None


def _count_problem(spec, node, expected, actual):
  del node  # the caller names it
  args = ", ".join(a.name for a in spec.inputs) or "none"
  return (f"has {actual} data input(s) but op {spec.name} takes {expected} "
          f"(args: {args})")


# --- TensorFlow's own checks ------------------------------------------------------------
def _tf_import(graph_def):
  """Imports `graph_def` into a scratch tf.Graph; raises what TF raises.

  The C importer alone (what tf.graph_util.import_graph_def runs first) is
  used when reachable: it does every check, including the shape functions,
  without building a Python Operation per node (2.3 s -> 0.3 s on 42k nodes).
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


_NODE_PATTERNS = [re.compile(p) for p in (
    r"\{\{node ([^}\s]+)\}\}",
    r"[Nn]ode '([^']+)'",
    r"[Nn]ode \"([^\"]+)\"",
    r"of node ([^\s,;:'\"]+)",
    r"for '([^'\s]+)'",
    r"'([^'\s]+)'",
    r"[Nn]ode ([^\s,;:'\"]+)",
)]


def node_named_in(message, names):
  """The first name in TF error `message` that is a key of `names`, or None."""
  for pattern in _NODE_PATTERNS:
    for match in pattern.finditer(message):
      name = match.group(1)
      for candidate in (name, name.rstrip(".")):
        if candidate in names:
          return candidate
  return None


# Lines of TF error messages that frame the problem rather than state it.
_FRAME_LINES = re.compile(
    r"^(Graph execution error:|Detected at node|Node: '|\[\[|Original stack trace|"
    r"File \"|Traceback)")
# TF's dump of the failing NodeDef; the node is named separately.
_NODE_DUMP = re.compile(r" for '\{\{node [^}]+\}\} = [^']*'")


def _one_line(message):
  lines = [l.strip() for l in str(message).splitlines() if l.strip()]
  useful = [l for l in lines if not _FRAME_LINES.match(l)]
  text = (useful or lines or ["(no message)"])[0]
  text = _NODE_DUMP.sub("", text)
  if len(text) > _MAX_MESSAGE:
    text = text[:_MAX_MESSAGE] + "..."
  return text


def tf_error(error, graph_def, what, source="graph", rename=None):
  """GraphValidationError (one line) for an error TF raised on `graph_def`.

  `what` says who refused ("TensorFlow's shape inference rejected it"); the
  node is taken from TF's message when it names one of `graph_def`'s nodes
  (`rename` maps names of a private copy back to the user's).
  """
  message = getattr(error, "message", None) or str(error)
  nodes = {n.name: n for n in graph_def.node}
  name = node_named_in(message, nodes)
  detail = _one_line(message)
  if name is not None:
    node = nodes[name]
    if rename is not None:
      original = rename(node)
      if original is not None:
        node = original
    return node_error(GraphValidationError, node, f"{what}: {detail}", _FIX,
                      source=source)
  return GraphValidationError(printable(f"{source}: {what}: {detail}; {_FIX}"))
