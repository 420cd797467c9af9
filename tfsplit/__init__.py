"""tfsplit: GraphDef-to-GraphDef passes for training large models in TensorFlow.

Importing this package does not import TensorFlow; submodules that need it
import it themselves, so `tfsplit estimate` and the CLI start quickly.
"""
from tfsplit.errors import (GraphLoadError, GraphValidationError, PlanError,
                            TfsplitError, UnsupportedOpError)

__version__ = "0.1.0"
