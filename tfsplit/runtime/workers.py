"""Worker processes: TF gRPC servers on loopback, started, watched and stopped.

The pieces every multi-process run shares (`tfsplit launch`, `tfsplit
worker`, the multi-process benchmarks, the tests):

- `free_ports(n)`: n distinct free 127.0.0.1 ports (bound to port 0, then
  released; a port is picked free, never fixed).
- `start_server(...)`: one `tf.distribute.Server` for task i of a cluster,
  with the settings collectives across tasks need (a group leader).
- `serve_forever(...)`: a worker's main loop; it replies once on stdout
  ('ready', a `TAG`-prefixed JSON line) and serves until SIGTERM/SIGINT, a
  'quit' line on stdin or the end of its stdin (its launcher is gone).
- `WorkerGroup`: child processes speaking that protocol (a line of JSON per
  reply on stdout, commands on stdin, stderr to a log file): started in
  their own session, with a parent-death signal (Linux) so they never
  outlive their launcher, every wait bounded, and `stop()` ending them all
  (quit, then SIGTERM, then SIGKILL) also when starting failed half-way.

TF's gRPC server cannot be stopped from Python, so a worker leaves with
os._exit once told to.
"""
import ctypes
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

HOST = "127.0.0.1"
JOB = "worker"
TAG = "@@tfsplit "  # prefix of a worker's replies on stdout

# Seconds stop() waits for a worker to leave after each request (quit, SIGTERM).
STOP_GRACE_SECONDS = 5.0


def free_ports(n, host=HOST):
  """n distinct free ports on `host` (bound to port 0 together, then released)."""
  socks, ports = [], []
  try:
    for _ in range(n):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind((host, 0))
      socks.append(s)
      ports.append(s.getsockname()[1])
  finally:
    for s in socks:
      s.close()
  return ports


def reachable(address, timeout=1.0):
  """True if a TCP connection to 'host:port' opens within `timeout` seconds."""
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
      return True
  except (OSError, ValueError):
    return False


def leader_of(job=JOB):
  """The collective group leader of a cluster's tasks: its first task."""
  return f"/job:{job}/replica:0/task:0"


def server_config(job=JOB, cpus=None, inter_op_threads=0, intra_op_threads=0):
  """ConfigProto of a worker server: `cpus` CPU devices, the group leader that
  collectives across tasks need, thread pools."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=inter_op_threads,
                                    intra_op_parallelism_threads=intra_op_threads)
  if cpus:
    config.device_count["CPU"] = int(cpus)
  config.experimental.collective_group_leader = leader_of(job)
  return config


def start_server(cluster, job, index, cpus=None, inter_op_threads=0, intra_op_threads=0):
  """Starts the tf.distribute.Server of task `index` of `job` in `cluster`
  ({job: [address, ...]} or a tf.train.ClusterSpec)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  spec = cluster if isinstance(cluster, tf.train.ClusterSpec) else tf.train.ClusterSpec(
      cluster)
  return tf.distribute.Server(spec, job_name=job, task_index=index,
                              config=server_config(job, cpus, inter_op_threads,
                                                   intra_op_threads),
                              start=True)


def reply(obj):
  """A worker's reply: one TAG-prefixed JSON line on stdout."""
  sys.stdout.write(TAG + json.dumps(obj) + "\n")
  sys.stdout.flush()


def serve_forever(server_info, commands=None):
  """A started worker's main loop (does not return: leaves with os._exit(0)).

  Replies {'ready': ..., **server_info} once, then serves until SIGTERM or
  SIGINT, a 'quit' line on stdin, or the end of stdin when stdin is a pipe
  (the process that started it is gone). commands: optional {word:
  fn(argument) -> dict} answered with a reply each (benchmarks' probes).
  """
  done = threading.Event()

  def on_signal(signum, _frame):
    del signum
    done.set()

  signal.signal(signal.SIGTERM, on_signal)
  signal.signal(signal.SIGINT, on_signal)

  def read_stdin():
    for line in sys.stdin:
      word, _, arg = line.strip().partition(" ")
      if word == "quit":
        break
      if not word:
        continue
      handler = (commands or {}).get(word)
      if handler is None:
        reply({"error": f"unknown command '{word}'"})
        continue
      try:
        reply(handler(arg))
      except Exception as e:  # pylint: disable=broad-except
        reply({"error": f"{type(e).__name__}: {e}"})
    done.set()

  reply({"ready": True, **server_info})
  try:
    watch_stdin = not os.isatty(sys.stdin.fileno())
  except (OSError, ValueError):
    watch_stdin = False
  if watch_stdin:
    threading.Thread(target=read_stdin, daemon=True).start()
  while not done.wait(0.5):
    pass
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)  # pylint: disable=protected-access


