"""tfsplit: GraphDef-to-GraphDef passes for training large models in TensorFlow.

Importing this package does not import TensorFlow; submodules that need it
import it themselves, so `tfsplit estimate` and the CLI start quickly.
"""
from tfsplit.errors import (GraphLoadError, GraphValidationError, PlanError,
                            TfsplitError, UnsupportedOpError)

__version__ = "0.1.0"

# Subpackages reached as attributes (`tfsplit.keras.split(...)` after a plain
# `import tfsplit`), imported on first use so that importing tfsplit stays
# free of TensorFlow.
_SUBPACKAGES = frozenset(["calibration", "cli", "commands", "constants", "cost", "errors",
                          "fileio", "graph", "keras", "layout", "memory", "passes",
                          "pipeline", "plan", "report", "rules", "runtime", "sharding",
                          "strategies", "units"])


def __getattr__(name):
  if name in _SUBPACKAGES:
    import importlib  # pylint: disable=import-outside-toplevel
    return importlib.import_module(f"tfsplit.{name}")
  raise AttributeError(f"module 'tfsplit' has no attribute '{name}'")


def __dir__():
  return sorted(set(globals()) | _SUBPACKAGES)


def split(*args, **kwargs):
  """Wraps a tf.function as a split multi-device callable; see
  tfsplit.runtime.split_function.split."""
  from tfsplit.runtime.split_function import split as _split  # pylint: disable=import-outside-toplevel
  return _split(*args, **kwargs)


def verify(*args, **kwargs):
  """Runs an original and a rewritten graph on seeded inputs and compares; see
  tfsplit.runtime.verify.verify."""
  from tfsplit.runtime.verify import verify as _verify  # pylint: disable=import-outside-toplevel
  return _verify(*args, **kwargs)


def deferred_init():
  """A scope whose variables hold no memory until a split makes their
  shards; see tfsplit.runtime.deferred."""
  from tfsplit.runtime.deferred import deferred_init as _deferred_init  # pylint: disable=import-outside-toplevel
  return _deferred_init()


def load_into(variables, path):
  """Fills an unsplit model's variables ({name: variable} or
  [(variable, name)]) from a split's checkpoint, one variable at a time;
  see tfsplit.runtime.checkpoint.load_into."""
  from tfsplit.runtime.checkpoint import load_into as _load_into  # pylint: disable=import-outside-toplevel
  return _load_into(variables, path)
