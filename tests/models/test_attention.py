"""`causal_attention` (query blocks over their causal prefix of keys) against a plain numpy softmax
attention and against the full [time, time] einsum attention's gradients; a decode step's cached
attention under the "native_cpu" decode backend (the CPU kernel where it takes the shapes, else
`cached_attention`'s scatter and einsum) against a plain numpy softmax over the first slots of a cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import NamedSharding, PartitionSpec

from sao_jax import native
from sao_jax.models.layers import AttentionLayout, cached_attention, causal_attention, dot_product_attention
from sao_jax.rollout.decode import NativeCpuKernels
from tests.models.test_splash_attention import qkv, reference_attention


@pytest.mark.parametrize("time", [40, 200])  # one block; blocks of 64, 64, 64 and a ragged 8
def test_causal_attention_equals_softmax_over_earlier_real_keys(time):
    q, k, v, mask = qkv(time=time)
    got = causal_attention(q, k, v, AttentionLayout.build(mask, None, None).allowed)
    real = np.asarray(mask)[..., None, None]
    want = reference_attention(q, k, v, mask)
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), rtol=1e-5, atol=1e-5)


def test_causal_attention_gradients_equal_the_full_attention_gradients():
    q, k, v, mask = qkv(time=200)
    allowed = AttentionLayout.build(mask, None, None).allowed
    weights = jax.random.normal(jax.random.key(1), q.shape) * mask[..., None, None]  # real queries only

    def grads(attend):
        loss = lambda q, k, v: jnp.sum(weights * attend(q, k, v, allowed))  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    for got, want in zip(grads(causal_attention), grads(dot_product_attention)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def reference_cached_attention(q, new_k, new_v, cache_k, cache_v, write_slots, num_keys):
    """Plain numpy: the new keys and values written at their slots (dropped past the end; rounded to
    bfloat16 by ml_dtypes for a bfloat16 cache), then query head h of row b attends cache slots
    [0, num_keys[b]) of kv head h // group; 0 where it attends none. Returns (out, keys, values)."""
    caches = []
    for cache, new in ((cache_k, new_k), (cache_v, new_v)):
        cache = np.array(cache)
        for b, slot in enumerate(np.asarray(write_slots)[:, 0]):
            if slot < cache.shape[1]:
                cache[b, slot] = np.asarray(new[b, 0]).astype(cache.dtype)
        caches.append(cache)
    q, k, v = (np.asarray(x, np.float64) for x in (q, *caches))
    batch, _, heads, head_dim = q.shape
    group = heads // k.shape[2]
    out = np.zeros(q.shape)
    for b in range(batch):
        n = int(num_keys[b])
        for h in range(heads):
            if n:
                logits = k[b, :n, h // group] @ q[b, 0, h] / np.sqrt(head_dim)
                p = np.exp(logits - logits.max())
                out[b, 0, h] = (p / p.sum()) @ v[b, :n, h // group]
    return out, *caches


def decode_inputs(batch, slots, heads, kv_heads, head_dim, dtype, seed=0):
    """One query per row, its new key and value, over a cache of `slots` filled with noise (past
    what each row attends too). Returns (q, new k, new v, (cache k, cache v), layout)."""
    ks = jax.random.split(jax.random.key(seed), 5)
    q, new_k, new_v = (jax.random.normal(key, (batch, 1, n, head_dim)) for key, n in
                       zip(ks[:3], (heads, kv_heads, kv_heads)))  # fmt: skip
    cache = tuple(jax.random.normal(key, (batch, slots, kv_heads, head_dim), dtype) for key in ks[3:])
    # row lengths before this token: 0 (a first token), block edges of the kernel (64 slots), full
    lengths = np.resize([0, 63, 64, 127, slots - 1, 5, 1, 100], batch) % slots
    layout = AttentionLayout.build(jnp.ones((batch, 1), bool), jnp.asarray(lengths, jnp.int32), slots)
    return q, new_k, new_v, cache, layout


def check(got, inputs, rtol=2e-5):
    """The kernel's (out, (keys, values)) against `reference_cached_attention`: the caches exactly."""
    q, new_k, new_v, (cache_k, cache_v), layout = inputs
    out, keys, values = reference_cached_attention(q, new_k, new_v, cache_k, cache_v, layout.write_slots,
                                                   layout.num_keys[:, 0])  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got[1][0]), keys)
    np.testing.assert_array_equal(np.asarray(got[1][1]), values)
    np.testing.assert_allclose(got[0], out, rtol=rtol, atol=rtol)


def native_cpu_attention(q, k, v, cache_kv, layout):
    """What `Attention` runs under the "native_cpu" backend's kernels: theirs, or the model's own."""
    return NativeCpuKernels().attention(q, k, v, cache_kv, layout) or cached_attention(q, k, v, cache_kv, layout)


