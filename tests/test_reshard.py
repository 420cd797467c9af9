"""Reshard: every transition between shardings, run on logical devices.

A global tensor X is laid out as `have` (each device its block; a partial
sum as blocks that add up to X), moved to `want` by the Resharder, run, and
every device's result compared with its block of X under `want`.
"""
import itertools
import types

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2
from tensorflow.core.framework import versions_pb2
from tensorflow.core.framework import function_pb2

from tfsplit.sharding.builder import DeviceGraph, const_node
from tfsplit.layout.mesh import Mesh
from tfsplit.sharding.reshard import Resharder
from tfsplit.layout.spec import Sharding

SHAPE = (4, 8, 6)


def _mesh(text):
  mesh = Mesh.parse(text)
  return Mesh(mesh.axes, [f"/job:localhost/replica:0/task:0/device:CPU:{i}"
                          for i in range(mesh.size)])


def _blocks(x, spec, mesh):
  """Each device's block of x under `spec` (partial: x shared out by weight)."""
  out = []
  for d in range(mesh.size):
    sl = tuple(slice(o, o + s) for o, s in zip(spec.offsets(x.shape, mesh, d),
                                                spec.local_shape(x.shape, mesh)))
    block = x[sl]
    for axis in sorted(spec.partial):
      n, c = mesh.size_of(axis), mesh.coord_of(d, axis)
      block = block * (c + 1) / (n * (n + 1) / 2)  # weights 1..n, summing to 1
    out.append(block.astype(np.float32))
  return out


def _run(mesh, have, want, seed=0):
  x = np.random.RandomState(seed).randn(*SHAPE).astype(np.float32)
  b = DeviceGraph(versions_pb2.VersionDef(producer=1), function_pb2.FunctionDefLibrary())
  current = []
  for d, block in enumerate(_blocks(x, have, mesh)):
    current.append(b.add(const_node(f"x/shard_{d}", block, mesh.devices[d])).name)
  info = types.SimpleNamespace(shape=SHAPE, dtype=tf.float32.as_datatype_enum,
                               num_elements=int(np.prod(SHAPE)))
  r = Resharder(b, mesh, 30.0, hash((str(have), str(want))) & 0xFFFF)
  out = r.reshard(current, list(range(mesh.size)), info, have, want, "x", 0, "test")
  names = []
  for d in range(mesh.size):
    ident = node_def_pb2.NodeDef(name=f"out_{d}", op="Identity", device=mesh.devices[d],
                                 input=[out[d]])
    ident.attr["T"].type = info.dtype
    b.add(ident)
    names.append(ident.name + ":0")
  graph_def = b.graph_def

  def body():
    return tf.graph_util.import_graph_def(graph_def, return_elements=names, name="")
  got = [t.numpy() for t in tf.compat.v1.wrap_function(body, [])()]
  return got, _blocks(x, want, mesh), r.collectives


def _specs(mesh, partial):
  axes = [a for a in mesh.axis_names]
  out = [Sharding.replicated(3)]
  for dim, axis in itertools.product(range(3), axes):
    out.append(Sharding.split(3, dim, axis))
  if len(axes) == 2:
    out.append(Sharding((axes[0], axes[1], None)))
    out.append(Sharding((None, axes[1], axes[0])))
  if partial:
    out += [s.with_partial({a}) for s in list(out) for a in axes if a not in s.axes_used]
  return out


def _cases(text):
  mesh = _mesh(text)
  return [(text, have, want) for have in _specs(mesh, True) for want in _specs(mesh, False)
          if have != want]


@pytest.mark.parametrize("text,have,want", _cases("tp=2"), ids=str)
def test_every_transition_on_two_devices(text, have, want):
  got, expected, _ = _run(_mesh(text), have, want)
  for d, (g, e) in enumerate(zip(got, expected)):
    np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6, err_msg=f"device {d}")


@pytest.mark.parametrize("text,have,want",
                         [c for i, c in enumerate(_cases("dp=2,tp=2")) if i % 5 == 0],
                         ids=str)
def test_transitions_on_a_two_by_two_mesh(text, have, want):
  got, expected, _ = _run(_mesh(text), have, want)
  for d, (g, e) in enumerate(zip(got, expected)):
    np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6, err_msg=f"device {d}")


def test_the_cheapest_collective_is_chosen():
  mesh = _mesh("tp=2")
  kinds = lambda have, want: [c.kind for c in _run(mesh, have, want)[2]]  # noqa: E731
  split0, split1 = Sharding.split(3, 0, "tp"), Sharding.split(3, 1, "tp")
  whole = Sharding.replicated(3)
  assert kinds(whole.with_partial({"tp"}), whole) == ["all_reduce"]
  assert kinds(split0, split1) == ["all_to_all"]       # not gather + slice
  assert kinds(split0, whole) == ["all_gather"]
  assert kinds(whole, split1) == []                     # a local slice
  # A reduce-scatter (on CPUs, with no kernel for it: an all-to-all and a
  # local sum), not an all-reduce and a local slice.
  assert kinds(whole.with_partial({"tp"}), split1) == ["reduce_scatter"]


def test_reduce_scatter_on_gpus():
  """On GPUs (NCCL) a partial sum wanted split is one CollectiveReduceScatterV2."""
  mesh = Mesh({"tp": 2}, [f"/job:localhost/replica:0/task:0/device:GPU:{i}"
                          for i in range(2)])
  b = DeviceGraph(versions_pb2.VersionDef(producer=1), function_pb2.FunctionDefLibrary())
  current = [b.add(const_node(f"x/shard_{d}", np.zeros(SHAPE, np.float32),
                              mesh.devices[d])).name for d in range(2)]
  info = types.SimpleNamespace(shape=SHAPE, dtype=tf.float32.as_datatype_enum,
                               num_elements=int(np.prod(SHAPE)))
  r = Resharder(b, mesh, 30.0, 1)
  r.reshard(current, [0, 1], info, Sharding.replicated(3).with_partial({"tp"}),
            Sharding.split(3, 1, "tp"), "x", 0, "test")
  ops = [n.op for n in b.graph_def.node]
  assert ops.count("CollectiveReduceScatterV2") == 2 and "CollectiveReduceV2" not in ops
  assert [c.kind for c in r.collectives] == ["reduce_scatter"]
  # TF's "auto" would run its ring implementation on GPUs: the op asks for NCCL.
  assert {n.attr["communication_hint"].s for n in b.graph_def.node
          if n.op.startswith("Collective")} == {b"nccl"}
