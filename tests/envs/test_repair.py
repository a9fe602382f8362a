"""Repair environment (the chain with a tested answer and one repair), checked against a plain-Python
reference of the documented rules — first right 1, repaired `repair_reward`, never right 0, the turn
budget — and the demonstrations replayed through the environment."""

from __future__ import annotations

import collections
import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sao_jax.config import load_config, to_dict
from sao_jax.data.tokenizers import CharTokenizer
from sao_jax.envs import ENVIRONMENTS, environment_class, make_env
from sao_jax.envs.chain import ChainEnv
from sao_jax.envs.repair import RepairEnv
from sao_jax.train.build import Run, env_options
from sao_jax.train.sft import demonstration_trajectory
from tests.envs.test_chain import ReferenceChain, chain_action, ref_actions, ref_parse

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
SUITE = ROOT / "configs" / "ablations" / "repair"
FAIL = "<test>fail</test>\n"


def prompts(n=80, seed=0, **kwargs):
    return RepairEnv.generate_prompts(np.random.default_rng(seed), n, **kwargs)


def play(env, prompt, actions):
    env.reset(prompt)
    return [env.step(a) for a in actions]


def as_tuples(results):
    return [(r.observation, r.reward, r.done) for r in results]


# ---------------------------------------------------------------------------------- the reference


class ReferenceRepair(ReferenceChain):
    """The rules of the module docstring: the chain's tools; an answer is tested — right first time 1,
    wrong first time "<test>fail</test>" and the episode goes on, right second time `repair_reward`,
    wrong second time 0; budget (links + 1) × 2 + 1 turns."""

    def __init__(self, text: str, max_turns: int | None = None, repair_reward: float = 0.5):
        super().__init__(text, max_turns)
        links, _, _ = ref_parse(text)
        self.budget = max_turns or (len(links) + 1) * 2 + 1
        self.repair_reward, self.answers = repair_reward, 0

    def step(self, action: str) -> tuple[str, float, bool]:
        assert not self.done
        self.turn += 1
        text = action[:-1] if action.endswith("\n") else action
        call = re.fullmatch(r"<(calc|est)>(.*)</\1>", text, flags=re.S)
        answer = re.fullmatch(r"A: ?(-?\d{1,15})", text.strip())
        if call:
            observation, reward, done = self.tool(*call.groups()), 0.0, False
        elif answer:
            self.answers += 1
            if int(answer.group(1)) == self.answer:
                observation, reward, done = "", 1.0 if self.answers == 1 else self.repair_reward, True
            elif self.answers == 1:
                observation, reward, done = FAIL, 0.0, False
            else:
                observation, reward, done = "", 0.0, True
        else:
            observation, reward, done = "<err>format</err>\n", 0.0, False
        if not done and self.turn >= self.budget:
            observation, done = "", True
        self.done = done
        return observation, reward, done


def ref_play(text, actions, **kwargs):
    ref = ReferenceRepair(text, **kwargs)
    out = []
    for a in actions:
        out.append(ref.step(a))
        if out[-1][2]:
            break
    return out


# ------------------------------------------------------------------------------------- the tests


def test_prompts_are_the_chains_with_a_budget_for_two_attempts():
    for difficulty in (None, [1, 2, 3]):
        repair = prompts(n=300, difficulty=difficulty)
        chain = ChainEnv.generate_prompts(np.random.default_rng(0), 300, difficulty)
        assert [(p.text, p.answer, p.difficulty) for p in repair] == [(p.text, p.answer, p.difficulty) for p in chain]
        for p in repair:
            assert p.metadata["max_turns"] == (p.difficulty + 1) * 2 + 1
            env = RepairEnv()
            assert env.reset(p) == p.text and env.max_turns == (p.difficulty + 1) * 2 + 1
    assert prompts(n=1, spare_turns=0, difficulty=3)[0].metadata["max_turns"] == 8
    with pytest.raises(ValueError, match="RepairEnv.generate_prompts: spare_turns"):
        prompts(spare_turns=-1)
    with pytest.raises(ValueError, match="RepairEnv.generate_prompts: difficulty"):
        prompts(difficulty=5)


