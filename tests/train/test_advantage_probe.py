"""The advantage-quality probe (`sao_jax.train.advantage_probe`): its formulas against hand
computations, the replay against the rollout it continues, and its bookkeeping against a scripted
rollout source whose continuation returns are known."""

import dataclasses
import math

import jax
import numpy as np
import pytest
from flax import nnx

from sao_jax import models
from sao_jax.config import ConfigError, load_config
from sao_jax.envs.chain import ChainEnv
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.train import advantage_probe as probe_lib
from sao_jax.train import steps as steps_lib
from sao_jax.train.build import INIT_STREAM, build_run, make_optimizers, policy_weights

TINY = ["model.preset=tiny_qwen3_moe", "env.name=chain", "env.difficulty=[1, 2]", "env.train_prompts=32",
        "rollout.num_slots=8", "rollout.max_total_tokens=160", "rollout.max_action_tokens=12",
        "train.batch_size=4", "train.probe_every=1", "train.probe_prompts=3", "train.probe_continuations=2"]  # fmt: skip


def test_monte_carlo_advantages_by_hand():
    # r = (0, 0, 1), V̂ = (1/4, 1/2, 3/4), V̂(s_3) = 0:
    # A_0 = 0 + 1/2 − 1/4, A_1 = 0 + 3/4 − 1/2, A_2 = 1 + 0 − 3/4
    np.testing.assert_allclose(probe_lib.monte_carlo_advantages([0, 0, 1], [0.25, 0.5, 0.75]), [0.25, 0.25, 0.25])
    # a wrong tool call that the rest of the episode cannot undo: V̂ drops after it
    np.testing.assert_allclose(probe_lib.monte_carlo_advantages([0, 1], [0.5, 0.0]), [-0.5, 1.0])


