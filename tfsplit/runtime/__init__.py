"""Running rewritten graphs: callables, multi-worker launch, verification."""
