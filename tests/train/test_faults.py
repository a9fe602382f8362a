"""Nothing lost, nothing silent: `sao-train --resume` after kill -9, after corrupted checkpoints and
under a changed config, on one tiny run finished once (module fixture) and copied per case."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.test_metrics import tensorboard_curves
from tests.train.test_multiprocess import PATIENT_STOP
from tests.train.test_resume import TINY_RUN, algorithm_metrics, count_lines, environment

FAULT_RUN = [*TINY_RUN, "sft.steps=5", "critic.pretrain_rollouts=8", "train.steps=6", "train.eval_every=3",
             "train.checkpoint_every=3"]  # fmt: skip
pytestmark = pytest.mark.slow


def command(output_dir, *extra, program="main"):
    # SIGINT as a shell leaves it to the program (Python's handler), even where pytest's runner ignores it.
    entry = (f"import signal; signal.signal(signal.SIGINT, signal.default_int_handler); from sao_jax.cli import "
             f"{program}; raise SystemExit({program}())")
    return [sys.executable, "-c", entry, f"output_dir={output_dir}", *FAULT_RUN, *extra]


def run(output_dir, env, *extra, program="main"):
    return subprocess.run(command(output_dir, *extra, program=program), env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def messages(stderr):
    """The stderr lines that are not progress bars."""
    return [line for line in stderr.replace("\r", "\n").splitlines() if line.strip() and "it/s" not in line
            and "s/it" not in line and not line.startswith(("sft:", "rl:", "value pretraining:"))]  # fmt: skip


def kill_when(output_dir, env, ready, *extra):
    """Start `--resume`, SIGKILL it as soon as `ready(stderr_path)` holds (or it ends by itself)."""
    log = output_dir.parent / f"{output_dir.name}.{time.monotonic_ns()}.stderr"
    with log.open("w") as stderr:
        process = subprocess.Popen(command(output_dir, *PATIENT_STOP, "--resume", *extra), env=env,
                                   stdout=subprocess.DEVNULL, stderr=stderr)  # fmt: skip
        deadline = time.monotonic() + 300
        while not ready(log) and process.poll() is None:
            assert time.monotonic() < deadline, "run did not progress"
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        process.wait()


def snapshot(folder):
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """(folder, env, stderr) of a run started with `--resume` on an empty folder, killed during SFT
    (before any checkpoint), and restarted with the same command to the end."""
    base = tmp_path_factory.mktemp("faults")
    env = environment(base / "jax_cache")
    out = base / "run"
    kill_when(out, env, lambda _: count_lines(out / "metrics.jsonl") >= 1)
    assert not (out / "checkpoints" / "0").exists()
    first_attempt = (out / "metrics.jsonl").read_text()
    done = run(out, env, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "metrics.previous.jsonl").read_text() == first_attempt  # kept aside, not unlinked
    assert (out / "tensorboard.previous").is_dir()
    return out, env, done.stderr


def copy_of(finished, tmp_path, rewind_to=None):
    """A copy of the finished run; `rewind_to`: as a kill right after that step's checkpoint left it."""
    out = tmp_path / "run"
    shutil.copytree(finished[0], out)
    if rewind_to is not None:
        for step_dir in (out / "checkpoints").iterdir():
            if int(step_dir.name) > rewind_to:
                shutil.rmtree(step_dir)
        lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
        (out / "metrics.jsonl").write_text("".join(line for line in lines if json.loads(line)["step"] <= rewind_to))
    return out


def test_the_first_start_and_a_restart_before_any_checkpoint_are_the_same_command(finished):
    out, _, stderr = finished
    assert f"no checkpoint in {out / 'checkpoints'}, starting from the beginning" in stderr
    evaluated = [line["step"] for line in algorithm_metrics(out / "metrics.jsonl") if "eval/success_rate" in line]
    assert evaluated == [0, 3, 6]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["0", "3", "6"]


def metric_curves(path):
    curves = {}
    for line in (json.loads(text) for text in path.read_text().splitlines()):
        for key, value in line.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                curves.setdefault(key, []).append((line["step"], pytest.approx(value, rel=1e-6, abs=1e-30)))
    return curves


