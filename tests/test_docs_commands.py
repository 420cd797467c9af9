"""Every command and Python block shown in README.md and docs/*.md runs.

Each ```bash and ```python block of a page is one step of that page; a
page's blocks run in order (a later block may use what an earlier one
wrote), in a fresh temporary copy of the repository: the files git tracks
plus the untracked ones it does not ignore, so nothing a block writes lands
in the checkout. The copy's `.venv` is a link to the checkout's (or, without
one, to the environment running the tests), and its `bin/` comes first on
PATH, so `tfsplit` and `python` are the project's, as after
`. .venv/bin/activate`. Bash blocks run with `bash -e -o pipefail`
(every command must succeed); Python blocks are fed to `python -` with the
copy as the working directory (as if pasted into `python` there).

What a block may need that a test cannot do: the README's first block
creates `.venv` and installs tfsplit into it. Lines that only do that,
`python3 -m venv .venv` and `.venv/bin/pip install ...`, are left out: the
copy's `.venv` already is the checkout's, installed by `.ci/run` (or by hand)
the same way. The README's test-suite block is not run (it is this suite);
test_readme_test_command_is_what_ci_runs checks that its commands are the
ones `.ci/run` runs.

Every block carries a marker, an HTML comment on the line before its
opening fence (invisible in rendered markdown):

    <!-- docs-test: ci -->              runs in every test run (CI)
    <!-- docs-test: slow -->            runs with `-m slow` only
    <!-- docs-test: skip REASON -->     never runs; the reason is required

The CI run of a page runs its `ci` blocks in order, so a `ci` block may only
use files written by earlier `ci` blocks; the slow run of a page runs all
its blocks but the skipped ones, in order. Keep the `ci` blocks to a couple
of minutes in all: the whole suite must stay under ~10 minutes on 2 cores.

    python -m pytest -q tests/test_docs_commands.py            # the CI part
    python -m pytest -q -m slow tests/test_docs_commands.py    # the rest
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The environment the blocks run in: the checkout's .venv (as .ci/run makes
# it), else the one running the tests.
VENV = os.path.join(ROOT, ".venv") if os.path.isdir(os.path.join(ROOT, ".venv")) \
    else sys.prefix
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*docs-test:\s*(ci|slow|skip)\b\s*(.*?)\s*-->\s*$")
RUN_LANGUAGES = ("bash", "python")
# Lines that create or install into the virtual environment: the copy's .venv
# is the checkout's, already installed (see the module docstring).
INSTALL_LINE = re.compile(r"^\s*(python3 -m venv \.venv|\.venv/bin/pip install .*)\s*$")
CI_TIMEOUT = 600       # seconds a ci block may take
SLOW_TIMEOUT = 4 * 3600  # a planner grid runs three processes of calibrating and timing


def pages():
  docs = os.path.join(ROOT, "docs")
  names = sorted(f for f in os.listdir(docs) if f.endswith(".md")) if os.path.isdir(docs) else []
  return ["README.md"] + [f"docs/{n}" for n in names]


class Block:
  """One fenced code block: its page, first line (1-based), language, marker, text."""

  def __init__(self, page, line, language, marker, reason, text):
    self.page, self.line, self.language = page, line, language
    self.marker, self.reason, self.text = marker, reason, text

  def __repr__(self):
    return f"{self.page}:{self.line} ({self.language}, {self.marker})"


def blocks(page):
  """The fenced blocks of `page` (a path relative to the repository)."""
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    lines = f.read().split("\n")
  out, i = [], 0
  while i < len(lines):
    m = FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    start, language = i, m.group(1)
    j = i + 1
    while j < len(lines) and lines[j].strip() != "```":
      j += 1
    k = start - 1
    while k >= 0 and not lines[k].strip():
      k -= 1
    marker = MARKER.match(lines[k]) if k >= 0 else None
    out.append(Block(page, start + 1, language, marker.group(1) if marker else None,
                     marker.group(2) if marker else "", "\n".join(lines[start + 1:j]) + "\n"))
    i = j + 1
  return out


def runnable(page):
  return [b for b in blocks(page) if b.language in RUN_LANGUAGES]


def _tracked_files():
  out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       cwd=ROOT, capture_output=True, check=True).stdout.decode()
  return [p for p in out.split("\0") if p]


def repo_copy(dest):
  """A copy of the repository at `dest` with the checkout's .venv linked in."""
  for rel in _tracked_files():
    src = os.path.join(ROOT, rel)
    if not os.path.isfile(src):  # deleted in the working tree
      continue
    target = os.path.join(dest, rel)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copy2(src, target)
  os.symlink(VENV, os.path.join(dest, ".venv"))
  return dest


