"""A toy repository task for agent scaffolds, and a smolagents scaffold that works on it.

Each task is a two-file repository: `calc.py` with one wrong line and `test_calc.py` whose tests fail
because of it. The agent reads and writes files and runs the tests; the reward is 1 when every test
passes afterwards, else 0. The tests run in the sandbox (`python_tool.run_python`): a program that
writes the repository into the sandbox's scratch directory, imports the test module and calls each
`test_*` function, printing `PASS name` or `FAIL name`.

`smolagents_episode(prompt, base_url, episode_id) -> reward` is the scaffold example
(`configs/scaffold/smolagents_toy_repo.yaml`): a smolagents `ToolCallingAgent` with three tools
(`read_file`, `write_file`, `run_tests`) over an in-memory copy of the repository, calling the policy
through the chat server with the episode id as its API key. smolagents is an optional dependency
(`pip install -e '.[scaffold]'`), imported when the function runs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np

from sao_jax.envs.base import Prompt, new_prompt_id
from sao_jax.envs.python_tool import run_python

# (function, wrong body line, right body line, test assertions)
BUGS = (
    ("add(a, b)", "return a - b", "return a + b", ["add(2, 3) == 5", "add(-1, 1) == 0"]),
    ("mul(a, b)", "return a + b", "return a * b", ["mul(3, 4) == 12", "mul(0, 7) == 0"]),
    ("is_even(n)", "return n % 2 == 1", "return n % 2 == 0", ["is_even(4)", "not is_even(3)"]),
    ("largest(xs)", "return min(xs)", "return max(xs)", ["largest([3, 9, 2]) == 9"]),
    ("absolute(x)", "return x", "return -x if x < 0 else x", ["absolute(-5) == 5", "absolute(2) == 2"]),
    ("square(x)", "return x * 2", "return x * x", ["square(3) == 9", "square(-2) == 4"]),
)
TASK_TEXT = ("The tests of `{name}` in test_calc.py fail. Fix the bug in calc.py so that every test passes. Use "
             "the tools to read files, write files and run the tests; do not change test_calc.py.")  # fmt: skip
MAX_STEPS = 4  # the example agent's steps (model calls) per episode


def repository(bug: int, *, fixed: bool = False) -> dict[str, str]:
    """The files of task `bug` (an index into the bug table); `fixed`: with the right line."""
    signature, wrong, right, checks = BUGS[bug]
    name = signature.split("(")[0]
    calc = f"def {signature}:\n    {right if fixed else wrong}\n"
    tests = f"from calc import {name}\n\n\n" + "".join(
        f"def test_{name}_{i}():\n    assert {check}\n\n\n" for i, check in enumerate(checks))
    return {"calc.py": calc, "test_calc.py": tests}


def generate_prompts(rng: np.random.Generator, n: int) -> list[Prompt]:
    """`n` tasks drawn uniformly from the bug table; the repository is in `metadata["files"]`."""
    bugs = rng.integers(0, len(BUGS), size=n)
    return [Prompt(id=new_prompt_id(rng), text=TASK_TEXT.format(name=BUGS[b][0].split("(")[0]), answer="",
                   difficulty=1, metadata={"bug": int(b), "files": repository(int(b))}) for b in bugs]  # fmt: skip


_RUNNER = """
import importlib, json, os, sys, traceback
files = json.loads({files!r})
for path, text in files.items():
    with open(os.path.basename(path), "w") as f:
        f.write(text)
sys.path.insert(0, os.getcwd())
try:
    module = importlib.import_module("test_calc")
except BaseException:
    print("FAIL import")
    traceback.print_exc(limit=1, file=sys.stdout)
    sys.exit(1)
failed = 0
for name in sorted(n for n in dir(module) if n.startswith("test_")):
    try:
        getattr(module, name)()
        print("PASS", name)
    except BaseException as e:
        failed += 1
        print("FAIL", name, type(e).__name__, e)
