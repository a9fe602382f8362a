"""One agentic trajectory `prompt ‖ a_0 ‖ o_0 ‖ a_1 ‖ … ‖ a_n`, and the collator that batches them.

A `Trajectory` is host-side (numpy) and per token: what the rollout engine knows when a trajectory
finishes. A `TrajectoryBatch` is the padded `[batch, time]` pytree the jitted training steps consume.
Lengths are padded up to a few bucket sizes so the steps compile once per bucket, not once per length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import struct


@dataclasses.dataclass
class Trajectory:
    """Per-token record of one rollout; every array has shape `[num_tokens]`.

    tokens            token ids of prompt, actions and observations in order
    action_mask       True where the policy sampled the token (action spans)
    rollout_logprobs  log μ(token) of the distribution the sampler actually drew from; 0 off actions
    rollout_entropy   full-vocabulary entropy of that distribution; 0 off actions
    policy_version    weights version that sampled each action token; -1 off actions
    rewards           per-token reward (the outcome reward sits on the last action token)
    turn_index        which action/observation pair a token belongs to; -1 for the prompt
    prompt_id         the prompt this trajectory answers (group mode: shared by the group)
    info              environment facts: errors, truncation, the answer text, judge outputs …
    """

    tokens: np.ndarray
    action_mask: np.ndarray
    rollout_logprobs: np.ndarray
    rollout_entropy: np.ndarray
    policy_version: np.ndarray
    rewards: np.ndarray
    turn_index: np.ndarray
    prompt_id: int
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for field in ("action_mask", "rollout_logprobs", "rollout_entropy", "policy_version", "rewards", "turn_index"):
            if len(getattr(self, field)) != n:
                raise ValueError(f"Trajectory.{field} has length {len(getattr(self, field))}, tokens has {n}")

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def outcome_reward(self) -> float:
        return float(np.sum(self.rewards))

    @property
    def oldest_version(self) -> int:
        """The oldest policy version that sampled any action token (staleness is measured from it)."""
        versions = self.policy_version[self.action_mask]
        return int(versions.min()) if versions.size else -1


@struct.dataclass
class TrajectoryBatch:
    """`[batch, time]` arrays for the training steps; padding rows/tokens have `valid_mask` False."""

    tokens: Any
    action_mask: Any
    valid_mask: Any
    rollout_logprobs: Any
    rollout_entropy: Any
    policy_version: Any
    staleness: Any  # versions between the trainer's and the one that sampled the token; 0 off actions
    rewards: Any
    turn_index: Any
    prompt_id: Any  # [batch]; -1 for padding rows

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)


DEFAULT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


def bucket_length(length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """The smallest bucket that holds `length` tokens; an error past the largest."""
    for bucket in sorted(buckets):
        if length <= bucket:
            return bucket
    raise ValueError(f"trajectory of {length} tokens exceeds the largest bucket {max(buckets)}")


def collate(
    trajectories: Sequence[Trajectory],
    *,
    batch_size: int | None = None,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    pad_id: int = 0,
    trainer_version: int | None = None,
) -> TrajectoryBatch:
    """Right-pad trajectories to one bucketed length and, if given, `batch_size` rows.

    Padding tokens are invalid, non-action, reward 0, log-prob and entropy 0, version and turn −1;
    padding rows have `prompt_id = -1`. `staleness` = `trainer_version` − `policy_version` on action
    tokens (the version the batch is trained from; None: every token is the trainer's own, staleness 0).
    """
    if not trajectories:
        raise ValueError("collate needs at least one trajectory")
    rows = batch_size if batch_size is not None else len(trajectories)
    if len(trajectories) > rows:
        raise ValueError(f"{len(trajectories)} trajectories do not fit batch_size={rows}")
    time = bucket_length(max(t.num_tokens for t in trajectories), buckets)

    def stack(field: str, dtype: Any, fill: Any) -> np.ndarray:
        out = np.full((rows, time), fill, dtype)
        for i, traj in enumerate(trajectories):
            out[i, : traj.num_tokens] = getattr(traj, field)
        return out

    valid = np.zeros((rows, time), bool)
    for i, traj in enumerate(trajectories):
        valid[i, : traj.num_tokens] = True
    prompt_ids = np.full((rows,), -1, np.int32)
    prompt_ids[: len(trajectories)] = [t.prompt_id for t in trajectories]
    action_mask, policy_version = stack("action_mask", bool, False), stack("policy_version", np.int32, -1)
    staleness = np.zeros((rows, time), np.int32)
    if trainer_version is not None:
        staleness = np.where(action_mask, trainer_version - policy_version, 0).astype(np.int32)
    return TrajectoryBatch(
        tokens=stack("tokens", np.int32, pad_id),
        action_mask=action_mask,
        valid_mask=valid,
        rollout_logprobs=stack("rollout_logprobs", np.float32, 0.0),
        rollout_entropy=stack("rollout_entropy", np.float32, 0.0),
        policy_version=policy_version,
        staleness=staleness,
        rewards=stack("rewards", np.float32, 0.0),
        turn_index=stack("turn_index", np.int32, -1),
        prompt_id=prompt_ids,
    )
