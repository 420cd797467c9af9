"""One process of tests/test_deferred.py: builds examples/models/seeded.py's
GPT (whole, or under tfsplit.deferred_init()), trains it --steps steps
unsplit or split over --mesh (in this process, or as this worker's task when
TF_CONFIG names one) and writes a JSON report: resident memory (base before
the model, after building, peak), the model's state bytes, this process's
share of it, the losses and, with --values, its shards' values."""
import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--deferred", action="store_true")
  parser.add_argument("--mesh", default=None)
  parser.add_argument("--preset", default="tiny", choices=["tiny", "wide"])
  parser.add_argument("--steps", type=int, default=1)
  parser.add_argument("--out", required=True)
  parser.add_argument("--values", action="store_true")
  args = parser.parse_args()
  import keras  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tfsplit  # pylint: disable=import-outside-toplevel
  from models import seeded  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import devices  # pylint: disable=import-outside-toplevel
  if args.mesh and "TF_CONFIG" not in os.environ:
    devices.ensure_logical_devices(2)
  cfg = seeded.TINY if args.preset == "tiny" else seeded.Config(
      vocab=4096, width=512, blocks=3, heads=8, seq=16, batch=4, lr=1e-3)
  base = seeded.process_memory("VmRSS")
  if args.deferred:
    with tfsplit.deferred_init():
      gpt = seeded.build(keras, cfg, seed=0)
  else:
    gpt = seeded.build(keras, cfg, seed=0)
  after_build = seeded.process_memory("VmRSS")
  batches = [gpt.inputs(100 + i) for i in range(args.steps)]
  report = {"base": base, "after_build": after_build, "state": gpt.state_bytes(),
            "share": 1.0}
  if args.mesh is None:
    report["losses"] = [float(gpt.train_step(*b)) for b in batches]
  else:
    step = tfsplit.split(gpt.train_step, mesh=args.mesh, input_signature=gpt.signature,
                         variable_names=gpt.variable_names(), timeout_seconds=120.0,
                         release=not args.deferred, split_embeddings=True)
    held = step.runner.manifest
    report["share"] = sum(int(np.prod(s["shape"])) * 4 for e in held.values()
                          for s in e["shards"]) / report["state"]
    report["losses"] = [float(step(*step.local_batch(*b))) for b in batches]
    if args.values:
      report["manifest"] = held
      report["values"] = {k: v.tolist() for k, v in step.shard_values().items()}
  report["peak"] = seeded.process_memory("VmHWM")
  with open(args.out, "w") as f:
    json.dump(report, f)


if __name__ == "__main__":
  main()
