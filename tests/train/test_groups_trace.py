"""Group rollouts (GRPO / RLOO) and TRACE turn credit in the trainer, against plain-Python references."""

import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sao_jax import advantages as adv
from sao_jax.checkpoint import Checkpointer
from sao_jax.config import ConfigError, load_config, to_dict
from sao_jax.models import Critic, Policy, tiny_qwen3_moe
from sao_jax.rollout.trajectory import Trajectory, collate
from sao_jax.train import batches, build
from sao_jax.train import steps as steps_lib
from sao_jax.train.distributed import Cluster
from tests.test_advantages import ref_trace_turn_rewards
from tests.xla_flags import xla_flags

VOCAB = 97


def turn_trajectory(rng, prompt_id, num_turns, reward, *, observation_after_last=False):
    """prompt ‖ (a_k ‖ o_k) for k < T, laid out as the agent loop does: turn_index −1 on the prompt,
    k on action k and on the observation after it; the outcome reward on the last action token."""
    prompt_length = int(rng.integers(2, 5))
    kinds, turns = [0] * prompt_length, [-1] * prompt_length
    for k in range(num_turns):
        action = int(rng.integers(1, 4))
        observation = int(rng.integers(1, 4)) if (k < num_turns - 1 or observation_after_last) else 0
        kinds += [1] * action + [2] * observation
        turns += [k] * (action + observation)
    kinds, n = np.array(kinds), len(kinds)
    action = kinds == 1
    rewards = np.zeros(n, np.float32)
    rewards[np.flatnonzero(action)[-1]] = reward
    return Trajectory(
        tokens=rng.integers(3, VOCAB, size=n).astype(np.int32),
        action_mask=action,
        rollout_logprobs=np.where(action, rng.normal(-2.0, 0.3, n), 0).astype(np.float32),
        rollout_entropy=np.where(action, rng.uniform(0.5, 2.0, n), 0).astype(np.float32),
        policy_version=np.where(action, 0, -1).astype(np.int32),
        rewards=rewards,
        turn_index=np.array(turns, np.int32),
        prompt_id=prompt_id,
    )


