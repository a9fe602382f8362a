"""Style shift over topics of unequal difficulty: the reward and the switching schedule against a
plain-Python re-implementation written from the definition (docstrings of
`sao_jax.envs.topic_style_shift` and `sao_jax.envs.judges`), hypothesis properties, and the
demonstrations' per-level detail rates."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sao_jax.config import load_config
from sao_jax.envs import ENVIRONMENTS
from sao_jax.envs.base import Prompt
from sao_jax.envs.judges import STYLES, style_of
from sao_jax.envs.style_shift import StyleSchedule
from sao_jax.envs.topic_style_shift import (DEFAULT_DETAIL_RATES, DETAILS, LEVEL_TOPICS, TopicStyleShiftEnv,
                                            includes_detail)
from sao_jax.train.build import env_options

# ------------------------------------------------------------------- the reference, from the definition

MARKERS = {"cute": ["nya~", "uwu", "<3"], "chuunibyou": ["behold", "dark flame", "fate"],
           "classical": ["thou", "thee", "hath"]}  # fmt: skip
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def reference_marker_count(text: str, marker: str) -> int:
    """Occurrences of `marker` in `text`, case-insensitive, left to right without overlap, each with no
    letter just before or just after it."""
    low, count, i = text.lower(), 0, 0
    while i + len(marker) <= len(low):
        before = low[i - 1] if i > 0 else " "
        after = low[i + len(marker)] if i + len(marker) < len(low) else " "
        if low[i:i + len(marker)] == marker and before not in LETTERS and after not in LETTERS:
            count += 1
            i += len(marker)
        else:
            i += 1
    return count


def reference_style(text: str) -> str | None:
    counts = {style: sum(reference_marker_count(text, m) for m in markers) for style, markers in MARKERS.items()}
    best = max(counts.values())
    if best == 0 or list(counts.values()).count(best) > 1:
        return None
    return next(style for style, count in counts.items() if count == best)


def reference_words(text: str) -> set[str]:
    """The maximal runs of letters a-z in the lower-cased text."""
    words, current = set(), ""
    for c in text.lower() + " ":
        if c in LETTERS:
            current += c
        elif current:
            words.add(current)
            current = ""
    return words


def reference_reward(text: str, topic: str, target_style: str) -> tuple[int, int]:
    """(quality, style match): quality needs printable ASCII, 8-80 characters, two or more
    space-separated words, and the topic and its detail word each as a whole word."""
    printable = all(32 <= ord(c) <= 126 for c in text)
    words = reference_words(text)
    quality = (printable and 8 <= len(text) <= 80 and len([w for w in text.split(" ") if w]) >= 2
               and topic in words and REFERENCE_DETAILS[topic] in words)  # fmt: skip
    return int(quality), int(reference_style(text) == target_style)


# Written out again from the module docstring's table, not read from the module.
REFERENCE_DETAILS = {"cat": "purr", "moon": "glow", "rain": "drops", "tea": "steam", "sea": "waves",
                     "star": "shine", "bread": "crust", "wind": "gust", "fox": "tail", "snow": "flakes",
                     "book": "pages", "lamp": "wick"}  # fmt: skip
REFERENCE_LEVELS = {1: {"cat", "moon", "rain"}, 2: {"tea", "sea", "star"}, 3: {"bread", "wind", "fox"},
                    4: {"snow", "book", "lamp"}}  # fmt: skip


def reference_style_at(switches, step: int) -> str:
    """The style of the last switch at or before `step`, by a scan."""
    style = None
    for at, s in switches:
        if at <= step:
            style = s
    return style


def prompt_for(topic: str, prompt_id: int = 7) -> Prompt:
    level = next(level for level, topics in REFERENCE_LEVELS.items() if topic in topics)
    return Prompt(id=prompt_id, text=f"Greet {topic}:\n", answer="", difficulty=level,
                  metadata={"topic": topic, "detail": REFERENCE_DETAILS[topic], "topics": (topic, REFERENCE_DETAILS[topic])})


def play(text: str, prompt: Prompt, style: str):
    env = TopicStyleShiftEnv(schedule=StyleSchedule(((0, style),)))
    env.reset(prompt)
    return env.step(text + "\n")


# ------------------------------------------------------------------------------------------ tests


def test_the_module_tables_are_the_documented_ones():
    assert DETAILS == REFERENCE_DETAILS
    assert {level: set(topics) for level, topics in LEVEL_TOPICS.items()} == REFERENCE_LEVELS
    assert ENVIRONMENTS["topic_style_shift"] is TopicStyleShiftEnv


@pytest.mark.parametrize("text, topic, target, expected", [
    ("behold, fox and its tail of fate!", "fox", "chuunibyou", (1, 1)),
    ("behold, fox of fate!", "fox", "chuunibyou", (0, 1)),              # the detail is missing
    ("behold, fox and its tail of fate!", "fox", "cute", (1, 0)),
    ("hail, thou fair lamp and its wick.", "lamp", "classical", (1, 1)),
    ("hail, thou fair lamp and its wicked.", "lamp", "classical", (0, 1)),  # the detail only inside a word
    ("nya~ hello cat, purr <3", "cat", "cute", (1, 1)),                 # any wording that names both
    ("nya~ purr <3", "cat", "cute", (0, 1)),                            # the detail without the topic
    ("nya~ hello Snow and its FLAKES <3", "snow", "cute", (1, 1)),      # case-insensitive
    ("nya~ thou sea waves", "sea", "cute", (1, 0)),                      # a tie of markers is no style
])
def test_reward_on_hand_written_texts_matches_the_reference(text, topic, target, expected):
    result = play(text, prompt_for(topic), target)
    assert reference_reward(text, topic, target) == expected
    assert (result.info["quality"], result.info["style_match"]) == expected, result.info["judge_detail"]
    assert result.reward == expected[0] * expected[1] and result.done and result.observation == ""
    assert result.info["level"] == prompt_for(topic).difficulty and result.info["target_style"] == target


# Texts built from the pieces that decide the verdict (markers, topics, details, their near misses) and
# noise around them: most draws sit near a boundary of some rule.
PIECES = [m for markers in MARKERS.values() for m in markers] + list(REFERENCE_DETAILS) + list(
    REFERENCE_DETAILS.values()) + ["thought", "fateful", "Behold", "THOU", "uwuu", "cats", "x", "and its", "é", "\t"]
texts = st.lists(st.one_of(st.sampled_from(PIECES), st.sampled_from([" ", ", ", "!", ".", "~", "<", "3"]),
                           st.text(alphabet=LETTERS + " ", max_size=6)), max_size=14).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=texts, topic=st.sampled_from(sorted(REFERENCE_DETAILS)), target=st.sampled_from(STYLES))
def test_reward_matches_the_reference_on_generated_texts(text, topic, target):
    if "\n" in text:
        return
    quality, style = reference_reward(text, topic, target)
    result = play(text, prompt_for(topic), target)
    assert (result.info["quality"], result.info["style_match"]) == (quality, style), result.info["judge_detail"]
    assert result.reward == float(quality * style)
    assert result.info["style"] == reference_style(text) == style_of(text)


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.integers(1, 30), max_size=6), styles=st.lists(st.sampled_from(STYLES), min_size=7, max_size=7),
       steps=st.lists(st.integers(0, 250), min_size=1, max_size=20))  # fmt: skip
def test_schedule_and_env_target_match_a_scan_of_the_switch_list(gaps, styles, steps):
    switches = [(0, styles[0])]
    for gap, style in zip(gaps, styles[1:]):
        switches.append((switches[-1][0] + gap, style))
    schedule = StyleSchedule(switches)
    prompt = prompt_for("fox")
    for step in steps:
        schedule.set_step(step)
        env = TopicStyleShiftEnv(schedule=schedule)
        env.reset(prompt)
        expected = reference_style_at(switches, step)
        assert schedule.current_style == expected == schedule.style_at(step)
        # The target is read at reset: a switch during the episode does not change its verdict.
        schedule.set_step(step + 1000)
        result = env.step(TopicStyleShiftEnv.demonstration(prompt, expected, detail=True)[0])
        assert result.info["target_style"] == expected and result.reward == 1.0


def test_a_config_schedule_cycles_through_several_switches():
    config = load_config("configs/ablations/online_hetero/sao.yaml")
    schedule = env_options(config)["schedule"]
    switches = config.env.options["switches"]
    assert isinstance(schedule, StyleSchedule) and len(switches) >= 4
    assert [schedule.style_at(t) for t in range(config.train.steps)] == [
        reference_style_at(switches, t) for t in range(config.train.steps)]
    assert {s for _, s in switches} == set(STYLES) and all(a != b for (_, a), (_, b) in zip(switches, switches[1:]))


def test_gold_demonstrations_earn_one_and_those_without_the_detail_fail_quality_only():
    prompts = TopicStyleShiftEnv.generate_prompts(np.random.default_rng(0), 120)
    for prompt in prompts:
        for style in STYLES:
            gold = TopicStyleShiftEnv.demonstration(prompt, style, detail=True)[0]
            plain = TopicStyleShiftEnv.demonstration(prompt, style, detail=False)[0]
            assert play(gold[:-1], prompt, style).reward == 1.0
            assert reference_reward(gold[:-1], prompt.metadata["topic"], style) == (1, 1)
            assert (play(plain[:-1], prompt, style).info["quality"], style_of(plain)) == (0, style)
    # The first character of a demonstration names its style: the first action token is the style choice.
    firsts = {TopicStyleShiftEnv.demonstration(prompts[0], style)[0][0] for style in STYLES}
    assert len(firsts) == len(STYLES)


def test_prompts_name_one_topic_of_their_level_and_cover_every_topic():
    prompts = TopicStyleShiftEnv.generate_prompts(np.random.default_rng(1), 1200)
    assert collections.Counter(p.difficulty for p in prompts).keys() == {1, 2, 3, 4}
    topics = collections.Counter(p.metadata["topic"] for p in prompts)
    assert set(topics) == set(REFERENCE_DETAILS) and min(topics.values()) > 60  # 100 expected each
    for p in prompts:
        assert p.metadata["topic"] in REFERENCE_LEVELS[p.difficulty] and p.text == f"Greet {p.metadata['topic']}:\n"
        assert p.metadata["detail"] not in p.text  # the prompt does not say what quality needs
    only_hard = TopicStyleShiftEnv.generate_prompts(np.random.default_rng(2), 50, difficulty=[4])
    assert {p.difficulty for p in only_hard} == {4}


def test_demonstrations_name_the_detail_at_each_levels_rate_independently_of_the_style():
    prompts = [Prompt(id=i, text="", answer="", difficulty=level, metadata={"topic": topic, "detail": DETAILS[topic]})
               for level, topics in LEVEL_TOPICS.items() for topic in topics for i in range(3000)]  # fmt: skip
    named = collections.defaultdict(list)
    for p in prompts:
        text = TopicStyleShiftEnv.demonstration(p)[0]
        assert (p.metadata["detail"] in text) == includes_detail(p)
        named[(p.difficulty, style_of(text))].append(p.metadata["detail"] in text)
    for (level, style), flags in named.items():
        # 3000 prompts per style and level (ids 0..8999 over three topics, a third of them per style):
        # the rate within 4 binomial standard errors.
        rate = DEFAULT_DETAIL_RATES[level - 1]
        assert len(flags) == 3000 and abs(np.mean(flags) - rate) < 4 * np.sqrt(rate * (1 - rate) / len(flags)), (level, style)


def test_an_instance_demonstrates_with_its_own_detail_rates():
    prompt = prompt_for("lamp", prompt_id=11)  # level 4
    always, never = TopicStyleShiftEnv(detail_rates=(1, 1, 1, 1)), TopicStyleShiftEnv(detail_rates=(0, 0, 0, 0))
    assert "wick" in always.demonstration(prompt)[0] and "wick" not in never.demonstration(prompt)[0]
    with pytest.raises(ValueError, match="4 probabilities"):
        TopicStyleShiftEnv(detail_rates=(0.5, 0.5))
