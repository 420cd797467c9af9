"""Cluster spec: devices, the hosts they sit in, and the links between them.

JSON form (sizes may be numbers of bytes or strings such as "80GB"):

  {"name": "...",
   "hosts": [{"name": "host0",
              "intra_host_link": {"bandwidth": 450e9, "latency": 2e-6},
              "inter_host_link": {"bandwidth": 400e9, "latency": 5e-6}}],
   "devices": [{"name": "host0/gpu:0", "host": "host0", "kind": "H100",
                "memory_bytes": 80e9, "memory_bandwidth": 3.35e12,
                "peak_flops": {"float32": 67e12, "bfloat16": 989.4e12}}]}

Bandwidths are bytes/s per direction, latencies seconds. `intra_host_link`
is what one device gets to a peer in its host (NVLink/NVSwitch). The host's
`inter_host_link` bandwidth is its total network bandwidth (all NICs), which
its devices share: one device sending alone gets its share (one NIC on a DGX),
while a collective with k members in the host gets k shares, as NCCL spreads
rings over the NICs.

Presets (tfsplit/cost/presets/*.json) describe one device type and its usual
host; `from_preset` builds an N-device cluster out of one.
"""
import collections
import dataclasses
import json
import math
import os

from tfsplit.errors import ClusterSpecError, UnitsError
from tfsplit.fileio import write_atomically
from tfsplit.units import parse_bytes

PRESET_DIR = os.path.join(os.path.dirname(__file__), "presets")

# Floating dtypes with no entry in peak_flops run at the float32 rate (e.g.
# bfloat16 on a V100 or a CPU without native bf16 math).
_FLOAT_DTYPES = ("float16", "bfloat16", "half", "tf32", "float8_e4m3fn",
                 "float8_e5m2")


@dataclasses.dataclass(frozen=True)
class Link:
  """A path between devices: bandwidth in bytes/s, latency in seconds."""
  bandwidth: float
  latency: float

  def transfer_time(self, nbytes):
    return self.latency + nbytes / self.bandwidth

  def to_json(self):
    return {"bandwidth": self.bandwidth, "latency": self.latency}


LOCAL = Link(math.inf, 0.0)  # a device to itself


@dataclasses.dataclass
class Device:
  name: str
  host: str
  kind: str
  memory_bytes: int
  memory_bandwidth: float
  peak_flops: dict

  def flops(self, dtype="float32"):
    """Peak FLOP/s for `dtype` (a TF dtype name, or 'tf32')."""
    if dtype in self.peak_flops:
      return self.peak_flops[dtype]
    if dtype in _FLOAT_DTYPES and "float32" in self.peak_flops:
      return self.peak_flops["float32"]
    raise ClusterSpecError(
        f"device '{self.name}' ({self.kind}) has no peak FLOP/s for dtype "
        f"'{dtype}'; add it to peak_flops (known: "
        f"{', '.join(sorted(self.peak_flops))})")

  def to_json(self):
    return {"name": self.name, "host": self.host, "kind": self.kind,
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth": self.memory_bandwidth,
            "peak_flops": dict(self.peak_flops)}


@dataclasses.dataclass
class Host:
  name: str
  intra_host_link: Link
  inter_host_link: Link

  def to_json(self):
    return {"name": self.name, "intra_host_link": self.intra_host_link.to_json(),
            "inter_host_link": self.inter_host_link.to_json()}


