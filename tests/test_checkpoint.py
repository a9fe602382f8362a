"""Orbax checkpoints: round trip, keep-N, and falling back past a corrupted step."""

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.checkpoint import Checkpointer, checkpoint_path
from sao_jax.config import load_config
from sao_jax.train.loop import checkpoint_dir


def make_state(seed):
    key = jax.random.key(seed)
    return {"params": {"w": jax.random.normal(key, (4, 3)), "b": jnp.arange(3.0)}, "step": jnp.int32(seed)}


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def test_round_trip_of_state_and_host_dict(tmp_path):
    state = make_state(1)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(7, state, {"prompts_taken": 12, "style_phase": "cute", "config": {"seed": 3}})
        ckpt.wait()
        restored_state, host = ckpt.restore(7, abstract(state))
    jax.tree.map(np.testing.assert_array_equal, restored_state, state)
    assert host == {"prompts_taken": 12, "style_phase": "cute", "config": {"seed": 3}}


def test_keeps_only_the_last_n(tmp_path):
    with Checkpointer(tmp_path / "ckpt", keep=2) as ckpt:
        for step in range(1, 5):
            ckpt.save(step, make_state(step), {})
            ckpt.wait()
        assert ckpt.steps() == [3, 4]


def test_corrupted_latest_step_falls_back_to_the_previous(tmp_path):
    directory = tmp_path / "ckpt"
    with Checkpointer(directory, async_save=False) as ckpt:
        ckpt.save(1, make_state(1), {"n": 1})
        ckpt.save(2, make_state(2), {"n": 2})
    # Corrupt every data file of step 2 (a disk error after the save completed).
    for path in (directory / "2").rglob("*"):
        if path.is_file():
            path.write_bytes(b"garbage")
    with Checkpointer(directory) as ckpt:
        step, state, host = ckpt.restore_latest(abstract(make_state(0)))
    assert step == 1 and host == {"n": 1}
    jax.tree.map(np.testing.assert_array_equal, state, make_state(1))


def test_restore_latest_takes_the_newest_step_and_past_a_corruption_the_next_newest(tmp_path):
    directory = tmp_path / "ckpt"
    with Checkpointer(directory, async_save=False) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, make_state(step), {"n": step})
        step, state, host = ckpt.restore_latest(abstract(make_state(0)))
    assert step == 3 and host == {"n": 3}
    jax.tree.map(np.testing.assert_array_equal, state, make_state(3))
    for path in (directory / "3").rglob("*"):
        if path.is_file():
            path.write_bytes(b"garbage")
    with Checkpointer(directory) as ckpt:
        step, state, host = ckpt.restore_latest(abstract(make_state(0)))
    assert step == 2 and host == {"n": 2}  # the newest readable step, not the oldest
    jax.tree.map(np.testing.assert_array_equal, state, make_state(2))


def test_no_checkpoint_gives_none(tmp_path):
    with Checkpointer(tmp_path / "empty") as ckpt:
        assert ckpt.restore_latest(abstract(make_state(0))) is None


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
    with Checkpointer(checkpoint_dir(load_config(None, [f"train.checkpoint_dir={tmp_path / 'elsewhere'}"]))) as ckpt:
        ckpt.save(1, {"x": jnp.ones(2)}, {"step": 1})
    assert (tmp_path / "elsewhere" / "1").is_dir()
