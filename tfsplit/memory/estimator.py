"""Memory of model states from the parameter count alone (no graph needed).

With P parameters, per parameter:

                         fp32   mixed precision (16-bit compute)
  weights                  4      2
  gradients                4      2
  fp32 master weights      -      4
  optimizer state       4 per state tensor, kept in fp32 (Adam: m, v = 8)

so Adam needs 16P bytes either way (mixed: 2 + 2 + 12, the ZeRO paper's
K = 12). ZeRO shards over N data-parallel devices (Rajbhandari et al. 2020):
stage 1 the optimizer state (with the master copy), stage 2 also the
gradients, stage 3 also the weights: 4P + 12P/N, 2P + 14P/N and 16P/N bytes
per device for mixed-precision Adam.

All sizes are decimal (1 GB = 1e9 bytes, 1 TB = 1e12), as device memory is
quoted. Device counts are lower bounds: they leave out activations (unless an
activation term is given), workspace and fragmentation, and assume the states
split perfectly.
"""
import dataclasses

from tfsplit.errors import EstimateError

PRECISIONS = ("fp32", "mixed")

# name -> (fp32 state tensors per weight, description)
_OPTIMIZERS = {
    "sgd": (0, "SGD, no state"),
    "momentum": (1, "SGD momentum buffer"),
    "adagrad": (1, "Adagrad accumulator"),
    "rmsprop": (1, "RMSprop mean square"),
    "adam": (2, "Adam moments m, v"),
}
_ALIASES = {"sgd-momentum": "momentum", "sgd_momentum": "momentum",
            "adamw": "adam"}


def optimizer_names():
  return sorted(_OPTIMIZERS) + sorted(_ALIASES)


def canonical_optimizer(name):
  key = str(name).strip().lower()
  key = _ALIASES.get(key, key)
  if key not in _OPTIMIZERS:
    raise EstimateError(f"unknown optimizer '{name}'; choose one of: "
                        f"{', '.join(optimizer_names())}")
  return key


@dataclasses.dataclass(frozen=True)
class Component:
  """One line of the estimate: what it is and how it shards under ZeRO."""
  name: str
  group: str                 # 'weights', 'gradients', 'optimizer', 'activations'
  bytes_per_param: float     # 0 for activations, which do not scale with P
  nbytes: int


@dataclasses.dataclass
class ZeroRow:
  stage: int
  label: str
  formula: str               # e.g. '4P + 12P/N'
  replicated_per_param: float  # bytes/param every device keeps whole
  sharded_per_param: float     # bytes/param split N ways
  per_device: int              # at `devices`, activations included
  devices: int

  def fewest_devices(self, device_memory, params, activation_bytes=0):
    """Smallest N at which a device of `device_memory` bytes holds it.

    None when even infinitely many devices would not make it fit.
    """
    room = (device_memory - round(self.replicated_per_param * params) -
            activation_bytes)
    if room < 0:
      return None
    sharded = round(self.sharded_per_param * params)
    if sharded == 0:
      return 1
    if room == 0:
      return None
    return max(1, _ceil_div(sharded, room))


