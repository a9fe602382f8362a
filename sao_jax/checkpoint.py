"""Orbax checkpoints of a whole run that verify themselves.

`CHECKPOINT_DIR/<step>/` holds four items:

- `state`: the `TrainState` pytree (both models, both optimizer states, baseline windows, step);
- `digest`: one 32-bit checksum per array of `state` (`checksums`), computed on the devices when the
  save starts;
- `config`: the resolved config the run was saved under;
- `host`: what the trainer needs besides the arrays — the step and, in async mode, each process's
  position in its prompt stream (`StreamingBatches.host_state`);
- `lagged_policy`, with sync mode's lag only (`rollout.policy_lag` > 0): the policy versions before the
  current one that the next steps sample with (`PolicyLagRing.saved`), digested with `state`.

Saves are asynchronous; the last `keep` are kept. A save Orbax declines (a step not newer than the
newest one present) raises instead of being dropped. A save that fails (a full disk, a folder without
write permission) is a `CheckpointSaveError` naming the step, the folder and the cause: from `save`
when it fails at once, from `failure` (which does not wait) or `wait` once it has failed in the
background; Orbax's own reports of it (tracebacks from its threads) are dropped, and the steps
saved before it are kept.

Orbax writes each step under a temporary name and renames it when complete, so a process killed
mid-save leaves no step that looks finished. A finished step that does not restore, whose arrays do
not match their digests or hold NaN/inf, is unreadable: `restore_latest` says so in one line and
falls back to the next newest step, and the trainer moves unreadable steps newer than the one it
resumes from aside (`<step>.unreadable`) so the redone saves can land. Before any array is read the
stored config is compared with the run's (`config_changes`): a difference outside
`RESUMABLE_CHANGES` is a `ResumeError`.

In a multi-process run every process calls `save` and `restore` with its arrays on the global mesh;
Orbax writes each array's shards from the processes that hold them (the directory must be shared).
The directory may be a local path or a Cloud Storage URL (`gs://bucket/run/checkpoints`), which
Orbax writes directly (`etils.epath`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from sao_jax.errors import UserError
from sao_jax.outputs import free_name, is_url

log = logging.getLogger(__name__)

# Config keys that may differ on resume without `--allow-config-change`: where the run writes and
# logs, how long it runs, how often it evaluates and saves, how long it bears a failing environment.
# Every other key shapes what is trained.
RESUMABLE_CHANGES = (
    "output_dir", "sft.cache_dir", "train.steps", "train.eval_every", "train.checkpoint_every",
    "train.keep_checkpoints", "train.checkpoint_dir", "train.signal_grace_s", "train.wandb", "train.wandb_project",
    "train.max_steps_without_data", "critic.pretrain_min_usable_fraction",
)  # fmt: skip

# Config keys that decide the train state's arrays (their shapes, or which arrays there are). A step
# that does not restore under a config differing from its own in one of them (`sao-eval`, or
# `--allow-config-change`, compare no config) is named with that key, not called unreadable.
SHAPING_KEYS = (
    "model.preset", "model.pretrained", "model.param_dtype", "critic.trainable_patterns", "env.train_prompts",
    "env.rl_prompts", "env.train_file", "advantage.estimator", "advantage.running_mean_scope",
    "advantage.running_mean_window", "loss.kl_coef",
)  # fmt: skip

# The checkpoint item of sync mode's lagged policy versions, and the prefix of their digest entries.
LAGGED_POLICY = "lagged_policy"

# Loggers that report an unreadable step at length (tracebacks, a whole TensorStore spec) while
# `restore_latest` already reports it in one line.
_NOISY_LOGGERS = ("absl", "asyncio", "orbax")


class ResumeError(UserError):
    """The run cannot start or continue from its folder as asked; the message is one line for the user."""


class CheckpointSaveError(Exception):
    """A checkpoint step could not be written; the message is one line for the user."""

    def __init__(self, step: int | None, directory: Any, cause: str):
        what = "a checkpoint" if step is None else f"checkpoint step {step}"
        super().__init__(f"{what} could not be saved in {directory}: {cause}")
        self.step, self.directory = step, directory


def _save_cause(error: BaseException) -> str:
    """Why a save failed, for the user: the operating system's words for an OS error anywhere in the
    chain ("No space left on device", "Permission denied"; TensorStore reports one as
    `os_error_code='28'`), else the root error's first line (`_cause`)."""
    seen = error
    while seen is not None:
        code = seen.errno if isinstance(seen, OSError) and seen.errno else None
        found = re.search(r"os_error_code='(\d+)'", str(seen))
        if code is None and found:
            code = int(found.group(1))
        if code is not None:
            return os.strerror(code)
        seen = seen.__cause__ or seen.__context__
    return _cause(error)


# Checkpoint folders a `Checkpointer` saves to: Orbax's error reports about saves there are dropped.
_saving_directories: set[str] = set()


