"""TIR environment: tool turns through the sandbox, the verified answer, format errors, the turn budget,
and the synthetic problems checked against answers computed independently (SymPy, brute force) from the
question text."""

import re
from fractions import Fraction

import numpy as np
import pytest
import sympy
from sympy.functions.combinatorial.numbers import nP

from sao_jax.envs import ENVIRONMENTS, Environment
from sao_jax.envs.base import Prompt
from sao_jax.envs.tir import DEFAULT_STOP, FAMILIES, LEVELS, TIREnv

PROBLEM = Prompt(id=1, text="Problem: What is 3/4 + 5/6?\n", answer=r"\frac{19}{12}", difficulty=1)


def started(**config) -> TIREnv:
    env = TIREnv(**config)
    env.reset(PROBLEM)
    return env


def code(source: str) -> str:
    return f"Let me run it.\n```python\n{source}\n```{DEFAULT_STOP}"


# --- tool turns ---------------------------------------------------------------------------------------------


def test_code_block_stdout_is_the_observation():
    result = started().step(code("print(19 * 12)\nprint(6 * 7)"))
    assert result.observation == "```output\n228\n42\n```\n"
    assert (result.reward, result.done) == (0.0, False)
    assert result.info["exit_code"] == 0 and not result.info["timed_out"]


def test_code_tag_and_several_blocks_run_as_one_program():
    env = started()
    assert env.step(f"<code>print(2 + 3)</code>{DEFAULT_STOP}").observation == "```output\n5\n```\n"
    two_blocks = f"```python\nx = 7\n```\nthen\n```py\nprint(x * 6)\n```{DEFAULT_STOP}"
    assert env.step(two_blocks).observation == "```output\n42\n```\n"


def test_error_shows_stdout_then_the_last_line_of_the_traceback():
    result = started().step(code("print('before')\n1 / 0"))
    assert result.observation == "```output\nbefore\nZeroDivisionError: division by zero\n```\n"
    assert result.info["exit_code"] == 1 and not result.done


def test_timeout_is_an_observation():
    result = started(code_timeout_s=0.5).step(code("while True:\n    pass"))
    assert result.observation == "```output\nTimeout: the program was stopped after 0.5 s\n```\n"
    assert result.info["timed_out"] and not result.done


def test_long_output_is_truncated_with_a_marker():
    result = started(max_output_chars=10).step(code("print('x' * 100)"))
    assert result.observation == "```output\nxxxxxxxxxx\n[output truncated to the first 10 characters]\n```\n"


def test_output_of_exactly_max_output_chars_is_not_marked_truncated():
    result = started(max_output_chars=8).step(code("print('abcdefg')"))  # 7 letters + newline = 8 characters
    assert result.observation == "```output\nabcdefg\n```\n"


def test_an_unclosed_code_block_gets_the_hint_on_block_syntax():
    result = started().step(f"```python\nprint(1)\n{DEFAULT_STOP}")
    assert result.observation == ("<err>format: run code in a ```python block, or give the final answer in \\boxed{} "
                                  "(a ```python block starts on its own line and ends with ```)</err>\n")


def test_observation_is_plain_ascii():
    result = started().step(code("print('\\u03c0\\tx')"))
    assert result.observation == "```output\n\\u03c0\\tx\n```\n"


def test_code_wins_over_a_box_in_the_same_message():
    result = started().step(f"```python\nprint(1)\n```\nso \\boxed{{1}}{DEFAULT_STOP}")
    assert result.observation == "```output\n1\n```\n" and not result.done


# --- answers ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("message, reward, verdict", [
    (r"3/4 + 5/6 = 19/12, so \boxed{\frac{19}{12}}", 1.0, "correct"),
    (r"\boxed{19/12}", 1.0, "correct"),
    (r"first \boxed{1}, no: \boxed{1.58333333}", 1.0, "correct"),  # 19/12 = 1.583333... to 6 places
    (r"\boxed{\frac{8}{10}}", 0.0, "wrong"),
    (r"\boxed{)(}", 0.0, "unparsable"),
    (r"\boxed{}", 0.0, "unparsable"),
])
def test_boxed_answer_ends_the_episode_with_the_verified_reward(message, reward, verdict):
    result = started().step(message + DEFAULT_STOP)
    assert (result.observation, result.reward, result.done) == ("", reward, True)
    assert result.info["verdict"] == verdict and result.info["correct"] == (reward == 1.0)


@pytest.mark.parametrize("message, error", [
    ("I think it is nineteen twelfths.", "format"),
    (r"\boxed{\frac{19}{12}", "format"),  # the box never closes
    ("```python\nprint(1)\n", "unclosed code block"),
    ("```python print(1)```", "unclosed code block"),
])
def test_format_error_costs_a_turn(message, error):
    env = started()
    result = env.step(message + DEFAULT_STOP)
    assert result.observation.startswith("<err>format: ") and result.observation.endswith("</err>\n")
    assert (result.reward, result.done, result.info["error"]) == (0.0, False, error)
    assert env.turn == 1


