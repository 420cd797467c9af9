"""A search result as text: the best candidates, and why the winner won.

The reasons compare the winner with what a user would try instead: plain
data parallelism over every device, the runner-up (naming the part of the
step where the winner saves the most), and the fastest candidate overall
when it does not fit the memory cap.
"""
import dataclasses

from tfsplit.plan import space
from tfsplit.report import format_table
from tfsplit.units import format_bytes


def format_time(seconds):
  """Seconds as a short time with its unit: 12.9 us, 3.4 ms, 1.2 s."""
  for unit, scale in (("s", 1.0), ("ms", 1e-3)):
    if seconds >= scale:
      return f"{seconds / scale:.4g} {unit}"
  return f"{seconds * 1e6:.4g} us"


def _against(what, other, best, result):
  """'WHAT needs X per device, over the cap' or 'WHAT fits but takes T (P
  slower)': an alternative to the best plan, priced."""
  if not space.fits(other, result.usable):
    return (f"{what} needs {format_bytes(other.memory)} per device, over the "
            f"{format_bytes(result.usable)} " + ("plans may use" if result.reserve else "cap"))
  return (f"{what} fits but takes {format_time(other.step_time)} "
          f"({_pct(other.step_time, best.step_time)} slower)")


def _pct(a, b):
  return f"{100 * (a / b - 1):.1f}%" if b else "n/a"


_PARTS = (("pipeline_time", "compute and pipeline bubble"),
          ("sync_time", "gradient all-reduce over dp"),
          ("update_time", "optimizer update"))


def reasons(result, costing):
  """Lines saying why result.best won."""
  best = result.best
  c = best.candidate
  out = []
  n = result.devices
  profile = costing.profile
  if c.dp != n or c.microbatches != 1 or c.zero or c.recompute != "none":
    if profile.batch % n:
      out.append(f"plain data parallelism (dp={n}) cannot split the batch of "
                 f"{profile.batch} over {n} devices")
    else:
      plain = costing.evaluate(space.Candidate(n, 1, 1), [(0, costing.n)])
      out.append(_against(f"plain data parallelism (dp={n})", plain, best, result))
  if c.zero >= 3:
    sharded = costing.evaluate(dataclasses.replace(c, zero=1), best.ranges)
    out.append("zero=3 holds the weights 1/dp per device; " +
               _against("the same plan with zero=1", sharded, best, result))
  fastest = result.fastest
  if fastest is not None and fastest.step_time < best.step_time:
    out.append(f"the fastest candidate, {fastest.label()} "
               f"({format_time(fastest.step_time)}), needs {format_bytes(fastest.memory)} per "
               f"device, over the cap")
  if len(result.ranked) > 1:
    second = result.ranked[1]
    key, what = max(_PARTS, key=lambda p: getattr(second, p[0]) - getattr(best, p[0]))
    saved = getattr(second, key) - getattr(best, key)
    if saved > 0:
      out.append(f"beats the runner-up, {second.label()}, by "
                 f"{_pct(second.step_time, best.step_time)}: {format_time(saved)} less "
                 f"{what}")
    elif best.memory <= second.memory:
      out.append(f"ties the runner-up, {second.label()}, on time and needs "
                 f"{format_bytes(second.memory - best.memory)} less memory per device")
    else:
      out.append(f"ties the runner-up, {second.label()}, on time with fewer "
                 "micro-batches (each costs per-op overhead on a real machine), for "
                 f"{format_bytes(best.memory - second.memory)} more memory per device")
  out += _expert_reasons(result, costing)
  out += _schedule_reasons(result)
  if c.replicate:
    names = ", ".join(profile.layers[i].name for i in c.replicate)
    out.append(f"replicates {names} over tp instead of splitting: each block's "
               "all-reduces cost more than the compute tp would save")
  if c.offload:
    out.append("offloads the optimizer state to the host: this mesh does not fit "
               "without, and the plans that fit without are slower")
  if c.pp > 1:
    stages = ", ".join(f"[{a}, {b})" for a, b in best.ranges)
    out.append(f"stage cut over the {costing.n} layers: {stages}; slowest stage "
               f"{format_time(max(best.stage_time))} per micro-batch, bubble "
               f"{100 * best.bubble:.1f}%")
  return out


