"""Orbax checkpoints: round trip, keep-N, declined saves, digests and the finite check, falling back
past unreadable steps, moving them aside, and the stored config."""

import errno
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from sao_jax.checkpoint import (CheckpointSaveError, Checkpointer, ResumeError, _checksum, _save_cause, checkpoint_path,
                                config_changes)
from sao_jax.config import load_config, to_dict
from sao_jax.train.build import checkpoint_dir


def make_state(seed):
    key = jax.random.key(seed)
    return {"params": {"w": jax.random.normal(key, (64, 300)), "b": jnp.arange(3.0)}, "step": jnp.int32(seed)}


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def save_steps(directory, steps, *, config=None):
    with Checkpointer(directory, config=config or {}, async_save=False) as ckpt:
        for step in steps:
            ckpt.save(step, make_state(step), {"n": step})


def data_files(step_dir):
    """The array data files of a step (OCDBT's `d/` folders), largest first."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_round_trip_of_state_and_host_dict(tmp_path):
    state = make_state(1)
    with Checkpointer(tmp_path / "ckpt", config={}) as ckpt:
        ckpt.save(7, state, {"prompts_taken": 12, "style_phase": "cute", "config": {"seed": 3}})
        ckpt.wait()
        restored_state, host = ckpt.restore(7, abstract(state))
    jax.tree.map(np.testing.assert_array_equal, restored_state, state)
    assert host == {"prompts_taken": 12, "style_phase": "cute", "config": {"seed": 3}}


def test_the_lagged_policy_item_round_trips_is_digested_and_only_read_when_asked_for(tmp_path):
    lagged = [jax.device_get(make_state(v)["params"]) for v in (5, 6)]  # host copies, as the ring keeps them
    with Checkpointer(tmp_path / "ckpt", config={}, async_save=False) as ckpt:
        ckpt.save(1, make_state(1), {}, lagged_policy=lagged)
        ckpt.save(2, make_state(2), {})  # a step saved without one
        shapes = abstract(lagged)
        with pytest.raises(ValueError, match="step 2 holds no lagged_policy"):
            ckpt.restore_lagged_policy(2, shapes)
        restored = ckpt.restore_latest(abstract(make_state(0)), abstract_lagged_policy=shapes)
        assert restored.step == 1 and restored.unreadable == (2,)  # the newest step lacks it: the next newest
        jax.tree.map(np.testing.assert_array_equal, restored.lagged_policy, lagged)
        assert ckpt.restore_latest(abstract(make_state(0))).lagged_policy is None  # sao-eval reads the state only
    lagged_dir = tmp_path / "ckpt" / "1" / "lagged_policy"
    flip_a_byte(max((p for p in lagged_dir.rglob("*") if p.is_file() and p.parent.name == "d"),
                    key=lambda p: p.stat().st_size))  # fmt: skip
    with Checkpointer(tmp_path / "ckpt", config={}) as ckpt:
        with pytest.raises(ValueError, match=r"the array lagged_policy\[\d\]\['w'\] does not match its digest"):
            ckpt.restore_lagged_policy(1, shapes)


def test_keeps_only_the_last_n(tmp_path):
    with Checkpointer(tmp_path / "ckpt", config={}, keep=2) as ckpt:
        for step in range(1, 5):
            ckpt.save(step, make_state(step), {})
            ckpt.wait()
        assert ckpt.steps() == [3, 4]


def test_a_save_orbax_declines_is_an_error(tmp_path):
    save_steps(tmp_path / "ckpt", [3])
    with Checkpointer(tmp_path / "ckpt", config={}) as ckpt, pytest.raises(RuntimeError, match="step 2 was not saved"):
        ckpt.save(2, make_state(2), {})


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint8, jnp.bool_])
def test_checksum_is_the_weighted_word_sum_and_sees_a_one_word_change(dtype):
    x = np.asarray(jax.random.uniform(jax.random.key(0), (5, 7, 3)) * 200).astype(dtype)
    words = x.astype(np.uint8) if dtype == jnp.bool_ else x
    words = words.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).astype(np.uint64).ravel()
    expected = int((words * (2 * np.arange(words.size, dtype=np.uint64) + 1)).sum() % 2**32)  # numpy, in 64 bits
    assert int(_checksum(jnp.asarray(x))) == expected
    changed = x.copy().ravel()
    changed[17] = ~changed[17] if dtype == jnp.bool_ else changed[17] + 1
    assert int(_checksum(jnp.asarray(changed.reshape(x.shape)))) != expected
    assert int(_checksum(jnp.asarray(x, dtype)[0, 0, 0])) == int(words[0])  # a scalar: weight 1


def test_a_flipped_byte_that_orbax_restores_without_a_word_is_caught_by_the_digest(tmp_path):
    directory = tmp_path / "ckpt"
    save_steps(directory, [1, 2])
    flip_a_byte(data_files(directory / "2")[0])
    # Orbax alone hands back different numbers without an error: the digest is what notices.
    with ocp.CheckpointManager(checkpoint_path(directory)) as manager:
        raw = manager.restore(2, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract(make_state(0)))))
    assert not np.array_equal(raw["state"]["params"]["w"], make_state(2)["params"]["w"])
    with Checkpointer(directory, config={}) as ckpt:
        restored = ckpt.restore_latest(abstract(make_state(0)))
    assert (restored.step, restored.host, restored.unreadable) == (1, {"n": 1}, (2,))
    jax.tree.map(np.testing.assert_array_equal, restored.state, make_state(1))


def test_a_state_with_nan_is_unreadable(tmp_path, caplog):
    directory = tmp_path / "ckpt"
    save_steps(directory, [1])
    with Checkpointer(directory, config={}, async_save=False) as ckpt:
        broken = make_state(2)
        broken["params"]["b"] = broken["params"]["b"].at[1].set(jnp.nan)
        ckpt.save(2, broken, {"n": 2})
        restored = ckpt.restore_latest(abstract(make_state(0)))
    assert (restored.step, restored.unreadable) == (1, (2,))
    assert "['params']['b'] holds NaN or inf" in caplog.text


def test_restore_latest_takes_the_newest_step_and_past_a_corruption_the_next_newest(tmp_path):
    directory = tmp_path / "ckpt"
    save_steps(directory, [1, 2, 3])
    with Checkpointer(directory, config={}) as ckpt:
        restored = ckpt.restore_latest(abstract(make_state(0)))
    assert (restored.step, restored.host, restored.unreadable) == (3, {"n": 3}, ())
    jax.tree.map(np.testing.assert_array_equal, restored.state, make_state(3))
    for path in (directory / "3").rglob("*"):
        if path.is_file():
            path.write_bytes(b"garbage")
    with Checkpointer(directory, config={}) as ckpt:
        restored = ckpt.restore_latest(abstract(make_state(0)))
    assert (restored.step, restored.host) == (2, {"n": 2})  # the newest readable step, not the oldest
    jax.tree.map(np.testing.assert_array_equal, restored.state, make_state(2))


def test_unreadable_steps_set_aside_make_room_for_the_redone_saves(tmp_path):
    directory = tmp_path / "ckpt"
    save_steps(directory, [1, 2, 3])
    data_files(directory / "3")[0].write_bytes(b"")  # truncated
    (directory / "2" / "state" / "_METADATA").write_text("{broken")
    with Checkpointer(directory, config={}, async_save=False) as ckpt:
        restored = ckpt.restore_latest(abstract(make_state(0)))
        assert (restored.step, restored.unreadable) == (1, (3, 2))
        ckpt.set_aside(restored.unreadable)
        assert ckpt.steps() == [1]
        ckpt.save(2, make_state(2), {"n": 2})
        ckpt.save(3, make_state(3), {"n": 3})
        assert ckpt.restore_latest(abstract(make_state(0))).step == 3
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2", "2.unreadable", "3", "3.unreadable"]


def test_no_readable_step_is_one_error_naming_the_folder_and_each_cause(tmp_path):
    directory = tmp_path / "ckpt"
    save_steps(directory, [1, 2])
    for step in (1, 2):
        for path in data_files(directory / str(step)):
            path.unlink()
    with Checkpointer(directory, config={}) as ckpt, pytest.raises(ResumeError) as error:
        ckpt.restore_latest(abstract(make_state(0)))
    message = str(error.value)
    assert message.startswith(f"no readable checkpoint in {directory}") and "step 2: " in message and "step 1: " in message
    assert "\n" not in message and len(message) < 1000
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2"]  # nothing touched


def test_no_checkpoint_gives_none(tmp_path):
    with Checkpointer(tmp_path / "empty", config={}) as ckpt:
        assert ckpt.restore_latest(abstract(make_state(0))) is None


def test_another_config_is_refused_naming_every_changed_key_except_the_resumable_ones(tmp_path):
    saved = to_dict(load_config(None, [f"output_dir={tmp_path}"]))
    save_steps(tmp_path / "ckpt", [1], config=saved)
    extended = to_dict(load_config(None, [f"output_dir={tmp_path}/moved", "train.steps=500", "train.eval_every=5"]))
    with Checkpointer(tmp_path / "ckpt", config=extended) as ckpt:
        assert ckpt.restore_latest(abstract(make_state(0))).step == 1
    changed = to_dict(load_config(None, [f"output_dir={tmp_path}", "policy.optimizer.lr=0.01", "seed=3",
                                         "train.steps=500"]))  # fmt: skip
    with Checkpointer(tmp_path / "ckpt", config=changed) as ckpt:
        with pytest.raises(ResumeError, match=r"another config \(policy\.optimizer\.lr: .* → 0\.01; seed: 0 → 3\)"):
            ckpt.restore_latest(abstract(make_state(0)))
        assert ckpt.restore_latest(abstract(make_state(0)), allow_config_change=True).step == 1


def test_config_changes_compares_as_stored():
    config = to_dict(load_config(None, ["env.difficulty=[1, 2]"]))
    assert config_changes(config, config) == []
    assert config_changes(config, {**config, "extra": 1}) == ["extra: (absent) → 1"]


def test_a_cloud_storage_url_reaches_orbax_as_it_stands_and_a_local_path_absolute(tmp_path, monkeypatch):
    url = checkpoint_path("gs://bucket/runs/a/checkpoints")
    assert str(url) == "gs://bucket/runs/a/checkpoints"  # pathlib would give "gs:/bucket/..."
    monkeypatch.chdir(tmp_path)
    assert str(checkpoint_path("runs/a")) == str(tmp_path / "runs" / "a")


def test_train_checkpoint_dir_moves_the_checkpoints_out_of_output_dir(tmp_path):
    default = load_config(None, [f"output_dir={tmp_path / 'run'}"])
    assert checkpoint_dir(default) == str(tmp_path / "run" / "checkpoints")
    moved = load_config(None, [f"output_dir={tmp_path / 'run'}", "train.checkpoint_dir=gs://bucket/run/ckpt"])
    assert checkpoint_dir(moved) == "gs://bucket/run/ckpt"
    elsewhere = load_config(None, [f"train.checkpoint_dir={tmp_path / 'elsewhere'}"])
    with Checkpointer(checkpoint_dir(elsewhere), config={}) as ckpt:
        ckpt.save(1, {"x": jnp.ones(2)}, {"step": 1})
    assert (tmp_path / "elsewhere" / "1").is_dir()


def test_the_reads_a_failed_restore_abandons_report_nothing_up_to_the_exit(tmp_path):
    """One failing array ends Orbax's restore while the step's other reads are in flight; their late
    errors (unraisable coroutines, TensorStore calling into a closed event loop) must not reach stderr."""
    directory = tmp_path / "ckpt"
    many = {f"w{i}": jax.random.normal(jax.random.key(i), (64, 64 + i)) for i in range(40)}
    with Checkpointer(directory, config={}, async_save=False) as ckpt:
        ckpt.save(1, many, {})
    for path in data_files(directory / "1"):
        path.unlink()
    script = f"""
