"""Sync mode's deterministic policy lag (`rollout.policy_lag`): the weights each step samples with,
against a lagged loop written out by hand; the log-probs a lagged rollout records, against the lagged
model's; and a lagged run resumed from a checkpoint, against the uninterrupted one."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from sao_jax.config import ConfigError, load_config
from sao_jax.rollout.trajectory import Trajectory, collate
from sao_jax.train import batches, build, warm_start
from tests.train.test_groups_trace import fake_run
from tests.xla_flags import xla_flags


def weights_of(version):
    """A stand-in for the sampler's weights, telling its version by its values."""
    return {"w": np.full(3, float(version), np.float32)}


class RecordingLoop:
    """Records each rollout call (the version the weights hold, the version named, the prompts, the
    key indices) and returns trajectories whose action tokens carry the version named."""

    def __init__(self):
        self.calls, self.weights_seen = [], []

    def rollout(self, weights, prompts, key, *, indices=None):
        params, version = weights
        self.weights_seen.append(params)
        held = float(np.asarray(jax.device_get(params)["w"])[0])
        self.calls.append({"held": held, "version": version, "prompts": [p.id for p in prompts], "indices": indices})
        return [Trajectory(tokens=np.array([1, 2, 3], np.int32), action_mask=np.array([False, True, True]),
                           rollout_logprobs=np.zeros(3, np.float32), rollout_entropy=np.zeros(3, np.float32),
                           policy_version=np.array([-1, version, version], np.int32), rewards=np.zeros(3, np.float32),
                           turn_index=np.array([-1, 0, 0], np.int32), prompt_id=p.id) for p in prompts]  # fmt: skip


def lagged_source(lag, spread="fixed", batch_size=4, ring=None):
    run = fake_run(group_size=1, batch_size=batch_size, **{"rollout.policy_lag": lag,
                                                           "rollout.policy_lag_spread": spread})  # fmt: skip
    loop = RecordingLoop()
    return batches.LockstepBatches(run, loop, ring or batches.PolicyLagRing(lag)), loop, run


def test_a_fixed_lag_samples_step_t_with_the_weights_of_step_t_minus_lag_clamped_at_the_warm_start():
    lag = 2
    source, loop, _ = lagged_source(lag)
    for step in range(1, 8):
        loop.calls.clear()
        kept, metrics = source.next(step, weights_of(step - 1))  # the trainer's weights after step − 1
        version = max(step - 1 - lag, 0)  # by hand: the lagged loop
        assert [(c["held"], c["version"]) for c in loop.calls] == [(version, version)], step
        assert loop.calls[0]["indices"] == [0, 1, 2, 3]  # every trajectory keeps its key fold_in(key, i)
        assert metrics["async/staleness_mean"] == step - 1 - version
        assert all(t.oldest_version == version for t in kept)
    assert sorted(source.ring.versions) == list(range(6 - lag, 7))  # the ring forgets what no step needs


def test_without_a_lag_the_trainer_weights_themselves_are_sampled_with():
    run = fake_run(group_size=1, batch_size=4)
    loop = RecordingLoop()
    current = weights_of(4)
    _, metrics = batches.LockstepBatches(run, loop).next(5, current)
    assert len(loop.weights_seen) == 1 and loop.weights_seen[0] is current  # the very object: sync mode as it was
    assert loop.calls[0]["indices"] is None and metrics["async/staleness_mean"] == 0.0


def test_a_uniform_spread_draws_each_trajectorys_lag_from_its_stream_and_keeps_every_key():
    lag, step = 3, 6
    source, loop, run = lagged_source(lag, spread="uniform", batch_size=8)
    for t in range(1, step):
        source.next(t, weights_of(t - 1))
    loop.calls.clear()
    kept, metrics = source.next(step, weights_of(step - 1))
    lags = np.random.default_rng([run.config.seed, build.POLICY_LAG_STREAM, step]).integers(0, lag + 1, 8)
    versions = step - 1 - lags
    assert len(set(lags.tolist())) > 1  # the draw spreads
    for call in loop.calls:  # one call per version, its trajectories at their places, with their keys
        assert call["held"] == call["version"]
        assert call["indices"] == np.flatnonzero(versions == call["version"]).tolist()
    assert sorted(i for c in loop.calls for i in c["indices"]) == list(range(8))
    assert [t.oldest_version for t in kept] == versions.tolist()  # in prompt order
    assert metrics["async/staleness_mean"] == pytest.approx(lags.mean())


