"""The Grappler config a split graph runs with (runtime/graph_function.py)."""
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import config_pb2
from tensorflow.core.protobuf import rewriter_config_pb2

from tfsplit.runtime.graph_function import grappler_config
from tfsplit.sharding import builder as builder_lib

RC = rewriter_config_pb2.RewriterConfig


def _graph(device, split=True):
  graph_def = graph_pb2.GraphDef()
  node = graph_def.node.add(name="x", op="Const", device=device)
  if split:
    node.attr[builder_lib.SOURCE_ATTR].s = b"x"
  return graph_def


def _rewrite(graph_def, config=None):
  return grappler_config(graph_def, config or config_pb2.ConfigProto()).graph_options.rewrite_options


def test_split_cpu_graph_skips_idle_optimizers():
  rewrite = _rewrite(_graph("/job:localhost/replica:0/task:0/device:CPU:1"))
  assert rewrite.meta_optimizer_iterations == RC.ONE
  assert rewrite.disable_tfg_optimizer
  assert rewrite.layout_optimizer == RC.OFF
  assert rewrite.memory_optimization == RC.NO_MEM_OPT
  assert rewrite.loop_optimization == RC.OFF
  # What still runs: the rewrites that change a split graph or speed its step.
  assert rewrite.constant_folding == RC.DEFAULT
  assert rewrite.remapping == RC.DEFAULT
  assert rewrite.arithmetic_optimization == RC.DEFAULT


def test_split_gpu_graph_keeps_layout_and_memory_optimizers():
  rewrite = _rewrite(_graph("/job:localhost/replica:0/task:0/device:GPU:0"))
  assert rewrite.disable_tfg_optimizer
  assert rewrite.layout_optimizer == RC.DEFAULT
  assert rewrite.memory_optimization == RC.DEFAULT_MEM_OPT


def test_callers_settings_and_plain_graphs_are_kept():
  config = config_pb2.ConfigProto()
  config.graph_options.rewrite_options.memory_optimization = RC.MANUAL
  config.graph_options.rewrite_options.layout_optimizer = RC.ON
  config.graph_options.rewrite_options.loop_optimization = RC.ON
  rewrite = _rewrite(_graph("/device:CPU:0"), config)
  assert rewrite.memory_optimization == RC.MANUAL
  assert rewrite.layout_optimizer == RC.ON
  assert rewrite.loop_optimization == RC.ON
  plain = _rewrite(_graph("/device:CPU:0", split=False))
  assert plain == config_pb2.ConfigProto().graph_options.rewrite_options


def test_loop_optimizer_runs_where_it_has_work():
  """Switch nodes (a constant predicate's dead branch), or functions whose
  If / While TF lowers to them before Grappler runs."""
  switch = _graph("/device:CPU:0")
  switch.node.add(name="s", op="Switch", input=["x", "x"], device="/device:CPU:0")
  assert _rewrite(switch).loop_optimization == RC.DEFAULT
  functions = _graph("/device:CPU:0")
  functions.library.function.add().signature.name = "branch"
  assert _rewrite(functions).loop_optimization == RC.DEFAULT
