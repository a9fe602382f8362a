"""Smoke test of benchmarks/async_stream.py: a tiny run prints a table that parses and accounts for
every prompt. No timing is asserted (the machine is shared); only counts and bounds."""

import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "async_stream.py"
STEPS, BATCH_SIZE, GROUP_SIZE = 3, 8, 8


@pytest.fixture(scope="module")
def table():
    """{mode: {column: value}} parsed from one tiny run (~2 s: JAX import plus ~0.3 s of sleeps)."""
    command = [sys.executable, str(SCRIPT), "--steps", str(STEPS), "--batch-size", str(BATCH_SIZE),
               "--workers", "8", "--median-latency-s", "0.01", "--train-step-s", "0.01",
               "--group-size", str(GROUP_SIZE)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    lines = result.stdout.splitlines()
    header_at = next(i for i, line in enumerate(lines) if line.split()[:1] == ["mode"])
    columns = lines[header_at].split()
    rows = {}
    for line in lines[header_at + 1: header_at + 3]:
        cells = line.split()
        assert len(cells) == len(columns), f"table row does not match the header: {line!r}"
        rows[cells[0]] = {name: float(cell) for name, cell in zip(columns[1:], cells[1:])}
    rows["output"] = result.stdout
    return rows


def test_both_modes_consume_the_same_number_of_trajectories(table):
    assert table["stream"]["trajectories"] == table["sync"]["trajectories"] == STEPS * BATCH_SIZE


@pytest.mark.parametrize("mode, group_size", [("stream", 1), ("sync", GROUP_SIZE)])
def test_every_prompt_taken_is_consumed(table, mode, group_size):
    row = table[mode]
    assert row["taken"] == row["consumed"] == STEPS * BATCH_SIZE // group_size
    assert row["dropped"] == row["failed"] == row["unconsumed"] == row["in_flight"] == 0


@pytest.mark.parametrize("mode", ["stream", "sync"])
def test_fractions_and_rates_are_in_range(table, mode):
    row = table[mode]
    assert 0.0 <= row["idle"] <= 1.0
    assert 0.0 <= row["idle_steady"] <= 1.0
    assert 0.0 <= row["fill_s"] <= row["wall_s"] and 0.0 <= row["drain_s"] <= row["wall_s"]
    assert row["traj_per_s"] > 0 and row["wall_s"] > 0
    assert row["staleness_mean"] >= 0


def test_sync_mode_is_on_policy(table):
    # The gated source starts no rollout of step s + 1 before the weights of step s are published.
    assert table["sync"]["staleness_mean"] == 0.0


def test_summary_lines_are_printed(table):
    output = table["output"]
    assert "ratio stream/sync:" in output
    assert "target stream idle <= 10%:" in output
    assert "ideal sync wall" in output
