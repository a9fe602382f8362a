"""Calculator (and Python-tool) environment: generator, grammar, rewards, and the safe evaluator."""

from __future__ import annotations

import collections
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sao_jax.envs import ENVIRONMENTS, Environment, environment_class, make_env
from sao_jax.envs.calculator import CalculatorEnv, PythonToolEnv, ToolError, estimate, safe_eval


def prompts(n=60, seed=0, **kwargs):
    return CalculatorEnv.generate_prompts(np.random.default_rng(seed), n, **kwargs)


def play(env, prompt, actions):
    env.reset(prompt)
    return [env.step(a) for a in actions]


def test_generator_covers_the_difficulty_mix_with_the_documented_shapes():
    mix = prompts(n=600)
    counts = collections.Counter(p.difficulty for p in mix)
    assert set(counts) == {1, 2, 3} and min(counts.values()) > 150
    for p in mix:
        expression = p.metadata["expression"]
        operators = re.findall(r"//|[+*-]", expression)
        operands = [int(x) for x in re.findall(r"\d+", expression)]
        assert len(operators) == p.difficulty
        assert max(operands) <= (999 if p.difficulty == 3 else 99) and min(operands) >= 1
        if p.difficulty == 1:
            assert "//" not in operators
        assert p.text == f"Q: {expression}=?\n"
        assert int(p.answer) == eval(expression)  # independent reference: Python on digits and operators
    assert any("(" in p.metadata["expression"] for p in mix if p.difficulty == 3)
    assert {p.difficulty for p in prompts(n=30, difficulty=2)} == {2}
    assert {p.difficulty for p in prompts(n=60, difficulty=[1, 3])} == {1, 3}
    with pytest.raises(ValueError, match="difficulty must be one of"):
        prompts(difficulty=4)


def test_word_form_prompts_use_words_and_the_demonstration_still_wins():
    for p in prompts(n=20, word_form_prob=1.0):
        assert not re.search(r"[+*/]|\d-", p.text) and re.search(r"plus|minus|times|over", p.text)
        assert play(CalculatorEnv(), p, CalculatorEnv.demonstration(p))[-1].reward == 1.0


def test_demonstration_fed_through_step_earns_reward_one():
    for p in prompts(n=60):
        demo = CalculatorEnv.demonstration(p)
        results = play(CalculatorEnv(), p, demo)
        assert results[0].observation == f"<out>{p.answer}</out>\n" and not results[0].done
        assert results[-1].done and results[-1].reward == 1.0 and results[-1].observation == ""
        assert all(action.endswith("\n") and action.isascii() for action in demo)


def _estimate_reference(value: int) -> int:
    """One significant digit, halves away from zero, by decimal arithmetic (not the env's digit maths)."""
    from decimal import ROUND_HALF_UP, Decimal

    if abs(value) < 10:
        return value
    exponent = Decimal(value).adjusted()
    return int(Decimal(value).scaleb(-exponent).quantize(Decimal(1), rounding=ROUND_HALF_UP).scaleb(exponent))


@given(st.integers(-(10**12), 10**12))
def test_estimate_rounds_to_one_significant_digit(value):
    assert estimate(value) == _estimate_reference(value)


def test_estimate_examples():
    assert [estimate(v) for v in (7, -7, 10, 14, 15, 55, 95, -1250, -1500, 999)] == [
        7, -7, 10, 10, 20, 60, 100, -1000, -2000, 1000]


def test_weak_demonstration_calls_the_estimator_and_is_right_only_on_round_values():
    outcomes = []
    for p in prompts(n=200):
        demo = CalculatorEnv.weak_demonstration(p)
        results = play(CalculatorEnv(), p, demo)
        value = int(p.answer)
        assert demo[0] == f"<est>{p.metadata['expression']}</est>\n"
        assert results[0].observation == f"<out>{_estimate_reference(value)}</out>\n"
        assert results[0].info["tool"] == "est" and not results[0].done
        assert results[-1].done and results[-1].reward == float(_estimate_reference(value) == value)
        outcomes.append(results[-1].reward)
    assert 0.0 < np.mean(outcomes) < 0.3  # the weak demonstrator is usually wrong, sometimes right


def test_estimator_errors_like_the_calculator():
    env = CalculatorEnv()
    env.reset(prompts(n=1)[0])
    result = env.step("<est>2**3</est>")
    assert result.observation == "<err>not allowed</err>\n" and result.info["tool"] == "est"


def test_wrong_answer_ends_with_reward_zero():
    p = prompts(n=1)[0]
    result = play(CalculatorEnv(), p, [f"A: {int(p.answer) + 1}\n"])[0]
    assert result.done and result.reward == 0.0 and result.info["correct"] is False


def test_answer_without_stop_string_is_accepted():
    p = prompts(n=1)[0]
    assert play(CalculatorEnv(), p, [f"A: {p.answer}"])[0].reward == 1.0


def test_right_answer_followed_by_more_text_is_a_format_error_not_an_answer():
    p = prompts(n=1)[0]
    result = play(CalculatorEnv(), p, [f"A: {p.answer} because\n"])[0]
    assert (result.observation, result.reward, result.done) == ("<err>format</err>\n", 0.0, False)
    assert result.info["error"] == "format"


