"""The packages of tfsplit/ form strict layers: a module imports only its own
package and the packages below it (lazy imports inside functions included),
and no two modules import each other. The order is BUILD_NOTES.md's
"Layers" section, read from there so it has one home.

The imports are read from the source (ast), nothing is imported; a checker
that finds nothing on a tree with an upward import added would prove
nothing, so the last tests add one (and a pair of modules importing each
other) to a copy of the tree and watch them fail.
"""
import ast
import os
import re
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "tfsplit"


def layer_order(notes_path=os.path.join(ROOT, "BUILD_NOTES.md")):
  """{package: level} from the ```text block under '## Layers' (one level a
  line, bottom first; names on one line share a level)."""
  text = open(notes_path, encoding="utf-8").read()
  found = re.search(r"^## Layers\n.*?```text\n(.*?)```", text, re.S | re.M)
  assert found, "BUILD_NOTES.md has no '## Layers' section with a ```text block"
  levels = {}
  for level, line in enumerate(l for l in found.group(1).splitlines() if l.strip()):
    for name in line.split("#")[0].replace(",", " ").split():
      levels[name] = level
  return levels


def _module_name(root, path):
  rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
  return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _modules(root):
  out = {}
  for directory, _, files in os.walk(os.path.join(root, PACKAGE)):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(directory, f)
        out[_module_name(root, path)] = path
  return out


def imports(root):
  """{module: {(imported module, line)}} of every tfsplit import in tfsplit/,
  at any depth of the file (lazy ones included)."""
  modules = _modules(root)
  found = {}
  for name, path in modules.items():
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
      if isinstance(node, ast.Import):
        targets.update((a.name, node.lineno) for a in node.names
                       if a.name.split(".")[0] == PACKAGE)
      elif isinstance(node, ast.ImportFrom):
        if node.level:
          base = package.split(".")[:len(package.split(".")) - node.level + 1]
          source = ".".join(base + ([node.module] if node.module else []))
        else:
          source = node.module or ""
        if source.split(".")[0] != PACKAGE:
          continue
        for alias in node.names:  # `from pkg import submodule` names the submodule
          sub = f"{source}.{alias.name}"
          targets.add((sub if sub in modules else source, node.lineno))
    found[name] = targets
  return found


def _package(module):
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else PACKAGE


def violations(root, levels):
  """Lines naming each upward import, unknown package and mutual import."""
  found = imports(root)
  problems = []
  for module, targets in sorted(found.items()):
    own = _package(module)
    for target, line in sorted(targets):
      other = _package(target)
      for pkg in (own, other):
        if pkg not in levels:
          problems.append(f"{module}: package '{pkg}' has no layer in BUILD_NOTES.md")
      if own in levels and other in levels and levels[other] > levels[own]:
        problems.append(f"{module} (line {line}) imports {target}: '{other}' is above "
                        f"'{own}'")
      if target != module and any(t == module for t, _ in found.get(target, ())):
        if module < target:
          problems.append(f"{module} and {target} import each other")
  return sorted(set(problems))


def test_every_package_has_a_layer_and_imports_go_down():
  problems = violations(ROOT, layer_order())
  assert not problems, "\n".join(problems)


def test_the_order_names_every_package_once():
  levels = layer_order()
  packages = {_package(m) for m in _modules(ROOT)}
  assert packages <= set(levels), sorted(packages - set(levels))
  assert levels[PACKAGE] == max(levels.values())  # the package's front door on top
  assert levels["errors"] == 0


@pytest.fixture
def tree(tmp_path):
  """A copy of tfsplit/ to break."""
  shutil.copytree(os.path.join(ROOT, PACKAGE), tmp_path / PACKAGE,
                  ignore=shutil.ignore_patterns("__pycache__"))
  return tmp_path


def test_an_upward_import_fails(tree):
  before = violations(str(tree), layer_order())
  path = tree / PACKAGE / "rules" / "base.py"
  path.write_text(path.read_text() + "\n\ndef _late():\n"
                  "  from tfsplit.runtime import session  # an upward lazy import\n")
  added = sorted(set(violations(str(tree), layer_order())) - set(before))
  assert added == ["tfsplit.rules.base (line %d) imports tfsplit.runtime.session: "
                   "'runtime' is above 'rules'" % (path.read_text().count("\n"))]


def test_modules_importing_each_other_fail(tree):
  a = tree / PACKAGE / "graph" / "ir.py"
  b = tree / PACKAGE / "graph" / "fold.py"
  assert "tfsplit.graph.ir" in b.read_text()
  a.write_text(a.read_text() + "\nfrom tfsplit.graph import fold  # a cycle\n")
  problems = violations(str(tree), layer_order())
  assert "tfsplit.graph.fold and tfsplit.graph.ir import each other" in problems, problems


def test_subpackages_are_attributes_of_a_plain_import():
  """`import tfsplit` then tfsplit.keras / tfsplit.plan work; reaching a
  TensorFlow-free one (the estimator's) leaves TensorFlow unimported."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  code = ("import sys, tfsplit\n"
          "import tfsplit.memory.estimator\nassert callable(tfsplit.memory.estimator.estimate)\n"
          "assert 'tensorflow' not in sys.modules\n"
          "assert callable(tfsplit.keras.split) and callable(tfsplit.plan.plan_graph)\n"
          "try:\n  tfsplit.no_such_thing\nexcept AttributeError as e:\n  print(e)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "module 'tfsplit' has no attribute 'no_such_thing'" in out.stdout


def test_the_split_module_doc_names_every_pass_in_order():
  """passes/split.py's docstring lists PASSES, in order, and nothing else."""
  from tfsplit.passes import split as split_lib  # pylint: disable=import-outside-toplevel
  doc = split_lib.__doc__
  listed = re.findall(r"^([a-z_]+)(?:\s|$)", doc[doc.index("Passes, in order"):], re.M)
  assert listed == [p.__name__ for p in split_lib.PASSES]
