"""Numeric verification: run an original and a rewritten graph, compare.

Both graphs get the same seeded variable values (the rewritten one as shards,
through its manifest) and the same seeded inputs; they run `steps` times (a
training step updates its variables each time) and every output, and every
variable afterwards, is compared. Errors are relative to the tensor's scale
(at least 1, since optimizers move every weight by about the learning rate).
"""
import dataclasses
import re
from typing import List

import numpy as np
import tensorflow as tf

from tfsplit.errors import TfsplitError
from tfsplit.graph import Graph, find_variables, load_graph
from tfsplit.graph.layers import graph_outputs
from tfsplit.runtime import shards as shards_lib
from tfsplit.runtime.graph_function import graph_inputs, import_graph

_GATHERS = ("ResourceGather", "GatherV2", "Gather")


@dataclasses.dataclass
class Comparison:
  what: str
  max_abs: float
  max_rel: float


@dataclasses.dataclass
class VerifyReport:
  comparisons: List[Comparison]
  rtol: float

  @property
  def ok(self):
    return all(c.max_rel <= self.rtol for c in self.comparisons)

  @property
  def worst(self):
    return max(self.comparisons, key=lambda c: c.max_rel)

  def table(self, show_all=False, worst=10):
    """Outputs, then the `worst` variables (all with show_all)."""
    outputs = [c for c in self.comparisons if not c.what.startswith("variable ")]
    variables = [c for c in self.comparisons if c.what.startswith("variable ")]
    shown = variables if show_all else sorted(
        variables, key=lambda c: -c.max_rel)[:worst]
    lines = [f"{'compared':60s} {'max abs err':>12s} {'max rel err':>12s}"]
    if variables and not show_all and len(variables) > worst:
      lines[0] += f"   ({len(variables)} variables, {worst} worst shown)"
    for c in outputs + shown:
      flag = "" if c.max_rel <= self.rtol else "  MISMATCH"
      lines.append(f"{c.what[:60]:60s} {c.max_abs:12.3e} {c.max_rel:12.3e}{flag}")
    verdict = "OK" if self.ok else "MISMATCH"
    lines.append(f"{verdict}: worst relative error {self.worst.max_rel:.3e} "
                 f"({self.worst.what}), tolerance {self.rtol:g}")
    return "\n".join(lines)


