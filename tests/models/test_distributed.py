"""Two local JAX processes (gloo collectives over TCP, one CPU device each) compute loss and gradients of
the tiny policy on a global batch sharded over processes, and match one process doing it alone."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import Policy, tiny_qwen3_moe
from tests.models._distributed_worker import flat_arrays, global_batch, next_token_loss
from tests.xla_flags import xla_flags

NUM_PROCESSES = 2
TIMEOUT_S = 240
REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_workers(work_dir: Path) -> list[subprocess.Popen]:
    env = dict(os.environ, XLA_FLAGS=xla_flags(devices=1), JAX_PLATFORMS="cpu")
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, "-m", "tests.models._distributed_worker", "--process-id", str(i),
             "--num-processes", str(NUM_PROCESSES), "--port", str(port), "--dir", str(work_dir)],
            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for i in range(NUM_PROCESSES)
    ]


def wait_for(workers: list[subprocess.Popen]) -> None:
    """Wait for all workers; a hang or a crash fails the test with the workers' output."""
    outputs = []
    try:
        for worker in workers:
            outputs.append(worker.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for worker in workers:
            worker.kill()
        pytest.fail(f"distributed workers did not finish within {TIMEOUT_S}s")
    for i, (worker, output) in enumerate(zip(workers, outputs)):
        assert worker.returncode == 0, f"process {i} exited with {worker.returncode}:\n{output[-4000:]}"


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    config = tiny_qwen3_moe()
    graphdef, state = nnx.split(Policy(config, rngs=nnx.Rngs(0)))
    np.savez(tmp_path / "params.npz", **flat_arrays(state))
    workers = start_workers(tmp_path)

    try:  # the one-process reference, while the workers run
        input_ids = global_batch(config.vocab_size)
        loss, grads = jax.jit(
            lambda state, ids: jax.value_and_grad(lambda s: next_token_loss(nnx.merge(graphdef, s), ids))(state)
        )(state, input_ids)
        expected = flat_arrays(grads)
    finally:
        wait_for(workers)

    for i in range(NUM_PROCESSES):
        with np.load(tmp_path / f"process_{i}.npz") as got:
            np.testing.assert_allclose(got["loss"], loss, rtol=1e-5)
            assert set(got.files) - {"loss"} == set(expected)
            for path, grad in expected.items():
                np.testing.assert_allclose(got[path], grad, rtol=1e-4, atol=1e-6, err_msg=f"process {i}: {path}")
