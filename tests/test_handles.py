"""graph/handles.py: the one walk of variable handles (which variable a
handle input names, who uses a variable, what an update reads), and its
bound."""
from tensorflow.core.framework import graph_pb2

from tfsplit import constants
from tfsplit.graph import Graph
from tfsplit.graph import handles


def _graph(*nodes):
  """A GraphDef of (name, op, inputs) triples."""
  graph_def = graph_pb2.GraphDef()
  for name, op, inputs in nodes:
    graph_def.node.add(name=name, op=op, input=list(inputs))
  return Graph(graph_def)


VARS = {"w", "m"}
GRAPH = _graph(
    ("w", "VarHandleOp", []), ("m", "VarHandleOp", []),
    ("w_branch", "Identity", ["w"]),                 # a conditional's branch argument
    ("both", "IdentityN", ["m", "w_branch"]),        # output k is input k
    ("read_w", "ReadVariableOp", ["both:1"]),
    ("read_m", "ReadVariableOp", ["both:0"]),
    ("scaled", "Mul", ["read_w", "read_m"]),
    ("update", "AssignSubVariableOp", ["w_branch", "scaled"]),
    ("other", "Placeholder", []),
    ("not_a_handle", "Identity", ["other"]))


def test_handle_of_walks_only_the_ops_it_is_told():
  assert handles.handle_of(GRAPH, "w_branch", VARS) == "w"
  assert handles.handle_of(GRAPH, "both:1", VARS) is None          # Identity only
  assert handles.handle_of(GRAPH, "both:1", VARS, handles.IDENTITY_AND_N) == "w"
  assert handles.handle_of(GRAPH, "both:0", VARS, handles.IDENTITY_AND_N) == "m"
  assert handles.handle_of(GRAPH, "not_a_handle", VARS) is None


def test_handle_users_skip_the_passthroughs():
  users = handles.handle_users(GRAPH, VARS, handles.IDENTITY_AND_N)
  assert sorted(n.name for n in users["w"]) == ["read_w", "update"]
  assert [n.name for n in users["m"]] == ["read_m"]


def test_variables_an_update_reads_and_uses():
  roles = {n: constants.UPDATE for n in ("read_w", "read_m", "scaled", "update")}
  # Through Identity alone the IdentityN hides both reads; the write's own
  # handle is used, never read.
  assert handles.variables_read_by(GRAPH, "update", VARS, roles, 64) == set()
  assert handles.variables_used_by(GRAPH, "update", VARS, roles, 64) == {"w"}
  plain = _graph(("w", "VarHandleOp", []), ("m", "VarHandleOp", []),
                 ("read_m", "ReadVariableOp", ["m"]), ("read_w", "ReadVariableOp", ["w"]),
                 ("scaled", "Mul", ["read_w", "read_m"]),
                 ("update", "AssignSubVariableOp", ["w", "scaled"]))
  assert handles.variables_read_by(plain, "update", VARS, roles, 64) == {"w", "m"}
  assert handles.variables_used_by(plain, "update", VARS, roles, 64) == {"w", "m"}
  # The bound: only the update itself and one input are visited.
  assert handles.variables_read_by(plain, "update", VARS, roles, 2) == set()


def test_bounded_walk_visits_each_item_once_up_to_its_limit():
  walk = handles.BoundedWalk(["a"], 3)
  seen = []
  for item in walk:
    seen.append(item)
    walk.follow(["a", "b", "c", "d"])
  assert seen == ["a", "b", "c"]
