"""The devices a rewritten graph needs, and making them in this process."""
import re

import tensorflow as tf

from tfsplit.errors import TfsplitError

_DEVICE_INDEX = re.compile(r"device:(CPU|GPU):(\d+)$")


def required_devices(graph_def, kind=None):
  """How many devices (of `kind`, or of any kind) the graph's nodes name."""
  ids = [int(m.group(2)) for n in graph_def.node for m in [_DEVICE_INDEX.search(n.device)]
         if m and (kind is None or m.group(1) == kind)]
  return max(ids) + 1 if ids else 1


def ensure_logical_devices(count, kind="CPU"):
  """Splits the first physical device of `kind` into `count` logical ones.

  Must run before TensorFlow initialises its devices; later calls that ask
  for no more devices than exist are fine.
  """
  physical = tf.config.list_physical_devices(kind)
  if not physical:
    raise TfsplitError(f"no {kind} device to run on")
  try:
    current = tf.config.get_logical_device_configuration(physical[0])
    if current is None or len(current) < count:
      tf.config.set_logical_device_configuration(
          physical[0], [tf.config.LogicalDeviceConfiguration()] * count)
  except RuntimeError:
    have = len(tf.config.list_logical_devices(kind))
    if have < count:
      raise TfsplitError(f"the graph needs {count} {kind} devices but TensorFlow is "
                         f"already running with {have}") from None
