"""Pipeline stages with gpipe and 1f1b schedules: exact training, and the order."""
import pytest

from tfsplit.errors import PlanError
from tfsplit.graph import load_graph
from tfsplit.pipeline.partition import balanced_partition
from tfsplit.pipeline.schedules import GPipe, OneFOneB
from tfsplit.runtime.split_function import make_mesh
from tfsplit.layout.mesh import Mesh
from tfsplit.passes import split_graph

from _util import TIMEOUT, check_training, example, names

BATCH = 16


def _check(name, mesh, m, schedule, size="tiny"):
  return check_training(example(name, size, batch_size=BATCH), seed=13, mesh=mesh,
                        microbatches=m, schedule=schedule)


_CI = {(2, 4, "1f1b"), (2, 4, "gpipe"), (4, 2, "1f1b"), (4, 8, "1f1b")}
RAW_CASES = [c if c in _CI else pytest.param(*c, marks=pytest.mark.slow)
             for c in [(s, m, sched) for s, m in [(2, 2), (2, 4), (2, 8), (4, 2), (4, 8)]
                       for sched in ("1f1b", "gpipe")]]


@pytest.mark.parametrize("stages,m,schedule", RAW_CASES)
def test_gpt_raw_pipeline(stages, m, schedule):
  step = _check("gpt_raw", f"pp={stages}", m, schedule)
  assert len(step.result.partition) == stages


@pytest.mark.parametrize("name", ["gpt_keras3", "gpt_tfkeras"])
def test_keras_pipeline(name):
  _check(name, "pp=2", 4, "1f1b")


def test_hybrid_data_and_pipeline_parallel():
  step = _check("gpt_raw", "pp=2,dp=2", 2, "1f1b")
  assert step.result.count("all_reduce") > 0  # gradients over dp


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages,m", [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8)])
@pytest.mark.parametrize("name", ["gpt_keras3", "gpt_tfkeras"])
def test_keras_pipeline_full_matrix(name, stages, m, schedule):
  _check(name, f"pp={stages}", m, schedule, size="small")


def test_schedule_orders_match_dapple():
  assert OneFOneB().order(0, 4, 8)[:6] == [("F", 0), ("F", 1), ("F", 2), ("F", 3),
                                           ("B", 0), ("F", 4)]
  assert OneFOneB().order(3, 4, 8)[:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
  assert OneFOneB().order(0, 4, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # m < S
  assert GPipe().order(1, 4, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1),
                                    ("B", 2)]
  for stage in range(4):
    seq = OneFOneB().order(stage, 4, 8)
    assert sorted(seq) == sorted(GPipe().order(stage, 4, 8))


def test_balanced_partition():
  assert balanced_partition([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
  assert balanced_partition([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
  # A cut where much crosses costs both stages it separates: the middle cut
  # (10) loses to an uneven split whose cut is free.
  assert balanced_partition([1, 1, 1, 1], 2, boundary=[0, 10, 0]) in (
      [(0, 1), (1, 4)], [(0, 3), (3, 4)])
  assert balanced_partition([1, 1, 1, 1], 2, boundary=[0, 0.1, 0]) == [(0, 2), (2, 4)]


def test_bad_pipeline_requests():
  ex = example("gpt_raw", batch_size=BATCH)
  graph_def = load_graph(ex.concrete("train"), variable_names=names(ex))
  with pytest.raises(PlanError, match="6 stages but the graph has only 5 layers"):
    split_graph(graph_def, Mesh({"pp": 6}), microbatches=2)
  with pytest.raises(PlanError, match="not contiguous"):
    split_graph(graph_def, make_mesh("pp=2"), microbatches=2,
                layer_ranges=[(0, 1), (2, 4)])
  with pytest.raises(PlanError, match="every layer needs a stage"):
    split_graph(graph_def, make_mesh("pp=2"), microbatches=2,
                layer_ranges=[(0, 1), (1, 3)])
  with pytest.raises(PlanError, match="unknown pipeline schedule 'zigzag'"):
    split_graph(graph_def, make_mesh("pp=2"), microbatches=2, schedule="zigzag")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_step_trace_follows_the_schedule(schedule):
  """Each stage runs its forward/backward micro-batch blocks in schedule order,
  read from the step stats of a real run (Grappler on)."""
  from tfsplit.graph import Graph  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.layers import detect_layers  # pylint: disable=import-outside-toplevel
  from tfsplit.pipeline.schedules import get_schedule  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import session as session_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import trace as trace_lib  # pylint: disable=import-outside-toplevel
  ex = example("gpt_raw", batch_size=BATCH)
  graph_def = load_graph(ex.concrete("train"), variable_names=names(ex))
  stages, m = 2, 4
  result = split_graph(graph_def, Mesh({"pp": stages}), microbatches=m, schedule=schedule,
                       timeout_seconds=TIMEOUT)
  runner = session_lib.SessionRunner(
      result.graph_def, session_lib.seeded_values(result.graph_def, result.manifest))
  _, metadata = runner.run(ex.make_inputs("train", seed=1), trace=True)
  roles = detect_layers(Graph(graph_def)).block_roles()
  mesh = Mesh({"pp": stages}).with_microbatches(m)
  blocks = trace_lib.microbatch_blocks(trace_lib.op_events(metadata), roles, mesh,
                                         result.graph_def)
  assert sorted(blocks) == list(range(stages))
  for stage, seq in blocks.items():
    assert [b[0] for b in seq] == get_schedule(schedule).order(stage, stages, m), stage
