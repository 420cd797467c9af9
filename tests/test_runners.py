"""The runners (runtime/runners.py): which one a split gets, and each one's
own work: placing a mesh, creating shards, running and tracing a step,
reading and writing shards, full values, checkpoints, refusals.

The cluster runners run against worker servers this test starts on free
127.0.0.1 ports (runtime/workers.py), stopped on leaving, also on failure.
"""
import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf

import tfsplit
from tfsplit.errors import PlanError
from tfsplit.layout.mesh import Mesh
from tfsplit.passes.config import SplitConfig
from tfsplit.runtime import cluster as cluster_lib
from tfsplit.runtime import runners
from tfsplit.runtime import workers

TIMEOUT = 60
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Mlp(object):
  """A two-layer MLP trained by SGD: small enough to run on a cluster fast."""

  def __init__(self):
    rng = np.random.RandomState(0)
    self.w1 = tf.Variable(rng.normal(size=(16, 32)).astype(np.float32) * 0.1,
                          name="fc1/kernel")
    self.w2 = tf.Variable(rng.normal(size=(32, 4)).astype(np.float32) * 0.1,
                          name="fc2/kernel")
    self.start = [self.w1.numpy(), self.w2.numpy()]
    self.x = rng.normal(size=(8, 16)).astype(np.float32)
    self.y = np.arange(8, dtype=np.int32) % 4
    opt = tf.keras.optimizers.SGD(0.1)

    @tf.function
    def step(x, y):
      with tf.GradientTape() as tape:
        h = tf.nn.relu(tf.matmul(x, self.w1, name="fc1/MatMul"))
        logits = tf.matmul(h, self.w2, name="fc2/MatMul")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
      opt.apply_gradients(zip(tape.gradient(loss, [self.w1, self.w2]), [self.w1, self.w2]))
      return loss

    self.step = step
    self.signature = [tf.TensorSpec([8, 16], tf.float32), tf.TensorSpec([8], tf.int32)]

  def reset(self):
    self.w1.assign(self.start[0])
    self.w2.assign(self.start[1])

  def reference(self, steps):
    """Losses and full values of `steps` unsplit steps, the variables reset after."""
    losses = [float(self.step(self.x, self.y)) for _ in range(steps)]
    values = {"fc1/kernel": self.w1.numpy(), "fc2/kernel": self.w2.numpy()}
    self.reset()
    return losses, values


def _spec_dict(tf_config_or_spec):
  return tf_config_or_spec if isinstance(tf_config_or_spec, dict) else json.loads(
      tf_config_or_spec)


def test_choose_picks_the_runner_from_the_cluster(monkeypatch):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  assert type(runners.choose("tp=2")) is runners.LocalRunner
  spec = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
  client = runners.choose("dp=2", spec)
  assert type(client) is runners.ClientRunner and client.cluster.num_tasks == 2
  # A Mesh with its own devices runs here whatever TF_CONFIG says.
  monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec,
                                              "task": {"type": "worker", "index": 1}}))
  task = runners.choose("dp=2")
  assert type(task) is runners.TaskRunner and task.task == 1
  assert type(runners.choose(Mesh({"tp": 2}))) is runners.LocalRunner


def test_client_and_task_runners_place_on_the_cluster_and_set_their_config():
  spec = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
  client = runners.ClientRunner(cluster_lib.resolve(spec))
  mesh = client.place("dp=2")
  assert [d.split("/device")[0] for d in mesh.devices] == ["/job:worker/replica:0/task:0",
                                                           "/job:worker/replica:0/task:1"]
  config = client.configure(SplitConfig(mesh))
  assert config.timeout_seconds == cluster_lib.DEFAULT_TIMEOUT_SECONDS and config.task is None
  assert client.configure(SplitConfig(mesh, timeout_seconds=5)).timeout_seconds == 5


def test_task_runner_holds_only_its_task_and_refuses_full_values():
  cluster = cluster_lib.resolve({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                 "task": {"type": "worker", "index": 1}})
  runner = runners.TaskRunner(cluster)
  manifest = {"w": {"shards": [{"name": "w/0", "device": cluster.device(0, 0)},
                               {"name": "w/1", "device": cluster.device(1, 0)}]}}
  assert [s["name"] for s in runner.held(manifest)["w"]["shards"]] == ["w/1"]
  with pytest.raises(PlanError, match="each worker holds only its task's shards"):
    runner.full_values()