@pytest.mark.parametrize("action, observation", [
    ("<calc>17*</calc>\n", "<err>syntax</err>\n"),
    ("<calc>__import__('os').system('id')</calc>\n", "<err>not allowed</err>\n"),
    ("<calc>2**10</calc>\n", "<err>not allowed</err>\n"),
    ("<calc>7//(3-3)</calc>\n", "<err>div by 0</err>\n"),
    ("<calc>17*3\n", "<err>format</err>\n"),
    ("the answer is 5\n", "<err>format</err>\n"),
    ("A: five\n", "<err>format</err>\n"),
])
def test_malformed_actions_get_an_error_observation_not_an_exception(action, observation):
    env = CalculatorEnv()
    env.reset(prompts(n=1)[0])
    result = env.step(action)
    assert (result.observation, result.reward, result.done) == (observation, 0.0, False)
    assert "error" in result.info


def test_turn_budget_ends_the_episode_with_reward_zero():
    p = prompts(n=1)[0]
    results = play(CalculatorEnv(max_turns=2), p, ["<calc>1+1</calc>\n", "<calc>2+2</calc>\n"])
    assert not results[0].done
    assert results[1].done and results[1].reward == 0.0 and results[1].info["out_of_turns"]
    assert results[1].observation == ""


def test_misuse_raises_clear_errors():
    env = CalculatorEnv()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("A: 1\n")
    p = prompts(n=1)[0]
    env.reset(p)
    with pytest.raises(TypeError, match="as str"):
        env.step(b"A: 1\n")
    env.step(f"A: {p.answer}\n")
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("A: 1\n")
    with pytest.raises(ValueError, match="max_turns"):
        CalculatorEnv(max_turns=0)


@pytest.mark.parametrize("expression, reason", [
    ("(1).real", "not allowed"), ("x + 1", "not allowed"), ("abs(-3)", "not allowed"),
    ("9**999999", "not allowed"), ("2**3", "not allowed"), ("1.5 + 1", "not allowed"), ("'a' * 3", "not allowed"),
    ("True + 1", "not allowed"), ("1 / 2", "not allowed"), ("[1][0]", "not allowed"), ("(lambda: 1)()", "not allowed"),
    ("1 if 1 else 2", "not allowed"), ("1 < 2", "not allowed"), ("5 % 3", "not allowed"),
    ("999999*999999*999999", "too big"), ("1" * 13, "too big"), ("1+" * 40 + "1", "too long"),
    ("3 //0", "div by 0"), ("", "syntax"), ("1 +", "syntax"), ("1;2", "syntax"),
])
def test_safe_eval_rejects_everything_but_integer_arithmetic(expression, reason):
    with pytest.raises(ToolError, match=re.escape(reason)):
        safe_eval(expression)


_numbers = st.integers(0, 999).map(str)
_expressions = st.recursive(  # at most 4 numbers below 1000: every intermediate stays below 10^12
    _numbers,
    lambda inner: st.one_of(
        st.tuples(inner, st.sampled_from(["+", "-", "*", "//"]), inner).map(lambda t: f"{t[0]}{t[1]}{t[2]}"),
        inner.map(lambda e: f"({e})"),
        inner.map(lambda e: f"-{e}"),
    ),
    max_leaves=4,
)


@settings(max_examples=200, deadline=None)
@given(_expressions)
def test_safe_eval_matches_python_on_allowed_expressions(expression):
    if len(expression) > 64:
        with pytest.raises(ToolError, match="too long"):
            safe_eval(expression)
        return
    try:
        expected = eval(expression)  # reference: the expression holds only digits, + - * // and parentheses
    except ZeroDivisionError:
        with pytest.raises(ToolError, match="div by 0"):
            safe_eval(expression)
        return
    assert safe_eval(expression) == expected


def test_registry_builds_every_environment_and_names_close_matches():
    for name, cls in ENVIRONMENTS.items():
        if name == "scaffold":  # its episodes are the scaffold's own, not stepped (tests/rollout/test_server.py)
            continue
        env = make_env(name)
        prompt = cls.generate_prompts(np.random.default_rng(0), 1)[0]
        assert env.reset(prompt) == prompt.text and env.max_turns >= 1
        # Every action is one line, except TIR's multi-line messages (stop "@", one character token).
        assert isinstance(env, Environment) and env.stop_strings == (("@",) if name == "tir" else ("\n",))
    with pytest.raises(ValueError, match="did you mean 'calculator'"):
        environment_class("calculater")


def test_python_tool_env_runs_the_demonstration_in_the_sandbox():
    p = prompts(n=1, seed=1)[0]
    results = play(PythonToolEnv(), p, PythonToolEnv.demonstration(p))
    assert results[0].observation == f"<out>{p.answer}</out>\n"
    assert results[-1].reward == 1.0
    env = PythonToolEnv()
    env.reset(p)
    assert env.step("<py>print(1//0)</py>\n").observation == "<err>ZeroDivisionError</err>\n"
    assert env.step("<py>print('a\\tb\\u00e9')</py>\n").observation == "<out>a?b?</out>\n"
