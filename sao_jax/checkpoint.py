"""Orbax checkpoints of a whole run: the train-state pytree plus JSON-able host state.

`OUTDIR/checkpoints/<step>/` holds `state` (the `TrainState` pytree: both models, both optimizer
states, baseline windows, step) and `host` (JSON: data-iterator position, environment schedule
position, the engine's bookkeeping, the config). Saves are asynchronous; the last `keep` are kept.

Orbax writes each step under a temporary name and renames it when complete, so a process killed
mid-save leaves no step that looks finished. A step that is finished but unreadable (a corrupted
file) is reported and skipped: `restore_latest` falls back to the newest step that restores.

In a multi-process run every process calls `save` and `restore` with its arrays on the global mesh;
Orbax writes each array's shards from the processes that hold them (the directory must be shared).
The directory may be a local path or a Cloud Storage URL (`gs://bucket/run/checkpoints`), which
Orbax writes directly (`etils.epath`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from sao_jax.outputs import is_url

log = logging.getLogger(__name__)


def abstract_state(state: Any) -> Any:
    """The shapes, dtypes and shardings of `state`: the `abstract_state` that restores a checkpoint
    laid out as `state` is (on the same devices, e.g. the global mesh of a multi-process run)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def checkpoint_path(directory: str | Path) -> epath.Path:
    """`directory` as Orbax takes it: a URL (`gs://…`) as it stands, a local path made absolute."""
    path = epath.Path(directory)
    return path if is_url(directory) else path.absolute()


class Checkpointer:
    """Save and restore `(state pytree, host dict)` pairs by step under `directory`."""

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True,
                 after_save: Callable[[], object] | None = None):  # fmt: skip
        """`after_save`: called once each save has started (the trainer pushes its other files then)."""
        self.directory = checkpoint_path(directory)
        self._after_save = after_save
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: Any, host: dict[str, Any]) -> None:
        """Start saving (returns before the write finishes when async; `wait` blocks on it)."""
        self._manager.save(
            int(step),
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), host=ocp.args.JsonSave(host)),
        )
        if self._after_save is not None:
            self._after_save()

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """(state, host) of `step`; `abstract_state` gives the pytree structure, shapes and shardings."""
        restored = self._manager.restore(
            int(step),
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), host=ocp.args.JsonRestore()),
        )
        return restored["state"], dict(restored["host"])

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict[str, Any]] | None:
        """(step, state, host) of the newest step that restores, or None when there is none."""
        for step in reversed(self.steps()):
            try:
                state, host = self.restore(step, abstract_state)
            except Exception as error:  # noqa: BLE001 — any unreadable step is skipped, loudly
                log.warning("checkpoint step %d in %s is unreadable (%s); trying the previous one",
                            step, self.directory, error)  # fmt: skip
                continue
            return step, state, host
        return None

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
