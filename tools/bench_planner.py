"""Benchmark: how fast the planner plans, and how its plans compare with the
common hand rule.

1. Planning time of a 96-block GPT (GPT-3 175B sizes: hidden 12288, 96
   heads, sequence 2048, global batch 1536) for 64 and 1024 H100-80GB
   devices, and of a 128-block one (the 1T GPT of Narayanan et al. 2021:
   hidden 25600, 160 heads, global batch 3072) for 3072 (targets: under
   2 s, 10 s and 5 s; plans fit the device memory less the default 10%
   reserve), best of --repeats. The
   model is the layer table of tfsplit.plan.profile.synthetic_gpt: the
   search never looks below layers, so it is the search's time.
   --graph-blocks B also traces a B-block GPT training graph of the example
   zoo (raw TF, hidden 64), and times profiling it (layer detection, shapes,
   per-layer costs) and the search.
2. On model x cluster cases, the planner's predicted step time against the
   hand rule's under the same cost model (tensor parallel within a host,
   pipeline across hosts with the fewest stages that fit, 1f1b, even cut,
   at least 4 micro-batches per stage, data parallel for the rest,
   recomputation only when nothing fits without it): hand / planner > 1
   means the planner's plan is faster.

3. With --measure MODELS (e.g. gpt_raw:small,mlp_raw:small): on --devices
   logical CPUs of this process, the planner's best --top plans for each
   example model (and plain data parallelism), each run with tfsplit.split
   and timed, against their predicted step time: after a warm-up, --rounds
   rounds in which every model's plans take turns (--steps timed steps
   each, after --settle unmeasured ones: a small step timed right after a
   large one pays for the switch), and the fastest round. Costs come from a
   calibration table of the micro-benchmarks alone (`tfsplit calibrate`
   without the graph: chains of ops, small synthetic training steps (the
   transformer-shaped ones also in micro-batches, and copies of them in
   lockstep on the logical CPUs), collectives and transfers between
   logical CPUs; calibrating from the
   graph being predicted would flatter the prediction); the cluster is the
   cpu-host preset with every device in one host. The table's small
   training steps take turns too, after each model's plans: the median
   over them of each one's time now (its fastest round beside that
   model's plans) over its time in the table is the machine's level
   against when it was calibrated (other work on a shared machine moves
   it by a tenth or more between minutes, and one step's time by up to a
   fifth on its own), printed, and the "x level" column is the
   prediction at the level beside its model over the measurement. With
   --processes K, all of that runs in K fresh processes one after the
   other (each calibrating its own table unless --calibration names one)
   and each plan's median ratio counts: a step's time moves by up to a
   tenth between processes.

    python tools/bench_planner.py [--repeats 3] [--graph-blocks 96]
    python tools/bench_planner.py --measure gpt_raw:small,mlp_raw:small \
        --meshes "dp=2;tp=2;dp=2,tp=2;pp=2 m=1;pp=2 m=2;pp=2 m=4" [--processes 3]

   A spec 'name:size/d' is the model with its batch divided by d: with
   --meshes "dp=1", 'gpt_raw:small/2' times unsplit the half batch each
   replica of a dp=2 split runs, beside the split, and prices it the same
   way (is a split mispriced, or its share of the batch?).

   --meshes adds fixed candidates to the planner's best (each with the
   planner's cut); --calibration FILE reuses (or writes) the table, so that
   several runs share one calibration.
"""
import dataclasses
import os
import statistics
import sys
import time

from absl import app
from absl import flags

import benchlib  # sys.path: repo root (pylint: disable=unused-import)
from tfsplit.cost import cluster as cluster_lib
from tfsplit.plan import profile as profile_lib
from tfsplit.plan.search import DEFAULT_RESERVE, Planner
from tfsplit.report import format_table
from tfsplit.units import format_bytes

FLAGS = flags.FLAGS
flags.DEFINE_integer("repeats", 3, "Best of this many searches.")
flags.DEFINE_integer("graph-blocks", 0, "Also plan a traced GPT graph of this many "
                     "blocks (0: skip).")
