"""Chained arithmetic with a tool: several tool calls an episode, each feeding the next, reward at the end.

Prompt:   "Q: a=17*3; b=a+4; c=b*2; c=?\\n"  (n = 1-4 links named a, b, c, d; the last is asked for)
Actions (one line each; the stop string is "\\n"), the calculator's tools and answer
(`sao_jax/envs/calculator.py`) with one restriction, one operation per call:
  tool call  "<calc>EXPR</calc>"  EXPR: integers, + - * //, parentheses, spaces; at most 64 characters,
             at most one binary operation -> "<out>VALUE</out>\\n"; "<err>one op</err>\\n" for a longer
             expression, "<err>REASON</err>\\n" for one the calculator refuses. Variable names are not
             expressions ("<calc>a+4</calc>" -> "<err>not allowed</err>"): link k's call must hold the
             value the tool showed for link k-1, copied from the context.
  estimate   "<est>EXPR</est>"    -> "<out>ESTIMATE</out>\\n": VALUE rounded to one significant digit
             (the calculator's estimator, under the same one-operation rule)
  answer     "A: INTEGER"         -> done; reward 1 if INTEGER equals the last link's value, else 0
  other      -> "<err>format</err>\\n"
The episode also ends (reward 0) after the prompt's turn budget, n calls + 1 answer + `spare_turns`
(constructor `max_turns` overrides it).

Gold demonstration (n = 3 above): ["<calc>17*3</calc>\\n", "<calc>51+4</calc>\\n", "<calc>55*2</calc>\\n",
"A: 110\\n"]: the exact tool at every link, each call written with the previous output.

Every link's value lies in [10, 999] and is not round (its estimate differs from it). So one estimate
anywhere in the chain makes the final answer wrong: + and - carry the error on, * multiplies it.

One operation per call, so that a chain of n links takes n calls: without the rule one call could
hold the whole chain ("<calc>(17*3+4)*2</calc>") and the episode would be one decision again.

Weak demonstration: at each link the weaker demonstrator picks the estimator or the exact tool by an
independent fair coin, drawn when the prompt is generated (`metadata["weak_tools"]`), and copies
whatever the tool showed into the next call and into the answer. Per link rather than "the
estimator at every link": a policy fitted to an all-or-nothing demonstrator can read its own earlier
tags, so it would learn to repeat its first choice, which leaves RL one decision per episode, as on
the calculator. Independent coins leave n decisions, each wrong about half the time and each fatal,
so a warm start fitted to them solves a chain of n links at most about 2^-n of the time — success
falls with n in one prompt stream, and a critic that reads the state (an estimate already called)
can tell a doomed episode from a live one. The coin sometimes picks the exact tool at every link, so
the weak demonstration earns 1 on about 2^-n of the prompts. The chain suite trains SFT on the weak
demonstrator alone (`sft.weak_demonstration_fraction: 1.0`, `configs/ablations/chain/sao.yaml`): a
mix with the gold one at share 1 - f would put the all-exact path at 1 - f + f·2^-n, flattening the
fall with n.

Difficulty n = the number of links (1-4), mixed in one stream by `env.difficulty`. Link 1 is
"x OP y" with x, y in 1-99; link k > 1 is "PREV OP y", y in 1-99 for + and -, 2-9 for *; operators
uniform over + - *; a link is redrawn until its value is in [10, 999] and not round.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence

import numpy as np

from sao_jax.envs.base import STOP, Prompt, choose_levels, new_prompt_id
from sao_jax.envs.calculator import CalculatorEnv, ToolError, estimate, safe_eval

LEVELS = (1, 2, 3, 4)
NAMES = "abcd"
MIN_VALUE, MAX_VALUE = 10, 999
_OPERATORS = ("+", "-", "*")


def operation_count(expression: str) -> int:
    """Binary operations in `expression` (0 when it does not parse; `safe_eval` then says why)."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return 0
    return sum(isinstance(node, ast.BinOp) for node in ast.walk(tree))


def _link_ok(value: int) -> bool:
    return MIN_VALUE <= value <= MAX_VALUE and estimate(value) != value


