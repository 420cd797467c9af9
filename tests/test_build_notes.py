"""BUILD_NOTES.md's pass table ("How a split runs") names every pass of
`tfsplit.passes.split.PASSES`, in order, and nothing else, and every place
its "where" column names exists in tfsplit/. A checker that passes on a
table with a row removed would prove nothing, so a test removes one and
watches the check fail.
"""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTES = os.path.join(ROOT, "BUILD_NOTES.md")


def _notes():
  with open(NOTES, encoding="utf-8") as f:
    return f.read()


def pass_rows(text):
  """[(pass, where)] of the table under '## How a split runs', in order."""
  found = re.search(r"^## How a split runs.*?\n(\| pass \|.*?)(?:\n\n|\Z)", text, re.S | re.M)
  assert found, "BUILD_NOTES.md has no pass table under '## How a split runs'"
  rows = []
  for line in found.group(1).splitlines()[2:]:
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    name = re.fullmatch(r"`([a-z_]+)`", cells[0])
    assert name and len(cells) == 3, f"not a pass row: {line}"
    rows.append((name.group(1), cells[2]))
  return rows


def table_problems(text, passes):
  """Lines naming what the table lacks, adds or orders otherwise than `passes`."""
  listed = [name for name, _ in pass_rows(text)]
  problems = [f"pass '{p}' has no row" for p in passes if p not in listed]
  problems += [f"row '{p}' names no pass" for p in listed if p not in passes]
  if not problems and listed != list(passes):
    problems.append(f"rows out of order: {listed} (PASSES: {list(passes)})")
  return problems


def _pass_names():
  from tfsplit.passes import split as split_lib  # pylint: disable=import-outside-toplevel
  return [p.__name__ for p in split_lib.PASSES]


def test_the_pass_table_names_every_pass_in_order():
  problems = table_problems(_notes(), _pass_names())
  assert not problems, "\n".join(problems)


def test_every_place_the_table_names_exists():
  missing = []
  for name, where in pass_rows(_notes()):
    for place in where.split(","):
      path = os.path.join(ROOT, "tfsplit", place.strip())
      if not os.path.exists(path):
        missing.append(f"{name}: {place.strip()}")
  assert not missing, missing


def test_a_missing_or_moved_row_fails():
  text, passes = _notes(), _pass_names()
  row = re.search(r"^\| `%s` \|.*\n" % passes[-2], text, re.M)
  assert row, passes[-2]
  without = text[:row.start()] + text[row.end():]
  assert table_problems(without, passes) == [f"pass '{passes[-2]}' has no row"]
  first = re.search(r"^\| `%s` \|.*\n" % passes[0], without, re.M)
  moved = without[:first.start()] + row.group(0) + without[first.start():]
  problems = table_problems(moved, passes)
  assert len(problems) == 1 and problems[0].startswith("rows out of order"), problems
