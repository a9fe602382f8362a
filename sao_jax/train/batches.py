"""Where RL's batches come from: `LockstepBatches` (sync mode, deterministic) and `StreamingBatches`
(async mode, the rollout engine), each with the host state a checkpoint keeps to resume its stream.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax import models
from sao_jax.checkpoint import ResumeError
from sao_jax.rollout.agent_loop import AgentLoop, RolloutService
from sao_jax.rollout.engine import RolloutEngine, RolloutsFailing, WeightStore
from sao_jax.rollout.failures import DeadEnvironmentError, FailureTally
from sao_jax.rollout.scaffold import ScaffoldLoop
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.train.build import POLICY_LAG_STREAM, RL_STREAM, Run, usable
from sao_jax.train.distributed import ProcessRollouts

log = logging.getLogger(__name__)

MAX_ERROR_MESSAGES = 20  # the distinct error messages a process reports to the others each step


class PolicyLagRing:
    """The policy versions sync mode's lag samples with (`rollout.policy_lag` = L): host copies of the
    weights of the versions before the current one, as far back as L.

    Version v is the policy after RL step v (0: the warm start). `record(v, weights)` keeps a host copy
    of version v and forgets the versions older than v − L; `weights(v)` is version v placed as the
    trainer's weights are (`place`: the run's `Cluster.place` on a mesh, else onto the default device).
    A checkpoint after step s holds the L versions s − L … s − 1, each clamped at 0 (`saved`: the
    versions steps s + 1 … s + L may sample with, the current one s being the state's own), and a
    resumed run starts from them (`restored`), so it samples with what the uninterrupted run did.
    """

    def __init__(self, lag: int, place: Callable[[Any], Any] = jax.device_put):
        if jax.process_count() > 1:
            raise ValueError("rollout.policy_lag > 0 keeps its weight versions on one host: run it as one process")
        self.lag, self.place = lag, place
        self.versions: dict[int, Any] = {}

    def record(self, version: int, weights) -> None:
        if version not in self.versions:
            self.versions[version] = jax.device_get(weights)  # a copy: the next step donates the state's buffers
        self.versions = {v: w for v, w in self.versions.items() if v >= version - self.lag}

    def weights(self, version: int):
        return self.place(self.versions[version])

    def saved_versions(self, step: int) -> list[int]:
        """The versions a checkpoint after RL step `step` holds: step − L … step − 1, clamped at 0."""
        return [max(v, 0) for v in range(step - self.lag, step)]

    def saved(self, step: int, weights) -> list[Any]:
        """The checkpoint's part after RL step `step`; `weights`, the current version's, are read at
        step 0 only, where every saved version is the warm start."""
        versions = {0: jax.device_get(weights)} if step == 0 else self.versions
        return [versions[v] for v in self.saved_versions(step)]

    @classmethod
    def restored(cls, lag: int, step: int, saved: list[Any], place: Callable[[Any], Any] = jax.device_put
                 ) -> PolicyLagRing:  # fmt: skip
        """The ring of a run resumed after RL step `step` from the checkpoint's part `saved`."""
        ring = cls(lag, place)
        ring.versions = {v: jax.device_get(w) for v, w in zip(ring.saved_versions(step), saved)}
        return ring


class LockstepBatches:
    """Sync mode: RL step s draws `batch_size / G` prompts with rng (seed, s) from the pool and rolls
    each out G = `advantage.group_size` times (members adjacent, each with its own key), in lockstep
    (no thread timing in the result), with the current weights. A group with an environment failure
    is dropped whole (a group baseline needs every member), as the async engine does. `errors`: every
    failed rollout so far, by message; `step_errors`: those of the last step.

    With `rollout.policy_lag` = L > 0 (a `PolicyLagRing`), trajectory i of step s samples with the
    weights of version max(s − 1 − ℓ_i, 0): ℓ_i = L (`policy_lag_spread: fixed`), or drawn uniformly
    from 0..L with rng (seed, POLICY_LAG_STREAM, s) (`uniform`); each version's trajectories are one
    rollout call, each keeping its key fold_in(key, i). Its staleness, (s − 1) − the version, is
    logged as the async engine's is (`async/staleness_mean`, the mean over the step's trajectories).
    """

    def __init__(self, run: Run, rollout_loop: AgentLoop, ring: PolicyLagRing | None = None):
        self.run, self.rollout_loop, self.ring = run, rollout_loop, ring
        self.errors, self.step_errors = FailureTally(), FailureTally()

    def next(self, step: int, weights) -> tuple[list[Trajectory], dict[str, float]]:
        config = self.run.config
        group = config.advantage.group_size
        rng = np.random.default_rng([config.seed, RL_STREAM, step])
        pool = self.run.train_prompts
        prompts = [pool[j] for j in rng.integers(0, len(pool), config.train.batch_size // group) for _ in range(group)]
        key = jax.random.fold_in(jax.random.key(config.seed), step)  # the i-th rollout samples with fold_in(key, i)
        current = step - 1
        if self.ring is None:
            trajectories = self.rollout_loop.rollout((weights, current), prompts, key)
        else:
            self.ring.record(current, weights)
            versions = np.maximum(current - self.lags(step, len(prompts)), 0)
            trajectories = [None] * len(prompts)
            for version in sorted(set(versions.tolist())):
                chosen = np.flatnonzero(versions == version).tolist()
                sampler_weights = weights if version == current else self.ring.weights(version)
                done = self.rollout_loop.rollout((sampler_weights, version), [prompts[i] for i in chosen], key,
                                                 indices=chosen)  # fmt: skip
                for i, trajectory in zip(chosen, done):
                    trajectories[i] = trajectory
        groups = [trajectories[i:i + group] for i in range(0, len(trajectories), group)]
        failed = [group - len(usable(members)[0]) for members in groups]
        self.step_errors = FailureTally(t.info["error"] for t in trajectories if t.info.get("error") is not None)
        self.errors.update(self.step_errors.counts.elements())
        kept = [t for members, f in zip(groups, failed) if not f for t in members]
        discarded = sum(group - f for f in failed if f)  # the survivors of groups that lost a member
        staleness = [0 if t.oldest_version < 0 else current - t.oldest_version for t in kept]  # as RolloutEngine's
        return kept, {"train/env_failed": sum(failed), "train/group_members_discarded": discarded,
                      "async/staleness_mean": float(np.mean(staleness)) if staleness else 0.0}  # fmt: skip

    def lags(self, step: int, count: int) -> np.ndarray:
        """Each of the step's `count` trajectories' lag ℓ_i (before the clamp at the warm start)."""
        config = self.run.config.rollout
        if config.policy_lag_spread == "fixed":
            return np.full(count, config.policy_lag)
        return np.random.default_rng([self.run.config.seed, POLICY_LAG_STREAM, step]).integers(
            0, config.policy_lag + 1, count)

    def host_state(self) -> dict[str, Any]:
        """Nothing: the prompts of step s are a function of (seed, s), and the lag's weight versions
        are a checkpoint item of their own (`PolicyLagRing.saved`)."""
        return {}

    def close(self) -> int:
        """Nothing to stop: no rollout outlives its step (0 dropped)."""
        return 0


class StreamingBatches:
    """Async mode: the rollout engine streams rollouts as they finish — single ones (SAO), or whole
    groups of G = `advantage.group_size` (members adjacent; a group with a failed or too-stale member
    is dropped whole); weights are published after every step and picked up by running rollouts
    between decode chunks.

    With P processes each runs its own engine on its own devices, with a local replica of the
    weights (`Cluster.local_replica`), over its own prompt stream (its i-th prompt is draw i·P + p
    of the pool), and contributes `batch_size / P` trajectories a step; the blocks are exchanged in
    process order, so every process trains on the same batch, and the engines' counters are summed
    (the trainer's idle fraction averaged), so every process logs the same metrics. Only the trainer thread talks to
    the other processes, once a step; the engines' threads run local computations only.

    Resume: `host_state()` holds each process's stream position after the last batch (every prompt
    it trained on has a smaller index), and an engine built with that `host` starts there, so a
    resumed run draws the prompts the interrupted one had not trained on yet, from where it was, with
    the same keys (a prompt index's key depends on the seed and the index only). Prompts in flight
    when the checkpoint was saved are not replayed.

    A dead environment: once `train.max_steps_without_data` steps' worth of rollouts in a row have
    failed on a process (`RolloutEngine.max_consecutive_failures`), `next` raises
    `DeadEnvironmentError` on every process (the processes agree through the same exchange as the
    batches), instead of waiting for a batch that never fills. `errors`: every process's failed
    rollouts so far, by message.
    """

    def __init__(self, run: Run, rollout_loop: AgentLoop | ScaffoldLoop | ProcessRollouts, weights, start_step: int,
                 host: dict[str, Any]):  # fmt: skip
        config = run.config
        self.run, self.cluster = run, run.cluster
        self.process, self.processes = jax.process_index(), jax.process_count()
        if config.train.batch_size % self.processes:
            raise ValueError(f"train.batch_size={config.train.batch_size} must be a multiple of the {self.processes} "
                             "processes: each contributes the same number of trajectories a step")  # fmt: skip
        key = jax.random.fold_in(jax.random.key(config.seed), RL_STREAM)  # the key of prompt index p: fold_in(key, p)
        if self.processes > 1:
            key = jax.random.fold_in(key, self.process)
        positions = host.get("prompt_index", [0] * self.processes)
        if len(positions) != self.processes:
            raise ResumeError(f"the checkpoint holds the prompt streams of {len(positions)} processes; this run has "
                              f"{self.processes}")  # fmt: skip
        self.positions = list(positions)
        self.store = WeightStore(self._local(weights), version=start_step)
        local_loop = rollout_loop.loop if isinstance(rollout_loop, ProcessRollouts) else rollout_loop
        # A scaffold loop is itself a thread-safe rollout function; the agent loop is shared through a service.
        self.service = local_loop if isinstance(local_loop, ScaffoldLoop) else RolloutService(local_loop)
        start = self.positions[self.process]
        self.per_step = config.train.batch_size // self.processes  # this process's trajectories a step
        self.engine = RolloutEngine(
            self.service, (run.train_prompts[self.pool_index(i)] for i in itertools.count(start)), self.store, key,
            num_workers=config.rollout.num_slots, queue_capacity=config.train.queue_capacity,
            max_staleness=config.train.max_staleness, group_size=config.advantage.group_size, start_index=start,
            max_consecutive_failures=config.train.max_steps_without_data * self.per_step,
        )  # fmt: skip
        self.errors, self.step_errors = FailureTally(), FailureTally()  # step_errors: nothing, `next` raises

    def _local(self, weights):
        """The trainer's weights for this process's sampler: a copy (the next step donates the state's
        buffers), gathered whole onto this process's devices when the state lives on a mesh, with the
        weights the forward computes in bfloat16 stored so (`models.compute_dtype_weights`)."""
        weights = models.compute_dtype_weights(weights, self.run.policy.config)
        return _copy(weights) if self.cluster.mesh is None else self.cluster.local_replica(weights)

    def pool_index(self, prompt_index: int) -> int:
        """The pool entry of this process's `prompt_index`-th prompt."""
        config = self.run.config
        draw = prompt_index * self.processes + self.process
        return int(np.random.default_rng([config.seed, RL_STREAM, draw]).integers(len(self.run.train_prompts)))

    def next(self, step: int, weights) -> tuple[list[Trajectory], dict[str, float]]:
        if step - 1 > self.store.version:
            self.store.publish(self._local(weights), step - 1)  # the trainer's weights after step − 1
        try:
            batch, failing = self.engine.get_batch(self.per_step), None
        except RolloutsFailing as stalled:  # told to every process below, so that all of them stop
            batch, failing = [], stalled.consecutive
        position = self.engine.state().next_prompt_index  # above every prompt index in the batch
        for trajectory in batch:  # the engine numbers prompts; baselines key on the pool index
            trajectory.prompt_id = self.pool_index(trajectory.prompt_id)
        errors = dict(self.engine.error_counts().most_common(MAX_ERROR_MESSAGES))
        blocks = self.cluster.all_gather([(batch, self.engine.metrics(), position, failing, errors)])
        self.positions = [block[2] for block in blocks]
        self.errors = FailureTally()
        for block in blocks:
            self.errors.counts.update(block[4])
        failing = [block[3] for block in blocks if block[3] is not None]
        if failing:
            bound = self.run.config.train.max_steps_without_data
            raise DeadEnvironmentError(
                f"RL step {step} got no usable batch: {max(failing)} rollouts in a row failed, "
                f"train.max_steps_without_data={bound} steps' worth ({self.per_step} a step"
                f"{' and process' if self.processes > 1 else ''}); the environment failed {self.errors.total} "
                f"rollouts in all, {self.errors.describe()}")  # fmt: skip
        batch = [trajectory for block in blocks for trajectory in block[0]]
        return batch, async_metrics([block[1] for block in blocks])

    def host_state(self) -> dict[str, Any]:
        """Each process's next prompt index after the last batch (the checkpoint's part of the stream)."""
        return {"prompt_index": self.positions}

    def close(self) -> int:
        """Stop the engine's workers (each finishes the rollout in hand) and the rollout service;
        returns the number of prompts finished but unused or still in flight, which a run resumed
        from the last checkpoint does not replay."""
        state = self.engine.close()
        self.service.close()
        return len(state.unconsumed_indices) + len(state.in_flight_indices)


def async_metrics(per_process: list[dict]) -> dict[str, float]:
    """The run's async metrics from each process's `RolloutEngine.metrics()`: counts and rates summed,
    the trainer's idle fraction averaged over processes, the staleness averaged over every trajectory."""

    def total(name):
        return sum(m[name] for m in per_process)

    histogram = collections.Counter()
    for m in per_process:
        histogram.update(m["staleness_histogram"])
    seen = sum(histogram.values())
    return {
        "async/queue_depth": total("queue_depth"),
        "async/trainer_idle_fraction": total("trainer_idle_fraction") / len(per_process),
        "async/trajectories_per_s": total("trajectories_per_s"),
        "async/action_tokens_per_s": total("action_tokens_per_s"),
        "async/dropped_stale": total("trajectories_dropped_stale"),
        "async/staleness_mean": sum(k * v for k, v in histogram.items()) / max(seen, 1),
        "train/env_failed": total("trajectories_failed"),
        "train/group_members_discarded": total("trajectories_discarded"),
    }


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)
