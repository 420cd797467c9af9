"""Multi-worker runs on TF's gRPC runtime: cluster -> mesh, `tfsplit launch`,
`tfsplit worker`, training across worker processes, dead workers, checkpoints.

Every test starts its own servers on 127.0.0.1 (free ports), bounds every
wait, and checks that nothing it started is left running: each launch gets a
unique marker in its environment, which its workers and command inherit, and
/proc is searched for it afterwards.
"""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from tfsplit.errors import ClusterSpecError
from tfsplit.runtime import checkpoint
from tfsplit.runtime import cluster as cluster_lib
from tfsplit.runtime import workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "gpt_raw_train_tiny.pb")
TRAIN = os.path.join(ROOT, "examples", "train_multiworker.py")
MARK = "TFSPLIT_TEST_MARK"


def _marked(mark):
  """pids of processes whose environment holds MARK=mark."""
  needle = f"{MARK}={mark}".encode()
  found = []
  for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
      continue
    try:
      with open(f"/proc/{pid}/environ", "rb") as f:
        if needle in f.read().split(b"\0"):
          with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().split(b") ", 1)[1][:1] != b"Z":
              found.append(int(pid))
    except OSError:
      pass
  return found


def _env(mark, **extra):
  env = dict(os.environ)
  env.pop("TF_CONFIG", None)
  env.update(extra)
  env[MARK] = mark
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _tfsplit(*args):
  return [sys.executable, "-m", "tfsplit.cli", *args]


def _wait_gone(mark, timeout=15.0):
  deadline = time.time() + timeout
  while _marked(mark) and time.time() < deadline:
    time.sleep(0.1)
  return _marked(mark)


@contextlib.contextmanager
def _workers(tmp_path, mark, devices_per_task=None):
  """(group, spec) of 2 fresh worker tasks on free 127.0.0.1 ports, marked
  `mark` (so _wait_gone finds any leftover), stopped on leaving, also on
  failure."""
  args = (2,) if devices_per_task is None else (2, devices_per_task)
  group, spec = workers.start_workers(*args, timeout=120, logdir=str(tmp_path),
                                      extra_env={MARK: mark})
  try:
    yield group, spec
  finally:
    group.stop()


def _kill_marked(mark):
  for pid in _marked(mark):
    try:
      os.kill(pid, signal.SIGKILL)
    except OSError:
      pass


# ------------------------------------------------------------- cluster -> mesh

