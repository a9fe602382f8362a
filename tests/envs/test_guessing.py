"""Guessing game: generator, feedback, turn budget, shaping and the binary-search demonstration."""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest

from sao_jax.envs.base import Prompt
from sao_jax.envs.guessing import GuessingEnv


def prompts(n=60, seed=0, **kwargs):
    return GuessingEnv.generate_prompts(np.random.default_rng(seed), n, **kwargs)


def game(lo, hi, hidden, max_turns=None):
    size = hi - lo + 1
    budget = max_turns if max_turns is not None else size.bit_length() + 1
    return Prompt(id=0, text=f"Guess {lo}-{hi}:\n", answer=str(hidden), difficulty=1,
                  metadata={"lo": lo, "hi": hi, "max_turns": budget})


def test_generator_covers_the_difficulty_mix():
    mix = prompts(n=600)
    counts = collections.Counter(p.difficulty for p in mix)
    assert set(counts) == {1, 2, 3} and min(counts.values()) > 150
    for p in mix:
        lo, hi, hidden = p.metadata["lo"], p.metadata["hi"], int(p.answer)
        assert hi - lo + 1 == {1: 16, 2: 64, 3: 256}[p.difficulty]
        assert lo <= hidden <= hi and p.text == f"Guess {lo}-{hi}:\n"
        assert p.metadata["max_turns"] == math.floor(math.log2(hi - lo + 1)) + 1 + 1  # worst case + 1 spare
    assert {p.difficulty for p in prompts(n=20, difficulty=3)} == {3}


@pytest.mark.parametrize("size", [16, 64, 256])
def test_binary_search_demonstration_wins_for_every_hidden_number_within_the_worst_case(size):
    lo = 7
    for hidden in range(lo, lo + size):
        prompt = game(lo, lo + size - 1, hidden, max_turns=math.floor(math.log2(size)) + 1)
        demo = GuessingEnv.demonstration(prompt)
        env = GuessingEnv()
        env.reset(prompt)
        results = [env.step(action) for action in demo]
        assert results[-1].done and results[-1].reward == 1.0, (hidden, demo)
        assert not any(r.done for r in results[:-1])


def test_feedback_says_where_the_hidden_number_is():
    env = GuessingEnv()
    env.reset(game(1, 16, 11))
    assert env.step("G: 4\n").observation == "higher\n"
    assert env.step("G: 15\n").observation == "lower\n"
    assert env.step("G: 99\n").observation == "lower\n"  # out of range is still information
    last = env.step("G: 11\n")
    assert last.done and last.reward == 1.0 and last.observation == "" and last.info["feedback"] == "correct"


def test_running_out_of_turns_scores_zero():
    env = GuessingEnv()
    env.reset(game(1, 16, 11))  # budget 6
    results = [env.step("G: 1\n") for _ in range(6)]
    assert [r.done for r in results] == [False] * 5 + [True]
    assert results[-1].reward == 0.0 and results[-1].info["out_of_turns"]
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("G: 11\n")


def test_turn_penalty_shapes_the_reward_by_turns_used():
    env = GuessingEnv(turn_penalty=0.25)
    env.reset(game(1, 16, 11))
    env.step("G: 1\n")
    env.step("G: 2\n")
    assert env.step("G: 11\n").reward == pytest.approx(0.5)  # 1 - 0.25 * (3 - 1)
    env.reset(game(1, 16, 11))
    assert env.step("G: 11\n").reward == 1.0
    with pytest.raises(ValueError, match="turn_penalty"):
        GuessingEnv(turn_penalty=1.5)


def test_constructor_budget_overrides_the_prompt_budget():
    env = GuessingEnv(max_turns=1)
    env.reset(game(1, 16, 11))
    assert env.max_turns == 1 and env.step("G: 3\n").done


@pytest.mark.parametrize("action", ["12\n", "G: twelve\n", "<calc>1</calc>\n", "\n"])
def test_malformed_guess_gets_an_error_observation(action):
    env = GuessingEnv()
    env.reset(game(1, 16, 11))
    result = env.step(action)
    assert (result.observation, result.reward, result.done) == ("<err>format</err>\n", 0.0, False)
