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
  j - K_s and at most K_s micro-batches' activations are alive on stage s;
- interleaved (Megatron-LM's interleaved 1F1B, Narayanan et al. 2021): the
  layers are cut into S * v chunks, chunk c on stage c % S; each stage runs
  its v chunks' forwards in groups of S micro-batches, a warm-up of
  2 (S - s - 1) + (v - 1) S chunk-forwards, then alternates one forward and
  one backward (chunks in reverse). The bubble shrinks by v.

Blocks are (kind, micro-batch, chunk), the chunk counted on the stage
(0 .. v-1: global chunk chunk * S + stage); gpipe and 1f1b have one chunk
and give their order as (kind, micro-batch).
"""
import collections

from tfsplit import constants
from tfsplit.errors import PlanError
from tfsplit.graph.ir import input_node, parse_input


class Schedule(object):
  """A per-stage order of forward (F) and backward (B) micro-batch blocks."""
  name = None
  chunks = 1  # model chunks (virtual stages) per pipeline stage

  def order(self, stage, stages, microbatches):
    """The [('F'|'B', j)] (one chunk) or [('F'|'B', j, chunk)] sequence this
    schedule runs on `stage`."""
    raise NotImplementedError

  def blocks(self, stage, stages, microbatches):
    """`order` as [('F'|'B', j, chunk on the stage)]."""
    return [tuple(b) if len(b) == 3 else (b[0], b[1], 0)
            for b in self.order(stage, stages, microbatches)]

  def edges(self, stage, stages, microbatches):
    """[(kind_waiting, j_waiting, chunk_waiting, kind_waited_on, j_waited_on,
    chunk_waited_on)] for one stage: each block starts when the previous one
    in `order` has finished."""
    seq = self.blocks(stage, stages, microbatches)
    return [(f"{b[0]}_in", b[1], b[2], f"{a[0]}_out", a[1], a[2])
            for a, b in zip(seq, seq[1:])]


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


class Interleaved(Schedule):
  """Megatron-LM's interleaved 1F1B over v = `chunks` model chunks per stage
  (megatron.core forward_backward_pipelining_with_interleaving, with its
  default group of S micro-batches per chunk).

  The stage's v * m chunk-forwards run in groups: micro-batches g .. g+S-1
  through chunk 0, then the same ones through chunk 1, ..., then the next
  group; the backwards run in the same sequence with the chunks reversed.
  After W_s = min(2 (S - s - 1) + (v - 1) S, v m) warm-up forwards the stage
  alternates forward W_s + i and backward i. m must be a multiple of S.
  """
  name = "interleaved"

  def __init__(self, chunks=2):
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 2:
      raise PlanError(f"the interleaved schedule needs virtual_stages >= 2 model chunks "
                      f"per stage, got {chunks!r}; use virtual_stages=2 or more, or the "
                      "1f1b schedule")
    self.chunks = chunks

  @staticmethod
  def check(stages, microbatches):
    if microbatches % stages:
      lower = microbatches // stages * stages
      fix = " or ".join(str(m) for m in (lower, lower + stages) if m)
      raise PlanError(f"the interleaved schedule needs micro-batches to be a multiple of "
                      f"the {stages} pipeline stages, got {microbatches}; use "
                      f"microbatches={fix}")

  def warmup(self, stage, stages, microbatches):
    return min(2 * (stages - stage - 1) + (self.chunks - 1) * stages,
               self.chunks * microbatches)

  def sequence(self, stages, microbatches):
    """[(j, chunk)] in the order every stage runs its chunk-forwards."""
    return [(j, c) for g in range(0, microbatches, stages) for c in range(self.chunks)
            for j in range(g, min(g + stages, microbatches))]

  def order(self, stage, stages, microbatches):
    self.check(stages, microbatches)
    v = self.chunks
    forwards = [("F", j, c) for j, c in self.sequence(stages, microbatches)]
    backwards = [("B", j, v - 1 - c) for j, c in self.sequence(stages, microbatches)]
    w = self.warmup(stage, stages, microbatches)
    seq = forwards[:w]
    for i in range(len(forwards) - w):
      seq += [forwards[w + i], backwards[i]]
    return seq + backwards[len(forwards) - w:]


SCHEDULES = {"gpipe": GPipe, "1f1b": OneFOneB, "interleaved": Interleaved}
# Marks the NoOp barriers a schedule adds. Runners give such graphs one
# Grappler round (runtime.graph_function.grappler_config): a second round
# re-associates ops across blocks once the first has pruned the edges that
# data paths imply.
SCHEDULE_BARRIER_ATTR = "_tfsplit_schedule_barrier"
# Nodes that do no per-micro-batch work (and may not take control inputs that
# force them to run, like a fed placeholder).
_NOT_SCHEDULED = frozenset(["Placeholder", "VarHandleOp", "Const", "NoOp"])


def get_schedule(name, chunks=1):
  """The schedule `name` over `chunks` model chunks per stage (interleaved
  needs >= 2, the others 1)."""
  if name not in SCHEDULES:
    raise PlanError(f"unknown pipeline schedule '{name}'; choose one of: "
                    f"{', '.join(sorted(SCHEDULES))}")
  if name == Interleaved.name:
    return Interleaved(chunks)
  if chunks != 1:
    raise PlanError(f"the {name} schedule runs one model chunk per stage, got "
                    f"virtual_stages={chunks}; use schedule='interleaved' or "
                    "virtual_stages=1")
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


def micro_batch_sets(graph_def, records, roles, mesh, after_update=(), chunk_of=None):
  """{(device id, j, chunk): {'F_in': set, 'F_out': set, 'B_in': set, 'B_out': set}}.

  records: local node -> NodeRecord (original node, device id, shared: serves
  all micro-batches, not part of any one); roles: original node -> role, of
  the nodes in blocks (LayerReport.block_roles: what depends on no variable
  is outside every block); after_update: original nodes that wait for the
  optimizer's updates; chunk_of: original node -> model chunk (the pipeline
  pass's stage_of); without it (or for a node it lacks) a node's chunk is
  its device's stage.
  """
  after_update = set(after_update)
  chunk_of = chunk_of or {}
  nodes = {n.name: n for n in graph_def.node}
  mb, pp = constants.MICROBATCH_AXIS, constants.PIPELINE_AXIS
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
    chunk = chunk_of.get(record.source)
    if chunk is None:
      chunk = mesh.coord(d, pp) if pp in mesh.axes else 0
    key_of[name] = (d, mesh.coord(d, mb) if mb in mesh.axes else 0, chunk, role)
  sets = collections.defaultdict(lambda: {"F_in": set(), "F_out": set(),
                                          "B_in": set(), "B_out": set(),
                                          "F": set(), "B": set()})
  consumers = collections.defaultdict(set)
  for name, node in nodes.items():
    for text in node.input:
      if not text.startswith("^"):
        consumers[input_node(text)].add(name)
  for name, key in key_of.items():
    node = nodes[name]
    same = [key_of.get(input_node(t)) for t in node.input if not t.startswith("^")]
    has_same_input = any(k == key for k in same)
    has_same_consumer = any(key_of.get(c) == key for c in consumers[name])
    d, j, chunk, role = key
    tag = constants.BLOCK_OF_ROLE[role]
    sets[(d, j, chunk)][tag].add(name)
    if not has_same_input:
      sets[(d, j, chunk)][tag + "_in"].add(name)
    if not has_same_consumer:
      sets[(d, j, chunk)][tag + "_out"].add(name)
  return sets


def apply_schedule(graph_def, schedule, sets, mesh, stages, microbatches):
  """Adds the schedule's control edges to `graph_def` (in place); returns their count.

  sets: micro_batch_sets, keyed by global chunk (chunk k of stage s is
  k * stages + s). Grappler rewrites the graph before it runs (fusing,
  removing reshapes and identities), and not every rewrite carries a node's
  control inputs over. So the edges are made robust: a block's end is a NoOp
  barrier depending on every op of the block, and every op of the next block
  (not only its entry ops) waits for that barrier; an op with control inputs
  is also one the arithmetic optimizer does not re-associate with ops of
  other blocks. That holds for one Grappler round only (see
  SCHEDULE_BARRIER_ATTR).
  """
  mb, pp = constants.MICROBATCH_AXIS, constants.PIPELINE_AXIS
  if mb not in mesh.axes:
    return 0  # one micro-batch: nothing to order
  nodes = {n.name: n for n in graph_def.node}
  barriers = {}
  added = 0

  def barrier(d, j, chunk, kind):
    key = (d, j, chunk, kind)
    if key not in barriers:
      members = sorted(sets.get((d, j, chunk), {}).get(kind, ()))
      if not members:
        barriers[key] = None
      else:
        # One chunk per stage keeps the names of the plain schedules.
        block = f"{kind}{j}" if schedule.chunks == 1 else f"{kind}{j}_chunk{chunk}"
        name = f"pipeline_barrier/{block}/device_{d}"
        node = graph_def.node.add(name=name, op="NoOp", device=nodes[members[0]].device,
                                  input=["^" + m for m in members])
        node.attr[SCHEDULE_BARRIER_ATTR].b = True
        nodes[name] = node
        barriers[key] = name
    return barriers[key]

  for d in sorted({key[0] for key in sets}):
    coords = mesh.coords(d)
    if coords[mb] != 0:
      continue
    stage = coords[pp] if pp in coords else 0
    for waiting_kind, j, cj, waited_kind, i, ci in schedule.edges(stage, stages,
                                                                  microbatches):
      dj = mesh.device_id({**coords, mb: j})
      di = mesh.device_id({**coords, mb: i})
      name = barrier(di, i, ci * stages + stage, waited_kind[0])
      if name is None:
        continue
      for member in sorted(sets.get((dj, j, cj * stages + stage), {}).get(waiting_kind[0], ())):
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