@pytest.fixture(scope="module")
def attend():
    assert native.cached_attention_available()
    return jax.jit(native_cpu_attention)


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, dtype",
    [(4, 2, 64, jnp.float32), (4, 4, 8, jnp.float32), (6, 2, 128, jnp.float32), (8, 1, 16, jnp.float32),
     (4, 2, 64, jnp.bfloat16),
     # a task per kv head: more kv heads than a task takes (8), or query heads wider than its buffers
     (16, 16, 8, jnp.float32), (32, 4, 256, jnp.float32)],
)  # fmt: skip
# The kernel gives a task all of a row's kv heads when there are rows enough for its threads (the
# tests' pool has 8: 64 rows), else one kv head (8 rows).
@pytest.mark.parametrize("batch", [8, 64])
def test_cached_attention_kernel_writes_then_equals_softmax_over_the_first_slots(attend, heads, kv_heads,
                                                                                 head_dim, dtype, batch):  # fmt: skip
    slots = 133  # not a multiple of the kernel's blocks (64) or rows (4)
    inputs = decode_inputs(batch, slots, heads, kv_heads, head_dim, dtype)
    assert "sao_cached_attention" in attend.lower(*inputs).as_text()  # the kernel, not the einsum
    np.testing.assert_array_equal(inputs[-1].num_keys[:8, 0], [1, 64, 65, 128, 133, 6, 2, 101])
    check(attend(*inputs), inputs)


def test_cached_attention_kernel_rounds_to_nearest_even_into_a_bfloat16_cache(attend):
    q, new_k, new_v, cache, layout = decode_inputs(8, 70, 4, 2, 64, jnp.bfloat16, seed=3)
    # halfway cases (ties go to the even neighbour), values just above a tie, infinities and a NaN
    bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x7F7FFFFF, 0xFF800000, 0x7FC00001], np.uint32)
    special = np.resize(bits.view(np.float32), new_k.shape)
    inputs = (q, jnp.asarray(special), jnp.asarray(special), cache, layout)
    _, (keys, _) = attend(*inputs)
    want = jnp.asarray(special).astype(jnp.bfloat16)  # XLA's own convert
    slots = np.asarray(layout.write_slots)[:, 0]
    got = np.asarray(keys)[np.arange(8), slots]
    np.testing.assert_array_equal(got.view(np.uint16), np.asarray(want)[:, 0].view(np.uint16))


def test_cached_attention_kernel_gives_zero_to_a_query_that_attends_nothing(attend):
    q, new_k, new_v, cache, _ = decode_inputs(2, 70, 4, 2, 64, jnp.float32)
    layout = AttentionLayout.build(jnp.array([[True], [False]]), jnp.zeros(2, jnp.int32), 70)  # row 1: padding
    out, (keys, _) = attend(q, new_k, new_v, cache, layout)
    np.testing.assert_allclose(out[0], np.asarray(new_v[0, 0]).repeat(2, axis=0)[None], rtol=1e-6)  # one slot
    np.testing.assert_array_equal(out[1], 0)
    np.testing.assert_array_equal(keys[1], cache[0][1])  # a padding token writes nothing


def test_cached_attention_kernel_on_a_cache_sharded_over_eight_devices(attend):
    inputs = decode_inputs(8, 96, 4, 2, 64, jnp.float32, seed=1)
    rows = NamedSharding(jax.make_mesh((8,), ("data",)), PartitionSpec("data"))
    q, new_k, new_v, cache, layout = inputs
    sharded = jax.device_put((q, new_k, new_v, cache), rows)
    check(attend(*sharded, layout), inputs)


def test_cached_attention_without_the_kernel_runs_the_scatter_and_the_einsum(monkeypatch):
    inputs = decode_inputs(8, 80, 4, 2, 64, jnp.float32, seed=2)
    monkeypatch.setattr(native, "cached_attention_available", lambda: False)
    lowered = jax.jit(native_cpu_attention).lower(*inputs)
    assert "sao_cached_attention" not in lowered.as_text()
    check(lowered.compile()(*inputs), inputs)


def test_cached_attention_with_more_than_eight_query_heads_per_kv_head_runs_the_einsum(attend):
    """The kernel takes at most 8 query heads per kv head; 16 on one kv head fall back to the einsum."""
    inputs = decode_inputs(8, 80, 16, 1, 64, jnp.float32, seed=4)
    assert "sao_cached_attention" not in attend.lower(*inputs).as_text()
    check(attend(*inputs), inputs)


def test_cached_attention_kernel_keeps_its_running_max_across_blocks_of_far_apart_scores(attend):
    """Scores q·k/√d of +100 on the first block of 64 slots and −100 after it: the online softmax must
    rescale by exp(−200) (a running max carried over blocks), never by exp(+200)."""
    q, new_k, new_v, (cache_k, cache_v), _ = decode_inputs(4, 200, 4, 2, 64, jnp.float32, seed=5)
    q = jnp.zeros_like(q).at[..., 0].set(10.0)
    cache_k = jnp.zeros_like(cache_k).at[:, :64, :, 0].set(80.0).at[:, 64:, :, 0].set(-80.0)
    new_k = jnp.zeros_like(new_k).at[..., 0].set(-80.0)
    layout = AttentionLayout.build(jnp.ones((4, 1), bool), jnp.array([149, 70, 130, 199], jnp.int32), 200)
    inputs = (q, new_k, new_v, (cache_k, cache_v), layout)
    out = attend(*inputs)
    assert np.isfinite(np.asarray(out[0])).all()
    check(out, inputs)
