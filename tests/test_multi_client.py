"""Every worker runs the same script: per-task graphs (sharding/tasks.py),
one client per task (runtime/multi_client.py), `tfsplit launch --each`.

The graph tests need no servers: each task's graph holds only its task's
nodes, its broadcasts pair with the other tasks' (same keys, same members),
its inputs are its share of the batch. The process tests start their own
workers on 127.0.0.1 (free ports), bound every wait, and kill what they
started, also on failure.
"""
import collections
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import tensor_util

from tfsplit.errors import PlanError
from tfsplit.graph import load_graph
from tfsplit.passes import split_graph
from tfsplit.runtime import cluster as cluster_lib
from tfsplit.runtime import workers
from tfsplit.sharding.tasks import task_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "gpt_raw_train_tiny.pb")
TRAIN = os.path.join(ROOT, "examples", "train_multiworker.py")


def _mesh(axes, tasks, per_task=1):
  cluster = cluster_lib.resolve({"worker": [f"127.0.0.1:{i + 1}" for i in range(tasks)]},
                                devices_per_task=per_task)
  return cluster_lib.mesh_on_cluster(axes, cluster)


def _const(nodes, text):
  return int(tensor_util.MakeNdarray(nodes[text].attr["value"].tensor))


def _broadcasts(graph_def):
  """{(group_key, instance_key): [(op, device, group_size)]} of a graph's broadcasts."""
  nodes = {n.name: n for n in graph_def.node}
  out = collections.defaultdict(list)
  for n in graph_def.node:
    if n.op == "CollectiveBcastSendV2":
      size, group, key = n.input[1:4]
    elif n.op == "CollectiveBcastRecvV2":
      size, group, key = n.input[0:3]
    else:
      continue
    out[(_const(nodes, group), _const(nodes, key))].append(
        (n.op, n.device, _const(nodes, size)))
  return out


@pytest.mark.parametrize("axes,tasks,per_task", [({"pp": 2}, 2, 1), ({"dp": 2}, 2, 1),
                                                 ({"dp": 2, "pp": 2}, 4, 1),
                                                 ({"dp": 2, "tp": 2}, 2, 2)])
def test_task_graphs_hold_their_task_and_pair_their_broadcasts(axes, tasks, per_task):
  original = load_graph(TINY)
  mesh = _mesh(axes, tasks, per_task)
  whole = split_graph(original, mesh, microbatches=2, timeout_seconds=30)
  parts = [split_graph(original, mesh, microbatches=2, timeout_seconds=30, task=k)
           for k in range(tasks)]
  members = collections.defaultdict(list)
  for k, part in enumerate(parts):
    # Only this task's devices; its graph is a fraction of the whole one.
    assert {task_of(n.device) for n in part.graph_def.node} == {k}
    assert len(part.graph_def.node) < len(whole.graph_def.node)
    assert part.task.task == k
    for key, found in _broadcasts(part.graph_def).items():
      members[key].extend(found)
    # Inputs: the share of the batch along the data axes laid over tasks.
    data_tasks = axes.get("dp", 1)
    dp = k // axes.get("pp", 1)   # tasks are laid dp-major, pp-minor
    for name, share in part.task.inputs.items():
      assert share["shape"][0] * data_tasks == share["global_shape"][0], (name, share)
      assert share["begin"][0] == dp * share["shape"][0], (name, share)
  # Every broadcast: one sender, a receiver on each other member task, all
  # with the same group size, on distinct tasks.
  for key, found in members.items():
    ops = collections.Counter(op for op, _, _ in found)
    assert ops["CollectiveBcastSendV2"] == 1 and ops["CollectiveBcastRecvV2"] >= 1, key
    assert len({size for _, _, size in found}) == 1 and found[0][2] == len(found), key
    assert len({task_of(d) for _, d, _ in found}) == len(found), key
  if "pp" in axes:
    assert members  # stage boundaries cross tasks
  else:
    assert not members  # data parallel alone: the all-reduces are all that crosses


def test_a_broken_pairing_is_seen():
  """The pairing check above fails on a task graph whose receiver is dropped."""
  original = load_graph(TINY)
  mesh = _mesh({"pp": 2}, 2)
  parts = [split_graph(original, mesh, microbatches=2, timeout_seconds=30, task=k)
           for k in range(2)]
  found = collections.defaultdict(list)
  for part in parts:
    graph_def = part.graph_def
    if part.task.task == 1:
      recv = next(n for n in graph_def.node if n.op == "CollectiveBcastRecvV2")
      graph_def.node.remove(recv)
    for key, members in _broadcasts(graph_def).items():
      found[key].extend(members)
  assert any(len(m) != m[0][2] for m in found.values())


