"""XLA_FLAGS for the test processes (pytest's own and the `sao-train` runs the tests start)."""

# The suite is bound by compiling its tiny programs, not by running them. Without LLVM's
# optimisations a cold `sao-train` run of the tests' size took 41 s of CPU against 68 s.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None) -> str:
    """FAST_COMPILE, and `devices` fake CPU devices when given."""
    return FAST_COMPILE if devices is None else f"{FAST_COMPILE} --xla_force_host_platform_device_count={devices}"