def grouped_batch(rng, rewards, group_size, batch_size, num_turns=None):
    """Whole groups of `group_size` members sharing a prompt id, padded to `batch_size` rows."""
    trajectories = [
        turn_trajectory(rng, i // group_size, 1 if num_turns is None else num_turns[i], r)
        for i, r in enumerate(rewards)
    ]
    return trajectories, collate(trajectories, batch_size=batch_size, buckets=(48,))


# ------------------------------------------------------------------------------------ groups


def reference_group_advantages(rewards, group_size, name):
    """GRPO `(r − mean) / (sample std + 1e-6)` and RLOO `r − mean of the others`, one group at a time."""
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        for i, r in enumerate(group):
            if name == "grpo":
                out.append((r - statistics.mean(group)) / (statistics.stdev(group) + 1e-6))
            else:
                out.append(r - statistics.mean(group[:i] + group[i + 1:]))
    return out


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_group_advantages_match_a_plain_python_reference(name):
    rng = np.random.default_rng(0)
    rewards = [1.0, 0.0, 0.25, 1.0, 0.5, 0.5, 0.5, 0.5, -1.2, 0.3, 2.0, 0.0]  # group 1: zero spread
    config = load_config(None, [f"advantage.estimator={name}", "advantage.group_size=4", "train.batch_size=16"])
    _, batch = grouped_batch(rng, rewards, 4, batch_size=16)  # 3 real groups, 1 padding group
    got, _ = steps_lib._outcome_advantages(name, jax.tree.map(jnp.asarray, batch), None, config)
    want = reference_group_advantages(rewards, 4, name) + [0.0] * 4
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_whole_groups_are_checked_by_position():
    steps_lib.check_whole_groups(np.array([7, 7, 3, 3, 7, 7, -1, -1]), 2)  # a prompt may repeat
    with pytest.raises(ValueError, match=r"rows 2\.\.3 are not one group"):
        steps_lib.check_whole_groups(np.array([7, 7, 3, 4, -1, -1]), 2)  # a group lost a member
    with pytest.raises(ValueError, match="not a multiple of advantage.group_size=4"):
        steps_lib.check_whole_groups(np.array([1, 1, 1, 1, 2, 2]), 4)
    with pytest.raises(ValueError, match="padding rows must come after"):
        steps_lib.check_whole_groups(np.array([-1, -1, 3, 3]), 2)


@pytest.mark.parametrize("scope", ["per_prompt", "global"])
def test_running_mean_reads_the_scope_and_skips_padding_rows(scope):
    rng = np.random.default_rng(5)
    trajectories = [turn_trajectory(rng, i, 1, r) for i, r in [(0, 1.0), (1, 0.5), (0, 0.25)]]
    batch = jax.tree.map(jnp.asarray, collate(trajectories, batch_size=4, buckets=(48,)))  # 1 padding row
    config = load_config(None, [f"advantage.running_mean_scope={scope}", "advantage.estimator=running_mean"])
    per_prompt = scope == "per_prompt"
    baseline = adv.running_mean_init(2 if per_prompt else 1, 8)
    got, state = steps_lib._outcome_advantages("running_mean", batch, baseline, config)
    # per prompt: windows {0: [1.0], 1: []} before row 2; global: one window [1.0, 0.5] before row 2.
    want = [1.0, 0.5, 0.25 - 1.0, 0.0] if per_prompt else [1.0, 0.5 - 1.0, 0.25 - 0.75, 0.0]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    np.testing.assert_array_equal(state.count, [2, 1] if per_prompt else [3])  # the padding row wrote nothing


@pytest.mark.parametrize("scope", ["per_prompt", "global"])
def test_window_fill_counts_the_rewards_each_baseline_averages(scope):
    # A plain loop over the rows in order: the window of row b holds its key's earlier rewards, at
    # most `window`; an empty one (fill 0) is baseline 0, i.e. no baseline.
    rng = np.random.default_rng(11)
    window, num_prompts = 3, 4
    prompt_ids = [0, 2, 0, 0, 1, 0, 0, 2]
    trajectories = [turn_trajectory(rng, i, 1, 1.0) for i in prompt_ids]
    batch = jax.tree.map(jnp.asarray, collate(trajectories, batch_size=10, buckets=(48,)))  # 2 padding rows
    config = load_config(None, [f"advantage.running_mean_scope={scope}", "advantage.estimator=running_mean",
                                f"advantage.running_mean_window={window}"])  # fmt: skip
    keys = prompt_ids if scope == "per_prompt" else [0] * len(prompt_ids)
    baseline = adv.running_mean_init(num_prompts if scope == "per_prompt" else 1, window)
    baseline = baseline._replace(count=baseline.count.at[2].set(5) if scope == "per_prompt" else baseline.count + 1)
    seen = {k: int(baseline.count[k]) for k in set(keys)}
    want = []
    for k in keys:
        want.append(min(seen[k], window))
        seen[k] += 1
    fill = adv.running_mean_window_fill(baseline, steps_lib.running_mean_keys(batch, config), batch.prompt_id >= 0)
    np.testing.assert_array_equal(np.asarray(fill), [*want, 0, 0])
    metrics = steps_lib.window_fill_metrics(baseline, batch, config)
    np.testing.assert_allclose(float(metrics["advantage/window_fill"]), np.mean(want), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["advantage/window_empty"]), np.mean(np.array(want) == 0), rtol=1e-6)


@pytest.mark.parametrize("estimator, length", [("skip_observation_gae", 4), ("cross_observation_gae", 7),
                                                ("step_gae_mean", 4)])
def test_length_adaptive_lambda_counts_the_steps_of_each_recursion(estimator, length):
    # One row by hand: 3 prompt tokens, an action of 2, an observation of 3, an action of 2, 2 padding.
    # Skip-observation (and step) GAE recurse over the 4 action tokens; cross-observation over the 7
    # tokens from the first action on. λ = 1 − 1/(α·l), α = 1.5.
    action = np.array([[0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0]], bool)
    valid = np.array([[1] * 10 + [0, 0]], bool)
    batch = types.SimpleNamespace(tokens=jnp.zeros(action.shape, jnp.int32), action_mask=jnp.asarray(action),
                                  valid_mask=jnp.asarray(valid))
    config = load_config(None, [f"advantage.estimator={estimator}"])
    np.testing.assert_allclose(np.asarray(steps_lib.policy_lambda(batch, config)), [1 - 1 / (1.5 * length)], rtol=1e-6)


