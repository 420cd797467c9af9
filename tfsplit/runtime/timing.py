"""Timing steps on a machine shared with other work.

A step's time moves with whatever else the machine runs: a burst of other
work lasting a second shifts every call timed in that second. Timing steps
in turns (each step a few calls, round after round) spreads such bursts
over all of them, and the median (or the fastest) of the rounds' medians
drops the rounds a burst hit. Calibration (tfsplit.calibration) and
the benchmarks in tools/ time steps this way.
"""
import math
import statistics
import time

import numpy as np


def timed_call(fn, args):
  """Seconds of one call fn(*args), its first output read back (a
  function's outputs: a tensor, or a list or tuple of them)."""
  t0 = time.perf_counter()
  out = fn(*args)
  while isinstance(out, (list, tuple)) and out:
    out = out[0]
  np.asarray(out)
  return time.perf_counter() - t0


# Timed calls in one turn last at least this long: ten calls of a step
# under a millisecond last less than a burst of other work, which then
# moves the whole turn. Timed both ways in turns, four times, the example
# MLP's one-device step's medians spread 0.39-0.52 ms with ten calls a
# turn and 0.40-0.45 ms with turns of 0.1 s; no step's level moved.
MIN_TURN_SECONDS = 0.05


def take_turns(steps_by_name, warmup, rounds, steps, settle=0,
               min_turn=MIN_TURN_SECONDS):
  """Times each {name: (fn, args)} step: `warmup` unmeasured calls each,
  then `rounds` rounds of `steps` calls, the steps taking turns within a
  round so load from other processes spreads over all of them. A step
  whose `steps` calls would take less than `min_turn` seconds (by its
  warm-up calls) makes that many more calls per turn. With `settle`, each
  turn starts with that many unmeasured calls: a small step timed right
  after a larger one otherwise pays for the switch (caches and the
  intra-op threads' state are the other step's). Returns {name: [seconds
  per call]} and {name: [median seconds per round]}."""
  calls = {}
  for name, (fn, args) in steps_by_name.items():
    warm = [timed_call(fn, args) for _ in range(warmup)]
    calls[name] = (max(steps, math.ceil(min_turn / max(statistics.median(warm), 1e-6)))
                   if warm and min_turn else steps)
  samples = {name: [] for name in steps_by_name}
  round_medians = {name: [] for name in steps_by_name}
  for _ in range(rounds):
    for name, (fn, args) in steps_by_name.items():
      for _ in range(settle):
        timed_call(fn, args)
      times = [timed_call(fn, args) for _ in range(calls[name])]
      samples[name] += times
      round_medians[name].append(statistics.median(times))
  return samples, round_medians


def median_of_rounds(steps_by_name, warmup, rounds, steps, settle=0):
  """{name: seconds}: each step's median round, timed by take_turns."""
  _, round_medians = take_turns(steps_by_name, warmup, rounds, steps, settle)
  return {name: statistics.median(r) for name, r in round_medians.items()}


def fastest_of_rounds(steps_by_name, warmup, rounds, steps, settle=0):
  """{name: seconds}: each step's fastest round (the median call of its
  quietest turn), timed by take_turns. Other work on a shared machine only
  ever slows a turn, and by more the smaller the step: one run's rounds of
  the example MLPs' sub-millisecond steps spread by 2x, with the median
  round falling anywhere between; the fastest is what the step costs when
  the machine is the step's."""
  _, round_medians = take_turns(steps_by_name, warmup, rounds, steps, settle)
  return {name: min(r) for name, r in round_medians.items()}