def script(block):
  """The block as it runs: install lines of the virtual environment left out."""
  if block.language != "bash":
    return block.text
  return "\n".join(l for l in block.text.split("\n") if not INSTALL_LINE.match(l)) + "\n"


def run_blocks(page_blocks, cwd, timeout):
  if not os.path.exists(os.path.join(VENV, "bin", "tfsplit")):
    pytest.skip(f"no tfsplit command in {VENV}: install the project there "
                "(pip install -e '.[test]')")
  env = dict(os.environ)
  env["PATH"] = os.path.join(cwd, ".venv", "bin") + os.pathsep + env.get("PATH", "")
  env["VIRTUAL_ENV"] = os.path.join(cwd, ".venv")
  env.pop("PYTHONHOME", None)
  for block in page_blocks:
    if block.language == "bash":
      argv, stdin = ["bash", "-e", "-o", "pipefail", "-c", script(block)], None
    else:
      argv, stdin = [os.path.join(cwd, ".venv", "bin", "python"), "-"], script(block)
    try:
      proc = subprocess.run(argv, cwd=cwd, env=env, input=stdin, capture_output=True,
                            text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
      pytest.fail(f"{block} ran past {timeout} s:\n{block.text}\n{(e.stdout or '')[-3000:]}")
    if proc.returncode != 0:
      pytest.fail(f"{block} exited {proc.returncode}:\n{block.text}\n--- stdout (tail)\n"
                  f"{proc.stdout[-4000:]}\n--- stderr (tail)\n{proc.stderr[-4000:]}")


def _pages_with(markers):
  return [p for p in pages() if any(b.marker in markers for b in runnable(p))]


# --- the blocks themselves ----------------------------------------------------------
@pytest.mark.parametrize("page", pages())
def test_every_block_is_marked(page):
  """A runnable block says whether CI runs it; a skipped one says why."""
  for block in runnable(page):
    assert block.marker, (f"{block}: put <!-- docs-test: ci -->, slow or skip REASON on "
                          "the line before the fence")
    if block.marker == "skip":
      assert block.reason, f"{block}: a skipped block needs a reason"


def test_readme_starts_with_install_and_test_commands():
  first = runnable("README.md")[:2]
  assert [b.language for b in first] == ["bash", "bash"]
  install, tests = first
  assert install.marker == "ci"
  assert "pip install" in install.text and "--steps 3" in install.text
  assert "--mesh tp=2" in install.text and "examples/gpt_raw_train_small.pb" in install.text
  assert tests.marker == "skip"


def _commands(text):
  """Shell commands of `text`, one per line or per `&&`, flags spelled long."""
  out = []
  for line in text.split("\n"):
    for part in line.split("&&"):
      part = " ".join(part.split()).replace(" -q ", " --quiet ")
      if part and not part.startswith("#"):
        out.append(part)
  return out


def test_readme_test_command_is_what_ci_runs():
  """The README's second block is .ci/run's install and test commands."""
  with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
    ci = _commands(f.read())
  shown = _commands(runnable("README.md")[1].text)
  assert shown[-1] == ".venv/bin/python -m pytest --quiet -n 2 tests" == ci[-1]
  for command in shown:
    assert command in ci, f"README shows '{command}', which .ci/run does not run"


def test_install_lines_are_the_only_lines_left_out():
  """Only the README's first block has lines the test leaves out."""
  for page in pages():
    for block in runnable(page):
      dropped = [l for l in block.text.split("\n") if INSTALL_LINE.match(l)]
      if block.marker != "skip" and dropped:
        assert (page, block.line) == ("README.md", runnable("README.md")[0].line), block


# --- running them ---------------------------------------------------------------------
@pytest.mark.parametrize("page", _pages_with({"ci"}))
def test_ci_blocks_run(page, tmp_path):
  run_blocks([b for b in runnable(page) if b.marker == "ci"],
             repo_copy(str(tmp_path / "repo")), CI_TIMEOUT)


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_with({"ci", "slow"}))
def test_all_blocks_run(page, tmp_path):
  run_blocks([b for b in runnable(page) if b.marker in ("ci", "slow")],
             repo_copy(str(tmp_path / "repo")), SLOW_TIMEOUT)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__] + sys.argv[1:]))