def test_config_rejects_batches_of_partial_groups_and_groups_of_one():
    with pytest.raises(ConfigError, match=r"train.batch_size must be a multiple of advantage.group_size=4 \(got 6\)"):
        load_config(None, ["advantage.group_size=4", "train.batch_size=6"])
    with pytest.raises(ConfigError, match="advantage.group_size must be >= 2 for estimator grpo"):
        load_config(None, ["advantage.estimator=grpo"])
    load_config(None, ["advantage.estimator=trace", "advantage.group_size=4", "train.batch_size=8"])


class FakeRolloutLoop:
    """Records what it is asked to roll out; the rollout at position `fail_at` ends in an env error."""

    def __init__(self, fail_at=None):
        self.calls, self.fail_at = [], fail_at

    def rollout(self, weights, prompts, key):
        self.calls.append(list(prompts))
        rng = np.random.default_rng(0)
        out = []
        for i, prompt in enumerate(prompts):
            t = turn_trajectory(rng, prompt.id, 1, 1.0)
            t.info["error"] = "boom" if i == self.fail_at else None
            out.append(t)
        return out


def fake_run(group_size, batch_size, pool_size=10, **more):
    config = load_config(None, [f"advantage.group_size={group_size}", f"train.batch_size={batch_size}",
                                *(f"{k}={v}" for k, v in more.items())])  # fmt: skip
    pool = [types.SimpleNamespace(id=i) for i in range(pool_size)]
    policy = types.SimpleNamespace(config=tiny_qwen3_moe())  # the sampler's copy keeps float32 weights
    return types.SimpleNamespace(config=config, train_prompts=pool, cluster=Cluster(), policy=policy)


def test_lockstep_batches_roll_out_whole_groups_and_drop_a_group_with_a_failure():
    run = fake_run(group_size=3, batch_size=9)
    rollouts = FakeRolloutLoop(fail_at=4)  # member 1 of the second group
    kept, metrics = batches.LockstepBatches(run, rollouts).next(step=5, weights=None)
    prompts = [p.id for p in rollouts.calls[0]]
    drawn = np.random.default_rng([run.config.seed, build.RL_STREAM, 5]).integers(0, 10, 3)
    assert prompts == [int(j) for j in drawn for _ in range(3)]
    assert [t.prompt_id for t in kept] == [prompts[i] for i in (0, 1, 2, 6, 7, 8)]
    # The fake trajectories say version 0 sampled them; the trainer is at version 4 before step 5.
    assert metrics == {"train/env_failed": 1, "train/group_members_discarded": 2, "async/staleness_mean": 4.0}


def test_lockstep_batches_with_groups_of_one_draw_the_same_prompts_as_before():
    run = fake_run(group_size=1, batch_size=4)
    rollouts = FakeRolloutLoop()
    batches.LockstepBatches(run, rollouts).next(step=2, weights=None)
    drawn = np.random.default_rng([run.config.seed, build.RL_STREAM, 2]).integers(0, 10, 4)
    assert [p.id for p in rollouts.calls[0]] == drawn.tolist()


def test_streaming_batches_ask_the_engine_for_whole_groups(monkeypatch):
    made = {}
    monkeypatch.setattr(batches, "RolloutService", lambda rollout_loop: None)
    monkeypatch.setattr(batches, "RolloutEngine", lambda *args, **kwargs: made.update(kwargs))
    batches.StreamingBatches(fake_run(group_size=4, batch_size=8), None, {"w": jnp.zeros(2)}, start_step=0, host={})
    assert made["group_size"] == 4


# ------------------------------------------------------------------------------------ TRACE


SLOW_LENGTH = 64  # one compiled shape for the slow loop: each sequence alone, right-padded, masked


def slow_gold_logprob_mean(model, trajectory, gold):
    """ℓ̄_s for s = 0..T: `model` (a jitted forward of one masked row) run on each
    `tokens[turn_index < s] ‖ gold` alone; log-softmax in float64."""
    num_turns = int(trajectory.turn_index.max()) + 1
    out = []
    for s in range(num_turns + 1):
        prefix = trajectory.tokens[trajectory.turn_index < s]
        sequence = np.concatenate([prefix, gold]).astype(np.int32)
        padded = np.zeros((1, SLOW_LENGTH), np.int32)
        padded[0, : len(sequence)] = sequence
        logits = np.asarray(model(padded, np.arange(SLOW_LENGTH)[None] < len(sequence)), np.float64)[0]
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        out.append(np.mean([logp[len(prefix) + j - 1, g] for j, g in enumerate(gold)]))
    return out


