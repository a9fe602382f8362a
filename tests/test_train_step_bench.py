"""Smoke test of benchmarks/train_step.py: the --quick run builds the trainer's own steps, times them
and prints one table row per update with FLOP rates. No timing is asserted (the machine is shared)."""

import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "train_step.py"
ROWS = ("SAO value update (frozen attention)", "SAO policy update", "SAO ttur_step (K=2, frozen attention)",
        "SAO value update (all trainable)", "SAO ttur_step (K=2, all trainable)")


@pytest.mark.slow
def test_quick_run_prints_every_update_with_a_positive_rate():
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--no-tunix", "--repeats", "1"],
                            capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    rows = {cells[0]: cells[1:] for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in result.stdout.splitlines() if line.startswith("| "))}  # fmt: skip
    for name in ROWS:
        ms, tokens_per_s, tflops, _ = rows[name]
        assert float(ms) > 0 and float(tokens_per_s.replace(",", "")) > 0 and float(tflops) >= 0, name