sys.exit(1 if failed else 0)
"""


def run_tests(files: Mapping[str, str], *, timeout_s: float = 5.0) -> tuple[bool, str]:
    """(every test passed, the runner's output) of the repository `files`, run in the sandbox."""
    result = run_python(_RUNNER.format(files=json.dumps(dict(files))), timeout_s=timeout_s)
    output = (result.stdout + result.stderr).strip()
    if result.timed_out:
        output += "\n(timed out)"
    return result.ok and "PASS" in result.stdout, output


def reward(files: Mapping[str, str], original: Mapping[str, str]) -> float:
    """1.0 if the tests pass with the original test file (an edited one does not count), else 0.0."""
    passed, _ = run_tests({**files, "test_calc.py": original["test_calc.py"]})
    return 1.0 if passed else 0.0


SYSTEM_PROMPT = ("You fix bugs in a small Python repository ({files}). Call exactly one tool per step. "
                 "When the tests pass, call final_answer.")  # fmt: skip


def smolagents_agent(prompt: Prompt, base_url: str, episode_id: str, *, max_steps: int = MAX_STEPS,
                     max_tokens: int = 64, files: dict[str, str] | None = None):  # fmt: skip
    """A smolagents ToolCallingAgent for `prompt`'s repository (edited in place in `files`, a copy of
    the prompt's by default), calling the chat server at `base_url` as episode `episode_id`."""
    import smolagents  # noqa: PLC0415 — an optional dependency, needed only by this example

    files = dict(prompt.metadata["files"]) if files is None else files
    tools = _tools(smolagents.tool, files)
    model = smolagents.OpenAIModel(model_id="policy", api_base=base_url, api_key=episode_id, max_tokens=max_tokens,
                                   client_kwargs={"max_retries": 0, "timeout": 600})  # fmt: skip
    agent = smolagents.ToolCallingAgent(tools=tools, model=model, max_steps=max_steps,
                                        verbosity_level=smolagents.LogLevel.OFF)  # fmt: skip
    agent.prompt_templates["system_prompt"] = SYSTEM_PROMPT.format(files=", ".join(sorted(files)))
    # At max_steps smolagents asks the model once more, under another system prompt, for a summary
    # answer; the reward here is the tests, not that answer, so that extra call is skipped.
    agent.provide_final_answer = lambda task: smolagents.ChatMessage(role=smolagents.MessageRole.ASSISTANT,
                                                                     content="")  # fmt: skip
    return agent, files


def _tools(tool, files: dict[str, str]) -> list:
    """The agent's tools over the repository `files` (edited in place); `tool`: smolagents' decorator
    (spelled `@tool`, the one name smolagents' source check accepts)."""

    @tool
    def read_file(path: str) -> str:
        """Read a file of the repository.

        Args:
            path: the file's name, e.g. calc.py
        """
        return files.get(path, f"no such file: {path}; the files are {sorted(files)}")

    @tool
    def write_file(path: str, content: str) -> str:
        """Replace a file of the repository.

        Args:
            path: the file's name, e.g. calc.py
            content: the file's new text
        """
        files[path] = content
        return f"wrote {len(content)} characters to {path}"

    @tool
    def run_tests() -> str:
        """Run the repository's tests and return their output."""
        return run_tests_output(files)

    return [read_file, write_file, run_tests]


def run_tests_output(files: Mapping[str, str]) -> str:
    passed, output = run_tests(files)
    return ("all tests passed\n" if passed else "tests failed\n") + output


def smolagents_episode(prompt: Prompt, base_url: str, episode_id: str) -> float:
    """The scaffold example's episode: the agent works until it answers or spends `MAX_STEPS` model
    calls (an agent error, e.g. a refused request, ends it too); the reward is whether the tests pass."""
    import smolagents  # noqa: PLC0415

    agent, files = smolagents_agent(prompt, base_url, episode_id)
    try:
        agent.run(prompt.text)
    except smolagents.utils.AgentError:
        pass
    return reward(files, prompt.metadata["files"])

