"""One config: SplitConfig is what every front door builds and every pass
reads; the CLI's flags, tfsplit.split's keywords and a plan fill it in one
way each, and the manifest records it."""
import json
import os

import pytest
from absl import flags

import tfsplit
from tfsplit.commands import rewrite_cmd
from tfsplit.commands import split_flags
from tfsplit.errors import PlanError
from tfsplit.graph import load_graph
from tfsplit.layout.mesh import Mesh
from tfsplit.passes import split_graph
from tfsplit.passes.config import SplitConfig
from tfsplit import plan as plan_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(ROOT, "examples", "gpt_raw_train_tiny.pb")


def _rewrite_flags(*argv):
  fv = flags.FlagValues()
  rewrite_cmd.define_flags(fv)
  fv(["tfsplit", *map(str, argv)])
  return fv


def test_config_has_one_spelling_per_option():
  config = SplitConfig(Mesh({"dp": 2}), offload="none", recompute="none",
                       annotations={"*/k": ["tp", None]}, layer_ranges=[[0, 1]])
  assert config.offload is None and config.recompute is None
  assert config.annotations == {"*/k": ("tp", None)} and config.layer_ranges == [(0, 1)]
  record = json.loads(json.dumps(config.to_json()))
  assert record["mesh"] == {"dp": 2} and set(record) == {"mesh", *SplitConfig.options()}
  with pytest.raises(PlanError, match="zero must be 0, 1, 2 or 3"):
    config.replace(zero=4)


def test_every_option_flag_of_rewrite_fills_its_field():
  """A flag named as a field sets it; the spelled ones convert their unit."""
  fv = _rewrite_flags("in.pb", "-o", "out.pb", "--mesh", "dp=2,tp=2", "--microbatches", 2,
                      "--bucket-mb", 0.5, "--collective-timeout", 7, "--zero", 1,
                      "--annotate", "*/fc1/kernel=-,tp", "--sequence-parallel",
                      "--gradient-reduce-dtype", "bfloat16")
  config = split_flags.split_config(fv)
  assert config.mesh.axes == {"dp": 2, "tp": 2}
  assert config.mesh.devices[3] == "/job:localhost/replica:0/task:0/device:CPU:3"
  assert (config.microbatches, config.bucket_bytes, config.timeout_seconds, config.zero) == (
      2, 2**19, 7.0, 1)
  assert config.annotations == {"*/fc1/kernel": (None, "tp")}
  assert config.sequence_parallel and config.gradient_reduce_dtype == "bfloat16"
  options, given, names = split_flags.options(fv)
  # Every option the command defines a flag for is read, by one name each.
  assert set(given) == {"microbatches", "bucket_bytes", "timeout_seconds", "zero",
                        "annotations", "sequence_parallel", "gradient_reduce_dtype"}
  assert names["bucket_bytes"] == "--bucket-mb" and "schedule" in options
  gpu = split_flags.split_config(_rewrite_flags("in.pb", "-o", "o.pb", "--stages", 2,
                                                "--mesh", "tp=2", "--devices", "gpu"))
  assert gpu.mesh.axes == {"pp": 2, "tp": 2} and gpu.mesh.devices[0].endswith("GPU:0")


def test_task_without_cluster_is_one_line():
  with pytest.raises(PlanError, match="--task needs --cluster"):
    split_flags.split_config(_rewrite_flags("in.pb", "-o", "o.pb", "--task", 0))


def _plan(**fields):
  layers = plan_lib.model_layer_names(load_graph(GPT))
  return plan_lib.Plan(devices=2, layers=layers, mesh="dp=2", microbatches=2, **fields)


def test_plan_applies_to_a_config_and_refuses_other_values():
  plan = _plan(zero=1, replicate=["gpt/block_0"]).bind(load_graph(GPT))
  base = SplitConfig(Mesh({"dp": 2}), annotations={"*/fc2/kernel": (None, None)},
                     bucket_bytes=0)
  config = plan.apply(base)
  assert (config.microbatches, config.zero, config.bucket_bytes) == (2, 1, 0)
  assert "*/fc2/kernel" in config.annotations
  assert any(k.startswith("gpt/block_0/") for k in config.annotations)
  plan.refuse({"zero": 1, "mesh": "dp=2", "microbatches": 2})   # the same values: fine
  with pytest.raises(PlanError, match="the plan sets zero 1 but zero 0 is given too"):
    plan.refuse({"zero": 0})
  with pytest.raises(PlanError, match="the plan is for mesh dp=2"):
    plan.apply(SplitConfig(Mesh({"tp": 2})))


def test_split_refuses_an_option_the_plan_sets_otherwise():
  from _util import example  # pylint: disable=import-outside-toplevel
  ex = example("gpt_raw")
  plan = plan_lib.Plan(devices=2, layers=plan_lib.model_layer_names(load_graph(GPT)),
                       mesh="tp=2")
  with pytest.raises(PlanError, match="the plan sets microbatches 1 but microbatches 2"):
    tfsplit.split(ex.train_step, plan=plan, input_signature=ex.train_signature,
                  microbatches=2)


def test_split_graph_takes_a_config_whole_and_the_manifest_records_it():
  graph_def = load_graph(GPT)
  config = SplitConfig(Mesh({"dp": 2}), microbatches=2, bucket_bytes=0)
  result = split_graph(graph_def, config)
  assert result.config is config
  assert json.loads(result.manifest_json())["config"] == json.loads(
      json.dumps(config.to_json()))
  short = split_graph(graph_def, Mesh({"dp": 2}), microbatches=2, bucket_bytes=0)
  assert short.graph_def.SerializeToString(deterministic=True) == \
      result.graph_def.SerializeToString(deterministic=True)
  assert split_graph(graph_def, config, bucket_bytes=1 << 20).config.bucket_bytes == 1 << 20
