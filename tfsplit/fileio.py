"""Writing output files whole or not at all.

Every file tfsplit writes (graphs, manifests, reports, cost tables, traces,
charts) goes through `write_atomically`: a temp file in the same folder, then
os.replace, so a crash or a failed run never leaves a partial file behind.
"""
import json
import os
import tempfile

from tfsplit.errors import TfsplitError


def write_atomically(path, data):
  """Writes bytes or str `data` (str as UTF-8) to `path` via a temp file."""
  path = os.fspath(path)
  directory = require_folder(path)
  if isinstance(data, str):
    data = data.encode("utf-8")
  fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".",
                             suffix=".tmp", dir=directory)
  try:
    # mkstemp makes 0600 files; give the result the usual umask permissions.
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def require_folder(path):
  """`path`'s folder; fails (before any long computation) when it is missing."""
  directory = os.path.dirname(os.path.abspath(os.fspath(path)))
  if not os.path.isdir(directory):
    raise TfsplitError(f"cannot write '{path}': folder '{directory}' does not "
                       "exist; create it or choose another path")
  return directory


def read_json(path, error_cls, missing, unreadable):
  """The JSON object in file `path`; `error_cls` with `missing` (the file is
  not there) or `unreadable` (it cannot be read or parsed: formatted with
  {error}, the reason) as one line otherwise."""
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except FileNotFoundError:
    raise error_cls(missing) from None
  except (OSError, ValueError) as e:
    raise error_cls(unreadable.format(error=str(e).splitlines()[0])) from None
