"""Numeric verification: run an original and a rewritten graph, compare.

Both graphs get the same seeded variable values (the rewritten one as shards,
through its manifest) and the same seeded inputs; they run `steps` times (a
training step updates its variables each time). Every output (every device's
copy of it), every shard of every variable, and every variable's update are
compared by `tfsplit.runtime.compare`; the original runs a second time on the
batch in reverse order to measure its own rounding noise.

A graph computing in bfloat16 or float16 is verified twice: both graphs
raised to float32 (graph/precision.py), which must agree as any float32
split does (a wrong shard is wrong there too), and both as they are, each
shard's update within RMS_NOISE_FACTOR times the precision's own spread
(the raised original's result against the original's). So is a float32
step whose gradients the rewrite reduced in bfloat16 (the manifest's
"gradient_reduce"): raised, it must agree exactly; as it is, it is held to
the spread of the original with those gradients rounded to bfloat16 once.
"""
import collections
import hashlib

import numpy as np
import tensorflow as tf

from tfsplit.errors import TfsplitError
from tfsplit.graph import Graph, load_graph
from tfsplit.graph import precision as precision_lib
from tfsplit.graph.endpoints import graph_outputs
from tfsplit.passes import manifest as manifest_lib
from tfsplit.runtime import compare as compare_lib
from tfsplit.runtime import shards as shards_lib
from tfsplit.runtime.graph_function import import_graph
from tfsplit.runtime.seeds import seeded_inputs, seeded_variable_values

VerifyReport = compare_lib.Report


def batch_size_of(inputs):
  """The most common leading dimension of the (rank >= 1) inputs, or None."""
  sizes = collections.Counter(np.shape(x)[0] for x in inputs if np.ndim(x) >= 1)
  return sizes.most_common(1)[0][0] if sizes else None


def reverse_batch(values, batch):
  """Every value whose leading dimension is the batch, in reverse batch order."""
  return [np.asarray(x)[::-1].copy() if batch and np.ndim(x) >= 1 and
          np.shape(x)[0] == batch else x for x in values]


def short_device(device):
  """'/job:localhost/replica:0/task:0/device:CPU:1' -> 'CPU:1';
  '/job:worker/replica:0/task:1/device:CPU:0' -> 'task:1/CPU:0'."""
  device = str(device)
  short = device.rsplit("device:", 1)[-1]
  if "/job:" in device and "/job:localhost/" not in device and "/task:" in device:
    short = "task:" + device.split("/task:", 1)[1].split("/", 1)[0] + "/" + short
  return short


def check_pair(original, rewritten, manifest, names=("the original", "the rewritten graph")):
  """Refuses in one line, before anything runs, a pair that is not what it
  claims: the original a split graph (arguments swapped), a split graph
  without a manifest, or a manifest whose shards are not the rewritten
  graph's variables (another split's manifest). `manifest` is
  {variable: shard entry} or None; `names` say how the two were given."""
  from tfsplit.graph.variables import find_variables  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime.graph_function import is_split  # pylint: disable=import-outside-toplevel
  first, second = names
  if is_split(original):
    hint = (" (the arguments look swapped: the unsplit graph comes first, "
            "tfsplit verify ORIGINAL REWRITTEN)" if not is_split(rewritten) else "")
    raise TfsplitError(f"{first} is a graph written by tfsplit rewrite{hint}; give the graph "
                       "the rewrite was made from as the original")
  if manifest is None:
    if is_split(rewritten):
      raise TfsplitError(f"{second} is a split graph but no shard manifest was found for it; "
                         "give the '.manifest.json' tfsplit rewrite wrote beside it "
                         "(--manifest)")
    return
  # Names and shapes: a shard on another device than the manifest says is
  # a broken split, which the comparison itself must catch (exit 1).
  held = {v.name: v for v in find_variables(Graph(rewritten))}
  for variable, entry in sorted(manifest.items()):
    for shard in entry["shards"]:
      info = held.get(shard["name"])
      if info is not None and list(info.shape or ()) == list(shard["shape"]):
        continue
      what = ("is not a variable of it" if info is None else
              f"has shape {list(info.shape or ())} there, not {list(shard['shape'])}")
      raise TfsplitError(f"the manifest does not describe {second}: shard '{shard['name']}' "
                         f"of variable '{variable}' {what}; give the manifest tfsplit "
                         "rewrite wrote beside it (--manifest)")


