"""Building blocks of the decoder: parameters with logical axes, RMSNorm, RoPE, GQA attention, KV cache,
and `DecodeKernels`, the hook through which a caller runs some of a forward's operations its own way.

Every parameter carries its logical axis names as `out_sharding` metadata ("vocab", "embed", "heads",
"kv_heads", "head_dim", "mlp", "expert", or None = replicated); `sao_jax.models.sharding` maps them to
mesh axes. Parameters are created with `eager_sharding=False`, so building a model needs no mesh.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models.config import ModelConfig
from sao_jax.models.sharding import active_mesh_and_rules, logical_to_spec

# Additive mask value for disallowed attention logits: finite, so a fully masked row (a padding query)
# gives a uniform softmax instead of NaN.
_MASKED_LOGIT = -1e30


def param(value: jax.Array, axes: Sequence[str | None]) -> nnx.Param:
    """A trained parameter annotated with one logical axis name per dimension."""
    if len(axes) != value.ndim:
        raise ValueError(f"{len(axes)} logical axes {tuple(axes)} for a parameter of shape {value.shape}")
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def normal_param(rngs: nnx.Rngs, shape, axes, config: ModelConfig) -> nnx.Param:
    """N(0, initializer_range²) initialisation, as the Hugging Face models do for Linear/Embedding."""
    value = config.initializer_range * jax.random.normal(rngs.params(), shape, jnp.float32)
    return param(value.astype(config.weight_dtype), axes)


def zeros_param(shape, axes, config: ModelConfig) -> nnx.Param:
    return param(jnp.zeros(shape, config.weight_dtype), axes)


class RMSNorm(nnx.Module):
    """y = scale · x / sqrt(mean(x²) + eps), normalised in float32 (as HF), then cast back."""

    def __init__(self, size: int, config: ModelConfig):
        self.scale = param(jnp.ones((size,), config.weight_dtype), (None,))
        self.eps = config.rms_norm_eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.scale[...] * normed.astype(x.dtype)).astype(x.dtype)


def rope_angles(positions: jax.Array, *, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """(cos a, sin a) of the rotary angles a_i = position · theta^(-2i/rotary_dim), i < rotary_dim/2:
    float32 [..., rotary_dim/2] from int positions [...]. A forward computes them once for all its
    layers (`KVCache` keeps them as a table for its slots)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary position embedding on the first rotary_dim = 2 · cos.shape[-1] dims of each head
    ("rotate half" layout). With x = [x1, x2, x_pass] (x1, x2 the two halves of the rotated part):
      y = [x1 cos a − x2 sin a,  x2 cos a + x1 sin a,  x_pass]
    x: [batch, time, heads, head_dim]; cos, sin: `rope_angles`. Computed in float32.
    """
    half = cos.shape[-1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half : 2 * half].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return jnp.concatenate([rotated, x[..., 2 * half :]], axis=-1)


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for incremental decoding, and how many slots each sequence fills.

    keys[l], values[l]: [batch, max_len, kv_heads, head_dim] (after q/k norm and RoPE).
    lengths: int32 [batch], slots 0..lengths[b]-1 of sequence b hold its tokens so far, compacted:
    padding tokens are never written, so slot = position (the number of earlier real tokens).

    A forward over a chunk `input_ids [batch, time]` with `attention_mask [batch, time]` writes the
    real tokens of sequence b to slots lengths[b], lengths[b]+1, ... and returns the cache with
    lengths[b] += (number of real tokens of b). Sequences may advance by different amounts in one
    call (prompts of different lengths; an observation chunk; a decode step where some are done).
    Writes past `max_len` are dropped silently: size the cache for the longest sequence.
    rope: (cos, sin) [max_len, rotary_dim/2], `rope_angles` of positions 0..max_len-1. A forward
    over the cache at the default positions (= slots) looks its angles up, since otherwise a decode
    step evaluates cos and sin again inside every layer's q and k fusions on XLA:CPU.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    lengths: jax.Array
    rope: tuple[jax.Array, jax.Array]

    @classmethod
    def init(cls, config: ModelConfig, batch_size: int, max_len: int, dtype=None) -> KVCache:
        """An empty cache (all lengths 0); `dtype` defaults to the config's compute dtype."""
        dtype = dtype or config.compute_dtype
        shape = (batch_size, max_len, config.num_kv_heads, config.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
        rope = rope_angles(jnp.arange(max_len), rotary_dim=config.rotary_dim, theta=config.rope_theta)
        return cls(keys=zeros, values=zeros, lengths=jnp.zeros((batch_size,), jnp.int32), rope=rope)

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[1]


@flax.struct.dataclass
class AttentionLayout:
    """Where a chunk's tokens sit and what each may attend to; computed once, shared by all layers.

    allowed: bool [batch, time, keys]: query t may attend key s.
    write_slots: int [batch, time] cache slot of each token (max_len for padding: dropped), or None
    without a cache.
    num_keys: int [batch, time] with a cache: query t attends cache slots [0, num_keys) (what
    `allowed` says, as a count); None without a cache.
    token_mask: bool [batch, time]: the chunk's real tokens (what a flash kernel reads instead of
    `allowed`).
    """

    allowed: jax.Array
    write_slots: jax.Array | None
    token_mask: jax.Array
    num_keys: jax.Array | None = None

    @staticmethod
    def build(token_mask: jax.Array, lengths: jax.Array | None, max_len: int | None) -> AttentionLayout:
        """Causal attention over real tokens, over the chunk itself or over a cache.

        Without a cache: query t sees key s iff s <= t and token s is real.
        With a cache: a real token gets slot lengths + (number of earlier real tokens in the chunk);
        query with slot q sees cache slot s iff s <= q and s < the updated length.
        """
        time = token_mask.shape[1]
        if lengths is None:
            index = jnp.arange(time)
            causal = index[None, :] <= index[:, None]  # [time(query), time(key)]
            return AttentionLayout(allowed=causal[None] & token_mask[:, None, :], write_slots=None,
                                   token_mask=token_mask)
        query_slots = lengths[:, None] + jnp.cumsum(token_mask, axis=1) - 1  # [batch, time]
        new_lengths = lengths + jnp.sum(token_mask, axis=1)
        key_slots = jnp.arange(max_len)
        allowed = (key_slots[None, None, :] <= query_slots[:, :, None]) & (
            key_slots[None, None, :] < new_lengths[:, None, None]
        )
        write_slots = jnp.where(token_mask, query_slots, max_len)
        num_keys = jnp.clip(jnp.minimum(query_slots + 1, new_lengths[:, None]), 0, max_len)
        return AttentionLayout(allowed=allowed, write_slots=write_slots, token_mask=token_mask, num_keys=num_keys)


def write_cache(cache: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """cache [batch, max_len, kv_heads, head_dim] with cache[b, slots[b, t]] = new[b, t] (cast to the
    cache's dtype); slots >= max_len are dropped."""
    batch_index = jnp.arange(cache.shape[0])[:, None]
    return cache.at[batch_index, slots].set(new.astype(cache.dtype), mode="drop")


def dot_product_attention(q, k, v, allowed):
    """softmax(q·kᵀ / sqrt(head_dim) masked by `allowed`) · v with grouped-query heads.

    q: [batch, time, heads, head_dim]; k, v: [batch, keys, kv_heads, head_dim]; query head h uses
    kv head h // (heads / kv_heads). Logits and softmax in float32.
    """
    batch, time, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, time, kv_heads, heads // kv_heads, head_dim)
    logits = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * head_dim**-0.5
    logits = jnp.where(allowed[:, None, None], logits, _MASKED_LOGIT)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(batch, time, heads, head_dim)


def causal_attention(q, k, v, allowed):
    """`dot_product_attention` of a chunk over its own keys (no cache), one block of queries at a
    time: queries [a, b) attend keys [0, b) only, since `allowed` never lets a query see a later key
    (`AttentionLayout.build` without a cache). The same numbers at every query that sees a key (a
    padding query sees none and averages over fewer values, which nothing reads); with n blocks the
    score matmuls, masking and softmax skip (n − 1) / 2n of the full [time, time] work. Blocks are
    ceil(time / 8) queries, at least 64 (benchmarks/RESULTS.md times the block counts).
    """
    time = q.shape[1]
    size = max(64, -(-time // 8))
    blocks = []
    for a in range(0, time, size):
        b = a + size  # queries [a, b) over keys [0, b)
        blocks.append(dot_product_attention(q[:, a:b], k[:, :b], v[:, :b], allowed[:, a:b, :b]))
    return jnp.concatenate(blocks, axis=1)


def cached_attention(q, k, v, cache_kv, layout: AttentionLayout):
    """The chunk's keys and values k, v [batch, time, kv_heads, head_dim] written into
    `cache_kv = (keys, values)` [batch, slots, kv_heads, head_dim] at `layout.write_slots`
    (`write_cache`), then `dot_product_attention` of q over the cache. Returns (out, cache_kv)."""
    cache_k, cache_v = cache_kv
    cache_k, cache_v = write_cache(cache_k, k, layout.write_slots), write_cache(cache_v, v, layout.write_slots)
    out = dot_product_attention(q, cache_k.astype(q.dtype), cache_v.astype(q.dtype), layout.allowed)
    return out, (cache_k, cache_v)


class DecodeKernels:
    """The operations of a forward that its caller may run its own way, passed to `Policy.forward` as
    `kernels`: the sampler's decode backend does (`sao_jax.rollout.decode`, "native_cpu"). Each method
    returns its result, or None to leave the operation to the model; this class returns None
    throughout, so a forward with `NO_KERNELS` (the default) is the model as written. A result must
    be the model's own up to float rounding.

      attention(q, k, v, cache_kv, layout) -> (out, cache_kv)      as `cached_attention`
      einsums(equation, x, kernels) -> [jnp.einsum(equation, x, w) for w in kernels]
          x's trailing axes contracted with each kernel's leading ones: the projections
          (`Projection`; q, k and v in one call) and the untied LM head ("btd,dv->btv")
      swiglu(x, gate, up, down) -> (silu(x·G) ⊙ x·U)·D              x [batch, time, embed], a dense MLP
      routed_experts(moe, x, token_mask, expert_ids, weights) -> [tokens, embed]
          Σ_j w_{t,j} · SwiGLU_{expert_ids[t,j]}(x_t), dropless, for the `moe.MoE` layer `moe`: x the
          call's batch · time tokens [tokens, embed], token_mask [batch, time], expert_ids and
          weights [tokens, k] from `moe.route`
    """

    def attention(self, q, k, v, cache_kv, layout: AttentionLayout):
        return None

    def einsums(self, equation: str, x: jax.Array, kernels: Sequence[jax.Array]):
        return None

    def swiglu(self, x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array):
        return None

    def routed_experts(self, moe, x: jax.Array, token_mask: jax.Array, expert_ids: jax.Array, weights: jax.Array):
        return None


NO_KERNELS = DecodeKernels()


def splash_attention(q, k, v, token_mask, *, interpret: bool = False):
    """`dot_product_attention` without a cache — causal, over real tokens — by the Pallas TPU
    splash (flash) kernel: scores are made block by block and never stored, in the forward or the
    backward pass. Same shapes as `dot_product_attention`, `token_mask` bool [batch, time].

    Padding tokens are segment 0 and real ones segment 1, so a real query sees exactly the earlier
    real keys (a padding query sees earlier padding; its output is never read). Time is padded to
    the kernel's block size. Each kv head runs the multi-query kernel on its group of query heads.
    Under `use_mesh` the call is a `shard_map` over the batch and kv-head axes (a Pallas call cannot
    be partitioned by XLA). The kernel compiles for TPU only; `interpret` runs it in Pallas interpret
    mode instead (exact but slow, for tests and CPU runs: `ModelConfig.attention_kernel_interpret`).
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    batch, time, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    block = 512 if time > 256 else -(-time // 128) * 128
    padded = -(-time // block) * block
    if interpret:
        _warn_interpreted()
    kernel = _splash_kernel(padded, heads // kv_heads, block, interpret)

    def attend(q, k, v, segment):  # one shard: q [b, t, h, d], k v [b, t, kv, d], segment [b, t]
        b, _, h, _ = q.shape
        kv = k.shape[2]
        pad = ((0, 0), (0, padded - time), (0, 0), (0, 0))
        q = jnp.pad(q * head_dim**-0.5, pad).reshape(b, padded, kv, h // kv, head_dim).transpose(0, 2, 3, 1, 4)
        k, v = (jnp.pad(x, pad).transpose(0, 2, 1, 3) for x in (k, v))  # [b, kv, padded, d]
        segment = jnp.pad(segment.astype(jnp.int32), ((0, 0), (0, padded - time)))
        per_head = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=ids), in_axes=(0, 0, 0, None))
        out = jax.vmap(lambda q, k, v, s: per_head(q, k, v, SegmentIds(q=s, kv=s)))(q, k, v, segment)
        return out.transpose(0, 3, 1, 2, 4).reshape(b, padded, h, head_dim)[:, :time]

    active = active_mesh_and_rules()
    if active is None:
        return attend(q, k, v, token_mask)
    mesh, rules = active
    heads_spec = logical_to_spec(("batch", "length", "kv_heads", "head_dim"), rules)
    mask_spec = logical_to_spec(("batch", "length"), rules)
    return jax.shard_map(attend, mesh=mesh, in_specs=(heads_spec, heads_spec, heads_spec, mask_spec),
                         out_specs=heads_spec, check_vma=False)(q, k, v, token_mask)  # fmt: skip


@functools.cache
def _splash_kernel(length: int, group: int, block: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    mask = splash.MultiHeadMask([splash.CausalMask((length, length)) for _ in range(group)])
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)  # fmt: skip
    # The kernel keeps arrays made from the mask, and it is cached: made inside one jit's trace they
    # would be that trace's tracers, leaked into every later one. Made here, they are concrete.
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)


@functools.cache
def _warn_interpreted() -> None:
    warnings.warn("model.attention=splash off TPU: the Pallas kernel is interpreted (exact, slow; for tests)",
                  stacklevel=3)  # fmt: skip


class Projection(nnx.Module):
    """y = einsum(x, kernel) (+ bias): a Linear layer whose kernel keeps heads as their own axis. The
    equation contracts x's trailing axes with the kernel's leading ones (`"btd,dhk->bthk"`,
    `"bthk,hkd->btd"`)."""

    def __init__(self, equation, kernel_shape, kernel_axes, bias_shape, bias_axes, config, rngs):
        self.equation = equation
        self.kernel = normal_param(rngs, kernel_shape, kernel_axes, config)
        self.bias = zeros_param(bias_shape, bias_axes, config) if bias_shape else None

    def __call__(self, x: jax.Array, kernels: DecodeKernels = NO_KERNELS) -> jax.Array:
        kernel = self.kernel[...].astype(x.dtype)
        y = kernels.einsums(self.equation, x, [kernel])
        y = jnp.einsum(self.equation, x, kernel) if y is None else y[0]
        return y if self.bias is None else y + self.bias[...].astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query causal self-attention with optional per-head q/k RMSNorm and (partial) RoPE."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, h, kv, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        qkv_bias = config.attention_bias
        self.q_proj = Projection(
            "btd,dhk->bthk", (d, h, hd), ("embed", "heads", "head_dim"),
            (h, hd) if qkv_bias else None, ("heads", "head_dim"), config, rngs,
        )  # fmt: skip
        self.k_proj = Projection(
            "btd,dhk->bthk", (d, kv, hd), ("embed", "kv_heads", "head_dim"),
            (kv, hd) if qkv_bias else None, ("kv_heads", "head_dim"), config, rngs,
        )  # fmt: skip
        self.v_proj = Projection(
            "btd,dhk->bthk", (d, kv, hd), ("embed", "kv_heads", "head_dim"),
            (kv, hd) if qkv_bias else None, ("kv_heads", "head_dim"), config, rngs,
        )  # fmt: skip
        self.o_proj = Projection(
            "bthk,hkd->btd", (h, hd, d), ("heads", "head_dim", "embed"),
            (d,) if config.o_proj_bias else None, ("embed",), config, rngs,
        )  # fmt: skip
        self.q_norm = RMSNorm(hd, config) if config.qk_norm else None
        self.k_norm = RMSNorm(hd, config) if config.qk_norm else None
        self.splash = config.attention == "splash"
        self.splash_interpret = config.attention_kernel_interpret

    def __call__(self, x, rope, layout: AttentionLayout, cache_kv=None, kernels: DecodeKernels = NO_KERNELS):
        """x: [batch, time, embed]; rope: (cos, sin) from `rope_angles`. With `cache_kv = (keys, values)`
        of this layer, the chunk's keys/values are written at `layout.write_slots` and attention runs
        over the whole cache. Returns (output [batch, time, embed], updated (keys, values) or None)."""
        q, k, v = self.project_qkv(x, kernels)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache_kv is not None:
            attended = kernels.attention(q, k, v, cache_kv, layout)
            out, cache_kv = cached_attention(q, k, v, cache_kv, layout) if attended is None else attended
        elif self.splash:
            out = splash_attention(q, k, v, layout.token_mask, interpret=self.splash_interpret)
        else:
            out = causal_attention(q, k, v, layout.allowed)
        return self.o_proj(out, kernels), cache_kv

    def project_qkv(self, x: jax.Array, kernels: DecodeKernels = NO_KERNELS) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k, v of x [batch, time, embed]: the three kernels in one `kernels.einsums` call where it
        takes them, else each projection's own."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        ys = kernels.einsums(self.q_proj.equation, x, [p.kernel[...].astype(x.dtype) for p in projections])
        if ys is None:
            return tuple(p(x, kernels) for p in projections)
        return tuple(y if p.bias is None else y + p.bias[...].astype(x.dtype) for y, p in zip(ys, projections))
