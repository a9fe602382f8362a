"""Chained-calculator environment, checked against a slow plain-Python reference of the documented
grammar (prompt parsing, values, estimates, tool outputs, rewards, turn budget) — not against the
env's own helpers."""

from __future__ import annotations

import collections
import re
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sao_jax.config import load_config
from sao_jax.envs import ENVIRONMENTS, environment_class, make_env
from sao_jax.envs.chain import ChainEnv

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
_PROMPT = re.compile(r"Q: (.+); ([a-d])=\?\n")
_LINK = re.compile(r"([a-d])=(\d+|[a-d])([+*-])(\d+)")


def prompts(n=80, seed=0, **kwargs):
    return ChainEnv.generate_prompts(np.random.default_rng(seed), n, **kwargs)


def play(env, prompt, actions):
    env.reset(prompt)
    return [env.step(a) for a in actions]


# ---------------------------------------------------------------------------------- the reference


def ref_estimate(value: int) -> int:
    """One significant digit, halves away from zero, with exact fractions."""
    if abs(value) < 10:
        return value
    scale = 10 ** (len(str(abs(value))) - 1)
    rounded = int(Fraction(abs(value), scale) + Fraction(1, 2)) * scale  # floor(x + 1/2) = half up
    return rounded if value > 0 else -rounded