def test_right_first_time_earns_one():
    for p in prompts(n=120):
        demo = RepairEnv.demonstration(p)
        assert demo == ChainEnv.demonstration(p) == ref_actions(p.text, ["calc"] * p.difficulty)
        results = play(RepairEnv(), p, demo)
        assert as_tuples(results) == ref_play(p.text, demo)
        last = results[-1]
        assert last.done and last.reward == 1.0 and FAIL not in [r.observation for r in results]
        assert last.info["correct"] and last.info["attempt"] == 1 and not last.info["repaired"]
        assert last.info["tools"] == ("calc",) * p.difficulty
        assert not any(r.info["failed_test"] or r.info["repaired"] for r in results)


@pytest.mark.parametrize("repair_reward", [0.5, 0.25, 0.0])
def test_a_failed_test_then_a_right_answer_earns_the_repair_reward(repair_reward):
    for p in prompts(n=60, seed=1):
        gold = RepairEnv.demonstration(p)
        wrong = f"A: {int(p.answer) + 1}\n"
        for first in ([wrong], ref_actions(p.text, ["est"] * p.difficulty), gold[:-1] + [wrong]):
            actions = first + gold
            results = play(RepairEnv(repair_reward=repair_reward), p, actions)
            assert as_tuples(results) == ref_play(p.text, actions, repair_reward=repair_reward)
            failed = len(first) - 1
            assert results[failed].observation == FAIL and not results[failed].done
            assert results[failed].info["attempt"] == 1 and not results[failed].info["correct"]
            last = results[-1]
            assert len(results) == len(actions) and last.done and last.reward == repair_reward
            assert last.info["correct"] and last.info["repaired"] and last.info["attempt"] == 2
            assert [r.info["failed_test"] for r in results] == [False] * failed + [True] * (len(results) - failed)
            assert [r.info["repaired"] for r in results] == [False] * (len(results) - 1) + [True]


def test_never_right_earns_zero_after_the_second_answer():
    for p in prompts(n=60, seed=2):
        gold = RepairEnv.demonstration(p)
        wrong, other = f"A: {int(p.answer) + 1}\n", f"A: {int(p.answer) - 1}\n"
        for actions in ([wrong, other], [wrong, wrong], gold[:-1] + [wrong] + gold[:-1] + [other]):
            results = play(RepairEnv(), p, actions)
            assert as_tuples(results) == ref_play(p.text, actions)
            assert len(results) == len(actions)
            assert [r.observation for r in results].count(FAIL) == 1
            last = results[-1]
            assert last.done and last.reward == 0.0 and last.observation == ""
            assert not last.info["correct"] and not last.info["repaired"] and last.info["attempt"] == 2
            assert "out_of_turns" not in last.info and last.info["failed_test"]


def test_the_turn_budget_holds_two_attempts_and_ends_with_reward_zero():
    for level in (1, 2, 3, 4):
        p = prompts(n=1, seed=level, difficulty=level)[0]
        budget = (level + 1) * 2 + 1
        stalls = ["<calc>10+1</calc>\n"] * budget
        results = play(RepairEnv(), p, stalls)
        assert as_tuples(results) == ref_play(p.text, stalls)
        assert not any(r.done for r in results[:-1])
        assert results[-1].done and results[-1].reward == 0.0 and results[-1].info["out_of_turns"]
        assert not results[-1].info["failed_test"]
        # a wrong first answer on the last turn ends the episode: no failed test, no repair
        late = stalls[: budget - 1] + [f"A: {int(p.answer) + 1}\n"]
        results = play(RepairEnv(), p, late)
        assert as_tuples(results) == ref_play(p.text, late)
        assert results[-1].done and results[-1].observation == "" and results[-1].info["out_of_turns"]
        assert results[-1].info["failed_test"]  # the answer was wrong, though the test was never shown
        # a first attempt with one extra call and a wrong answer, then the gold path: the whole budget
        gold = RepairEnv.demonstration(p)
        actions = gold[:-1] + ["<calc>1+1</calc>\n", f"A: {int(p.answer) + 1}\n"] + gold
        results = play(RepairEnv(), p, actions)
        assert len(actions) == budget and results[-1].reward == 0.5
    p = prompts(n=1, difficulty=4)[0]
    actions = ["A: 1\n", "<calc>1+1</calc>\n"]
    results = play(RepairEnv(max_turns=2), p, actions)
    assert as_tuples(results) == ref_play(p.text, actions, max_turns=2)
    assert results[1].done and results[1].info["out_of_turns"]


