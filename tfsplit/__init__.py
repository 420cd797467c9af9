"""tfsplit: GraphDef-to-GraphDef passes for training large models in TensorFlow.

Importing this package does not import TensorFlow; submodules that need it
import it themselves, so `tfsplit estimate` and the CLI start quickly.
"""
from tfsplit.errors import (GraphLoadError, GraphValidationError, PlanError,
                            TfsplitError, UnsupportedOpError)

__version__ = "0.1.0"


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
