"""One exception family for every user-facing failure.

Each message names the file or node, its op, what is wrong and what to do.
The CLI prints ``str(error)`` as one line on stderr and exits with code 2.
"""


class TfsplitError(Exception):
  """Base class: a problem with the user's input or request (not a bug)."""


class GraphLoadError(TfsplitError):
  """A graph file or object could not be read."""


class GraphValidationError(TfsplitError):
  """A GraphDef is structurally invalid (dangling input, cycle, unknown op)."""


class UnsupportedOpError(TfsplitError):
  """An op has no rule for what was asked of it."""


class PlanError(TfsplitError):
  """A plan, mesh or device request that does not fit the graph or machine."""


class DivergedCopiesError(TfsplitError):
  """Copies of one replicated tensor disagree across devices."""


class UnitsError(TfsplitError):
  """A size or count string that cannot be read."""


class EstimateError(TfsplitError):
  """A memory-estimate request that cannot be answered as given."""


class ClusterSpecError(TfsplitError):
  """A cluster spec or preset that is missing, malformed or inconsistent."""


class CalibrationError(TfsplitError):
  """A graph that cannot be run for calibration."""


class CostTableError(TfsplitError):
  """A calibration table that is missing or malformed."""


def printable(text):
  """``text`` with control characters (line breaks too) escaped: a message
  naming a node of a corrupt graph must still print as one line."""
  if text.isprintable():
    return text
  return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                 for c in text)


def node_error(cls, node, problem, fix=None, source=None):
  """Builds ``cls`` with a message naming ``node`` (a NodeDef) and its op.

  ``source`` (a file name, 'graph') prefixes the message when given.
  """
  msg = f"node '{node.name}' (op {node.op}): {problem}"
  if source:
    msg = f"{source}: {msg}"
  if fix:
    msg += f"; {fix}"
  return cls(printable(msg))
