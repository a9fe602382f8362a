"""`env.name=scaffold`: episodes run by an agent scaffold through the chat server, not stepped here.

A scaffold owns its episode loop (`sao_jax.rollout.scaffold.ScaffoldLoop` runs it against the policy's
chat server), so this class only supplies what the run needs from an environment class: the prompts.
Without `env.train_file` / `env.eval_file` they are the toy repository tasks of `toy_repo` (fix
`calc.py` so that `test_calc.py` passes), which the example scaffold solves; a user's scaffold reads
whatever its prompt records carry (`Prompt.text`, `answer`, `metadata`). There are no demonstrations:
a scaffold run starts from the model as loaded (`sft.steps: 0`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sao_jax.envs import toy_repo
from sao_jax.envs.base import Prompt, StepResult


class ScaffoldEnv:
    """The environment class of `env.name=scaffold` (module docstring). Its instances are never
    stepped: the scaffold drives the episode; `reset` and `step` say so."""

    stop_strings: tuple[str, ...] = ()
    max_turns = 1

    def __init__(self, **options) -> None:
        if options:
            raise ValueError(f"env.name=scaffold takes no env.options (got {sorted(options)}); its settings are "
                             "the scaffold section")  # fmt: skip

    def reset(self, prompt: Prompt) -> str:
        raise RuntimeError("env.name=scaffold episodes are run by the scaffold (rollout.scaffold.ScaffoldLoop), "
                           "not stepped by the agent loop")  # fmt: skip

    def step(self, action_text: str) -> StepResult:
        return self.reset(None)

    @staticmethod
    def generate_prompts(rng: np.random.Generator, n: int, difficulty: int | Sequence[int] | None = None,
                         ) -> list[Prompt]:  # fmt: skip
        """The toy repository tasks (one level: `difficulty` is not used)."""
        return toy_repo.generate_prompts(rng, n)

    @staticmethod
    def demonstration(prompt: Prompt) -> list[str]:
        raise ValueError("env.name=scaffold has no demonstrations: set sft.steps=0")