def test_task_without_mesh_devices_is_one_line():
  original = load_graph(TINY)
  mesh = _mesh({"dp": 2}, 2)
  with pytest.raises(PlanError, match=r"task 3 holds no device of mesh"):
    split_graph(original, mesh, timeout_seconds=30, task=3)


def test_task_graph_size_does_not_grow_with_replicas_on_other_tasks():
  """dp=2 -> dp=4, a device per task: one task's graph stays the size it was,
  the whole graph grows with the replicas (tools/bench_tasks.py goes further)."""
  original = load_graph(TINY)
  sizes = {}
  for dp in (2, 4):
    mesh = _mesh({"dp": dp}, dp)
    part = split_graph(original, mesh, timeout_seconds=30, task=0)
    whole = split_graph(original, mesh, timeout_seconds=30)
    sizes[dp] = (part.graph_def.ByteSize(), whole.graph_def.ByteSize())
  assert sizes[4][0] < 1.1 * sizes[2][0], sizes
  assert sizes[4][1] > 1.7 * sizes[2][1], sizes


# --- processes -----------------------------------------------------------------------
def _env(task, spec, per_task):
  env = dict(os.environ)
  env["TF_CONFIG"] = workers.tf_config(spec, per_task, "CPU", task)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


class _Each(object):
  """N processes of the same command, each a worker task (its own TF_CONFIG),
  all killed on leaving."""

  def __init__(self, tasks, args, per_task=1, extra=None):
    spec = workers.cluster_spec(workers.free_ports(tasks))
    self.procs = [subprocess.Popen(
        [sys.executable, TRAIN, *args, *((extra or {}).get(k, ()))],
        env=_env(k, spec, per_task), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True) for k in range(tasks)]

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    for p in self.procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
      p.wait(timeout=30)

  def communicate(self, timeout):
    deadline = time.time() + timeout
    return [p.communicate(timeout=max(1.0, deadline - time.time())) for p in self.procs]


def _launch_each(tasks, mesh, per_task=1, steps=3, extra=()):
  cmd = [sys.executable, "-m", "tfsplit.cli", "launch", "--workers", str(tasks),
         "--devices-per-worker", str(per_task), "--each", "--", sys.executable, TRAIN,
         "--mesh", mesh, "--steps", str(steps), "--compare", "--timeout", "60", *extra]
  env = dict(os.environ)
  env.pop("TF_CONFIG", None)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                        check=False)


def _check_each(proc, tasks):
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  oks = re.findall(r"OK: (\d+) comparisons .* on task (\d+) within 1e-4", proc.stdout)
  assert sorted(int(t) for _, t in oks) == list(range(tasks)), proc.stdout[-3000:]
  assert all(int(n) > 3 for n, _ in oks)


def test_launch_each_dp2_trains_like_one_device():
  _check_each(_launch_each(2, "dp=2"), 2)


@pytest.mark.slow
@pytest.mark.parametrize("mesh,tasks,per_task,extra", [
    ("pp=2", 2, 1, ("--microbatches", "2")),
    ("dp=2,tp=2", 2, 2, ()),
    ("dp=2,pp=2", 4, 1, ("--microbatches", "2"))])
def test_launch_each_trains_like_one_device(mesh, tasks, per_task, extra):
  _check_each(_launch_each(tasks, mesh, per_task, extra=extra), tasks)


def test_a_worker_with_other_flags_is_refused_at_start():
  """Task 1 runs the script with another micro-batch count: both workers
  exit 2 at start with one line naming it, instead of hanging."""
  args = ["--mesh", "dp=2", "--steps", "2", "--timeout", "30"]
  with _Each(2, args, extra={1: ("--microbatches", "2")}) as each:
    t0 = time.time()
    results = each.communicate(120)
    for p, (out, err) in zip(each.procs, results):
      assert p.returncode == 2, (out, err[-3000:])
      errors = [l for l in err.splitlines() if ": error: " in l]
      assert len(errors) == 1 and "/job:worker/task:1 split another graph" in errors[0], \
          err[-3000:]
      assert "step 1" not in out
    assert time.time() - t0 < 120


