"""One run per folder: a second `sao-train` on a folder in use gets one line and exit 2, and the lock
goes with its holder however it ends (kill -9 leaves a file, never a lock)."""

import signal
import subprocess
import sys
import time

import pytest

from sao_jax.config import load_config
from sao_jax.outputs import FolderBusyError, FolderLock, OutputMirror
from sao_jax.train.loop import run_folder_locks
from tests.train.test_faults import messages
from tests.train.test_resume import TINY_RUN, count_lines, environment

HOLDER = """
import sys, time
from sao_jax.outputs import FolderLock
with FolderLock(sys.argv[1], key="output_dir"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_held_folder_is_refused_naming_the_key_and_freed_on_exit(tmp_path):
    with FolderLock(tmp_path, key="output_dir"):
        with pytest.raises(FolderBusyError, match=rf"^another sao-train is running in {tmp_path} \(output_dir\); "):
            with FolderLock(tmp_path, key="output_dir"):
                pass
    with FolderLock(tmp_path, key="output_dir"):  # released: taken again
        pass


def test_a_lock_whose_holder_was_killed_blocks_nothing(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderBusyError):
            FolderLock(tmp_path, key="output_dir").__enter__()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with FolderLock(tmp_path, key="output_dir"):  # nothing of it blocks a restart
        pass
    assert list(tmp_path.iterdir()) == []  # and nothing was written in the folder


def test_a_run_locks_its_output_folder_its_checkpoint_folder_and_a_urls_local_mirror(tmp_path):
    config = load_config(None, [f"output_dir={tmp_path / 'out'}", f"train.checkpoint_dir={tmp_path / 'ckpt'}"])
    with run_folder_locks(config):
        for folder, key in ((tmp_path / "out", "output_dir"), (tmp_path / "ckpt", "train.checkpoint_dir")):
            with pytest.raises(FolderBusyError, match=rf"in {folder} \({key}\)"):
                FolderLock(folder, key=key).__enter__()
    url = "memory://bucket/locked"
    with run_folder_locks(load_config(None, [f"output_dir={url}"])):
        with pytest.raises(FolderBusyError, match=f"in {url} "):
            run_folder_locks(load_config(None, [f"output_dir={url}"]))
        assert (OutputMirror.local_path(url).parent / f"{OutputMirror.local_path(url).name}.lock").exists()
    with run_folder_locks(load_config(None, [f"output_dir={url}"])):
        pass


@pytest.mark.slow
def test_a_second_sao_train_on_a_folder_in_use_exits_2_in_one_line(tmp_path):
    env = environment(tmp_path / "jax_cache")
    out = tmp_path / "run"
    command = [sys.executable, "-m", "sao_jax.cli", f"output_dir={out}", *TINY_RUN, "sft.steps=2000",
               "sft.target_demonstration_probability=0", "--resume"]  # fmt: skip
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while count_lines(out / "metrics.jsonl") < 1:  # in SFT, holding the folder
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.05)
        for extra in ([], ["--resume"]):
            second = subprocess.run([*command[:-1], *extra], env=env, capture_output=True, text=True, timeout=300)
            assert second.returncode == 2
            assert messages(second.stderr) == [f"error: another sao-train is running in {out} (output_dir); wait for "
                                               "it to end, or choose another output_dir"]  # fmt: skip
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    with FolderLock(out, key="output_dir"):  # kill -9 left no lock behind
        pass