def test_mesh_on_cluster_puts_tp_within_and_dp_pp_across_tasks():
  two_by_two = cluster_lib.Cluster({"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                   devices_per_task=2)
  mesh = cluster_lib.mesh_on_cluster({"dp": 2, "tp": 2}, two_by_two)
  short = [d.replace("/job:worker/replica:0/", "") for d in mesh.devices]
  assert short == ["task:0/device:CPU:0", "task:0/device:CPU:1",
                   "task:1/device:CPU:0", "task:1/device:CPU:1"]
  # tp first in the mesh: still tp within a task, pp across.
  mesh = cluster_lib.mesh_on_cluster({"tp": 2, "pp": 2}, two_by_two)
  assert [mesh.devices[mesh.device_id({"tp": t, "pp": 1})] for t in range(2)] == [
      "/job:worker/replica:0/task:1/device:CPU:0",
      "/job:worker/replica:0/task:1/device:CPU:1"]
  # Told otherwise: dp within a task.
  mesh = cluster_lib.mesh_on_cluster({"dp": 2}, two_by_two, across=())
  assert {d.split("/task:")[1][0] for d in mesh.devices} == {"0"}
  # Tasks of one device: tp=2 must cross tasks.
  one = cluster_lib.Cluster({"worker": ["127.0.0.1:1", "127.0.0.1:2"]})
  mesh = cluster_lib.mesh_on_cluster({"tp": 2}, one)
  assert mesh.devices == ["/job:worker/replica:0/task:0/device:CPU:0",
                          "/job:worker/replica:0/task:1/device:CPU:0"]
  with pytest.raises(ClusterSpecError, match="needs 8 devices but the cluster has 4"):
    cluster_lib.mesh_on_cluster({"dp": 2, "tp": 4}, two_by_two)


def test_resolve_reads_tf_config_files_and_resolvers(tmp_path, monkeypatch):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  monkeypatch.delenv("TF_CONFIG", raising=False)
  assert cluster_lib.resolve() is None
  with pytest.raises(ClusterSpecError, match="TF_CONFIG names no cluster"):
    cluster_lib.resolve("TF_CONFIG")
  monkeypatch.setenv("TF_CONFIG", workers.tf_config(
      {"worker": ["127.0.0.1:5", "127.0.0.1:6"]}, 2, "CPU", 1))
  found = cluster_lib.resolve()
  assert (found.addresses, found.devices_per_task, found.task_type, found.task_index) == (
      ["127.0.0.1:5", "127.0.0.1:6"], 2, "worker", 1)
  spec = tmp_path / "spec.json"
  spec.write_text(json.dumps({"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}))
  assert cluster_lib.resolve(str(spec)).num_tasks == 2
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec({"worker": ["a:1", "b:1", "c:1"]}))
  assert cluster_lib.resolve(resolver, devices_per_task=4).devices_per_task == 4
  spec.write_text("{not json")
  with pytest.raises(ClusterSpecError, match="not JSON"):
    cluster_lib.resolve(str(spec))


def test_rewrite_cluster_flag_places_graph_on_worker_tasks(tmp_path):
  from tfsplit.commands import common, rewrite_cmd  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  spec = tmp_path / "spec.json"
  spec.write_text(json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                              "tfsplit": {"devices_per_task": 2}}))
  out = str(tmp_path / "out.pb")
  assert common.main("rewrite", rewrite_cmd, [TINY, "-o", out, "--mesh", "dp=2,tp=2",
                                              "--cluster", str(spec)]) == 0
  devices = {n.device for n in load_graph(out).node if n.device}
  assert devices == {f"/job:worker/replica:0/task:{t}/device:CPU:{d}"
                     for t in range(2) for d in range(2)}


# ------------------------------------------------------------- launch

def test_launch_forwards_exit_code_and_leaves_nothing_running(tmp_path):
  mark = uuid.uuid4().hex
  seen = tmp_path / "tf_config.json"
  script = ("import json, os, socket, sys\n"
            "c = json.loads(os.environ['TF_CONFIG'])\n"
            f"open({str(seen)!r}, 'w').write(json.dumps(c))\n"
            "for a in c['cluster']['worker']:\n"
            "  h, p = a.split(':'); socket.create_connection((h, int(p)), 5).close()\n"
            "sys.exit(3)\n")
  try:
    proc = subprocess.run(_tfsplit("launch", "--workers", "2", "--devices-per-worker", "2",
                                   "--logdir", str(tmp_path), "--", sys.executable, "-c",
                                   script),
                          env=_env(mark), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    config = json.loads(seen.read_text())
    addresses = config["cluster"]["worker"]
    assert len(addresses) == 2 and all(a.startswith("127.0.0.1:") for a in addresses)
    assert config["tfsplit"]["devices_per_task"] == 2 and "task" not in config
    assert _wait_gone(mark, 5.0) == []
    assert not any(workers.reachable(a, 0.5) for a in addresses)
  finally:
    _kill_marked(mark)


def test_launch_stops_everything_when_interrupted_or_failing(tmp_path):
  mark = uuid.uuid4().hex
  started = tmp_path / "started"
  script = (f"import os, time\nopen({str(started)!r}, 'w').write(os.environ['TF_CONFIG'])\n"
            "time.sleep(300)\n")
  try:
    proc = subprocess.Popen(_tfsplit("launch", "--workers", "2", "--logdir", str(tmp_path),
                                      "--", sys.executable, "-c", script),
                            env=_env(mark), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not started.exists() and time.time() < deadline and proc.poll() is None:
      time.sleep(0.1)
    assert started.exists(), proc.communicate(timeout=30)
    addresses = json.loads(started.read_text())["cluster"]["worker"]
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert time.time() - t0 < 15
    assert _wait_gone(mark, 5.0) == []
    assert not any(workers.reachable(a, 0.5) for a in addresses)
    # A command that cannot start: one line, exit 2, no worker left.
    proc = subprocess.run(_tfsplit("launch", "--workers", "1", "--logdir", str(tmp_path),
                                   "--", str(tmp_path / "no_such_command")),
                          env=_env(mark), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [l for l in proc.stderr.splitlines() if "error" in l]
    assert len(errors) == 1 and "no_such_command" in errors[0], proc.stderr
    assert _wait_gone(mark, 5.0) == []
  finally:
    _kill_marked(mark)


# ------------------------------------------------------------- running on workers

def test_dp2_across_two_worker_processes_matches_one_device(tmp_path):
  """dp=2 over 2 worker processes (one client, cross-task all-reduce) against
  the original on this process: 3 steps, every output, shard and update."""
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import split_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import verify  # pylint: disable=import-outside-toplevel
  mark = uuid.uuid4().hex
  with _workers(tmp_path, mark, devices_per_task=1) as (_, spec):
    cluster = cluster_lib.resolve(spec)
    original = load_graph(TINY)
    result = split_graph(original, cluster_lib.mesh_on_cluster({"dp": 2}, cluster),
                         timeout_seconds=30)
    report = verify.verify(original, result.graph_def, json.loads(
        result.manifest_json(source=TINY)), steps=3, cluster=cluster, timeout_seconds=60)
    report.assert_ok("dp=2 on 2 workers")
  assert _wait_gone(mark, 5.0) == []


def test_cluster_graph_without_cluster_is_one_line(tmp_path, monkeypatch):
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import split_graph  # pylint: disable=import-outside-toplevel
  monkeypatch.delenv("TF_CONFIG", raising=False)
  cluster = cluster_lib.Cluster({"worker": ["127.0.0.1:1", "127.0.0.1:2"]})
  result = split_graph(load_graph(TINY), cluster_lib.mesh_on_cluster({"pp": 2}, cluster))
  with pytest.raises(ClusterSpecError, match="no cluster is given.*tfsplit launch"):
    cluster_lib.cluster_for_graph(result.graph_def)
  port = workers.free_ports(1)[0]
  down = cluster_lib.Cluster({"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{port}"]})
  with pytest.raises(cluster_lib.ClusterError, match=r"cannot reach worker /job:worker/task:0"):
    cluster_lib.ClusterRunner(result.graph_def, {}, down, timeout_seconds=1)


# ------------------------------------------------------------- checkpoints

def test_checkpoint_converts_between_meshes_and_refuses_other_variables(tmp_path):
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import split_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import seeds, shards  # pylint: disable=import-outside-toplevel
  from tfsplit.layout.mesh import Mesh  # pylint: disable=import-outside-toplevel
  from tfsplit.errors import TfsplitError  # pylint: disable=import-outside-toplevel
  original = load_graph(TINY)
  tp = split_graph(original, Mesh({"tp": 2})).manifest
  dp = split_graph(original, Mesh({"dp": 2})).manifest
  full = seeds.seeded_manifest_values(tp, 3)
  full = shards.full_values(tp, full)
  path = checkpoint.save(str(tmp_path / "ck"), tp, shards.shard_values(tp, full), step=7)
  assert checkpoint.latest(str(tmp_path / "ck")) == path
  assert sorted(os.listdir(path))[0] == "manifest.json"
  meta, saved = checkpoint.load(str(tmp_path / "ck"))
  assert meta["step"] == 7
  same = checkpoint.convert(meta, saved, tp)
  assert all(np.array_equal(same[k], v) for k, v in shards.shard_values(tp, full).items())
  other = checkpoint.convert(meta, saved, dp)
  back = shards.full_values(dp, other)
  assert all(np.array_equal(back[k], full[k]) for k in full)
  fewer = {k: v for k, v in dp.items() if k != sorted(dp)[0]}
  with pytest.raises(TfsplitError, match="other variables than the step"):
    checkpoint.convert(meta, saved, fewer)
  # A half-written checkpoint is never the latest.
  os.makedirs(tmp_path / "ck" / ".ckpt-00000008.tmp")
  assert checkpoint.latest(str(tmp_path / "ck")) == path


# ------------------------------------------------------------- slow: the done criteria

@pytest.mark.slow
@pytest.mark.parametrize("mesh,per_worker", [("dp=2", 1), ("tp=2", 1), ("pp=2", 1),
                                             ("dp=2,tp=2", 2)])
def test_launch_training_and_verify_across_two_workers(tmp_path, mesh, per_worker):
  """`tfsplit launch --workers 2`: the example trains 3 steps across the 2
  worker processes (loss and every parameter within 1e-4 of one device), and
  `tfsplit rewrite --cluster TF_CONFIG` + `tfsplit verify` agree (dp=2,tp=2:
  tp within each worker's 2 devices, dp across the workers)."""
  mark = uuid.uuid4().hex
  out = tmp_path / "out.pb"
  chief = (f"{sys.executable} {TRAIN} --mesh {mesh} --steps 3 --compare --timeout 60 && "
           f"{sys.executable} -m tfsplit.cli rewrite {TINY} -o {out} --mesh {mesh} "
           "--cluster TF_CONFIG --collective-timeout 60 && "
           f"{sys.executable} -m tfsplit.cli verify {TINY} {out} --steps 3 --timeout 60")
  if mesh == "pp=2":
    chief += (f" && {sys.executable} -m tfsplit.cli trace {out} -o {tmp_path / 'trace.json'}"
              " --timeout 60")
  try:
    proc = subprocess.run(_tfsplit("launch", "--workers", "2", "--devices-per-worker",
                                   str(per_worker), "--logdir", str(tmp_path),
                                   "--", "sh", "-c", chief),
                          env=_env(mark), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "within 1e-4 of the one-device run" in proc.stdout
    assert "\nOK: " in proc.stdout and "task:1/" in proc.stdout
    if mesh == "pp=2":
      trace = json.loads((tmp_path / "trace.json").read_text())
      assert {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"} == {
          f"/job:worker/replica:0/task:{t}/device:CPU:0" for t in range(2)}
    assert _wait_gone(mark, 5.0) == []
  finally:
    _kill_marked(mark)


@pytest.mark.slow
def test_dead_worker_is_one_line_and_resume_is_exact(tmp_path):
  """Kill worker 1 during training: the chief exits 2 within the timeout with
  one line naming task 1. Fresh workers then resume from the last checkpoint
  and end with exactly the parameters of an uninterrupted run."""
  mark = uuid.uuid4().hex
  timeout = 10
  steps = 6

  def chief(env, ckpt, output, delay=0.0):
    return subprocess.Popen(
        [sys.executable, TRAIN, "--mesh", "dp=2", "--steps", str(steps), "--timeout",
         str(timeout), "--checkpoint_dir", str(ckpt), "--output", str(output),
         "--step_delay", str(delay)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

  def cluster_env(spec):
    return _env(mark, TF_CONFIG=workers.tf_config(spec))

  try:
    # The uninterrupted run.
    with _workers(tmp_path, mark) as (_, spec):
      proc = chief(cluster_env(spec), tmp_path / "ck_full", tmp_path / "full.npz")
      _, err = proc.communicate(timeout=300)
      assert proc.returncode == 0, err[-3000:]
    # The interrupted run: worker 1 killed after step 3's checkpoint.
    with _workers(tmp_path, mark) as (group, spec):
      proc = chief(cluster_env(spec), tmp_path / "ck", tmp_path / "cut.npz", delay=1.0)
      deadline = time.time() + 300
      for line in proc.stdout:
        if line.startswith("step 3 ") or time.time() > deadline:
          break
      os.kill(group.procs[1].pid, signal.SIGKILL)
      t0 = time.time()
      out, err = proc.communicate(timeout=timeout + 30)
      elapsed = time.time() - t0
      assert proc.returncode == 2, (line, out, err[-3000:])
      errors = [l for l in err.splitlines() if ": error: " in l]
      assert len(errors) == 1 and "/job:worker/task:1" in errors[0], err[-3000:]
      assert elapsed < timeout + 5, elapsed
    # Resume on fresh workers (new ports) from the last checkpoint.
    with _workers(tmp_path, mark) as (_, spec):
      proc = chief(cluster_env(spec), tmp_path / "ck", tmp_path / "resumed.npz")
      out, err = proc.communicate(timeout=300)
      assert proc.returncode == 0, err[-3000:]
      assert "on 2 task(s) of job 'worker'" in out, out
      # The last complete checkpoint: 3, or 2 if the kill hit the saving of 3.
      assert any(f"resumed from step {k} " in out for k in (2, 3, 4)), out
    full, resumed = np.load(tmp_path / "full.npz"), np.load(tmp_path / "resumed.npz")
    names = [k for k in full.files if k.startswith("var:")]
    assert names and sorted(names) == sorted(k for k in resumed.files if k.startswith("var:"))
    for k in names:
      assert np.array_equal(full[k], resumed[k]), k
    first = int(resumed["first"])
    assert np.array_equal(full["losses"][first:], resumed["losses"])
    assert _wait_gone(mark, 5.0) == []
  finally:
    _kill_marked(mark)


@pytest.mark.slow
def test_hung_worker_is_named_after_the_step_timeout(tmp_path):
  """A stopped (not dead) worker keeps its port open: the step ends at its
  timeout and the error names the task that does not answer."""
  from tfsplit.graph import Graph, load_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import split_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import seeds, session  # pylint: disable=import-outside-toplevel
  mark = uuid.uuid4().hex
  timeout = 8
  with _workers(tmp_path, mark) as (group, spec):
    cluster = cluster_lib.resolve(spec)
    original = load_graph(TINY)
    result = split_graph(original, cluster_lib.mesh_on_cluster({"dp": 2}, cluster),
                         timeout_seconds=timeout)
    runner = cluster_lib.ClusterRunner(result.graph_def, session.seeded_values(
        result.graph_def, result.manifest), cluster, timeout)
    inputs = seeds.seeded_inputs(Graph(original), 0)
    runner.run(inputs)
    os.kill(group.procs[1].pid, signal.SIGSTOP)
    try:
      t0 = time.time()
      with pytest.raises(cluster_lib.ClusterError,
                         match=r"worker /job:worker/task:1 .* does not answer"):
        runner.run(inputs)
      assert time.time() - t0 < timeout + 5
    finally:   # stopped, not dead: let it exit with the group
      os.kill(group.procs[1].pid, signal.SIGCONT)
  assert _wait_gone(mark, 5.0) == []
