"""The split as an explicit sequence of passes (see split.py for the order)."""
from tfsplit.passes.config import SplitConfig
from tfsplit.passes.result import SplitResult
from tfsplit.passes.split import PASSES, run_passes, split_graph

__all__ = ["PASSES", "SplitConfig", "SplitResult", "run_passes", "split_graph"]