class _SaveErrorFilter(logging.Filter):
    """Drops Orbax's reports of a failed save (each of its threads logs the error, with a traceback):
    an error record of Orbax's that carries an exception or names a folder of `_saving_directories`.
    The `Checkpointer` reports the failure in one line (`CheckpointSaveError`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" not in record.pathname or record.levelno < logging.ERROR:
            return True
        message = record.getMessage()
        return not (record.exc_info or any(directory in message for directory in _saving_directories))


def _drop_save_error_reports(directory: str) -> None:
    if not _saving_directories:
        logging.getLogger("absl").addFilter(_SaveErrorFilter())
    _saving_directories.add(directory)


def abstract_state(state: Any) -> Any:
    """The shapes, dtypes and shardings of `state`: the `abstract_state` that restores a checkpoint
    laid out as `state` is (on the same devices, e.g. the global mesh of a multi-process run)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def checkpoint_path(directory: str | Path) -> epath.Path:
    """`directory` as Orbax takes it: a URL (`gs://…`) as it stands, a local path made absolute."""
    path = epath.Path(directory)
    return path if is_url(directory) else path.absolute()


def holds_checkpoints(directory: str | Path) -> bool:
    """Whether `directory` holds a step folder, finished (`<step>`) or interrupted
    (`<step>.orbax-checkpoint-tmp-*`), found without creating the folder."""
    path = checkpoint_path(directory)
    return path.is_dir() and any(child.name.split(".")[0].isdigit() for child in path.iterdir())


