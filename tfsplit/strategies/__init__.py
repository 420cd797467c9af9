"""Strategies: where to split, found from the graph (megatron) or given."""
