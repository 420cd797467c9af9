"""Size-only memory estimate, unit parsing and the `tfsplit estimate` command."""
import json

import pytest

from tfsplit import units
from tfsplit.cli import run
from tfsplit.errors import TfsplitError
from tfsplit.memory import estimator
from tfsplit.errors import EstimateError

P = 100 * 10**9


def _cli(args, capsys):
  code = run(["tfsplit", "estimate"] + args)
  captured = capsys.readouterr()
  return code, captured.out, captured.err


# --- units --------------------------------------------------------------------
@pytest.mark.parametrize("text,expected", [
    ("16GB", 16 * 10**9), ("16gb", 16 * 10**9), ("16G", 16 * 10**9),
    ("16 GB", 16 * 10**9), ("16GiB", 16 * 2**30), ("1.2TB", 12 * 10**11),
    ("80e9", 80 * 10**9), ("512MiB", 512 * 2**20), ("141GB", 141 * 10**9),
    (1024, 1024),
])
def test_parse_bytes_is_decimal_unless_binary_is_spelled_out(text, expected):
  assert units.parse_bytes(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("100e9", P), ("100B", P), ("175b", 175 * 10**9), ("1.5M", 1_500_000),
    ("7e9", 7 * 10**9), ("1T", 10**12), ("12345", 12345),
])
def test_parse_count(text, expected):
  assert units.parse_count(text) == expected


@pytest.mark.parametrize("bad", ["", "GB", "16XB", "-1GB", "0", "1e999GB"])
def test_bad_sizes_are_user_errors(bad):
  with pytest.raises(TfsplitError):
    units.parse_bytes(bad)


def test_format_bytes_decimal():
  assert units.format_bytes(1.2e12) == "1.2 TB"
  assert units.format_bytes(1.6e12) == "1.6 TB"
  assert units.format_bytes(400e9) == "400 GB"
  assert units.format_bytes(418.75e9) == "418.8 GB"


# --- the estimate -----------------------------------------------------------
def test_issue_numbers_fp32_adam():
  e = estimator.estimate(P, "adam", "fp32")
  parts = {c.group: c.nbytes for c in e.components}
  assert parts["weights"] == 400 * 10**9
  assert parts["optimizer"] == 800 * 10**9            # Adam m and v in fp32
  assert e.weights_and_optimizer == 1.2e12
  assert estimator.devices_needed(e.weights_and_optimizer, 16 * 10**9) == 75
  assert estimator.devices_needed(e.weights_and_optimizer, 32 * 10**9) == 38
  assert e.total == 1.6e12                             # plus fp32 gradients
  assert estimator.devices_needed(e.total, 16 * 10**9) == 100


def test_issue_numbers_mixed_precision_adam():
  e = estimator.estimate(P, "adamw", "mixed")
  per_param = {c.name: c.bytes_per_param for c in e.components}
  assert per_param == {
      "weights (16-bit)": 2, "fp32 master copy of weights": 4,
      "optimizer state: Adam moments m, v (fp32)": 8, "gradients (16-bit)": 2}
  assert e.total == 1.6e12
  assert e.bytes_per_param == 16


@pytest.mark.parametrize("optimizer,fp32,mixed", [
    ("sgd", 8, 8), ("momentum", 12, 12), ("sgd-momentum", 12, 12),
    ("adagrad", 12, 12), ("adam", 16, 16), ("rmsprop", 12, 12),
])
def test_bytes_per_param_by_optimizer(optimizer, fp32, mixed):
  assert estimator.estimate(P, optimizer, "fp32").bytes_per_param == fp32
  assert estimator.estimate(P, optimizer, "mixed").bytes_per_param == mixed


@pytest.mark.parametrize("n", [1, 8, 64, 100, 1000])
def test_zero_published_formulas_mixed_adam(n):
  rows = estimator.estimate(P, "adam", "mixed").zero(n)
  assert [r.formula for r in rows] == ["16P", "4P + 12P/N", "2P + 14P/N",
                                       "16P/N"]
  exact = [16 * P, 4 * P + 12 * P / n, 2 * P + 14 * P / n, 16 * P / n]
  for row, want in zip(rows, exact):
    assert row.per_device == pytest.approx(want, abs=1)


def test_zero_fp32_adam_and_fewest_devices():
  e = estimator.estimate(P, "adam", "fp32")
  assert [r.formula for r in e.zero(64)] == ["16P", "8P + 8P/N", "4P + 12P/N",
                                             "16P/N"]
  stage3 = e.zero(64)[3]
  assert stage3.per_device == 25 * 10**9
  assert stage3.fewest_devices(16 * 10**9, P) == 100
  assert stage3.fewest_devices(80 * 10**9, P) == 20
  assert e.zero(64)[1].fewest_devices(80 * 10**9, P) is None  # 8P > 80 GB
  small = estimator.estimate(10**9, "adam", "mixed").zero(8)
  # 4e9 + 12e9/N <= 8e9 needs N >= 3.
  assert small[1].fewest_devices(8 * 10**9, 10**9) == 3
  assert small[0].fewest_devices(16 * 10**9, 10**9) == 1


def test_activation_term():
  act = estimator.transformer_activation_bytes(
      layers=2, hidden=1024, seq_len=512, micro_batch=4, heads=16)
  sbh = 512 * 4 * 1024
  assert act == 2 * (34 * sbh + 5 * 16 * 512 * 512 * 4)
  assert estimator.transformer_activation_bytes(
      2, 1024, 512, 4, 16, recompute=True) == 2 * 2 * sbh
  e = estimator.estimate(10**9, "adam", "mixed", activation_bytes=act)
  assert e.total == 16 * 10**9 + act
  assert e.zero(4)[3].per_device == 4 * 10**9 + act


