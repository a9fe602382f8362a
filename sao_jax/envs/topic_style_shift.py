"""Style-shift writing over topics of unequal difficulty: the online experiment where the value of a
start state depends on the prompt (docs/algorithms.md §11).

Prompt:   "Greet fox:\\n"   (one topic of 12; the topic's level d in 1-4 is its difficulty)
Action:   one line of text (stop string "\\n") -> done; reward = r_quality × r_style ∈ {0, 1} from the judge.
Quality:  the judge's rules (`sao_jax.envs.judges.RuleJudge`) with the required words (topic, detail):
          the text must name the topic *and* the topic's detail word, which the prompt does not give
          ("fox" needs "tail": "behold, fox and its tail of fate!"). Style: as `style_shift`, against
          the run's shared `StyleSchedule`, which switches the rewarded archetype without the prompt
          saying so.

What makes a topic hard is how rarely the demonstrator writes its detail: a demonstration for a
prompt of level d names the detail with probability `detail_rates[d − 1]` (default 0.9, 0.6, 0.3,
0.1), decided by a hash of the prompt id (`includes_detail`) independent of the style, which is
`STYLES[id % 3]` as in `style_shift`. The warm start imitates that mix, so it meets the quality check of
a level-1 topic most of the time and of a level-4 topic rarely: with one trajectory per prompt, the
expected reward of a start state is then ≈ P(rewarded style) × P(quality | topic), a number that
differs by topic and that one global running mean cannot hold. A demonstration without the detail
earns reward 0 (quality fails): unlike the other environments', these demonstrations are not all gold
(`demonstration(prompt, detail=True)` is).

Every demonstration starts with its style's first marker ("nya~", "behold", "hail, thou"), so the first
action token is the style choice, which the trainer's first-action advantage by style reads.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from sao_jax.envs.base import STOP, Prompt, choose_levels, new_prompt_id
from sao_jax.envs.judges import STYLES, check_style
from sao_jax.envs.style_shift import StyleShiftEnv

LEVELS = (1, 2, 3, 4)
# The topics of each level and each topic's detail word (no style marker, no other topic's word).
LEVEL_TOPICS: dict[int, tuple[str, ...]] = {
    1: ("cat", "moon", "rain"),
    2: ("tea", "sea", "star"),
    3: ("bread", "wind", "fox"),
    4: ("snow", "book", "lamp"),
}
DETAILS: dict[str, str] = {
    "cat": "purr", "moon": "glow", "rain": "drops", "tea": "steam", "sea": "waves", "star": "shine",
    "bread": "crust", "wind": "gust", "fox": "tail", "snow": "flakes", "book": "pages", "lamp": "wick",
}  # fmt: skip
TOPIC_LEVEL: dict[str, int] = {topic: level for level, topics in LEVEL_TOPICS.items() for topic in topics}
DEFAULT_DETAIL_RATES = (0.9, 0.6, 0.3, 0.1)

# Demonstration templates: `{named}` is "cat" or "cat and its purr".
_TEMPLATES = {
    "cute": "nya~ hello {named} <3",
    "chuunibyou": "behold, {named} of fate!",
    "classical": "hail, thou fair {named}.",
}


def check_detail_rates(rates: Sequence[float]) -> tuple[float, ...]:
    rates = tuple(float(r) for r in rates)
    if len(rates) != len(LEVELS) or not all(0.0 <= r <= 1.0 for r in rates):
        raise ValueError(f"TopicStyleShiftEnv: detail_rates must be {len(LEVELS)} probabilities in [0, 1], one per "
                         f"level {LEVELS} (got {rates})")
    return rates


def unit_hash(prompt_id: int) -> float:
    """A number in [0, 1) from the prompt id (splitmix64's finaliser, top 53 bits): uniform over ids and
    unrelated to `id % 3`, which picks the demonstration's style."""
    z = (int(prompt_id) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


def includes_detail(prompt: Prompt, detail_rates: Sequence[float] = DEFAULT_DETAIL_RATES) -> bool:
    """Whether the demonstration of `prompt` names its topic's detail: `unit_hash(id) < rate of its level`."""
    return unit_hash(prompt.id) < detail_rates[prompt.difficulty - 1]


class TopicStyleShiftEnv(StyleShiftEnv):
    """`style_shift` whose quality check needs the topic's detail word too (module docstring).

    `detail_rates`: per level 1-4, the share of demonstrations that name the detail (how often the warm
    start meets the topic's quality check). `StepResult.info` is `style_shift`'s plus `level`.
    """

    def __init__(self, *, schedule=None, judge=None, detail_rates: Sequence[float] = DEFAULT_DETAIL_RATES) -> None:
        super().__init__(schedule=schedule, judge=judge)
        self.detail_rates = check_detail_rates(detail_rates)
        self.demonstration = functools.partial(type(self).demonstration, detail_rates=self.detail_rates)

    @staticmethod
    def generate_prompts(rng: np.random.Generator, n: int, difficulty: int | Sequence[int] | None = None,
                         ) -> list[Prompt]:
        """`n` prompts, each one topic of a level drawn uniformly from `difficulty` (None: 1-4), the topic
        uniform within its level; deterministic given `rng`."""
        prompts = []
        for level in choose_levels(rng, n, difficulty, LEVELS, env="TopicStyleShiftEnv"):
            topics = LEVEL_TOPICS[level]
            topic = topics[int(rng.integers(len(topics)))]
            prompts.append(Prompt(id=new_prompt_id(rng), text=f"Greet {topic}:{STOP}", answer="", difficulty=level,
                                  metadata={"topic": topic, "detail": DETAILS[topic],
                                            "topics": (topic, DETAILS[topic])}))  # fmt: skip
        return prompts

    @classmethod
    def demonstration(cls, prompt: Prompt, style: str | None = None, *, detail: bool | None = None,
                      detail_rates: Sequence[float] = DEFAULT_DETAIL_RATES) -> list[str]:
        """A greeting in `style` (None: `STYLES[id % 3]`) naming the topic and, when `detail` (None:
        `includes_detail(prompt, detail_rates)`), its detail word. On an instance, `detail_rates` is the
        instance's."""
        style = STYLES[prompt.id % len(STYLES)] if style is None else check_style(style)
        topic = prompt.metadata["topic"]
        if detail is None:
            detail = includes_detail(prompt, detail_rates)
        named = f"{topic} and its {prompt.metadata['detail']}" if detail else topic
        return [_TEMPLATES[style].format(named=named) + STOP]

    def _act(self, action: str):
        result = super()._act(action)
        result.info["level"] = self.prompt.difficulty
        return result
