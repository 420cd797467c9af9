"""Inlining of function calls so passes see one flat graph.

`PartitionedCall` / `StatefulPartitionedCall` nodes are replaced by the body
of the function they call, with node names prefixed by the call's name. The
call node's name survives as an `IdentityN` of the function's results (with
control inputs from its control outputs), so every consumer of `call:i` or
`^call` keeps working unchanged. Functional conditionals (`If`,
`StatelessIf`) are lowered to Switch and Merge the way TF lowers them before
running, so their branches are split like any other ops. Loops (`While`, ...)
and `Case` are kept as opaque nodes: their bodies stay in the library and a
warning names them.
"""
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.framework import node_def_pb2
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import function_def_to_graph

from tfsplit.errors import GraphValidationError
from tfsplit.graph.ir import Graph, control_input, parse_input

CALL_OPS = frozenset(["PartitionedCall", "StatefulPartitionedCall"])
IF_OPS = frozenset(["If", "StatelessIf"])
INLINED_OPS = CALL_OPS | IF_OPS
CONTROL_FLOW_OPS = frozenset([
    "While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
    "For", "RemoteCall"])
_MAX_ROUNDS = 64
# The ops of a graph that only wraps one call: its arguments, its results.
_WRAPPER_OPS = frozenset(["Placeholder", "Identity", "IdentityN", "NoOp", "Const"])  # nesting depth guard (a recursive function would loop)


def _function_attrs(node):
  """Names of functions referenced by `node`'s attrs."""
  names = []
  for value in node.attr.values():
    if value.HasField("func"):
      names.append(value.func.name)
    elif value.HasField("list"):
      names.extend(f.name for f in value.list.func)
  return names


def _inline_body(graph, fdef, prefix, data_inputs, controls, device, label,
                 unprefixed=False):
  """Adds the body of `fdef` to `graph` under `prefix` (with `unprefixed`,
  under its own names where they are free: a signature's one call), its
  arguments read from `data_inputs`, every node after `controls` (the body's
  sources and arguments wait for them, so a dead control input kills the
  whole body). A resource argument without controls reads the caller's
  handle directly, as an Identity of it would. Returns (result tensors,
  control-output inputs)."""
  body, nested_to_flat = function_def_to_graph.function_def_to_graph_def(fdef)
  arg_names = [arg.name for arg in fdef.signature.input_arg]
  if len(data_inputs) != len(arg_names):
    raise GraphValidationError(
        f"{label} passes {len(data_inputs)} inputs to "
        f"function '{fdef.signature.name}', which takes {len(arg_names)}")
  direct = {} if controls else {
      arg.name: data_inputs[i] for i, arg in enumerate(fdef.signature.input_arg)
      if arg.type == types_pb2.DT_RESOURCE}
  new_name = {node.name: node.name if unprefixed and node.name not in graph
              else prefix + node.name for node in body.node if node.name not in direct}

  def rename(text):
    name, port = parse_input(text)
    if name in direct:
      return control_input(parse_input(direct[name])[0]) if port < 0 else direct[name]
    name = new_name.get(name, prefix + name)
    if port < 0:
      return control_input(name)
    return name if port == 0 else f"{name}:{port}"

  arg_set = set(arg_names)
  for node in body.node:
    if node.name in direct:
      continue
    if node.name in arg_set:
      index = arg_names.index(node.name)
      graph.add_node(new_name[node.name], "Identity",
                     [data_inputs[index]] + controls,
                     {"T": attr_value_pb2.AttrValue(type=node.attr["dtype"].type)},
                     device)
      continue
    new = graph.add_node(new_name[node.name], node.op,
                         [rename(t) for t in node.input], None,
                         node.device or device)
    for key in node.attr:
      new.attr[key].CopyFrom(node.attr[key])
    if "_class" in new.attr:   # colocation with a body node: its new name
      located = [b"loc:@" + rename(v.decode()[len("loc:@"):]).encode()
                 if v.startswith(b"loc:@") else v for v in new.attr["_class"].list.s]
      del new.attr["_class"].list.s[:]
      new.attr["_class"].list.s.extend(located)
    if controls and not node.input:
      # Source nodes of the body must still wait for the call's control inputs.
      new.input.extend(controls)

  results = []
  for out_arg in fdef.signature.output_arg:
    nested = fdef.ret[out_arg.name]
    flat = nested_to_flat.get(nested, nested)
    results.append(rename(flat))
  control_outputs = [rename("^" + fdef.control_ret[k]) for k in sorted(fdef.control_ret)]
  return results, control_outputs


def _inline_call(graph, call, fdef, unprefixed=False):
  """Replaces `call` (a NodeDef in `graph`) by the body of `fdef`."""
  data_inputs = [t for t in call.input if not t.startswith("^")]
  call_controls = [t for t in call.input if t.startswith("^")]
  results, controls = _inline_body(
      graph, fdef, call.name + "/", data_inputs, call_controls, call.device,
      f"node '{call.name}' (op {call.op})", unprefixed)
  out_types = [a.type for a in fdef.signature.output_arg]
  call_name, call_device = call.name, call.device
  graph.remove_nodes([call_name])
  if results:
    attrs = {"T": attr_value_pb2.AttrValue(
        list=attr_value_pb2.AttrValue.ListValue(type=out_types))}
    graph.add_node(call_name, "IdentityN", results + controls, attrs, call_device)
  else:
    graph.add_node(call_name, "NoOp", controls, None, call_device)


