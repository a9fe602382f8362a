"""Style-shift writing: the schedule, the rule judge on hand-written texts, and the environment."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from sao_jax.envs.base import Prompt
from sao_jax.envs.judges import STYLES, RuleJudge, Verdict, style_of
from sao_jax.envs.style_shift import StyleSchedule, StyleShiftEnv

SWITCHES = ((0, "cute"), (10, "chuunibyou"), (25, "classical"), (40, "cute"))


def greet(*topics):
    return Prompt(id=3, text=f"Greet {', '.join(topics)}:\n", answer="", difficulty=len(topics),
                  metadata={"topics": topics})


def test_schedule_switches_exactly_at_the_given_steps():
    schedule = StyleSchedule(SWITCHES)
    expected = ["cute"] * 10 + ["chuunibyou"] * 15 + ["classical"] * 15 + ["cute"] * 10
    assert [schedule.style_at(t) for t in range(50)] == expected
    schedule.set_step(24)
    assert schedule.current_style == "chuunibyou"
    schedule.set_step(25)
    assert schedule.current_style == "classical"


@pytest.mark.parametrize("switches, message", [
    (((5, "cute"),), "starting at 0"),
    (((0, "cute"), (10, "classical"), (10, "cute")), "strictly increasing"),
    ((), "starting at 0"),
    (((0, "gothic"),), "unknown style 'gothic'"),
])
def test_schedule_rejects_bad_switch_lists(switches, message):
    with pytest.raises(ValueError, match=message):
        StyleSchedule(switches)


def test_env_refuses_a_private_schedule_built_from_a_plain_list():
    with pytest.raises(TypeError, match="shared StyleSchedule"):
        StyleShiftEnv(schedule=[[0, "cute"]])


def test_schedule_state_dict_round_trips_and_refuses_another_schedule():
    schedule = StyleSchedule(SWITCHES)
    schedule.set_step(31)
    restored = StyleSchedule(SWITCHES)
    restored.load_state_dict(schedule.state_dict())
    assert restored.step == 31 and restored.current_style == "classical"
    with pytest.raises(ValueError, match="differ"):
        StyleSchedule(((0, "cute"),)).load_state_dict(schedule.state_dict())


@pytest.mark.parametrize("text, style", [
    ("nya~ hello cat, so fluffy <3", "cute"),
    ("uwu hi moon", "cute"),
    ("Behold, cat, herald of fate!", "chuunibyou"),
    ("the dark flame greets the rain", "chuunibyou"),
    ("Hail, thou noble cat.", "classical"),
    ("The moon hath risen for thee", "classical"),
    ("I thought of the cat", None),          # "thou" inside a word does not count
    ("nyan cat, fateful day", None),          # neither does "fate" in "fateful"
    ("nya~ thou cat", None),                  # a tie is no style
    ("nya~ uwu thou cat", "cute"),            # strictly most markers wins
    ("sothou cat", None),                     # nor "thou" with a letter before it
    ("hello cat", None),
])
def test_style_of_reads_the_documented_markers(text, style):
    assert style_of(text) == style


@pytest.mark.parametrize("text, topics, target, verdict", [
    ("nya~ hello cat <3", ("cat",), "cute", Verdict(1, 1)),
    ("nya~ hello cat <3", ("cat",), "classical", Verdict(1, 0)),
    ("Behold the moon and the sea, o fate!", ("moon", "sea"), "chuunibyou", Verdict(1, 1)),
    ("Behold the moon, o fate!", ("moon", "sea"), "chuunibyou", Verdict(0, 1)),   # a topic is missing
    ("hail, thou fair tea.", ("tea",), "classical", Verdict(1, 1)),
    ("hail, thou fair teapot.", ("tea",), "classical", Verdict(0, 1)),            # topic only inside a word
    ("thou", ("tea",), "classical", Verdict(0, 1)),                                # too short, one word
    ("hail thou " + "tea " * 30, ("tea",), "classical", Verdict(0, 1)),           # too long
    ("nya~ hello caf\u00e9 cat <3", ("cat",), "cute", Verdict(0, 1)),               # not ASCII
    ("hello cat, good day", ("cat",), "cute", Verdict(1, 0)),                      # no style at all
    ("cat,nya~!", ("cat",), "cute", Verdict(0, 1)),                                # 9 chars but one word
    ("nya~ hello cat " + "x" * 65, ("cat",), "cute", Verdict(1, 1)),               # exactly max_chars = 80
    ("nya~ hello cat " + "x" * 66, ("cat",), "cute", Verdict(0, 1)),               # 81 chars
    ("nya~ cat", ("cat",), "cute", Verdict(1, 1)),                                 # exactly min_chars = 8
])
def test_rule_judge_scores_hand_written_examples(text, topics, target, verdict):
    got = RuleJudge().judge(text, topics=topics, target_style=target)
    assert got == verdict, got.detail
    assert got.reward == verdict.quality * verdict.style


def test_env_judges_against_the_style_of_the_step_it_started_in():
    schedule = StyleSchedule(SWITCHES)
    prompt = greet("cat", "moon")
    cute, dark = (StyleShiftEnv.demonstration(prompt, style)[0] for style in ("cute", "chuunibyou"))
    schedule.set_step(9)
    early = StyleShiftEnv(schedule=schedule)
    early.reset(prompt)
    schedule.set_step(10)  # the switch happens while `early` is mid-episode
    late = StyleShiftEnv(schedule=schedule)
    late.reset(prompt)
    first, second = early.step(cute), late.step(cute)
    assert (first.reward, first.done, first.observation) == (1.0, True, "")
    assert first.info["target_style"] == "cute" and first.info["style"] == "cute"
    assert second.reward == 0.0 and second.info["target_style"] == "chuunibyou"
    again = StyleShiftEnv(schedule=schedule)
    again.reset(prompt)
    assert again.step(dark).reward == 1.0


def test_demonstrations_earn_reward_one_and_cover_the_styles_evenly():
    rng = np.random.default_rng(0)
    prompts = StyleShiftEnv.generate_prompts(rng, 90)
    for style in STYLES:
        schedule = StyleSchedule(((0, style),))
        for prompt in prompts:
            env = StyleShiftEnv(schedule=schedule)
            env.reset(prompt)
            assert env.step(StyleShiftEnv.demonstration(prompt, style)[0]).reward == 1.0
    default_styles = collections.Counter(style_of(StyleShiftEnv.demonstration(p)[0]) for p in prompts)
    assert set(default_styles) == set(STYLES) and min(default_styles.values()) > 15


def test_difficulty_is_the_number_of_topics():
    a = StyleShiftEnv.generate_prompts(np.random.default_rng(1), 300)
    counts = collections.Counter(p.difficulty for p in a)
    assert set(counts) == {1, 2, 3} and min(counts.values()) > 70
    for p in a:
        topics = p.metadata["topics"]
        assert len(set(topics)) == p.difficulty and p.text == f"Greet {', '.join(topics)}:\n"


def test_an_empty_difficulty_list_is_refused_by_name():
    with pytest.raises(ValueError, match="difficulty must be one of"):
        StyleShiftEnv.generate_prompts(np.random.default_rng(0), 3, difficulty=[])
