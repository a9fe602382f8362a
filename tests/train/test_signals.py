"""`StopRequests` alone, in a process that never reaches a step's end: a second signal ends it at once,
and `train.signal_grace_s` bounds a stop that does not come (the trainer's stops: tests/train/test_faults.py,
and tests/train/test_multiprocess.py for two processes)."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

# Asks nothing of the run: it only waits, saying when a stop has been asked for.
STUCK_RUN = """
import signal, sys, time
from sao_jax.train.signals import StopRequests

signal.signal(signal.SIGINT, signal.default_int_handler)  # as a shell leaves it, even where pytest's runner ignores it

with StopRequests(grace_s=float(sys.argv[1])) as stops:
    print("ready", flush=True)
    while stops.signum is None:
        time.sleep(0.01)
    print("stop requested", flush=True)
    while True:
        time.sleep(0.01)
"""


def stuck_run(grace_s):
    process = subprocess.Popen([sys.executable, "-c", STUCK_RUN, str(grace_s)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert process.stdout.readline() == "ready\n"
    return process


def test_a_second_signal_ends_the_process_at_once():
    process = stuck_run(grace_s=600)
    process.send_signal(signal.SIGTERM)
    assert process.stdout.readline() == "stop requested\n"
    sent = time.monotonic()
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("a second signal did not end the process")
    assert process.returncode == -signal.SIGINT and time.monotonic() - sent < 10


def test_a_stop_that_outlasts_the_grace_period_exits_with_the_signals_status_in_one_line():
    process = stuck_run(grace_s=0.5)
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        _, stderr = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("train.signal_grace_s did not end the process")
    assert process.returncode == 143 and 0.5 <= time.monotonic() - sent < 30
    assert stderr.splitlines() == ["interrupted by SIGTERM: the stop took longer than train.signal_grace_s=0.5 s; "
                                   "exiting without waiting further; --resume continues from the newest checkpoint"]


def test_a_signal_during_the_gather_stops_every_process_at_the_next_gather_not_this_one(monkeypatch):
    """Two processes, the signal reaching this one while `agreed`'s gather is in flight: the flags
    gathered say no stop, so this process goes on as the other does (a lone stop would save, a
    collective, alone and hang); its flag is in the next gather, where both stop."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from sao_jax.train.signals import StopRequests

    stops = StopRequests(grace_s=60.0)
    gathered = []

    def gather_with_a_signal_arriving(local):
        gathered.append(np.asarray(local).tolist())
        if len(gathered) == 1:
            stops.request(signal.SIGTERM)  # the handler runs after this process's flags were taken
        return np.stack([np.asarray(local), np.zeros(2, np.int32)])  # the other process: no signal, no failure

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", gather_with_a_signal_arriving)
    try:
        assert stops.agreed() == (False, False)
        assert stops.agreed() == (True, False)
    finally:
        stops.__exit__(None, None, None)  # cancels the grace timer
    assert gathered == [[0, 0], [int(signal.SIGTERM), 0]]