def test_estimate_rejects_bad_requests():
  with pytest.raises(EstimateError, match="choose one of: .*adam"):
    estimator.estimate(P, "lamb")
  with pytest.raises(EstimateError, match="positive integer"):
    estimator.estimate(0)
  with pytest.raises(EstimateError, match="precision"):
    estimator.estimate(P, precision="fp8")


# --- the command ------------------------------------------------------------
def _line(out, section, label):
  """The first line starting with `label` after the line starting `section`."""
  lines = out.splitlines()
  start = next(i for i, l in enumerate(lines) if l.startswith(section))
  return next(l for l in lines[start:] if l.strip().startswith(label))


def test_cli_issue_example(capsys):
  code, out, err = _cli(["--params", "100e9", "--optimizer", "adam"], capsys)
  assert code == 0, err
  fp32 = _line(out, "fp32", "= weights + optimizer state").split()
  assert "1.2" in fp32 and "TB" in fp32
  code, out, _ = _cli(["--params", "100e9", "--optimizer", "adam",
                       "--device-memory", "16GB,32GB"], capsys)
  assert code == 0
  fp32 = _line(out, "fp32", "= weights + optimizer state").split()
  assert fp32[-4:] == ["1.2", "TB", "75", "38"]
  mixed_total = _line(out, "mixed precision", "= total").split()
  assert mixed_total[-4:] == ["1.6", "TB", "100", "50"]
  for name in ("weights (16-bit)", "gradients (16-bit)",
               "fp32 master copy of weights",
               "optimizer state: Adam moments m, v (fp32)"):
    assert name in out
  assert "4P + 12P/N" in out and "2P + 14P/N" in out and "16P/N" in out


def test_cli_json(capsys):
  code, out, _ = _cli(["--params", "100B", "--device-memory", "16GB,32GB",
                       "--precision", "mixed", "--zero-devices", "8",
                       "--format", "json"], capsys)
  assert code == 0
  data = json.loads(out)["estimate"]
  assert data["params"] == P
  (mixed,) = data["precisions"]
  assert mixed["total_bytes"] == 1.6e12
  assert mixed["devices_needed"][0] == {"device_memory": 16 * 10**9,
                                        "weights_and_optimizer": 88,
                                        "total": 100}
  stage1 = mixed["zero"]["stages"][1]
  assert stage1["per_device_bytes"] == 4 * P + 12 * P // 8


def test_cli_device_memory_accepts_presets_and_gib(capsys):
  code, out, _ = _cli(["--params", "1e9", "--precision", "fp32",
                       "--device-memory", "h100-80gb,16GiB"], capsys)
  assert code == 0
  assert "80 GB" in out and "17.18 GB" in out


@pytest.mark.parametrize("args,needle", [
    (["--params", "lots"], "cannot read count 'lots'"),
    (["--params", "1e9", "--optimizer", "lamb"], "unknown optimizer 'lamb'"),
    (["--params", "1e9", "--device-memory", "16XB"], "unknown size unit"),
    (["--params", "1e9", "--zero-devices", "0"], "--help"),
    (["--params", "1e9", "--bogus"], "bogus"),
    (["--params", "1e9", "stray"], "unexpected argument"),
    ([], "nothing to estimate"),
    (["--params", "1e9", "--layers", "4"], "missing --hidden"),
    (["--params", "1e9", "--trace", "t.json"], "--simulate-pipeline"),
])
def test_cli_errors_exit_2_with_one_line(args, needle, capsys):
  code, out, err = _cli(args, capsys)
  assert code == 2
  lines = [l for l in err.splitlines() if l.strip()]
  assert len(lines) == 1 and needle in lines[0], err
  assert "Traceback" not in err and out == ""


def test_cli_help(capsys):
  code, out, _ = _cli(["--help"], capsys)
  assert code == 0 and "--device-memory" in out and "--simulate-pipeline" in out


def test_cli_simulate_pipeline_with_trace(tmp_path, capsys):
  trace = tmp_path / "step.json"
  code, out, err = _cli(["--simulate-pipeline", "--stages", "4",
                         "--microbatches", "2", "--schedule", "1f1b",
                         "--trace", str(trace)], capsys)
  assert code == 0, err
  assert "bubble 60.00%" in out
  events = json.loads(trace.read_text())["traceEvents"]
  assert sum(e["ph"] == "X" for e in events) == 2 * 4 * 2
  assert [p.name for p in tmp_path.iterdir()] == ["step.json"]


def test_cli_simulate_pipeline_json(capsys):
  code, out, _ = _cli(["--simulate-pipeline", "--stages", "8",
                       "--microbatches", "3", "--schedule", "gpipe",
                       "--format", "json"], capsys)
  assert code == 0
  pipe = json.loads(out)["pipeline"]
  assert pipe["bubble_fraction"] == pytest.approx(7 / 10)
  assert pipe["peak_activations"] == [3] * 8


def test_cli_gantt_without_matplotlib_writes_nothing(tmp_path, capsys,
                                                     monkeypatch):
  import builtins  # pylint: disable=import-outside-toplevel
  real_import = builtins.__import__

  def no_matplotlib(name, *args, **kwargs):
    if name.startswith("matplotlib"):
      raise ImportError(name)
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_matplotlib)
  code, _, err = _cli(["--simulate-pipeline", "--trace",
                       str(tmp_path / "t.json"), "--gantt",
                       str(tmp_path / "g.png")], capsys)
  assert code == 2 and "matplotlib" in err and "pip install" in err
  assert list(tmp_path.iterdir()) == []
