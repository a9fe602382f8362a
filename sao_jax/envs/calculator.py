"""Arithmetic with a tool: the main job's default task (and the same task with a sandboxed Python tool).

Prompt:   "Q: 17*3+4=?\\n"  (or in words, "Q: 17 times 3 plus 4=?\\n", with `word_form_prob`)
Actions (one line each; the stop string is "\\n"):
  tool call  "<calc>EXPR</calc>"  EXPR: integers, + - * //, parentheses, spaces; at most 64 characters
             -> observation "<out>VALUE</out>\\n", or "<err>REASON</err>\\n" when EXPR is not allowed
  estimate   "<est>EXPR</est>"    -> "<out>ESTIMATE</out>\\n": VALUE rounded to one significant digit
             (half away from zero: 55 -> 60, -1234 -> -1000; |VALUE| < 10 is exact), so answering it
             is right only when VALUE happens to be round
  answer     "A: INTEGER"         -> done; reward 1 if INTEGER equals the answer, else 0
  other      -> "<err>format</err>\\n"
The episode also ends (reward 0) after `max_turns` actions. The gold demonstration is
["<calc>EXPR</calc>\\n", "A: VALUE\\n"]: one tool call, one observation span, one answer. The weak
demonstration is the same with the estimator: ["<est>EXPR</est>\\n", "A: ESTIMATE\\n"].

Difficulty (a state-dependent baseline should matter: success falls with length):
  1: one operation on 1-2 digit numbers (+ - *)
  2: two operations on 1-2 digit numbers (+ - * //)
  3: three operations on 1-3 digit numbers (+ - * //), one parenthesised pair half of the time
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Sequence

import numpy as np

from sao_jax.envs.base import STOP, EpisodicEnv, Prompt, StepResult, choose_levels, error_observation, new_prompt_id
from sao_jax.envs.python_tool import run_python

LEVELS = (1, 2, 3)
MAX_EXPRESSION_CHARS = 64
MAX_ABS_VALUE = 10**12

_OPERATIONS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}
_WORDS = {"+": "plus", "-": "minus", "*": "times", "//": "over"}
_LEVEL_SHAPES = {  # level -> (number of operations, largest operand, operators)
    1: (1, 99, ("+", "-", "*")),
    2: (2, 99, ("+", "-", "*", "//")),
    3: (3, 999, ("+", "-", "*", "//")),
}
_ANSWER = re.compile(r"A: ?(-?\d{1,15})")


class ToolError(ValueError):
    """A tool call that cannot be served; the message is the short text shown to the policy."""


def safe_eval(expression: str) -> int:
    """Value of an integer expression built only from literals, + - * //, unary minus and parentheses.

    Parsed with `ast` and walked explicitly — nothing is ever `eval`ed, so names, calls, attributes,
    `**`, floats and strings are refused. Every intermediate value must satisfy |v| <= 10^12 and the
    text is at most 64 characters, which bounds the work. Raises `ToolError` with a short reason.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError("too long")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise ToolError("syntax") from None
    return _evaluate(tree.body)


def estimate(value: int) -> int:
    """`value` rounded to one significant digit, halves away from zero (55 -> 60, -1250 -> -1000)."""
    magnitude = abs(value)
    if magnitude < 10:
        return value
    scale = 10 ** (len(str(magnitude)) - 1)
    leading, rest = divmod(magnitude, scale)
    rounded = (leading + (2 * rest >= scale)) * scale
    return rounded if value >= 0 else -rounded


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = -_evaluate(node.operand) if isinstance(node.op, ast.USub) else _evaluate(node.operand)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATIONS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.FloorDiv) and right == 0:
            raise ToolError("div by 0")
        value = _OPERATIONS[type(node.op)](left, right)
    else:
        raise ToolError("not allowed")
    if abs(value) > MAX_ABS_VALUE:
        raise ToolError("too big")
    return value


def _random_expression(rng: np.random.Generator, level: int) -> str:
    num_ops, largest, operators = _LEVEL_SHAPES[level]
    while True:  # resample the rare expression the calculator refuses (division by zero)
        numbers = [str(int(rng.integers(1, largest + 1))) for _ in range(num_ops + 1)]
        ops = [operators[int(i)] for i in rng.integers(0, len(operators), size=num_ops)]
        if level == 3 and rng.random() < 0.5:
            i = int(rng.integers(0, num_ops))  # parenthesise operands i and i+1
            numbers[i], numbers[i + 1] = "(" + numbers[i], numbers[i + 1] + ")"
        expression = numbers[0] + "".join(op + n for op, n in zip(ops, numbers[1:]))
        try:
            safe_eval(expression)
            return expression
        except ToolError:
            continue


def _in_words(expression: str) -> str:
    return re.sub(r"//|[+*-]", lambda m: f" {_WORDS[m.group()]} ", expression)


