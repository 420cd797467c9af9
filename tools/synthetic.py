"""A synthetic hybrid-parallel training step as a task DAG (for benchmarks).

Shape of a Megatron-style GPT step without a GraphDef: `layers` transformer
layers cut into pipeline stages, each stage split over a tensor-parallel group
of devices (one host), 1f1b order between micro-batches. Per layer and rank:
four forward and four backward compute tasks, and per layer and micro-batch
two all-reduces forward and two backward on the group's link, which is what a
correct split of attention + MLP costs. Stage boundaries send one activation
shard per rank. Durations come from the cluster preset's peak FLOP/s and the
collective model, so the schedule is plausible, not measured.
"""
from tfsplit.cost import cluster as cluster_lib
from tfsplit.cost import collectives
from tfsplit.cost.pipeline_sim import stage_order
from tfsplit.cost.simulator import TaskGraph


def transformer_step(layers=48, devices=64, stages=8, microbatches=32,
                     hidden=8192, seq_len=2048, preset="h100-80gb",
                     efficiency=0.5):
  """Returns a TaskGraph; about 3300 tasks per micro-batch at the defaults."""
  tp = devices // stages
  per_stage = layers // stages
  cluster = cluster_lib.from_preset(preset, devices, devices_per_host=tp)
  act_bytes = seq_len * hidden * 2                 # one bf16 micro-batch
  layer_flops = 24 * seq_len * hidden * hidden     # forward, whole layer
  peak = cluster.device(0).flops("bfloat16") * efficiency
  f_op = layer_flops / tp / peak / 4               # four ops per layer
  b_op = 2 * f_op
  group = list(range(tp))
  ar = collectives.all_reduce_time(cluster, group, act_bytes)
  p2p = collectives.send_recv_time(cluster, 0, tp, act_bytes // tp)

  g = TaskGraph()
  dev = [[g.add_device(f"s{s}r{r}") for r in range(tp)] for s in range(stages)]
  tp_link = [g.add_link(f"s{s} tp", dev[s]) for s in range(stages)]
  fwd_link = [[g.add_link(f"s{s}r{r}->s{s + 1}", (dev[s][r], dev[s + 1][r]))
               for r in range(tp)] for s in range(stages - 1)]
  bwd_link = [[g.add_link(f"s{s + 1}r{r}->s{s}", (dev[s + 1][r], dev[s][r]))
               for r in range(tp)] for s in range(stages - 1)]
  prio = {}
  for s in range(stages):
    for pos, (phase, j) in enumerate(stage_order("1f1b", stages, microbatches,
                                                 s)):
      prio[(phase, s, j)] = pos

  saved = {}     # (s, j) -> per layer, per rank: forward task ids
  fwd_out = {}   # (s, j) -> the stage's last all-reduce
  first_fwd = {}  # (s, j) -> first forward task per rank
  for s in range(stages):
    for j in range(microbatches):
      p = prio[("F", s, j)]
      if s == 0:
        inputs = [[] for _ in range(tp)]
      else:
        inputs = [[g.add_task(f"send F{j}", fwd_link[s - 1][r], p2p,
                              deps=[fwd_out[(s - 1, j)]], kind="comm",
                              priority=p)] for r in range(tp)]
      layers_saved = []
      first = None
      for l in range(per_stage):
        ops = [[0] * 4 for _ in range(tp)]
        for r in range(tp):
          ops[r][0] = g.add_task(f"F{j} l{l} op0", dev[s][r], f_op,
                                 deps=inputs[r], kind="forward",
                                 alloc=act_bytes, priority=p)
          ops[r][1] = g.add_task(f"F{j} l{l} op1", dev[s][r], f_op,
                                 deps=[ops[r][0]], kind="forward",
                                 alloc=act_bytes, priority=p)
        if first is None:
          first = [ops[r][0] for r in range(tp)]
        ar1 = g.add_task(f"F{j} l{l} allreduce", tp_link[s], ar,
                         deps=[ops[r][1] for r in range(tp)], kind="comm",
                         priority=p)
        for r in range(tp):
          ops[r][2] = g.add_task(f"F{j} l{l} op2", dev[s][r], f_op, deps=[ar1],
                                 kind="forward", alloc=act_bytes, priority=p)
          ops[r][3] = g.add_task(f"F{j} l{l} op3", dev[s][r], f_op,
                                 deps=[ops[r][2]], kind="forward",
                                 alloc=act_bytes, priority=p)
        ar2 = g.add_task(f"F{j} l{l} allreduce", tp_link[s], ar,
                         deps=[ops[r][3] for r in range(tp)], kind="comm",
                         priority=p)
        inputs = [[ar2] for _ in range(tp)]
        layers_saved.append(ops)
      saved[(s, j)] = layers_saved
      fwd_out[(s, j)] = inputs[0][0]
      first_fwd[(s, j)] = first

  bwd_out = {}
  last_bwd = {}
  for s in reversed(range(stages)):
    for j in range(microbatches):
      p = prio[("B", s, j)]
      if s == stages - 1:
        grads = [[] for _ in range(tp)]
      else:
        grads = [[g.add_task(f"send B{j}", bwd_link[s][r], p2p,
                             deps=[bwd_out[(s + 1, j)]], kind="comm",
                             priority=p)] for r in range(tp)]
      last = None
      for l in reversed(range(per_stage)):
        ops = saved[(s, j)][l]
        b3 = [g.add_task(f"B{j} l{l} op3", dev[s][r], b_op,
                         deps=grads[r] + [ops[r][3]], kind="backward",
                         priority=p) for r in range(tp)]
        b2 = [g.add_task(f"B{j} l{l} op2", dev[s][r], b_op,
                         deps=[b3[r], ops[r][2]], kind="backward", priority=p)
              for r in range(tp)]
        ar1 = g.add_task(f"B{j} l{l} allreduce", tp_link[s], ar, deps=b2,
                         kind="comm", priority=p)
        b1 = [g.add_task(f"B{j} l{l} op1", dev[s][r], b_op,
                         deps=[ar1, ops[r][1]], kind="backward", priority=p)
              for r in range(tp)]
        b0 = [g.add_task(f"B{j} l{l} op0", dev[s][r], b_op,
                         deps=[b1[r], ops[r][0]], kind="backward", priority=p)
              for r in range(tp)]
        ar2 = g.add_task(f"B{j} l{l} allreduce", tp_link[s], ar, deps=b0,
                         kind="comm", priority=p)
        grads = [[ar2] for _ in range(tp)]
        last = b0
      bwd_out[(s, j)] = grads[0][0]
      last_bwd[(s, j)] = last

  # 1f1b: forward j on stage s waits for backward j - K_s on the same rank.
  for s in range(stages):
    warmup = min(stages - s, microbatches)
    for j in range(warmup, microbatches):
      for r in range(tp):
        g.add_control_dep(first_fwd[(s, j)][r], last_bwd[(s, j - warmup)][r])
  return g
