"""Stage balancing by the cost model: per-layer op times and the activations
crossing each cut."""
from tfsplit.cost import cluster as cluster_lib
from tfsplit.cost import layer_cost
from tfsplit.cost import op_cost
from tfsplit.graph import load_graph
from tfsplit.passes.analysis import Analysis

from _util import example, names


def test_layer_times_and_boundary_bytes_on_gpt():
  ex = example("gpt_raw", batch_size=8)
  cfg = ex.config
  analysis = Analysis(load_graph(ex.concrete("train"), variable_names=names(ex)))
  report = analysis.layers
  model = op_cost.CostModel(cluster_lib.from_preset("cpu-host", num_devices=2,
                                                    devices_per_host=2))
  seconds = layer_cost.layer_seconds(analysis.graph, analysis.shapes, report, model)
  cuts = layer_cost.boundary_bytes(analysis.graph, analysis.shapes, report)
  layers = [l.name for l in report.model_layers]
  blocks = [i for i, l in enumerate(report.model_layers) if l.block]
  assert len(blocks) == cfg.blocks and len(seconds) == len(layers)
  assert len(cuts) == len(layers) - 1
  # Identical blocks cost the same; each is more than the final norm.
  block_times = [seconds[i] for i in blocks]
  assert max(block_times) - min(block_times) <= 1e-9 * max(block_times)
  assert min(block_times) > seconds[layers.index("gpt/ln_f")]
  # Between two blocks the residual stream crosses: batch x seq x hidden floats.
  residual = cfg.batch * cfg.seq * cfg.hidden * 4
  between = [cuts[i] for i in blocks[:-1]]
  assert len(set(between)) == 1 and between[0] >= residual, between
  # The head (loss included) runs with the last layer: its cost is counted there.
  assert seconds[-1] > 0
