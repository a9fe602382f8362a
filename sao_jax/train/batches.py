"""Where RL's batches come from: `LockstepBatches` (sync mode, deterministic) and `StreamingBatches`
(async mode, the rollout engine), each with the host state a checkpoint keeps to resume its stream.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax import models
from sao_jax.checkpoint import ResumeError
from sao_jax.rollout.agent_loop import AgentLoop, RolloutService
from sao_jax.rollout.engine import RolloutEngine, WeightStore
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.train.build import RL_STREAM, Run, usable
from sao_jax.train.distributed import ProcessRollouts


class LockstepBatches:
    """Sync mode: RL step s draws `batch_size / G` prompts with rng (seed, s) from the pool and rolls
    each out G = `advantage.group_size` times (members adjacent, each with its own key), in lockstep
    (no thread timing in the result), with the current weights. A group with an environment failure
    is dropped whole (a group baseline needs every member), as the async engine does."""

    def __init__(self, run: Run, rollout_loop: AgentLoop):
        self.run, self.rollout_loop = run, rollout_loop

    def next(self, step: int, weights) -> tuple[list[Trajectory], dict[str, float]]:
        config = self.run.config
        group = config.advantage.group_size
        rng = np.random.default_rng([config.seed, RL_STREAM, step])
        pool = self.run.train_prompts
        prompts = [pool[j] for j in rng.integers(0, len(pool), config.train.batch_size // group) for _ in range(group)]
        key = jax.random.fold_in(jax.random.key(config.seed), step)  # the i-th rollout samples with fold_in(key, i)
        trajectories = self.rollout_loop.rollout((weights, step - 1), prompts, key)
        groups = [trajectories[i:i + group] for i in range(0, len(trajectories), group)]
        failed = [group - len(usable(members)[0]) for members in groups]
        kept = [t for members, f in zip(groups, failed) if not f for t in members]
        discarded = sum(group - f for f in failed if f)  # the survivors of groups that lost a member
        return kept, {"train/env_failed": sum(failed), "train/group_members_discarded": discarded}

    def host_state(self) -> dict[str, Any]:
        """Nothing: the prompts of step s are a function of (seed, s)."""
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
    """

    def __init__(self, run: Run, rollout_loop: AgentLoop | ProcessRollouts, weights, start_step: int,
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
        self.service = RolloutService(local_loop)
        start = self.positions[self.process]
        self.engine = RolloutEngine(
            self.service, (run.train_prompts[self.pool_index(i)] for i in itertools.count(start)), self.store, key,
            num_workers=config.rollout.num_slots, queue_capacity=config.train.queue_capacity,
            max_staleness=config.train.max_staleness, group_size=config.advantage.group_size, start_index=start,
        )  # fmt: skip

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
        batch = self.engine.get_batch(self.run.config.train.batch_size // self.processes)
        position = self.engine.state().next_prompt_index  # above every prompt index in the batch
        for trajectory in batch:  # the engine numbers prompts; baselines key on the pool index
            trajectory.prompt_id = self.pool_index(trajectory.prompt_id)
        blocks = self.cluster.all_gather([(batch, self.engine.metrics(), position)])
        self.positions = [position for _, _, position in blocks]
        batch = [trajectory for block, _, _ in blocks for trajectory in block]
        return batch, async_metrics([engine_metrics for _, engine_metrics, _ in blocks])

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