flags.DEFINE_list("measure", [], "Example models (name:size, or name:size/d: its batch "
                  "divided by d) to plan on logical CPUs and time against the prediction.")
flags.DEFINE_integer("devices", 4, "With --measure: logical CPU devices.")
flags.DEFINE_integer("top", 3, "With --measure: plans timed per model.")
flags.DEFINE_integer("steps", 10, "With --measure: steps per round.")
flags.DEFINE_integer("rounds", 5, "With --measure: rounds (as many as calibration times its "
                     "steps in: the level compares fastest rounds).")
flags.DEFINE_integer("settle", 2, "With --measure: unmeasured steps at the start of "
                     "each plan's turn in a round.")
flags.DEFINE_string("meshes", "", "With --measure: also time these candidates, "
                    "';'-separated 'MESH [m=K]' (e.g. 'dp=2;tp=2;dp=2,tp=2;pp=2 m=2'), "
                    "each with the planner's cut.")
flags.DEFINE_bool("measure_only", False, "With --measure: skip the planning-time and "
                  "hand-rule parts, and print the rows as a result line (tests read it).")
flags.DEFINE_string("calibration", "", "With --measure: the cost table to use (written "
                    "by the micro-benchmark when missing); default: measure one now.")
flags.DEFINE_integer("processes", 1, "With --measure: measure in this many fresh "
                     "processes, one after the other, and take each plan's median "
                     "ratio (a step's time moves by a tenth between processes).",
                     lower_bound=1)

LEVEL = "level"   # the calibration's small training steps among the timed steps

# (model, sizes for synthetic_gpt)
MODELS = {
    "GPT 1.3B": dict(blocks=24, hidden=2048, heads=16, seq_len=2048, batch=256),
    "GPT 6.7B": dict(blocks=32, hidden=4096, heads=32, seq_len=2048, batch=512),
    "GPT 13B": dict(blocks=40, hidden=5120, heads=40, seq_len=2048, batch=512),
    "GPT 30B": dict(blocks=48, hidden=7168, heads=56, seq_len=2048, batch=1024),
    "GPT 175B": dict(blocks=96, hidden=12288, heads=96, seq_len=2048, batch=1536),
    "GPT 1T": dict(blocks=128, hidden=25600, heads=160, seq_len=2048, batch=3072),
}
# (model, preset, devices)
CASES = [("GPT 1.3B", "a100-80gb", 8), ("GPT 6.7B", "v100-16gb", 16),
         ("GPT 13B", "a100-40gb", 32), ("GPT 30B", "h200-141gb", 128),
         ("GPT 175B", "h100-80gb", 64), ("GPT 175B", "a100-80gb", 512),
         ("GPT 175B", "h100-80gb", 1024)]


def model_on(name, preset):
  """The synthetic profile of `name` at the float16 peak of `preset`'s device."""
  device = cluster_lib.from_preset(preset, 1).device(0)
  return profile_lib.synthetic_gpt(**MODELS[name], peak_flops=device.flops("float16"),
                                   memory_bandwidth=device.memory_bandwidth)


def plan(profile, preset, devices):
  cluster = cluster_lib.from_preset(preset, devices)
  planner = Planner(profile, cluster, devices, cluster.device(0).memory_bytes,
                    reserve=DEFAULT_RESERVE)
  return planner, planner.search()


# (model, devices, target seconds) of the planning-time part
TIMING = [("GPT 175B", 64, 2.0), ("GPT 175B", 1024, 10.0), ("GPT 1T", 3072, 5.0)]


def timing():
  print("planning time, h100-80gb, 80 GB cap "
        f"({100 * DEFAULT_RESERVE:g}% kept in reserve):")
  for name, devices, target in TIMING:
    profile = model_on(name, "h100-80gb")
    best = None
    for _ in range(FLAGS.repeats):
      t0 = time.perf_counter()
      _, result = plan(profile, "h100-80gb", devices)
      dt = time.perf_counter() - t0
      best = dt if best is None else min(best, dt)
    b = result.best
    print(f"  {name} ({MODELS[name]['blocks']} blocks), {devices:5d} devices: {best:.2f} s "
          f"(target < {target:g} s), "
          f"{result.evaluated} candidates priced; best {b.label()}: step "
          f"{b.step_time:.3g} s, {format_bytes(b.memory)}/device, bubble "
          f"{100 * b.bubble:.1f}%")


