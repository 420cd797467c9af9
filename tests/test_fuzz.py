"""Seeded mutation fuzzing of the bundled training graphs through the CLI.

Each case mutates one of examples/*_train_tiny.pb (a dangling or deleted
input, a bad port, another op type, a dropped or retyped attr, a cycle, a
duplicate name, a Const without value, a truncated or bit-flipped file, ...),
writes it to a .pb and runs `tfsplit rewrite X -o out.pb --mesh tp=2` and
`tfsplit inspect X` on it. Every outcome must be either success (exit 0, the
graph and its manifest written, the rewritten graph loadable) or exactly one
line `tfsplit <command>: error: ...` on stderr with exit 2, nothing on stdout
and nothing left in the output directory: never a traceback, never a crash.

Cases run in driver processes (this file run as a script), many per process
(in-process `tfsplit.cli.run` calls, with file descriptors 1 and 2 captured
per command); a driver that dies (an abort inside TensorFlow's C++) names,
through its progress file, the case that killed it, which is recorded as a
failure, and a new driver carries on after it.

    TFSPLIT_FUZZ_CASES=5000 TFSPLIT_FUZZ_SEED=7 python -m pytest -q -s -m slow tests/test_fuzz.py

prints the outcome histogram; TFSPLIT_FUZZ_REPORT=path.json keeps every case.
"""
import collections
import contextlib
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import time
import traceback

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*_train_tiny.pb")))
CI_CASES = 150
SLOW_CASES = 2000
WORKERS = 2


# --- mutations (pure protobuf; used by the driver) ---------------------------------
class Skip(Exception):
  """The mutation does not apply to this graph/node; another is drawn."""


def _pick(rng, items):
  items = list(items)
  if not items:
    raise Skip()
  return rng.choice(items)


def _node_with(rng, gd, pred):
  return _pick(rng, [n for n in gd.node if pred(n)])


def _data_inputs(node):
  return [i for i, t in enumerate(node.input) if not t.startswith("^")]


