"""The automatic planner: which mesh, micro-batches, schedule, stage cut,
recomputation, optimizer-state sharding, blocks replicated rather than
split over tp, and optimizer offload to split a training step with, leaving
a reserve of each device's memory free.

    from tfsplit.plan import plan_graph
    plan, result = plan_graph(graph_def, devices=8, device_memory="16GB",
                              cluster="h100-80gb")
    config = plan.bind(graph_def).apply(SplitConfig(Mesh.parse(plan.mesh)))
    split_graph(graph_def, config)

entry.py holds the entry points re-exported here; profile.py turns the
graph into one row per layer, costing.py prices a candidate (space.py) from those rows,
search.py finds the fastest candidate that fits the per-device memory (its
stage cuts from the dynamic program of cuts.py), plan.py reads and writes
the chosen plan as JSON.
The planner reads the cost model (tfsplit.cost) and the layer detection
(tfsplit.graph.layers); the runtime and the commands read the planner.
"""
from tfsplit.errors import PlanError, TfsplitError
from tfsplit.plan.entry import (AUTO, DEFAULT_CLUSTER, check_devices, cluster_for,
                                local_cluster, memory_cap, model_layer_names, plan_graph,
                                plan_profile, profile_graph, resolve)
from tfsplit.plan.plan import Plan, read
from tfsplit.plan.search import DEFAULT_RESERVE, Planner, SearchResult, no_plan_message

__all__ = ["AUTO", "DEFAULT_CLUSTER", "DEFAULT_RESERVE", "Plan", "PlanError", "Planner",
           "SearchResult", "TfsplitError", "check_devices", "cluster_for", "local_cluster",
           "memory_cap", "model_layer_names", "no_plan_message", "plan_graph", "plan_profile",
           "profile_graph", "read", "resolve"]
