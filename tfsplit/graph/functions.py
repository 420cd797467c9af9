"""Inlining of function calls so passes see one flat graph.

`PartitionedCall` / `StatefulPartitionedCall` nodes are replaced by the body
of the function they call, with node names prefixed by the call's name. The
call node's name survives as an `IdentityN` of the function's results (with
control inputs from its control outputs), so every consumer of `call:i` or
`^call` keeps working unchanged. Functional control flow (`While`, `If`, ...)
is kept as an opaque node: its bodies stay in the library and a warning
names it.
"""
from absl import logging
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import function_def_to_graph

from tfsplit.errors import GraphValidationError
from tfsplit.graph.ir import Graph, control_input, parse_input

CALL_OPS = frozenset(["PartitionedCall", "StatefulPartitionedCall"])
CONTROL_FLOW_OPS = frozenset([
    "While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
    "For", "RemoteCall"])
_MAX_ROUNDS = 64  # nesting depth guard (a recursive function would loop)


def _function_attrs(node):
  """Names of functions referenced by `node`'s attrs."""
  names = []
  for value in node.attr.values():
    if value.HasField("func"):
      names.append(value.func.name)
    elif value.HasField("list"):
      names.extend(f.name for f in value.list.func)
  return names


def _inline_call(graph, call, fdef):
  """Replaces `call` (a NodeDef in `graph`) by the body of `fdef`."""
  prefix = call.name + "/"
  body, nested_to_flat = function_def_to_graph.function_def_to_graph_def(fdef)
  arg_names = [arg.name for arg in fdef.signature.input_arg]
  data_inputs = [t for t in call.input if not t.startswith("^")]
  call_controls = [t for t in call.input if t.startswith("^")]
  if len(data_inputs) != len(arg_names):
    raise GraphValidationError(
        f"node '{call.name}' (op {call.op}) passes {len(data_inputs)} inputs to "
        f"function '{fdef.signature.name}', which takes {len(arg_names)}")

  def rename(text):
    name, port = parse_input(text)
    if port < 0:
      return control_input(prefix + name)
    return prefix + name if port == 0 else f"{prefix}{name}:{port}"

  arg_set = set(arg_names)
  for node in body.node:
    if node.name in arg_set:
      index = arg_names.index(node.name)
      graph.add_node(prefix + node.name, "Identity",
                     [data_inputs[index]] + call_controls,
                     {"T": attr_value_pb2.AttrValue(type=node.attr["dtype"].type)},
                     call.device)
      continue
    new = graph.add_node(prefix + node.name, node.op,
                         [rename(t) for t in node.input], None,
                         node.device or call.device)
    for key in node.attr:
      new.attr[key].CopyFrom(node.attr[key])
    if call_controls and not node.input:
      # Source nodes of the body must still wait for the call's control inputs.
      new.input.extend(call_controls)

  results = []
  for out_arg in fdef.signature.output_arg:
    nested = fdef.ret[out_arg.name]
    flat = nested_to_flat.get(nested, nested)
    results.append(rename(flat))
  controls = [control_input(prefix + fdef.control_ret[k])
              for k in sorted(fdef.control_ret)]
  out_types = [a.type for a in fdef.signature.output_arg]
  call_name, call_device = call.name, call.device
  graph.remove_nodes([call_name])
  if results:
    attrs = {"T": attr_value_pb2.AttrValue(
        list=attr_value_pb2.AttrValue.ListValue(type=out_types))}
    graph.add_node(call_name, "IdentityN", results + controls, attrs, call_device)
  else:
    graph.add_node(call_name, "NoOp", controls, None, call_device)


def inline_functions(graph_def):
  """GraphDef -> GraphDef with every PartitionedCall-style call inlined.

  Functions still referenced afterwards (bodies of While/If, ...) stay in
  the library; the others are dropped.
  """
  graph = Graph(graph_def)
  functions = {f.signature.name: f for f in graph_def.library.function}
  for _ in range(_MAX_ROUNDS):
    calls = [n for n in graph.nodes if n.op in CALL_OPS]
    if not calls:
      break
    for call in calls:
      fname = call.attr["f"].func.name
      if fname not in functions:
        raise GraphValidationError(
            f"node '{call.name}' (op {call.op}) calls function '{fname}', which "
            "is not in the graph's function library; export the graph with its "
            "library (ConcreteFunction.graph.as_graph_def())")
      _inline_call(graph, call, functions[fname])
  else:
    raise GraphValidationError(
        f"function calls nested deeper than {_MAX_ROUNDS} levels (recursion?)")

  for node in graph.nodes:
    if node.op in CONTROL_FLOW_OPS:
      logging.warning("node '%s' (op %s) is functional control flow; it is "
                      "kept as one opaque node and will not be split",
                      node.name, node.op)

  result = graph.to_graph_def()
  # Keep only the functions still reachable from remaining nodes.
  needed, stack = set(), [f for n in result.node for f in _function_attrs(n)]
  while stack:
    name = stack.pop()
    if name in needed or name not in functions:
      continue
    needed.add(name)
    for node in functions[name].node_def:
      stack.extend(_function_attrs(node))
      if node.op in functions:
        stack.append(node.op)
  del result.library.function[:]
  result.library.function.extend(
      f for f in graph_def.library.function if f.signature.name in needed)
  del result.library.gradient[:]
  result.library.gradient.extend(
      g for g in graph_def.library.gradient if g.function_name in needed)
  return result
