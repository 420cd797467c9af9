"""Benchmark: peak resident memory of each process that trains a split model,
built whole or under tfsplit.deferred_init(), against the unsplit process.

The model is examples/models/seeded.py's GPT-2-style decoder (Keras 3, Adam;
--preset gpt2-small: 124 M parameters, 1.49 GB of weights and moments;
gpt-1b: 1.07 B parameters, 12.0 GiB).
Every configuration runs in fresh processes (this script again, --role), each
training --steps steps on the same seeded batches and reporting:
- base: its resident memory after importing TensorFlow, Keras and tfsplit and
  making its logical devices, before any model exists (TF's own baseline);
- peak: VmHWM at the end (the most it ever held);
- growth = peak - base, and growth / the unsplit process's growth;
- its share of the model's state (weights + moments) its shards hold;
- its losses, which must equal the unsplit process's (same seed).

Configurations: unsplit (one process, one device); tp=4 in one process on 4
logical devices; pp=2 and dp=2 with zero=1 or zero=3 (FSDP) over 2 worker processes (every
worker runs the script, as `tfsplit launch --each` does); each split one
built whole (split(release=True): every original emptied once its shards
hold it) and under deferred_init().

    python tools/bench_memory.py [--preset gpt2-small|gpt-1b|tiny] [--configs ...] [--steps 3]

Glibc's allocator keeps freed memory in per-thread arenas; MALLOC_ARENA_MAX=2
in the environment (inherited by every process) lowers every peak, the
split workers' most.
"""
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "examples"))

FLAGS = flags.FLAGS
CONFIGS = ["unsplit", "tp=4/whole", "tp=4/deferred", "pp=2/whole", "pp=2/deferred",
           "dp=2,zero=1/whole", "dp=2,zero=1/deferred", "dp=2,zero=3/deferred"]
flags.DEFINE_enum("preset", "gpt2-small", ["gpt2-small", "gpt-1b", "tiny"],
                  "Model size (gpt-1b: 12 GiB of state, for a machine where two "
                  "workers cannot each hold it whole).")
flags.DEFINE_list("configs", CONFIGS, "Configurations to run (see the module doc).")
flags.DEFINE_boolean("untied", False, "An LM head of its own instead of the tied "
                     "embedding (a pipeline then sends no table between stages).")
flags.DEFINE_integer("steps", 3, "Training steps per process.", lower_bound=1)
flags.DEFINE_boolean("phases", False, "Also print each process's peak growth after the "
                     "split (its shards made) and after the first step.")
flags.DEFINE_float("timeout", 1800.0, "Seconds each configuration may take.")
flags.DEFINE_string("role", None, "Internal: 'process' runs one configuration here.")
flags.DEFINE_string("config", None, "Internal: the configuration of --role.")
flags.DEFINE_string("out", None, "Internal: where --role writes its JSON.")


def _preset():
  from models import seeded  # pylint: disable=import-outside-toplevel
  cfg = {"gpt2-small": seeded.GPT2_SMALL, "gpt-1b": seeded.GPT_1B,
         "tiny": seeded.TINY}[FLAGS.preset]
  return cfg._replace(tied=not FLAGS.untied)


def _configs(tokens):
  """--configs as configurations: the list flag splits 'dp=2,zero=1/whole'
  at its comma, so pieces are joined up to the one with the '/'."""
  out, pending = [], []
  for token in tokens:
    pending.append(token)
    if "/" in token or token == "unsplit":
      out.append(",".join(pending))
      pending = []
  if pending:
    raise ValueError(f"--configs: '{','.join(pending)}' lacks '/whole' or '/deferred'")
  return out


def _parse(config):
  """(mesh, options, deferred) of 'tp=4/deferred', 'dp=2,zero=1/whole'."""
  if config == "unsplit":
    return None, {}, False
  axes, how = config.split("/")
  mesh, options = [], {}
  for part in axes.split(","):
    key, value = part.split("=")
    if key in ("zero",):
      options[key] = int(value)
    else:
      mesh.append(part)
  return ",".join(mesh), options, how == "deferred"