def _words(x: jax.Array) -> jax.Array:
    """The array's bytes as uint32 words, one per element (two for an 8-byte element)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    width = x.dtype.itemsize
    if width == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[width]).astype(jnp.uint32)


def _checksum(x: jax.Array) -> jax.Array:
    """Σ w_i·(2i + 1) mod 2³² over the words w_i in row-major order i: any change of one word changes it
    (odd weights are invertible mod 2³²); a change of several goes unseen with a chance of about 2⁻³²."""
    words = _words(x)
    strides = np.cumprod((1,) + words.shape[:0:-1])[::-1] if words.ndim else ()
    index = sum((jax.lax.broadcasted_iota(jnp.uint32, words.shape, d) * jnp.uint32(int(s) % 2**32)
                 for d, s in enumerate(strides)), jnp.uint32(0))  # fmt: skip
    return jnp.sum(words * (2 * index + 1), dtype=jnp.uint32)


@jax.jit
def _verify_values(state: Any) -> tuple[Any, Any]:
    """(checksum, finite) per array of `state`."""
    finite = lambda x: jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)  # noqa: E731
    return jax.tree.map(_checksum, state), jax.tree.map(finite, state)


def _by_path(tree: Any) -> dict[str, Any]:
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _verify(tree: Any, digest: Mapping[str, int], name: str, prefix: str) -> None:
    """Raise ValueError when an array of `tree` (the item `name`) does not match its digest entry
    (keyed `prefix` + its path) or holds NaN/inf."""
    sums, finite = (_by_path(t) for t in jax.device_get(_verify_values(tree)))
    for path, value in sums.items():
        if digest.get(prefix + path) != int(value):
            raise ValueError(f"the array {name}{path} does not match its digest")
        if not finite[path]:
            raise ValueError(f"the array {name}{path} holds NaN or inf")


def checksums(state: Any) -> dict[str, int]:
    """Each array's checksum (`_checksum`), keyed by its path in `state`."""
    return {path: int(value) for path, value in _by_path(jax.device_get(_verify_values(state)[0])).items()}


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` → `{"a.b": 1}`."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """`key: old → new` for every key whose value differs between two config dicts, outside
    `RESUMABLE_CHANGES`."""
    old, new = (_flat(json.loads(json.dumps(config, default=str))) for config in (saved, current))  # as stored
    return [f"{key}: {old.get(key, '(absent)')} → {new.get(key, '(absent)')}" for key in sorted(old.keys() | new.keys())
            if key not in RESUMABLE_CHANGES and old.get(key) != new.get(key)]  # fmt: skip


def _cause(error: BaseException) -> str:
    """One sentence for the log: the root error's type and the first line of its message, cut short."""
    while error.__cause__ is not None:
        error = error.__cause__
    first = (str(error).strip().splitlines() or [""])[0].split(" See full TensorStore details")[0]
    return f"{type(error).__name__}: {first[:200]}{'…' if len(first) > 200 else ''}"


# Checkpoint folders holding a step that failed to restore: late reports of reads there are dropped.
_abandoned_directories: set[str] = set()


def _from_an_abandoned_read(error: BaseException | None) -> bool:
    """Whether `error` is the late report of a read Orbax abandoned: when one array of a restore
    fails, the restore returns while the step's other reads are still in flight, and each later ends
    as an unraisable coroutine or an asyncio task or future nobody awaits (its error raised in
    Orbax's serialization, or a TensorStore error naming the step's folder), or as TensorStore
    calling back into the event loop the restore has closed (printed through `sys.excepthook`)."""
    if error is None:
        return False
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True
    if any(directory in str(error) for directory in _abandoned_directories):
        return True
    tb = error.__traceback__
    while tb is not None:
        if "orbax/checkpoint/_src/serialization" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


class _AbandonedReadFilter(logging.Filter):
    """Drops asyncio's "exception was never retrieved" record for an abandoned read; it is logged
    whenever the task is collected, which may be long after the restore."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and _from_an_abandoned_read(record.exc_info[1]))


def _drop_abandoned_reads(directory: str) -> None:
    """From now on, drop the reports of `_from_an_abandoned_read` under `directory` (they arrive any
    time later, up to the interpreter's exit) and pass every other unraisable or uncaught error and
    every other asyncio record on as before."""
    first = not _abandoned_directories
    _abandoned_directories.add(directory)
    if not first:
        return
    unraisable, excepthook = sys.unraisablehook, sys.excepthook

    def unraisable_hook(report: Any) -> None:
        if not _from_an_abandoned_read(report.exc_value):
            unraisable(report)

    def uncaught_hook(kind: type[BaseException], error: BaseException, tb: Any) -> None:
        if not _from_an_abandoned_read(error):
            excepthook(kind, error, tb)

    sys.unraisablehook, sys.excepthook = unraisable_hook, uncaught_hook
    logging.getLogger("asyncio").addFilter(_AbandonedReadFilter())


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the third-party loggers around a restore attempt, and the asyncio tasks and coroutines
    its failure leaves behind (reported, as unraisable exceptions and warnings, when collected)."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    hook, sys.unraisablehook = sys.unraisablehook, lambda unraisable: None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                yield
            finally:
                gc.collect()
    finally:
        sys.unraisablehook = hook
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `restore_latest` found: the newest readable step, and the newer steps that were not."""

    step: int
    state: Any
    host: dict[str, Any]
    unreadable: tuple[int, ...]  # steps newer than `step`, newest first
    lagged_policy: Any = None  # the `lagged_policy` item, when asked for


class Checkpointer:
    """Save and restore `(state pytree, host dict)` pairs by step under `directory`, each with its
    digests and with `config` (a JSON-able dict: the run's resolved config)."""

    def __init__(self, directory: str | Path, *, config: Mapping[str, Any], keep: int = 3, async_save: bool = True,
                 after_save: Callable[[], object] | None = None):  # fmt: skip
        """`after_save`: called once each save has started (the trainer pushes its other files then)."""
        self.directory = checkpoint_path(directory)
        self.config = dict(config)
        self._after_save = after_save
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        with _quiet():  # Orbax logs each step whose metadata does not parse; `restore_latest` reports it
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._saving: int | None = None  # the step of the last save not yet known to be complete
        _drop_save_error_reports(str(self.directory))

    def save(self, step: int, state: Any, host: dict[str, Any], *, lagged_policy: Any = None) -> None:
        """Start saving (returns before the write finishes when async; `wait` blocks on it). Raises
        when Orbax declines the save (a step >= `step` is already there), and `CheckpointSaveError`
        when this save, or the one before it, failed. `lagged_policy`: the item of that name (module
        docstring), when the run has one."""
        digest = checksums(state)
        items = dict(state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(self.config),
                     host=ocp.args.JsonSave(host))  # fmt: skip
        if lagged_policy is not None:
            digest |= {LAGGED_POLICY + path: value for path, value in checksums(lagged_policy).items()}
            items[LAGGED_POLICY] = ocp.args.StandardSave(lagged_policy)
        items = ocp.args.Composite(**items, digest=ocp.args.JsonSave(digest))
        self.wait()  # Orbax waits for the previous save anyway: its failure is named here, as its own
        self._saving = int(step)
        try:
            saved = self._manager.save(int(step), args=items)
        except Exception as error:
            raise self._failed(error) from error
        if not saved:
            raise RuntimeError(f"checkpoint step {step} was not saved in {self.directory}: "
                               f"step {self._manager.latest_step()} is already there")  # fmt: skip
        if self._after_save is not None:
            self._after_save()

    def _failed(self, error: BaseException) -> CheckpointSaveError:
        step, self._saving = self._saving, None
        return CheckpointSaveError(step, self.directory, _save_cause(error))

    def failure(self) -> CheckpointSaveError | None:
        """The failure of the last save if it has failed, without waiting for one still running."""
        if self._saving is None or self._manager.is_saving_in_progress():
            return None
        try:
            self.wait()
        except CheckpointSaveError as error:
            return error
        return None

    def wait(self) -> None:
        """Block until the last save is complete; `CheckpointSaveError` if it failed."""
        try:
            self._manager.wait_until_finished()
        except Exception as error:
            raise self._failed(error) from error
        self._saving = None

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """(state, host) of `step`; `abstract_state` gives the pytree structure, shapes and shardings.
        Raises ValueError when an array does not match its digest or holds NaN/inf."""
        restored = self._manager.restore(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), digest=ocp.args.JsonRestore(),
            host=ocp.args.JsonRestore()))  # fmt: skip
        _verify(restored["state"], dict(restored["digest"]), "state", "")
        return restored["state"], dict(restored["host"])

    def restore_lagged_policy(self, step: int, abstract: Any) -> Any:
        """The `lagged_policy` item of `step`, verified as `restore` verifies the state."""
        if not (self.directory / str(int(step)) / LAGGED_POLICY).exists():
            raise ValueError(f"step {step} holds no {LAGGED_POLICY} (saved without rollout.policy_lag)")
        restored = self._manager.restore(int(step), args=ocp.args.Composite(
            **{LAGGED_POLICY: ocp.args.StandardRestore(abstract)}, digest=ocp.args.JsonRestore()))  # fmt: skip
        _verify(restored[LAGGED_POLICY], dict(restored["digest"]), LAGGED_POLICY, LAGGED_POLICY)
        return restored[LAGGED_POLICY]

    def saved_config(self, step: int) -> dict[str, Any]:
        """The config `step` was saved under."""
        return dict(self._manager.restore(int(step), args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"])

    def restore_latest(self, abstract_state: Any, *, allow_config_change: bool = False,
                       abstract_lagged_policy: Any = None) -> Restored | None:  # fmt: skip
        """The newest step that restores (with its `lagged_policy` item too when
        `abstract_lagged_policy` is given), or None when there is no step at all. Each unreadable step
        is logged in one line. Raises `ResumeError` when steps exist but none is readable, or when the
        newest step whose config reads was saved under another config (`config_changes`; unless
        `allow_config_change`)."""
        unreadable: list[tuple[int, str]] = []
        compared = allow_config_change
        for step in reversed(self.steps()):
            try:
                with _quiet():
                    if not compared:
                        changes = config_changes(self.saved_config(step), self.config)
                        if changes:
                            raise ResumeError(
                                f"the checkpoints in {self.directory} were saved under another config "
                                f"({'; '.join(changes)}); pass --allow-config-change to resume all the same")
                        compared = True
                    state, host = self.restore(step, abstract_state)
                    lagged_policy = (None if abstract_lagged_policy is None
                                     else self.restore_lagged_policy(step, abstract_lagged_policy))  # fmt: skip
            except ResumeError:
                raise
            except Exception as error:  # noqa: BLE001 — any unreadable step is skipped, in one line
                _drop_abandoned_reads(str(self.directory))
                reshaped = self._shaping_changes(step) if allow_config_change else []
                if reshaped:
                    raise ResumeError(
                        f"checkpoint step {step} in {self.directory} was saved under another model or state "
                        f"({'; '.join(reshaped)}), whose arrays this config's do not fit: pass the run's own values "
                        "of these keys") from None  # fmt: skip
                unreadable.append((step, _cause(error)))
                log.warning("checkpoint step %d in %s is unreadable (%s)", step, self.directory, unreadable[-1][1])
                continue
            return Restored(step, state, host, tuple(s for s, _ in unreadable), lagged_policy)
        if unreadable:
            causes = "; ".join(f"step {s}: {cause}" for s, cause in unreadable)
            raise ResumeError(f"no readable checkpoint in {self.directory} ({causes})")
        return None

    def _shaping_changes(self, step: int) -> list[str]:
        """`config_changes` of `step` in `SHAPING_KEYS` (none when its config does not read either)."""
        try:
            with _quiet():
                saved = self.saved_config(step)
        except Exception:  # noqa: BLE001 — a step whose config does not read is simply unreadable
            return []
        return [change for change in config_changes(saved, self.config) if change.split(":")[0] in SHAPING_KEYS]

    def set_aside(self, steps: tuple[int, ...]) -> None:
        """Rename each of `steps` to `<step>.unreadable` (or `<step>.unreadable-2`, …): out of Orbax's
        sight, so the same steps can be saved again, and kept for whoever wants to look."""
        if not steps:
            return
        if jax.process_index() == 0:  # the directory is shared: one process renames, every one waits
            for step in steps:
                target = free_name(self.directory / str(step), "unreadable")
                (self.directory / str(step)).rename(target)
                log.warning("moved unreadable checkpoint step %d aside to %s", step, target)
        ocp.multihost.sync_global_processes("sao_jax:set_aside")
        with _quiet():
            self._manager.reload()

    def close(self) -> None:
        self.wait()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
