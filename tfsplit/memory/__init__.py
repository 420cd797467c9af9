"""Memory: size-only estimates of model states (and later recompute, offload)."""
