"""Tool-integrated reasoning (TIR): solve a math problem, running Python along the way; the reward is the
verified final answer (`math_reward.verify`).

Prompt:  INSTRUCTIONS, a blank line, "Problem: ...", "\\n". `Prompt.answer` is the gold answer in LaTeX.
Actions: one assistant message each, ending with one of `stop_strings` (default "@", a single character
  so the built-in character tokenizer can stop on it; chat-templated runs wrap the environment in
  `ChatEnv`, which stops on the template's end-of-turn token instead). Per message, in this order:
  code    one or more ```python (or ```py) fenced blocks, or <code>...</code> blocks: their code, joined
          in order, runs as one program with `run_python` (a fresh interpreter each turn: nothing persists
          between turns; the sandbox has the standard library only) and the observation is
              ```output\\n<stdout>\\n```\\n
          with stdout cut to `max_output_chars` and marked "[output truncated ...]"; a failing program adds
          the last line of its error ("ZeroDivisionError: division by zero"), a slow one
          "Timeout: ...". A message with code is never an answer, even if it also holds a \\boxed{}.
  answer  no code and a complete \\boxed{...}: the episode ends; reward 1 if `verify` finds the last box
          equivalent to the gold answer, else 0; info["verdict"] is the `Verdict.status`.
  other   (no code, no box, or an unclosed code block) -> "<err>format: ...</err>\\n", costing a turn.
The episode also ends after `max_turns` messages (reward 0, info["verdict"] = "no_answer").
Observations are plain text, printable ASCII and newlines (other characters are shown escaped, "\\u03c0").

Synthetic problems (`generate_prompts`), three families, uniform within a level, exact answers:
  level  fraction                         modular                            counting
  1      a/b + c/d                        (a*b + c) mod m                    C(n, k) committees
  2      a/b +- c/d +- e/f                a^k mod m                          arrangements of a word's letters
  3      sum of 1/(k(k+1)), k = m..n      (1^k + ... + n^k) mod m            1..N divisible by one of a, b, c
The gold demonstration is a message with a code block that computes the answer, then "\\boxed{answer}".
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from sao_jax.envs.base import STOP, EpisodicEnv, Prompt, StepResult, choose_levels, error_observation, new_prompt_id
from sao_jax.envs.math_reward import extract_final_answer, verify
from sao_jax.envs.python_tool import run_python

LEVELS = (1, 2, 3)
FAMILIES = ("fraction", "modular", "counting")
DEFAULT_STOP = "@"
INSTRUCTIONS = ("Solve the problem. You can run Python: write a ```python code block and you will see its output. "
                "Put the final answer in \\boxed{}.")
_CODE_BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```|<code>(.*?)</code>", re.DOTALL)
_CODE_OPENER = re.compile(r"```(?:python|py)\b|<code>")
_FORMAT_HINT = "format: run code in a ```python block, or give the final answer in \\boxed{}"
_UNCLOSED_HINT = _FORMAT_HINT + " (a ```python block starts on its own line and ends with ```)"


class TIREnv(EpisodicEnv):
    """Math problems solved with a Python tool and a boxed final answer (protocol in the module docstring).

    `StepResult.info` holds `turn` and, as they apply: `exit_code`, `timed_out`, `output_truncated` (a code
    turn); `verdict`, `answer`, `correct` (the end: `verdict` in `math_reward.STATUSES`); `error` (a format
    error); `out_of_turns`.
    """

    def __init__(self, *, max_turns: int = 6, stop_strings: Sequence[str] = (DEFAULT_STOP,),
                 code_timeout_s: float = 5.0, code_memory_mb: int = 512, max_output_chars: int = 512,
                 verify_timeout_s: float = 5.0) -> None:
        super().__init__(max_turns=max_turns)
        stop_strings = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings)
        if not stop_strings or not all(isinstance(s, str) and s for s in stop_strings):
            raise ValueError(f"TIREnv: stop_strings must be non-empty strings (got {stop_strings!r})")
        if max_output_chars < 1:
            raise ValueError(f"TIREnv: max_output_chars must be >= 1 (got {max_output_chars})")
        self.stop_strings = stop_strings
        self.code_timeout_s, self.code_memory_mb = code_timeout_s, code_memory_mb
        self.max_output_chars, self.verify_timeout_s = max_output_chars, verify_timeout_s

    @staticmethod
    def generate_prompts(rng: np.random.Generator, n: int, difficulty: int | Sequence[int] | None = None,
                         ) -> list[Prompt]:
        """`n` problems; `difficulty` None = uniform mix of levels 1-3. Deterministic given `rng`."""
        prompts = []
        for level in choose_levels(rng, n, difficulty, LEVELS, env="TIREnv"):
            family = FAMILIES[int(rng.integers(0, len(FAMILIES)))]
            question, answer, code, facts = _PROBLEMS[family](rng, level)
            prompts.append(Prompt(
                id=new_prompt_id(rng), text=f"{INSTRUCTIONS}\n\nProblem: {question}{STOP}", answer=_latex(answer),
                difficulty=level, metadata={"family": family, "solution_code": code, **facts},
            ))
        return prompts

    @classmethod
    def demonstration(cls, prompt: Prompt) -> list[str]:
        """A code message that computes the answer, then the boxed answer; each ends with DEFAULT_STOP."""
        return [f"Let me compute it.\n```python\n{prompt.metadata['solution_code']}\n```{DEFAULT_STOP}",
                f"The answer is \\boxed{{{prompt.answer}}}.{DEFAULT_STOP}"]

    def step(self, action_text: str) -> StepResult:
        result = super().step(action_text)
        if result.done:
            result.info.setdefault("verdict", "no_answer")  # out of turns: every ended episode has a verdict
        return result

    def _act(self, action: str) -> StepResult:
        for stop in self.stop_strings:
            if action.endswith(stop):
                action = action[: -len(stop)]
                break
        blocks = list(_CODE_BLOCK.finditer(action))
        if _CODE_OPENER.search(_CODE_BLOCK.sub("", action)):
            return StepResult(error_observation(_UNCLOSED_HINT), 0.0, False, {"error": "unclosed code block"})
        if blocks:  # group 1: a fenced block's code, group 2: a <code> tag's
            return self._run_code("\n".join(next(g for g in m.groups() if g is not None) for m in blocks))
        answer = extract_final_answer(action)
        if answer is None:
            return StepResult(error_observation(_FORMAT_HINT), 0.0, False, {"error": "format"})
        verdict = verify(action, self.prompt.answer, timeout_s=self.verify_timeout_s)
        return StepResult("", verdict.reward, True, {"verdict": verdict.status, "answer": answer,
                                                     "correct": verdict.correct})

    def _run_code(self, code: str) -> StepResult:
        # A cap well above what is shown, so the last line of a long traceback is still captured.
        result = run_python(code, timeout_s=self.code_timeout_s, memory_mb=self.code_memory_mb,
                            max_output_bytes=max(64 * 1024, 4 * self.max_output_chars))
        shown = result.stdout
        if len(shown) > self.max_output_chars or result.output_truncated:
            shown = (f"{shown[: self.max_output_chars]}\n"
                     f"[output truncated to the first {self.max_output_chars} characters]")
        if result.timed_out:
            problem = f"Timeout: the program was stopped after {self.code_timeout_s:g} s"
        elif result.output_truncated:
            problem = "Stopped: the program printed too much"
        elif result.exit_code != 0:
            problem = (result.stderr.strip().splitlines() or [f"Exit code {result.exit_code}"])[-1]
        else:
            problem = ""
        body = "\n".join(part.rstrip("\n") for part in (shown, problem) if part)
        observation = f"```output\n{_plain_text(body)}\n```{STOP}"
        return StepResult(observation, 0.0, False, {"exit_code": result.exit_code, "timed_out": result.timed_out,
                                                    "output_truncated": result.output_truncated})


def _plain_text(text: str) -> str:
    """Printable ASCII and newlines; any other character written as its Python escape ("\\t", "\\u03c0")."""
    return "".join(c if c == "\n" or " " <= c <= "~" else c.encode("unicode_escape").decode("ascii") for c in text)


def _latex(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


# ---- problem families: (rng, level) -> (question, exact answer, solution code, facts for metadata) ----------


def _int(rng: np.random.Generator, low: int, high: int) -> int:
    """Uniform integer in [low, high]."""
    return int(rng.integers(low, high + 1))


def _fraction_problem(rng, level):
    if level == 3:
        m = _int(rng, 1, 20)
        n = m + _int(rng, 5, 60)
        question = (f"What is the sum of 1/(k(k+1)) for k = {m}, {m + 1}, ..., {n}? "
                    "Give it as a fraction in lowest terms.")
        answer = Fraction(1, m) - Fraction(1, n + 1)  # telescoping: 1/(k(k+1)) = 1/k - 1/(k+1)
        code = f"from fractions import Fraction\nprint(sum(Fraction(1, k * (k + 1)) for k in range({m}, {n + 1})))"
        return question, answer, code, {"m": m, "n": n}
    count, largest = (2, 9) if level == 1 else (3, 12)
    terms = [(_int(rng, 1, largest), _int(rng, 2, largest)) for _ in range(count)]
    signs = ["+"] + ["+" if level == 1 or rng.random() < 0.5 else "-" for _ in range(count - 1)]
    expression = f"{terms[0][0]}/{terms[0][1]}" + "".join(f" {s} {a}/{b}" for s, (a, b) in zip(signs[1:], terms[1:]))
    answer = sum(Fraction(a, b) * (1 if s == "+" else -1) for s, (a, b) in zip(signs, terms))
    code = "from fractions import Fraction as F\nprint(" + re.sub(r"(\d+)/(\d+)", r"F(\1, \2)", expression) + ")"
    return (f"What is {expression}? Give it as a fraction in lowest terms.", answer, code,
            {"terms": terms, "signs": signs})


def _modular_problem(rng, level):
    if level == 1:
        a, b, c, m = _int(rng, 10, 99), _int(rng, 10, 99), _int(rng, 1, 99), _int(rng, 3, 19)
        return (f"What is the remainder when {a}*{b} + {c} is divided by {m}?", Fraction((a * b + c) % m),
                f"print(({a} * {b} + {c}) % {m})", {"a": a, "b": b, "c": c, "m": m})
    if level == 2:
        a, k, m = _int(rng, 2, 20), _int(rng, 10, 200), _int(rng, 3, 50)
        return (f"What is the remainder when {a}^{k} is divided by {m}?", Fraction(pow(a, k, m)),
                f"print(pow({a}, {k}, {m}))", {"a": a, "k": k, "m": m})
    n, k, m = _int(rng, 10, 200), _int(rng, 2, 20), _int(rng, 7, 97)
    return (f"What is the remainder when 1^{k} + 2^{k} + ... + {n}^{k} is divided by {m}?",
            Fraction(sum(pow(i, k, m) for i in range(1, n + 1)) % m),
            f"print(sum(i ** {k} for i in range(1, {n + 1})) % {m})", {"n": n, "k": k, "m": m})


def _counting_problem(rng, level):
    if level == 1:
        n = _int(rng, 5, 15)
        k = _int(rng, 2, n - 2)
        return (f"In how many ways can a committee of {k} be chosen from {n} people?", Fraction(math.comb(n, k)),
                f"import math\nprint(math.comb({n}, {k}))", {"n": n, "k": k})
    if level == 2:
        letters = [chr(ord("A") + int(i)) for i in rng.choice(26, size=_int(rng, 3, 4), replace=False)]
        word = "".join(letters[int(i)] for i in rng.integers(0, len(letters), size=_int(rng, 6, 9)))
        arrangements = math.factorial(len(word))
        for repeats in Counter(word).values():
            arrangements //= math.factorial(repeats)
        code = (f"import math\nfrom collections import Counter\nn = math.factorial(len({word!r}))\n"
                f"for r in Counter({word!r}).values():\n    n //= math.factorial(r)\nprint(n)")
        return (f"How many distinct arrangements are there of the letters of the string {word}?",
                Fraction(arrangements), code, {"word": word})
    big = _int(rng, 100, 10000)
    a, b, c = (int(x) for x in sorted(rng.choice(np.arange(2, 16), size=3, replace=False)))
    lcm = math.lcm
    count = (big // a + big // b + big // c - big // lcm(a, b) - big // lcm(a, c) - big // lcm(b, c)
             + big // lcm(a, b, c))  # inclusion-exclusion
    return (f"How many integers from 1 to {big} are divisible by at least one of {a}, {b}, {c}?", Fraction(count),
            f"print(sum(1 for x in range(1, {big + 1}) if x % {a} == 0 or x % {b} == 0 or x % {c} == 0))",
            {"N": big, "divisors": (a, b, c)})


_PROBLEMS = {"fraction": _fraction_problem, "modular": _modular_problem, "counting": _counting_problem}