def ref_apply(x: int, op: str, y: int) -> int:
    return {"+": x + y, "-": x - y, "*": x * y, "//": x // y if y else None}[op]


def ref_parse(text: str) -> tuple[list[tuple[str, str, str, int]], list[int], str]:
    """(links as (name, left, op, right), values, asked name) of a prompt text."""
    m = _PROMPT.fullmatch(text)
    assert m, text
    links, values, env = [], [], {}
    for part in m.group(1).split("; "):
        name, left, op, right = _LINK.fullmatch(part).groups()
        x = env[left] if left.isalpha() else int(left)
        env[name] = ref_apply(x, op, int(right))
        links.append((name, left, op, right))
        values.append(env[name])
    return links, values, m.group(2)


def ref_actions(text: str, tools) -> list[str]:
    """The actions of a demonstrator using `tools[k]` at link k that copies every shown value on."""
    links, _, _ = ref_parse(text)
    actions, shown = [], None
    for (_, left, op, right), tag in zip(links, tools):
        x = int(left) if shown is None else shown
        actions.append(f"<{tag}>{x}{op}{right}</{tag}>\n")
        value = ref_apply(x, op, int(right))
        shown = value if tag == "calc" else ref_estimate(value)
    return [*actions, f"A: {shown}\n"]


class ReferenceChain:
    """The grammar of the module docstring, for the expressions the tests write: "X OP Y" with
    integers is evaluated; an expression with two or more operators is "one op"; a name is "not
    allowed"; anything else the tests send is not covered."""

    def __init__(self, text: str, max_turns: int | None = None):
        links, values, _ = ref_parse(text)
        self.answer, self.budget, self.turn, self.done = values[-1], max_turns or len(links) + 2, 0, False

    def tool(self, tag: str, expression: str) -> str:
        if len(re.findall(r"//|[+*]|(?<=[\d)])\s*-", expression)) >= 2:
            return "<err>one op</err>\n"
        if re.search(r"[a-z]", expression):
            return "<err>not allowed</err>\n"
        m = re.fullmatch(r"(-?\d+)(//|[+*-])(\d+)", expression)
        assert m, f"the reference does not cover {expression!r}"
        value = ref_apply(int(m.group(1)), m.group(2), int(m.group(3)))
        return f"<out>{value if tag == 'calc' else ref_estimate(value)}</out>\n"

    def step(self, action: str) -> tuple[str, float, bool]:
        assert not self.done
        self.turn += 1
        text = action[:-1] if action.endswith("\n") else action
        call = re.fullmatch(r"<(calc|est)>(.*)</\1>", text, flags=re.S)
        answer = re.fullmatch(r"A: ?(-?\d{1,15})", text.strip())
        if call:
            observation, reward, done = self.tool(*call.groups()), 0.0, False
        elif answer:
            observation, reward, done = "", float(int(answer.group(1)) == self.answer), True
        else:
            observation, reward, done = "<err>format</err>\n", 0.0, False
        if not done and self.turn >= self.budget:
            observation, done = "", True
        self.done = done
        return observation, reward, done


def ref_play(text, actions, max_turns=None):
    ref = ReferenceChain(text, max_turns)
    out = []
    for a in actions:
        out.append(ref.step(a))
        if out[-1][2]:
            break
    return out


def as_tuples(results):
    return [(r.observation, r.reward, r.done) for r in results]


# ------------------------------------------------------------------------------------- the tests


def test_prompts_follow_the_documented_shapes():
    for p in prompts(n=800):
        links, values, asked = ref_parse(p.text)
        assert len(links) == p.difficulty and asked == "abcd"[p.difficulty - 1]
        assert [name for name, *_ in links] == list("abcd"[: p.difficulty])
        for k, (name, left, op, right) in enumerate(links):
            if k == 0:
                assert 1 <= int(left) <= 99 and 1 <= int(right) <= 99
            else:
                assert left == links[k - 1][0]  # link k reads the previous link's name
                assert (2 <= int(right) <= 9) if op == "*" else (1 <= int(right) <= 99)
        # Every value is in [10, 999] and not round: an estimate anywhere breaks the chain.
        assert all(10 <= v <= 999 and ref_estimate(v) != v for v in values), p.text
        assert p.answer == str(values[-1])
        assert p.metadata["max_turns"] == p.difficulty + 2
        assert len(p.metadata["weak_tools"]) == p.difficulty and set(p.metadata["weak_tools"]) <= {"calc", "est"}


def test_the_level_mix_is_uniform_by_default_and_follows_difficulty():
    counts = collections.Counter(p.difficulty for p in prompts(n=800))
    assert set(counts) == {1, 2, 3, 4} and min(counts.values()) > 150
    assert {p.difficulty for p in prompts(n=40, difficulty=3)} == {3}
    mixed = collections.Counter(p.difficulty for p in prompts(n=600, difficulty=[1, 4, 4]))
    assert set(mixed) == {1, 4} and 1.6 < mixed[4] / mixed[1] < 2.5
    with pytest.raises(ValueError, match="difficulty must be one of"):
        prompts(difficulty=5)


def test_demonstration_is_the_exact_tool_at_every_link_and_earns_reward_one():
    for p in prompts(n=120):
        demo = ChainEnv.demonstration(p)
        assert demo == ref_actions(p.text, ["calc"] * p.difficulty)
        results = play(ChainEnv(), p, demo)
        assert as_tuples(results) == ref_play(p.text, demo)
        _, values, _ = ref_parse(p.text)
        assert [r.observation for r in results[:-1]] == [f"<out>{v}</out>\n" for v in values]
        assert results[-1].done and results[-1].reward == 1.0
        assert results[-1].info["tools"] == ("calc",) * p.difficulty


def test_weak_demonstration_flips_a_coin_per_link_and_wins_only_on_the_all_exact_path():
    rewards, est = collections.defaultdict(list), collections.defaultdict(list)
    for p in prompts(n=800):
        tools = p.metadata["weak_tools"]
        demo = ChainEnv.weak_demonstration(p)
        assert demo == ref_actions(p.text, tools)
        results = play(ChainEnv(), p, demo)
        assert as_tuples(results) == ref_play(p.text, demo)
        assert results[-1].done and results[-1].reward == float(all(t == "calc" for t in tools))
        rewards[p.difficulty].append(results[-1].reward)
        for k, t in enumerate(tools):
            est[k].append(t == "est")
    assert all(0.4 < np.mean(v) < 0.6 for v in est.values())  # a fair coin at every link
    for level, got in rewards.items():  # wins about 2^-n of the time: usually 0, falling with n
        assert abs(np.mean(got) - 0.5**level) < 0.12, level
    assert np.mean([r for got in rewards.values() for r in got]) < 0.35


def test_a_wrong_copy_breaks_the_chain():
    for p in prompts(n=60, difficulty=[2, 3, 4]):
        _, values, _ = ref_parse(p.text)
        gold = ChainEnv.demonstration(p)
        # Link 2 is called with the value shown for link 1 off by one; later links copy what they see.
        m = re.fullmatch(r"<calc>(\d+)(.+)</calc>\n", gold[1])
        actions = [gold[0], f"<calc>{int(m.group(1)) + 1}{m.group(2)}</calc>\n"]
        env, ref = ChainEnv(), ReferenceChain(p.text)
        env.reset(p)
        shown = None
        for k, action in enumerate(actions + [None] * (p.difficulty - 2)):
            if action is None:
                op_right = re.fullmatch(r"<calc>\d+(.+)</calc>\n", gold[k]).group(1)
                action = f"<calc>{shown}{op_right}</calc>\n"
            result = env.step(action)
            assert (result.observation, result.reward, result.done) == ref.step(action)
            shown = int(re.fullmatch(r"<out>(-?\d+)</out>\n", result.observation).group(1))
        assert shown != values[-1]
        final = env.step(f"A: {shown}\n")
        assert final.done and final.reward == 0.0 and ref.step(f"A: {shown}\n") == ("", 0.0, True)


def test_the_turn_budget_scales_with_the_links_and_ends_with_reward_zero():
    for level in (1, 2, 3, 4):
        p = prompts(n=1, seed=level, difficulty=level)[0]
        assert ChainEnv().reset(p) == p.text
        env = ChainEnv()
        env.reset(p)
        assert env.max_turns == level + 2
        stalls = ["<calc>10+1</calc>\n"] * (level + 2)
        results = play(env, p, stalls)
        assert as_tuples(results) == ref_play(p.text, stalls)
        assert not any(r.done for r in results[:-1])
        assert results[-1].done and results[-1].reward == 0.0 and results[-1].info["out_of_turns"]
        assert results[-1].observation == ""
    p = prompts(n=1, difficulty=4)[0]
    results = play(ChainEnv(max_turns=2), p, ["<calc>1+1</calc>\n", "<calc>2+2</calc>\n"])
    assert as_tuples(results) == ref_play(p.text, ["<calc>1+1</calc>\n", "<calc>2+2</calc>\n"], max_turns=2)
    assert results[1].done and results[1].info["out_of_turns"]
    with pytest.raises(ValueError, match="spare_turns"):
        prompts(spare_turns=-1)


@pytest.mark.parametrize("action, observation", [
    ("<calc>17*3+4</calc>\n", "<err>one op</err>\n"),      # the whole chain in one call is refused
    ("<est>(17*3)+4</est>\n", "<err>one op</err>\n"),
    ("<calc>1-2-3</calc>\n", "<err>one op</err>\n"),
    ("<calc>a+4</calc>\n", "<err>not allowed</err>\n"),    # the name, not the value: nothing to copy from
    ("<calc>17*</calc>\n", "<err>syntax</err>\n"),
    ("<calc>2**3</calc>\n", "<err>not allowed</err>\n"),
    ("<calc>7//0</calc>\n", "<err>div by 0</err>\n"),
    ("<calc>17*3\n", "<err>format</err>\n"),
    ("<calc>17*3</est>\n", "<err>format</err>\n"),
    ("A: five\n", "<err>format</err>\n"),
    ("A: 5 because\n", "<err>format</err>\n"),
    ("the answer is 5\n", "<err>format</err>\n"),
])
def test_malformed_actions_get_an_error_observation_and_cost_a_turn(action, observation):
    p = prompts(n=1, difficulty=3)[0]
    env = ChainEnv()
    env.reset(p)
    result = env.step(action)
    assert (result.observation, result.reward, result.done) == (observation, 0.0, False)
    assert "error" in result.info and env.turn == 1


def test_a_single_operation_with_a_negative_operand_is_allowed():
    env = ChainEnv()
    env.reset(prompts(n=1)[0])
    assert env.step("<calc>-5+3</calc>\n").observation == "<out>-2</out>\n"
    assert env.step("<est>-512*1</est>\n").observation == "<out>-500</out>\n"


_KINDS = ("gold", "miscopy", "estimate", "answer_shown", "answer_gold", "answer_wrong", "answer_far", "name", "two_ops",
          "garbage")


def chain_action(kind: str, links, values, link: int, shown: int | None) -> str:
    """One action of `kind` at link `link` (0-based) of a chain parsed by `ref_parse`, `shown` the
    last value the tool showed (None before the first call)."""
    _, left, op, right = links[min(link, len(links) - 1)]
    x = int(left) if shown is None else shown
    return {
        "gold": f"<calc>{x}{op}{right}</calc>\n", "miscopy": f"<calc>{x + 1}{op}{right}</calc>\n",
        "estimate": f"<est>{x}{op}{right}</est>\n", "answer_shown": f"A: {shown}\n",
        "answer_gold": f"A: {values[-1]}\n", "answer_wrong": f"A: {values[-1] + 1}\n",
        "answer_far": f"A: {2 * values[-1]}\n",
        "name": f"<calc>{'abcd'[min(max(link - 1, 0), 3)]}{op}{right}</calc>\n", "two_ops": f"<calc>{x}{op}{right}+1</calc>\n",
        "garbage": "<calc" + str(x) + "\n",
    }[kind]  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.data())