def _bound_batch(original_graph, rewritten):
  """The original (`original_graph`, its Graph) with an unknown batch
  dimension bound to the batch the rewritten graph was split for (rewrite
  --batch), so both run one batch; None when nothing is to bind."""
  from tfsplit.graph.endpoints import bind_batch, graph_inputs, unbound_batch_inputs  # pylint: disable=import-outside-toplevel
  unbound = unbound_batch_inputs(original_graph)
  if not unbound:
    return None
  split = Graph(rewritten)
  shapes = {name: split.node(name).attr["shape"].shape for name in graph_inputs(split)}
  name = unbound[0][0]
  if name not in shapes or not shapes[name].dim or shapes[name].dim[0].size < 0:
    return None   # seeded_inputs names the input that needs a static shape
  return bind_batch(original_graph.graph_def, shapes[name].dim[0].size)


def _run(graph_def, variables, inputs, steps, outputs=None):
  """[(outputs, {variable: value})] after each of `steps` runs."""
  fn = import_graph(graph_def, variables, outputs=outputs)
  tensors = [tf.constant(x) for x in inputs]
  out = []
  for step in range(steps):
    try:
      results = [o.numpy() for o in fn(*tensors)]
    except tf.errors.DeadlineExceededError as e:
      # A split graph's collectives carry the rewrite's --collective-timeout.
      first = (str(e).strip().splitlines() or [""])[0]
      raise TfsplitError(f"step {step + 1} of the rewritten graph stopped: a collective "
                         f"waited past its timeout ({first[:160]}); a device never joined "
                         "it, so the graph was not written for this mesh or was edited "
                         "after the rewrite: rewrite it again") from None
    out.append((results, {k: v.numpy() for k, v in variables.items()}))
  return out


def _run_on_cluster(graph_def, values, inputs, steps, outputs, cluster, timeout_seconds):
  """_run's results for a graph placed on `cluster`'s workers, driven by one
  Session client (runtime/cluster.py); `values` are {variable: numpy value}
  by the names the graph records (shard names for a split graph)."""
  from tfsplit.runtime import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
  runner = cluster_lib.ClusterRunner(graph_def, values, cluster, timeout_seconds)
  try:
    names, out = list(values), []
    for _ in range(steps):
      results, _ = runner.run(inputs, fetch=outputs)
      out.append(([np.asarray(r) for r in results], runner.variable_values(names)))
    return out
  finally:
    runner.close(reset=True)


# The reference runs of the last few originals: checking several rewrites of
# one graph (the mutation tests, a sweep of meshes) runs the original once.
_REFERENCES = collections.OrderedDict()
_MAX_REFERENCES = 4


def _reference(original, values, inputs, steps, n_outputs, fresh):
  """(want, alt, use_noise): the original's outputs and variables after each
  step, the same on the batch reversed (its rounding noise), and whether that
  noise estimate holds (the graph does not depend on batch order)."""
  key = (hashlib.sha256(original.SerializeToString(deterministic=True)).hexdigest(),
         steps, tuple(hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()
                      for x in inputs),
         tuple(sorted((k, hashlib.sha256(v.tobytes()).hexdigest())
                      for k, v in values.items())))
  if key in _REFERENCES:
    _REFERENCES.move_to_end(key)
    return _REFERENCES[key]
  want = _run(original, fresh(values), inputs, steps)
  batch = batch_size_of(inputs)
  alt = [(reverse_batch(o, batch), v) for o, v in
         _run(original, fresh(values), reverse_batch(inputs, batch), steps)]
  pairs = [(w_vars[k], a_vars[k]) for (_, w_vars), (_, a_vars) in zip(want, alt)
           for k in w_vars]
  pairs += [(w, a) for (ws, _), (as_, _) in zip(want, alt) for w, a in zip(ws, as_)]
  use_noise = batch is not None and compare_lib.typical_noise_is_small(pairs)
  if not use_noise:
    alt = [([None] * n_outputs, None)] * steps
  _REFERENCES[key] = (want, alt, use_noise)
  while len(_REFERENCES) > _MAX_REFERENCES:
    _REFERENCES.popitem(last=False)
  return _REFERENCES[key]