def test_killed_three_times_then_resumed_writes_the_uninterrupted_runs_metrics_and_curves(finished, tmp_path):
    out = copy_of(finished, tmp_path, rewind_to=3)
    env = finished[1]
    at_checkpoint = count_lines(out / "metrics.jsonl")
    kill_when(out, env, lambda log: "resumed from step 3" in log.read_text())  # while starting up
    kill_when(out, env, lambda _: count_lines(out / "metrics.jsonl") > at_checkpoint)  # between two checkpoints
    # Right after the last save: the resumed run has nothing left to write, so the curves of steps 4-6
    # are the killed process's events, on disk only if they were flushed with the checkpoint.
    kill_when(out, env, lambda _: (out / "checkpoints" / "6").is_dir())
    done = run(out, env, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert algorithm_metrics(out / "metrics.jsonl") == algorithm_metrics(finished[0] / "metrics.jsonl")
    assert tensorboard_curves(out / "tensorboard") == metric_curves(out / "metrics.jsonl")
    history = {p.name for p in out.glob("config*.yaml")}
    assert {"config.yaml", "config.resume-3.yaml"} <= history  # the copy's output_dir differs: on record


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def largest_data_file(step_dir):
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
               key=lambda p: p.stat().st_size)  # fmt: skip


# A truncated or deleted data file and a broken `_METADATA`: tests/test_checkpoint.py.
CORRUPTIONS = {
    "byte_flipped": lambda step_dir: flip_a_byte(largest_data_file(step_dir)),
    "broken_host_metadata": lambda step_dir: (step_dir / "host" / "metadata").write_text("{"),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_corrupt_newest_step_is_set_aside_and_redone_in_one_line_each(finished, tmp_path, corruption):
    out = copy_of(finished, tmp_path)
    CORRUPTIONS[corruption](out / "checkpoints" / "6")
    done = run(out, finished[1], "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    said = messages(done.stderr)
    unreadable = [line for line in said if "is unreadable" in line]
    assert len(unreadable) == 1 and f"checkpoint step 6 in {out / 'checkpoints'} is unreadable (" in unreadable[0]
    assert any(f"moved unreadable checkpoint step 6 aside to {out / 'checkpoints' / '6.unreadable'}" in line
               for line in said)  # fmt: skip
    assert len(said) <= 5 and "Traceback" not in done.stderr, said
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["0", "3", "6", "6.unreadable"]
    assert algorithm_metrics(out / "metrics.jsonl") == algorithm_metrics(finished[0] / "metrics.jsonl")


def test_no_readable_step_exits_2_in_one_line_per_step_touching_nothing(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    for step in (0, 3, 6):
        largest_data_file(out / "checkpoints" / str(step)).unlink()
    before = snapshot(out)
    done = run(out, finished[1], "--resume")
    said = messages(done.stderr)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert said[-1].startswith(f"error: no readable checkpoint in {out / 'checkpoints'} (step 6: ")
    assert len(said) == 4 and all("is unreadable" in line for line in said[:3]), said
    assert snapshot(out) == before


@pytest.mark.parametrize(("change", "named"), [
    (["model.preset=tiny_glm4_moe"], "model.preset: tiny_qwen3_moe → tiny_glm4_moe"),  # other shapes
    (["policy.optimizer.lr=1e-2", "train.steps=9"], "policy.optimizer.lr: 0.001 → 0.01"),  # train.steps may change
])  # fmt: skip
def test_a_changed_config_exits_2_naming_every_changed_key(finished, tmp_path, change, named):
    out = copy_of(finished, tmp_path)
    before = snapshot(out)
    done = run(out, finished[1], *change, "--resume")
    assert done.returncode == 2
    assert messages(done.stderr) == [
        f"error: the checkpoints in {out / 'checkpoints'} were saved under another config ({named}); "
        "pass --allow-config-change to resume all the same"]
    assert snapshot(out) == before


def test_without_resume_a_folder_holding_a_run_is_refused(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    before = snapshot(out)
    done = run(out, finished[1])
    assert done.returncode == 2
    assert messages(done.stderr) == [f"error: {out} already holds a run (metrics.jsonl or checkpoints); continue it "
                                     "with --resume, or choose another output_dir"]  # fmt: skip
    assert snapshot(out) == before


def test_sao_eval_without_a_readable_checkpoint_is_one_line(finished, tmp_path):
    empty = run(tmp_path / "empty", finished[1], program="evaluate_main")
    assert (empty.returncode, messages(empty.stderr)) == (2, [f"error: no checkpoint in {tmp_path / 'empty' / 'checkpoints'}"])
    out = copy_of(finished, tmp_path)
    for step in (0, 3, 6):
        (out / "checkpoints" / str(step) / "state" / "_METADATA").write_text("{")
    done = run(out, finished[1], program="evaluate_main")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert messages(done.stderr)[-1].startswith(f"error: no readable checkpoint in {out / 'checkpoints'}")


def test_sao_eval_under_another_model_names_the_key_and_calls_no_checkpoint_unreadable(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    done = run(out, finished[1], "model.preset=tiny_glm4_moe", program="evaluate_main")
    assert done.returncode == 2 and "unreadable" not in done.stderr and "Traceback" not in done.stderr
    assert messages(done.stderr) == [
        f"error: checkpoint step 6 in {out / 'checkpoints'} was saved under another model or state (model.preset: "
        "tiny_qwen3_moe → tiny_glm4_moe), whose arrays this config's do not fit: pass the run's own values of these "
        "keys"]  # fmt: skip


def test_resume_of_a_run_past_a_lowered_train_steps_is_refused_touching_nothing(finished, tmp_path):
    """A finished 6-step run resumed with train.steps=3 would train nothing and report 3 steps beside
    metrics that reach 6: refused instead, naming the step reached and what to do."""
    out = copy_of(finished, tmp_path)
    before = snapshot(out)
    done = run(out, finished[1], "train.steps=3", "--resume")
    assert done.returncode == 2
    assert messages(done.stderr) == [f"error: the run in {out / 'checkpoints'} has reached step 6, past train.steps=3: "
                                     "raise train.steps to train it further, or evaluate it with sao-eval"]  # fmt: skip
    assert snapshot(out) == before
    again = run(out, finished[1], "--resume")  # the same train.steps: nothing left to do, the same summary
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 6
    assert "in 6 RL steps" in again.stdout


# `sao-train --resume` with the rollout engine recording, one JSON line each, its start index and
# the prompt indices of every batch it hands out.
RECORDING_TRAINER = """
import json, sys
import sao_jax.rollout.engine as engine_lib
import sao_jax.train.batches as batches
from sao_jax.cli import main

record = open(sys.argv[1], "a")

class Recorded(engine_lib.RolloutEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        record.write(json.dumps({"start": self.start_index}) + "\\n"); record.flush()

    def get_batch(self, batch_size, timeout_s=None):
        batch = super().get_batch(batch_size, timeout_s)
        record.write(json.dumps({"batch": [t.prompt_id for t in batch]}) + "\\n"); record.flush()
        return batch

batches.RolloutEngine = Recorded  # the name StreamingBatches looks up
raise SystemExit(main([*sys.argv[2:], "--resume"]))
"""


def recording_trainer(out, record, *extra):
    """The command of a tiny async run in `out` with the RECORDING_TRAINER writing to `record`."""
    overrides = [f"output_dir={out}", *TINY_RUN, "train.mode=async", "sft.steps=0", "critic.pretrain_rollouts=0",
                 "train.steps=6", "train.eval_every=6", "train.queue_capacity=4", *extra]  # fmt: skip
    return [sys.executable, "-c", RECORDING_TRAINER, str(record), *overrides]


def test_async_resume_continues_the_prompt_stream(finished, tmp_path):
    """kill -9 after a checkpoint: the resumed engine starts where the interrupted one stood, above
    every prompt index trained on before the checkpoint, and trains on none of those again."""
    out, record = tmp_path / "run", tmp_path / "record.jsonl"
    trainer = recording_trainer(out, record, "train.checkpoint_every=2")
    interrupted = subprocess.Popen(trainer, env=finished[1], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not ((out / "checkpoints" / "2").is_dir() and count_lines(out / "metrics.jsonl") >= 4):  # 0, 1, 2, 3
        assert interrupted.poll() is None and time.monotonic() < deadline, "run did not reach step 3"
        time.sleep(0.02)
    interrupted.send_signal(signal.SIGKILL)
    interrupted.wait()
    lines = record.read_text().splitlines()
    resumed = subprocess.run(trainer, env=finished[1], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (step,) = {int(line.split("resumed from step ")[1].split()[0]) for line in messages(resumed.stderr)
               if "resumed from step" in line}  # fmt: skip
    first = [json.loads(line) for line in lines]
    second = [json.loads(line) for line in record.read_text().splitlines()[len(lines):]]
    assert first[0] == {"start": 0} and second[0]["start"] > 0
    trained = [index for entry in first[1:step + 1] for index in entry["batch"]]  # steps 1..step
    redone = [index for entry in second[1:] for index in entry["batch"]]  # steps step+1..6
    assert len(trained) == 4 * step and len(redone) == 4 * (6 - step)
    assert second[0]["start"] > max(trained) and min(redone) >= second[0]["start"]


def digests(out, step):
    """The per-array checksums saved with checkpoint `step` (`checkpoint.checksums`)."""
    return json.loads((out / "checkpoints" / str(step) / "digest" / "metadata").read_text())


def signal_when(output_dir, env, signum, ready, *extra):
    """`--resume` sent `signum` as soon as `ready()` holds; (exit status, stderr)."""
    log = output_dir.parent / f"{output_dir.name}.{time.monotonic_ns()}.stderr"
    with log.open("w") as stderr:
        process = subprocess.Popen(command(output_dir, *PATIENT_STOP, "--resume", *extra), env=env,
                                   stdout=subprocess.DEVNULL, stderr=stderr)  # fmt: skip
        deadline = time.monotonic() + 300
        while not ready() and process.poll() is None:
            assert time.monotonic() < deadline, "run did not progress"
            time.sleep(0.02)
        process.send_signal(signum)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            pytest.fail(f"the run did not stop within 120 s of {signal.Signals(signum).name}")
    return process.returncode, log.read_text()


def stop_between_checkpoints(finished, tmp_path, signum):
    """A copy of the finished run rewound to checkpoint 3, resumed and sent `signum` once step 4 is
    written; checks the stop (one line, exit 128 + the signal, the step in hand saved) and returns
    (folder, the step it stopped at)."""
    out = copy_of(finished, tmp_path, rewind_to=3)
    at_checkpoint = count_lines(out / "metrics.jsonl")
    step_4_written = lambda: count_lines(out / "metrics.jsonl") > at_checkpoint  # noqa: E731
    returncode, stderr = signal_when(out, finished[1], signum, step_4_written)
    stopped_at = algorithm_metrics(out / "metrics.jsonl")[-1]["step"]
    assert returncode == 128 + signum and "Traceback" not in stderr, stderr[-3000:]
    said = [line for line in messages(stderr) if not line.startswith(("INFO ", "INFO:"))]
    name = signal.Signals(signum).name
    assert said == [f"interrupted by {name} at step {stopped_at}; saved; resume with --resume"], said
    assert 3 < stopped_at and (out / "checkpoints" / str(stopped_at)).is_dir()
    return out, stopped_at


def test_sigterm_saves_the_step_in_hand_and_resume_ends_as_the_uninterrupted_run(finished, tmp_path):
    """SIGTERM between two checkpoints (3 and 6): `--resume` from the step saved on the way out writes
    the uninterrupted run's metrics and final checkpoint."""
    out, stopped_at = stop_between_checkpoints(finished, tmp_path, signal.SIGTERM)
    done = run(out, finished[1], "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from step {stopped_at}" in done.stderr
    assert algorithm_metrics(out / "metrics.jsonl") == algorithm_metrics(finished[0] / "metrics.jsonl")
    assert digests(out, 6) == digests(finished[0], 6)


def test_ctrl_c_saves_the_step_in_hand_in_one_line_without_a_traceback(finished, tmp_path):
    stop_between_checkpoints(finished, tmp_path, signal.SIGINT)


# `sao-train` whose checkpoint writes fail with ENOSPC ("No space left on device") from step 3 on, in
# Orbax's background commit, where a full disk makes them fail.
FULL_DISK_TRAINER = """
import errno, os
from orbax.checkpoint._src.handlers import json_checkpoint_handler as json_handler
from sao_jax.cli import main

written = json_handler.JsonCheckpointHandler._save_fn

async def full_disk(self, x, directory):
    if int(directory.parent.name.split(".")[0]) >= 3:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
    return await written(self, x, directory)

json_handler.JsonCheckpointHandler._save_fn = full_disk
raise SystemExit(main())
"""


def test_a_failed_save_stops_the_run_at_once_in_one_line_keeping_what_was_trained(finished, tmp_path):
    out = copy_of(finished, tmp_path, rewind_to=0)
    (out / "summary.json").unlink()
    shutil.rmtree(out / "plots")
    done = subprocess.run([sys.executable, "-c", FULL_DISK_TRAINER, f"output_dir={out}", *FAULT_RUN, "--resume"],
                          env=finished[1], capture_output=True, text=True, timeout=600)  # fmt: skip
    said = messages(done.stderr)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in said if line.startswith("error:")]
    assert errors == [f"error: checkpoint step 3 could not be saved in {out / 'checkpoints'}: No space left on device "
                      "(the earlier checkpoints are kept: --resume continues from the newest)"], said  # fmt: skip
    trained = algorithm_metrics(out / "metrics.jsonl")[-1]["step"]
    assert 3 < trained < 6, "the failure was known only at the next checkpoint"
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["0"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == trained and summary["eval_success_start"] is not None
    assert any((out / "plots").glob("*.png"))


def step_lines(path):
    """The metric lines of the evaluation before RL and of the RL steps: the warm-start stages' lines
    (SFT, value pretraining, the critic's warmup, each with a `stage`) left out."""
    return [line for line in algorithm_metrics(path) if "stage" not in line] if path.exists() else []


def test_async_sigterm_stops_the_rollout_threads_saves_and_resume_continues_the_stream(finished, tmp_path):
    """SIGTERM in async mode, with no checkpoint due before the end: the step in hand is saved with the
    stream's position, the prompts in flight are counted in the one line, and the resumed engine starts
    at that position, trains on none of the prompts trained on before, and ends the run."""
    out, record = tmp_path / "run", tmp_path / "record.jsonl"
    trainer = recording_trainer(out, record, "train.checkpoint_every=6", *PATIENT_STOP)
    log = tmp_path / "interrupted.stderr"
    with log.open("w") as stderr:
        interrupted = subprocess.Popen(trainer, env=finished[1], stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + 300
        while len(step_lines(out / "metrics.jsonl")) < 3:  # steps 0, 1, 2
            assert interrupted.poll() is None and time.monotonic() < deadline, "run did not reach step 2"
            time.sleep(0.02)
        interrupted.send_signal(signal.SIGTERM)
        interrupted.wait(timeout=120)
    stderr = log.read_text()
    assert interrupted.returncode == 143 and "Traceback" not in stderr, stderr[-3000:]
    said = [line for line in messages(stderr) if not line.startswith(("INFO ", "INFO:"))]
    step = algorithm_metrics(out / "metrics.jsonl")[-1]["step"]
    line = rf"interrupted by SIGTERM at step {step}; saved(; \d+ prompts queued or in flight dropped)?; resume with --resume"
    assert len(said) == 1 and re.fullmatch(line, said[0]), said
    position = json.loads((out / "checkpoints" / str(step) / "host" / "metadata").read_text())["prompt_index"]
    lines = record.read_text().splitlines()
    resumed = subprocess.run(trainer, env=finished[1], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first = [json.loads(line) for line in lines]
    second = [json.loads(line) for line in record.read_text().splitlines()[len(lines):]]
    trained = [index for entry in first[1:step + 1] for index in entry["batch"]]  # steps 1..step
    assert second[0] == {"start": position[0]} and position[0] > max(trained)
    redone = [index for entry in second[1:] for index in entry["batch"]]  # steps step+1..6
    assert len(redone) == 4 * (6 - step) and min(redone) >= position[0]
    assert [line["step"] for line in step_lines(out / "metrics.jsonl")] == list(range(7))


def test_a_signal_during_sft_stops_in_one_line_leaving_a_folder_resume_starts_over(finished, tmp_path):
    out = tmp_path / "run"
    sft_line_written = lambda: count_lines(out / "metrics.jsonl") >= 1  # noqa: E731
    returncode, stderr = signal_when(out, finished[1], signal.SIGTERM, sft_line_written)
    assert returncode == 143 and "Traceback" not in stderr, stderr[-3000:]
    said = [line for line in messages(stderr) if not line.startswith(("INFO ", "INFO:"))]
    assert said == ["interrupted by SIGTERM during SFT, before the first checkpoint; --resume starts from the beginning"]
    assert {line.get("stage") for line in algorithm_metrics(out / "metrics.jsonl")} == {"sft"}
    assert not any(p.name[0].isdigit() for p in (out / "checkpoints").iterdir())  # `--resume` starts over (fixture)