def test_random_episodes_match_the_reference_step_by_step(seed, data):
    p = prompts(n=1, seed=seed)[0]
    links, values, _ = ref_parse(p.text)
    env, ref = ChainEnv(), ReferenceChain(p.text)
    env.reset(p)
    shown, link = None, 0
    while True:
        action = chain_action(data.draw(st.sampled_from(_KINDS)), links, values, link, shown)
        result = env.step(action)
        assert (result.observation, result.reward, result.done) == ref.step(action), (p.text, action)
        if result.done:
            break
        out = re.fullmatch(r"<out>(-?\d+)</out>\n", result.observation)
        if out:
            shown, link = int(out.group(1)), link + 1


def test_misuse_raises_clear_errors():
    env = ChainEnv()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("A: 1\n")
    p = prompts(n=1)[0]
    env.reset(p)
    env.step(f"A: {p.answer}\n")
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("A: 1\n")
    with pytest.raises(ValueError, match="max_turns"):
        ChainEnv(max_turns=0)


def test_registered_by_name_with_the_calculator_tools():
    assert ENVIRONMENTS["chain"] is ChainEnv and environment_class("chain") is ChainEnv
    assert ChainEnv.tool_names() == ("calc", "est")
    env = make_env("chain")
    p = prompts(n=1)[0]
    assert env.reset(p) == p.text and env.stop_strings == ("\n",)
    with pytest.raises(ValueError, match="did you mean 'chain'"):
        environment_class("chian")


def test_the_suite_fits_the_longest_gold_episode_in_its_token_budget():
    """The chain suite's rollout limits hold every gold episode (bos + prompt + actions + observations):
    a limit below it would truncate correct answers."""
    config = load_config(ROOT / "configs" / "ablations" / "chain" / "sao.yaml")
    assert config.env.name == "chain" and config.sft.weak_demonstration_fraction == 1.0
    longest = longest_action = 0
    for p in prompts(n=2000, difficulty=list(config.env.difficulty)):
        demo = ChainEnv.demonstration(p)
        total = 1 + len(p.text) + sum(len(a) for a in demo)
        total += sum(len(obs) for obs, *_ in ref_play(p.text, demo))
        longest, longest_action = max(longest, total), max(longest_action, *map(len, demo))
    # Worst case by construction: "Q: a=99*99..." cannot occur (values <= 999), so 3-digit values,
    # 2-digit operands: prompt 39, per link "<calc>999+99</calc>\n" 20 + "<out>999</out>\n" 15, "A: 999\n" 7.
    assert longest <= 1 + 39 + 4 * 35 + 7 <= config.rollout.max_total_tokens
    assert longest_action <= 20 <= config.rollout.max_action_tokens