@pytest.mark.slow  # 36 s; stopping on a failed worker: test_multiworker.py's launch test
def test_dead_worker_ends_the_others_and_resume_is_exact(tmp_path):
  """Kill task 1 mid-training: task 0 exits 2 within the timeout + 5 s with one
  line naming task 1. Restarted, both resume from their checkpoint parts and
  end with the shards and losses of an uninterrupted run."""
  timeout, steps = 10, 6
  base = ["--mesh", "dp=2", "--steps", str(steps), "--timeout", str(timeout)]

  def run(ckpt, output, delay=None):
    args = base + ["--checkpoint_dir", str(ckpt), "--output", str(output)]
    return _Each(2, args + (["--step_delay", str(delay)] if delay else []))

  with run(tmp_path / "ck_full", tmp_path / "full.npz") as each:
    for p, (out, err) in zip(each.procs, each.communicate(300)):
      assert p.returncode == 0, err[-3000:]
  # Each task wrote its part; merged, plain TF reads every variable whole:
  # the value the uninterrupted run ended with.
  reader = tf.train.load_checkpoint(str(tmp_path / "ck_full"))
  path = os.path.dirname(tf.train.latest_checkpoint(str(tmp_path / "ck_full")))
  with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
    saved = json.load(f)
  assert saved["step"] == steps and not [d for d in os.listdir(path) if d.startswith("task-")]
  final = np.load(tmp_path / "full.task0.npz")
  assert set(reader.get_variable_to_shape_map()) == set(saved["variables"])
  for name, entry in saved["variables"].items():
    shard = next(s for s in entry["shards"] if "task:0" in s["device"])
    assert np.array_equal(reader.get_tensor(name), final["var:" + shard["name"]]), name
  with run(tmp_path / "ck", tmp_path / "cut.npz", delay=1.0) as each:
    deadline = time.time() + 300
    for line in each.procs[0].stdout:
      if line.startswith("step 3 ") or time.time() > deadline:
        break
    os.killpg(each.procs[1].pid, signal.SIGKILL)
    t0 = time.time()
    out, err = each.procs[0].communicate(timeout=timeout + 60)
    elapsed = time.time() - t0
    assert each.procs[0].returncode == 2, (out, err[-3000:])
    errors = [l for l in err.splitlines() if ": error: " in l]
    assert len(errors) == 1 and "/job:worker/task:1" in errors[0], err[-3000:]
    assert elapsed < timeout + 5 + 1.0, elapsed   # + the step delay it was sleeping
  with run(tmp_path / "ck", tmp_path / "resumed.npz") as each:
    results = each.communicate(300)
  for k, (p, (out, err)) in enumerate(zip(each.procs, results)):
    assert p.returncode == 0, err[-3000:]
    assert any(f"resumed from step {s} " in out for s in (2, 3, 4)), out
    full = np.load(tmp_path / f"full.task{k}.npz")
    resumed = np.load(tmp_path / f"resumed.task{k}.npz")
    names = [n for n in full.files if n.startswith("var:")]
    assert names and sorted(names) == sorted(n for n in resumed.files
                                             if n.startswith("var:"))
    for n in names:
      assert np.array_equal(full[n], resumed[n]), n
    first = int(resumed["first"])
    assert np.array_equal(full["losses"][first:], resumed["losses"])


@pytest.mark.slow
def test_a_job_resumes_on_another_mesh_from_each_tasks_part(tmp_path):
  """Two workers each running the script save at dp=2 (each task its part,
  merged into one TF checkpoint); restarted at pp=2, each task reads its
  stage's slices and the losses go on as the uninterrupted dp=2 run's."""
  def run(args):
    with _Each(2, args) as each:
      results = each.communicate(300)
      for p, (out, err) in zip(each.procs, results):
        assert p.returncode == 0, err[-3000:]
      return [out for out, _ in results]

  run(["--mesh", "dp=2", "--steps", "4", "--output", str(tmp_path / "full.npz")])
  ckpt = str(tmp_path / "ck")
  run(["--mesh", "dp=2", "--steps", "2", "--checkpoint_dir", ckpt, "--save_every", "2"])
  assert tf.train.load_checkpoint(ckpt).get_variable_to_shape_map()
  outs = run(["--mesh", "pp=2", "--steps", "4", "--checkpoint_dir", ckpt, "--output",
              str(tmp_path / "resumed.npz")])
  # The pp=2 job's own checkpoints: each stage's task wrote its part.
  latest = tf.train.latest_checkpoint(ckpt)
  assert os.path.basename(os.path.dirname(latest)) == "ckpt-00000004"
  with open(os.path.join(os.path.dirname(latest), "manifest.json"), encoding="utf-8") as f:
    saved = json.load(f)
  assert {task_of(s["device"]) for e in saved["variables"].values()
          for s in e["shards"]} == {0, 1}
  assert set(tf.train.load_checkpoint(ckpt).get_variable_to_shape_map()) == \
      set(saved["variables"])
  want = np.load(tmp_path / "full.task0.npz")["losses"]
  for k, out in enumerate(outs):
    assert "resumed from step 2 " in out, out
    got = np.load(tmp_path / f"resumed.task{k}.npz")["losses"]
    np.testing.assert_allclose(got, want[2:], rtol=1e-4)


