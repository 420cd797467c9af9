"""A pipelined tfsplit.split step runs each stage's forward/backward micro-batch
blocks in the schedule's order: read from a real step's trace (TF's profiler),
under TF's default Grappler config. (The Session runner's trace is checked in
test_pipeline.test_step_trace_follows_the_schedule.)"""
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

import tfsplit
from tfsplit.graph import Graph
from tfsplit.graph.layers import detect_layers
from tfsplit.pipeline import schedules
from tfsplit.runtime import trace as trace_lib

from _util import TIMEOUT, example, names

BATCH, STAGES, M = 16, 2, 4


def _split(schedule, stages=STAGES, m=M):
  ex = example("gpt_raw", batch_size=BATCH)
  return ex, tfsplit.split(ex.train_step, mesh=f"pp={stages}", microbatches=m,
                           schedule=schedule, input_signature=ex.train_signature,
                           variable_names=names(ex), timeout_seconds=TIMEOUT)


def _block_orders(ex, step, m=M):
  """{stage: [('F'|'B', j)]} of one traced step, after a warm-up step."""
  inputs = [tf.constant(x) for x in ex.make_inputs("train", seed=1)]
  step(*inputs)  # instantiation and Grappler stay out of the trace
  _, events = step.trace(*inputs)
  roles = detect_layers(Graph(step.original_graph_def)).block_roles()
  blocks = trace_lib.microbatch_blocks(events, roles, step.mesh.with_microbatches(m),
                                         step.graph_def)
  return {stage: [b[0] for b in seq] for stage, seq in blocks.items()}


def _check_orders(schedule, stages=STAGES, m=M):
  ex, step = _split(schedule, stages, m)
  before = context.context().function_call_options.config_proto_serialized
  orders = _block_orders(ex, step, m)
  # The step's own Grappler config does not outlive its call.
  assert context.context().function_call_options.config_proto_serialized == before
  assert sorted(orders) == list(range(stages))
  for stage, seq in orders.items():
    assert seq == schedules.get_schedule(schedule).order(stage, stages, m), (
        f"stage {stage} ran {seq}")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_split_step_trace_follows_the_schedule(schedule):
  _check_orders(schedule)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_split_step_trace_follows_the_schedule_four_stages(schedule):
  _check_orders(schedule, stages=4, m=8)


def test_trace_tells_a_step_without_schedule_edges(monkeypatch):
  """The order check is not vacuous: without the schedule's edges stage 0
  runs its forwards ahead of the 1f1b order."""
  monkeypatch.setattr(schedules, "apply_schedule", lambda *args: 0)
  ex, step = _split("1f1b")
  assert not any(schedules.SCHEDULE_BARRIER_ATTR in n.attr for n in step.graph_def.node)
  orders = _block_orders(ex, step)
  assert orders[0] != schedules.get_schedule("1f1b").order(0, STAGES, M), orders