@pytest.fixture(scope="module")
def reference_model():
    """(params, buffers, jitted one-row forward) of a policy that differs from `trace_setup`'s."""
    graphdef, params, buffers = steps_lib.split_model(Policy(tiny_qwen3_moe(), rngs=nnx.Rngs(7)))
    forward = jax.jit(lambda tokens, mask: nnx.merge(graphdef, params, buffers).forward(tokens, attention_mask=mask)[0])
    return graphdef, params, buffers, forward


def test_trace_batch_turn_starts_and_padding():
    rng = np.random.default_rng(1)
    trajectories = [turn_trajectory(rng, 0, 3, 1.0), turn_trajectory(rng, 0, 1, 0.0)]
    batch = steps_lib.trace_batch(collate(trajectories, batch_size=4, buckets=(48,)), [[5, 6], [7, 8, 9]])
    first = trajectories[0]
    starts = [int(np.sum(first.turn_index < s)) for s in range(4)]
    np.testing.assert_array_equal(batch.turn_start[0], starts)  # 4 slots: T + 1 = 4
    second = trajectories[1]
    np.testing.assert_array_equal(batch.turn_start[1], [np.sum(second.turn_index < 0)] + [second.num_tokens] * 3)
    np.testing.assert_array_equal(batch.num_turns, [3, 1, 0, 0])
    np.testing.assert_array_equal(batch.gold_length, [2, 3, 0, 0])
    np.testing.assert_array_equal(batch.gold_tokens[:2, :3], [[5, 6, 0], [7, 8, 9]])
    with pytest.raises(ValueError, match="TRACE needs a gold answer"):
        steps_lib.trace_batch(collate(trajectories, batch_size=4, buckets=(48,)), [[5], []])


def test_trace_batch_keeps_a_slot_for_the_state_after_the_last_turn():
    # T = 4 turns need slots s = 0..4: five, padded to eight; slot 4 (and past it) is the whole row.
    rng = np.random.default_rng(6)
    trajectory = turn_trajectory(rng, 0, 4, 1.0)
    batch = steps_lib.trace_batch(collate([trajectory], batch_size=2, buckets=(48,)), [[5]])
    starts = [int(np.sum(trajectory.turn_index < s)) for s in range(4)] + [trajectory.num_tokens] * 4
    np.testing.assert_array_equal(batch.turn_start[0], starts)


def test_trace_metrics_read_the_last_turn_and_real_rows_only(trace_setup, monkeypatch):
    config, state, graphs, steps, policy_tx = trace_setup
    rng = np.random.default_rng(7)
    _, batch = grouped_batch(rng, [1.0, 0.0, 0.5, 0.5], 2, batch_size=6, num_turns=[1, 3, 2, 2])
    batch = jax.tree.map(jnp.asarray, steps_lib.trace_batch(batch, [[5], [6], [7], [8]]))
    gold = np.array([[-1.0, -2.0, -3.0, -4.0], [-5.0, -6.0, -7.0, -8.0], [-2.0, -1.0, -0.5, -0.5],
                     [-4.0, -3.0, -2.0, -2.0], [-9.0, -9.0, -9.0, -9.0], [-9.0, -9.0, -9.0, -9.0]], np.float32)
    monkeypatch.setattr(steps_lib, "reference_gold_logprob_mean", lambda *args, **kwargs: jnp.asarray(gold))
    _, metrics = steps_lib._trace_advantages(state, batch, graphs, config)
    # rows 4 and 5 are padding (-9 everywhere); ℓ̄ at slot T: -2 (T=1), -8 (T=3), -0.5 and -2 (T=2).
    assert float(metrics["trace_gold_logprob_start"]) == pytest.approx((-1 - 5 - 2 - 4) / 4)
    assert float(metrics["trace_gold_logprob_end"]) == pytest.approx((-2 - 8 - 0.5 - 2) / 4)