@pytest.mark.parametrize("axes,per_task,options", [
    ({"dp": 2}, 1, {}), ({"dp": 2, "tp": 2}, 2, {"microbatches": 2}),
    ({"dp": 2}, 1, {"zero": 2, "microbatches": 2}), ({"dp": 4}, 2, {}),
    ({"pp": 2}, 1, {"microbatches": 2}), ({"dp": 2, "pp": 2}, 1, {"microbatches": 2})])
def test_one_task_materialized_alone_is_the_cut_of_the_whole(axes, per_task, options,
                                                             monkeypatch):
  """Only the task's devices (and, with a pipeline axis, its pipeline peers)
  are made: the same nodes as the task's cut of the whole-mesh graph, and
  the tasks made apart agree on every collective: each (group key, instance
  key) has one member per device of its group, all of the same collective.
  (Instance keys of groups inside one task may differ from the cut's.)"""
  from tfsplit.passes import split as split_pass  # pylint: disable=import-outside-toplevel
  original = load_graph(TINY)
  tasks = int(np.prod(list(axes.values()))) // per_task
  mesh = _mesh(axes, tasks, per_task)
  alone = [split_graph(original, mesh, timeout_seconds=30, task=k, **options)
           for k in range(tasks)]
  monkeypatch.setattr(split_pass, "task_devices", lambda state: None)
  cut = [split_graph(original, mesh, timeout_seconds=30, task=k, **options)
         for k in range(tasks)]
  def collective_keys(graph_def):
    nodes = {n.name: n for n in graph_def.node}
    # (op, group size, group key, instance key): a receiver has no input tensor.
    first = {"CollectiveBcastRecvV2": 0}
    return {n.name: (n.op, *(_const(nodes, n.input[first.get(n.op, 1) + i]) for i in range(3)))
            for n in graph_def.node if n.op.startswith("Collective")}

  instances = collections.defaultdict(list)
  for a, c in zip(alone, cut):
    assert sorted(n.name for n in a.graph_def.node) == sorted(n.name for n in c.graph_def.node)
    assert a.manifest == c.manifest
    assert a.task == c.task
    devices = {n.name: n.device for n in a.graph_def.node}
    for name, (op, size, group, instance) in collective_keys(a.graph_def).items():
      if not op.startswith("CollectiveBcast"):   # paired by the test above
        instances[(group, instance)].append(
            (op, size, re.sub(r"/shard_\d+(?=/|$)", "", name), devices[name]))
  assert instances or set(axes) == {"pp"}   # a pipeline alone only broadcasts
  for key, members in instances.items():
    assert len({m[:3] for m in members}) == 1, (key, members)
    assert len({m[3] for m in members}) == len(members) == members[0][1], (key, members)


def test_rewrite_task_writes_that_task_only(tmp_path):
  spec = tmp_path / "cluster.json"
  spec.write_text('{"worker": ["127.0.0.1:1", "127.0.0.1:2"]}')
  out = tmp_path / "task1.pb"
  run = lambda *a: subprocess.run([sys.executable, "-m", "tfsplit.cli", "rewrite", TINY,
                                   "-o", str(out), "--mesh", "pp=2", *a],
                                  capture_output=True, text=True, timeout=300, check=False)
  done = run("--cluster", str(spec), "--task", "1", "--microbatches", "2")
  assert done.returncode == 0, done.stderr[-2000:]
  graph_def = load_graph(str(out))
  assert {task_of(n.device) for n in graph_def.node} == {1}
  assert any(n.op == "CollectiveBcastRecvV2" for n in graph_def.node)
  out.unlink()
  refused = run("--task", "1")
  assert refused.returncode == 2 and not out.exists()
  assert refused.stderr.strip().splitlines()[-1].endswith("--task needs --cluster: a task "
                                                          "is one of the cluster's workers")