def traced_graph(blocks):
  """Plans a traced `blocks`-block GPT training graph of the example zoo."""
  import models  # pylint: disable=import-outside-toplevel
  from models import example, raw  # pylint: disable=import-outside-toplevel
  from tfsplit import plan as plan_lib  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  del models
  cfg = dataclasses.replace(example.config_for("gpt", "small"), blocks=blocks)
  t0 = time.perf_counter()
  ex = raw.build("gpt", "gpt_raw", "small", cfg, 0)
  graph_def = load_graph(ex.train_step.get_concrete_function(*ex.train_signature))
  t1 = time.perf_counter()
  for devices in (64, 1024):
    t2 = time.perf_counter()
    profile = plan_lib.profile_graph(graph_def, devices, "h100-80gb")
    t3 = time.perf_counter()
    _, result = plan_lib.plan_profile(profile, devices, None, "h100-80gb")
    t4 = time.perf_counter()
    print(f"  traced {blocks}-block GPT ({len(graph_def.node)} nodes, traced in "
          f"{t1 - t0:.1f} s) on {devices} devices: profile {t3 - t2:.2f} s, search "
          f"{t4 - t3:.2f} s; best {result.best.label()}")


def versus_hand_rule():
  print("\nplanner vs hand rule (same cost model; cap: the device's memory, "
        f"{100 * DEFAULT_RESERVE:g}% kept in reserve):")
  rows = []
  for name, preset, devices in CASES:
    profile = model_on(name, preset)
    planner, result = plan(profile, preset, devices)
    hand = planner.hand_rule()
    best = result.best
    ratio = (f"{hand.step_time / best.step_time:.2f}" if hand and best else
             "hand: no fit" if best else "no fit")
    rows.append([name, f"{devices} x {preset}",
                 best.label() if best else "-",
                 f"{best.step_time:.3g}" if best else "-",
                 hand.label() if hand else "-",
                 f"{hand.step_time:.3g}" if hand else "-", ratio,
                 f"{result.seconds:.2f}"])
  print(format_table(["model", "cluster", "planner", "step s", "hand rule", "step s",
                      "hand/planner", "plan s"], rows, "<<<><>>>", indent="  "))


