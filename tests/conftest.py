"""Test session setup: four logical CPU devices, configured before TF starts."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# An exception inside a split rule fails the test instead of falling back.
os.environ["TFSPLIT_STRICT_RULES"] = "1"

import tensorflow as tf  # pylint: disable=wrong-import-position

NUM_TEST_DEVICES = 4
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_TEST_DEVICES)
