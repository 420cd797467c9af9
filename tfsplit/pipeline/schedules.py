"""Pipeline schedules: small classes that only add control edges.

After materialization every node of a pipelined graph is known by stage,
micro-batch and role. For each device of a stage and each micro-batch j the
schedule sees four sets of nodes:
  F_in(j)  forward nodes that start micro-batch j here (read another stage, or the input)
  F_out(j) forward nodes of j whose outputs leave this stage's forward
  B_in(j)  backward nodes of j that start its backward here
  B_out(j) backward nodes of j that end it (gradient sent back, or accumulated)
and orders them with control edges on that device only, so no collective
member is ever ordered against a member on another device.

A schedule is its per-stage order of blocks; each block's entry nodes wait
for the previous block's exit nodes, which enforces the order exactly:
- gpipe: F0 .. F(m-1), then B0 .. B(m-1);
- 1f1b (DAPPLE early backward / PipeDream-Flush): stage s runs K_s = min(S - s, m)
  warm-up forwards, then alternates B and F, so forward j waits for backward
  j - K_s and at most K_s micro-batches' activations are alive on stage s.
"""
import collections

from tfsplit import constants
from tfsplit.errors import PlanError
from tfsplit.graph.ir import parse_input


class Schedule(object):
  """A per-stage order of forward (F) and backward (B) micro-batch blocks."""
  name = None

  def order(self, stage, stages, microbatches):
    """The [('F'|'B', j)] sequence this schedule runs on `stage`."""
    raise NotImplementedError

  def edges(self, stage, stages, microbatches):
    """[(kind_waiting, j_waiting, kind_waited_on, j_waited_on)] for one stage:
    each block starts when the previous one in `order` has finished."""
    seq = self.order(stage, stages, microbatches)
    return [(f"{b[0]}_in", b[1], f"{a[0]}_out", a[1]) for a, b in zip(seq, seq[1:])]


class GPipe(Schedule):
  """All forwards of a stage, then all backwards."""
  name = "gpipe"

  def order(self, stage, stages, microbatches):
    return [("F", j) for j in range(microbatches)] + [("B", j) for j in range(microbatches)]


class OneFOneB(Schedule):
  """DAPPLE early backward: K_s = min(S - s, m) warm-up forwards, then one
  backward and one forward alternately; forward j waits for backward j - K_s."""
  name = "1f1b"

  @staticmethod
  def warmup(stage, stages, microbatches):
    return min(stages - stage, microbatches)

  def order(self, stage, stages, microbatches):
    k = self.warmup(stage, stages, microbatches)
    seq = [("F", j) for j in range(k)]
    for j in range(microbatches):
      seq.append(("B", j))
      if j + k < microbatches:
        seq.append(("F", j + k))
    return seq


SCHEDULES = {"gpipe": GPipe, "1f1b": OneFOneB}
# Marks the NoOp barriers a schedule adds. Runners give such graphs one
# Grappler round (runtime.graph_function.grappler_config): a second round
# re-associates ops across blocks once the first has pruned the edges that
# data paths imply.
SCHEDULE_BARRIER_ATTR = "_tfsplit_schedule_barrier"
# Nodes that do no per-micro-batch work (and may not take control inputs that
# force them to run, like a fed placeholder).
_NOT_SCHEDULED = frozenset(["Placeholder", "VarHandleOp", "Const", "NoOp"])


def get_schedule(name):
  if name not in SCHEDULES:
    raise PlanError(f"unknown pipeline schedule '{name}'; choose one of: "
                    f"{', '.join(sorted(SCHEDULES))}")
  return SCHEDULES[name]()


def waiting_for_updates(graph, roles):
  """Original nodes that (through control edges) wait for an update op: they
  end the step (a train step's returned loss), outside every micro-batch."""
  waiting = set()
  for name in graph.topological_order():
    for text in graph.node(name).input:
      src = parse_input(text)[0]
      if (text.startswith("^") and roles.get(src) == constants.UPDATE) or src in waiting:
        waiting.add(name)
        break
  return waiting


