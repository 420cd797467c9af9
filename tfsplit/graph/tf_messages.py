"""TensorFlow's error messages turned into one-line GraphValidationErrors
that name the node: for the scratch import (validate.py), Grappler's shape
inference and TensorFlow running a graph's shape arithmetic."""
import re

from tfsplit.errors import GraphValidationError, node_error, printable

FIX = "re-export the graph (the file was edited by hand or is corrupt)"
_MAX_MESSAGE = 400


_NODE_PATTERNS = [re.compile(p) for p in (
    r"\{\{node ([^}\s]+)\}\}",
    r"[Nn]ode '([^']+)'",
    r"[Nn]ode \"([^\"]+)\"",
    r"of node ([^\s,;:'\"]+)",
    r"for '([^'\s]+)'",
    r"'([^'\s]+)'",
    r"[Nn]ode ([^\s,;:'\"]+)",
)]


def node_named_in(message, names):
  """The first name in TF error `message` that is a key of `names`, or None."""
  for pattern in _NODE_PATTERNS:
    for match in pattern.finditer(message):
      name = match.group(1)
      for candidate in (name, name.rstrip(".")):
        if candidate in names:
          return candidate
  return None


# Lines of TF error messages that frame the problem rather than state it.
_FRAME_LINES = re.compile(
    r"^(Graph execution error:|Detected at node|Node: '|\[\[|Original stack trace|"
    r"File \"|Traceback)")
# TF's dump of the failing NodeDef; the node is named separately.
_NODE_DUMP = re.compile(r" for '\{\{node [^}]+\}\} = [^']*'")


def _one_line(message):
  lines = [l.strip() for l in str(message).splitlines() if l.strip()]
  useful = [l for l in lines if not _FRAME_LINES.match(l)]
  text = (useful or lines or ["(no message)"])[0]
  text = _NODE_DUMP.sub("", text)
  if len(text) > _MAX_MESSAGE:
    text = text[:_MAX_MESSAGE] + "..."
  return text


def tf_error(error, graph_def, what, source="graph", rename=None):
  """GraphValidationError (one line) for an error TF raised on `graph_def`.

  `what` says who refused ("TensorFlow's shape inference rejected it"); the
  node is taken from TF's message when it names one of `graph_def`'s nodes
  (`rename` maps names of a private copy back to the user's).
  """
  message = getattr(error, "message", None) or str(error)
  nodes = {n.name: n for n in graph_def.node}
  name = node_named_in(message, nodes)
  detail = _one_line(message)
  if name is not None:
    node = nodes[name]
    if rename is not None:
      original = rename(node)
      if original is not None:
        node = original
    return node_error(GraphValidationError, node, f"{what}: {detail}", FIX,
                      source=source)
  return GraphValidationError(printable(f"{source}: {what}: {detail}; {FIX}"))
