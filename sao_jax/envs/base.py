"""The protocol every environment follows, the prompt record its generator yields, and the shared
episode bookkeeping.

An episode (the agent loop drives it; one environment object per trajectory, cheap to build):

    env = ENVIRONMENTS[name](**config)
    text = env.reset(prompt)                  # the prompt text the policy conditions on
    while True:
        action = sample until one of env.stop_strings (the stop string is part of the action)
        result = env.step(action)             # StepResult(observation, reward, done, info)
        if result.done: break
        append result.observation to the context

Conventions shared by all environments here:
  * Texts are short printable ASCII with newlines (the built-in character tokenizer's alphabet).
  * Every action is one line: `stop_strings == ("\\n",)` (TIR's multi-line messages stop at "@"). `step`
    accepts the action with or without its trailing stop string (a sampler that hit its token limit
    returns it without).
  * Observations end with "\\n". When `done` is True the observation is "" — a trajectory ends with an
    action, and the outcome reward belongs to that last action.
  * A malformed action is the policy's mistake, not an error: it gets an `<err>...</err>` observation and
    costs a turn. Misuse by the caller (step before reset or after the end, a non-str action) raises.
  * Each environment class also provides `generate_prompts(rng, n, difficulty=None)` — synthetic,
    deterministic given `rng` — and `demonstration(prompt)`, the gold actions (stop strings included)
    that, fed through `step`, earn reward 1; the trainer's SFT warm start is built from them. A class
    may also provide `weak_demonstration(prompt)`, a worse demonstrator's actions, which the default
    config mixes into SFT (`sft.weak_demonstration_fraction`; set it to 0 for a class without one).
    The trainer asks for both of an environment built with the run's `env.options`, so a constructor
    option may shape them (repair's `demonstrate_repair`); asked of the class, they follow its defaults.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

STOP = "\n"


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One task instance.

    id          random 62-bit integer drawn from the generator's rng (unique with high probability)
    text        what the policy sees first (the return value of `reset`)
    answer      the gold answer as text ("" when the task has none, e.g. style-shift)
    difficulty  the level it was generated at (1 = easiest)
    metadata    task facts the environment needs (expression, range, topics, turn budget ...)
    """

    id: int
    text: str
    answer: str
    difficulty: int
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any]


@runtime_checkable
class Environment(Protocol):
    """What the agent loop needs from an environment instance."""

    stop_strings: tuple[str, ...]

    @property
    def max_turns(self) -> int:
        """The turn budget of the current episode (valid after `reset`)."""

    def reset(self, prompt: Prompt) -> str: ...

    def step(self, action_text: str) -> StepResult: ...


class EnvironmentClass(Protocol):
    """What config lookup needs from an entry of `ENVIRONMENTS`: a constructor plus the task's prompt
    generator and demonstrations. `weak_demonstration` is needed only by runs that mix weak
    demonstrations into SFT (`sft.weak_demonstration_fraction > 0`, the default); the calculator
    tasks have it, and SFT refuses such a run, naming the key, for a class without it."""

    def __call__(self, **config: Any) -> Environment: ...

    def generate_prompts(self, rng: np.random.Generator, n: int, difficulty: int | Sequence[int] | None = None,
                         ) -> list[Prompt]: ...

    def demonstration(self, prompt: Prompt) -> list[str]:
        """The gold actions for `prompt` (stop strings included); fed through `step` they earn reward 1."""

    def weak_demonstration(self, prompt: Prompt) -> list[str]:
        """A weaker demonstrator's actions for `prompt` (stop strings included), valid actions that
        usually earn less than the gold ones. SFT mixes them in at `sft.weak_demonstration_fraction`,
        so the warm-started policy sometimes makes the worse choice and RL has a decision to learn
        (the calculator's: call the estimator instead of the exact tool)."""


def choose_levels(rng: np.random.Generator, n: int, difficulty: int | Sequence[int] | None,
                  levels: Sequence[int], *, env: str) -> list[int]:
    """The difficulty level of each of `n` prompts: `None` = uniform over `levels`, an int = that level,
    a sequence = uniform over it."""
    if n < 0:
        raise ValueError(f"{env}.generate_prompts: n must be >= 0 (got {n})")
    allowed = tuple(levels) if difficulty is None else (
        (difficulty,) if isinstance(difficulty, (int, np.integer)) else tuple(difficulty))
    bad = [d for d in allowed if d not in levels]
    if bad or not allowed:
        raise ValueError(f"{env}.generate_prompts: difficulty must be one of {tuple(levels)} or a list of them "
                         f"(got {difficulty!r})")
    return [int(allowed[i]) for i in rng.integers(0, len(allowed), size=n)]


def new_prompt_id(rng: np.random.Generator) -> int:
    return int(rng.integers(0, 2**62))


class EpisodicEnv(abc.ABC):
    """Shared bookkeeping for the environments here: reset/step order, the turn count and budget, and
    stripping the stop string. Subclasses implement `_act`."""

    stop_strings: tuple[str, ...] = (STOP,)

    def __init__(self, *, max_turns: int | None) -> None:
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"{type(self).__name__}: max_turns must be >= 1 (got {max_turns})")
        self._max_turns_config = max_turns
        self._prompt: Prompt | None = None
        self._turn = 0
        self._done = False

    @property
    def prompt(self) -> Prompt:
        if self._prompt is None:
            raise RuntimeError(f"{type(self).__name__}: no episode yet, call reset(prompt) first")
        return self._prompt

    @property
    def max_turns(self) -> int:
        return self._turn_budget(self.prompt)

    @property
    def turn(self) -> int:
        """Actions taken so far in this episode."""
        return self._turn

    def reset(self, prompt: Prompt) -> str:
        if not isinstance(prompt, Prompt):
            raise TypeError(f"{type(self).__name__}.reset expects a Prompt, got {type(prompt).__name__}")
        self._prompt, self._turn, self._done = prompt, 0, False
        return self._observe_prompt(prompt)

    def step(self, action_text: str) -> StepResult:
        name = type(self).__name__
        if self._prompt is None:
            raise RuntimeError(f"{name}.step called before reset(prompt)")
        if self._done:
            raise RuntimeError(f"{name}.step called after the episode ended (done was returned)")
        if not isinstance(action_text, str):
            raise TypeError(f"{name}.step expects the action as str, got {type(action_text).__name__}")
        self._turn += 1
        action = action_text[: -len(STOP)] if action_text.endswith(STOP) else action_text
        result = self._act(action)
        info = {"turn": self._turn, **result.info}
        done = result.done
        if not done and self._turn >= self.max_turns:
            done = info["out_of_turns"] = True
        self._done = done
        return StepResult("" if done else result.observation, result.reward, done, info)

    def _turn_budget(self, prompt: Prompt) -> int:
        if self._max_turns_config is None:
            raise ValueError(f"{type(self).__name__}: max_turns is not set")
        return self._max_turns_config

    def _observe_prompt(self, prompt: Prompt) -> str:
        """The first observation: the prompt text."""
        return prompt.text

    @abc.abstractmethod
    def _act(self, action: str) -> StepResult:
        """Respond to one action (stop string already removed); the base class handles the budget."""


def error_observation(message: str) -> str:
    return f"<err>{message}</err>{STOP}"
