"""Built-in environments behind one protocol (`sao_jax.envs.base`), looked up by config name.

`ENVIRONMENTS[name]` is the environment class: call it with the config's keyword arguments for one
environment per trajectory; its `generate_prompts(rng, n, difficulty=None)` and `demonstration(prompt)`
give synthetic prompts and gold actions. The sandbox (`python_tool.run_python`) and the style judges
(`judges.JUDGES`) live beside them.
"""

from __future__ import annotations

import difflib
from typing import Any

from sao_jax.envs.base import Environment, EnvironmentClass, Prompt, StepResult
from sao_jax.envs.calculator import CalculatorEnv, PythonToolEnv
from sao_jax.envs.chain import ChainEnv
from sao_jax.envs.guessing import GuessingEnv
from sao_jax.envs.repair import RepairEnv
from sao_jax.envs.scaffold import ScaffoldEnv
from sao_jax.envs.style_shift import StyleSchedule, StyleShiftEnv
from sao_jax.envs.tir import TIREnv
from sao_jax.envs.topic_style_shift import TopicStyleShiftEnv

ENVIRONMENTS: dict[str, EnvironmentClass] = {
    "calculator": CalculatorEnv,
    "chain": ChainEnv,
    "guessing": GuessingEnv,
    "python_tool": PythonToolEnv,
    "repair": RepairEnv,
    "scaffold": ScaffoldEnv,
    "style_shift": StyleShiftEnv,
    "tir": TIREnv,
    "topic_style_shift": TopicStyleShiftEnv,
}


def environment_class(name: str) -> EnvironmentClass:
    """`ENVIRONMENTS[name]`, or a ValueError naming the known environments and the closest one."""
    if name not in ENVIRONMENTS:
        close = difflib.get_close_matches(name, ENVIRONMENTS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown environment {name!r}: known are {sorted(ENVIRONMENTS)}{hint}")
    return ENVIRONMENTS[name]


def make_env(name: str, **config: Any) -> Environment:
    return environment_class(name)(**config)


__all__ = ["ENVIRONMENTS", "Environment", "EnvironmentClass", "Prompt", "StepResult", "StyleSchedule",
           "environment_class", "make_env"]