@dataclasses.dataclass
class Estimate:
  params: int
  optimizer: str
  precision: str
  components: list
  activation_bytes: int = 0

  def _sum(self, groups):
    return sum(c.nbytes for c in self.components if c.group in groups)

  def _per_param(self, groups):
    return sum(c.bytes_per_param for c in self.components if c.group in groups)

  @property
  def weights_and_optimizer(self):
    """Weights, master copy and optimizer state: the states kept between steps."""
    return self._sum(("weights", "optimizer"))

  @property
  def weights_and_optimizer_per_param(self):
    return self._per_param(("weights", "optimizer"))

  @property
  def total(self):
    return sum(c.nbytes for c in self.components)

  @property
  def bytes_per_param(self):
    return self._per_param(("weights", "gradients", "optimizer"))

  def zero(self, devices):
    """Per-device bytes with no sharding and with ZeRO stages 1, 2, 3."""
    if devices < 1:
      raise EstimateError(f"ZeRO needs at least 1 device, got {devices}")
    w = self._per_param(("weights",))
    g = self._per_param(("gradients",))
    o = self._per_param(("optimizer",))
    stages = [(0, "replicated", w + g + o, 0),
              (1, "optimizer state", w + g, o),
              (2, "+ gradients", w, g + o),
              (3, "+ weights", 0, w + g + o)]
    rows = []
    for stage, label, rep, shard in stages:
      per_device = _ceil_div(round(rep * self.params * devices) +
                             round(shard * self.params), devices)
      rows.append(ZeroRow(stage=stage, label=label, formula=_formula(rep, shard),
                          replicated_per_param=rep, sharded_per_param=shard,
                          per_device=per_device + self.activation_bytes,
                          devices=devices))
    return rows

  def to_json(self, device_memory=(), zero_devices=None):
    out = {
        "precision": self.precision,
        "components": [{"name": c.name, "group": c.group,
                        "bytes_per_param": c.bytes_per_param, "bytes": c.nbytes}
                       for c in self.components],
        "bytes_per_param": self.bytes_per_param,
        "weights_and_optimizer_bytes": self.weights_and_optimizer,
        "total_bytes": self.total,
        "devices_needed": [
            {"device_memory": m,
             "weights_and_optimizer": devices_needed(self.weights_and_optimizer, m),
             "total": devices_needed(self.total, m)}
            for m in device_memory],
    }
    if zero_devices:
      out["zero"] = {"devices": zero_devices, "stages": [
          {"stage": r.stage, "formula": r.formula, "per_device_bytes": r.per_device,
           "fewest_devices": [
               {"device_memory": m,
                "devices": r.fewest_devices(m, self.params, self.activation_bytes)}
               for m in device_memory]}
          for r in self.zero(zero_devices)]}
    return out


def _ceil_div(a, b):
  return -(-int(a) // int(b))


def _coef(x):
  return f"{x:g}P"


def _formula(replicated, sharded):
  parts = []
  if replicated:
    parts.append(_coef(replicated))
  if sharded:
    parts.append(_coef(sharded) + "/N")
  return " + ".join(parts) or "0"


def devices_needed(nbytes, device_memory):
  """ceil(nbytes / device_memory): 1.2e12 over 16e9 is 75."""
  return max(1, _ceil_div(nbytes, device_memory)) if nbytes else 0


def transformer_activation_bytes(layers, hidden, seq_len, micro_batch, heads,
                                 recompute=False, precision="mixed"):
  """Activation bytes of one micro-batch through a GPT-style transformer.

  Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models"): s*b*h*(34 + 5*a*s/h) bytes per layer with 16-bit
  activations and no parallelism; with full recomputation only each layer's
  input, 2*s*b*h bytes, is kept. fp32 activations roughly double it.
  """
  for name, v in (("layers", layers), ("hidden", hidden), ("seq_len", seq_len),
                  ("micro_batch", micro_batch), ("heads", heads)):
    if not isinstance(v, int) or v < 1:
      raise EstimateError(f"transformer activation estimate: {name} must be a "
                          f"positive integer, got {v!r}")
  sbh = seq_len * micro_batch * hidden
  if recompute:
    per_layer = 2 * sbh
  else:
    per_layer = sbh * 34 + 5 * heads * seq_len * seq_len * micro_batch
  scale = 2 if precision == "fp32" else 1
  return layers * per_layer * scale


def estimate(params, optimizer="adam", precision="mixed", activation_bytes=0):
  """The model-state estimate for `params` parameters; returns an Estimate."""
  if isinstance(params, bool) or not isinstance(params, int) or params < 1:
    raise EstimateError(f"parameter count must be a positive integer, got "
                        f"{params!r}")
  if precision not in PRECISIONS:
    raise EstimateError(f"unknown precision '{precision}'; choose one of: "
                        f"{', '.join(PRECISIONS)}")
  opt = canonical_optimizer(optimizer)
  states, what = _OPTIMIZERS[opt]
  if precision == "fp32":
    lines = [("weights (fp32)", "weights", 4)]
  else:
    lines = [("weights (16-bit)", "weights", 2),
             ("fp32 master copy of weights", "optimizer", 4)]
  if states:
    lines.append((f"optimizer state: {what} (fp32)", "optimizer", 4 * states))
  lines.append(("gradients (fp32)" if precision == "fp32" else
                "gradients (16-bit)", "gradients", 4 if precision == "fp32" else 2))
  components = [Component(name, group, bpp, bpp * params)
                for name, group, bpp in lines]
  if activation_bytes:
    components.append(Component("activations (one micro-batch)", "activations",
                                0, int(activation_bytes)))
  return Estimate(params=params, optimizer=opt, precision=precision,
                  components=components, activation_bytes=int(activation_bytes))
