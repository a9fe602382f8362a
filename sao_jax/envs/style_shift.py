"""Style-shift writing, the online non-stationary experiment (docs/algorithms.md §11).

Prompt:   "Greet cat, moon:\\n"   (difficulty k = number of topics the greeting must name, 1-3)
Action:   one line of text (stop string "\\n") -> done; reward = r_quality × r_style ∈ {0, 1} from the judge.
The target archetype is not in the prompt: it comes from a `StyleSchedule` that switches between
archetypes (cute, chuunibyou, classical) at set training steps, so the policy learns it — and has to
re-learn it after a switch — from the reward alone. Style markers and the rules: `sao_jax.envs.judges`.

One schedule object is shared by every environment of a run (the trainer builds it from config, calls
`set_step` each step and checkpoints `state_dict()`); an environment reads the target at `reset`, so a
trajectory is judged against the style of the step it started in.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np

from sao_jax.envs.base import STOP, EpisodicEnv, Prompt, StepResult, choose_levels, new_prompt_id
from sao_jax.envs.judges import STYLES, Judge, RuleJudge, check_style, style_of

LEVELS = (1, 2, 3)
TOPICS = ("cat", "moon", "rain", "tea", "sea", "star", "bread", "wind", "fox", "snow", "book", "lamp")
DEFAULT_SWITCHES = ((0, "cute"), (100, "chuunibyou"), (200, "classical"))

# Demonstration templates: `{topics}` is "cat" / "cat and moon" / "cat, moon and tea".
_TEMPLATES = {
    "cute": "nya~ hello {topics} <3",
    "chuunibyou": "behold, {topics} of fate!",
    "classical": "hail, thou fair {topics}.",
}


class StyleSchedule:
    """Which archetype is rewarded at each training step.

    switches: ((step, style), ...) with strictly increasing steps, the first at step 0; the style of
    step t is that of the last switch at or before t. The position (`step`) is the only state.
    """

    def __init__(self, switches: Sequence[tuple[int, str]] = DEFAULT_SWITCHES) -> None:
        switches = tuple((int(step), check_style(style)) for step, style in switches)
        steps = [step for step, _ in switches]
        if not switches or steps[0] != 0 or any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"StyleSchedule: switches need strictly increasing steps starting at 0 (got {switches})")
        self.switches = switches
        self._steps = steps
        self._step = 0

    @property
    def step(self) -> int:
        return self._step

    def set_step(self, step: int) -> None:
        if step < 0:
            raise ValueError(f"StyleSchedule.set_step: step must be >= 0 (got {step})")
        self._step = int(step)

    def style_at(self, step: int) -> str:
        return self.switches[bisect.bisect_right(self._steps, step) - 1][1]

    @property
    def current_style(self) -> str:
        return self.style_at(self._step)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step, "switches": [list(s) for s in self.switches]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = tuple((int(step), style) for step, style in state["switches"])
        if saved != self.switches:
            raise ValueError(f"StyleSchedule.load_state_dict: the checkpoint's switches {saved} differ from this "
                             f"schedule's {self.switches}; build the schedule from the run's config")
        self.set_step(state["step"])


class StyleShiftEnv(EpisodicEnv):
    """One-turn writing task judged against the schedule's current style.

    `StepResult.info` holds `turn`, `target_style`, `style` (what `style_of` reads in the text),
    `quality`, `style_match` and the judge's `judge_detail`.
    """

    def __init__(self, *, schedule: StyleSchedule | None = None, judge: Judge | None = None) -> None:
        super().__init__(max_turns=1)
        if schedule is not None and not isinstance(schedule, StyleSchedule):
            raise TypeError(f"StyleShiftEnv: schedule must be the run's shared StyleSchedule, got "
                            f"{type(schedule).__name__}; build StyleSchedule(switches) once and pass it to every env")
        self.schedule = schedule if schedule is not None else StyleSchedule()
        self.judge = judge if judge is not None else RuleJudge()
        self.target_style: str | None = None

    @staticmethod
    def generate_prompts(rng: np.random.Generator, n: int, difficulty: int | Sequence[int] | None = None,
                         ) -> list[Prompt]:
        """`n` prompts; `difficulty` None = uniform mix of 1-3 topics. Deterministic given `rng`."""
        prompts = []
        for level in choose_levels(rng, n, difficulty, LEVELS, env="StyleShiftEnv"):
            topics = tuple(str(TOPICS[i]) for i in rng.choice(len(TOPICS), size=level, replace=False))
            prompts.append(Prompt(id=new_prompt_id(rng), text=f"Greet {', '.join(topics)}:{STOP}", answer="",
                                  difficulty=level, metadata={"topics": topics}))
        return prompts

    @staticmethod
    def demonstration(prompt: Prompt, style: str | None = None) -> list[str]:
        """A greeting naming every topic, in `style`; None picks `STYLES[prompt.id % 3]`, so warm-start
        demonstrations cover the archetypes evenly and RL has to select the rewarded one."""
        style = STYLES[prompt.id % len(STYLES)] if style is None else check_style(style)
        topics = list(prompt.metadata["topics"])
        named = topics[0] if len(topics) == 1 else ", ".join(topics[:-1]) + " and " + topics[-1]
        return [_TEMPLATES[style].format(topics=named) + STOP]

    def _observe_prompt(self, prompt: Prompt) -> str:
        self.target_style = self.schedule.current_style
        return prompt.text

    def _act(self, action: str) -> StepResult:
        verdict = self.judge.judge(action, topics=self.prompt.metadata["topics"], target_style=self.target_style)
        return StepResult("", verdict.reward, True, {
            "target_style": self.target_style, "style": style_of(action), "quality": verdict.quality,
            "style_match": verdict.style, "judge_detail": verdict.detail,
        })

