"""Test session setup: four logical CPU devices, configured before TF starts;
the example model zoo (examples/models, `import models`) and the helpers in
tools/ (`import synthetic`, `import bench_estimate`) importable."""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(_ROOT, "examples"), os.path.join(_ROOT, "tools")):
  if _path not in sys.path:
    sys.path.insert(0, _path)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# An exception inside a split rule fails the test instead of falling back.
os.environ["TFSPLIT_STRICT_RULES"] = "1"

import tensorflow as tf  # pylint: disable=wrong-import-position

NUM_TEST_DEVICES = 4
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_TEST_DEVICES)