def test_weak_demonstration_with_the_repair_earns_one_or_the_repair_reward():
    rewards = collections.defaultdict(list)
    for p in prompts(n=800, difficulty=[1, 2, 3]):
        tools, gold = p.metadata["weak_tools"], RepairEnv.demonstration(p)
        exact = all(t == "calc" for t in tools)
        demo = RepairEnv.weak_demonstration(p)
        assert demo == RepairEnv().weak_demonstration(p) == make_env("repair").weak_demonstration(p)
        assert demo == (gold if exact else ref_actions(p.text, tools) + gold)
        results = play(RepairEnv(), p, demo)
        assert as_tuples(results) == ref_play(p.text, demo)
        assert len(results) == len(demo) and results[-1].done
        assert results[-1].reward == (1.0 if exact else 0.5) and results[-1].info["repaired"] == (not exact)
        assert [r.observation for r in results].count(FAIL) == (0 if exact else 1)
        rewards[p.difficulty].append(results[-1].reward)
    for level, got in rewards.items():  # first right about 2^-n of the time, else repaired
        assert abs(np.mean(np.equal(got, 1.0)) - 0.5**level) < 0.1, level
        assert set(got) <= {0.5, 1.0}


def test_without_the_repair_the_weak_demonstration_stops_at_its_wrong_answer_and_never_shows_the_test():
    tok = CharTokenizer()
    env = RepairEnv(demonstrate_repair=False)
    assert make_env("repair", demonstrate_repair=False).weak_demonstration(prompts(n=1)[0]) == \
        ChainEnv.weak_demonstration(prompts(n=1)[0])
    stopped = 0
    for p in prompts(n=200, difficulty=[1, 2, 3]):
        demo = env.weak_demonstration(p)
        assert demo == ChainEnv.weak_demonstration(p) == RepairEnv.weak_demonstration(p, repair=False)
        trajectory = demonstration_trajectory(RepairEnv(demonstrate_repair=False), p, demo, tok)
        assert "<test>" not in tok.decode(trajectory.tokens)
        assert trajectory.action_mask[-1] and tok.decode(trajectory.tokens[-len(demo[-1]):]) == demo[-1]
        stopped += any(t == "est" for t in p.metadata["weak_tools"])
    assert stopped > 100


def test_demonstrate_repair_flows_from_the_config_to_the_trainers_demonstrations():
    for overrides, repaired in ((["env.name=repair"], True),
                                (["env.name=repair", "env.options.demonstrate_repair=false"], False)):
        config = load_config(overrides=overrides)
        run = Run(config, CharTokenizer(), environment_class("repair"), env_options(config), [], [], None, ())
        for p in prompts(n=40):
            expected = RepairEnv.weak_demonstration(p, repair=repaired)
            assert run.demonstration(p, weak=True) == expected
            assert run.demonstration(p) == RepairEnv.demonstration(p)
    config = load_config(SUITE / "frozen_unseen.yaml")
    assert env_options(config) == {"demonstrate_repair": False}


