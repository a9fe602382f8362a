"""Trajectory record and the bucketed collator."""

import jax
import numpy as np
import pytest

from sao_jax.rollout.trajectory import Trajectory, bucket_length, collate


def make_trajectory(spans, prompt_id=0, version=3):
    """spans: list of (kind, length); kind in prompt/action/observation."""
    kinds = [kind for kind, n in spans for _ in range(n)]
    n = len(kinds)
    action = np.array([k == "action" for k in kinds])
    turn = np.cumsum([k == "action" and (i == 0 or kinds[i - 1] != "action") for i, k in enumerate(kinds)]) - 1
    rewards = np.zeros(n, np.float32)
    rewards[np.flatnonzero(action)[-1]] = 1.0
    return Trajectory(
        tokens=np.arange(1, n + 1, dtype=np.int32),
        action_mask=action,
        rollout_logprobs=np.where(action, -0.5, 0.0).astype(np.float32),
        rollout_entropy=np.where(action, 1.2, 0.0).astype(np.float32),
        policy_version=np.where(action, version, -1).astype(np.int32),
        rewards=rewards,
        turn_index=turn.astype(np.int32),
        prompt_id=prompt_id,
    )


def test_bucket_length_picks_smallest_fit_and_rejects_overflow():
    assert bucket_length(1, (8, 16)) == 8
    assert bucket_length(8, (8, 16)) == 8
    assert bucket_length(9, (16, 8)) == 16
    with pytest.raises(ValueError, match="exceeds the largest bucket 16"):
        bucket_length(17, (8, 16))


def test_mismatched_field_length_is_named():
    t = make_trajectory([("prompt", 2), ("action", 3)])
    with pytest.raises(ValueError, match="rewards has length 2"):
        Trajectory(**{**t.__dict__, "rewards": np.zeros(2)})


def test_collate_pads_tokens_and_rows():
    a = make_trajectory([("prompt", 3), ("action", 4), ("observation", 2), ("action", 2)], prompt_id=7)
    b = make_trajectory([("prompt", 2), ("action", 5)], prompt_id=9, version=4)
    batch = collate([a, b], batch_size=4, buckets=(8, 16, 32))
    assert batch.shape == (4, 16)
    assert batch.valid_mask.sum(axis=1).tolist() == [11, 7, 0, 0]
    assert batch.prompt_id.tolist() == [7, 9, -1, -1]
    np.testing.assert_array_equal(batch.tokens[0, :11], a.tokens)
    np.testing.assert_array_equal(batch.action_mask[1, :7], b.action_mask)
    # padding is never an action, carries no reward and no version
    pad = ~batch.valid_mask
    assert not batch.action_mask[pad].any()
    assert (batch.rewards[pad] == 0).all() and (batch.policy_version[pad] == -1).all()
    assert batch.rewards.sum() == pytest.approx(2.0)


def test_collate_puts_every_field_in_its_own_column_and_pads_with_its_fill():
    a = make_trajectory([("prompt", 3), ("action", 4), ("observation", 2), ("action", 2)], prompt_id=7)
    b = make_trajectory([("prompt", 2), ("action", 5)], prompt_id=9, version=4)
    for offset, t in ((0.0, a), (100.0, b)):  # per-token values that no two fields share
        n = t.num_tokens
        t.rollout_logprobs[:] = -(np.arange(n) + 1 + offset)
        t.rollout_entropy[:] = np.arange(n) + 0.5 + offset
        t.rewards[:] = np.arange(n) * 0.25 + offset
    batch = collate([a, b], batch_size=3, buckets=(16,))
    fills = {"tokens": 0, "action_mask": False, "rollout_logprobs": 0.0, "rollout_entropy": 0.0,
             "policy_version": -1, "rewards": 0.0, "turn_index": -1}  # fmt: skip
    for field, fill in fills.items():
        column = getattr(batch, field)
        for row, t in enumerate((a, b)):
            np.testing.assert_array_equal(column[row, : t.num_tokens], getattr(t, field), err_msg=field)
            assert (column[row, t.num_tokens :] == fill).all(), field
        assert (column[2] == fill).all(), field


def test_collated_batch_is_a_pytree_for_jit():
    batch = collate([make_trajectory([("prompt", 2), ("action", 3)])], buckets=(8,))
    total = jax.jit(lambda b: (b.rewards * b.action_mask).sum())(batch)
    assert float(total) == pytest.approx(1.0)


def test_oldest_version_and_outcome():
    t = make_trajectory([("prompt", 2), ("action", 3), ("observation", 1), ("action", 2)])
    t.policy_version[t.action_mask] = [5, 5, 5, 6, 6]
    assert t.oldest_version == 5
    assert t.outcome_reward == pytest.approx(1.0)


def test_too_many_trajectories_for_batch_size():
    t = make_trajectory([("action", 2)])
    with pytest.raises(ValueError, match="do not fit batch_size=1"):
        collate([t, t], batch_size=1)
