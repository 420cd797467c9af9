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

- gpipe: all forwards of a stage, then all backwards: B_in(0) waits for F_out(m-1).
- 1f1b (DAPPLE early backward / PipeDream-Flush): stage s runs K_s = min(S - s, m)
  warm-up forwards, then alternates: F_in(j) waits for B_out(j - K_s), and
  B_in(j) waits for F_out(min(j + K_s - 1, m - 1)). At most K_s micro-batches'
  activations are alive on stage s.
"""
import collections

from tfsplit.errors import PlanError


class Schedule(object):
  name = None

  def edges(self, stage, stages, microbatches):
    """[(kind_waiting, j_waiting, kind_waited_on, j_waited_on)] for one stage;
    kinds are 'F_in', 'F_out', 'B_in', 'B_out'."""
    raise NotImplementedError

  def order(self, stage, stages, microbatches):
    """The (F|B, j) sequence this schedule runs on `stage` (for checks and traces)."""
    raise NotImplementedError


class GPipe(Schedule):
  name = "gpipe"

  def edges(self, stage, stages, microbatches):
    return [("B_in", 0, "F_out", microbatches - 1)]

  def order(self, stage, stages, microbatches):
    return [("F", j) for j in range(microbatches)] + [("B", j) for j in range(microbatches)]


class OneFOneB(Schedule):
  name = "1f1b"

  @staticmethod
  def warmup(stage, stages, microbatches):
    return min(stages - stage, microbatches)

  def edges(self, stage, stages, microbatches):
    k = self.warmup(stage, stages, microbatches)
    out = []
    for j in range(microbatches):
      if j >= k:
        out.append(("F_in", j, "B_out", j - k))
      out.append(("B_in", j, "F_out", min(j + k - 1, microbatches - 1)))
    return out

  def order(self, stage, stages, microbatches):
    k = self.warmup(stage, stages, microbatches)
    seq = [("F", j) for j in range(k)]
    for j in range(microbatches):
      seq.append(("B", j))
      if j + k < microbatches:
        seq.append(("F", j + k))
    return seq


SCHEDULES = {"gpipe": GPipe, "1f1b": OneFOneB}
# Nodes that do no per-micro-batch work (and may not take control inputs that
# force them to run, like a fed placeholder).
_NOT_SCHEDULED = frozenset(["Placeholder", "VarHandleOp", "Const", "NoOp"])


def get_schedule(name):
  if name not in SCHEDULES:
    raise PlanError(f"unknown pipeline schedule '{name}'; choose one of: "
                    f"{', '.join(sorted(SCHEDULES))}")
  return SCHEDULES[name]()


def micro_batch_sets(graph_def, meta, shared, roles, stage_of, mesh, after_update=()):
  """{(device id, j): {'F_in': set, 'F_out': set, 'B_in': set, 'B_out': set}}.

  meta: local node -> (original node, device id); shared: local nodes serving
  all micro-batches (not part of any one); roles: original node -> role;
  after_update: original nodes that wait for the optimizer's updates (a train
  step's returned loss): they end the step, outside every micro-batch.
  """
  after_update = set(after_update)
  nodes = {n.name: n for n in graph_def.node}
  key_of = {}
  for name, (original, d) in meta.items():
    if name in shared or name not in nodes or nodes[name].op in _NOT_SCHEDULED:
      continue
    role = roles.get(original)
    if role not in ("forward", "backward") or original in after_update:
      continue
    key_of[name] = (d, mesh.coord(d, "mb") if "mb" in mesh.axes else 0, role)
  sets = collections.defaultdict(lambda: {"F_in": set(), "F_out": set(),
                                          "B_in": set(), "B_out": set()})
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
    tag = "F" if role == "forward" else "B"
    if not has_same_input:
      sets[(d, j)][tag + "_in"].add(name)
    if not has_same_consumer:
      sets[(d, j)][tag + "_out"].add(name)
  return sets


def apply_schedule(graph_def, schedule, sets, mesh, stages, microbatches):
  """Adds the schedule's control edges to `graph_def` (in place); returns their count."""
  if "mb" not in mesh.axes:
    return 0  # one micro-batch: nothing to order
  nodes = {n.name: n for n in graph_def.node}
  added = 0
  devices = sorted({d for d, _ in sets})
  for d in devices:
    stage = mesh.coord(d, "pp")
    # Every micro-batch copy of this device shares its non-mb coordinates.
    for waiting_kind, j, waited_kind, i in schedule.edges(stage, stages, microbatches):
      coords = mesh.coords(d)
      if coords["mb"] != 0:
        continue
      dj = mesh.device_id({**coords, "mb": j})
      di = mesh.device_id({**coords, "mb": i})
      waiting = sets.get((dj, j), {}).get(waiting_kind, ())
      waited = sets.get((di, i), {}).get(waited_kind, ())
      deps = sorted("^" + w for w in waited)
      for name in sorted(waiting):
        node = nodes[name]
        missing = [t for t in deps if t not in node.input and t[1:] != name]
        node.input.extend(missing)
        added += len(missing)
  return added
