"""Pipeline schedules: small classes that only add control edges.

After materialization every node of a pipelined graph is known by stage,
micro-batch and role. For each device of a stage, each micro-batch j and
each model chunk, `micro_batch_sets` groups the nodes into blocks: F(j) the
forward nodes, B(j) the backward nodes (and W(j) the weight gradients, taken
out of B(j) where the schedule splits the backward), each also with its
entry nodes (`F_in`: reading nothing of the block, such as the nodes that
read another stage or the input) and exit nodes (`F_out`: read by nothing of
the block). The schedules order whole blocks, with control edges on that
device only, so no collective member is ever ordered against a member on
another device.

A schedule is its per-stage order of blocks (`Schedule.edges`: each block
after the one before it). `apply_schedule` ends every block that another
waits for with a NoOp barrier depending on all of the block's ops, and
gates every op of the waiting block (not only its entry nodes) on that
barrier: a block starts only once the previous one has finished. The
orders:
- gpipe: F0 .. F(m-1), then B0 .. B(m-1);
- 1f1b (DAPPLE early backward / PipeDream-Flush): stage s runs K_s = min(S - s, m)
  warm-up forwards, then alternates B and F, so forward j waits for backward
  j - K_s and at most K_s micro-batches' activations are alive on stage s;
- interleaved (Megatron-LM's interleaved 1F1B, Narayanan et al. 2021): the
  layers are cut into S * v chunks, chunk c on stage c % S; each stage runs
  its v chunks' forwards in groups of S micro-batches, a warm-up of
  2 (S - s - 1) + (v - 1) S chunk-forwards, then alternates one forward and
  one backward (chunks in reverse). The bubble shrinks by v.

- zb-h1, zb-h2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024):
  each backward block is split into B (input gradients, which the previous
  stage waits for) and W (weight gradients, which only the update waits
  for), and W blocks fill what 1f1b leaves idle. zb-h1 keeps 1f1b's
  warm-up and defers stage s's first s W blocks: every stage holds at most
  min(S, m) micro-batches (1f1b's first stage's peak) and, with equal F, B
  and W, the bubble is (S - 1)(F + B - W), a third of 1f1b's. zb-h2 runs
  up to 2S - 1 forwards ahead and fills the rest with W: no idle time
  inside a stage's span (a parallelogram) for about twice the memory.

Blocks are (kind, micro-batch, chunk) (`Block`), the chunk counted on the
stage (0 .. v-1: global chunk chunk * S + stage); gpipe, 1f1b and the
zero-bubble schedules have one chunk and give their order as (kind,
micro-batch).
"""
import collections
import functools

from tfsplit import constants
from tfsplit.errors import GraphValidationError, PlanError
from tfsplit.graph.ir import Graph, input_node, parse_input
from tfsplit.graph.weight_gradients import weight_gradient_nodes

# One block of a stage's order: kind 'F', 'B' or 'W', micro-batch, model
# chunk counted on the stage.
Block = collections.namedtuple("Block", ["kind", "microbatch", "chunk"])
# One schedule edge on a stage: every op of block `waiting` waits for all of
# block `after`.
BlockEdge = collections.namedtuple("BlockEdge", ["waiting", "after"])


class Schedule(object):
  """A per-stage order of forward (F) and backward (B) micro-batch blocks
  (B and W blocks where `splits_backward`)."""
  name = None
  chunks = 1  # model chunks (virtual stages) per pipeline stage
  splits_backward = False  # orders input-gradient (B) and weight-gradient (W) blocks apart

  def order(self, stage, stages, microbatches):
    """The [('F'|'B', j)] (one chunk) or [('F'|'B', j, chunk)] sequence this
    schedule runs on `stage`."""
    raise NotImplementedError

  def blocks(self, stage, stages, microbatches):
    """`order` as [Block(kind, j, chunk on the stage)]."""
    return [Block(*b) if len(b) == 3 else Block(b[0], b[1], 0)
            for b in self.order(stage, stages, microbatches)]

  def edges(self, stage, stages, microbatches):
    """[BlockEdge(waiting, after)] for one stage: each block of `order`
    starts when the one before it has finished."""
    seq = self.blocks(stage, stages, microbatches)
    return [BlockEdge(b, a) for a, b in zip(seq, seq[1:])]


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


