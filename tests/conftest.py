"""Shared test setup.

Eight fake CPU devices are requested before JAX is imported anywhere, so mesh tests can build a
(data=2, fsdp=2, expert=2) mesh; single-device code simply runs on device 0. XLA compiles without
LLVM's optimisations (`tests/xla_flags.py`): the suite spends most of its time compiling. The entry
points' XLA flag (`sao_jax.cli.set_xla_flags`) is set here too: importing the library sets none.
"""

import os

from tests.xla_flags import xla_flags

os.environ.setdefault("XLA_FLAGS", xla_flags(devices=8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from sao_jax.cli import set_xla_flags  # noqa: E402  (importing sao_jax imports JAX: after JAX_PLATFORMS)

set_xla_flags()  # the TTUR steps' XLA:CPU scheduler, as `sao-train` runs them (sao_jax/cli.py, CPU_SCHEDULER_FLAG)

# The longest files, longest first (seconds on the 2-core CI machine). `make test` runs the suite on
# two pytest-xdist workers, one file at a time each (`--dist loadfile`, so a module's compiled
# fixtures are built once); starting these first keeps one worker from finishing long before the other.
LONGEST_FILES = (
    "tests/train/test_multiprocess.py",  # ~290: ten `sao-train` processes
    "tests/train/test_resume.py",  # ~150: five runs, three killed or resumed
    "tests/train/test_groups_trace.py",  # ~110
    "tests/train/test_policy_lag.py",  # two `sao-train` processes, one resumed
    "tests/train/test_steps.py",  # ~90
    "tests/train/test_micro_batches.py",
    "tests/test_train_step_bench.py",
    "tests/train/test_outputs.py",
    "tests/train/test_real_inputs.py",
    "tests/test_reproduce.py",
)


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