def _process():
  """One configuration in this process; writes its report to --out."""
  import keras  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import tfsplit  # pylint: disable=import-outside-toplevel
  from models import seeded  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import devices  # pylint: disable=import-outside-toplevel
  mesh, options, deferred = _parse(FLAGS.config)
  multi = "TF_CONFIG" in os.environ
  if mesh and not multi:
    devices.ensure_logical_devices(4)
  base = seeded.process_memory("VmRSS")
  if deferred:
    with tfsplit.deferred_init():
      gpt = seeded.build(keras, _preset(), seed=0)
  else:
    gpt = seeded.build(keras, _preset(), seed=0)
  state = gpt.state_bytes()
  after_build = seeded.process_memory("VmRSS")
  batches = [gpt.inputs(seed=100 + i) for i in range(FLAGS.steps)]
  share = 1.0
  phases = {}
  if mesh is None:
    losses = [float(gpt.train_step(*batches[0]))]
    phases["first_step"] = seeded.process_memory("VmHWM")
    losses += [float(gpt.train_step(*b)) for b in batches[1:]]
  else:
    step = tfsplit.split(gpt.train_step, mesh=mesh, input_signature=gpt.signature,
                         variable_names=gpt.variable_names(), release=not deferred, split_embeddings=True,
                         timeout_seconds=600.0, **options)
    held = sum(int(np.prod(s["shape"])) * 4 for e in step.runner.manifest.values()
               for s in e["shards"])
    share = held / state
    phases["split"] = seeded.process_memory("VmHWM")
    losses = [float(step(*step.local_batch(*batches[0])))]
    phases["first_step"] = seeded.process_memory("VmHWM")
    losses += [float(step(*step.local_batch(*b))) for b in batches[1:]]
  report = {"config": FLAGS.config, "task": os.environ.get("TF_CONFIG") and
            json.loads(os.environ["TF_CONFIG"])["task"]["index"],
            "base": base, "after_build": after_build, "peak": seeded.process_memory("VmHWM"),
            "state": state, "share": share, "losses": losses, "phases": phases}
  with open(FLAGS.out, "w") as f:
    json.dump(report, f)
  del tf


def _run(config, tmp):
  """[report of each process] of one configuration."""
  mesh, _, _ = _parse(config)
  workers = 2 if mesh and not mesh.startswith("tp") else 1
  out = os.path.join(tmp, config.replace("/", "_").replace(",", "_").replace("=", ""))
  cmd = [sys.executable, os.path.abspath(__file__), "--role", "process", "--config", config,
         "--preset", FLAGS.preset, "--steps", str(FLAGS.steps),
         "--untied" if FLAGS.untied else "--nountied"]
  if workers == 1:
    subprocess.run(cmd + ["--out", out + ".json"], check=True, timeout=FLAGS.timeout)
    return [json.load(open(out + ".json"))]
  from tfsplit.runtime import workers as workers_lib  # pylint: disable=import-outside-toplevel
  # Each worker writes its own file: its task index is in its TF_CONFIG.
  script = ("import json, os, subprocess, sys; t = json.loads(os.environ['TF_CONFIG'])"
            "['task']['index']; sys.exit(subprocess.call(sys.argv[1:] + ['--out', "
            f"'{out}.' + str(t) + '.json']))")
  code = workers_lib.launch_each([sys.executable, "-c", script] + cmd, workers)
  if code:
    raise SystemExit(f"{config}: a worker exited with code {code}")
  return [json.load(open(f"{out}.{t}.json")) for t in range(workers)]


def main(argv):
  del argv
  if FLAGS.role == "process":
    return _process()
  with tempfile.TemporaryDirectory() as tmp:
    rows = []
    for config in _configs(FLAGS.configs):
      rows.extend(_run(config, tmp))
      sys.stdout.flush()
  unsplit = next((r for r in rows if r["config"] == "unsplit"), None)
  gib = 1024.0 ** 3
  print(f"model state (weights + Adam moments): {rows[0]['state'] / gib:.2f} GiB, "
        f"{FLAGS.steps} steps")
  print(f"{'config':24s} {'task':>4s} {'base':>7s} {'peak':>7s} {'growth':>7s} "
        f"{'x unsplit':>9s} {'share':>6s}  losses equal  first loss")
  for r in rows:
    growth = r["peak"] - r["base"]
    ratio = growth / (unsplit["peak"] - unsplit["base"]) if unsplit else float("nan")
    same = unsplit is not None and all(abs(a - b) <= 1e-5 * max(1.0, abs(b))
                                       for a, b in zip(r["losses"], unsplit["losses"]))
    print(f"{r['config']:24s} {str(r['task'] if r['task'] is not None else '-'):>4s} "
          f"{r['base'] / gib:7.2f} {r['peak'] / gib:7.2f} {growth / gib:7.2f} "
          f"{ratio:9.2f} {r['share']:6.2f}  {str(same):12s}  {r['losses'][0]:.6f}")
    if FLAGS.phases:
      print("    peak growth by then: " + ", ".join(
          f"{k} {(v - r['base']) / gib:.2f} GiB" for k, v in r["phases"].items()))
  return 0


if __name__ == "__main__":
  app.run(main)