def _registered_ops():
  """{number of input args: [op names]} over TensorFlow's registered ops."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tensorflow.python.framework import op_def_registry  # pylint: disable=import-outside-toplevel
  by_arity = collections.defaultdict(list)
  for name in sorted(dir(tf.raw_ops)):
    op_def = op_def_registry.get(name)
    if op_def is not None:
      by_arity[len(op_def.input_arg)].append(name)
  return by_arity


_OPS = {}


def _op_pool(gd):
  if "registry" not in _OPS:
    _OPS["registry"] = _registered_ops()
  from tensorflow.python.framework import op_def_registry  # pylint: disable=import-outside-toplevel
  local = collections.defaultdict(set)
  for node in gd.node:
    op_def = op_def_registry.get(node.op)
    if op_def is not None:
      local[len(op_def.input_arg)].add(node.op)
  return _OPS["registry"], {k: sorted(v) for k, v in local.items()}


def _arity(op):
  from tensorflow.python.framework import op_def_registry  # pylint: disable=import-outside-toplevel
  op_def = op_def_registry.get(op)
  return None if op_def is None else len(op_def.input_arg)


def m_delete_input(gd, rng):
  node = _node_with(rng, gd, lambda n: n.input)
  i = rng.randrange(len(node.input))
  text = node.input[i]
  del node.input[i]
  return f"{node.name}: deleted input {i} '{text}'"


def m_dangling_input(gd, rng):
  node = _pick(rng, gd.node)
  ghost = f"ghost_{rng.randrange(1000)}" + _pick(rng, ["", ":0", ":1"])
  how = rng.choice(["append", "replace", "control"])
  if how == "replace" and _data_inputs(node):
    node.input[rng.choice(_data_inputs(node))] = ghost
  elif how == "control":
    node.input.append("^" + ghost.split(":")[0])
  else:
    node.input.insert(len(_data_inputs(node)), ghost)
  return f"{node.name}: {how} dangling '{ghost}'"


def m_bad_port(gd, rng):
  node = _node_with(rng, gd, _data_inputs)
  i = rng.choice(_data_inputs(node))
  src = node.input[i].split(":")[0]
  port = rng.choice([1, 2, 3, 5, 17, 1000, 2 ** 31, 2 ** 40])
  node.input[i] = f"{src}:{port}"
  return f"{node.name}: input {i} -> '{src}:{port}'"


def m_rewire_input(gd, rng):
  node = _node_with(rng, gd, _data_inputs)
  i = rng.choice(_data_inputs(node))
  src = _pick(rng, gd.node).name
  node.input[i] = src
  return f"{node.name}: input {i} -> '{src}'"


def m_swap_inputs(gd, rng):
  node = _node_with(rng, gd, lambda n: len(_data_inputs(n)) >= 2)
  a, b = rng.sample(_data_inputs(node), 2)
  node.input[a], node.input[b] = node.input[b], node.input[a]
  return f"{node.name}: swapped inputs {a} and {b}"


def _change_op(gd, rng, same_arity):
  registry, local = _op_pool(gd)
  node = _node_with(rng, gd, lambda n: _arity(n.op) is not None)
  arity = _arity(node.op)
  pool = registry if rng.random() < 0.5 else local
  if same_arity:
    choices = [op for op in pool.get(arity, ()) if op != node.op]
  else:
    choices = [op for k, ops in sorted(pool.items()) if k != arity for op in ops]
  old, node.op = node.op, _pick(rng, choices)
  return f"{node.name}: op {old} -> {node.op}"


def m_op_same_arity(gd, rng):
  return _change_op(gd, rng, True)


def m_op_other_arity(gd, rng):
  return _change_op(gd, rng, False)


def m_op_unknown(gd, rng):
  node = _pick(rng, gd.node)
  old, node.op = node.op, rng.choice(["MyCustomOp", "", "Const ", "matmul"])
  return f"{node.name}: op {old} -> {node.op!r}"


def m_drop_attr(gd, rng):
  node = _node_with(rng, gd, lambda n: n.attr)
  key = _pick(rng, sorted(node.attr))
  del node.attr[key]
  return f"{node.name} ({node.op}): dropped attr '{key}'"


_DTYPES = [1, 2, 3, 4, 5, 6, 7, 9, 10, 14, 19, 20, 21]  # float ... resource, variant
_BAD_DTYPES = [0, 101, 999, 23, 30]


def m_retype_attr(gd, rng):
  """A 'type' attr (T, dtype, DstT, ...) set to another dtype."""
  node = _node_with(rng, gd, lambda n: any(v.WhichOneof("value") == "type"
                                           for v in n.attr.values()))
  key = _pick(rng, sorted(k for k, v in node.attr.items()
                          if v.WhichOneof("value") == "type"))
  old = node.attr[key].type
  new = rng.choice(_BAD_DTYPES) if rng.random() < 0.2 else rng.choice(
      [d for d in _DTYPES if d != old])
  node.attr[key].type = new
  return f"{node.name} ({node.op}): attr {key} {old} -> {new}"


def m_attr_kind(gd, rng):
  """An attr value replaced by a value of another kind."""
  node = _node_with(rng, gd, lambda n: n.attr)
  key = _pick(rng, sorted(node.attr))
  value = node.attr[key]
  kind = rng.choice(["i", "f", "b", "s", "type", "shape", "list", "empty"])
  value.Clear()
  if kind == "i":
    value.i = rng.choice([0, 1, -1, 7, 2 ** 40])
  elif kind == "f":
    value.f = 0.5
  elif kind == "b":
    value.b = True
  elif kind == "s":
    value.s = b"fuzz"
  elif kind == "type":
    value.type = rng.choice(_DTYPES)
  elif kind == "shape":
    value.shape.dim.add(size=rng.choice([-1, 0, 3]))
  elif kind == "list":
    value.list.i.extend([1, 2])
  return f"{node.name} ({node.op}): attr {key} -> a {kind}"


def m_attr_value(gd, rng):
  """An attr keeps its kind but gets another value."""
  node = _node_with(rng, gd, lambda n: n.attr)
  key = _pick(rng, sorted(node.attr))
  value = node.attr[key]
  kind = value.WhichOneof("value")
  if kind == "i":
    value.i = rng.choice([0, -1, -7, 1, 3, 2 ** 31, 2 ** 62])
  elif kind == "b":
    value.b = not value.b
  elif kind == "f":
    value.f = rng.choice([0.0, -1.0, 1e30, float("nan")])
  elif kind == "s":
    value.s = rng.choice([b"", b"SAME", b"VALID", b"NCHW", b"fuzz", b"\xff\xfe"])
  elif kind == "type":
    value.type = rng.choice(_DTYPES + _BAD_DTYPES)
  elif kind == "shape":
    del value.shape.dim[:]
    value.shape.unknown_rank = False
    for _ in range(rng.choice([0, 1, 2, 3])):
      value.shape.dim.add(size=rng.choice([-2, -1, 0, 1, 3, 7, 2 ** 40]))
  elif kind == "list":
    lst = value.list
    for field in ("i", "type", "s", "shape", "f", "b"):
      items = getattr(lst, field)
      if len(items):
        del items[rng.randrange(len(items))]
        break
    else:
      lst.i.append(-3)
  elif kind == "tensor":
    return _corrupt_tensor(node, value.tensor, rng)
  else:
    raise Skip()
  return f"{node.name} ({node.op}): attr {key} value changed"


def _corrupt_tensor(node, tensor, rng):
  how = rng.choice(["dtype", "shape", "content", "values", "huge"])
  if how == "dtype":
    tensor.dtype = rng.choice(_DTYPES + _BAD_DTYPES)
  elif how == "shape":
    del tensor.tensor_shape.dim[:]
    for _ in range(rng.choice([0, 1, 2, 3])):
      tensor.tensor_shape.dim.add(size=rng.choice([-1, 0, 1, 2, 5]))
  elif how == "content":
    if tensor.tensor_content:
      tensor.tensor_content = tensor.tensor_content[:rng.randrange(
          len(tensor.tensor_content))]
    else:
      tensor.tensor_content = b"\x01\x02\x03"
  elif how == "values":
    tensor.float_val.extend([1.0] * rng.choice([1, 5, 100]))
    tensor.int_val.extend([1] * rng.choice([1, 5]))
  else:
    del tensor.tensor_shape.dim[:]
    tensor.tensor_shape.dim.add(size=2 ** 20)
    tensor.tensor_shape.dim.add(size=2 ** 20)
  return f"{node.name} ({node.op}): value tensor {how} corrupted"


def m_const_dtype(gd, rng):
  node = _node_with(rng, gd, lambda n: n.op == "Const")
  old = node.attr["dtype"].type
  node.attr["dtype"].type = rng.choice([d for d in _DTYPES if d != old])
  if rng.random() < 0.5:  # the value too: consistent, but not what readers expect
    node.attr["value"].tensor.dtype = node.attr["dtype"].type
  return f"{node.name}: Const dtype {old} -> {node.attr['dtype'].type}"


def m_const_no_value(gd, rng):
  node = _node_with(rng, gd, lambda n: n.op == "Const")
  del node.attr["value"]
  return f"{node.name}: Const without value"


def m_const_corrupt(gd, rng):
  node = _node_with(rng, gd, lambda n: n.op == "Const")
  return _corrupt_tensor(node, node.attr["value"].tensor, rng)


def m_cycle(gd, rng):
  names = {n.name: n for n in gd.node}
  consumer = _node_with(rng, gd, lambda n: any(
      t.lstrip("^").split(":")[0] in names for t in n.input))
  src = names[_pick(rng, [t.lstrip("^").split(":")[0] for t in consumer.input
                          if t.lstrip("^").split(":")[0] in names])]
  if rng.random() < 0.5 or not _data_inputs(src):
    src.input.append("^" + consumer.name)
    how = "control"
  else:
    src.input[rng.choice(_data_inputs(src))] = consumer.name
    how = "data"
  return f"{src.name} <-> {consumer.name} ({how} cycle)"


def m_long_cycle(gd, rng):
  """A cycle through an ancestor several edges up."""
  names = {n.name: n for n in gd.node}
  node = _node_with(rng, gd, lambda n: n.input)
  path = [node]
  for _ in range(rng.randrange(2, 8)):
    srcs = [names[t.lstrip("^").split(":")[0]] for t in path[-1].input
            if t.lstrip("^").split(":")[0] in names]
    if not srcs:
      break
    path.append(rng.choice(srcs))
  if len(path) < 3:
    raise Skip()
  path[-1].input.append("^" + node.name)
  return f"{path[-1].name} -> ... -> {node.name} ({len(path)}-node cycle)"


def m_duplicate_name(gd, rng):
  a, b = rng.sample(list(gd.node), 2)
  if rng.random() < 0.5:
    old, a.name = a.name, b.name
    return f"{old} renamed to existing '{b.name}'"
  gd.node.add().CopyFrom(a)
  return f"{a.name} added twice"


def m_control_first(gd, rng):
  node = _node_with(rng, gd, _data_inputs)
  src = _pick(rng, gd.node).name
  node.input.insert(0, "^" + src)
  return f"{node.name}: control input '^{src}' before its data inputs"


def m_unknown_attr(gd, rng):
  node = _pick(rng, gd.node)
  key = rng.choice(["fuzz", "T2", "_fuzz_private"])
  node.attr[key].i = 3
  return f"{node.name} ({node.op}): added attr '{key}'"


def m_variable_record(gd, rng):
  """tfsplit's recorded variable shape/dtype changed (passes TF's importer)."""
  node = _node_with(rng, gd, lambda n: "_tfsplit_var_shape" in n.attr)
  if rng.random() < 0.6:
    shape = node.attr["_tfsplit_var_shape"].shape
    if shape.dim and rng.random() < 0.6:
      shape.dim[rng.randrange(len(shape.dim))].size = rng.choice([1, 3, 5, 1024, -1])
    else:
      shape.dim.add(size=rng.choice([1, 2, 7]))
    return f"{node.name}: recorded variable shape changed"
  node.attr["_tfsplit_var_dtype"].type = rng.choice([2, 3, 9, 10, 0, 999])
  return f"{node.name}: recorded variable dtype changed"


def m_multi(gd, rng):
  done = []
  for _ in range(rng.choice([2, 3])):
    for _ in range(20):
      try:
        done.append(GRAPH_MUTATIONS[rng.choice(_SINGLE)](gd, rng))
        break
      except Skip:
        continue
  return " + ".join(done)


GRAPH_MUTATIONS = {
    "delete_input": m_delete_input, "dangling_input": m_dangling_input,
    "bad_port": m_bad_port, "rewire_input": m_rewire_input,
    "swap_inputs": m_swap_inputs, "op_same_arity": m_op_same_arity,
    "op_other_arity": m_op_other_arity, "op_unknown": m_op_unknown,
    "drop_attr": m_drop_attr, "retype_attr": m_retype_attr,
    "attr_kind": m_attr_kind, "attr_value": m_attr_value,
    "const_dtype": m_const_dtype, "const_no_value": m_const_no_value,
    "const_corrupt": m_const_corrupt, "cycle": m_cycle, "long_cycle": m_long_cycle,
    "duplicate_name": m_duplicate_name, "control_first": m_control_first,
    "unknown_attr": m_unknown_attr, "variable_record": m_variable_record,
    "multi": m_multi,
}
_SINGLE = sorted(k for k in GRAPH_MUTATIONS if k != "multi")
FILE_MUTATIONS = ["truncate", "flip_bytes", "empty", "garbage"]
ALL_MUTATIONS = sorted(GRAPH_MUTATIONS) + FILE_MUTATIONS


def make_case(seed, index, bases):
  """(base file, mutation, detail, bytes) of case `index`; deterministic."""
  from tensorflow.core.framework import graph_pb2  # pylint: disable=import-outside-toplevel
  rng = random.Random(f"tfsplit-fuzz:{seed}:{index}")
  base = rng.choice(sorted(bases))
  data = bases[base]
  for _ in range(50):
    kind = rng.choice(ALL_MUTATIONS)
    if kind == "truncate":
      n = rng.randrange(1, len(data))
      return base, kind, f"first {n} of {len(data)} bytes", data[:n]
    if kind == "flip_bytes":
      buf = bytearray(data)
      spots = [rng.randrange(len(buf)) for _ in range(rng.choice([1, 2, 4, 16]))]
      for spot in spots:
        buf[spot] ^= rng.randrange(1, 256)
      return base, kind, f"bytes {spots[:4]} flipped", bytes(buf)
    if kind == "empty":
      return base, kind, "", b""
    if kind == "garbage":
      n = rng.choice([1, 16, 4096])
      return base, kind, f"{n} random bytes", bytes(rng.randrange(256) for _ in range(n))
    gd = graph_pb2.GraphDef()
    gd.ParseFromString(data)
    try:
      detail = GRAPH_MUTATIONS[kind](gd, rng)
    except Skip:
      continue
    return base, kind, detail, gd.SerializeToString()
  raise RuntimeError(f"case {index}: no mutation applies")


# --- the driver (this file as a script) ------------------------------------------------
@contextlib.contextmanager
def _captured_fds(out_path, err_path):
  """Points file descriptors 1 and 2 (C++ logging included) at two files."""
  sys.stdout.flush()
  sys.stderr.flush()
  saved = os.dup(1), os.dup(2)
  out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
  err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
  os.dup2(out, 1)
  os.dup2(err, 2)
  try:
    yield
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)
    for fd in (out, err, *saved):
      os.close(fd)


def _error_kind(message):
  """A coarse bucket of a one-line error message, for the histogram."""
  buckets = [
      ("load:empty", "is empty"), ("load:corrupt", "not a valid binary GraphDef"),
      ("load:corrupt", "without a name or op"), ("load:corrupt", "holds no nodes"),
      ("duplicate_name", "defined twice"), ("unknown_op", "does not know"),
      ("no_name_or_op", "has no op"), ("no_name_or_op", "has no name"),
      ("dangling_input", "dangling input"), ("cycle", "cycle"),
      ("input_order", "comes after a control input"),
      ("input_count", "data input(s) but op"), ("bad_port", "output(s)"),
      ("const_value", "its value"), ("tfsplit_attr", "tfsplit attr"),
      ("attr", "attr '"), ("input_dtype", "expects"),
      ("tf_importer", "importer rejected"), ("tf_shape_inference", "shape inference"),
      ("tf_shape_arithmetic", "static shape arithmetic"),
      ("plan:unknown_variable_shape", "has an unknown size"),
  ]
  for kind, needle in buckets:
    if needle in message:
      return kind
  return "other"


def _run_command(cli_run, argv, work, command):
  """Runs one CLI command in-process: (exit code, stdout, stderr, traceback
  of an exception that escaped `tfsplit.cli.run` or None)."""
  out_path = os.path.join(work, f"{command}.stdout")
  err_path = os.path.join(work, f"{command}.stderr")
  crash = None
  with _captured_fds(out_path, err_path):
    try:
      code = cli_run(argv)
    except BaseException:  # pylint: disable=broad-except
      code, crash = None, traceback.format_exc()
  with open(out_path, "rb") as f:
    stdout = f.read().decode("utf-8", "replace")
  with open(err_path, "rb") as f:
    stderr = f.read().decode("utf-8", "replace")
  os.unlink(out_path)
  os.unlink(err_path)
  return code, stdout, stderr, crash


_LOG_PREFIXES = ("WARNING:absl:", "ERROR:absl:", "INFO:absl:")
_RULE_ERROR = "internal error in the split rule"


def _judge_error(command, code, stdout, stderr, crash, out_dir):
  """(outcome, kind, why) for a command that did not succeed."""
  if crash is not None:
    return "FAIL", "traceback", crash.strip().splitlines()[-1]
  lines = [l for l in stderr.splitlines() if l.strip()]
  if code != 2:
    return "FAIL", f"exit {code}", stderr[-300:]
  if "Traceback" in stderr:
    return "FAIL", "traceback", stderr[-300:]
  if len(lines) != 1 or not lines[0].startswith(f"tfsplit {command}: error: "):
    if lines and lines[-1].startswith(f"tfsplit {command}: error: ") and all(
        l.startswith(_LOG_PREFIXES) for l in lines[:-1]):
      return "FAIL", "log lines before the error", stderr[-400:]
    return "FAIL", "not one error line", stderr[-400:]
  if stdout.strip():
    return "FAIL", "stdout on error", stdout[-200:]
  if out_dir is not None and os.listdir(out_dir):
    return "FAIL", "output left", str(sorted(os.listdir(out_dir)))
  return "error", _error_kind(lines[0]), lines[0]


def run_case(cli_run, load_graph, path, work):
  """Both commands on one mutated graph file: {command: (outcome, kind, why)}."""
  result = {}
  out_dir = os.path.join(work, "out")
  os.mkdir(out_dir)
  out = os.path.join(out_dir, "out.pb")
  code, stdout, stderr, crash = _run_command(
      cli_run, ["tfsplit", "rewrite", path, "-o", out, "--mesh", "tp=2"], work, "rewrite")
  if code == 0 and crash is None:
    manifest = os.path.join(out_dir, "out.manifest.json")
    if "Traceback" in stderr:
      result["rewrite"] = ("FAIL", "traceback", stderr[-300:])
    elif sorted(os.listdir(out_dir)) != ["out.manifest.json", "out.pb"]:
      result["rewrite"] = ("FAIL", "outputs", str(sorted(os.listdir(out_dir))))
    else:
      try:
        load_graph(out)
        with open(manifest) as f:
          json.load(f)
        # Success, but a split rule raised and its op was replicated: a
        # tfsplit bug the product logs and survives; counted, not failed.
        rule_errors = [l for l in stderr.splitlines() if _RULE_ERROR in l]
        result["rewrite"] = (("ok", "ok", "") if not rule_errors else
                             ("ok", "rule_internal_error", rule_errors[0][:300]))
      except Exception as e:  # pylint: disable=broad-except
        result["rewrite"] = ("FAIL", "output not loadable",
                             f"{type(e).__name__}: {str(e)[:300]}")
  else:
    result["rewrite"] = _judge_error("rewrite", code, stdout, stderr, crash, out_dir)
  shutil.rmtree(out_dir)

  code, stdout, stderr, crash = _run_command(
      cli_run, ["tfsplit", "inspect", path], work, "inspect")
  if code == 0 and crash is None:
    if "Traceback" in stderr or not stdout.strip():
      result["inspect"] = ("FAIL", "bad success", stderr[-300:])
    else:
      result["inspect"] = ("ok", "ok", "")
  else:
    result["inspect"] = _judge_error("inspect", code, stdout, stderr, crash, None)
  return result


def driver_main(argv):
  """python tests/test_fuzz.py --driver SEED FIRST LAST PROGRESS WORKDIR"""
  seed, first, last = int(argv[1]), int(argv[2]), int(argv[3])
  progress_path, workdir = argv[4], argv[5]
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  sys.path.insert(0, ROOT)
  from tfsplit.cli import run as cli_run  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  bases = {}
  for path in EXAMPLES:
    with open(path, "rb") as f:
      bases[os.path.basename(path)] = f.read()
  with open(progress_path, "a") as progress:
    for index in range(first, last):
      base, kind, detail, data = make_case(seed, index, bases)
      work = os.path.join(workdir, f"case{index}")
      os.mkdir(work)
      path = os.path.join(work, "graph.pb")
      with open(path, "wb") as f:
        f.write(data)
      progress.write(json.dumps({"start": index, "base": base, "mutation": kind,
                                 "detail": detail}) + "\n")
      progress.flush()
      os.fsync(progress.fileno())
      t0 = time.perf_counter()
      result = run_case(cli_run, load_graph, path, work)
      record = {"index": index, "base": base, "mutation": kind, "detail": detail,
                "seconds": round(time.perf_counter() - t0, 3), **result}
      if any(r[0] == "FAIL" for r in result.values()):
        os.replace(path, os.path.join(workdir, f"failed_case{index}.pb"))
      shutil.rmtree(work)
      progress.write(json.dumps(record) + "\n")
      progress.flush()
  return 0


# --- the test side ----------------------------------------------------------------------
def _run_driver_chunk(seed, first, last, workdir, timeout):
  """Runs cases [first, last) in as many driver processes as crashes need."""
  records = {}
  progress_path = os.path.join(workdir, f"progress_{first}.jsonl")
  start = first
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONHASHSEED="0")
  # As a user runs it: a split rule that raises falls back to replication
  # (conftest makes such rules fail the other tests).
  env.pop("TFSPLIT_STRICT_RULES", None)
  while start < last:
    began = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--driver", str(seed), str(start),
         str(last), progress_path, workdir],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
      out, err = proc.communicate(timeout=max(60.0, timeout - (time.monotonic() - began)))
      hung = False
    except subprocess.TimeoutExpired:
      proc.kill()
      out, err = proc.communicate()
      hung = True
    done, started = {}, {}
    with open(progress_path) as f:
      for line in f:
        rec = json.loads(line)
        if "start" in rec:
          started[rec["start"]] = rec
        else:
          done[rec["index"]] = rec
    finished = [i for i in range(start, last) if i in done]
    records.update((i, done[i]) for i in finished)
    next_start = (max(finished) + 1) if finished else start
    if proc.returncode == 0 and next_start >= last:
      break
    # The driver died (or hung) in the case it started last and did not finish.
    victim = next_start
    info = started.get(victim, {"base": "?", "mutation": "?", "detail": "?"})
    why = ("hang" if hung else f"driver died with exit {proc.returncode}")
    tail = (err or b"").decode("utf-8", "replace").strip().splitlines()[-3:]
    records[victim] = ({"index": victim, "base": info["base"], "mutation": info["mutation"],
                    "detail": info["detail"], "seconds": None,
                    "rewrite": ("FAIL", why, " | ".join(tail)),
                    "inspect": ("FAIL", why, "")})
    if victim not in started:  # died before its first case: nothing to skip
      raise RuntimeError(f"fuzz driver failed to start: {' | '.join(tail)}")
    start = victim + 1
    del out
  return list(records.values())


def run_fuzz(num_cases, seed, workdir, workers=WORKERS, timeout=3600.0):
  """Runs `num_cases` cases over `workers` driver chains; returns the records."""
  from concurrent import futures  # pylint: disable=import-outside-toplevel
  bounds = [num_cases * k // workers for k in range(workers + 1)]
  with futures.ThreadPoolExecutor(workers) as pool:
    jobs = [pool.submit(_run_driver_chunk, seed, bounds[k], bounds[k + 1], workdir,
                        timeout) for k in range(workers) if bounds[k] < bounds[k + 1]]
    records = [r for job in jobs for r in job.result()]
  return sorted(records, key=lambda r: r["index"])


def summarize(records):
  """Counts per command and outcome/kind, and the failures."""
  hist = {c: collections.Counter() for c in ("rewrite", "inspect")}
  by_mutation = collections.defaultdict(collections.Counter)
  failures = []
  for rec in records:
    for command in ("rewrite", "inspect"):
      outcome, kind, _ = rec[command]
      hist[command]["ok" if kind == "ok" else f"{outcome}:{kind}"] += 1
    by_mutation[rec["mutation"]][rec["rewrite"][0]] += 1
    if any(rec[c][0] == "FAIL" for c in ("rewrite", "inspect")):
      failures.append(rec)
  return hist, by_mutation, failures


def _fuzz(num_cases, seed, tmp_path):
  num_cases = int(os.environ.get("TFSPLIT_FUZZ_CASES", num_cases))
  seed = int(os.environ.get("TFSPLIT_FUZZ_SEED", seed))
  t0 = time.perf_counter()
  records = run_fuzz(num_cases, seed, str(tmp_path))
  seconds = time.perf_counter() - t0
  hist, by_mutation, failures = summarize(records)
  lines = [f"fuzz: {len(records)} cases (seed {seed}) in {seconds:.1f} s"]
  for command, counts in hist.items():
    lines.append(f"  {command}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
  lines.append("  rewrite outcome per mutation: " + "; ".join(
      f"{m} {dict(c)}" for m, c in sorted(by_mutation.items())))
  print("\n".join(lines))
  report = os.environ.get("TFSPLIT_FUZZ_REPORT")
  if report:
    with open(report, "w") as f:
      json.dump({"seed": seed, "cases": len(records), "seconds": seconds,
                 "histogram": {k: dict(v) for k, v in hist.items()},
                 "records": records}, f, indent=1)
  assert len(records) == num_cases
  assert not failures, f"{len(failures)} of {len(records)} cases failed:\n" + "\n".join(
      f"  case {r['index']} {r['base']} {r['mutation']} ({r['detail']}): "
      f"rewrite {r['rewrite']}, inspect {r['inspect']}" for r in failures[:10])


def test_mutation_fuzz(tmp_path):
  """A few hundred seeded mutations: each a success or one clean error line."""
  _fuzz(CI_CASES, 0, tmp_path)


@pytest.mark.slow
def test_mutation_fuzz_many(tmp_path):
  _fuzz(SLOW_CASES, 1, tmp_path)


# --- the validation behind it, one problem at a time --------------------------------------
def _mlp_graph_def():
  from tensorflow.core.framework import graph_pb2  # pylint: disable=import-outside-toplevel
  graph_def = graph_pb2.GraphDef()
  with open(os.path.join(ROOT, "examples", "mlp_raw_train_tiny.pb"), "rb") as f:
    graph_def.ParseFromString(f.read())
  return graph_def


def _node(graph_def, name):
  return next(n for n in graph_def.node if n.name == name)


def _without_value(g):
  del _node(g, "loss/Const").attr["value"]


def _control_first(g):
  _node(g, "mlp/layer_0/BiasAdd").input.insert(0, "^x")


def _string_t(g):
  _node(g, "mlp/layer_0/Relu").attr["T"].type = 7


def _bad_port(g):
  _node(g, "mlp/layer_0/Relu").input[0] = "mlp/layer_0/BiasAdd:2"


def _wrong_dtype(g):
  _node(g, "mlp/layer_0/MatMul").input[0] = "labels"


def _deleted_input(g):
  del _node(g, "mlp/layer_0/BiasAdd").input[1]


def _foreign_attr(g):
  _node(g, "mlp/layer_0/Relu").attr["alpha"].f = 0.5


def _const_dtype(g):
  _node(g, "loss/Const").attr["dtype"].type = 1


def _recorded_dtype(g):
  _node(g, "mlp/layer_0/MatMul/ReadVariableOp/resource").attr[
      "_tfsplit_var_dtype"].type = 3


def _recorded_shape(g):
  shape = _node(g, "mlp/layer_0/MatMul/ReadVariableOp/resource").attr[
      "_tfsplit_var_shape"].shape
  shape.dim[0].size += 1


def _op_with_line_break(g):
  _node(g, "mlp/layer_0/Relu").op = "Re\nlu"


def _cycle(g):
  _node(g, "mlp/layer_0/MatMul").input.append("^mlp/layer_0/Relu")


@pytest.mark.parametrize("mutate, needles", [
    (_without_value, ["'loss/Const' (op Const)", "attr 'value'", "missing"]),
    (_control_first, ["'mlp/layer_0/BiasAdd'", "control inputs ('^name') must come last"]),
    (_string_t, ["'mlp/layer_0/Relu'", "attr 'T' is string", "allows only"]),
    (_bad_port, ["reads 'mlp/layer_0/BiasAdd:2'", "has 1 output(s)"]),
    (_wrong_dtype, ["'mlp/layer_0/MatMul'", "is int32 but op MatMul expects float32"]),
    (_deleted_input, ["'mlp/layer_0/BiasAdd'", "has 1 data input(s) but op BiasAdd takes 2"]),
    (_foreign_attr, ["has attr 'alpha', which op Relu does not define"]),
    (_const_dtype, ["'loss/Const' (op Const)", "its value is a int32 tensor",
                    "dtype attr says float32"]),
    (_recorded_dtype, ["'mlp/layer_0/MatMul/ReadVariableOp' (op ReadVariableOp)",
                       "importer rejected it", "wrong dtype"]),
    (_recorded_shape, ["importer rejected it", "mlp/layer_0"]),
    (_op_with_line_break, ["uses op 'Re\\nlu'"]),
    (_cycle, ["cycle through node", "mlp/layer_0/MatMul"]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_validation_names_the_problem(mutate, needles):
  from tfsplit.errors import GraphValidationError  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.validate import validate_graph_def  # pylint: disable=import-outside-toplevel
  graph_def = _mlp_graph_def()
  mutate(graph_def)
  before = graph_def.SerializeToString(deterministic=True)
  with pytest.raises(GraphValidationError) as e:
    validate_graph_def(graph_def, "mlp.pb")
  message = str(e.value)
  assert message.startswith("mlp.pb: ") and len(message.splitlines()) == 1, message
  for needle in needles:
    assert needle in message, message
  assert graph_def.SerializeToString(deterministic=True) == before  # not modified


def test_unset_attr_takes_its_default():
  """As tf.graph_util.import_graph_def: an attr present without a value is its
  OpDef default (tfsplit's own passes leave such attrs behind)."""
  from tensorflow.core.framework import attr_value_pb2  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.validate import validate_graph_def  # pylint: disable=import-outside-toplevel
  graph_def = _mlp_graph_def()
  _node(graph_def, "mlp/layer_0/MatMul").attr["transpose_a"].CopyFrom(
      attr_value_pb2.AttrValue())
  validate_graph_def(graph_def, "mlp.pb")


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "examples", "*.pb"))),
                         ids=os.path.basename)
def test_bundled_graphs_validate(path):
  from tensorflow.core.framework import graph_pb2  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.validate import validate_graph_def  # pylint: disable=import-outside-toplevel
  graph_def = graph_pb2.GraphDef()
  with open(path, "rb") as f:
    graph_def.ParseFromString(f.read())
  validate_graph_def(graph_def, path)


def test_every_mutation_applies():
  """Each mutation kind produces a changed graph on some bundled graph."""
  bases = {}
  for path in EXAMPLES:
    with open(path, "rb") as f:
      bases[os.path.basename(path)] = f.read()
  seen = collections.Counter()
  for index in range(400):
    base, kind, _, data = make_case(0, index, bases)
    assert data != bases[base], (index, kind)
    seen[kind] += 1
  assert set(seen) == set(ALL_MUTATIONS), set(ALL_MUTATIONS) - set(seen)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--driver":
  sys.exit(driver_main(sys.argv[1:]))
