"""Shared test setup.

Eight fake CPU devices are requested before JAX is imported anywhere, so mesh tests can build a
(data=2, fsdp=2, expert=2) mesh; single-device code simply runs on device 0.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