def test_reference_scores_equal_one_forward_per_prefix_and_gold(reference_model):
    rng = np.random.default_rng(2)
    trajectories = [turn_trajectory(rng, i, t, 1.0, observation_after_last=i == 1) for i, t in enumerate([1, 3, 2])]
    golds = [rng.integers(3, VOCAB, size=n).astype(np.int32) for n in (3, 1, 5)]
    batch = steps_lib.trace_batch(collate(trajectories, batch_size=4, buckets=(48,)), golds)
    graphdef, params, buffers, forward = reference_model
    score = jax.jit(functools.partial(steps_lib.reference_gold_logprob_mean, graphdef))
    got = np.asarray(score(params, buffers, jax.tree.map(jnp.asarray, batch)))
    for row, (trajectory, gold) in enumerate(zip(trajectories, golds)):
        want = slow_gold_logprob_mean(forward, trajectory, gold)
        np.testing.assert_allclose(got[row, : len(want)], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[row, len(want):], want[-1], rtol=1e-5, atol=1e-5)  # slots past T: S_T


@pytest.fixture(scope="module")
def trace_setup():
    config = load_config(None, ["advantage.estimator=trace", "advantage.group_size=2", "train.batch_size=6",
                                "policy.optimizer.lr=1.0", "loss.eps_low=0.99", "loss.eps_high=100.0"])  # fmt: skip
    policy = Policy(tiny_qwen3_moe(), rngs=nnx.Rngs(0))
    critic = Critic.from_policy(policy, rngs=nnx.Rngs(1))
    policy_tx = steps_lib.guard_nonfinite(optax.sgd(config.policy.optimizer.lr))
    critic_tx = steps_lib.guard_nonfinite(optax.sgd(1.0))
    state, graphs = steps_lib.make_train_state(policy, critic, policy_tx, critic_tx, config)
    steps = steps_lib.build_steps(graphs, policy_tx, critic_tx, config)
    return config, state, graphs, steps, policy_tx


@pytest.mark.slow  # compiles the TRACE step and the hand-written one (~25 s on 2 loaded cores)
def test_trace_policy_update_equals_the_hand_written_step(trace_setup, reference_model):
    config, state, graphs, steps, policy_tx = trace_setup
    _, reference_params, _, forward = reference_model  # differs from the policy
    state = state.replace(reference_params=jax.tree.map(jnp.copy, reference_params))
    rng = np.random.default_rng(3)
    rewards, num_turns = [1.0, 0.0, 0.5, 0.5], [1, 3, 2, 2]  # group 1 has zero spread: A_out = 0
    trajectories, batch = grouped_batch(rng, rewards, 2, batch_size=6, num_turns=num_turns)
    golds = [rng.integers(3, VOCAB, size=n).astype(np.int32) for n in (2, 4, 3, 3)]
    batch = jax.tree.map(jnp.asarray, steps_lib.trace_batch(batch, golds))

    # TRACE from the formulas: A_out (GRPO), ℓ̄ from the reference alone, r_k, α_out·A_out + α_turn·r_k.
    outcome_advantage = reference_group_advantages(rewards, 2, "grpo")
    advantages = np.zeros(batch.tokens.shape)
    start_logprob = []
    for row, (trajectory, gold) in enumerate(zip(trajectories, golds)):
        logprob = slow_gold_logprob_mean(forward, trajectory, gold)
        start_logprob.append(logprob[0])
        turn_rewards = ref_trace_turn_rewards(logprob, num_turns[row], outcome_advantage[row], 3, 0.8, 2.0,
                                              num_turns[row])  # fmt: skip
        for t in np.flatnonzero(trajectory.action_mask):
            advantages[row, t] = outcome_advantage[row] + 0.2 * turn_rewards[trajectory.turn_index[t]]

    def objective(params):
        model = nnx.merge(graphs.policy, params, state.policy_buffers)
        logits, _, aux = model.forward(batch.tokens, attention_mask=batch.valid_mask)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        logp = jnp.pad(jnp.take_along_axis(logp, batch.tokens[:, 1:, None], axis=-1)[..., 0], ((0, 0), (1, 0)))
        ratio = jnp.exp(logp - batch.rollout_logprobs)
        keep = jax.lax.stop_gradient((ratio > 0.01) & (ratio < 101.0) & batch.action_mask)
        loss = -jnp.sum(jnp.where(keep, ratio * advantages, 0.0)) / jnp.sum(batch.action_mask)
        return loss + graphs.policy_aux_coef * aux

    grads = jax.jit(jax.grad(objective))(state.policy_params)
    updates, _ = policy_tx.update(grads, state.policy_opt_state, state.policy_params)
    expected = optax.apply_updates(state.policy_params, updates)

    new_state, metrics = steps.ttur_step(jax.tree.map(jnp.copy, state), batch, jax.random.key(0))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), new_state.policy_params, expected)
    jax.tree.map(np.testing.assert_array_equal, new_state.reference_params, reference_params)  # frozen
    np.testing.assert_allclose(float(metrics["policy/trace_gold_logprob_start"]), np.mean(start_logprob), rtol=1e-5)


