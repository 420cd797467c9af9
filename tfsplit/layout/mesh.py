"""Device meshes: named axes over logical device ids, mapped to device names.

A Mesh is pure geometry (`dp=2,tp=2`: 4 logical devices, row-major, the last
axis fastest); which physical device each logical id runs on is a separate
list of device strings, so one plan runs on logical CPUs in a test, on GPUs,
or across `/job:worker/task:i` without touching the passes.
"""
import itertools
import re

from tfsplit.errors import PlanError
from tfsplit.layout import spec as spec_lib

_AXIS_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*([0-9]+)\s*$")


def is_gpu(device):
  """Whether device string `device` names a GPU ('/device:GPU:0', '/gpu:1')."""
  return "GPU" in device.upper()


def local_cpu_devices(n):
  return [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(n)]


class Mesh(object):
  """Named axes (ordered) over `size` logical devices, plus device names."""

  def __init__(self, axes, devices=None):
    axes = dict(axes)
    if not axes:
      raise PlanError("a mesh needs at least one axis, e.g. tp=2")
    for name, size in axes.items():
      if int(size) < 1:
        raise PlanError(f"mesh axis '{name}' has size {size}; sizes must be >= 1")
    self.axes = {name: int(size) for name, size in axes.items()}
    self.axis_names = list(self.axes)
    self.size = 1
    for s in self.axes.values():
      self.size *= s
    if devices is None:
      devices = local_cpu_devices(self.size)
    devices = list(devices)
    if len(devices) != self.size:
      raise PlanError(f"mesh {self} has {self.size} devices but {len(devices)} "
                      "device names were given")
    self.devices = devices
    self._coords = list(itertools.product(*[range(s) for s in self.axes.values()]))
    # Row-major ids (the last axis fastest): ids and groups are computed, not
    # searched, the mesh being as large as a cluster.
    self._strides, stride = {}, 1
    for name in reversed(self.axis_names):
      self._strides[name], stride = stride, stride * self.axes[name]
    self._groups = {}

  @classmethod
  def parse(cls, text, devices=None):
    """'tp=4' or 'dp=2,tp=2' -> Mesh."""
    axes = {}
    for part in str(text).split(","):
      m = _AXIS_RE.match(part)
      if not m:
        raise PlanError(f"cannot read mesh '{text}': write axes as name=size, "
                        "comma-separated, e.g. tp=4 or dp=2,tp=2")
      if m.group(1) in axes:
        raise PlanError(f"mesh '{text}' names axis '{m.group(1)}' twice")
      axes[m.group(1)] = int(m.group(2))
    return cls(axes, devices)

  def __repr__(self):
    return ",".join(f"{k}={v}" for k, v in self.axes.items())

  # Compound axes: "dp*mb" splits one tensor dimension over two mesh axes,
  # the first major (a batch split over data-parallel replicas and, within
  # each, over micro-batches).
  axis_parts = staticmethod(spec_lib.axis_parts)

  @property
  def on_gpus(self):
    """Whether every device of the mesh is a GPU."""
    return all(is_gpu(d) for d in self.devices)

  def size_of(self, axis):
    size = 1
    for part in self.axis_parts(axis):
      size *= self.axes[part]
    return size

  def coord_of(self, device_id, axis):
    """Coordinate of `device_id` along a (possibly compound) axis."""
    coord = 0
    for part in self.axis_parts(axis):
      coord = coord * self.axes[part] + self.coord(device_id, part)
    return coord

  def is_local(self, axis):
    """True if every group along `axis` sits on one device (micro-batches)."""
    return all(len({self.devices[m] for m in members}) == 1
               for members in self.groups(axis))

  def with_microbatches(self, m, name="mb"):
    """This mesh plus a local axis of `m` micro-batches (after dp if any)."""
    if m == 1:
      return self
    axes, order = {}, []
    for a in self.axis_names:
      axes[a] = self.axes[a]
      order.append(a)
      if a == "dp":
        axes[name] = m
    if name not in axes:
      axes = {name: m, **axes}
    result = Mesh(axes, [self.devices[0]] * (self.size * m))
    devices = []
    for d in range(result.size):
      c = result.coords(d)
      devices.append(self.devices[self.device_id({a: c[a] for a in self.axis_names})])
    result.devices = devices
    return result

  def coords(self, device_id):
    """{axis: coordinate} of logical device `device_id`."""
    return dict(zip(self.axis_names, self._coords[device_id]))

  def coord(self, device_id, axis):
    return self._coords[device_id][self.axis_names.index(axis)]

  def device_id(self, coords):
    return sum(coords[a] * self._strides[a] for a in self.axis_names)

  def groups(self, axis):
    """Lists of device ids that differ only in `axis` (collective groups),
    in the order of the other coordinates."""
    return [list(members) for members in self._axis_groups(axis)[0]]

  def group_of(self, device_id, axis):
    """(group index, members) of the `axis` group holding `device_id`."""
    groups, index_of = self._axis_groups(axis)
    i = index_of[device_id]
    return i, list(groups[i])

  def _axis_groups(self, axis):
    found = self._groups.get(axis)
    if found is None:
      index = self.axis_names.index(axis)
      groups = {}
      for device_id, c in enumerate(self._coords):
        groups.setdefault(c[:index] + c[index + 1:], []).append(device_id)
      ordered = [tuple(groups[k]) for k in sorted(groups)]
      index_of = {d: i for i, members in enumerate(ordered) for d in members}
      found = self._groups[axis] = (ordered, index_of)
    return found

  def check_devices_available(self, available):
    """Raises PlanError if the mesh needs more devices than `available`."""
    if self.size > len(available):
      raise PlanError(
          f"mesh {self} needs {self.size} devices but only {len(available)} are "
          f"available ({', '.join(available) or 'none'}); use a smaller mesh or "
          "configure more (logical) devices")