def _schedule_reasons(result):
  """Of a pipelined winner: its schedule against the fastest fitting plan
  of each other schedule (1f1b and the zero-bubble ones)."""
  best = result.best
  c = best.candidate
  if c.pp == 1 or not result.best_by_schedule:
    return []
  what = {"1f1b": "1f1b (each backward whole, at most S - s micro-batches in flight)",
          "zb-h1": "zb-h1 (weight gradients moved into the bubble, 1f1b's peak "
                   "micro-batches on every stage)",
          "zb-h2": "zb-h2 (forwards run ahead to fill the warm-up, weight gradients the "
                   "drain, up to 2S - 1 micro-batches in flight)"}
  others = []
  for name in ("1f1b", "zb-h1", "zb-h2"):
    other = result.best_by_schedule.get(name)
    if name == c.schedule:
      continue
    if other is None:
      others.append(f"no {name} plan fits")
    else:
      others.append(f"the fastest {name} plan, {other.label()}, takes "
                    f"{format_time(other.step_time)} ({_pct(other.step_time, best.step_time)} "
                    f"slower), bubble {100 * other.bubble:.1f}%, "
                    f"{format_bytes(other.memory)} per device")
  return [f"runs {what.get(c.schedule, c.schedule)}: bubble {100 * best.bubble:.1f}%, "
          f"{format_bytes(best.memory)} per device; " + "; ".join(others)]


def _expert_reasons(result, costing):
  """Of a model with experts: what splitting them over ep does in the
  winner, and the fastest plan of the other kind."""
  if not result.best_by_ep:
    return []
  best = result.best
  c = best.candidate
  other = result.best_by_ep.get(c.ep == 1)
  if c.ep > 1:
    experts = float(costing.profile.experts_bytes)
    what = (f"splits the experts over ep={c.ep}: each device holds "
            f"{format_bytes(experts / c.ep / c.pp / c.tp)} of the "
            f"{format_bytes(experts)} of expert weights, and each MoE layer's tokens go to "
            "their experts by all-to-all")
    kind = "without ep"
  else:
    what = "keeps each device's experts whole (no ep axis)"
    kind = "with ep"
  if other is None:
    return [f"{what}; no plan {kind} priced fits"]
  return [f"{what}; the fastest plan {kind}, {other.label()}, takes "
          f"{format_time(other.step_time)} ({_pct(other.step_time, best.step_time)} slower)"]


def lines(result, costing, what="the model", cluster="", top=5):
  """The table of the best candidates and the reasons, as text lines."""
  p = costing.profile.summary()
  cap = (f", {format_bytes(result.device_memory)} each" if result.device_memory
         else "")
  if result.device_memory and result.reserve:
    cap += (f" ({100 * result.reserve:g}% kept in reserve: plans fit "
            f"{format_bytes(result.usable)})")
  out = [f"planned {what} for {result.devices} devices of {cluster}{cap}: "
         f"{result.evaluated} candidates priced in {result.seconds:.2f} s",
         f"  model: {p['layers']} layers with parameters ({p['blocks']} repeated "
         f"blocks), batch {p['batch']}, {format_bytes(p['params_bytes'])} of weights, "
         f"{format_bytes(p['slot_bytes'])} of optimizer state"]
  rows = [[str(k + 1), e.label(), format_time(e.step_time), format_bytes(e.memory),
           f"{100 * e.bubble:.1f}%", format_time(e.pipeline_time), format_time(e.sync_time),
           format_time(e.update_time)]
          for k, e in enumerate(result.ranked[:top])]
  out += format_table(["rank", "plan", "step time", "memory/device", "bubble",
                       "compute", "dp sync", "update"], rows, "<<" + ">" * 6,
                      indent="  ").split("\n")
  out.append("why the winner won:")
  out += [f"  - {r}" for r in reasons(result, costing)]
  return out
