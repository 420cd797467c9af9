"""The checker itself: a correct split graph passes, and every kind of break fails.

A correct rewrite of the bundled GPT training step is broken on purpose in
one place on one device (one replica skips an update, one shard's step is 10%
too large, one shard's Adam second moment is zeroed, two shards are swapped,
one collective member contributes nothing, one device's attention logits are
10% too large) and `verify` must report MISMATCH
after 1 step and after 3 steps, on dp=2, tp=2 and dp=2 x tp=2 graphs.
"""
import os

import numpy as np
import pytest
from tensorflow.core.framework import graph_pb2
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import tensor_util

from tfsplit import cli
from tfsplit.graph import load_graph, save_graph
from tfsplit.graph import variables as variables_lib
from tfsplit.runtime.verify import verify
from tfsplit.layout.mesh import Mesh
from tfsplit.passes import split_graph

from _util import TIMEOUT

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "gpt_raw_train_tiny.pb")
KERNEL = "gpt/block_0/mlp/fc1/kernel"
VELOCITY = "adam/gpt_block_0_mlp_fc1_kernel_0_velocity"
MESHES = ["dp=2", "tp=2", "dp=2,tp=2"]
_SPLITS = {}


def _split(mesh_text):
  if mesh_text not in _SPLITS:
    original = load_graph(EXAMPLE)
    axes = Mesh.parse(mesh_text).axes
    size = int(np.prod(list(axes.values())))
    mesh = Mesh(axes, [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(size)])
    result = split_graph(original, mesh, timeout_seconds=TIMEOUT)
    manifest = {"variables": result.manifest, "outputs": result.output_copies,
                "devices": mesh.devices}
    _SPLITS[mesh_text] = (original, result.graph_def, manifest)
  return _SPLITS[mesh_text]


# --- graph surgery ---------------------------------------------------------------
def _shard_of(node):
  """The variable shard a captured-variable placeholder reads, or None."""
  if variables_lib.VAR_NAME_ATTR in node.attr:
    return node.attr[variables_lib.VAR_NAME_ATTR].s.decode()
  return None


def _updates(graph_def, shard):
  """Update ops writing variable shard `shard`."""
  handles = {n.name for n in graph_def.node if _shard_of(n) == shard}
  return [n for n in graph_def.node
          if n.op.startswith(("Assign", "ResourceApply")) and n.input[0] in handles]


def _add(graph_def, name, op, device, inputs, dtype=types_pb2.DT_FLOAT, value=None):
  node = graph_def.node.add(name=name, op=op, device=device, input=inputs)
  if op == "Const":
    node.attr["dtype"].type = dtype
    node.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(
        np.asarray(value, np.float32)))
  else:
    node.attr["T"].type = dtype
  return node


def _shards(manifest, variable):
  return manifest["variables"][variable]["shards"]


def skip_replica_update(graph_def, manifest):
  """The last device's copy of the kernel never trains (its step is zero)."""
  shard = _shards(manifest, KERNEL)[-1]["name"]
  (update,) = _updates(graph_def, shard)
  _add(graph_def, "mutation/no_step", "ZerosLike", update.device, [update.input[1]])
  update.input[1] = "mutation/no_step"


def scale_step(graph_def, manifest):
  """Device 0's step of the kernel is 10% too large (its learning rate x 1.1)."""
  shard = _shards(manifest, KERNEL)[0]["name"]
  (update,) = _updates(graph_def, shard)
  scale = _add(graph_def, "mutation/lr_scale", "Const", update.device, [], value=1.1)
  _add(graph_def, "mutation/scaled_step", "Mul", update.device, [update.input[1], scale.name])
  update.input[1] = "mutation/scaled_step"


def zero_second_moment(graph_def, manifest):
  """Device 0's shard of the kernel's Adam second moment is set to zero."""
  shard = _shards(manifest, VELOCITY)[0]["name"]
  (update,) = _updates(graph_def, shard)
  _add(graph_def, "mutation/zeros", "ZerosLike", update.device, [update.input[1]])
  update.op = "AssignVariableOp"
  update.input[1] = "mutation/zeros"
  update.attr["dtype"].type = types_pb2.DT_FLOAT


def swap_shards(graph_def, manifest):
  """Two devices read each other's shard of the kernel; where the kernel is
  replicated, device 0 reads two same-shaped variables the wrong way round."""
  shards = _shards(manifest, KERNEL)
  other = next((s for s in shards if s["offsets"] != shards[0]["offsets"]), None)
  if other is not None:
    a, b = shards[0]["name"], other["name"]
  else:
    a = _shards(manifest, "gpt/block_0/ln_1/gamma")[0]["name"]
    b = _shards(manifest, "gpt/block_0/ln_1/beta")[0]["name"]
  for node in graph_def.node:
    if _shard_of(node) in (a, b):
      node.attr[variables_lib.VAR_NAME_ATTR].s = (b if _shard_of(node) == a else a).encode()