import jax, jax.numpy as jnp
from sao_jax.checkpoint import Checkpointer, ResumeError
shapes = {{f"w{{i}}": jax.ShapeDtypeStruct((64, 64 + i), jnp.float32) for i in range(40)}}
try:
    Checkpointer({str(directory)!r}, config={{}}).restore_latest(shapes)
except ResumeError:
    print("refused")
"""
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert done.stdout.strip() == "refused" and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_an_abandoned_read_collected_after_the_restore_is_not_logged_and_other_errors_are(tmp_path):
    """asyncio logs "Task exception was never retrieved" when the task is collected, which can be
    long after the restore that abandoned it; only the reads of a folder that failed to restore are
    dropped."""
    script = f"""
import asyncio, gc, logging
from sao_jax.checkpoint import _drop_abandoned_reads
logging.basicConfig()
_drop_abandoned_reads({str(tmp_path)!r})

async def fail(message):
    raise ValueError(message)

async def main():
    tasks = [asyncio.ensure_future(fail(m)) for m in ({str(tmp_path / "0" / "state")!r}, "an unrelated failure")]
    await asyncio.sleep(0.01)
    tasks.clear()
    gc.collect()

asyncio.run(main())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "an unrelated failure" in done.stderr and "exception was never retrieved" in done.stderr
    assert str(tmp_path) not in done.stderr, done.stderr


