"""The decoder-only MoE transformer, the Policy (decoder + LM head) and the Critic (decoder + value head).

Parameter paths (the optimizer selects by them): `embed/embedding`, `layers/<i>/input_norm/scale`,
`layers/<i>/attn/{q,k,v,o}_proj/{kernel,bias}`, `layers/<i>/attn/{q,k}_norm/scale`,
`layers/<i>/post_attn_norm/scale`, MoE layers `layers/<i>/mlp/router/kernel` (+ the non-Param buffer
`layers/<i>/mlp/router/e_score_correction_bias`), `layers/<i>/mlp/experts/{gate,up,down}_proj`,
`layers/<i>/mlp/shared_experts/{gate,up,down}_proj`; dense layers `layers/<i>/mlp/{gate,up,down}_proj`;
`final_norm/scale`; `lm_head/kernel` (Policy, untied only); `value_head/{kernel,bias}` (Critic).

Calling convention (Policy and Critic alike):
  model(input_ids, positions=None, attention_mask=None) -> logits [batch, time, vocab] float32 (Policy)
                                                       or values [batch, time] float32 (Critic; with
                                                       value_bins, value logits [batch, time, bins])
  model.forward(input_ids, positions=None, attention_mask=None, cache=None) -> (out, cache, aux_loss)
with `aux_loss` the router load-balancing loss averaged over MoE layers (0 without MoE layers; the
trainer scales it by `config.router_aux_loss_coef`) and `cache` a `KVCache` (None in, None out).
`attention_mask` marks real tokens (1) vs padding (0); padding ids are ignored. Default `positions`:
the number of earlier real tokens of the sequence (+ the cache length), so left or right padding
does not shift positions. For a KV-cache forward, see `KVCache`: prefill a padded chunk, decode
[batch, 1] steps (mask 0 for finished sequences), prefill more tokens (an observation), resume.
`Policy.forward(..., kernels=...)` runs some operations the caller's way (`layers.DecodeKernels`:
the sampler's decode backend); the default is the model as written.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models.config import ModelConfig
from sao_jax.models.layers import (
    NO_KERNELS, Attention, AttentionLayout, DecodeKernels, KVCache, RMSNorm, normal_param, param, rope_angles,
)
from sao_jax.models.moe import FeedForward, MoE
from sao_jax.models.sharding import with_logical_constraint


class Embedding(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.embedding = normal_param(rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"), config)

    def __call__(self, input_ids: jax.Array, dtype) -> jax.Array:
        return jnp.take(self.embedding[...], input_ids, axis=0).astype(dtype)


class DecoderLayer(nnx.Module):
    """x + Attn(RMSNorm(x)), then h + MLP(RMSNorm(h)); MLP is MoE or dense per `config.is_moe_layer`."""

    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        self.is_moe = config.is_moe_layer(layer)
        self.input_norm = RMSNorm(config.hidden_size, config)
        self.attn = Attention(config, rngs=rngs)
        self.post_attn_norm = RMSNorm(config.hidden_size, config)
        self.mlp = MoE(config, rngs=rngs) if self.is_moe else FeedForward(config, config.intermediate_size, rngs=rngs)

    def __call__(self, x, rope, token_mask, layout, cache_kv, kernels: DecodeKernels = NO_KERNELS):
        """rope: (cos, sin) from `rope_angles`. Returns (x [batch, time, embed], updated cache
        (keys, values) or None, aux loss or None)."""
        attn_out, cache_kv = self.attn(self.input_norm(x), rope, layout, cache_kv, kernels)
        h = x + attn_out
        if self.is_moe:
            mlp_out, aux = self.mlp(self.post_attn_norm(h), token_mask, kernels)
        else:
            mlp_out, aux = self.mlp(self.post_attn_norm(h), kernels), None
        return h + mlp_out, cache_kv, aux


def _call_layer_remat(layer: DecoderLayer, x, rope, token_mask, layout, cache_kv, kernels):
    """`layer(...)` under `jax.checkpoint`: the backward pass recomputes the layer's intermediates.
    (The layer goes in as split state: a layer only reads its variables, so nothing is written back.)"""
    graph, state = nnx.split(layer)

    def apply(state, *inputs):
        return nnx.merge(graph, state)(*inputs, kernels)

    return jax.checkpoint(apply)(state, x, rope, token_mask, layout, cache_kv)


class Decoder(nnx.Module):
    """Token embedding, `layers`, final RMSNorm: the trunk that Policy and Critic share."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = Embedding(config, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, i, rngs=rngs) for i in range(config.num_layers)])
        self.final_norm = RMSNorm(config.hidden_size, config)

    def hidden_states(self, input_ids, positions=None, attention_mask=None, cache: KVCache | None = None,
                      kernels: DecodeKernels = NO_KERNELS):
        """Final-normed hidden states [batch, time, embed] (compute dtype), updated cache, aux loss.

        The aux loss is the mean over MoE layers of each layer's `load_balancing_loss` (transformers
        instead pools all layers' tokens into one f and P; the two agree for a single MoE layer)."""
        token_mask = jnp.ones(input_ids.shape, bool) if attention_mask is None else attention_mask.astype(bool)
        input_ids = jnp.where(token_mask, input_ids, 0)  # padding ids may be anything, even -1
        lengths = None if cache is None else cache.lengths
        slot_positions = positions is None
        if positions is None:
            earlier_real = jnp.cumsum(token_mask, axis=1) - 1
            positions = jnp.maximum(earlier_real if lengths is None else lengths[:, None] + earlier_real, 0)
        if cache is not None and slot_positions:  # the cache's table (its last row for dropped tokens)
            rope = tuple(table[positions] for table in cache.rope)
        else:
            rope = rope_angles(positions, rotary_dim=self.config.rotary_dim, theta=self.config.rope_theta)
        layout = AttentionLayout.build(token_mask, lengths, None if cache is None else cache.max_len)
        x = self.embed(input_ids, self.config.compute_dtype)
        new_keys, new_values, aux_losses = [], [], []
        # Remat matters only where a backward pass follows; cached decoding never differentiates.
        call = _call_layer_remat if self.config.remat and cache is None else DecoderLayer.__call__
        for i, layer in enumerate(self.layers):
            cache_kv = None if cache is None else (cache.keys[i], cache.values[i])
            x, cache_kv, aux = call(layer, x, rope, token_mask, layout, cache_kv, kernels)
            x = with_logical_constraint(x, ("batch", "length", "embed"))
            if cache_kv is not None:
                new_keys.append(cache_kv[0])
                new_values.append(cache_kv[1])
            if aux is not None:
                aux_losses.append(aux)
        if cache is not None:
            cache = cache.replace(keys=tuple(new_keys), values=tuple(new_values),
                                  lengths=cache.lengths + jnp.sum(token_mask, axis=1, dtype=jnp.int32))  # fmt: skip
        aux_loss = jnp.mean(jnp.stack(aux_losses)) if aux_losses else jnp.zeros((), jnp.float32)
        return self.final_norm(x), cache, aux_loss

    def init_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty KV cache for this model (see `KVCache`)."""
        return KVCache.init(self.config, batch_size, max_len)


class Policy(Decoder):
    """Decoder + LM head; `policy(input_ids, positions=None, attention_mask=None)` -> float32 logits.
    With `tie_word_embeddings` the head is the transposed token embedding and `lm_head` is absent."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = LMHead(config, rngs=rngs)

    def forward(self, input_ids, positions=None, attention_mask=None, cache: KVCache | None = None,
                kernels: DecodeKernels = NO_KERNELS):
        """(logits float32 [batch, time, vocab], cache, aux_loss); see the module docstring. `kernels`
        gets the untied head only (the tied one is the embedding read transposed)."""
        hidden, cache, aux_loss = self.hidden_states(input_ids, positions, attention_mask, cache, kernels)
        kernel = self._head_kernel().astype(hidden.dtype)
        logits = None if self.config.tie_word_embeddings else kernels.einsums("btd,dv->btv", hidden, [kernel])
        return (_logits(hidden, kernel) if logits is None else logits[0]), cache, aux_loss

    def token_logprobs(self, input_ids, attention_mask=None, *, chunk: int = 0):
        """(log π(token_t | tokens_<t) float32 [batch, time], 0 at t = 0; aux loss): the numbers of
        `losses.token_logprobs(forward(...)[0], input_ids)`, made `chunk` positions at a time.

        Each chunk's logits [batch, chunk, vocab] are made, read at the next token and dropped; the
        backward pass remakes them (`jax.checkpoint`), so the whole-sequence logits and their gradient
        never exist — at 128k tokens and a 152k vocabulary those are 148 GiB per sequence. chunk 0
        (or ≥ time): the logits of the whole sequence at once, kept for the backward pass.
        """
        hidden, _, aux_loss = self.hidden_states(input_ids, None, attention_mask)
        kernel = self._head_kernel()
        next_tokens = jnp.pad(input_ids[:, 1:], ((0, 0), (0, 1)))  # position t predicts token t+1

        def next_token_logprobs(hidden, next_tokens):
            logprobs = jax.nn.log_softmax(_logits(hidden, kernel), axis=-1)
            return jnp.take_along_axis(logprobs, next_tokens[..., None], axis=-1)[..., 0]

        batch, time = input_ids.shape
        if not chunk or chunk >= time:
            picked = next_token_logprobs(hidden, next_tokens)
        else:
            pieces = -(-time // chunk)
            pad = pieces * chunk - time

            def split(x):  # [batch, time, ...] -> [pieces, batch, chunk, ...]
                x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
                return x.reshape(batch, pieces, chunk, *x.shape[2:]).swapaxes(0, 1)

            picked = jax.lax.map(lambda xs: jax.checkpoint(next_token_logprobs)(*xs), (split(hidden), split(next_tokens)))
            picked = picked.swapaxes(0, 1).reshape(batch, pieces * chunk)[:, :time]
        return jnp.pad(picked[:, :-1], ((0, 0), (1, 0))), aux_loss

    def _head_kernel(self) -> jax.Array:
        """The LM head [embed, vocab]: the transposed token embedding when tied."""
        return self.embed.embedding[...].T if self.config.tie_word_embeddings else self.lm_head.kernel[...]

    def __call__(self, input_ids, positions=None, attention_mask=None) -> jax.Array:
        return self.forward(input_ids, positions, attention_mask)[0]


def _logits(hidden: jax.Array, kernel: jax.Array) -> jax.Array:
    """hidden [..., embed] · kernel [embed, vocab] in the compute dtype, accumulated and returned in float32."""
    return jnp.einsum("...d,dv->...v", hidden, kernel.astype(hidden.dtype), preferred_element_type=jnp.float32)


class LMHead(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.kernel = normal_param(rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"), config)


class ValueHead(nnx.Module):
    """v = h·kernel + bias in float32 (`bins` = 0), or, with `bins` = B > 0, B logits per token
    `h·kernel + bias` (kernel [hidden, B]) of a distributional head (`sao_jax.losses.hl_gauss_values`).
    kernel ~ N(0, initializer_range²), bias 0: a fresh scalar head predicts values near 0, a fresh
    distributional one a near-uniform histogram, and the trunk gets gradient from the first step."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, bins: int = 0):
        shape = (config.hidden_size, bins) if bins else (config.hidden_size,)
        kernel = config.initializer_range * jax.random.normal(rngs.params(), shape, jnp.float32)
        self.kernel = param(kernel, ("embed", None) if bins else ("embed",))
        self.bias = param(jnp.zeros(shape[1:], jnp.float32), (None,) if bins else ())

    def __call__(self, hidden: jax.Array) -> jax.Array:
        return hidden.astype(jnp.float32) @ self.kernel[...] + self.bias[...]


class Critic(Decoder):
    """Decoder + value head per token; `critic(input_ids, ...)` -> the head's output, float32:
    values [batch, time] (`value_bins` = 0) or value-histogram logits [batch, time, value_bins]."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, value_bins: int = 0):
        super().__init__(config, rngs=rngs)
        self.value_head = ValueHead(config, rngs=rngs, bins=value_bins)

    @classmethod
    def from_policy(cls, policy: Policy, *, rngs: nnx.Rngs, value_bins: int = 0) -> Critic:
        """A critic whose decoder (embed, layers, final_norm) is a copy of `policy`'s and whose value
        head is fresh (from `rngs`). The copy owns its arrays, so donating either model's buffers is safe."""
        critic = nnx.eval_shape(lambda: cls(policy.config, rngs=nnx.Rngs(0), value_bins=value_bins))
        for name in ("embed", "layers", "final_norm"):
            state = jax.tree.map(jnp.copy, nnx.state(getattr(policy, name)))
            nnx.update(getattr(critic, name), state)
        critic.value_head = ValueHead(policy.config, rngs=rngs, bins=value_bins)
        return critic

    def forward(self, input_ids, positions=None, attention_mask=None, cache: KVCache | None = None):
        """(the value head's output float32 [batch, time] or [batch, time, bins], cache, aux_loss)."""
        hidden, cache, aux_loss = self.hidden_states(input_ids, positions, attention_mask, cache)
        return self.value_head(hidden), cache, aux_loss

    def __call__(self, input_ids, positions=None, attention_mask=None) -> jax.Array:
        return self.forward(input_ids, positions, attention_mask)[0]


# The parameters a forward casts to `config.compute_dtype` before using them: projections and their
# biases, experts, dense MLPs, the embedding table (rows cast after the lookup) and the LM head. Norm
# scales, the router and GLM's correction bias are read in float32 and are not listed.
_CAST_ON_USE = re.compile(r"(.*/)?(embed/embedding|lm_head/kernel|attn/[qkvo]_proj/(kernel|bias)|(gate|up|down)_proj)")


def compute_dtype_weights(state: Any, config: ModelConfig) -> Any:
    """A model's NNX state with each parameter that the forward casts to `config.compute_dtype` stored
    in that dtype already (`_CAST_ON_USE`); every other variable as it was. The forward from it is
    the same, bit for bit: rounding once here or at each use gives the same values. With float32
    masters and bfloat16 compute that halves the bytes a sampler holds, moves and reads. Variables
    that need no cast are kept, not copied; when the compute dtype is not narrower than the storage
    dtype (nothing to save), `state` itself is returned."""
    dtype = jnp.dtype(config.compute_dtype)
    if dtype.itemsize >= jnp.dtype(config.weight_dtype).itemsize:
        return state

    def cast(path: tuple, variable: nnx.Variable) -> nnx.Variable:
        value = variable.get_value()
        if value.dtype == dtype or not _CAST_ON_USE.fullmatch("/".join(map(str, path))):
            return variable
        return variable.replace(value.astype(dtype))

    return nnx.from_flat_state([(path, cast(path, variable)) for path, variable in nnx.to_flat_state(state)])
