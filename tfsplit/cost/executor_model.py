"""TF's executor as the graph simulator models it: which nodes a step runs at
all (pruned_nodes: what no output, stateful op, control-flow op or
placeholder depends on is left out, as TF prunes a function's body) and in
what order one inter-op thread runs the rest (executor_order on
ExecutorModel: inexpensive kernels inline, the others through a thread queue
that works as a stack, each node's out edges in graph order or shuffled by a
seed). It owns the order because the order, not the op costs, decides how
long tensors live and so the simulated memory peak; the task graph
(graph_tasks) and the simulation (graph_sim) take it as given."""

# Order (executor_order): TF's executor does not run ready ops in graph order.
# With one inter-op thread (how the allocator's peak is measured: with more,
# the order and the peak change from step to step), a node that finishes
# readies the consumers whose last input it was, in the order of its out
# edges. Inexpensive kernels among them (views and metadata: INLINE_OPS) join
# the thread's inline queue (first in, first out); of the expensive ones, each
# but the last is pushed to the thread pool's queue, and the last runs next on
# this thread unless inline work is waiting (then it is pushed too). A worker
# pushes to and pops from the front of its own queue (Eigen's thread pool), so
# with one thread that queue is a stack: what was pushed first runs last. In a
# backward pass the gradient chain runs on inline while the ops readied beside
# it are pushed under it; those that wait for nothing else (a bias's
# BiasAddGrad, a LayerNorm's parameter Sums, a weight gradient whose
# activation already exists) run at the end of the step, and their inputs
# (upstream gradients, recomputed activations) stay allocated until then. In
# graph order they would run at once: with blocks recomputation, where the
# peak is in the last block's backward, that order under-estimated the
# allocator's peak (docs/planner-accuracy.md has the figures).
#
# Which consumer runs on and which are pushed depends on the order of a node's
# out edges in TF's runtime graph, which Grappler's and the oneDNN pass's
# rewrites reshuffle and the GraphDef does not record; a profile of a step
# shows neither graph order nor its reverse. simulate_graph therefore runs the
# model with each node's out edges shuffled by a few fixed seeds and keeps the
# run with the median shared peak. The choice repeats in every block, so where
# it decides whether each block's largest gradient waits for the end of the
# step, the runtime's order sits at one end of that spread (how far, per
# model: docs/planner-accuracy.md). Not modelled: the executor's cost
# estimates, which start every kernel as expensive and let cheap ones run
# inline only after many runs of a step (KernelStats); a thread queue's
# capacity, past which a push runs the task at once; Grappler's changes to the
# graph.

import collections
import random

from tfsplit.graph.ir import parse_input

# Kernels whose OpKernel::IsExpensive() is false: TF's executor runs them
# inline on the thread that readied them instead of queueing them (a
# profile shows them only at its verbose trace level).
INLINE_OPS = frozenset([
    "Const", "HostConst", "Placeholder", "_Arg", "_Retval", "_DeviceArg",
    "_DeviceRetval", "Identity", "IdentityN", "StopGradient",
    "PreventGradient", "Reshape", "Squeeze", "ExpandDims", "Shape", "ShapeN",
    "Size", "Rank", "NoOp", "ControlTrigger", "Switch", "RefSwitch", "Merge",
    "RefMerge", "Enter", "RefEnter", "Exit", "RefExit", "NextIteration",
    "RefNextIteration", "LoopCond"])
_FLOW_OPS = frozenset(["Switch", "RefSwitch", "Merge", "RefMerge", "Enter",
                       "RefEnter", "Exit", "RefExit", "NextIteration",
                       "RefNextIteration", "LoopCond", "ControlTrigger"])


