"""The reference pages say what the code has.

docs/cli.md is generated from the commands' flags by tools/gen_cli_reference.py;
it must be what the generator writes now (run the generator after changing a
flag). docs/python-api.md is written by hand; it must name every keyword of
tfsplit.split and tfsplit.keras.split.
"""
import inspect
import os
import re

import gen_cli_reference  # tools/, on sys.path through conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(rel):
  with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
    return f.read()


def test_cli_reference_is_generated_from_the_flags():
  assert _read("docs/cli.md") == gen_cli_reference.generate(), (
      "docs/cli.md is stale: run python tools/gen_cli_reference.py")


def test_cli_reference_shows_every_command_and_flag():
  from absl import flags  # pylint: disable=import-outside-toplevel
  import importlib  # pylint: disable=import-outside-toplevel
  from tfsplit.cli import COMMANDS  # pylint: disable=import-outside-toplevel
  text = _read("docs/cli.md")
  for command, (module, _) in COMMANDS.items():
    section = text.split(f"## tfsplit {command}\n", 1)[1].split("\n## ", 1)[0]
    fv = flags.FlagValues()
    importlib.import_module(module).define_flags(fv)
    for name in fv:
      flag = fv[name]
      shown = f"`--[no]{flag.name}`" if flag.boolean else f"`--{flag.name}`"
      assert shown in section, f"docs/cli.md: tfsplit {command} does not show {shown}"


def _keywords(fn):
  return [p.name for p in inspect.signature(fn).parameters.values()
          if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def test_python_api_names_every_keyword():
  from tfsplit.keras import split as keras_split  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime.split_function import split  # pylint: disable=import-outside-toplevel
  text = _read("docs/python-api.md")
  table = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
  from tfsplit.passes.config import SplitConfig  # pylint: disable=import-outside-toplevel
  missing = [k for k in _keywords(split)[1:] + list(SplitConfig.options()) if k not in table]
  assert not missing, f"docs/python-api.md's tfsplit.split table lacks {missing}"
  heading = re.search(r"^## `tfsplit\.keras\.split\((.*)\)`", text, re.M).group(1)
  for keyword in _keywords(keras_split)[1:]:
    assert keyword in heading, f"docs/python-api.md: tfsplit.keras.split lacks {keyword}"
