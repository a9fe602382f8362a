"""The toy repository task of the scaffold example: its tests, run in the sandbox, fail on each task's
repository and pass once the one wrong line is fixed; the reward ignores edits to the test file."""

import numpy as np
import pytest

from sao_jax.envs import ENVIRONMENTS, toy_repo


@pytest.mark.parametrize("bug", range(len(toy_repo.BUGS)))
def test_each_task_fails_as_given_and_passes_with_its_fix(bug):
    given, fixed = toy_repo.repository(bug), toy_repo.repository(bug, fixed=True)
    passed, output = toy_repo.run_tests(given)
    assert not passed and "FAIL test_" in output
    assert toy_repo.reward(given, given) == 0.0
    assert toy_repo.reward(fixed, given) == 1.0


def test_an_edited_test_file_does_not_earn_the_reward():
    given = toy_repo.repository(0)
    cheat = {**given, "test_calc.py": "def test_nothing():\n    pass\n"}
    assert toy_repo.run_tests(cheat)[0]
    assert toy_repo.reward(cheat, given) == 0.0


def test_a_broken_repository_fails_instead_of_raising():
    given = toy_repo.repository(1)
    assert toy_repo.reward({**given, "calc.py": "def mul(a, b):\n  return (\n"}, given) == 0.0


def test_the_scaffold_environment_draws_toy_tasks_and_cannot_be_stepped():
    scaffold = ENVIRONMENTS["scaffold"]
    [prompt] = scaffold.generate_prompts(np.random.default_rng(0), 1)
    assert prompt.metadata["files"] == toy_repo.repository(prompt.metadata["bug"])
    with pytest.raises(RuntimeError, match="run by the scaffold"):
        scaffold().reset(prompt)
    with pytest.raises(ValueError, match="sft.steps=0"):
        scaffold.demonstration(prompt)