def measured(specs):
  """Predicted against measured step time of the planner's plans on logical CPUs."""
  devices = FLAGS.devices
  benchlib.logical_devices("CPU", devices)  # before TensorFlow's runtime starts
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import tfsplit  # pylint: disable=import-outside-toplevel
  from tfsplit.calibration import measure  # pylint: disable=import-outside-toplevel
  from tfsplit.calibration.run import calibrate  # pylint: disable=import-outside-toplevel
  from tfsplit.cost import fitting, op_cost  # pylint: disable=import-outside-toplevel
  from tfsplit.plan import Plan, space  # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  path = FLAGS.calibration
  if path and os.path.exists(path):
    table = op_cost.CostTable.load(path)
  else:
    table = calibrate()
    if path:
      table.save(path)
  spec = cluster_lib.from_preset("cpu-host", devices, devices_per_host=devices)
  print(f"\npredicted vs measured on {devices} logical CPUs (micro-benchmark calibration "
        f"in {time.perf_counter() - t0:.0f} s; per op {table.op_overhead * 1e6:.2f} us "
        f"(overlapping x{table.gap_concurrency.get(2, 0):.2f}, their work "
        f"x{table.kernel_concurrency.get(2, 0):.2f} on 2 devices), each further argument "
        f"{table.argument_overhead * 1e6:.1f} us, "
        f"ops in a step x{table.graph_scale:.2f}, concurrency {table.concurrency or 0:.2f} "
        f"(4 devices: {table.concurrency_for(4) or 0:.2f}), collective "
        f"{table.collective_overhead * 1e6:.0f} us (4 devices: "
        f"{table.collective_for(4) * 1e6:.0f} us; each further group's at once "
        f"x{table.collective_overlap:.2f}), transfer "
        f"{table.transfer_overhead * 1e6:.1f} us):")
  steps, priced = {}, []   # every model's plans, timed together
  # The machine's level now against the table's: the calibration's small
  # training steps take turns with the plans.
  level_steps = measure.level_steps() if table.machine.get("training_steps") else {}
  for text in specs:
    ex, graph_def, names = benchlib.example_model(text)
    profile = profile_lib.from_graph(graph_def, op_cost.CostModel(spec, table=table))
    planner = Planner(profile, spec, devices)
    result = planner.search(top=max(1, FLAGS.top))
    chosen = list(result.ranked[:FLAGS.top])
    if profile.batch % devices == 0 and not any(
        e.candidate == space.Candidate(devices, 1, 1) for e in chosen):
      chosen.append(planner.costing.evaluate(space.Candidate(devices, 1, 1),
                                             [(0, planner.costing.n)]))
    # A mesh whose replicas x micro-batches do not divide the model's batch
    # (a spec's divided batch) is skipped for that model.
    fixed = [planner.price(c) for c in benchlib.mesh_candidates(FLAGS.meshes)
             if profile.batch % (c.dp * c.microbatches) == 0]
    chosen += [e for e in fixed if e is not None and
               all(e.candidate != x.candidate for x in chosen)]
    inputs = [tf.constant(x) for x in ex.make_inputs("train", seed=0)]
    ranked = min(FLAGS.top, len(result.ranked))
    for rank, est in enumerate(chosen):
      plan = Plan.from_estimate(est, profile)
      steps[(text, est.label())] = (tfsplit.split(
          ex.train_step, plan=plan, input_signature=ex.train_signature,
          variable_names=names), inputs)
      priced.append((text, str(rank + 1) if rank < ranked else "-", est))
    for k, step in level_steps.items():   # after each model's plans: many moments of a round
      steps[(LEVEL, k, text)] = step
  # All models' plans take turns in each round, so the rounds of one plan
  # spread over the whole run and a burst of other work on the machine
  # spoils one of its rounds rather than all of a model's; the fastest
  # round counts, as in calibration (other work only slows a round: one
  # run's rounds of the MLPs' plans spread by 2x, their median rounds 0.6
  # to 0.8 of the predictions, the fastest 0.66-1.27).
  before = benchlib.cpu_times()
  _, round_medians = benchlib.take_turns(steps, warmup=3, rounds=FLAGS.rounds,
                                         steps=FLAGS.steps, settle=FLAGS.settle)
  steal = benchlib.steal_share(before, benchlib.cpu_times())
  # A model's plans are judged at the level read right after them in each
  # round: the fastest of as many rounds as the plans' own, and as the
  # table's times of the steps (calibrate's five; the fastest of every
  # model's rounds would be the least of six times as many, lower by that
  # alone).
  level_now = {text: {k: min(round_medians[(LEVEL, k, text)]) for k in level_steps}
               for text in specs}
  levels = {text: fitting.machine_level(table, now) or 1.0
            for text, now in level_now.items()}
  rows, results = [], []
  for text, rank, est in priced:
    label, level = est.label(), levels[text]
    got = min(round_medians[(text, label)])
    results.append({"model": text, "plan": label, "mesh": est.candidate.mesh,
                    "microbatches": est.candidate.microbatches,
                    "candidate": dataclasses.asdict(est.candidate),   # to re-price it
                    "predicted": est.step_time, "measured": got, "level": level,
                    "steal": steal,
                    "ratio": est.step_time * level / got,
                    "round_medians": round_medians[(text, label)],
                    "level_rounds": {k: round_medians[(LEVEL, k, text)] for k in level_steps}})
    rows.append([text, rank, label, f"{est.step_time * 1e3:.3g}", f"{got * 1e3:.3g}",
                 f"{est.step_time / got:.2f}", f"{est.step_time * level / got:.2f}"])
  if not level_steps:
    print("  machine level: unknown (the table keeps no training steps' times), taken as 1")
  for text in specs if level_steps else ():
    print(f"  machine level beside {text}'s plans: the calibration's training steps take "
          f"{levels[text]:.2f} x their times in the table (the median of " + ", ".join(
              f"{r:.2f}" for r in fitting.level_ratios(table, level_now[text]).values()) + ")")
  if steal is not None:
    print(f"  CPU time the host gave other guests while the steps ran (steal): {steal:.0%}")
  print(format_table(["model", "rank", "plan", "predicted ms", "measured ms",
                      "predicted/measured", "x level"], rows, "<<<>>>>", indent="  "))
  if FLAGS.measure_only:
    benchlib.print_result(results)