def test_turn_budget_ends_the_episode_with_reward_zero():
    env = started(max_turns=2)
    assert not env.step(code("print(1)")).done
    last = env.step("still thinking" + DEFAULT_STOP)
    assert (last.observation, last.reward, last.done) == ("", 0.0, True)
    assert last.info["out_of_turns"] and last.info["verdict"] == "no_answer"
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step(r"\boxed{1}")


def test_stop_strings_are_a_constructor_argument():
    env = started(stop_strings=["<|im_end|>"])
    assert env.stop_strings == ("<|im_end|>",)
    assert env.step(r"\boxed{19/12}<|im_end|>").reward == 1.0
    with pytest.raises(ValueError, match="stop_strings"):
        TIREnv(stop_strings=[""])


def test_registered_and_follows_the_protocol():
    assert ENVIRONMENTS["tir"] is TIREnv
    env = started()
    assert isinstance(env, Environment) and env.max_turns == 6 and env.stop_strings == (DEFAULT_STOP,)


# --- synthetic problems -------------------------------------------------------------------------------------


def reference_answer(prompt: Prompt) -> sympy.Rational:
    """The answer recomputed from the question text alone, by a different method than the generator's."""
    question = prompt.text.split("Problem: ")[1]
    ints = [int(x) for x in re.findall(r"\d+", question)]
    if question.startswith("What is the sum of 1/(k(k+1))"):
        k = sympy.Symbol("k", integer=True, positive=True)
        return sympy.summation(1 / (k * (k + 1)), (k, ints[2], ints[-1]))  # ints: 1, 1, m, m+1, n
    if question.startswith("What is ") and "remainder" not in question:
        return sympy.sympify(question[len("What is "): question.index("?")], rational=True)
    if question.startswith("What is the remainder when 1^"):
        k = sympy.Symbol("k", integer=True, positive=True)
        power, n, m = ints[1], ints[-3], ints[-1]  # ints: 1, k, 2, k, n, k, m
        return sympy.Integer(sympy.summation(k**power, (k, 1, n)).doit()) % m  # Faulhaber closed form
    if question.startswith("What is the remainder when"):
        body = question[len("What is the remainder when "): question.index(" is divided")]
        return sympy.sympify(body.replace("^", "**")) % ints[-1]
    if question.startswith("In how many ways"):
        return sympy.binomial(ints[1], ints[0])
    if question.startswith("How many distinct arrangements"):
        word = question.split()[-1].rstrip("?")
        return sympy.Integer(nP(word, len(word)))
    if question.startswith("How many integers"):
        big, divisors = ints[1], ints[2:]
        return sympy.Integer(sum(1 for x in range(1, big + 1) if any(x % d == 0 for d in divisors)))
    raise AssertionError(f"unknown question {question!r}")


def latex_value(answer: str) -> sympy.Rational:
    fraction = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", answer)
    if fraction:
        return sympy.Rational(int(fraction.group(2)), int(fraction.group(3))) * (-1 if fraction.group(1) else 1)
    return sympy.Integer(int(answer))


def test_generated_answers_match_an_independent_reference():
    prompts = TIREnv.generate_prompts(np.random.default_rng(0), 150)
    seen = {(p.metadata["family"], p.difficulty) for p in prompts}
    assert seen == {(f, level) for f in FAMILIES for level in LEVELS}
    for prompt in prompts:
        assert latex_value(prompt.answer) == reference_answer(prompt), prompt.text


def test_prompts_are_ascii_and_at_the_asked_level():
    first = TIREnv.generate_prompts(np.random.default_rng(5), 20)
    for prompt in first:
        assert prompt.text.endswith("\n") and all(c == "\n" or " " <= c <= "~" for c in prompt.text)
    assert {p.difficulty for p in TIREnv.generate_prompts(np.random.default_rng(5), 20, difficulty=2)} == {2}
    with pytest.raises(ValueError, match="difficulty"):
        TIREnv.generate_prompts(np.random.default_rng(5), 1, difficulty=4)


def test_demonstrations_run_the_code_and_earn_reward_one():
    # One prompt per (family, level): each runs the sandbox once (~0.1 s).
    prompts = {}
    for prompt in TIREnv.generate_prompts(np.random.default_rng(1), 60):
        prompts.setdefault((prompt.metadata["family"], prompt.difficulty), prompt)
    assert len(prompts) == len(FAMILIES) * len(LEVELS)
    for prompt in prompts.values():
        env = TIREnv()
        env.reset(prompt)
        code_turn, answer_turn = TIREnv.demonstration(prompt)
        value = latex_value(prompt.answer)
        printed = str(Fraction(int(value.p), int(value.q)))
        assert env.step(code_turn).observation == f"```output\n{printed}\n```\n", prompt.text
        final = env.step(answer_turn)
        assert (final.reward, final.done, final.info["verdict"]) == (1.0, True, "correct"), prompt.text