def drop_member(graph_def, manifest):
  """Device 1's member of the first all-reduce contributes zeros."""
  device = manifest["devices"][1]
  node = next(n for n in graph_def.node if n.op == "CollectiveReduceV2" and n.device == device)
  zeros = _add(graph_def, "mutation/no_contribution", "ZerosLike", device, [node.input[0]],
               dtype=node.attr["T"].type)
  node.input[0] = zeros.name


def scale_attention_logits(graph_def, manifest):
  """The last device's attention logits in the first block are 10% too large."""
  device = manifest["devices"][-1]
  node = next(n for n in graph_def.node if n.op == "Softmax" and n.device == device)
  scale = _add(graph_def, "mutation/logit_scale", "Const", device, [], value=1.1)
  _add(graph_def, "mutation/scaled_logits", "Mul", device, [node.input[0], scale.name])
  node.input[0] = "mutation/scaled_logits"


MUTATIONS = [skip_replica_update, scale_step, zero_second_moment, swap_shards, drop_member,
             scale_attention_logits]


def _mutated(graph_def, manifest, mutation):
  broken = graph_pb2.GraphDef()
  broken.CopyFrom(graph_def)
  mutation(broken, manifest)
  return broken


# --- tests ---------------------------------------------------------------------
@pytest.mark.parametrize("mesh", MESHES)
def test_correct_split_passes(mesh):
  original, rewritten, manifest = _split(mesh)
  report = verify(original, rewritten, manifest, steps=3)
  report.assert_ok(mesh)
  kinds = {c.kind for c in report.comparisons}
  assert kinds == {"output", "value", "update", "copy"}
  # Every shard of every variable is compared, for its value and its update.
  shards = sum(len(e["shards"]) for e in manifest["variables"].values())
  assert sum(c.kind == "value" for c in report.comparisons) == shards
  assert report.noise_estimated


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("mesh", MESHES)
def test_every_break_is_a_mismatch(mesh, mutation):
  """Reported after 1 step and after 3 steps (one run, variables compared
  after every step: the same numbers as two runs of 1 and 3 steps)."""
  original, rewritten, manifest = _split(mesh)
  broken = _mutated(rewritten, manifest, mutation)
  report = verify(original, broken, manifest, steps=3, every_step=True)
  assert "MISMATCH" in report.table()
  for step in (1, 3):
    failed = [c for c in report.failures if c.what.startswith((
        f"after step {step}:", f"step {step} "))]
    assert failed, f"{mutation.__name__} on {mesh} passed at step {step}:\n{report.table()}"


def test_one_step_run_equals_first_step_of_three():
  """every_step's step-1 comparisons are those of a 1-step run."""
  original, rewritten, manifest = _split("dp=2")
  broken = _mutated(rewritten, manifest, scale_step)
  one = verify(original, broken, manifest, steps=1)
  three = verify(original, broken, manifest, steps=3, every_step=True)
  first = {c.what[len("after step 1: "):]: c.max_abs for c in three.comparisons
           if c.what.startswith("after step 1: ")}
  assert first == {c.what: c.max_abs for c in one.comparisons
                   if not c.what.startswith("step ")}


def test_divergent_replica_is_named_by_device():
  original, rewritten, manifest = _split("dp=2")
  report = verify(original, _mutated(rewritten, manifest, skip_replica_update), manifest,
                  steps=1)
  copy = report.first_divergent_copy()
  assert copy is not None and KERNEL in copy.what and "CPU:1" in copy.what, report.table()
  # The un-mutated replica still matches: the failure is on the right device.
  by_what = {c.what: c for c in report.comparisons if c.kind == "update"}
  assert by_what[f"{KERNEL} on CPU:0"].ok
  assert not by_what[f"{KERNEL} on CPU:1"].ok


def test_cli_verify_exit_code_on_broken_graph(tmp_path, capsys):
  original, rewritten, manifest = _split("dp=2")
  path = str(tmp_path / "broken.pb")
  save_graph(_mutated(rewritten, manifest, scale_step), path)
  import json  # pylint: disable=import-outside-toplevel
  with open(str(tmp_path / "broken.manifest.json"), "w", encoding="utf-8") as f:
    json.dump(manifest, f)
  assert cli.run(["tfsplit", "verify", EXAMPLE, path, "--steps", "1"]) == 1
  out = capsys.readouterr().out
  assert "MISMATCH" in out and f"{KERNEL} on CPU:0" in out
