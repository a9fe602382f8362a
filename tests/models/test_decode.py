"""Incremental decoding with the KV cache gives the logits of one full forward over the whole sequence.

The full forward is itself checked against transformers in test_hf_parity.py.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import KVCache, Policy, tiny_glm4_moe

pytestmark = pytest.mark.slow


def _jitted(policy):
    """(full(ids, mask) -> logits, chunk(ids, mask, cache) -> (logits, cache)), compiled per shape."""
    graphdef, state = nnx.split(policy)

    @jax.jit
    def full(ids, mask):
        return nnx.merge(graphdef, state)(ids, attention_mask=mask)

    @jax.jit
    def chunk(ids, mask, cache):
        logits, cache, _ = nnx.merge(graphdef, state).forward(ids, attention_mask=mask, cache=cache)
        return logits, cache

    return full, chunk


def _right_padded(sequences):
    width = max(len(s) for s in sequences)
    ids = np.zeros((len(sequences), width), np.int32)
    mask = np.zeros((len(sequences), width), bool)
    for b, s in enumerate(sequences):
        ids[b, : len(s)], mask[b, : len(s)] = s, True
    return ids, mask


BATCH, MAX_LEN = 3, 16  # every test here uses these, so the compiled functions are shared


@pytest.fixture(scope="module")
def glm_policy():
    return Policy(tiny_glm4_moe(initializer_range=0.3), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def compiled(glm_policy):
    return _jitted(glm_policy)


def test_prefill_decode_observation_decode_matches_full_forward(glm_policy, compiled):
    """Prompts of different lengths (one left-padded), 2 decode steps, an observation chunk of a
    different length per sequence (0 for one of them), 2 more decode steps."""
    full, chunk = compiled
    rng = np.random.default_rng(0)
    prompt_lengths, observation_lengths, decode_steps = [3, 5, 2], [2, 0, 4], 2
    totals = [p + 2 * decode_steps + o for p, o in zip(prompt_lengths, observation_lengths)]
    sequences = [rng.integers(1, 97, n) for n in totals]
    full_ids, full_mask = _right_padded(sequences)
    expected = np.asarray(full(full_ids, full_mask))  # [batch, time, vocab]

    cache = glm_policy.init_cache(batch_size=BATCH, max_len=MAX_LEN)
    done = [0, 0, 0]  # tokens of each sequence fed so far

    def feed(lengths, width, left_pad_rows=()):
        """Feed the next `lengths[b]` tokens of each sequence as one padded chunk of `width`; check
        every real token."""
        nonlocal cache
        ids, mask = np.zeros((3, width), np.int32), np.zeros((3, width), bool)
        for b, n in enumerate(lengths):
            cols = slice(width - n, width) if b in left_pad_rows else slice(0, n)
            ids[b, cols], mask[b, cols] = sequences[b][done[b] : done[b] + n], True
        logits, cache = chunk(ids, mask, cache)
        for b, n in enumerate(lengths):
            cols = slice(width - n, width) if b in left_pad_rows else slice(0, n)
            np.testing.assert_allclose(
                np.asarray(logits)[b, cols], expected[b, done[b] : done[b] + n], rtol=1e-4, atol=1e-5,
                err_msg=f"sequence {b}, tokens {done[b]}..{done[b] + n - 1}",
            )  # fmt: skip
            done[b] += n
        np.testing.assert_array_equal(np.asarray(cache.lengths), done)

    feed(prompt_lengths, width=5, left_pad_rows=(0,))
    for _ in range(decode_steps):
        feed([1, 1, 1], width=1)
    feed(observation_lengths, width=5)  # same width as the prompt chunk: no new compile
    for _ in range(decode_steps):
        feed([1, 1, 1], width=1)
    assert done == totals


def test_token_by_token_decode_matches_full_forward(glm_policy, compiled):
    """From an empty cache, one token per step; finished sequences feed padding (mask 0)."""
    full, chunk = compiled
    rng = np.random.default_rng(1)
    sequences = [rng.integers(1, 97, n) for n in (10, 4, 7)]
    ids, mask = _right_padded(sequences)
    ids[~mask] = -1  # padding ids are ignored, whatever they are
    expected = np.asarray(full(ids, mask))
    cache = KVCache.init(glm_policy.config, batch_size=BATCH, max_len=MAX_LEN)
    for t in range(ids.shape[1]):
        logits, cache = chunk(ids[:, t : t + 1], mask[:, t : t + 1], cache)
        real = mask[:, t]
        np.testing.assert_allclose(np.asarray(logits)[real, 0], expected[real, t], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [10, 4, 7])


def test_left_and_right_padding_give_the_same_logits(compiled):
    """Default positions count real tokens only, so where the padding sits does not matter."""
    full, _ = compiled
    tokens = np.random.default_rng(2).integers(1, 97, (BATCH, 6))
    right_ids, right_mask = np.zeros((BATCH, 10), np.int32), np.zeros((BATCH, 10), bool)
    right_ids[:, :6], right_mask[:, :6] = tokens, True
    left_ids, left_mask = np.zeros((BATCH, 10), np.int32), np.zeros((BATCH, 10), bool)
    left_ids[:, 4:], left_mask[:, 4:] = tokens, True
    right = np.asarray(full(right_ids, right_mask))[:, :6]
    left = np.asarray(full(left_ids, left_mask))[:, 4:]
    np.testing.assert_allclose(left, right, rtol=1e-4, atol=1e-5)


def test_bfloat16_compute_is_close_to_float32():
    """Same float32 parameters (same key), bfloat16 activations: logits agree to bfloat16 precision."""
    policy32 = Policy(tiny_glm4_moe(), rngs=nnx.Rngs(0))
    policy16 = Policy(tiny_glm4_moe(dtype="bfloat16"), rngs=nnx.Rngs(0))
    tokens, mask = np.random.default_rng(3).integers(1, 97, (BATCH, 10)), np.ones((BATCH, 10), bool)
    expected = np.asarray(_jitted(policy32)[0](tokens, mask))
    got = np.asarray(_jitted(policy16)[0](tokens, mask))
    assert got.dtype == np.float32
    relative_error = np.mean(np.abs(got - expected)) / np.mean(np.abs(expected))
    assert relative_error < 0.02, relative_error


def test_shifting_all_positions_leaves_logits_unchanged(glm_policy, compiled):
    """RoPE makes attention depend on position differences only: explicit positions offset by a
    constant give the logits of the default positions."""
    full, _ = compiled
    graphdef, state = nnx.split(glm_policy)
    with_positions = jax.jit(lambda ids, positions: nnx.merge(graphdef, state)(ids, positions=positions))
    tokens = np.random.default_rng(4).integers(1, 97, (BATCH, 10))
    expected = np.asarray(full(tokens, np.ones((BATCH, 10), bool)))
    shifted = np.arange(10)[None, :] + np.array([[0], [7], [100]])
    np.testing.assert_allclose(np.asarray(with_positions(tokens, shifted)), expected, rtol=1e-3, atol=1e-4)