def test_a_ring_restored_from_its_checkpoint_part_samples_as_the_uninterrupted_one():
    lag, saved_after = 3, 4
    uninterrupted, loop_a, _ = lagged_source(lag, spread="uniform", batch_size=8)
    for step in range(1, saved_after + 1):
        uninterrupted.next(step, weights_of(step - 1))
    saved = uninterrupted.ring.saved(saved_after, weights_of(saved_after))
    assert [float(w["w"][0]) for w in saved] == [1.0, 2.0, 3.0]  # versions 1..3: what steps 5..7 may need
    ring = batches.PolicyLagRing.restored(lag, saved_after, saved)
    resumed, loop_b, _ = lagged_source(lag, spread="uniform", batch_size=8, ring=ring)
    loop_a.calls.clear()
    for step in range(saved_after + 1, saved_after + 5):
        a, _ = uninterrupted.next(step, weights_of(step - 1))
        b, _ = resumed.next(step, weights_of(step - 1))
        assert [t.oldest_version for t in a] == [t.oldest_version for t in b]
    assert loop_a.calls == loop_b.calls
    # At step 0 every saved version is the warm start.
    assert [float(w["w"][0]) for w in batches.PolicyLagRing(2).saved(0, weights_of(0))] == [0.0, 0.0]


def test_the_rows_of_every_lag_share_one_warm_start():
    plain = load_config(None, ["sft.cache_dir=/c"])
    lagged = load_config(None, ["sft.cache_dir=/c", "rollout.policy_lag=4", "rollout.policy_lag_spread=uniform"])
    assert warm_start.sft_cache_key(lagged) == warm_start.sft_cache_key(plain)
    assert warm_start.sft_cache_key(load_config(None, ["rollout.top_k=5"])) != warm_start.sft_cache_key(plain)


def test_the_lag_is_sync_modes_and_its_spread_a_known_name():
    with pytest.raises(ConfigError, match=r"^rollout.policy_lag is sync mode's lag"):
        load_config(None, ["rollout.policy_lag=2", "train.mode=async"])
    with pytest.raises(ConfigError, match=r"^rollout.policy_lag_spread must be fixed or uniform"):
        load_config(None, ["rollout.policy_lag_spread=gaussian"])


TINY = ["model.preset=tiny_qwen3_moe", "env.train_prompts=16", "env.eval_prompts=2", "env.difficulty=[1]",
        "rollout.num_slots=4", "rollout.max_total_tokens=64", "rollout.max_action_tokens=16", "train.batch_size=4"]


def test_a_lagged_rollout_records_the_lagged_models_log_probs():
    """Step 2 at lag 1 samples with version 0 while the trainer holds version 1 (another policy): the
    log μ it records are version 0's teacher-forced log-probs (up to the decode backend's numerics,
    module docstring of sao_jax.rollout.decode) and far from version 1's. Step 1, clamped at the warm
    start, is the unlagged step 1."""
    config = load_config(None, [*TINY, "rollout.policy_lag=1"])
    run = build.build_run(config)
    graph, version_0 = nnx.split(run.policy)
    rng = np.random.default_rng(0)
    version_1 = jax.tree.map(lambda x: x + rng.normal(0.0, 0.3, x.shape).astype(x.dtype), version_0)
    loop = run.agent_loop(greedy=False)
    source = batches.LockstepBatches(run, loop, batches.PolicyLagRing(1))
    first, _ = source.next(1, version_0)
    unlagged, _ = batches.LockstepBatches(run, loop).next(1, version_0)
    for a, b in zip(first, unlagged):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.rollout_logprobs, b.rollout_logprobs)
    lagged, metrics = source.next(2, version_1)
    assert metrics["async/staleness_mean"] == 1.0 and all(t.oldest_version == 0 for t in lagged)
    batch = collate(lagged, buckets=run.buckets, trainer_version=1)
    assert np.all(np.asarray(batch.staleness)[batch.action_mask] == 1)

    def teacher_forced(weights):
        logp, _ = nnx.merge(graph, weights).token_logprobs(batch.tokens, batch.valid_mask)
        return np.asarray(logp)[batch.action_mask]

    recorded = np.asarray(batch.rollout_logprobs)[batch.action_mask]
    np.testing.assert_allclose(recorded, teacher_forced(version_0), atol=1e-4)
    assert np.max(np.abs(recorded - teacher_forced(version_1))) > 0.1


LAG_RUN = [*TINY, "sft.steps=2", "sft.batch_size=4", "critic.pretrain_rollouts=0", "critic.warmup_steps=0",
           "train.steps=4", "train.eval_every=4", "train.checkpoint_every=2", "rollout.policy_lag=2"]  # fmt: skip


@pytest.mark.slow
def test_a_lagged_run_resumed_from_a_checkpoint_writes_what_the_uninterrupted_one_did(tmp_path):
    env = dict(os.environ, XLA_FLAGS=xla_flags(), JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

    def run(out, *extra):
        done = subprocess.run([sys.executable, "-m", "sao_jax.cli", f"output_dir={out}", *LAG_RUN, *extra],
                              env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in line.items() if not k.startswith("time/")} for line in lines]

    full = run(tmp_path / "full")
    rl = [line for line in full if "train/reward_mean" in line]
    assert [line["async/staleness_mean"] for line in rl] == [0, 1, 2, 2]  # clamped at the warm start, then L
    assert rl[0]["mismatch/logprob_abs_max"] is not None and rl[3]["mismatch/logprob_abs_max"] is None  # no lag-0 token
    # Resume from the step-2 checkpoint: steps 3 and 4 sample with versions 0 and 1, which only its
    # lagged_policy item holds.
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
    assert run(tmp_path / "resumed", "--resume") == full