def verify(original, rewritten, manifest=None, steps=1, seed=0,
           rtol=compare_lib.DEFAULT_RTOL, int_max=None, every_step=False,
           update_rtol=compare_lib.DEFAULT_UPDATE_RTOL, cluster=None,
           timeout_seconds=600.0, names=("the original", "the rewritten graph")):
  """compare.Report of `rewritten` against `original` (GraphDefs or paths).

  A pair that is not what it claims (check_pair: swapped, a split graph
  without its manifest, another split's manifest) is refused in one line
  before anything runs; `names` say how the two were given.

  A rewritten graph placed on worker tasks (`tfsplit rewrite --cluster`) runs
  on `cluster` (default TF_CONFIG: see runtime/cluster.py), each step bounded
  by `timeout_seconds`; the original runs in this process.

  manifest: the rewritten graph's shard manifest (a path, the manifest dict
  `tfsplit rewrite` writes, or {variable: shard entry}); None if its variables
  are the original's.
  every_step: compare the variables after every step, not only the last
  (their comparisons are labelled 'after step k').
  """
  original = load_graph(original) if not hasattr(original, "node") else original
  rewritten = load_graph(rewritten) if not hasattr(rewritten, "node") else rewritten
  manifest_arg = manifest
  if isinstance(manifest, str):
    manifest = manifest_lib.read(manifest)
  output_copies, lowered = {}, None
  if manifest is not None and isinstance(manifest.get("variables"), dict):
    output_copies = manifest.get("outputs") or {}
    lowered = manifest.get("gradient_reduce")
    if lowered:   # the raised check below compares without it
      manifest_arg = dict(manifest, gradient_reduce=None)
    manifest = manifest["variables"]
  check_pair(original, rewritten, manifest, names)
  original_graph = Graph(original)
  bound = _bound_batch(original_graph, rewritten)
  if bound is not None:
    original, original_graph = bound, Graph(bound)
  values = seeded_variable_values(original_graph, seed)
  if manifest is not None and set(manifest) != set(values):
    missing, extra = sorted(set(values) - set(manifest)), sorted(set(manifest) - set(values))
    raise TfsplitError(
        "the manifest does not describe the original graph's variables ("
        + (f"not in the manifest: {', '.join(missing[:3])}" if missing else "")
        + ("; " if missing and extra else "")
        + (f"not in the original: {', '.join(extra[:3])}" if extra else "")
        + "); give the original graph (and --signature) the rewrite was made from")
  inputs = seeded_inputs(original_graph, seed, int_max)
  outputs = graph_outputs(original_graph)

  def fresh(named_values):
    return {k: tf.Variable(v) for k, v in named_values.items()}

  precision = precision_lib.compute_precision(original)
  as_is = original   # the original in the precision the rewritten graph computes
  if lowered and precision == "float32":
    # Gradients reduced in a lower dtype: the original in that precision
    # rounds each of those gradients once (graph/precision.py).
    precision = lowered["dtype"]
    as_is = precision_lib.rounded_tensors(original, lowered["tensors"], precision)
  raised = None
  if precision in compare_lib.REDUCED_PRECISIONS:
    # Exactness is checked on both graphs raised to float32; the run in
    # their own precision is held to the precision's spread (the float32
    # reference against the reference), per shard by RMS.
    raised = verify(precision_lib.promoted(original), precision_lib.promoted(rewritten),
                    manifest_arg, steps, seed, rtol, int_max, every_step, update_rtol,
                    cluster, timeout_seconds, names)
    want32 = _reference(precision_lib.promoted(original), values, inputs, steps,
                        len(outputs), fresh)[0]

  from tfsplit.runtime import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
  on_cluster = cluster_lib.cluster_for_graph(rewritten, cluster)
  want, alt, use_noise = _reference(as_is, values, inputs, steps, len(outputs), fresh)
  if raised is not None:
    alt, use_noise = want32, True
  copies = [(name, d, tensor) for name in outputs for d, tensor in output_copies.get(name, [])]
  fetch = outputs + [t for _, _, t in copies]
  if on_cluster is not None:
    got = _run_on_cluster(rewritten, shards_lib.shard_values(manifest, values)
                          if manifest is not None else values, inputs, steps, fetch,
                          on_cluster, timeout_seconds)
  else:
    new_vars = (shards_lib.create_shard_variables(manifest, values) if manifest is not None
                else fresh(values))
    got = _run(rewritten, new_vars, inputs, steps, fetch)
  if manifest is not None:
    manifest = {name: dict(entry, shards=[dict(s, device=short_device(s["device"]))
                                          for s in entry["shards"]])
                for name, entry in manifest.items()}

  # An output of a 16-bit step (the loss) is held to one rounding in its
  # precision besides the spread: the split re-rounds what the original
  # rounded once (a batch-split or partial-sum reduction of 16-bit terms),
  # and exactness is the float32 check's.
  out_rtol = rtol if raised is None else max(rtol, compare_lib.UNIT_ROUNDOFF[precision])
  comparisons = []
  for step, ((w_out, w_vars), (a_out, a_vars), (g_out, g_vars)) in enumerate(
      zip(want, alt, got)):
    for k, name in enumerate(outputs):
      noise_abs = compare_lib.noise(w_out[k], a_out[k])
      what = f"step {step + 1} {name}"
      comparisons.append(compare_lib.compare("output", what, g_out[k], w_out[k], out_rtol,
                                             noise_abs))
      mine = [(short_device(d), g_out[len(outputs) + j])
              for j, (o, d, _) in enumerate(copies) if o == name]
      comparisons.extend(compare_lib.compare("output", f"{what} on {dev}", v, w_out[k], out_rtol,
                                             noise_abs) for dev, v in mine)
      comparisons.extend(compare_lib.compare_copies(what, mine, rtol, noise_abs))
    if every_step or step == steps - 1:
      found = compare_lib.compare_variables(manifest, values, w_vars, g_vars, a_vars, rtol,
                                            update_rtol, None if raised is None else precision)
      if every_step:
        for c in found:
          c.what = f"after step {step + 1}: {c.what}"
      comparisons.extend(found)
  if raised is None:
    return compare_lib.Report(comparisons, rtol, use_noise, update_rtol)
  for c in raised.comparisons:
    c.what = f"float32: {c.what}"
  for c in comparisons:
    c.what = f"{precision}: {c.what}"
  return compare_lib.Report(raised.comparisons + comparisons, rtol, raised.noise_estimated,
                            update_rtol, precision)


def verify_files(original, rewritten, manifest=None, signature=None, variables=None,
                 **options):
  """verify() of two graph files, as `tfsplit verify` runs it.

  manifest: path of the rewritten graph's manifest (default: beside it, if
  present). signature / variables: how to load `original` (see load_graph).
  options: verify()'s steps, seed, rtol, int_max, update_rtol, cluster,
  timeout_seconds.
  """
  from tfsplit.graph import recover  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import devices as devices_lib  # pylint: disable=import-outside-toplevel
  # Devices first: loading a SavedModel starts TensorFlow's runtime, after
  # which the logical devices the rewritten graph needs can no longer be made.
  from tfsplit.runtime import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
  rewritten_def = load_graph(rewritten)
  names = (f"ORIGINAL '{original}'", f"REWRITTEN '{rewritten}'")
  if not cluster_lib.needs_cluster(rewritten_def):
    devices_lib.ensure_logical_devices(devices_lib.required_devices(rewritten_def))
  original_def = load_graph(original, signature=signature, variables_from=variables)
  recover.require_variable_shapes(original_def, original, variables)
  return verify(original_def, rewritten_def, manifest_lib.find(rewritten, manifest),
                names=names, **options)
