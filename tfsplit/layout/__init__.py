"""The vocabulary every layer of a split shares: a named device Mesh and a
Sharding (which mesh axis splits each dimension of a tensor, which axes hold
partial sums). Leaf modules: they import nothing of tfsplit but its errors,
so split rules, propagation, the cost model and the runtime can all use them."""