def pruned_nodes(graph):
  """Names of the nodes TF leaves out of a step: what no output, stateful op
  (a variable update, a collective, a send), control-flow op or placeholder
  depends on, as TF prunes a function's body before running it. Such a node
  (a gradient nobody reads, a layer's unused extra output) would otherwise
  hold its inputs until it ran."""
  from tensorflow.python.framework import op_def_registry  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.endpoints import graph_outputs  # pylint: disable=import-outside-toplevel
  kept = {}

  def is_root(op):
    if op not in kept:
      op_def = op_def_registry.get(op)
      kept[op] = (op_def is None or op_def.is_stateful or op in _FLOW_OPS or
                  op in ("Placeholder", "_Arg"))
    return kept[op]
  live = set()
  stack = list(graph_outputs(graph)) + [n.name for n in graph.nodes
                                        if is_root(n.op)]
  while stack:
    name = stack.pop()
    if name in live or name not in graph:
      continue
    live.add(name)
    for text in graph.node(name).input:
      stack.append(text[1:] if text[:1] == "^" else parse_input(text)[0])
  return frozenset(n for n in graph.node_names() if n not in live)


class ExecutorModel:
  """TF's executor on one inter-op thread over one graph (see the notes
  at the top of this module); order(seed) runs it with the out edges in one
  order."""

  def __init__(self, graph, order):
    self.names = order
    index = {name: i for i, name in enumerate(order)}
    self.data_out = [[] for _ in order]
    self.control_out = [[] for _ in order]
    self.pending = [0] * len(order)
    self.inline_op = [False] * len(order)
    for i, name in enumerate(order):
      node = graph.node(name)
      self.inline_op[i] = node.op in INLINE_OPS
      for text in node.input:
        if text[:1] == "^":
          self.control_out[index[text[1:]]].append(i)
        else:
          self.data_out[index[parse_input(text)[0]]].append(i)
        self.pending[i] += 1

  def order(self, seed=None):
    data_out, control_out = self.data_out, self.control_out
    if seed is not None:
      shuffle = random.Random(seed).shuffle
      data_out = [list(e) for e in data_out]
      control_out = [list(e) for e in control_out]
      for edges in data_out + control_out:
        if len(edges) > 1:
          shuffle(edges)
    inline_op = self.inline_op
    pending = list(self.pending)
    ran = []
    stack = []  # the thread's queue: pushed to and popped from its end

    def process(ready):
      inline = collections.deque()
      while True:
        # ScheduleReady: inexpensive ops inline; every expensive one but the
        # last queued, and the last too if inline work is waiting.
        current = None
        for j in ready:
          if inline_op[j]:
            inline.append(j)
          else:
            if current is not None:
              stack.append(current)
            current = j
        if current is not None:
          if inline:
            stack.append(current)
          else:
            inline.append(current)
        if not inline:
          return
        i = inline.popleft()
        ran.append(i)
        ready = []
        for j in data_out[i]:
          pending[j] -= 1
          if not pending[j]:
            ready.append(j)
        for j in control_out[i]:
          pending[j] -= 1
          if not pending[j]:
            ready.append(j)

    # The executor's source readies every node without inputs, in order.
    process([i for i, count in enumerate(pending) if not count])
    while stack:
      process([stack.pop()])
    if len(ran) != len(self.names):
      return list(self.names)
    return [self.names[i] for i in ran]


def executor_order(graph, order=None, seed=None):
  """Names of `graph`'s nodes in the order TF's executor runs them on one
  inter-op thread (see the notes at the top of this module); a topological
  order.

  graph: a tfsplit Graph. order: its topological order, if already computed.
  seed: None lists each node's out edges in that order (data edges before
  control edges, as TF's executor walks them); an int shuffles each node's
  data edges and its control edges with random.Random(seed). TF's runtime
  graph lists them in an order that its rewrites (Grappler, the oneDNN pass)
  leave behind and the GraphDef does not record; simulate_graph takes the
  median peak over a few seeds. A graph the model cannot run through (a TF1
  while loop: a Merge runs on its first input) keeps `order`.
  """
  if order is None:
    order = graph.topological_order()
  return ExecutorModel(graph, order).order(seed)
