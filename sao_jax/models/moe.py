"""Feed-forward blocks: the dense SwiGLU MLP and the routed mixture of experts (MoE).

MoE(x) = Σ_{e ∈ top-k(x)} w_e(x) · SwiGLU_e(x) + SwiGLU_shared(x),   SwiGLU(x) = (silu(x·G) ⊙ x·U)·D.
Routing is described in `ModelConfig` and implemented in `route`; two dispatches compute the same
sum: `dense_dispatch` (the readable reference) and `sorted_dispatch` (tokens grouped by expert).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models.config import ModelConfig
from sao_jax.models.layers import normal_param


class RouterBias(nnx.Variable):
    """A router buffer that steers expert choice but is not trained by gradient (HF registers GLM's
    `e_score_correction_bias` as a buffer). Not an `nnx.Param`, so optimizers over Params skip it."""


def swiglu(x, gate_proj, up_proj, down_proj):
    """(silu(x·G) ⊙ x·U)·D for x [..., embed], G, U [embed, mlp], D [mlp, embed]."""
    return (jax.nn.silu(x @ gate_proj) * (x @ up_proj)) @ down_proj


class FeedForward(nnx.Module):
    """A dense SwiGLU MLP (`gate_proj`, `up_proj`: [embed, mlp]; `down_proj`: [mlp, embed])."""

    def __init__(self, config: ModelConfig, width: int, *, rngs: nnx.Rngs):
        d = config.hidden_size
        self.gate_proj = normal_param(rngs, (d, width), ("embed", "mlp"), config)
        self.up_proj = normal_param(rngs, (d, width), ("embed", "mlp"), config)
        self.down_proj = normal_param(rngs, (width, d), ("mlp", "embed"), config)

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        return swiglu(x, self.gate_proj[...].astype(dtype), self.up_proj[...].astype(dtype),
                      self.down_proj[...].astype(dtype))  # fmt: skip


def route(router_logits, correction_bias, config: ModelConfig):
    """Top-k expert choice and weights for each token (see `ModelConfig` for the equations).

    router_logits: float32 [tokens, experts]; correction_bias: [experts] or None.
    Returns (expert_ids int32 [tokens, k], weights float32 [tokens, k], scores float32 [tokens, experts]).
    Group-limited choice follows transformers' Glm4MoeTopkRouter: a group scores the sum of its two
    best choice scores, and the experts of unselected groups get choice score 0 (not -inf).
    """
    scores = jax.nn.softmax(router_logits, axis=-1) if config.router_scoring == "softmax" else (
        jax.nn.sigmoid(router_logits))  # fmt: skip
    choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    if config.num_expert_groups > 1:
        tokens = choice.shape[0]
        grouped = choice.reshape(tokens, config.num_expert_groups, -1)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [tokens, groups]
        _, best_groups = jax.lax.top_k(group_scores, config.num_selected_groups)
        group_selected = jnp.zeros_like(group_scores, dtype=bool).at[
            jnp.arange(tokens)[:, None], best_groups].set(True)  # fmt: skip
        choice = jnp.where(group_selected[:, :, None], grouped, 0.0).reshape(tokens, -1)
    _, expert_ids = jax.lax.top_k(choice, config.num_experts_per_token)
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if config.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return expert_ids, weights * config.routed_scaling_factor, scores


def load_balancing_loss(scores, expert_ids, token_mask, num_experts: int):
    """Switch-Transformer auxiliary loss of one layer: L = E · Σ_e f_e · P_e over real tokens, where
    f_e = (1/T) Σ_t [e ∈ top-k(t)] (the fraction of tokens routed to e, summed over the k slots) and
    P_e = (1/T) Σ_t p_e(t) with p(t) the router scores normalised to sum 1 (softmax: the probabilities).
    Equals transformers' `load_balancing_loss_func` for one layer; perfectly uniform routing gives k.

    scores: [tokens, experts]; expert_ids: int [tokens, k]; token_mask: [tokens] (0/1).
    """
    weight = token_mask.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(weight), 1.0)
    chosen = jnp.sum(jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32), axis=1)  # [tokens, E]
    fraction_routed = jnp.sum(chosen * weight[:, None], axis=0) / count
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    mean_prob = jnp.sum(probs * weight[:, None], axis=0) / count
    return num_experts * jnp.sum(fraction_routed * mean_prob)


def dense_dispatch(x, expert_ids, weights, gate_proj, up_proj, down_proj):
    """Reference dispatch: every expert on every token, combined with the sparse routing weights.

    out_t = Σ_e c_{t,e} · SwiGLU_e(x_t),  c_{t,e} = w_{t,j} if expert_ids[t, j] = e else 0.
    x: [tokens, embed]; expert weights stacked [experts, ...]. Costs experts/k times the needed FLOPs.
    """
    tokens, num_experts = x.shape[0], gate_proj.shape[0]
    combine = jnp.zeros((tokens, num_experts), weights.dtype).at[
        jnp.arange(tokens)[:, None], expert_ids].add(weights)  # fmt: skip
    hidden = jax.nn.silu(jnp.einsum("td,edf->tef", x, gate_proj)) * jnp.einsum("td,edf->tef", x, up_proj)
    expert_out = jnp.einsum("tef,efd->ted", hidden, down_proj)
    return jnp.einsum("ted,te->td", expert_out, combine.astype(x.dtype))


def sorted_dispatch(x, expert_ids, weights, gate_proj, up_proj, down_proj):
    """Grouped dispatch: the tokens·k (token, expert) pairs are sorted by expert so that each expert
    multiplies one contiguous block (`jax.lax.ragged_dot`), then unsorted and combined:
    out_t = Σ_j w_{t,j} · SwiGLU_{expert_ids[t,j]}(x_t). Same result as `dense_dispatch`.
    Meant for accelerators' grouped matmuls; on CPU (jax 0.10.2) XLA lowers `ragged_dot` to a masked
    dense matmul over all experts, so `dense_dispatch` is cheaper there.
    """
    tokens, k = expert_ids.shape
    num_experts = gate_proj.shape[0]
    flat_experts = expert_ids.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)  # pair order grouped by expert
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)
    x_sorted = x[order // k]
    hidden = jax.nn.silu(jax.lax.ragged_dot(x_sorted, gate_proj, group_sizes)) * jax.lax.ragged_dot(
        x_sorted, up_proj, group_sizes
    )
    out_sorted = jax.lax.ragged_dot(hidden, down_proj, group_sizes)
    out_pairs = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(tokens, k, -1)
    return jnp.einsum("tkd,tk->td", out_pairs, weights.astype(x.dtype))


DISPATCHES = {"dense": dense_dispatch, "sorted": sorted_dispatch}


class Router(nnx.Module):
    """Router logits z = x·kernel in float32 (`kernel`: [embed, expert]) and, for GLM, the
    `e_score_correction_bias` buffer [expert]."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.kernel = normal_param(rngs, (config.hidden_size, config.num_experts), ("embed", "expert"), config)
        self.e_score_correction_bias = (
            RouterBias(jnp.zeros((config.num_experts,), jnp.float32), out_sharding=(None,), eager_sharding=False)
            if config.router_correction_bias
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return x.astype(jnp.float32) @ self.kernel[...].astype(jnp.float32)


class Experts(nnx.Module):
    """Routed experts stacked on a leading axis: `gate_proj`, `up_proj` [expert, embed, mlp],
    `down_proj` [expert, mlp, embed]."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        e, d, f = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_proj = normal_param(rngs, (e, d, f), ("expert", "embed", "mlp"), config)
        self.up_proj = normal_param(rngs, (e, d, f), ("expert", "embed", "mlp"), config)
        self.down_proj = normal_param(rngs, (e, f, d), ("expert", "mlp", "embed"), config)


class MoE(nnx.Module):
    """Routed experts plus optional shared experts; returns (output, load-balancing aux loss)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.router = Router(config, rngs=rngs)
        self.experts = Experts(config, rngs=rngs)
        self.shared_experts = (
            FeedForward(config, config.num_shared_experts * config.moe_intermediate_size, rngs=rngs)
            if config.num_shared_experts
            else None
        )

    def __call__(self, x: jax.Array, token_mask: jax.Array):
        """x: [batch, time, embed]; token_mask: [batch, time] (padding is excluded from the aux loss)."""
        batch, time, d = x.shape
        flat = x.reshape(batch * time, d)
        bias = self.router.e_score_correction_bias
        expert_ids, weights, scores = route(self.router(flat), None if bias is None else bias[...], self.config)
        dispatch = DISPATCHES[self.config.moe_dispatch]
        dtype = x.dtype
        out = dispatch(flat, expert_ids, weights, self.experts.gate_proj[...].astype(dtype),
                       self.experts.up_proj[...].astype(dtype), self.experts.down_proj[...].astype(dtype))  # fmt: skip
        out = out.reshape(batch, time, d)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        aux = load_balancing_loss(scores, expert_ids, token_mask.reshape(-1), self.config.num_experts)
        return out, aux
