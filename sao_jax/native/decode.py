"""What the sampler's `native_cpu` decode backend (`sao_jax.rollout.decode`) runs instead of XLA:CPU's
own lowering: the calls into this folder's decode kernels, what shapes and dtypes each takes, the
weight layout the experts' kernel reads, a written-out threefry, and the compiler options of the
decode programs. Nothing here is used on other platforms, nor outside a decode.

Each `*_takes` says whether a kernel handles these shapes and dtypes; whether it could be built is
`sao_jax.native.*_available()`. The kernels have no gradients: a decode never differentiates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sao_jax import native

# XLA:CPU's YNNPACK dot fusions are off in the decode programs: a decode step's few-row matmuls
# (32 × 256 · 256 × 1024) run slower with them than with XLA's own dot emitter (benchmarks/RESULTS.md).
COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def cached_attention_takes(num_heads: int, kv_heads: int, head_dim: int, cache_dtype) -> bool:
    """Whether `cached_attention` takes a cache of this dtype and these heads: float32 or bfloat16, at
    most 8 query heads per kv head, head_dim a multiple of 8 and at most 256."""
    return (jnp.dtype(cache_dtype) in (jnp.float32, jnp.bfloat16) and num_heads // kv_heads <= 8
            and head_dim % 8 == 0 and head_dim <= 256)  # fmt: skip


def cached_attention(q, k, v, write_slots, num_keys, cache_k, cache_v):
    """A decode step's `layers.write_cache` of k, v [batch, 1, kv_heads, head_dim] at `write_slots`
    into the caches [batch, slots, kv_heads, head_dim], then `layers.dot_product_attention` of q
    [batch, 1, heads, head_dim] over cache slots [0, num_keys), by `cached_attention_cpu.cc`, in place
    on the caches: it writes only the new slots (XLA:CPU scatters into a bfloat16 cache by converting
    all of it to float32 and back) and reads each slot a query attends once, in the cache's layout
    (the einsum makes XLA:CPU copy every layer's whole K and V into the layouts of its batched dots).
    The same numbers up to float rounding, except that a query attending no slot (a row never fed,
    whose output nothing reads) gets 0 instead of the einsum's average over all slots.
    Returns (out, cache_k, cache_v)."""
    if not native.cached_attention_available():  # builds and registers the kernel
        raise RuntimeError("cached_attention: the CPU kernel is unavailable (logged why)")
    results = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(cache_k.shape, cache_k.dtype),
               jax.ShapeDtypeStruct(cache_v.shape, cache_v.dtype))  # fmt: skip
    call = jax.ffi.ffi_call(native.CACHED_ATTENTION_TARGET, results, input_output_aliases={5: 1, 6: 2},
                            vmap_method="sequential")  # fmt: skip
    dtype = q.dtype
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    out, cache_k, cache_v = call(q, k, v, write_slots.astype(jnp.int32), num_keys.astype(jnp.int32), cache_k, cache_v)
    return out.astype(dtype), cache_k, cache_v


# The most rows `few_rows_matmul` takes: beyond it XLA:CPU's own dots are the faster
# (benchmarks/RESULTS.md, the sampler section).
FEW_ROWS = 32


def few_rows_matmul_takes(rows: int, depth: int, width: int, dtype) -> bool:
    """Whether `few_rows_matmul` takes x [rows, depth] · w [depth, width] of this dtype: float32, at
    most `FEW_ROWS` rows, depth a multiple of 4 and width of 16."""
    return rows <= FEW_ROWS and jnp.dtype(dtype) == jnp.float32 and depth % 4 == 0 and width % 16 == 0


def few_rows_matmul(x, w):
    """x [rows, depth] · w [depth, width] by `few_rows_matmul_cpu.cc`: each 8 rows × 16 columns of the
    product summed in registers down the whole depth (XLA:CPU's dots run these few rows well below
    its matmul peak). The same numbers as `x @ w` up to float rounding."""
    if not native.few_rows_matmul_available():  # builds and registers the kernel
        raise RuntimeError("few_rows_matmul: the CPU kernel is unavailable (logged why); use x @ w")
    call = jax.ffi.ffi_call(native.FEW_ROWS_MATMUL_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32),
                            vmap_method="sequential")  # fmt: skip
    return call(x, w)


def routed_swiglu_takes(dtype, embed: int, mlp: int) -> bool:
    """Whether `routed_swiglu_packed` takes tokens and expert weights of this dtype and these widths:
    float32, embed and mlp multiples of 16."""
    return jnp.dtype(dtype) == jnp.float32 and embed % 16 == 0 and mlp % 16 == 0


def pack_experts(gate_proj, up_proj, down_proj):
    """The experts' weights laid out for `routed_swiglu_packed`: [experts, 3 · embed · mlp], per
    expert G, U then D, each [depth, width] matrix stored as [width / 16][depth][16] so that a
    16-column strip's weights are contiguous (the kernel reads them in memory order)."""

    def strips(w):  # [experts, depth, width] → [experts, width / 16 · depth · 16]
        experts, depth, width = w.shape
        return w.reshape(experts, depth, width // 16, 16).transpose(0, 2, 1, 3).reshape(experts, -1)

    return jnp.concatenate([strips(gate_proj), strips(up_proj), strips(down_proj)], axis=1)


def routed_swiglu_packed(x, expert_ids, weights, packed):
    """out_t = Σ_j w_{t,j} · SwiGLU_{expert_ids[t,j]}(x_t), dropless, for x [tokens, embed], by
    `expert_swiglu_cpu.cc` on the weights of `pack_experts`: each chosen expert's weights read once,
    for its tokens only, a strip of 16 columns at a time in memory order. The same numbers as
    `moe.dense_dispatch` up to float rounding; an id outside [0, experts) adds 0."""
    if not native.expert_swiglu_available():  # builds and registers the kernel
        raise RuntimeError("routed_swiglu_packed: the CPU kernel is unavailable (logged why)")
    call = jax.ffi.ffi_call(native.EXPERT_SWIGLU_PACKED_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32),
                            vmap_method="sequential")  # fmt: skip
    return call(x, expert_ids.astype(jnp.int32), weights.astype(jnp.float32), packed)


_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry2x32(k1, k2, x1, x2):
    """Threefry-2x32 with 20 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
    SC 2011): the counter (x1, x2) hashed under the key (k1, k2), uint32 arrays of one shape. Rounds
    rotate by 13, 15, 26, 6 then 17, 29, 16, 24; after every fourth the key words are injected in turn
    from (k1, k2, k1 ^ k2 ^ 0x1BD11BDA), plus the injection's number."""
    key_words = (k1, k2, k1 ^ k2 ^ jnp.uint32(0x1BD11BDA))
    x1, x2 = x1 + key_words[0], x2 + key_words[1]
    for injection in range(1, 6):
        for r in _THREEFRY_ROTATIONS[(injection - 1) % 2]:
            x1 = x1 + x2
            x2 = x1 ^ ((x2 << jnp.uint32(r)) | (x2 >> jnp.uint32(32 - r)))
        x1 = x1 + key_words[injection % 3]
        x2 = x2 + key_words[(injection + 1) % 3] + jnp.uint32(injection)
    return x1, x2


def slot_uniforms(keys: jax.Array, slots: jax.Array) -> jax.Array:
    """u[b] = `jax.random.uniform(jax.random.fold_in(keys[b], slots[b]), ())`, bit for bit
    (`sao_jax.rollout.decode.slot_uniforms`): float32 in [0, 1). keys: typed PRNG keys [batch];
    slots: int [batch].

    For threefry keys (JAX's default) the two hashes — fold_in's, then the uniform's bits — are
    written out here: XLA:CPU lowers JAX's threefry as a 5-iteration while loop, and those two loops
    and their copies take much of a decode step's sampling time (benchmarks/RESULTS.md). The same
    numbers as JAX's: fold_in(k, d) hashes the counter (0, d) under k; a uniform of shape () hashes
    (0, 0) under that key and takes the high 23 bits of the two words' XOR as the mantissa of a float
    in [1, 2), minus 1. Other key implementations, and `jax_threefry_partitionable` off (other bits),
    take `jax.random` itself."""
    if str(jax.random.key_impl(keys)) != "threefry2x32" or not jax.config.jax_threefry_partitionable:
        return jax.vmap(lambda key, slot: jax.random.uniform(jax.random.fold_in(key, slot), ()))(keys, slots)
    data = jax.random.key_data(keys)
    zeros = jnp.zeros(slots.shape, jnp.uint32)
    k1, k2 = _threefry2x32(data[..., 0], data[..., 1], zeros, slots.astype(jnp.uint32))
    bits1, bits2 = _threefry2x32(k1, k2, zeros, zeros)
    mantissa = (bits1 ^ bits2) >> jnp.uint32(9)
    return jax.lax.bitcast_convert_type(mantissa | jnp.uint32(0x3F800000), jnp.float32) - 1.0