class CalculatorEnv(EpisodicEnv):
    """Arithmetic word problems solved with a calculator tool (grammar in the module docstring).

    `StepResult.info` holds `turn`, and as they apply `error` (why an <err> was shown), `tool` (the tag
    called: the exact tool's or "est"), `tool_output`, `tools` (on the answer: every tag called, in order),
    `answer` (the integer answered, as text), `correct`, `out_of_turns`.
    """

    tool_tag = "calc"

    def __init__(self, *, max_turns: int = 4) -> None:
        super().__init__(max_turns=max_turns)
        self._tools_called: list[str] = []

    def _observe_prompt(self, prompt: Prompt) -> str:
        self._tools_called = []
        return prompt.text

    @classmethod
    def tool_names(cls) -> tuple[str, ...]:
        """The tags a policy can call: the exact tool's and the estimator's."""
        return cls.tool_tag, "est"

    @staticmethod
    def generate_prompts(rng: np.random.Generator, n: int, difficulty: int | Sequence[int] | None = None, *,
                         word_form_prob: float = 0.0) -> list[Prompt]:
        """`n` problems; `difficulty` None = uniform mix of levels 1-3. Deterministic given `rng`."""
        prompts = []
        for level in choose_levels(rng, n, difficulty, LEVELS, env="CalculatorEnv"):
            expression = _random_expression(rng, level)
            shown = _in_words(expression) if rng.random() < word_form_prob else expression
            prompts.append(Prompt(
                id=new_prompt_id(rng), text=f"Q: {shown}=?{STOP}", answer=str(safe_eval(expression)),
                difficulty=level, metadata={"expression": expression},
            ))
        return prompts

    @classmethod
    def demonstration(cls, prompt: Prompt) -> list[str]:
        return [f"<{cls.tool_tag}>{prompt.metadata['expression']}</{cls.tool_tag}>{STOP}", f"A: {prompt.answer}{STOP}"]

    @staticmethod
    def weak_demonstration(prompt: Prompt) -> list[str]:
        """A weaker demonstrator's actions: the estimator, then its (usually wrong) estimate. Mixed into
        SFT they leave RL one decision to learn — which tool to call — while every demonstration still
        teaches the same copying (expression into the call, tool output into the answer)."""
        expression = prompt.metadata["expression"]
        return [f"<est>{expression}</est>{STOP}", f"A: {estimate(safe_eval(expression))}{STOP}"]

    def _act(self, action: str) -> StepResult:
        for tag, tool in zip(self.tool_names(), (self._run_tool, self._run_estimator)):
            open_tag, close_tag = f"<{tag}>", f"</{tag}>"
            if not (action.startswith(open_tag) and action.endswith(close_tag)):
                continue
            self._tools_called.append(tag)
            try:
                output = tool(action[len(open_tag): -len(close_tag)])
            except ToolError as e:
                return StepResult(error_observation(str(e)), 0.0, False, {"error": str(e), "tool": tag})
            return StepResult(f"<out>{output}</out>{STOP}", 0.0, False, {"tool_output": output, "tool": tag})
        answer = _ANSWER.fullmatch(action.strip())
        if answer is None:
            return StepResult(error_observation("format"), 0.0, False, {"error": "format"})
        correct = int(answer.group(1)) == int(self.prompt.answer)
        info = {"answer": answer.group(1), "correct": correct, "tools": tuple(self._tools_called)}
        return StepResult("", float(correct), True, info)

    def _run_tool(self, expression: str) -> str:
        return str(safe_eval(expression))

    @staticmethod
    def _run_estimator(expression: str) -> str:
        return str(estimate(safe_eval(expression)))


class PythonToolEnv(CalculatorEnv):
    """The calculator task with the sandboxed Python tool instead: "<py>print(17*3+4)</py>" runs the
    code with `run_python` and shows its stdout as "<out>...</out>" (printable ASCII, at most
    `max_output_chars`); a failing program shows "<err>ExceptionName</err>", a slow one "<err>timeout</err>".
    Each tool call starts a sandbox (~50 ms). Math problems solved with this tool are env `tir`
    (`sao_jax/envs/tir.py`)."""

    tool_tag = "py"

    def __init__(self, *, max_turns: int = 4, timeout_s: float = 5.0, memory_mb: int = 256,
                 max_output_chars: int = 32) -> None:
        super().__init__(max_turns=max_turns)
        self.timeout_s, self.memory_mb, self.max_output_chars = timeout_s, memory_mb, max_output_chars

    @classmethod
    def demonstration(cls, prompt: Prompt) -> list[str]:
        return [f"<py>print({prompt.metadata['expression']})</py>{STOP}", f"A: {prompt.answer}{STOP}"]

    def _run_tool(self, code: str) -> str:
        result = run_python(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                            max_output_bytes=4 * self.max_output_chars)
        if result.timed_out:
            raise ToolError("timeout")
        if result.exit_code != 0:
            last_line = (result.stderr.strip().splitlines() or [f"exit {result.exit_code}"])[-1]
            raise ToolError(_printable(last_line.split(":")[0])[: self.max_output_chars])
        return _printable(result.stdout.strip())[: self.max_output_chars]


def _printable(text: str) -> str:
    """Text restricted to the character tokenizer's alphabet (printable ASCII; newlines become spaces)."""
    return "".join(c if " " <= c <= "~" else (" " if c == "\n" else "?") for c in text)

