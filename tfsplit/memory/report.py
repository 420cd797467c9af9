"""The size-only `tfsplit estimate --params P` report: memory of model states
per precision, the devices needed to hold them, and the ZeRO stages.

`model_states(...)` returns (the dict `--format json` prints, text lines).
No TensorFlow: this runs from the parameter count alone.
"""
from tfsplit import units
from tfsplit.errors import EstimateError
from tfsplit.memory import estimator
from tfsplit.report import format_table

_PRECISION_TITLE = {
    "fp32": "fp32",
    "mixed": "mixed precision (16-bit weights and gradients; fp32 master "
             "copy and optimizer state)",
}


def activation_bytes(precision, activations=None, layers=None, hidden=None,
                     seq_len=None, heads=None, micro_batch=1, recompute=False):
  """Activation bytes of one micro-batch on a device: `activations` (a size
  such as '30GB') when given, else estimated from the transformer's shape
  (all of layers, hidden, seq_len, heads), else 0."""
  if activations:
    return units.parse_bytes(activations)
  shape = {"layers": layers, "hidden": hidden, "seq-len": seq_len, "heads": heads}
  if all(v is None for v in shape.values()):
    return 0
  missing = [k for k, v in shape.items() if v is None]
  if missing:
    raise EstimateError("an activation estimate needs --layers, --hidden, "
                        f"--seq-len and --heads; missing --{', --'.join(missing)}")
  return estimator.transformer_activation_bytes(
      layers, hidden, seq_len, micro_batch, heads, recompute=recompute,
      precision=precision)


def model_states(params, device_memory, optimizer="adam", precision="both",
                 zero_devices=64, **activation):
  """The estimate for `params` parameters (a count or text: 100e9, 175B) on
  devices of each size in `device_memory` (bytes); precision 'fp32', 'mixed'
  or 'both'; `activation`: the keyword arguments of activation_bytes."""
  params = units.parse_count(params)
  precisions = estimator.PRECISIONS if precision == "both" else (precision,)
  estimates = [estimator.estimate(params, optimizer, p,
                                  activation_bytes=activation_bytes(p, **activation))
               for p in precisions]
  opt = estimates[0].optimizer
  data = {"params": params, "optimizer": opt, "device_memory": list(device_memory),
          "units": "bytes (decimal: 1 GB = 1e9)",
          "precisions": [e.to_json(device_memory, zero_devices) for e in estimates]}
  lines = [f"model states for {units.format_count(params)} parameters "
           f"({params:,}), optimizer {opt}",
           "sizes are decimal (1 GB = 1e9 bytes); device counts are lower bounds: "
           "activations (unless given), workspace and fragmentation are left out"]
  for e in estimates:
    lines.append("")
    lines += estimate_lines(e, device_memory, zero_devices)
  return data, lines


def _table_lines(rows, align):
  return format_table(rows[0], rows[1:], align, indent="  ", rule=False).split("\n")


def estimate_lines(est, memory, zero_devices):
  """One precision's table of model states and its ZeRO table, as lines."""
  mem_heads = [units.format_bytes(m) for m in memory]
  lines = [_PRECISION_TITLE[est.precision]]
  rows = [["", "bytes/param", "size"] + mem_heads]
  blanks = [""] * len(memory)
  grouped = [c for c in est.components if c.group != "activations"]
  subtotal_after = max(i for i, c in enumerate(grouped)
                       if c.group in ("weights", "optimizer"))
  for i, c in enumerate(grouped):
    rows.append([c.name, f"{c.bytes_per_param:g}", units.format_bytes(c.nbytes)] + blanks)
    if i == subtotal_after:
      rows.append(["= weights + optimizer state",
                   f"{est.weights_and_optimizer_per_param:g}",
                   units.format_bytes(est.weights_and_optimizer)] +
                  [str(estimator.devices_needed(est.weights_and_optimizer, m))
                   for m in memory])
  for c in est.components:
    if c.group == "activations":
      rows.append([c.name, "", units.format_bytes(c.nbytes)] + blanks)
  rows.append(["= total", f"{est.bytes_per_param:g}", units.format_bytes(est.total)] +
              [str(estimator.devices_needed(est.total, m)) for m in memory])
  lines += _table_lines(rows, "<>>" + ">" * len(memory))
  lines.append(f"  (columns {', '.join(mem_heads)}: devices needed to hold "
               "the line, split perfectly)")
  lines.append("")
  lines.append(f"ZeRO, {est.precision}, sharded over N = {zero_devices} "
               "devices (P = parameters)")
  rows = [["stage", "shards", "bytes/device", f"at N={zero_devices}"] +
          [f"N for {h}" for h in mem_heads]]
  for r in est.zero(zero_devices):
    fewest = [r.fewest_devices(m, est.params, est.activation_bytes) for m in memory]
    rows.append([str(r.stage), r.label, r.formula, units.format_bytes(r.per_device)] +
                ["-" if n is None else str(n) for n in fewest])
  lines += _table_lines(rows, "><<>" + ">" * len(memory))
  lines.append("  (N for a size: fewest devices at which a device of that "
               "size holds its share; - if none does)")
  return lines
