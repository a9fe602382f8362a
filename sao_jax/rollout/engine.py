"""The asynchronous single-rollout engine: prompts in, finished trajectories out, in completion order.

SAO streams each trajectory to the trainer the moment it finishes (group size 1) instead of waiting
for a group; the trainer publishes new weights after every step, and rollouts already running pick
them up between decode chunks, so one trajectory can be sampled by several policy versions.

Pieces
------
`WeightStore`        `publish(params, version)` / `latest() -> (params, version)`: the one place
                     weights cross from the trainer to the rollout.
`RolloutEngine`      `num_workers` threads; each takes one prompt at a time from the prompt source,
                     runs the rollout function and pushes the finished trajectory into a bounded queue
                     (workers block while it is full); `get_batch` hands trajectories out in
                     completion order.

The trainer's async mode (`train.mode=async`) runs this engine; its sync mode rolls out in lockstep
without it (`sao_jax/train/batches.py::LockstepBatches`).

The rollout function (injected; the trainer wires the agent loop in)
--------------------------------------------------------------------
    rollout_fn(prompt, weights, key) -> Trajectory

prompt   one item of the prompt source, passed through untouched.
weights  the engine's `WeightStore`. The rollout calls `weights.latest() -> (params, version)`
         whenever it may switch weights — before its first decode chunk and between chunks — and
         records on each action token the version of the params that sampled it
         (`Trajectory.policy_version`, -1 off actions). It must not publish.
key      a JAX PRNG key, `rollout_key(base_key, prompt_index, member)`; the rollout's only randomness.
returns  a `Trajectory`. The engine replaces its `prompt_id` with the prompt's index (below), so ids
         are unique within a run and shared by the members of a group. Raising, or returning anything
         but a `Trajectory`, is a failed rollout: counted by its message (`error_counts`), recorded in
         `failures` — it costs that trajectory only, never the engine. Nothing is printed per failure
         (the first one's traceback is logged at DEBUG level, `sao_jax.rollout.failures`).
`RolloutEngine` calls it from several threads at once, so it must be thread-safe (JAX dispatch is).

Prompt indices and keys
-----------------------
The i-th prompt drawn from the source (i = 0, 1, …) has index `start_index + i`. Member m
(0 <= m < group_size) of prompt index p is rolled out with key `fold_in(fold_in(base_key, p), m)`, so
a prompt index gets the same key whichever thread runs it, whenever.

Staleness
---------
Measured when `get_batch` takes a trajectory off the queue, against the store at that moment:

    staleness = weights.version − trajectory.oldest_version

`oldest_version` is the smallest `policy_version` over the trajectory's action tokens; a trajectory
without action tokens has staleness 0 (nothing in it is off-policy). A trajectory with
staleness > max_staleness is dropped and counted; every consumed or dropped trajectory adds one to
`staleness_histogram[staleness]`. A group is dropped whole if any member is too stale.
`max_staleness=None` keeps everything.

Group mode (GRPO comparison)
----------------------------
`group_size = n > 1`: every prompt is rolled out n times (members may run on different workers); the
n trajectories enter the queue together once all have finished, and `get_batch` hands out whole
groups, members in order, so `batch_size` must be a multiple of n. If a member fails, its group is
discarded (the survivors are counted in `trajectories_discarded`): a group baseline needs the whole
group. Groups still stream in completion order.

Accounting and resume
---------------------
Every prompt index taken from the source ends in exactly one of: consumed, dropped (stale), failed,
unconsumed (finished, waiting in or for the queue) or in flight (still rolling out). `state()` reports
them, and

    next_prompt_index − start_index == consumed + dropped + failed + len(unconsumed) + len(in_flight).

To resume, checkpoint the prompt source's own state together with `state().next_prompt_index`, and pass
that as `start_index` to the new engine. Unconsumed and in-flight prompts of the old run are not
replayed; their indices are reported (by `close()` too) so the loss is visible.

A dead rollout function
-----------------------
`max_consecutive_failures = n`: once n rollouts in a row have failed (no trajectory finished in
between, in completion order), a `get_batch` that cannot fill its batch raises `RolloutsFailing` with
the counts instead of waiting for trajectories that will never come.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import numbers
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax

from sao_jax.rollout.failures import EnvFailure, log_first_failure
from sao_jax.rollout.trajectory import Trajectory

logger = logging.getLogger(__name__)

RolloutFn = Callable[[Any, "WeightStore", jax.Array], Trajectory]

MAX_RECORDED_FAILURES = 100  # `failures` keeps the most recent ones; the counters stay exact


def _check_version(version: Any) -> int:
    if isinstance(version, bool) or not isinstance(version, numbers.Integral):
        raise TypeError(f"WeightStore version must be an int (got {version!r} of type {type(version).__name__})")
    return int(version)


class WeightStore:
    """The latest published policy weights and their version, shared by the trainer and the rollouts.

    Holds a reference to the params pytree, never a copy: publish a new pytree rather than mutating a
    published one (JAX arrays are immutable, so publishing each step's new params is enough).
    Versions strictly increase; `latest()` returns a (params, version) pair published together.
    """

    def __init__(self, params: Any, version: int = 0):
        self._publish_lock = threading.Lock()
        self._latest = (params, _check_version(version))

    def publish(self, params: Any, version: int) -> None:
        """Make `params` the latest weights; `version` must exceed the current one."""
        version = _check_version(version)
        with self._publish_lock:
            current = self._latest[1]
            if version <= current:
                raise ValueError(
                    f"WeightStore.publish: version {version} is not newer than the published version "
                    f"{current}; versions must strictly increase"
                )
            self._latest = (params, version)

    def latest(self) -> tuple[Any, int]:
        # One tuple swapped by a single assignment, so a reader never sees params of one version
        # with another version's number; no lock needed.
        return self._latest

    @property
    def version(self) -> int:
        return self._latest[1]


def rollout_key(base_key: jax.Array, prompt_index: int, member: int = 0) -> jax.Array:
    """The key of member `member` of prompt `prompt_index`: fold_in(fold_in(base_key, prompt_index), member)."""
    return jax.random.fold_in(jax.random.fold_in(base_key, prompt_index), member)


class RolloutsFailing(RuntimeError):
    """`max_consecutive_failures` rollouts in a row failed: `consecutive` of them, and every failure of
    the engine counted by message (`errors`)."""

    def __init__(self, consecutive: int, errors: collections.Counter):
        super().__init__(f"{consecutive} rollouts in a row failed")
        self.consecutive, self.errors = consecutive, errors


@dataclasses.dataclass(frozen=True)
class RolloutFailure:
    """One failed rollout: which prompt index and group member, and the error it raised."""

    prompt_index: int
    member: int
    error: str


@dataclasses.dataclass(frozen=True)
class EngineState:
    """Where every prompt taken from the source stands (see the module docstring, Accounting)."""

    start_index: int
    next_prompt_index: int  # start_index + prompts taken from the source; resume from here
    prompts_consumed: int
    prompts_dropped: int  # stale
    prompts_failed: int
    unconsumed_indices: tuple[int, ...]  # finished, not yet handed out by get_batch
    in_flight_indices: tuple[int, ...]  # taken, some member still rolling out (or never started)
    threads_alive: int  # worker threads still running; 0 after a clean close()


@dataclasses.dataclass(eq=False)
class _Group:
    """The rollouts of one prompt index: `size` members (1 in streaming mode)."""

    index: int
    prompt: Any
    size: int
    results: dict = dataclasses.field(default_factory=dict)  # member -> Trajectory | RolloutFailure
    members_assigned: int = 0
    finished: bool = False  # every member done, none failed: waiting for the queue or in it

    def add(self, member: int, result: Trajectory | RolloutFailure) -> bool:
        """Record one member's result; True once every member is done."""
        self.results[member] = result
        return len(self.results) == self.size

    @property
    def failed(self) -> bool:
        return any(isinstance(result, RolloutFailure) for result in self.results.values())

    @property
    def trajectories(self) -> list[Trajectory]:
        """Members' trajectories in member order."""
        return [self.results[member] for member in sorted(self.results)]


def _staleness(trajectory: Trajectory, version: int) -> int:
    oldest = trajectory.oldest_version
    return 0 if oldest < 0 else version - oldest


def _run_rollout(rollout_fn: RolloutFn, group: _Group, member: int, weights: WeightStore, base_key: jax.Array):
    """One call of the rollout function; its failure becomes a `RolloutFailure`, never an exception."""
    key = rollout_key(base_key, group.index, member)
    try:
        trajectory = rollout_fn(group.prompt, weights, key)
        if not isinstance(trajectory, Trajectory):
            raise TypeError(f"rollout_fn returned {type(trajectory).__name__}, not a Trajectory")
        return dataclasses.replace(trajectory, prompt_id=group.index)
    except Exception as error:  # counted, never printed per rollout (module docstring)
        log_first_failure(error, f"prompt index {group.index}, member {member}")
        message = str(error) if isinstance(error, EnvFailure) else f"{type(error).__name__}: {error}"
        return RolloutFailure(group.index, member, message)


_EXHAUSTED = object()


def _draw(prompts) -> Any:
    """next(prompts), or _EXHAUSTED; any other error from the source becomes a RuntimeError naming it."""
    try:
        return next(prompts)
    except StopIteration:
        return _EXHAUSTED
    except Exception as error:
        raise RuntimeError(f"the prompt source raised {type(error).__name__}: {error}") from error


class _Ledger:
    """Counters and timings the engine reports (guarded by the engine's lock)."""

    def __init__(self) -> None:
        self.started_s = time.monotonic()
        self.stopped_s: float | None = None
        self.idle_s = 0.0  # time the consumer spent inside get_batch
        self.trajectories_produced = 0
        self.trajectories_failed = 0
        self.trajectories_consumed = 0
        self.trajectories_dropped_stale = 0
        self.trajectories_discarded = 0
        self.action_tokens_produced = 0
        self.prompts_consumed = 0
        self.prompts_dropped = 0
        self.prompts_failed = 0
        self.staleness_histogram: collections.Counter[int] = collections.Counter()
        self.failures: collections.deque[RolloutFailure] = collections.deque(maxlen=MAX_RECORDED_FAILURES)
        self.errors: collections.Counter[str] = collections.Counter()  # every failure, by message
        self.consecutive_failures = 0  # since the last rollout that finished, in completion order

    def record_rollout(self, result: Trajectory | RolloutFailure) -> None:
        if isinstance(result, RolloutFailure):
            self.trajectories_failed += 1
            self.failures.append(result)
            self.errors[result.error] += 1
            self.consecutive_failures += 1
        else:
            self.consecutive_failures = 0
            self.trajectories_produced += 1
            self.action_tokens_produced += int(result.action_mask.sum())

    def record_failed_group(self, group: _Group) -> None:
        self.prompts_failed += 1
        self.trajectories_discarded += sum(isinstance(r, Trajectory) for r in group.results.values())

    def settle(self, group: _Group, version: int, max_staleness: int | None) -> bool:
        """Apply the staleness bound to a finished group at consumption time; True if it is kept."""
        staleness = [_staleness(t, version) for t in group.trajectories]
        self.staleness_histogram.update(staleness)
        keep = max_staleness is None or max(staleness) <= max_staleness
        if keep:
            self.prompts_consumed += 1
            self.trajectories_consumed += group.size
        else:
            self.prompts_dropped += 1
            self.trajectories_dropped_stale += group.size
        return keep

    def metrics(self) -> dict[str, Any]:
        wall_s = max((self.stopped_s or time.monotonic()) - self.started_s, 1e-9)
        return {
            "trajectories_produced": self.trajectories_produced,
            "trajectories_failed": self.trajectories_failed,
            "trajectories_consumed": self.trajectories_consumed,
            "trajectories_dropped_stale": self.trajectories_dropped_stale,
            "trajectories_discarded": self.trajectories_discarded,
            "action_tokens_produced": self.action_tokens_produced,
            "trainer_idle_fraction": min(self.idle_s / wall_s, 1.0),
            "trajectories_per_s": self.trajectories_produced / wall_s,
            "action_tokens_per_s": self.action_tokens_produced / wall_s,
            "staleness_histogram": dict(sorted(self.staleness_histogram.items())),
        }


class RolloutEngine:
    """Asynchronous single-rollout engine: worker threads stream finished trajectories to a bounded queue.

    queue_capacity counts trajectories (a group counts as group_size); a worker whose trajectory
    (group) does not fit blocks until the consumer makes room. Threads start on construction; use
    `with RolloutEngine(...) as engine:` or call `close()`.
    """

    def __init__(
        self,
        rollout_fn: RolloutFn,
        prompts: Iterable[Any],
        weights: WeightStore,
        key: jax.Array,
        *,
        num_workers: int = 2,
        queue_capacity: int = 8,
        group_size: int = 1,
        max_staleness: int | None = None,
        start_index: int = 0,
        max_consecutive_failures: int | None = None,
    ):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1 (got {group_size})")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None (got {max_staleness})")
        if start_index < 0:
            raise ValueError(f"start_index must be >= 0 (got {start_index})")
        if max_consecutive_failures is not None and max_consecutive_failures < 1:
            raise ValueError(f"max_consecutive_failures must be >= 1 or None (got {max_consecutive_failures})")
        self.max_consecutive_failures = max_consecutive_failures
        self._rollout_fn = rollout_fn
        self._prompts = iter(prompts)
        self._weights = weights
        self._key = key
        self.group_size = group_size
        self.max_staleness = max_staleness
        self.start_index = start_index
        self._next_index = start_index
        self._closed = False
        self._ledger = _Ledger()
        self._cond = threading.Condition()  # guards the ledger and the queue state
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 (got {num_workers})")
        if queue_capacity < group_size:
            raise ValueError(f"queue_capacity={queue_capacity} cannot hold one group of group_size={group_size}")
        self.queue_capacity = queue_capacity
        # Lock order: _source_lock before _cond, never the reverse.
        self._source_lock = threading.Lock()  # the prompt source, _open_group and _exhausted
        # self._cond guards everything else below.
        self._open_group: _Group | None = None  # a group some of whose members are not yet assigned
        self._live: dict[int, _Group] = {}  # every prompt taken and not yet consumed, dropped or failed
        self._queue: collections.deque[_Group] = collections.deque()  # finished groups, completion order
        self._queue_depth = 0  # trajectories in _queue
        self._queue_depth_max = 0
        self._workers_blocked = 0
        # Finished groups enter the queue in the order they finished, even when space frees up for
        # several waiting workers at once: each takes a ticket and waits for its turn.
        self._next_ticket = 0
        self._next_admitted = 0
        self._exhausted = False  # the source raised StopIteration
        self._stopping = False
        self._fatal: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._work, name=f"rollout-worker-{i}", daemon=True) for i in range(num_workers)
        ]
        self._workers_running = num_workers  # once 0, no trajectory will arrive any more
        for thread in self._threads:
            thread.start()

    def _check_batch_size(self, batch_size: int) -> None:
        if batch_size < 1 or batch_size % self.group_size:
            raise ValueError(
                f"get_batch: batch_size must be a positive multiple of group_size={self.group_size} (got {batch_size})"
            )
        if self._closed:
            raise RuntimeError("get_batch on a closed rollout engine")

    @property
    def failures(self) -> tuple[RolloutFailure, ...]:
        """The most recent failed rollouts (at most MAX_RECORDED_FAILURES)."""
        with self._cond:
            return tuple(self._ledger.failures)

    def error_counts(self) -> collections.Counter:
        """Every failed rollout so far, counted by its error message."""
        with self._cond:
            return collections.Counter(self._ledger.errors)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- workers -------------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            while (work := self._take()) is not None:
                group, member = work
                result = _run_rollout(self._rollout_fn, group, member, self._weights, self._key)
                self._finish(group, member, result)
        except BaseException as error:  # an engine bug or a broken prompt source: surface it in get_batch
            with self._cond:
                if self._fatal is None:
                    self._fatal = error
        finally:
            with self._cond:
                self._workers_running -= 1
                self._cond.notify_all()

    def _take(self) -> tuple[_Group, int] | None:
        """The next (group, member) to roll out; None once the source is exhausted or the engine stops."""
        with self._source_lock:
            with self._cond:
                if self._stopping or self._fatal is not None:
                    return None
            group = self._open_group
            if group is None:
                if self._exhausted:
                    return None
                prompt = _draw(self._prompts)
                if prompt is _EXHAUSTED:
                    self._exhausted = True
                    return None
                with self._cond:
                    group = _Group(self._next_index, prompt, self.group_size)
                    self._next_index += 1
                    self._live[group.index] = group
                self._open_group = group
            member = group.members_assigned
            group.members_assigned += 1
            if group.members_assigned == group.size:
                self._open_group = None
            return group, member

    def _finish(self, group: _Group, member: int, result: Trajectory | RolloutFailure) -> None:
        with self._cond:
            self._ledger.record_rollout(result)
            if isinstance(result, RolloutFailure):
                self._cond.notify_all()  # a consumer may be waiting to see the failures pile up
            if not group.add(member, result):
                return
            if group.failed:
                self._ledger.record_failed_group(group)
                del self._live[group.index]
                self._cond.notify_all()
                return
            group.finished = True
            ticket = self._next_ticket
            self._next_ticket += 1

            def must_wait() -> bool:
                no_room = self._queue_depth + group.size > self.queue_capacity
                return not self._stopping and (ticket != self._next_admitted or no_room)

            if must_wait():
                self._workers_blocked += 1
                while must_wait():
                    self._cond.wait()
                self._workers_blocked -= 1
            if self._stopping:  # closing: the group stays in _live, reported as unconsumed
                return
            self._queue.append(group)
            self._queue_depth += group.size
            self._queue_depth_max = max(self._queue_depth_max, self._queue_depth)
            self._next_admitted += 1
            self._cond.notify_all()

    # ---- consumer ------------------------------------------------------------------------------

    def get_batch(self, batch_size: int, timeout_s: float | None = None) -> list[Trajectory]:
        """Up to `batch_size` finished trajectories, in completion order (whole groups in group mode).

        Blocks until `batch_size` are ready. Returns fewer only when `timeout_s` passed, the workers
        have all stopped (source exhausted; then an empty list means the end) or the engine is closing.
        Stale trajectories are dropped here (module docstring, Staleness). If a worker hit an error
        outside the rollout function (e.g. the prompt source raised), the other workers finish their
        rollouts, the queue is drained, and then get_batch raises RuntimeError. Once
        `max_consecutive_failures` rollouts in a row have failed, a batch it cannot fill from the queue
        raises `RolloutsFailing` (module docstring).
        """
        self._check_batch_size(batch_size)
        began_s = time.monotonic()
        deadline_s = None if timeout_s is None else began_s + timeout_s
        batch: list[Trajectory] = []
        with self._cond:
            try:
                while len(batch) < batch_size:
                    if self._queue:
                        group = self._queue.popleft()
                        self._queue_depth -= group.size
                        del self._live[group.index]
                        self._cond.notify_all()  # room for a blocked worker
                        if self._ledger.settle(group, self._weights.version, self.max_staleness):
                            batch.extend(group.trajectories)
                        continue
                    if self._stopping:
                        break
                    failing = self._ledger.consecutive_failures
                    if self.max_consecutive_failures is not None and failing >= self.max_consecutive_failures:
                        raise RolloutsFailing(failing, collections.Counter(self._ledger.errors))
                    if self._workers_running == 0:  # source exhausted, or a worker error stopped them all
                        if self._fatal is not None and not batch:
                            message = "the rollout engine stopped after an error in a worker thread"
                            raise RuntimeError(message) from self._fatal
                        break
                    remaining_s = None if deadline_s is None else deadline_s - time.monotonic()
                    if remaining_s is not None and remaining_s <= 0:
                        break
                    self._cond.wait(remaining_s)
            finally:
                self._ledger.idle_s += time.monotonic() - began_s
        return batch

    def metrics(self) -> dict[str, Any]:
        """Queue depth (now, max, capacity), workers blocked on a full queue, counters, rates, histogram."""
        with self._cond:
            return {
                "queue_depth": self._queue_depth,
                "queue_depth_max": self._queue_depth_max,
                "queue_capacity": self.queue_capacity,
                "workers_blocked": self._workers_blocked,
                "prompts_taken": self._next_index - self.start_index,
                **self._ledger.metrics(),
            }

    def state(self) -> EngineState:
        with self._cond:
            return EngineState(
                start_index=self.start_index,
                next_prompt_index=self._next_index,
                prompts_consumed=self._ledger.prompts_consumed,
                prompts_dropped=self._ledger.prompts_dropped,
                prompts_failed=self._ledger.prompts_failed,
                unconsumed_indices=tuple(sorted(i for i, g in self._live.items() if g.finished)),
                in_flight_indices=tuple(sorted(i for i, g in self._live.items() if not g.finished)),
                threads_alive=sum(thread.is_alive() for thread in self._threads),
            )

    def close(self, timeout_s: float = 30.0) -> EngineState:
        """Stop the workers and wait up to `timeout_s` for them; returns the final `state()`.

        Workers take no new prompt; one in the middle of a rollout finishes it (its trajectory is then
        reported unconsumed). Idempotent: calling again waits again for threads still alive.
        """
        with self._cond:
            self._stopping = True
            self._closed = True
            self._cond.notify_all()
        deadline_s = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(deadline_s - time.monotonic(), 0.0))
        if self._ledger.stopped_s is None:
            self._ledger.stopped_s = time.monotonic()
        state = self.state()
        if state.threads_alive:
            logger.warning("rollout engine closed with %d worker thread(s) still running", state.threads_alive)
        if state.unconsumed_indices or state.in_flight_indices:
            logger.info(
                "rollout engine closed with %d unconsumed and %d in-flight prompt(s)",
                len(state.unconsumed_indices),
                len(state.in_flight_indices),
            )
        return state