class ClusterSpec:
  """Devices (indexed 0..N-1, the logical ids a Mesh maps) and their hosts."""

  def __init__(self, devices, hosts, name="cluster"):
    self.name = name
    self.devices = list(devices)
    self.hosts = {h.name: h for h in hosts}
    if not self.devices:
      raise ClusterSpecError(f"cluster '{name}' has no devices; list at least "
                             "one under 'devices'")
    seen = set()
    for d in self.devices:
      if d.name in seen:
        raise ClusterSpecError(f"cluster '{name}': device name '{d.name}' is "
                               "used twice; device names must be unique")
      seen.add(d.name)
      if d.host not in self.hosts:
        raise ClusterSpecError(
            f"cluster '{name}': device '{d.name}' is on host '{d.host}', which "
            "is not under 'hosts'; add the host or fix the device's host")
    self._host_size = collections.Counter(d.host for d in self.devices)

  def __len__(self):
    return len(self.devices)

  def __repr__(self):
    return (f"ClusterSpec({self.name!r}, {len(self.devices)} devices on "
            f"{len(self.hosts)} hosts)")

  @property
  def num_devices(self):
    return len(self.devices)

  def device(self, index):
    return self.devices[index]

  def host_of(self, index):
    return self.hosts[self.devices[index].host]

  def network_share(self, host_name, members=1):
    """Bytes/s of host `host_name`'s network that `members` of its devices get."""
    host = self.hosts[host_name]
    return host.inter_host_link.bandwidth * members / self._host_size[host_name]

  def link(self, a, b):
    """The point-to-point path from device index `a` to `b` (Send/Recv)."""
    if a == b:
      return LOCAL
    ha, hb = self.devices[a].host, self.devices[b].host
    if ha == hb:
      return self.hosts[ha].intra_host_link
    return Link(min(self.network_share(ha), self.network_share(hb)),
                max(self.hosts[ha].inter_host_link.latency,
                    self.hosts[hb].inter_host_link.latency))

  def group_link(self, group):
    """The slowest link a collective over device indices `group` crosses.

    Within one host: that host's intra-host link. Across hosts: the least of
    the intra-host links of hosts holding two or more members and, for each
    host, its members' share of the host's network; the latency is the
    largest of the links crossed.
    """
    members = collections.Counter(self.devices[i].host for i in set(group))
    if sum(members.values()) <= 1:
      return LOCAL
    if len(members) == 1:
      return self.hosts[next(iter(members))].intra_host_link
    bandwidth, latency = math.inf, 0.0
    for host_name, k in members.items():
      host = self.hosts[host_name]
      if k >= 2:
        bandwidth = min(bandwidth, host.intra_host_link.bandwidth)
        latency = max(latency, host.intra_host_link.latency)
      bandwidth = min(bandwidth, self.network_share(host_name, k))
      latency = max(latency, host.inter_host_link.latency)
    return Link(bandwidth, latency)

  def to_json(self):
    return {"name": self.name,
            "hosts": [h.to_json() for h in self.hosts.values()],
            "devices": [d.to_json() for d in self.devices]}

  def save(self, path):
    """Writes the spec as JSON atomically (temp file, then rename)."""
    write_atomically(path, json.dumps(self.to_json(), indent=2) + "\n")

  @classmethod
  def from_json(cls, obj, source="cluster spec"):
    if not isinstance(obj, dict):
      raise ClusterSpecError(f"{source}: expected a JSON object with 'hosts' "
                             "and 'devices'")
    hosts = [Host(name=_field(h, "name", source, str),
                  intra_host_link=_link(h, "intra_host_link", source),
                  inter_host_link=_link(h, "inter_host_link", source))
             for h in _field(obj, "hosts", source, list)]
    devices = [_device(d, source) for d in _field(obj, "devices", source, list)]
    return cls(devices, hosts, name=obj.get("name", source))

  @classmethod
  def load(cls, path_or_preset):
    """Reads a cluster spec JSON file; a preset name gives one host of it."""
    if not os.path.exists(path_or_preset) and path_or_preset in preset_names():
      return from_preset(path_or_preset)
    return cls.from_json(_read_json(path_or_preset), source=path_or_preset)


def _read_json(path):
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except FileNotFoundError:
    raise ClusterSpecError(
        f"cluster spec '{path}' does not exist; give a JSON file or one of the "
        f"presets: {', '.join(preset_names())}") from None
  except (OSError, ValueError) as e:
    raise ClusterSpecError(f"cannot read cluster spec '{path}': {e}; it must "
                           "be a JSON file") from None


def _field(obj, key, source, kind):
  if not isinstance(obj, dict) or key not in obj:
    raise ClusterSpecError(f"{source}: missing field '{key}' in {obj!r:.80}")
  value = obj[key]
  if kind is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
        not value > 0 or not math.isfinite(value):
      raise ClusterSpecError(f"{source}: '{key}' must be a positive number, "
                             f"got {value!r}")
    return float(value)
  if not isinstance(value, kind):
    names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple)
                                              else (kind,)))
    raise ClusterSpecError(f"{source}: '{key}' must be a {names}, got "
                           f"{value!r:.80}")
  return value