def test_task_runner_says_which_share_of_the_batch_its_step_takes():
  """A worker feeding the batch it traced instead of its share: one line
  naming the share and the global batch (checked before anything runs)."""
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.passes import split_graph  # pylint: disable=import-outside-toplevel
  cluster = cluster_lib.resolve({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                 "task": {"type": "worker", "index": 1}})
  runner = runners.TaskRunner(cluster)
  graph_def = load_graph(os.path.join(ROOT, "examples", "mlp_raw_train_tiny.pb"))
  runner.result = split_graph(graph_def, SplitConfig(runner.place("dp=2"), task=1))
  name, share = next(iter(runner.task_inputs.items()))
  args = [np.zeros(s["global_shape"]) for s in runner.task_inputs.values()]
  with pytest.raises(PlanError, match=re.escape(
      f"input '{name}' of shape {share['global_shape']}: task 1's step takes "
      f"{share['shape']}") + ".*step.local_batch"):
    runner._feed(args)  # pylint: disable=protected-access
  assert [list(a.shape) for a in runner._feed(runner.local_batch(args))] == [  # pylint: disable=protected-access
      s["shape"] for s in runner.task_inputs.values()]


def test_local_runner_trains_saves_and_restores_exactly(tmp_path):
  model = _Mlp()
  want_losses, want = model.reference(3)
  try:
    step = tfsplit.split(model.step, mesh="dp=2,tp=2", input_signature=model.signature)
    runner = step.runner
    assert type(runner) is runners.LocalRunner and step.variables is runner.variables
    assert len(runner.variables) == sum(len(e["shards"]) for e in step.manifest.values())
    losses = [float(step(model.x, model.y)) for _ in range(3)]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    full = step.full_values()
    for name, value in want.items():
      np.testing.assert_allclose(full[name], value, rtol=1e-5, atol=1e-6)
    # Every copy of a split weight is a block of the full value, on its device.
    for shard in step.manifest["fc1/kernel"]["shards"]:
      assert runner.variables[shard["name"]].device.endswith(shard["device"].split("/")[-1])
    path = step.save(str(tmp_path), 3)
    _, events = step.trace(model.x, model.y)
    assert {d for d, *_ in events} >= set(step.mesh.devices[:1])
    step.assign_shards({s["name"]: np.zeros(s["shape"], np.float32)
                        for s in step.manifest["fc2/kernel"]["shards"]})
    assert not step.full_values()["fc2/kernel"].any()
    assert step.restore(path) == 3
    np.testing.assert_allclose(step.full_values()["fc2/kernel"], want["fc2/kernel"],
                               rtol=1e-5, atol=1e-6)
  finally:
    model.reset()


def test_a_step_sharing_shards_keeps_their_split():
  """A forward step of the same model (evaluation, prediction) over the
  training step's shards splits each variable as the training step did,
  though alone its first layer, feeding nothing, would stay whole."""
  model = _Mlp()
  try:
    step = tfsplit.split(model.step, mesh="tp=2", input_signature=model.signature)

    @tf.function
    def features(x):
      return tf.nn.relu(tf.matmul(x, model.w1, name="fc1/MatMul"))

    signature = model.signature[:1]
    alone = tfsplit.split(features, mesh="tp=2", input_signature=signature)
    assert not any(alone.manifest["fc1/kernel"]["sharding"])
    shared = tfsplit.split(features, mesh="tp=2", input_signature=signature, shares_with=step)
    assert shared.manifest["fc1/kernel"]["sharding"] == [None, "tp"]
    assert all(shared.variables[n] is step.variables[n] for n in shared.variables)
    np.testing.assert_allclose(shared(model.x), features(model.x), rtol=1e-5, atol=1e-6)
  finally:
    model.reset()


def test_client_runner_matches_the_local_runner_on_two_workers(tmp_path):
  """The same split through one client over 2 worker processes: the same
  losses, shards, full values and checkpoint as on this process's devices."""
  model = _Mlp()
  want_losses, want = model.reference(2)
  group, spec = workers.start_workers(2, 1, timeout=120, logdir=str(tmp_path))
  try:
    step = tfsplit.split(model.step, mesh="dp=2", input_signature=model.signature,
                         cluster=spec, timeout_seconds=TIMEOUT)
    assert type(step.runner) is runners.ClientRunner and step.variables is None
    assert {d.split("/device")[0] for d in step.mesh.devices} == {
        "/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"}
    with pytest.raises(PlanError, match=r"of shape \[4, 16\]: the split step takes \[8, 16\]"):
      step(model.x[:4], model.y[:4])
    losses = [float(step(model.x, model.y)) for _ in range(2)]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    full = step.full_values()
    for name, value in want.items():
      np.testing.assert_allclose(full[name], value, rtol=1e-5, atol=1e-6)
    _, events = step.trace(model.x, model.y)
    assert {d.split("/device")[0] for d, *_ in events} == {
        "/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"}
    path = step.save(str(tmp_path / "ckpt"), 2)
    shards = step.shard_values()
    step.assign_from_originals()   # the model's variables: the start values
    np.testing.assert_allclose(step.full_values()["fc1/kernel"], model.start[0])
    assert step.restore(path) == 2
    for name, value in step.shard_values().items():
      np.testing.assert_array_equal(value, shards[name])
    step.runner.session.close(reset=True)
  finally:
    group.stop()
    model.reset()