def test_a_save_failing_in_the_background_is_known_without_waiting_and_named_in_one_error(tmp_path, monkeypatch,
                                                                                          capfd):  # fmt: skip
    """A disk that fills during step 2's background write: `failure` reports it once the write has
    ended (it never blocks on one in progress), as ENOSPC's words with the step and the folder, with
    none of Orbax's tracebacks; step 1 is kept."""
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as json_handler

    written = json_handler.JsonCheckpointHandler._save_fn

    async def full_disk(self, x, directory):
        if directory.parent.name.startswith("2"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
        return await written(self, x, directory)

    monkeypatch.setattr(json_handler.JsonCheckpointHandler, "_save_fn", full_disk)
    ckpt = Checkpointer(tmp_path / "ckpt", config={})
    ckpt.save(1, make_state(1), {})
    ckpt.wait()
    assert ckpt.failure() is None
    ckpt.save(2, make_state(2), {})
    deadline = time.monotonic() + 60
    while (failure := ckpt.failure()) is None:
        assert time.monotonic() < deadline, "the failed save was never reported"
        time.sleep(0.01)
    assert isinstance(failure, CheckpointSaveError)
    assert str(failure) == f"checkpoint step 2 could not be saved in {tmp_path / 'ckpt'}: No space left on device"
    assert ckpt.failure() is None  # reported once
    assert ckpt.steps() == [1]
    ckpt.close()
    assert "Traceback" not in capfd.readouterr().err


def test_the_cause_of_a_failed_save_is_the_operating_systems_words():
    tensorstore = ValueError('RESOURCE_EXHAUSTED: Error writing local file "/ckpt/3/state/_sharding": Failed to '
                             "write 8061 bytes to file 13: No space left on device [os_error_code='28']")  # fmt: skip
    assert _save_cause(tensorstore) == "No space left on device"
    try:
        try:
            raise PermissionError(errno.EACCES, "Permission denied", "/ckpt/3")
        except PermissionError as error:
            raise RuntimeError("save failed") from error
    except RuntimeError as wrapped:
        assert _save_cause(wrapped) == "Permission denied"
    assert _save_cause(RuntimeError("something else\nmore")) == "RuntimeError: something else"