def _random_link(rng: np.random.Generator, previous: int | None) -> tuple[str, int]:
    """(text, value) of one link: "x OP y" for the first (`previous` None), else "OP y" applied to
    `previous`; redrawn until the value is in [10, 999] and not round."""
    while True:
        op = _OPERATORS[int(rng.integers(0, len(_OPERATORS)))]
        y = int(rng.integers(2, 10)) if op == "*" and previous is not None else int(rng.integers(1, 100))
        x = int(rng.integers(1, 100)) if previous is None else previous
        value = safe_eval(f"{x}{op}{y}")
        if _link_ok(value):
            return (f"{x}{op}{y}" if previous is None else f"{op}{y}"), value


class ChainEnv(CalculatorEnv):
    """A chain of n dependent calculations, one tool call each (grammar in the module docstring).

    `StepResult.info` is the calculator's: `turn`, and as they apply `error`, `tool`, `tool_output`,
    `tools` (on the answer: every tag called, in order), `answer`, `correct`, `out_of_turns`.
    """

    def __init__(self, *, max_turns: int | None = None) -> None:
        """`max_turns` None: each prompt's own budget, its links + 2 (`metadata["max_turns"]`)."""
        super().__init__(max_turns=max_turns)

    @classmethod
    def generate_prompts(cls, rng: np.random.Generator, n: int, difficulty: int | Sequence[int] | None = None, *,
                         spare_turns: int = 1) -> list[Prompt]:
        """`n` chains; `difficulty` None = uniform mix of 1-4 links. Deterministic given `rng`."""
        if spare_turns < 0:
            raise ValueError(f"{cls.__name__}.generate_prompts: spare_turns must be >= 0 (got {spare_turns})")
        prompts = []
        for level in choose_levels(rng, n, difficulty, LEVELS, env=cls.__name__):
            links, values, previous = [], [], None
            for k in range(level):
                shown, previous = _random_link(rng, previous)
                links.append(f"{NAMES[k]}={shown}" if k == 0 else f"{NAMES[k]}={NAMES[k - 1]}{shown}")
                values.append(previous)
            weak_tools = tuple("est" if coin else "calc" for coin in rng.integers(0, 2, size=level))
            prompts.append(Prompt(
                id=new_prompt_id(rng), text=f"Q: {'; '.join(links)}; {NAMES[level - 1]}=?{STOP}",
                answer=str(values[-1]), difficulty=level,
                metadata={"links": tuple(links), "values": tuple(values), "weak_tools": weak_tools,
                          "max_turns": cls.turn_budget(level, spare_turns)},
            ))
        return prompts

    @staticmethod
    def turn_budget(links: int, spare_turns: int) -> int:
        """The turn budget of a chain of `links`: one call per link, one answer, the spare turns."""
        return links + 1 + spare_turns

    @staticmethod
    def _actions(prompt: Prompt, tools: Sequence[str]) -> list[str]:
        """The calls of a demonstrator that uses `tools[k]` at link k and copies each shown value on."""
        actions, shown = [], None
        for link, tag in zip(prompt.metadata["links"], tools):
            expression = link.split("=", 1)[1]
            if shown is not None:
                expression = str(shown) + expression[1:]  # the previous link's name -> its shown value
            actions.append(f"<{tag}>{expression}</{tag}>{STOP}")
            value = safe_eval(expression)
            shown = value if tag == "calc" else estimate(value)
        return [*actions, f"A: {shown}{STOP}"]

    @classmethod
    def demonstration(cls, prompt: Prompt) -> list[str]:
        return cls._actions(prompt, ["calc"] * prompt.difficulty)

    @classmethod
    def weak_demonstration(cls, prompt: Prompt) -> list[str]:
        """The coin-flipping demonstrator: `metadata["weak_tools"]` at each link (module docstring)."""
        return cls._actions(prompt, prompt.metadata["weak_tools"])

    def _turn_budget(self, prompt: Prompt) -> int:
        return self._max_turns_config if self._max_turns_config is not None else prompt.metadata["max_turns"]

    def _run_tool(self, expression: str) -> str:
        _one_operation(expression)
        return super()._run_tool(expression)

    @staticmethod
    def _run_estimator(expression: str) -> str:
        _one_operation(expression)
        return CalculatorEnv._run_estimator(expression)


def _one_operation(expression: str) -> None:
    if operation_count(expression) > 1:
        raise ToolError("one op")
