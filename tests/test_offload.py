"""CPU offload of the optimizer state (offload='optimizer'): exact training
alone and with dp, tp, micro-batches and pipelines; every slot, its reads,
writes and update ops on the host CPU, the weights not; bad input in one line.

The mesh sits on CPU:1.. so that CPU:0 is a host apart from the mesh's
devices, as a GPU's host CPU is."""
import os

import pytest

from tfsplit.cli import run as cli_run
from tfsplit.errors import PlanError
from tfsplit.memory import offload as offload_lib
from tfsplit.passes import split_graph
from tfsplit.sharding import zero as zero_lib
from tfsplit.layout.mesh import Mesh, local_cpu_devices

from _util import check_training, example, names

BATCH = 8
HOST = local_cpu_devices(1)[0]
TRAIN = os.path.join(os.path.dirname(__file__), "..", "examples", "gpt_raw_train_tiny.pb")


def _mesh(text):
  """The mesh on CPU:1.. (CPU:0 is the host)."""
  size = Mesh.parse(text).size
  return Mesh.parse(text, local_cpu_devices(size + 1)[1:])


def _check_placement(result):
  problems = offload_lib.misplaced(result.graph_def, result.records, result.manifest,
                                   result.offload)
  assert not problems, problems[:5]
  slots = [n for n, e in result.manifest.items() if zero_lib.SLOT_OF_KEY in e]
  assert slots, "no optimizer slot found"
  for name in slots:  # every slot shard on the host, serving a mesh device
    for shard in result.manifest[name]["shards"]:
      assert shard["device"] == HOST
      assert shard[offload_lib.OFFLOADED_FROM_KEY] in result.mesh.devices
  weights = {result.manifest[n][zero_lib.SLOT_OF_KEY] for n in slots}
  for name in weights:  # the weights stay on the mesh's devices
    assert all(s["device"] != HOST for s in result.manifest[name]["shards"])
  # Update ops run on the host: more than the slots' reads and writes.
  on_host = [n for n in result.graph_def.node if n.device == HOST]
  assert any(n.op in ("Mul", "Sub", "AddV2", "Sqrt", "RealDiv", "Square")
             for n in on_host), sorted({n.op for n in on_host})


CASES = [
    ("gpt_raw", "dp=1", 1),
    ("gpt_raw", "dp=2", 1),
    ("gpt_raw", "tp=2", 1),
    ("gpt_raw", "dp=1", 4),
    ("gpt_raw", "pp=2", 4),
    ("gpt_keras3", "dp=2", 1),
    ("gpt_tfkeras", "tp=2", 2),
]


@pytest.mark.parametrize("name,mesh,m", CASES)
def test_training_is_exact(name, mesh, m):
  step = check_training(example(name, batch_size=BATCH), mesh=_mesh(mesh), microbatches=m,
                        offload="optimizer")
  _check_placement(step.result)
  # Shard variables live where the manifest says: slots on the host.
  for entry in step.manifest.values():
    for shard in entry["shards"]:
      assert step.variables[shard["name"]].device == shard["device"]


def test_checkpoint_round_trip(tmp_path):
  """save/restore follow the manifest: slot shards on the host come back."""
  step = check_training(example("gpt_raw", batch_size=BATCH), steps=1, mesh=_mesh("dp=2"),
                        offload="optimizer")
  saved = step.shard_values()
  step.save(str(tmp_path), 1)
  for var in step.variables.values():
    var.assign(var.numpy() * 0)
  assert step.restore(str(tmp_path)) == 1
  for name, value in step.shard_values().items():
    assert (value == saved[name]).all(), name


def test_placement_check_finds_a_slot_left_on_the_device():
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  result = split_graph(load_graph(TRAIN), _mesh("tp=2"), offload="optimizer")
  assert not offload_lib.misplaced(result.graph_def, result.records, result.manifest,
                                   result.offload)
  slot = sorted(result.offload.slot_of)[0]
  for node in result.graph_def.node:  # the slot's handle copy back on its device
    record = result.records.get(node.name)
    if record is not None and record.source == slot:
      node.device = result.mesh.devices[record.device_id]
      break
  problems = offload_lib.misplaced(result.graph_def, result.records, result.manifest,
                                   result.offload)
  assert len(problems) == 1 and "not on a host" in problems[0], problems


@pytest.mark.parametrize("kwargs,match", [
    (dict(mesh=Mesh.parse("tp=2"), offload="optimizer"),
     r"needs a host CPU apart from the mesh's devices.*CPU:0.*--offload-device"),
    (dict(mesh=_mesh("tp=2"), offload="activations"), r"unknown offload 'activations'"),
    (dict(mesh=_mesh("tp=2"), offload_device=HOST), r"offload is not"),
    (dict(mesh=_mesh("tp=2"), offload="optimizer",
          offload_device=local_cpu_devices(2)[1]), r"itself a mesh device"),
])
def test_bad_input_is_one_line(kwargs, match):
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  mesh = kwargs.pop("mesh")
  with pytest.raises(PlanError, match=match) as info:
    split_graph(load_graph(TRAIN), mesh, **kwargs)
  assert "\n" not in str(info.value)


def test_rewrite_cli(tmp_path, capsys):
  out = str(tmp_path / "off.pb")
  assert cli_run(["tfsplit", "rewrite", TRAIN, "-o", out, "--mesh", "tp=2", "--offload",
                  "optimizer", "--offload-device", "/job:localhost/replica:0/task:0/"
                  "device:CPU:2"]) == 0
  text = capsys.readouterr().out
  assert "offload (optimizer):" in text and "MiB per device moved to its host" in text
  # Without a host apart from the mesh: one line, exit 2, no output file.
  out2 = str(tmp_path / "bad.pb")
  assert cli_run(["tfsplit", "rewrite", TRAIN, "-o", out2, "--mesh", "tp=2",
                  "--offload", "optimizer"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "--offload-device" in err
  assert not os.path.exists(out2)


def test_moved_constants_stay_with_their_readers():
  """An op left on a device reads its own device's constants, never one of
  the host's: materialize keeps the constants the plan moves apart from the
  equal ones that stay (on this model, the step counter's 1)."""
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  ex = example("gpt_keras3", batch_size=BATCH)
  result = split_graph(load_graph(ex.concrete("train"), variable_names=names(ex)),
                       _mesh("tp=2"), offload="optimizer")
  nodes = {n.name: n for n in result.graph_def.node}
  reads = [(n, nodes[t.lstrip("^").split(":")[0]]) for n in result.graph_def.node
           if n.device != HOST for t in n.input]
  assert [(n.name, c.name) for n, c in reads if c.op == "Const" and c.device == HOST] == []
  assert any(c.op == "Const" for _, c in reads)


def test_fully_sharded_data_parallelism_offloads_the_slot_blocks():
  """zero=3 with offload: each replica's weight block on its device, its
  slot blocks (split over dp like the weights) and their update on the host."""
  step = check_training(example("gpt_raw", batch_size=BATCH), mesh=_mesh("dp=2"),
                        zero=3, offload="optimizer")
  _check_placement(step.result)
  for name, entry in step.manifest.items():
    if zero_lib.WEIGHT_KEY in entry:
      assert "dp" in entry["sharding"], (name, entry["sharding"])
