"""Sharding specs over device meshes, propagation, resharding, materialization."""