_KINDS = ("gold", "miscopy", "estimate", "answer_shown", "answer_gold", "answer_wrong", "garbage", "name")


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.data(), st.sampled_from([0.5, 0.3]))
def test_random_episodes_match_the_reference_step_by_step(seed, data, repair_reward):
    p = prompts(n=1, seed=seed)[0]
    links, values, _ = ref_parse(p.text)
    env, ref = RepairEnv(repair_reward=repair_reward), ReferenceRepair(p.text, repair_reward=repair_reward)
    env.reset(p)
    shown, link, answers, failed = None, 0, 0, False
    while True:
        action = chain_action(data.draw(st.sampled_from(_KINDS)), links, values, link, shown)
        result = env.step(action)
        assert (result.observation, result.reward, result.done) == ref.step(action), (p.text, action)
        if "attempt" in result.info:
            answers += 1
            failed |= result.reward == 0.0
            assert result.info["attempt"] == answers
        assert result.info["failed_test"] == failed
        assert result.info["repaired"] == (result.reward == repair_reward and answers == 2)
        if result.done:
            break
        if result.observation == FAIL:
            shown, link = None, 0  # a new attempt starts from the first link
        out = re.fullmatch(r"<out>(-?\d+)</out>\n", result.observation)
        if out:
            shown, link = int(out.group(1)), link + 1


def test_misuse_and_bad_options_raise_clear_errors():
    env = RepairEnv()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("A: 1\n")
    p = prompts(n=1)[0]
    env.reset(p)
    env.step("A: -1\n")
    env.step(f"A: {p.answer}\n")
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("A: 1\n")
    env.reset(p)  # a new episode starts with its first attempt again
    assert env.step(f"A: {p.answer}\n").reward == 1.0
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="repair_reward"):
            RepairEnv(repair_reward=bad)
    with pytest.raises(ValueError, match="max_turns"):
        RepairEnv(max_turns=0)


def test_registered_by_name_with_the_calculator_tools():
    assert ENVIRONMENTS["repair"] is RepairEnv and environment_class("repair") is RepairEnv
    assert RepairEnv.tool_names() == ("calc", "est")
    env = make_env("repair", repair_reward=0.25)
    assert env.repair_reward == 0.25 and env.stop_strings == ("\n",)
    with pytest.raises(ValueError, match="did you mean 'repair'"):
        environment_class("repiar")


def test_the_suite_fits_the_longest_repaired_episode_in_its_token_budget():
    """Every weak demonstration with its repair (the longest demonstrated episodes: a wrong attempt,
    the failed test, the gold path) fits the suite's rollout limits."""
    config = load_config(SUITE / "skip_observation.yaml")
    assert config.env.name == "repair" and config.sft.weak_demonstration_fraction == 1.0
    longest = longest_action = 0
    for p in prompts(n=4000, difficulty=list(config.env.difficulty)):
        demo = RepairEnv.weak_demonstration(p)
        total = 1 + len(p.text) + sum(len(a) for a in demo) + sum(len(obs) for obs, *_ in ref_play(p.text, demo))
        longest, longest_action = max(longest, total), max(longest_action, *map(len, demo))
    assert longest <= config.rollout.max_total_tokens
    assert longest_action <= config.rollout.max_action_tokens


def flat_config(name: str) -> dict:
    """The suite row's loaded config as {dotted key: value}."""
    out = {}

    def walk(value, prefix):
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(inner, f"{prefix}{key}.")
        else:
            out[prefix[:-1]] = value

    walk(json.loads(json.dumps(to_dict(load_config(SUITE / f"{name}.yaml")))), "")
    return out


def test_the_suites_rows_differ_from_their_pair_in_their_variable_only():
    def differ(a, b):
        a, b = flat_config(a), flat_config(b)
        return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}

    assert differ("skip_observation", "cross_observation") == {"advantage.estimator"}
    assert flat_config("skip_observation")["advantage.estimator"] == "skip_observation_gae"
    assert flat_config("cross_observation")["advantage.estimator"] == "cross_observation_gae"
    assert differ("skip_observation", "frozen_unseen") == {"env.options.demonstrate_repair"}
    assert differ("frozen_unseen", "trained_unseen") == {"critic.trainable_patterns"}
    assert flat_config("trained_unseen")["critic.trainable_patterns"] == [".*"]
