"""One CLI style for every command: --help, unknown flags, dashed flag names."""
import importlib

import pytest
from absl import flags

from tfsplit.cli import COMMANDS, run
from tfsplit.commands import common


def _module(command):
  return importlib.import_module(COMMANDS[command][0])


def _flags(command):
  fv = flags.FlagValues()
  _module(command).define_flags(fv)
  return {fv[name].name: fv[name] for name in fv}


def _cli(args, capsys):
  code = run(["tfsplit"] + args)
  captured = capsys.readouterr()
  return code, captured.out, captured.err


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("spelling", ["--help", "-h"])
def test_help_prints_usage_and_every_flag(command, spelling, capsys):
  code, out, err = _cli([command, spelling], capsys)
  assert code == 0 and err == ""
  assert out.startswith(f"usage: tfsplit {command}")
  for name, flag in _flags(command).items():
    shown = f"--[no]{name}" if flag.boolean else f"--{name}"
    assert shown in out, f"{command} --help does not show {shown}"
    assert "_" not in name, f"{command}: flag --{name} is not dashed"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_wins_over_other_arguments(command, capsys):
  code, out, _ = _cli([command, "some.pb", "--no-such-flag", "--help"], capsys)
  assert code == 0 and out.startswith("usage:")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_unknown_flag_is_one_line_and_exit_2(command, capsys):
  code, out, err = _cli([command, "--no-such-flag"], capsys)
  assert code == 2 and out == ""
  lines = err.splitlines()
  assert len(lines) == 1, err
  assert lines[0].startswith(f"tfsplit {command}: error: ") and "no-such-flag" in lines[0]
  assert f"tfsplit {command} --help" in lines[0]


def test_output_is_dash_o_wherever_a_file_is_written():
  for command in ("inspect", "rewrite", "trace", "calibrate"):
    assert _flags(command)["output"].short_name == "o", command


def test_old_underscore_spellings_are_hidden_aliases():
  fv = flags.FlagValues()
  _module("verify").define_flags(fv)
  assert common.dashed(fv, ["a.pb", "--int_max=7", "--update_rtol", "0.1", "--noall",
                            "--", "--int_max"]) == [
                                "a.pb", "--int-max=7", "--update-rtol", "0.1", "--noall",
                                "--", "--int_max"]
  fv = flags.FlagValues()
  _module("calibrate").define_flags(fv)
  assert common.dashed(fv, ["--out", "t.json"], _module("calibrate").ALIASES) == [
      "--output", "t.json"]


@pytest.mark.parametrize("command", ["rewrite", "trace", "calibrate"])
def test_missing_output_is_a_usage_error(command, capsys):
  code, _, err = _cli([command, "in.pb"], capsys)
  assert code == 2 and "missing --output" in err and "usage: tfsplit" in err