def _compare(what, got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if got.shape != want.shape:
    raise TfsplitError(f"{what}: shapes differ ({list(got.shape)} vs {list(want.shape)})")
  if not want.size:
    return Comparison(what, 0.0, 0.0)
  diff = np.abs(got - want)
  if np.isnan(diff).any():
    return Comparison(what, float("nan"), float("inf"))
  return Comparison(what, float(diff.max()), float(diff.max() / max(np.abs(want).max(), 1.0)))


def seeded_variable_values(graph, seed=0):
  """{variable name: value}: weights ~ N(0, 0.1), other state ~ U(0, 0.1), ints 0."""
  rng = np.random.RandomState(seed)
  values = {}
  for var in find_variables(graph):
    if var.shape is None or not var.dtype:
      raise TfsplitError(f"variable '{var.name}' (node '{var.node}') has no known shape "
                         "or dtype; cannot make values for it")
    dtype = tf.as_dtype(var.dtype)
    if dtype.is_integer or dtype == tf.bool:
      values[var.name] = np.zeros(var.shape, dtype.as_numpy_dtype)
    elif var.trainable is False:
      values[var.name] = rng.uniform(0, 0.1, var.shape).astype(dtype.as_numpy_dtype)
    else:
      values[var.name] = (rng.randn(*var.shape) * 0.1).astype(dtype.as_numpy_dtype)
  return values


def _int_bound(graph):
  """Ids must index every table they reach; use the smallest gather table."""
  bounds = []
  from tfsplit.graph.shapes import infer_shapes  # pylint: disable=import-outside-toplevel
  shapes = infer_shapes(graph)
  for node in graph.nodes:
    if node.op in _GATHERS:
      info = shapes.get(node.input[0])
      if node.op == "ResourceGather":
        var = next((v for v in find_variables(graph) if v.node == node.input[0]), None)
        if var is not None and var.shape:
          bounds.append(var.shape[0])
      elif info is not None and info.shape and info.shape[0]:
        bounds.append(info.shape[0])
  return min(bounds) if bounds else 8


def seeded_inputs(graph, seed=0, int_max=None):
  rng = np.random.RandomState(seed + 1000)
  int_max = int_max or _int_bound(graph)
  out = []
  for name in graph_inputs(graph):
    node = graph.node(name)
    dtype = tf.as_dtype(node.attr["dtype"].type)
    shape = tf.TensorShape(node.attr["shape"].shape)
    if not shape.is_fully_defined():
      raise TfsplitError(f"input '{name}' has shape {shape}; verification needs static "
                         "input shapes")
    if dtype.is_integer:
      out.append(rng.randint(0, int_max, shape.as_list()).astype(dtype.as_numpy_dtype))
    else:
      out.append(rng.randn(*shape.as_list()).astype(dtype.as_numpy_dtype))
  return out


def _device_count(graph_def):
  ids = [int(m.group(1)) for n in graph_def.node
         for m in [re.search(r"device:(?:CPU|GPU):(\d+)$", n.device)] if m]
  return max(ids) + 1 if ids else 1


def verify(original, rewritten, manifest=None, steps=1, seed=0, rtol=1e-4, int_max=None):
  """VerifyReport comparing `rewritten` against `original` (GraphDefs or paths).

  manifest: the rewritten graph's shard manifest (dict or JSON path); None if
  its variables are the original's.
  """
  original = load_graph(original) if not hasattr(original, "node") else original
  rewritten = load_graph(rewritten) if not hasattr(rewritten, "node") else rewritten
  if isinstance(manifest, str):
    manifest = shards_lib.load_manifest(manifest)
  original_graph = Graph(original)
  values = seeded_variable_values(original_graph, seed)
  inputs = [tf.constant(x) for x in seeded_inputs(original_graph, seed, int_max)]
  outputs = graph_outputs(original_graph)

  def make_vars(named_values):
    return {k: tf.Variable(v) for k, v in named_values.items()}

  ref_vars = make_vars(values)
  ref_fn = import_graph(original, ref_vars)
  if manifest is not None:
    new_vars = shards_lib.create_shard_variables(manifest, values)
  else:
    new_vars = make_vars(values)
  new_fn = import_graph(rewritten, new_vars)
  comparisons = []
  for step in range(steps):
    want = ref_fn(*inputs)
    got = new_fn(*inputs)
    for name, w, g in zip(outputs, want, got):
      comparisons.append(_compare(f"step {step + 1} output {name}", g.numpy(), w.numpy()))
  if manifest is not None:
    got_values = shards_lib.full_values(manifest, {k: v.numpy() for k, v in new_vars.items()})
  else:
    got_values = {k: v.numpy() for k, v in new_vars.items()}
  for name, var in ref_vars.items():
    comparisons.append(_compare(f"variable {name}", got_values[name], var.numpy()))
  return VerifyReport(comparisons, rtol)


def ensure_logical_devices(count, kind="CPU"):
  """Splits the first physical device of `kind` into `count` logical ones.

  Must run before TensorFlow initialises its devices; later calls that ask
  for no more devices than exist are fine.
  """
  physical = tf.config.list_physical_devices(kind)
  if not physical:
    raise TfsplitError(f"no {kind} device to run on")
  try:
    current = tf.config.get_logical_device_configuration(physical[0])
    if current is None or len(current) < count:
      tf.config.set_logical_device_configuration(
          physical[0], [tf.config.LogicalDeviceConfiguration()] * count)
  except RuntimeError:
    have = len(tf.config.list_logical_devices(kind))
    if have < count:
      raise TfsplitError(f"the graph needs {count} {kind} devices but TensorFlow is "
                         f"already running with {have}") from None


def required_devices(graph_def):
  return _device_count(graph_def)