class ZeroBubbleH1(Schedule):
  """ZB-H1: 1f1b's K_s = min(S - s, m) warm-up forwards, then B, W and F in
  turn, with stage s's W blocks s micro-batches behind its B blocks; the
  deferred W blocks run where 1f1b's stage s would wait for the gradients
  of later stages. A micro-batch's activations live until its W, so every
  stage holds at most min(S, m) of them, as 1f1b's first stage does."""
  name = "zb-h1"
  splits_backward = True

  def order(self, stage, stages, microbatches):
    m = microbatches
    k = min(stages - stage, m)
    seq = [("F", j) for j in range(k)]
    weights = 0  # W blocks placed so far
    for j in range(m):
      seq.append(("B", j))
      if j - stage >= 0:
        seq.append(("W", j - stage))
        weights = j - stage + 1
      if j + k < m:
        seq.append(("F", j + k))
    return seq + [("W", j) for j in range(weights, m)]


class ZeroBubbleH2(Schedule):
  """ZB-H2: up to 2S - 1 micro-batches in flight on every stage, so forwards
  fill the warm-up and W blocks the drain: with equal F, B and W no stage
  waits between its first and its last block (the parallelogram of the
  paper's Figure 4), for about twice 1f1b's activation memory.

  The order is the one a list scheduler gives at equal block times: each
  stage, whenever it is free, runs the block that can start first, a B
  before an F before a W at the same moment (B is on the critical path,
  W waits for nothing), and an F only while fewer than 2S - 1 micro-batches
  are in flight (a micro-batch's activations are freed by its W)."""
  name = "zb-h2"
  splits_backward = True

  @staticmethod
  def in_flight_limit(stages, microbatches):
    return min(2 * stages - 1, microbatches)

  def order(self, stage, stages, microbatches):
    return list(_list_schedule(stages, microbatches,
                               self.in_flight_limit(stages, microbatches))[stage])


@functools.lru_cache(maxsize=64)
def _list_schedule(stages, m, limit):
  """ZB-H2's per-stage orders (tuples) at unit block times; see ZeroBubbleH2."""
  free = [0] * stages              # when each stage is next free (unit block times)
  done = {}                        # (kind, stage, j) -> finish time
  count = {s: {"F": 0, "B": 0, "W": 0} for s in range(stages)}
  orders = [[] for _ in range(stages)]
  rank = {"B": 0, "F": 1, "W": 2}
  for _ in range(3 * m * stages):
    best = None
    for s in range(stages):
      c = count[s]
      options = []
      if c["B"] < c["F"]:
        need = [("F", s, c["B"])] + ([("B", s + 1, c["B"])] if s < stages - 1 else [])
        if all(n in done for n in need):
          options.append((max([free[s]] + [done[n] for n in need]), rank["B"], "B"))
      if c["F"] < m and c["F"] - c["W"] < limit:
        need = [("F", s - 1, c["F"])] if s else []
        if all(n in done for n in need):
          options.append((max([free[s]] + [done[n] for n in need]), rank["F"], "F"))
      if c["W"] < c["B"]:
        options.append((free[s], rank["W"], "W"))
      if options:
        option = min(options)
        if best is None or option[:2] < best[0][:2]:
          best = (option, s)
    (start, _, kind), s = best
    j = count[s][kind]
    free[s] = done[(kind, s, j)] = start + 1
    count[s][kind] += 1
    orders[s].append((kind, j))
  return tuple(tuple(o) for o in orders)


SCHEDULES = {"gpipe": GPipe, "1f1b": OneFOneB, "interleaved": Interleaved,
             "zb-h1": ZeroBubbleH1, "zb-h2": ZeroBubbleH2}
