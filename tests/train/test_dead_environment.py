"""A dead environment stops the run loudly: an environment whose every step raises ends `sao-train`
with exit 3 and one line naming its most frequent error and the count, in sync mode, in async mode
(which waited forever before, printing a traceback per rollout) and in value pretraining (an
`IndexError` before); nothing is printed per rollout and no summary.json claims an evaluation."""

import subprocess
import sys

import pytest

from tests.train.test_faults import messages
from tests.train.test_resume import TINY_RUN, environment

pytestmark = pytest.mark.slow

# `sao-train` with an environment `dead` whose every step raises (its resets and demonstrations work).
DEAD_TRAINER = """
import sys
from sao_jax.envs import ENVIRONMENTS
from sao_jax.envs.calculator import CalculatorEnv

class DeadEnv(CalculatorEnv):
    def step(self, action_text):
        raise RuntimeError("sandbox gone")

ENVIRONMENTS["dead"] = DeadEnv
from sao_jax.cli import main
raise SystemExit(main(sys.argv[1:]))
"""
DEAD_RUN = [*TINY_RUN, "env.name=dead", "sft.steps=0", "train.steps=6", "train.checkpoint_every=6"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return environment(tmp_path_factory.mktemp("jax_cache"))


def train(out, env, *extra, timeout=600):
    return subprocess.run([sys.executable, "-c", DEAD_TRAINER, f"output_dir={out}", *DEAD_RUN, *extra], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_environment_failing_every_rl_rollout_stops_the_run_in_one_line(tmp_path, env, mode):
    done = train(tmp_path / "run", env, "critic.pretrain_rollouts=0", f"train.mode={mode}", timeout=400)
    assert done.returncode == 3, done.stderr[-3000:]
    said = messages(done.stderr)
    assert len(said) == 1 and "Traceback" not in done.stderr, said
    assert said[0].startswith("error: ") and "train.max_steps_without_data=3" in said[0]
    assert "most often 'env.step raised RuntimeError: sandbox gone' (" in said[0]
    assert len(done.stderr) < 20_000
    out = tmp_path / "run"
    assert not (out / "summary.json").exists()  # the run did not finish: no end result is claimed
    assert (out / "checkpoints" / "0").is_dir() and (out / "plots").is_dir()  # what was done is kept


def test_too_few_usable_value_pretraining_rollouts_stop_the_run_in_one_line(tmp_path, env):
    done = train(tmp_path / "run", env, "critic.pretrain_rollouts=8")
    assert done.returncode == 3, done.stderr[-3000:]
    assert messages(done.stderr) == [
        "error: value pretraining got 0 usable rollouts of 8, fewer than its floor of 4 "
        "(critic.pretrain_min_usable_fraction=0.5 of critic.pretrain_rollouts=8, and one train.batch_size at least): "
        "the environment failed 8, most often 'env.step raised RuntimeError: sandbox gone' (8 times)"]


def test_debug_shows_the_first_failed_rollout_in_full_and_once(tmp_path, env):
    done = train(tmp_path / "run", env, "critic.pretrain_rollouts=8", "--debug")
    assert done.returncode != 0
    assert done.stderr.count("the first failed rollout") == 1
    assert ", in step\n" in done.stderr and "\nRuntimeError: sandbox gone\n" in done.stderr  # the environment's frame
