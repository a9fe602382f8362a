"""Guess a hidden integer: here the observation *is* the information (skip- vs cross-observation GAE).

Prompt:   "Guess 17-80:\\n"   (the hidden number h lies in [lo, hi], both shown)
Action:   "G: INTEGER"        (one line; the stop string is "\\n")
  -> "higher\\n" if h > guess, "lower\\n" if h < guess; a correct guess ends the episode with
     reward max(0, 1 - turn_penalty * (turns used - 1)); anything else -> "<err>format</err>\\n".
The turn budget (constructor `max_turns`, else the prompt's own) ends the episode with reward 0.

Difficulty k: the range holds 4^(k+1) numbers (16, 64, 256); the prompt's budget is the worst case of
binary search, `size.bit_length()`, plus `spare_turns`. The demonstration is binary search.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from sao_jax.envs.base import STOP, EpisodicEnv, Prompt, StepResult, choose_levels, error_observation, new_prompt_id

LEVELS = (1, 2, 3)
_GUESS = re.compile(r"G: ?(-?\d{1,9})")


class GuessingEnv(EpisodicEnv):
    """Find the hidden number from "higher"/"lower" feedback.

    `turn_penalty` shapes the reward by turns used (0 = plain 0/1 reward). `StepResult.info` holds
    `turn`, and as they apply `guess`, `feedback` ("higher"/"lower"/"correct"), `error`, `out_of_turns`.
    """

    def __init__(self, *, max_turns: int | None = None, turn_penalty: float = 0.0) -> None:
        super().__init__(max_turns=max_turns)
        if not 0.0 <= turn_penalty <= 1.0:
            raise ValueError(f"GuessingEnv: turn_penalty must be in [0, 1] (got {turn_penalty})")
        self.turn_penalty = turn_penalty

    @staticmethod
    def generate_prompts(rng: np.random.Generator, n: int, difficulty: int | Sequence[int] | None = None, *,
                         spare_turns: int = 1) -> list[Prompt]:
        """`n` games; `difficulty` None = uniform mix of levels 1-3. Deterministic given `rng`."""
        prompts = []
        for level in choose_levels(rng, n, difficulty, LEVELS, env="GuessingEnv"):
            size = 4 ** (level + 1)
            lo = int(rng.integers(0, 100))
            hi = lo + size - 1
            hidden = int(rng.integers(lo, hi + 1))
            prompts.append(Prompt(
                id=new_prompt_id(rng), text=f"Guess {lo}-{hi}:{STOP}", answer=str(hidden), difficulty=level,
                metadata={"lo": lo, "hi": hi, "max_turns": size.bit_length() + spare_turns},
            ))
        return prompts

    @staticmethod
    def demonstration(prompt: Prompt) -> list[str]:
        """Binary search: guess the middle of the interval that is still possible."""
        lo, hi, hidden = prompt.metadata["lo"], prompt.metadata["hi"], int(prompt.answer)
        actions = []
        while True:
            guess = (lo + hi) // 2
            actions.append(f"G: {guess}{STOP}")
            if guess == hidden:
                return actions
            lo, hi = (guess + 1, hi) if hidden > guess else (lo, guess - 1)

    def _turn_budget(self, prompt: Prompt) -> int:
        return self._max_turns_config if self._max_turns_config is not None else prompt.metadata["max_turns"]

    def _act(self, action: str) -> StepResult:
        match = _GUESS.fullmatch(action.strip())
        if match is None:
            return StepResult(error_observation("format"), 0.0, False, {"error": "format"})
        guess, hidden = int(match.group(1)), int(self.prompt.answer)
        if guess == hidden:
            reward = max(0.0, 1.0 - self.turn_penalty * (self.turn - 1))
            return StepResult("", reward, True, {"guess": guess, "feedback": "correct"})
        feedback = "higher" if hidden > guess else "lower"
        return StepResult(f"{feedback}{STOP}", 0.0, False, {"guess": guess, "feedback": feedback})
