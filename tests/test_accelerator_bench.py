"""Smoke test of benchmarks/accelerator.sh: `--smoke` (the tiny preset, one repeat) runs the dispatch
table of benchmarks/model.py and then benchmarks/train_step.py at its fastest dispatch, on the CPU.
No timing is asserted beyond the run finishing (the machine is shared)."""

import os
import pathlib
import subprocess
import sys

import pytest

from tests.xla_flags import xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the rows on the CPU: no Triton row (GPU only), no gmm row (TPU only)
CPU_DISPATCH_ROWS = ["MoE, capacity dispatch", "MoE, sorted dispatch", "dense, same active"]
UPDATES = ["SAO value update (frozen attention)", "SAO policy update", "SAO ttur_step (K=2, frozen attention)"]


def _tables(stdout):
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| model") and not line.startswith("| update")]  # fmt: skip


@pytest.mark.slow
def test_smoke_run_prints_one_row_per_dispatch_then_the_updates_at_the_fastest():
    env = dict(os.environ, PYTHON=sys.executable, XLA_FLAGS=xla_flags(), JAX_PLATFORMS="cpu")
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "accelerator.sh"), "--smoke"], capture_output=True,
                            text=True, timeout=600, check=False, env=env)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = _tables(result.stdout)
    names = [row[0] for row in rows]
    assert names == CPU_DISPATCH_ROWS + UPDATES, names
    for row in rows[:3]:  # ms/step, compiled ÷ model FLOPs, MFU
        assert float(row[3]) > 0 and float(row[8]) >= 1.0 and row[-1].endswith("%"), row
    fastest = min(rows[:2], key=lambda row: float(row[3]))[0]
    dispatch = fastest.split(", ")[1].split()[0]
    assert f"fastest dispatch: {dispatch}\n" in result.stdout
    assert f"dispatch {dispatch}, float32" in result.stdout  # train_step.py ran with it