def _link(obj, key, source):
  link = _field(obj, key, source, dict)
  latency = link.get("latency", 0.0)
  if isinstance(latency, bool) or not isinstance(latency, (int, float)) or \
      not 0 <= latency < math.inf:
    raise ClusterSpecError(f"{source}: {key}: 'latency' must be a number of "
                           f"seconds >= 0, got {latency!r}")
  return Link(_field(link, "bandwidth", f"{source}: {key}", float),
              float(latency))


def _device(obj, source):
  name = _field(obj, "name", source, str)
  where = f"{source}: device '{name}'"
  try:
    memory = parse_bytes(_field(obj, "memory_bytes", where, (int, float, str)))
  except UnitsError as e:
    raise ClusterSpecError(f"{where}: memory_bytes: {e}") from None
  flops = _field(obj, "peak_flops", where, dict)
  if not flops:
    raise ClusterSpecError(f"{where}: peak_flops is empty; give at least "
                           "{'float32': FLOP/s}")
  flops = {k: _field(flops, k, f"{where}: peak_flops", float) for k in flops}
  return Device(name=name, host=_field(obj, "host", where, str),
                kind=obj.get("kind", "device"), memory_bytes=memory,
                memory_bandwidth=_field(obj, "memory_bandwidth", where, float),
                peak_flops=flops)


def preset_names():
  return sorted(f[:-len(".json")] for f in os.listdir(PRESET_DIR)
                if f.endswith(".json"))


def load_preset(name):
  """The raw preset dict (device, devices_per_host, links, sources)."""
  path = os.path.join(PRESET_DIR, f"{name}.json")
  if not os.path.exists(path):
    raise ClusterSpecError(f"unknown hardware preset '{name}'; choose one of: "
                           f"{', '.join(preset_names())}")
  return _read_json(path)


def from_preset(name, num_devices=None, devices_per_host=None):
  """An N-device cluster of preset `name`, filling hosts in order.

  `devices_per_host` defaults to the preset's (8 for the DGX-style GPU
  presets); `num_devices` defaults to one full host. A last host that is not
  full is allowed (its devices share its network).
  """
  preset = load_preset(name)
  per_host = devices_per_host or preset["devices_per_host"]
  count = per_host if num_devices is None else num_devices
  if count < 1 or per_host < 1:
    raise ClusterSpecError(f"preset '{name}': need at least one device and one "
                           f"device per host, got {count} and {per_host}")
  source = f"preset '{name}'"
  intra = _link(preset, "intra_host_link", source)
  inter = _link(preset, "inter_host_link", source)
  base = dict(preset["device"], name="_", host="_")
  template = _device(base, source)
  num_hosts = -(-count // per_host)
  hosts = [Host(f"host{h}", intra, inter) for h in range(num_hosts)]
  devices = [dataclasses.replace(template, name=f"host{i // per_host}/dev:{i % per_host}",
                                 host=f"host{i // per_host}",
                                 peak_flops=dict(template.peak_flops))
             for i in range(count)]
  return ClusterSpec(devices, hosts, name=f"{name} x{count}")


def for_graph(spec, num_devices, count=None):
  """The cluster a graph on `num_devices` devices runs on: `count` (default
  num_devices) devices of a preset, or a spec file with at least that many."""
  if spec in preset_names():
    return from_preset(spec, count or num_devices)
  cluster = ClusterSpec.load(spec)
  if cluster.num_devices < num_devices:
    raise ClusterSpecError(f"cluster '{spec}' has {cluster.num_devices} devices "
                           f"but the graph uses {num_devices}; give a bigger cluster")
  return cluster


def device_memory_sizes(text):
  """'16GB,32GiB,h100-80gb' -> [bytes, ...]: sizes or hardware preset names."""
  sizes = []
  for token in str(text).split(","):
    token = token.strip()
    if token.lower() in preset_names():
      token = load_preset(token.lower())["device"]["memory_bytes"]
    if token:
      sizes.append(parse_bytes(token))
  if not sizes:
    raise ClusterSpecError("--device-memory is empty; give sizes such as 16GB,32GB")
  return sizes