def test_reference_is_taken_after_warm_start_and_survives_a_checkpoint(tmp_path, trace_setup):
    config, state, graphs, steps, policy_tx = trace_setup
    warm = jax.tree.map(lambda p: p + 1.0, state.policy_params)  # stands in for the SFT'd policy
    frozen = steps_lib.freeze_reference(state.replace(policy_params=warm))
    jax.tree.map(np.testing.assert_array_equal, frozen.reference_params, warm)
    with Checkpointer(tmp_path, config=to_dict(config)) as checkpointer:
        checkpointer.save(3, frozen, {"step": 3})
        checkpointer.wait()
        restored = checkpointer.restore_latest(jax.eval_shape(lambda: state))
    jax.tree.map(np.testing.assert_array_equal, restored.state.reference_params, warm)
    # Estimators that read no reference keep none, and freezing is then a no-op.
    plain = state.replace(reference_params=None)
    assert steps_lib.freeze_reference(plain).reference_params is None


def test_trace_step_refuses_a_batch_without_gold_answers(trace_setup):
    config, state, graphs, steps, policy_tx = trace_setup
    rng = np.random.default_rng(4)
    _, batch = grouped_batch(rng, [1.0, 0.0], 2, batch_size=6)
    with pytest.raises(TypeError, match="reads a TraceBatch"):
        steps.policy_update(jax.tree.map(jnp.copy, state), jax.tree.map(jnp.asarray, batch), jax.random.key(0))


# ------------------------------------------------------------------------------------ the whole run

FAKE_WANDB = '''
import json, os
_path = os.environ["FAKE_WANDB_LOG"]
class _Run:
    def log(self, data, step):
        with open(_path, "a") as f:
            f.write(json.dumps({"step": step, **data}) + "\\n")
    def finish(self):
        pass
def init(**kwargs):
    with open(_path, "a") as f:
        f.write(json.dumps({"init": sorted(kwargs)}) + "\\n")
    return _Run()
'''

TINY_TRACE_RUN = [
    "model.preset=tiny_qwen3_moe", "env.train_prompts=16", "env.eval_prompts=2", "env.difficulty=[1]",
    "rollout.num_slots=4", "rollout.max_total_tokens=64", "rollout.max_action_tokens=16", "sft.steps=2",
    "sft.batch_size=4", "critic.pretrain_rollouts=0", "critic.warmup_steps=0", "train.steps=3",
    "train.batch_size=4", "train.eval_every=3", "train.checkpoint_every=2", "advantage.estimator=trace",
    "advantage.group_size=2", "train.wandb=true",
]  # fmt: skip


@pytest.mark.slow
def test_trace_run_resumes_exactly_and_mirrors_its_lines_to_wandb(tmp_path):
    (tmp_path / "fake" / "wandb").mkdir(parents=True)
    (tmp_path / "fake" / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'fake'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               FAKE_WANDB_LOG=str(tmp_path / "wandb.jsonl"), XLA_FLAGS=xla_flags(),
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")  # fmt: skip

    def run(out, *extra):
        done = subprocess.run([sys.executable, "-m", "sao_jax.cli", f"output_dir={out}", *TINY_TRACE_RUN, *extra],
                              env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    full = run(tmp_path / "full")
    rl = [line for line in full if "policy/trace_turn_reward_mean" in line]
    assert [line["step"] for line in rl] == [1, 2, 3]
    logged = [json.loads(line) for line in (tmp_path / "wandb.jsonl").read_text().splitlines()]
    assert logged[0] == {"init": ["config", "dir", "name", "project"]}
    scalars = [{k: v for k, v in line.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
               for line in full]  # fmt: skip
    assert logged[1:] == scalars

    # Resume from the step-2 checkpoint: the frozen reference comes back from it, not from the policy.
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "3")
    resumed = run(tmp_path / "resumed", "--resume")
    without_time = lambda lines: [{k: v for k, v in line.items() if not k.startswith("time/")} for line in lines]
    assert without_time(resumed) == without_time(full)