def _lowers(node):
  """Whether `node` is a functional conditional TF itself would lower to
  Switch and Merge before running it (lower_if_op.cc)."""
  if node.op not in IF_OPS:
    return False
  flag = node.attr.get("_lower_using_switch_merge")
  return flag is None or flag.b


def _lower_if(graph, node, functions):
  """Replaces the `If` `node` by both branches inlined behind one predicate,
  as TF's own lowering does: a Switch of the predicate on itself gives one
  live pivot per branch; every node of a branch waits for its pivot, so the
  branch not taken is dead and none of its ops (variable updates included)
  runs. Each result is the Merge of the two branches' results; `^node`
  waits on a Merge of both branches' control outputs, alive whichever ran.

  Only the predicate passes through a Switch: a branch reads its inputs as
  they are and is killed by its pivot's control edge, so what flows into a
  branch (a split variable's handle, a sharded gradient) keeps the layout the
  split gives it outside."""
  node = node_def_pb2.NodeDef.FromString(node.SerializeToString())  # outlives removal
  name, device = node.name, node.device
  label = f"node '{name}' (op {node.op})"
  branches = []
  for key in ("else_branch", "then_branch"):
    fname = node.attr[key].func.name
    if fname not in functions:
      raise GraphValidationError(
          f"{label} branches to function '{fname}', which is not in the graph's "
          "function library; export the graph with its library")
    branches.append(functions[fname])
  pred, *data_inputs = [t for t in node.input if not t.startswith("^")]
  controls = [t for t in node.input if t.startswith("^")]
  out_types = list(node.attr["Tout"].list.type)
  graph.remove_nodes([name])
  bool_type = attr_value_pb2.AttrValue(type=types_pb2.DT_BOOL)
  two = attr_value_pb2.AttrValue(i=2)

  def add(base, op, inputs, attrs):
    return graph.add_node(graph.unique_name(f"{name}/{base}"), op, inputs, attrs,
                          device).name

  if node.attr["Tcond"].type != types_pb2.DT_BOOL:
    # TF takes any non-zero scalar as true; a Cast to bool says the same.
    pred = add("pred", "Cast", [pred], {"SrcT": node.attr["Tcond"], "DstT": bool_type,
                                        "Truncate": attr_value_pb2.AttrValue(b=False)})
  switch = add("switch_pred", "Switch", [pred, pred] + controls, {"T": bool_type})
  done, results = [], []
  for port, (tag, fdef) in enumerate(zip(("else", "then"), branches)):
    pivot = add(f"pivot_{tag}", "Identity", [f"{switch}:{port}"], {"T": bool_type})
    branch_results, branch_controls = _inline_body(
        graph, fdef, f"{name}/{tag}/", data_inputs, [control_input(pivot)], device,
        label)
    if len(branch_results) != len(out_types):
      raise GraphValidationError(
          f"{label}: branch '{fdef.signature.name}' returns {len(branch_results)} "
          f"values, the node {len(out_types)}")
    done.append(add(f"{tag}_done", "Identity", [pivot] + branch_controls, {"T": bool_type}))
    results.append(branch_results)
  ran = add("branch_executed", "Merge", done, {"T": bool_type, "N": two})
  merged = [add(f"merged_{i}", "Merge", [results[0][i], results[1][i]],
                {"T": attr_value_pb2.AttrValue(type=out_type), "N": two})
            for i, out_type in enumerate(out_types)]
  if merged:
    attrs = {"T": attr_value_pb2.AttrValue(
        list=attr_value_pb2.AttrValue.ListValue(type=out_types))}
    graph.add_node(name, "IdentityN", merged + [control_input(ran)], attrs, device)
  else:
    graph.add_node(name, "NoOp", [control_input(ran)], None, device)


def inline_functions(graph_def):
  """GraphDef -> GraphDef with every PartitionedCall-style call inlined.

  Functions still referenced afterwards (bodies of While/If, ...) stay in
  the library; the others are dropped.
  """
  graph = Graph(graph_def)
  functions = {f.signature.name: f for f in graph_def.library.function}
  calls = [n for n in graph.nodes if n.op in CALL_OPS]
  if len(calls) == 1 and all(n.op in _WRAPPER_OPS for n in graph.nodes if n is not calls[0]):
    # A wrapper (a SavedModel signature, a function calling one tf.function):
    # its call's body keeps its own names, so gradient scopes stay scopes.
    fname = calls[0].attr["f"].func.name
    if fname in functions:
      _inline_call(graph, calls[0], functions[fname], unprefixed=True)
  for _ in range(_MAX_ROUNDS):
    calls = [n for n in graph.nodes if n.op in CALL_OPS]
    conditionals = [n for n in graph.nodes if _lowers(n)]
    if not calls and not conditionals:
      break
    for node in conditionals:
      _lower_if(graph, node, functions)
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