def micro_batch_sets(graph_def, records, roles, mesh, after_update=()):
  """{(device id, j): {'F_in': set, 'F_out': set, 'B_in': set, 'B_out': set}}.

  records: local node -> NodeRecord (original node, device id, shared: serves
  all micro-batches, not part of any one); roles: original node -> role, of
  the nodes in blocks (LayerReport.block_roles: what depends on no variable
  is outside every block); after_update: original nodes that wait for the
  optimizer's updates.
  """
  after_update = set(after_update)
  nodes = {n.name: n for n in graph_def.node}
  mb = constants.MICROBATCH_AXIS
  key_of = {}
  for name, record in records.items():
    if record.shared or record.device_id is None or name not in nodes or \
        nodes[name].op in _NOT_SCHEDULED:
      continue
    role = roles.get(record.source)
    if record.source in after_update or role not in constants.ROLES:
      continue
    if role == constants.UPDATE:
      # A per-micro-batch copy of an optimizer op (a sparse embedding update
      # summing its gradient rows) finishes that micro-batch's backward; in a
      # block, its running sum is tied down and Grappler cannot merge it into
      # one AddN that keeps every micro-batch's copy alive.
      role = constants.BACKWARD
    d = record.device_id
    key_of[name] = (d, mesh.coord(d, mb) if mb in mesh.axes else 0, role)
  sets = collections.defaultdict(lambda: {"F_in": set(), "F_out": set(),
                                          "B_in": set(), "B_out": set(),
                                          "F": set(), "B": set()})
  consumers = collections.defaultdict(set)
  for name, node in nodes.items():
    for text in node.input:
      if not text.startswith("^"):
        consumers[text.split(":")[0]].add(name)
  for name, (d, j, role) in key_of.items():
    node = nodes[name]
    same = [key_of.get(t.split(":")[0]) for t in node.input if not t.startswith("^")]
    has_same_input = any(k == (d, j, role) for k in same)
    has_same_consumer = any(key_of.get(c) == (d, j, role) for c in consumers[name])
    tag = constants.BLOCK_OF_ROLE[role]
    sets[(d, j)][tag].add(name)
    if not has_same_input:
      sets[(d, j)][tag + "_in"].add(name)
    if not has_same_consumer:
      sets[(d, j)][tag + "_out"].add(name)
  return sets


def apply_schedule(graph_def, schedule, sets, mesh, stages, microbatches):
  """Adds the schedule's control edges to `graph_def` (in place); returns their count.

  Grappler rewrites the graph before it runs (fusing, removing reshapes and
  identities), and not every rewrite carries a node's control inputs over.
  So the edges are made robust: a block's end is a NoOp barrier depending on
  every op of the block, and every op of the next block (not only its entry
  ops) waits for that barrier; an op with control inputs is also one the
  arithmetic optimizer does not re-associate with ops of other blocks. That
  holds for one Grappler round only (see SCHEDULE_BARRIER_ATTR).
  """
  mb, pp = constants.MICROBATCH_AXIS, constants.PIPELINE_AXIS
  if mb not in mesh.axes:
    return 0  # one micro-batch: nothing to order
  nodes = {n.name: n for n in graph_def.node}
  barriers = {}
  added = 0

  def barrier(d, j, kind):
    key = (d, j, kind)
    if key not in barriers:
      members = sorted(sets.get((d, j), {}).get(kind, ()))
      if not members:
        barriers[key] = None
      else:
        name = f"pipeline_barrier/{kind}{j}/device_{d}"
        node = graph_def.node.add(name=name, op="NoOp", device=nodes[members[0]].device,
                                  input=["^" + m for m in members])
        node.attr[SCHEDULE_BARRIER_ATTR].b = True
        nodes[name] = node
        barriers[key] = name
    return barriers[key]

  for d in sorted({d for d, _ in sets}):
    coords = mesh.coords(d)
    if coords[mb] != 0:
      continue
    stage = coords[pp] if pp in coords else 0
    for waiting_kind, j, waited_kind, i in schedule.edges(stage, stages, microbatches):
      dj = mesh.device_id({**coords, mb: j})
      di = mesh.device_id({**coords, mb: i})
      name = barrier(di, i, waited_kind[0])
      if name is None:
        continue
      for member in sorted(sets.get((dj, j), {}).get(waiting_kind[0], ())):
        node = nodes[member]
        if node.device != nodes[name].device:
          # Never order ops of different devices: a collective's members on
          # two devices could then wait for each other.
          raise PlanError(
              f"schedule edge from '{name}' ({nodes[name].device}) to '{member}' "
              f"({node.device}) would order two devices; this is a bug in tfsplit")
        if "^" + name not in node.input:
          node.input.append("^" + name)
          added += 1
  return added
