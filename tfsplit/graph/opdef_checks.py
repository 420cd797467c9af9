"""What a node's OpDef asks of it, checked before TensorFlow or Grappler see
the graph (validate.py runs these): every attr present and of the declared
kind and allowed values, Const values consistent with their dtype and shape,
the number of data inputs the OpDef asks for and each input's port and dtype.
Each check returns a problem (one phrase naming what is wrong) or None."""
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import dtypes
from tensorflow.python.framework import op_def_registry

from tfsplit.graph import variables as variables_lib
from tfsplit.graph.ir import parse_input


_VALID_DTYPES = frozenset(v for v in types_pb2.DataType.values()
                          if 0 < v < 100)  # no DT_INVALID, no reference types
_REF_OFFSET = 100
_MAX_RANK = 254  # TensorShape::MaxDimensions()
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
CONST_OPS = frozenset(["Const", "HostConst"])
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


def spec_cache(graph_def):
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


def check_attrs(spec, node, unset):
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


def check_const(node):
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


DANGLING = object()  # check_inputs: an input names no node


class OutputTypes(object):
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


def check_inputs(node, spec, outputs, earlier, late):
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
          return DANGLING
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
            return DANGLING
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