# Marks the NoOp barriers a schedule adds. Runners give such graphs one
# Grappler round (runtime.graph_function.grappler_config): a second round
# re-associates ops across blocks once the first has pruned the edges that
# data paths imply.
SCHEDULE_BARRIER_ATTR = "_tfsplit_schedule_barrier"
# The block kind ('F', 'B' or 'W') a barrier ends: its control inputs are
# that block's members, which is how a trace tells W ops from B ops.
SCHEDULE_BLOCK_ATTR = "_tfsplit_schedule_block"
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


def micro_batch_sets(graph_def, records, roles, mesh, after_update=(), chunk_of=None,
                     split_backward=False):
  """{(device id, j, chunk): {'F_in': set, 'F_out': set, 'B_in': set, 'B_out': set}}
  (and 'W', 'W_in', 'W_out' with split_backward).

  records: local node -> NodeRecord (original node, device id, shared: serves
  all micro-batches, not part of any one); roles: original node -> role, of
  the nodes in blocks (LayerReport.block_roles: what depends on no variable
  is outside every block); after_update: original nodes that wait for the
  optimizer's updates; chunk_of: original node -> model chunk (the pipeline
  pass's stage_of); without it (or for a node it lacks) a node's chunk is
  its device's stage. split_backward: tell each backward block's weight
  gradients (W, graph.weight_gradients) from the rest (B).
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
                                          "F": set(), "B": set(),
                                          "W_in": set(), "W_out": set(), "W": set()})
  consumers = collections.defaultdict(set)
  for name, node in nodes.items():
    for text in node.input:
      if not text.startswith("^"):
        consumers[input_node(text)].add(name)
  weights = ()
  if split_backward:
    weights = weight_gradient_nodes(
        Graph(graph_def), {n for n, k in key_of.items() if k[3] == constants.BACKWARD},
        key_of)
  for name in weights:
    key_of[name] = key_of[name][:3] + (constants.WEIGHT_GRADIENT_BLOCK,)
  for name, key in key_of.items():
    node = nodes[name]
    same = [key_of.get(input_node(t)) for t in node.input if not t.startswith("^")]
    has_same_input = any(k == key for k in same)
    has_same_consumer = any(key_of.get(c) == key for c in consumers[name])
    d, j, chunk, role = key
    tag = constants.BLOCK_OF_ROLE.get(role, role)
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
        node.attr[SCHEDULE_BLOCK_ATTR].s = kind.encode()
        nodes[name] = node
        barriers[key] = name
    return barriers[key]

  for d in sorted({key[0] for key in sets}):
    coords = mesh.coords(d)
    if coords[mb] != 0:
      continue
    stage = coords[pp] if pp in coords else 0
    for waiting, after in schedule.edges(stage, stages, microbatches):
      j, i = waiting.microbatch, after.microbatch
      dj = mesh.device_id({**coords, mb: j})
      di = mesh.device_id({**coords, mb: i})
      name = barrier(di, i, after.chunk * stages + stage, after.kind)
      if name is None:
        continue
      for member in sorted(sets.get((dj, j, waiting.chunk * stages + stage), {})
                           .get(waiting.kind, ())):
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
  if schedule.splits_backward:
    # Every W block gets its barrier, the last ones too (nothing waits for
    # them): the barriers are the graph's record of which ops are W.
    for d, j, chunk in sorted(sets):
      barrier(d, j, chunk, constants.WEIGHT_GRADIENT_BLOCK)
    try:
      Graph(graph_def).topological_order()
    except GraphValidationError as e:
      # A W block waits for later B blocks; one that a B block needs (through
      # an op the weight-gradient test let through) would close a cycle.
      raise PlanError(f"the {schedule.name} schedule would make a cycle in this graph "
                      f"({str(e)[:200]}): some weight gradient is needed by an input "
                      "gradient; use schedule='1f1b' for this graph") from None
  return added