def measured_in_processes(specs):
  """measured() in --processes fresh processes, one after the other. Each
  has its own runtime, allocators and threads, and its own luck: the same
  step's median moved by up to a tenth between processes on a shared 2-core
  machine, one step faster in one process and another in the next. Without
  --calibration each process also calibrates its own table, so the
  calibration's own noise is sampled too. A plan's row is its median ratio
  (predicted at the process's level over measured) over the processes."""
  args = ["--measure", ",".join(specs), "--devices", str(FLAGS.devices),
          "--top", str(FLAGS.top), "--steps", str(FLAGS.steps),
          "--rounds", str(FLAGS.rounds), "--settle", str(FLAGS.settle),
          "--meshes", FLAGS.meshes, "--measure_only", "--processes", "1"]
  if FLAGS.calibration:   # the first process writes it when missing
    args += ["--calibration", FLAGS.calibration]
  by_cell, steals = {}, []
  for k in range(FLAGS.processes):
    print(f"\nprocess {k + 1}/{FLAGS.processes}:", flush=True)
    process_rows = benchlib.run_script(__file__, args, timeout=1800)
    for r in process_rows:
      by_cell.setdefault((r["model"], r["plan"]), []).append(r)
    steals.append(process_rows[0].get("steal") if process_rows else None)
  rows, results = [], []
  for (model, label), runs in by_cell.items():
    row = {key: runs[0][key] for key in ("model", "plan", "mesh", "microbatches")}
    row.update({key: statistics.median(r[key] for r in runs)
                for key in ("predicted", "measured", "level", "ratio")})
    row["ratios"] = [r["ratio"] for r in runs]
    results.append(row)
    rows.append([model, label, f"{row['predicted'] * 1e3:.3g}", f"{row['measured'] * 1e3:.3g}",
                 " ".join(f"{x:.2f}" for x in row["ratios"]), f"{row['ratio']:.2f}"])
  print(f"\nmedian over {FLAGS.processes} processes (x level: predicted at each "
        "process's level over measured; steal per process: " +
        ", ".join("?" if x is None else f"{x:.0%}" for x in steals) + "):")
  print(format_table(["model", "plan", "predicted ms", "measured ms", "x level per process",
                      "median"], rows, "<<>>>>", indent="  "))
  if FLAGS.measure_only:
    benchlib.print_result(results)


def main(argv):
  del argv
  if FLAGS.measure:  # first: logical devices must be set before TF starts
    from tfsplit.errors import TfsplitError  # pylint: disable=import-outside-toplevel
    try:   # a spec that names no model or size, or a batch that does not divide
      (measured_in_processes if FLAGS.processes > 1 else measured)(FLAGS.measure)
    except TfsplitError as e:
      print(f"bench_planner: {e}", file=sys.stderr)
      return 2
    if FLAGS.measure_only:
      return
  timing()
  if FLAGS["graph-blocks"].value:
    traced_graph(FLAGS["graph-blocks"].value)
  versus_hand_rule()


if __name__ == "__main__":
  app.run(main)