def _die_with_parent():
  """Popen preexec_fn: the child gets SIGKILL when its parent dies (Linux)."""
  try:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


class WorkerError(RuntimeError):
  """A worker process that failed to start or to answer."""


class WorkerGroup(object):
  """Child processes that answer with TAG-prefixed JSON lines (see module doc).

  commands: one argv per worker; envs: one environment (or None) per worker;
  logdir: where each worker's stderr goes (worker<i>.log); timeout: seconds
  to wait for any reply (the first, 'ready', included). The constructor
  returns once every worker replied ready; on any failure it stops them all
  and raises WorkerError with the failing worker's log tail.
  """

  def __init__(self, commands, envs=None, logdir=None, timeout=60.0, names=None):
    import tempfile  # pylint: disable=import-outside-toplevel
    self.timeout = timeout
    self.logdir = logdir or tempfile.mkdtemp(prefix="tfsplit_workers_")
    self.names = names or [f"worker {i}" for i in range(len(commands))]
    self.procs, self._queues, self._logs = [], [], []
    envs = envs or [None] * len(commands)
    try:
      for i, (cmd, env) in enumerate(zip(commands, envs)):
        log = open(os.path.join(self.logdir, f"worker{i}.log"), "w",  # pylint: disable=consider-using-with
                   encoding="utf-8")
        self._logs.append(log)
        proc = subprocess.Popen(  # pylint: disable=consider-using-with
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
            bufsize=1, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        self.procs.append(proc)
        q = queue.Queue()
        threading.Thread(target=self._pump, args=(proc, q), daemon=True).start()
        self._queues.append(q)
      self.ready = [self.read(i) for i in range(len(self.procs))]
    except BaseException:
      self.stop()
      raise

  @property
  def pids(self):
    return [p.pid for p in self.procs]

  @staticmethod
  def _pump(proc, q):
    try:
      for line in proc.stdout:
        if line.startswith(TAG):
          try:
            q.put(json.loads(line[len(TAG):]))
          except ValueError:
            pass
    except (OSError, ValueError):
      pass
    q.put(None)  # end of output

  def read(self, i, timeout=None):
    """The next reply of worker i (bounded wait)."""
    timeout = self.timeout if timeout is None else timeout
    try:
      answer = self._queues[i].get(timeout=timeout)
    except queue.Empty:
      raise WorkerError(f"{self.names[i]} did not answer within {timeout:g} s"
                        f"{self.log_tail(i)}") from None
    if answer is None or "error" in answer:
      code = self.procs[i].poll()
      why = (answer or {}).get("error") or (f"exited with code {code}" if code is not None
                                            else "closed its output")
      raise WorkerError(f"{self.names[i]} failed: {why}{self.log_tail(i)}")
    return answer

  def log_tail(self, i, lines=20):
    """'; its log ends: ...' with the last lines of worker i's stderr, or ''."""
    try:
      self._logs[i].flush()
      with open(self._logs[i].name, encoding="utf-8", errors="replace") as f:
        tail = [l for l in f.readlines() if l.strip()][-lines:]
    except (OSError, IndexError, ValueError):
      return ""
    return "; its log ends:\n" + "".join(tail) if tail else ""

  def command(self, cmd):
    """Sends `cmd` (a string, or one per worker) to every worker; their
    replies, in order."""
    cmds = [cmd] * len(self.procs) if isinstance(cmd, str) else cmd
    for proc, c in zip(self.procs, cmds):
      proc.stdin.write(c + "\n")
      proc.stdin.flush()
    return [self.read(i) for i in range(len(self.procs))]

  def exited(self):
    """[(index, exit code)] of the workers no longer running."""
    return [(i, p.poll()) for i, p in enumerate(self.procs) if p.poll() is not None]

  def stop(self, grace=STOP_GRACE_SECONDS):
    """Ends every worker: 'quit' and end of stdin, then SIGTERM, then SIGKILL,
    each after a bounded wait; reaps them all. Safe to call twice."""
    for proc in self.procs:
      try:
        if proc.poll() is None:
          proc.stdin.write("quit\n")
          proc.stdin.flush()
      except (OSError, ValueError):
        pass
      try:
        proc.stdin.close()
      except (OSError, ValueError):
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
      deadline = time.time() + grace
      for proc in self.procs:
        try:
          proc.wait(timeout=max(0.05, deadline - time.time()))
        except subprocess.TimeoutExpired:
          pass
      running = [p for p in self.procs if p.poll() is None]
      if not running:
        break
      for proc in running:
        try:
          os.kill(proc.pid, sig)
        except OSError:
          pass
    for proc in self.procs:
      try:
        proc.wait(timeout=grace)
      except subprocess.TimeoutExpired:
        pass
      if proc.stdout is not None:
        try:
          proc.stdout.close()
        except (OSError, ValueError):
          pass
    for log in self._logs:
      try:
        log.close()
      except (OSError, ValueError):
        pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()
    return False


# ------------------------------------------------------------------ launching

def worker_command():
  """argv of a `tfsplit worker` process with this Python."""
  return [sys.executable, "-m", "tfsplit.cli", "worker"]


def cluster_spec(ports, host=HOST, job=JOB):
  return {job: [f"{host}:{p}" for p in ports]}


def tf_config(spec, devices_per_task=1, kind="CPU", task_index=None, job=JOB):
  """TF_CONFIG JSON of a launched cluster: the spec, tfsplit's own key and,
  for a worker, its task (the driving client names no task)."""
  data = {"cluster": spec,
          "tfsplit": {"devices_per_task": int(devices_per_task), "device_type": kind}}
  if task_index is not None:
    data["task"] = {"type": job, "index": int(task_index)}
  return json.dumps(data)


def start_workers(num_workers, devices_per_worker=1, kind="CPU", timeout=120.0,
                  logdir=None, attempts=3, extra_env=None):
  """(WorkerGroup, spec) of `num_workers` `tfsplit worker` processes on free
  loopback ports, each ready; a start that fails because a port was taken in
  the meantime is retried on fresh ports (`attempts` in all)."""
  kind = kind.upper()
  last = None
  for _ in range(attempts):
    spec = cluster_spec(free_ports(num_workers))
    envs = []
    for i in range(num_workers):
      env = dict(os.environ, **(extra_env or {}))
      env["TF_CONFIG"] = tf_config(spec, devices_per_worker, kind, i)
      env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
      if kind == "GPU":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(
            str(i * devices_per_worker + j) for j in range(devices_per_worker))
      envs.append(env)
    try:
      group = WorkerGroup([worker_command()] * num_workers, envs, logdir, timeout,
                          names=[f"worker task {i} ({a})" for i, a in
                                 enumerate(spec[JOB])])
      return group, spec
    except WorkerError as e:
      last = e
      if "address already in use" not in str(e).lower() and "bind" not in str(e).lower():
        raise
  raise last


def _chief_preexec():
  os.setpgid(0, 0)  # its own process group: signals reach its children too
  try:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


def _signal_group(pgid, sig):
  try:
    os.killpg(pgid, sig)
  except OSError:
    pass


def _group_alive(pgid):
  try:
    os.killpg(pgid, 0)
    return True
  except OSError:
    return False


class _SignalForwarder:
  """Passes SIGINT / SIGTERM / SIGHUP received by this process on to the
  process groups of the commands it starts (a signal that came before a
  command started is passed on as soon as it starts); restore() puts the
  previous handlers back."""

  def __init__(self, procs):
    self.procs = procs
    self.received = []
    self.previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
      try:
        self.previous[sig] = signal.signal(sig, self._on_signal)
      except ValueError:  # not the main thread
        pass

  def _on_signal(self, signum, _frame):
    self.received.append(signum)
    for p in self.procs:
      _signal_group(p.pid, signum)

  def start(self, command, env):
    try:
      proc = subprocess.Popen(command, env=env, preexec_fn=_chief_preexec)  # pylint: disable=consider-using-with
    except OSError as e:
      from tfsplit.errors import TfsplitError  # pylint: disable=import-outside-toplevel
      raise TfsplitError(f"cannot run {command[0]}: {e.strerror or e}") from None
    self.procs.append(proc)
    if self.received:
      _signal_group(proc.pid, self.received[-1])
    return proc

  def restore(self):
    for sig, handler in self.previous.items():
      signal.signal(sig, handler)


def launch(command, num_workers, devices_per_worker=1, kind="CPU", start_timeout=120.0,
           logdir=None, stop_grace=STOP_GRACE_SECONDS, log=None):
  """Runs `command` (argv) as the client of `num_workers` fresh workers.

  Starts the workers (`tfsplit worker`, free loopback ports), runs `command`
  with TF_CONFIG naming the cluster, and returns its exit code (128 + n if
  signal n ended it). SIGINT / SIGTERM / SIGHUP to this process are passed
  on to the command's process group. Every worker, and whatever is left of
  the command's process group, is stopped before returning, on failure too.
  log: where to write progress lines (default stderr).
  """
  log = log or sys.stderr
  group, spec = start_workers(num_workers, devices_per_worker, kind, start_timeout, logdir)
  procs = []
  forward = _SignalForwarder(procs)
  proc = None
  try:
    env = dict(os.environ)
    env["TF_CONFIG"] = tf_config(spec, devices_per_worker, kind.upper())
    log.write(f"tfsplit launch: {num_workers} worker(s) on {', '.join(spec[JOB])} "
              f"({devices_per_worker} {kind.upper()} each); logs in {group.logdir}\n")
    log.flush()
    proc = forward.start(command, env)
    while True:
      try:
        code = proc.wait(timeout=0.5)
        break
      except subprocess.TimeoutExpired:
        continue
    early = [(i, c) for i, c in group.exited() if c not in (0, None)]
    for i, c in early:
      log.write(f"tfsplit launch: {group.names[i]} exited with code {c} while the "
                f"command ran; its log: {group._logs[i].name}\n")  # pylint: disable=protected-access
    return 128 - code if code < 0 else code
  finally:
    try:
      if proc is not None:
        if proc.poll() is None:
          _signal_group(proc.pid, signal.SIGTERM)
          try:
            proc.wait(timeout=stop_grace)
          except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(timeout=stop_grace)
        # Leftovers of the command (children it started in the background).
        if _group_alive(proc.pid):
          _signal_group(proc.pid, signal.SIGTERM)
          deadline = time.time() + stop_grace
          while _group_alive(proc.pid) and time.time() < deadline:
            time.sleep(0.05)
          _signal_group(proc.pid, signal.SIGKILL)
    finally:
      group.stop(stop_grace)
      forward.restore()


def launch_each(command, num_workers, devices_per_worker=1, kind="CPU",
                stop_grace=STOP_GRACE_SECONDS, log=None):
  """Runs `command` (argv) in `num_workers` processes, each a worker task of
  one cluster on free loopback ports with its own TF_CONFIG naming its task
  (every worker runs the same script, as multi-worker jobs do; the command
  serves its task itself, see runtime/multi_client.py).

  Returns 0 if every worker exited 0, else the exit code of the first that
  did not (128 + n for signal n). A worker that fails does not stop the
  others: they end on their own, within their collective timeout, naming it.
  Signals to this process are passed on to every worker's process group;
  whatever is left of them is stopped before returning."""
  log = log or sys.stderr
  kind = kind.upper()
  spec = cluster_spec(free_ports(num_workers))
  procs = []
  forward = _SignalForwarder(procs)
  try:
    log.write(f"tfsplit launch: {num_workers} worker(s) on {', '.join(spec[JOB])} "
              f"({devices_per_worker} {kind} each), each running the command\n")
    log.flush()
    for i in range(num_workers):
      env = dict(os.environ)
      env["TF_CONFIG"] = tf_config(spec, devices_per_worker, kind, i)
      env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
      if kind == "GPU":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(
            str(i * devices_per_worker + j) for j in range(devices_per_worker))
      forward.start(command, env)
    first_failure = None
    while any(p.poll() is None for p in procs):
      for i, p in enumerate(procs):
        code = p.poll()
        if code not in (0, None) and first_failure is None:
          first_failure = code
          log.write(f"tfsplit launch: worker task {i} ({spec[JOB][i]}) exited with "
                    f"code {code}\n")
          log.flush()
      time.sleep(0.2)
    codes = [p.returncode for p in procs]
    if first_failure is None:
      first_failure = next((c for c in codes if c != 0), 0)
    return 128 - first_failure if first_failure < 0 else first_failure
  finally:
    try:
      for p in procs:
        if p.poll() is None:
          _signal_group(p.pid, signal.SIGTERM)
      deadline = time.time() + stop_grace
      for p in procs:
        try:
          p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
          _signal_group(p.pid, signal.SIGKILL)
          p.wait(timeout=stop_grace)
      for p in procs:  # leftovers of each worker's process group
        if _group_alive(p.pid):
          _signal_group(p.pid, signal.SIGKILL)
    finally:
      forward.restore()