def test_first_token_values_read_each_turns_first_action_token():
    #            prompt  a0 a0  o0  a1 a1 a1
    x = np.array([9, 9, 1, 2, 9, 3, 4, 5], float)
    action = np.array([0, 0, 1, 1, 0, 1, 1, 1], bool)
    turn = np.array([-1, -1, 0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(probe_lib.first_token_values(x, action, turn, 2), [1, 3])


def test_correlation_by_hand_and_undefined_for_a_constant():
    x, y = np.array([1.0, 2.0, 4.0]), np.array([1.0, 3.0, 2.0])
    dx, dy = x - x.mean(), y - y.mean()
    assert probe_lib.correlation(x, y) == pytest.approx(float(dx @ dy / math.sqrt((dx @ dx) * (dy @ dy))))
    assert probe_lib.correlation(x, np.zeros(3)) is None
    assert probe_lib.correlation(np.ones(1), np.ones(1)) is None


def test_the_replay_env_starts_after_the_given_actions_with_the_turns_left():
    prompt = ChainEnv.generate_prompts(np.random.default_rng(0), 1, difficulty=3)[0]
    gold = ChainEnv.demonstration(prompt)
    plain = ChainEnv()
    history = plain.reset(prompt)
    for action in gold[:2]:
        history += action + plain.step(action).observation
    replay = probe_lib.ReplayEnv(ChainEnv())
    assert replay.reset(probe_lib.Continuation(prompt, tuple(gold[:2]))) == history
    assert replay.max_turns == plain.max_turns - 2
    replay.step(gold[2])
    assert replay.step(gold[3]).reward == 1.0  # the rest of the gold episode still earns its reward
    with pytest.raises(RuntimeError, match="ended before its last action"):
        probe_lib.ReplayEnv(ChainEnv()).reset(probe_lib.Continuation(prompt, tuple(gold) + ("A: 1\n",)))


def tiny_probe(*overrides):
    config = load_config(overrides=[*TINY, *overrides])
    run = build_run(config)
    policy_tx, critic_tx = make_optimizers(config)
    critic = models.Critic.from_policy(run.policy, rngs=nnx.Rngs(config.seed + INIT_STREAM))
    state, graphs = steps_lib.make_train_state(run.policy, critic, policy_tx, critic_tx, config,
                                               num_prompts=len(run.train_prompts))  # fmt: skip
    return run, state, graphs, probe_lib.AdvantageProbe(run, graphs)


def test_a_continuation_conditions_on_the_tokens_of_the_rollout_it_continues_or_is_counted_inexact():
    """A random policy samples special tokens (no text) now and then: the replays of rollouts with
    none are the original contexts token for token, and the probe flags those with one."""
    run, state, graphs, probe = tiny_probe()
    weights = (policy_weights(state, graphs), 0)
    rollouts = probe.loop.rollout(weights, [probe_lib.Continuation(p, ()) for p in probe.prompts], jax.random.key(1))
    outcomes = set()
    for t in rollouts:
        actions = [run.tokenizer.decode(t.tokens[t.action_mask & (t.turn_index == k)]) for k in range(t.info["num_turns"])]
        for k in range(1, t.info["num_turns"]):
            start = probe_lib.first_action_token(t.action_mask, t.turn_index, k)
            has_text = np.array_equal(run.tokenizer.encode(run.tokenizer.decode(t.tokens[1:start])), t.tokens[1:start])
            continuation = probe_lib.Continuation(probe.prompts_by_id[t.prompt_id], tuple(actions[:k]))
            continued = probe.loop.rollout(weights, [continuation], jax.random.key(2))[0]
            assert continued.info["error"] is None
            context = continued.tokens[: probe_lib.first_action_token(continued.action_mask, continued.turn_index, 0)]
            assert np.array_equal(context, t.tokens[:start]) == has_text
            outcomes.add(has_text)
    assert outcomes == {True, False}  # both cases were seen


class ScriptedLoop:
    """Rollouts by a script: the probe's own rollouts are given; a continuation from s_k of prompt p
    conditions on the original rollout's tokens before action k and earns `value[p, k]` (0 or 1) on
    each of its copies, so V̂(s_k) = value[p, k] exactly."""

    def __init__(self, rollouts, value):
        self.rollouts, self.value, self.calls = rollouts, value, 0

    def rollout(self, weights, items, key):
        self.calls += 1
        if self.calls == 1:
            return self.rollouts
        original = {t.prompt_id: t for t in self.rollouts}
        return [continued(original[c.id], len(c.actions), self.value[c.id, len(c.actions)]) for c in items]


def continued(t, turn, reward):
    """The original rollout's context before action `turn`, then a one-token action earning `reward`."""
    start = probe_lib.first_action_token(t.action_mask, t.turn_index, turn)
    n = start + 1
    return Trajectory(tokens=np.append(t.tokens[:start], 50), action_mask=np.arange(n) == start,
                      rollout_logprobs=np.zeros(n, np.float32), rollout_entropy=np.zeros(n, np.float32),
                      policy_version=np.zeros(n, np.int32), rewards=np.where(np.arange(n) == start, reward, 0.0).astype(np.float32),
                      turn_index=np.where(np.arange(n) == start, 0, -1), prompt_id=t.prompt_id,
                      info={"error": None, "num_turns": 1})  # fmt: skip


def two_turns(prompt_id, final_reward):
    """[bos] p | a0 a0 | o0 | a1 a1, the reward on a1's last token."""
    return Trajectory(tokens=np.array([1, 7, 40, 41, 10, 42, 43]), action_mask=np.array([0, 0, 1, 1, 0, 1, 1], bool),
                      rollout_logprobs=np.zeros(7, np.float32), rollout_entropy=np.zeros(7, np.float32),
                      policy_version=np.zeros(7, np.int32), rewards=np.array([0, 0, 0, 0, 0, 0, final_reward], np.float32),
                      turn_index=np.array([-1, -1, 0, 0, 0, 1, 1]), prompt_id=prompt_id,
                      info={"error": None, "num_turns": 2})  # fmt: skip


def scripted_probe():
    """A probe whose own rollouts are two two-turn episodes of its first two prompts (rewards 1 and 0)
    and whose continuations return V̂ = (0, 1) and (1, 0): (state, probe, first id, second id)."""
    run, state, graphs, probe = tiny_probe()
    first, second = probe.prompts[0].id, probe.prompts[1].id
    rollouts = [two_turns(first, 1.0), two_turns(second, 0.0)]
    value = {(first, 0): 0.0, (first, 1): 1.0, (second, 0): 1.0, (second, 1): 0.0}
    probe.loop = ScriptedLoop(rollouts, value)
    return state, probe, first, second


def test_the_probe_compares_each_decision_with_its_monte_carlo_advantage():
    state, probe, first, second = scripted_probe()
    # The estimator's advantage on each token is its position + 10 × row: a0 reads 2 (row 0) and 12.
    probe._advantages = lambda state, batch: np.arange(batch.tokens.shape[1])[None, :] + 10.0 * np.arange(
        batch.tokens.shape[0])[:, None]
    metrics = probe(state, None, step=1)
    # Row 0: A_MC = (0 + 1 − 0, 1 + 0 − 1) = (1, 0); row 1: (0 + 0 − 1, 0 + 0 − 0) = (−1, 0).
    monte_carlo = np.array([1.0, 0.0, -1.0, 0.0])
    ours = np.array([2.0, 5.0, 12.0, 15.0])  # the first tokens of a0 (position 2) and a1 (position 5)
    assert metrics["probe/decisions"] == 4
    assert metrics["probe/advantage_rmse"] == pytest.approx(float(np.sqrt(np.mean((ours - monte_carlo) ** 2))))
    assert metrics["probe/mc_advantage_std"] == pytest.approx(float(np.std(monte_carlo)))
    assert metrics["probe/advantage_correlation"] == pytest.approx(float(np.corrcoef(ours, monte_carlo)[0, 1]))


def test_the_probe_runs_on_a_real_run_and_reports_the_decisions_it_compared():
    run, state, graphs, probe = tiny_probe()
    metrics = probe(state, policy_weights(state, graphs), step=1)
    assert metrics["probe/decisions"] >= len(probe.prompts)  # every rollout has at least one decision
    assert np.isfinite(metrics["probe/advantage_rmse"]) and metrics["probe/mc_advantage_std"] >= 0
    assert -1 <= metrics.get("probe/advantage_correlation", 0.0) <= 1


@pytest.mark.parametrize(("override", "message"), [("advantage.estimator=grpo", "compares a group"),
                                                   ("advantage.gamma=0.9", "undiscounted")])
def test_the_config_refuses_a_probe_it_cannot_run(override, message):
    with pytest.raises(ConfigError, match=f"train.probe_every.*{message}"):
        load_config(overrides=[*TINY, override, "advantage.group_size=2"])


def test_a_rollout_whose_replay_differs_from_it_is_left_out_and_counted():
    state, probe, first, second = scripted_probe()
    original = probe.loop.rollout

    def rollout(weights, items, key):  # the replays of `second` read token 8 where its rollout has 7
        out = original(weights, items, key)
        if probe.loop.calls == 1:
            return out
        return [dataclasses.replace(t, tokens=np.where(np.arange(t.num_tokens) == 1, 8, t.tokens))
                if t.prompt_id == second else t for t in out]  # fmt: skip

    probe.loop.rollout = rollout
    probe._advantages = lambda state, batch: np.zeros(batch.tokens.shape)
    metrics = probe(state, None, step=1)
    assert metrics["probe/decisions"] == 2 and metrics["probe/inexact_replays"] == 1


@pytest.mark.slow
def test_the_probe_logs_its_metrics_and_changes_nothing_the_run_learns(tmp_path):
    """The probe draws its own prompts and keys and leaves the train state as it was: a run with it
    writes the same training metrics as one without, plus the probe's lines every probe_every steps."""
    from sao_jax.train.loop import train

    from tests.train.test_resume import TINY_RUN, algorithm_metrics

    base = [*TINY_RUN, "env.name=chain", "rollout.max_total_tokens=96", "train.steps=4", "train.eval_every=2",
            "train.checkpoint_every=4", "train.probe_prompts=2", "train.probe_continuations=2"]  # fmt: skip
    train(load_config(None, [*base, f"output_dir={tmp_path / 'plain'}"]))
    train(load_config(None, [*base, f"output_dir={tmp_path / 'probed'}", "train.probe_every=2"]))
    plain = algorithm_metrics(tmp_path / "plain" / "metrics.jsonl")
    probed = algorithm_metrics(tmp_path / "probed" / "metrics.jsonl")
    assert [line["step"] for line in probed if "probe/decisions" in line] == [2, 4]
    assert [{k: v for k, v in line.items() if not k.startswith("probe/")} for line in probed] == plain
    assert (tmp_path / "probed" / "plots" / "advantage_probe.png").exists() or not any(
        "probe/advantage_correlation" in line for line in probed)  # plotted when a correlation was defined
