"""A deterministic run killed with SIGKILL and resumed writes the same metrics as an uninterrupted run."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tests.xla_flags import xla_flags

TINY_RUN = [
    "model.preset=tiny_qwen3_moe",
    "env.train_prompts=64",
    "env.eval_prompts=8",
    "env.difficulty=[1]",
    "rollout.num_slots=4",
    "rollout.max_total_tokens=64",
    "rollout.max_action_tokens=24",
    "sft.steps=6",
    "sft.batch_size=4",
    "critic.pretrain_rollouts=8",
    "critic.pretrain_epochs=1",
    "critic.warmup_steps=2",
    "train.steps=20",
    "train.batch_size=4",
    "train.eval_every=5",
    "train.checkpoint_every=3",
    "policy.optimizer.lr=1e-3",
    "critic.optimizer.lr=1e-3",
]


def command(output_dir, *extra):
    return [sys.executable, "-m", "sao_jax.cli", f"output_dir={output_dir}", *TINY_RUN, *extra]


def environment(cache_dir):
    # All runs share one persistent compilation cache: the same programs compile once.
    env = dict(os.environ)
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", XLA_FLAGS=xla_flags())  # fmt: skip
    return env


def algorithm_metrics(path):
    """Every metric line without wall-clock timings (the only thing allowed to differ)."""
    lines = [json.loads(text) for text in path.read_text().splitlines()]
    return [{k: v for k, v in line.items() if not k.startswith("time/")} for line in lines]


def count_lines(path):
    try:
        return len(path.read_text().splitlines())
    except FileNotFoundError:
        return 0


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_gives_identical_metrics(tmp_path):
    cache = tmp_path / "jax_cache"
    env = environment(cache)
    reference = tmp_path / "reference"
    subprocess.run(command(reference), env=env, check=True, capture_output=True, timeout=900)
    expected = algorithm_metrics(reference / "metrics.jsonl")
    assert [line["step"] for line in expected if "eval/success_rate" in line] == [0, 5, 10, 15, 20]

    rng = random.Random(0)  # one kill here; tests/train/test_faults.py kills and resumes at chosen moments
    out = tmp_path / "killed"
    # Kill once the run has written a random number of lines (SFT, pretraining, or RL steps).
    kill_at = rng.randrange(3, len(expected) - 1)
    process = subprocess.Popen(command(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while count_lines(out / "metrics.jsonl") < kill_at and process.poll() is None:
        assert time.monotonic() < deadline, "run did not progress"
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 0.5))  # somewhere inside the next step or checkpoint write
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_after = count_lines(out / "metrics.jsonl")
    resumed = subprocess.run(command(out, "--resume"), env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = algorithm_metrics(out / "metrics.jsonl")
    assert got == expected, f"killed after {killed_after} lines; metrics differ after resume"
