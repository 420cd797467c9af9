"""Meshes placed on devices: the one way a mesh's axes meet device names.

    make_mesh("dp=2,tp=2")                        # this process's devices
    make_mesh("tp=2", devices=device_names("gpu", 2))   # named devices (rewrite)
    make_mesh("dp=2", cluster=cluster)            # a cluster's worker tasks

A Mesh given whole keeps its own devices. Every front door (tfsplit.split,
tfsplit.keras.split, the commands, a plan's mesh) places its mesh here.
"""
from tfsplit import constants
from tfsplit.errors import PlanError, TfsplitError
from tfsplit.layout.mesh import Mesh


def mesh_axes(mesh, stages=1):
  """{axis: size} of 'tp=4', a dict or a Mesh, with a 'pp' axis of `stages`
  in front when stages > 1 (the CLI's --stages)."""
  if isinstance(mesh, Mesh):
    axes = dict(mesh.axes)
  elif isinstance(mesh, str):
    axes = Mesh.parse(mesh).axes
  else:
    axes = dict(mesh)
  if stages > 1:
    if constants.PIPELINE_AXIS in axes:
      raise TfsplitError("give the pipeline either as --stages or as pp= in --mesh, "
                         "not both")
    axes = {constants.PIPELINE_AXIS: stages, **axes}
  return axes


def device_names(kind="cpu", count=1, job="localhost"):
  """Full names of `count` devices of `kind` ('cpu' or 'gpu') of task 0 of `job`."""
  kind = kind.upper()
  return [f"/job:{job}/replica:0/task:0/device:{kind}:{i}" for i in range(count)]


def available_devices():
  """This process's logical GPUs if any, else its logical CPUs (full names)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  for kind in ("GPU", "CPU"):
    devices = [d.name for d in tf.config.list_logical_devices(kind)]
    if devices:
      return devices
  return []


def make_mesh(mesh, devices=None, cluster=None, across=None):
  """The Mesh of `mesh` ('tp=4', a dict; a Mesh is returned as it is).

  devices: device names, the first as many as the mesh needs used (too few
  is one line saying how to get more); None: this process's devices.
  cluster: a runtime.cluster.Cluster: the mesh over its worker tasks, the
  `across` axes (default dp, pp) across tasks, the others within one.
  """
  if isinstance(mesh, Mesh):
    return mesh
  axes = mesh_axes(mesh)
  if cluster is not None:
    from tfsplit.runtime import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
    return cluster_lib.mesh_on_cluster(axes, cluster,
                                       tuple(across or cluster_lib.DEFAULT_ACROSS))
  size = 1
  for s in axes.values():
    size *= s
  if devices is None:
    devices = available_devices()
  if size > len(devices):
    raise PlanError(
        f"mesh {','.join(f'{k}={v}' for k, v in axes.items())} needs {size} devices but "
        f"this process has {len(devices)} ({', '.join(devices)}); use a smaller mesh, or "
        "split one device into logical ones with tf.config.set_logical_device_configuration "
        "before TensorFlow starts")
  return Mesh(axes, list(devices)[:size])
