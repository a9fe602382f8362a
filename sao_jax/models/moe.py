"""Feed-forward blocks: the dense SwiGLU MLP and the routed mixture of experts (MoE).

MoE(x) = Σ_{e ∈ top-k(x)} w_e(x) · SwiGLU_e(x) + SwiGLU_shared(x),   SwiGLU(x) = (silu(x·G) ⊙ x·U)·D.
Routing is described in `ModelConfig` and implemented in `route`; four dispatches compute the sum:
`dense_dispatch` (the readable reference), `sorted_dispatch` (tokens grouped by expert for
`jax.lax.ragged_dot`), `blocked_dispatch` (tokens grouped by expert in fixed-size blocks) — these
three give the same numbers — and `capacity_dispatch` (a fixed number of slots per expert; the same
numbers unless an expert overflows, whose extra assignments are dropped). Calls of "blocked" with at
most 4 tokens per expert (decode steps) take `few_tokens_dispatch` (a dropless `capacity_dispatch`)
or, for one or two rows, `gathered_dispatch`. A caller's `DecodeKernels` may run the routed experts
its own way (`MoE.__call__`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models.config import ModelConfig
from sao_jax.models.layers import NO_KERNELS, DecodeKernels, normal_param
from sao_jax.models.sharding import active_mesh_and_rules


class RouterBias(nnx.Variable):
    """A router buffer that steers expert choice but is not trained by gradient (HF registers GLM's
    `e_score_correction_bias` as a buffer). Not an `nnx.Param`, so optimizers over Params skip it."""


def swiglu(x, gate_proj, up_proj, down_proj):
    """(silu(x·G) ⊙ x·U)·D for x [..., embed], G, U [embed, mlp], D [mlp, embed]; with a leading
    group axis on all four (x [groups, rows, embed], G [groups, embed, mlp], ...), one per group."""
    return (jax.nn.silu(x @ gate_proj) * (x @ up_proj)) @ down_proj


class FeedForward(nnx.Module):
    """A dense SwiGLU MLP (`gate_proj`, `up_proj`: [embed, mlp]; `down_proj`: [mlp, embed])."""

    def __init__(self, config: ModelConfig, width: int, *, rngs: nnx.Rngs):
        d = config.hidden_size
        self.gate_proj = normal_param(rngs, (d, width), ("embed", "mlp"), config)
        self.up_proj = normal_param(rngs, (d, width), ("embed", "mlp"), config)
        self.down_proj = normal_param(rngs, (width, d), ("mlp", "embed"), config)

    def __call__(self, x: jax.Array, kernels: DecodeKernels = NO_KERNELS) -> jax.Array:
        """x: [..., embed]. The leading axes are flattened first: on XLA:CPU the backward of a
        [batch, time, embed] matmul (contracting batch and time together) is slower
        (benchmarks/RESULTS.md)."""
        dtype = x.dtype
        gate, up, down = (w[...].astype(dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))
        out = kernels.swiglu(x, gate, up, down)
        return swiglu(x.reshape(-1, x.shape[-1]), gate, up, down).reshape(x.shape) if out is None else out


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
    dense matmul over all experts, slower there than even `dense_dispatch` (use `blocked_dispatch`).
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


def expert_capacity(tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert: C = min(tokens, ceil(capacity_factor · tokens · k / num_experts)).

    A token picks an expert at most once, so C = tokens (capacity_factor >= num_experts / k) never drops.
    """
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * k / num_experts)))


def capacity_slots(expert_ids, num_experts: int, capacity: int, token_mask=None):
    """Slot of each (token, choice) assignment in its expert's buffer, and whether it fits.

    Assignments queue in a fixed order, choice-major: all tokens' first choices (in token order),
    then all second choices, ... (so a token's top choice is dropped only when its expert is full of
    other top choices). slot[t, j] = number of earlier assignments in that order to expert_ids[t, j];
    kept[t, j] = slot[t, j] < capacity and token t is real. Padding tokens (token_mask 0) take no slot.
    Fraction of real assignments dropped = 1 − Σ kept / (k · Σ token_mask).

    expert_ids: int [tokens, k]; token_mask: [tokens] or None (all real).
    Returns (slot int32 [tokens, k], kept bool [tokens, k]).
    """
    tokens, k = expert_ids.shape
    real = jnp.ones((tokens,), bool) if token_mask is None else token_mask.astype(bool)
    queue = expert_ids.T.reshape(-1)  # [k * tokens], choice-major
    queued = jax.nn.one_hot(queue, num_experts, dtype=jnp.int32) * jnp.tile(real, k)[:, None].astype(jnp.int32)
    earlier = jnp.cumsum(queued, axis=0) - queued  # assignments before this one, per expert
    slot = jnp.take_along_axis(earlier, queue[:, None], axis=1)[:, 0].reshape(k, tokens).T
    return slot, (slot < capacity) & real[:, None]


def capacity_dispatch(x, expert_ids, weights, gate_proj, up_proj, down_proj, *, capacity: int, token_mask=None):
    """Capacity dispatch (Switch / GShard): each expert e has `capacity` slots; an assignment (t, j)
    that gets a slot (see `capacity_slots`) is gathered into buffer [e, slot], the experts run as one
    batched matmul over [experts, capacity, embed], and results are gathered back:
      out_t = Σ_j kept[t, j] · w_{t,j} · SwiGLU_{expert_ids[t,j]}(x_t).
    A dropped assignment (its expert full) contributes 0 and gets no gradient; the residual stream
    still carries the token. Equals `dense_dispatch` when nothing is dropped. Costs
    experts · capacity ≈ capacity_factor · tokens · k token-expert products, gathers rather than
    [tokens, experts, capacity] one-hot matmuls.
    """
    tokens, k = expert_ids.shape
    num_experts = gate_proj.shape[0]
    slot, kept = capacity_slots(expert_ids, num_experts, capacity, token_mask)
    buffer_index = jnp.where(kept, expert_ids * capacity + slot, num_experts * capacity)  # dropped: out of range
    slot_token = jnp.full((num_experts * capacity,), tokens, jnp.int32).at[buffer_index.reshape(-1)].set(
        jnp.repeat(jnp.arange(tokens, dtype=jnp.int32), k), mode="drop"
    )  # token in each slot; empty slots hold `tokens` (out of range, gathered as zeros)
    x_slots = jnp.take(x, slot_token, axis=0, mode="fill", fill_value=0).reshape(num_experts, capacity, -1)
    out_slots = swiglu(x_slots, gate_proj, up_proj, down_proj).reshape(num_experts * capacity, -1)  # batched
    out_pairs = jnp.take(out_slots, buffer_index, axis=0, mode="fill", fill_value=0)  # [tokens, k, embed]
    return jnp.einsum("tkd,tk->td", out_pairs, weights.astype(x.dtype))


def gathered_dispatch(x, expert_ids, weights, gate_proj, up_proj, down_proj):
    """Each assignment (t, j) runs a copy of its own expert's weights:
    out_t = Σ_j w_{t,j} · SwiGLU_{e_{t,j}}(x_t), with the weights gathered per assignment.

    It reads tokens·k experts' weights (each twice: gathered, then multiplied) where the batched
    dispatches read all of them once, so it pays only for very few tokens: a decode step of one or
    two rows (`MoE.__call__`).
    """
    tokens, k = expert_ids.shape
    chosen = expert_ids.reshape(-1)  # [tokens·k]
    xs = jnp.repeat(x, k, axis=0)
    gate = jnp.einsum("nd,ndf->nf", xs, gate_proj[chosen])
    hidden = jax.nn.silu(gate) * jnp.einsum("nd,ndf->nf", xs, up_proj[chosen])
    out = jnp.einsum("nf,nfd->nd", hidden, down_proj[chosen]).reshape(tokens, k, -1)
    return jnp.einsum("tjd,tj->td", out, weights.astype(x.dtype))


def few_tokens_dispatch(x, expert_ids, weights, gate_proj, up_proj, down_proj):
    """A decode step's few tokens, dropless: out_t = Σ_j w_{t,j} · SwiGLU_{expert_ids[t,j]}(x_t) as in
    `dense_dispatch`, by `capacity_dispatch` with C = min(tokens, 2 · ceil(tokens · k / experts))
    slots per expert (twice an even share) when no expert got more than C assignments, else with
    C = tokens (room for every token), so nothing is dropped; with a router near balance the first
    branch runs, at 2 · tokens · k token-expert products instead of experts · tokens (the step reads
    every expert's weights either way).
    """
    args = (x, expert_ids, weights, gate_proj, up_proj, down_proj)
    tokens, k = expert_ids.shape
    num_experts = gate_proj.shape[0]
    small = min(tokens, 2 * -(-tokens * k // num_experts))
    if small == tokens:
        return capacity_dispatch(*args, capacity=tokens)
    most = jnp.max(jnp.bincount(expert_ids.reshape(-1), length=num_experts))
    return jax.lax.cond(most <= small, functools.partial(capacity_dispatch, capacity=small),
                        functools.partial(capacity_dispatch, capacity=tokens), *args)  # fmt: skip


def blocked_dispatch(x, expert_ids, weights, gate_proj, up_proj, down_proj):
    """Dropless grouped dispatch in fixed-size blocks (MegaBlocks-style, without sparse kernels):
    each expert's assignments fill ceil(count_e / B) blocks of B rows (its last block padded), every
    block is one matmul with its expert's weights (`expert_blocks`), and results are gathered back:
      out_t = Σ_j w_{t,j} · SwiGLU_{expert_ids[t,j]}(x_t),  the same numbers as `dense_dispatch`.
    Σ_e ceil(count_e / B) <= (tokens·k + E·(B−1)) / B whatever the routing, which fixes the number
    of blocks; B = max(8, tokens·k / (8E) rounded down to a multiple of 8), so padding is at most
    about an eighth of the tokens·k rows. Unlike `capacity_dispatch`, a token's output never depends
    on the other tokens of the call (decode steps and full forwards agree).
    """
    tokens, k = expert_ids.shape
    num_experts = gate_proj.shape[0]
    block = max(8, tokens * k // (8 * num_experts) // 8 * 8)
    num_blocks = (tokens * k + num_experts * (block - 1)) // block
    rank, _ = capacity_slots(expert_ids, num_experts, capacity=tokens)  # index within its expert
    count = jnp.bincount(expert_ids.reshape(-1), length=num_experts)
    padded = (count + block - 1) // block * block
    padded_end = jnp.cumsum(padded)
    row = (padded_end - padded)[expert_ids] + rank  # [tokens, k]: row of each assignment
    row_token = jnp.full((num_blocks * block,), tokens, jnp.int32).at[row.reshape(-1)].set(
        jnp.repeat(jnp.arange(tokens, dtype=jnp.int32), k)
    )  # token in each row; padding rows hold `tokens` (out of range, gathered as zeros)
    block_expert = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(num_blocks) * block, side="right"),
                               num_experts - 1)  # fmt: skip (blocks past the last expert's are empty)
    x_blocks = jnp.take(x, row_token, axis=0, mode="fill", fill_value=0).reshape(num_blocks, block, -1)
    out_blocks = expert_blocks(x_blocks, block_expert, gate_proj, up_proj, down_proj)
    out_pairs = jnp.take(out_blocks.reshape(num_blocks * block, -1), row, axis=0)  # [tokens, k, embed]
    return jnp.einsum("tkd,tk->td", out_pairs, weights.astype(x.dtype))


@jax.custom_vjp
def expert_blocks(x_blocks, block_expert, gate_proj, up_proj, down_proj):
    """y[b] = SwiGLU_e(x_blocks[b]) with e = block_expert[b], for x_blocks [blocks, rows, embed] and
    expert weights stacked [experts, ...]: a `lax.scan` over the blocks that reads each block's
    weights in place.

    Its gradient is written out rather than derived: with a = x·G_e, u = x·U_e, h = silu(a) ⊙ u, y = h·D_e
    and the incoming dy of each block,
      dD_e += hᵀ·dy,  dh = dy·D_eᵀ,  da = dh ⊙ u ⊙ σ(a)(1 + a(1 − σ(a))),  du = dh ⊙ silu(a),
      dG_e += xᵀ·da,  dU_e += xᵀ·du,  dx = da·G_eᵀ + du·U_eᵀ,
    each block adding into its expert's slice of float32 accumulators in place. Autodiff of the batched
    form (one weight copy per block) builds a [blocks, embed, mlp] gradient per weight instead, which
    XLA:CPU transposes and sums per expert, more slowly (benchmarks/RESULTS.md, "Model forward and
    backward").
    """
    return _expert_blocks_forward(x_blocks, block_expert, gate_proj, up_proj, down_proj)[0]


def _expert_blocks_forward(x_blocks, block_expert, gate_proj, up_proj, down_proj):
    def one_block(_, block):
        x, e = block
        a, u = x @ gate_proj[e], x @ up_proj[e]
        return None, ((jax.nn.silu(a) * u) @ down_proj[e], a, u)

    _, (y, a, u) = jax.lax.scan(one_block, None, (x_blocks, block_expert))
    return y, (x_blocks, block_expert, gate_proj, up_proj, down_proj, a, u)


def _expert_blocks_backward(residuals, dy):
    x_blocks, block_expert, gate_proj, up_proj, down_proj, a, u = residuals

    def one_block(grads, block):
        d_gate, d_up, d_down = grads
        x, e, a, u, dy = block
        sigmoid = jax.nn.sigmoid(a)
        silu = a * sigmoid
        d_down = d_down.at[e].add(jnp.matmul((silu * u).T, dy, preferred_element_type=jnp.float32))
        dh = dy @ down_proj[e].T
        da = dh * u * sigmoid * (1 + a * (1 - sigmoid))
        du = dh * silu
        d_gate = d_gate.at[e].add(jnp.matmul(x.T, da, preferred_element_type=jnp.float32))
        d_up = d_up.at[e].add(jnp.matmul(x.T, du, preferred_element_type=jnp.float32))
        return (d_gate, d_up, d_down), da @ gate_proj[e].T + du @ up_proj[e].T

    zeros = tuple(jnp.zeros(w.shape, jnp.float32) for w in (gate_proj, up_proj, down_proj))
    grads, dx = jax.lax.scan(one_block, zeros, (x_blocks, block_expert, a, u, dy))
    d_gate, d_up, d_down = (g.astype(w.dtype) for g, w in zip(grads, (gate_proj, up_proj, down_proj)))
    return dx, None, d_gate, d_up, d_down


expert_blocks.defvjp(_expert_blocks_forward, _expert_blocks_backward)


_MIN_ROW_TILE = {2: 16, 4: 8}  # rows of a TPU sublane tile by itemsize (bfloat16 packs two rows)


def _feature_tile(dim: int, bound: int) -> int:
    """The k or n tile of `gmm`: the whole dim when it is at most `bound` (a full-dim block is always
    a legal TPU block), else the largest multiple of 128 (a lane tile) that divides it and is at most
    `bound`, else 128 (the kernel masks a ragged last tile)."""
    if dim <= bound:
        return dim
    return next((t for t in range(bound // 128 * 128, 0, -128) if dim % t == 0), 128)


def gmm_tiling(rows: int, k: int, n: int, num_groups: int, itemsize: int = 4, *, max_tile: int = 512):
    """(tm, tk, tn) of a `gmm` of [rows, k] tokens grouped over `num_groups` experts by [groups, k, n].

    tk, tn: `_feature_tile` of k and n. tm: the largest power of two in [min_tm, max_tile] with
    tm · num_groups <= rows / 4, else min_tm (8 rows for 4-byte, 16 for 2-byte elements). A group
    whose rows start or end inside a tile pays for the whole tile, so the kernel computes at most
      ceil(rows / tm) · tm + (num_groups − 1) · tm   rows   (`gmm_padded_rows`),
    and this tm keeps padded / real <= 1 + tm · num_groups / rows <= 1.25 whenever min_tm allows it
    (rows >= 4 · min_tm · num_groups, i.e. a few dozen tokens per expert)."""
    min_tm = _MIN_ROW_TILE.get(itemsize, 8)
    tm = min_tm
    while tm * 2 <= max_tile and tm * 2 * num_groups * 4 <= rows:
        tm *= 2
    return tm, _feature_tile(k, max_tile), _feature_tile(n, max_tile)


def gmm_padded_rows(group_sizes, tm: int) -> int:
    """Rows the megablox kernel computes for these group sizes at row tile tm (the token rows padded
    to a multiple of tm, the padding counted in the last group as `gmm_swiglu` does): each nonempty
    group covers the tiles from the one holding its first row to the one holding its last,
      Σ_{e: n_e > 0} (ceil(end_e / tm) − floor(start_e / tm)) · tm,
    with start_e, end_e its first and one-past-last rows. A pure function of the sizes (numbers, not
    traced arrays), for checking the padding bound of `gmm_tiling`."""
    sizes = [int(s) for s in group_sizes]
    rows = sum(sizes)
    sizes[-1] += -rows % tm  # padding rows join the last group
    tiles, start = 0, 0
    for size in sizes:
        if size:
            end = start + size
            tiles += -(-end // tm) - start // tm
            start = end
    return tiles * tm


def _gmm(lhs, rhs, group_sizes, tiling, group_offset, interpret: bool):
    from jax.experimental.pallas.ops.tpu.megablox import gmm  # Pallas: imported only where used

    # positional: the custom VJP's non-differentiable arguments (dtype, tiling, transpose, interpret)
    return gmm(lhs, rhs, group_sizes, lhs.dtype, tiling, group_offset, None, False, interpret)


def gmm_swiglu(x_sorted, group_sizes, gate_proj, up_proj, down_proj, *, interpret: bool = False,
               group_offset=None):  # fmt: skip
    """Rows of x_sorted [rows, embed] grouped by expert (group e: the next group_sizes[e] rows) through
    their expert's SwiGLU by the megablox grouped matmul (`gmm`; its VJP runs `gmm` for the input
    gradient and `tgmm` for the weight gradients):
      y_r = (silu(x_r · G_e) ⊙ x_r · U_e) · D_e   for row r of group e.
    The rows are padded with zeros to a multiple of tm and the padding counted in the last group: a
    zero row gives a zero output and adds nothing to any weight gradient, and every row the kernel
    writes is then defined. With `group_offset` g the weights are the local experts g … g + E_local − 1
    of expert parallelism; the rows of other experts come out 0 (the kernel zeroes them).
    `interpret`: run the Pallas kernel in interpret mode (off TPU: exact, slow; for tests)."""
    rows, embed = x_sorted.shape
    mlp = gate_proj.shape[-1]
    num_groups = group_sizes.shape[0]
    tm, tk, tn = gmm_tiling(rows, embed, mlp, num_groups, jnp.dtype(x_sorted.dtype).itemsize)
    pad = -rows % tm
    lhs = jnp.pad(x_sorted, ((0, pad), (0, 0)))
    group_sizes = group_sizes.astype(jnp.int32).at[-1].add(pad)
    if group_offset is not None:
        group_offset = jnp.asarray(group_offset, jnp.int32)
    up_tiling, down_tiling = (tm, tk, tn), (tm, tn, tk)
    hidden = jax.nn.silu(_gmm(lhs, gate_proj, group_sizes, up_tiling, group_offset, interpret)) * _gmm(
        lhs, up_proj, group_sizes, up_tiling, group_offset, interpret)  # fmt: skip
    return _gmm(hidden, down_proj, group_sizes, down_tiling, group_offset, interpret)[:rows]


def _sort_by_expert(expert_ids, num_experts: int):
    """(order, group_sizes) of the tokens·k assignments, as `sorted_dispatch` builds them: `order`
    lists the flat (token·k + j) assignment indices grouped by expert (stable), group_sizes[e] the
    assignments of expert e."""
    flat_experts = expert_ids.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)
    return order, jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)


def gmm_dispatch(x, expert_ids, weights, gate_proj, up_proj, down_proj, *, interpret: bool = False):
    """Grouped dispatch through the Pallas megablox kernel: the (token, expert) pairs sorted by expert
    as in `sorted_dispatch`, each expert's rows multiplied by `gmm_swiglu` (TPU tiles of its weights,
    the rows of a tile from at most a few groups), then unsorted and combined:
      out_t = Σ_j w_{t,j} · SwiGLU_{expert_ids[t,j]}(x_t),  the same numbers as `dense_dispatch`.
    For TPUs, where `ragged_dot` has no grouped lowering of its own; `interpret` for tests off TPU
    (`ModelConfig.moe_kernel_interpret`)."""
    tokens, k = expert_ids.shape
    order, group_sizes = _sort_by_expert(expert_ids, gate_proj.shape[0])
    out_sorted = gmm_swiglu(x[order // k], group_sizes, gate_proj, up_proj, down_proj, interpret=interpret)
    out_pairs = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(tokens, k, -1)
    return jnp.einsum("tkd,tk->td", out_pairs, weights.astype(x.dtype))


def expert_parallel_gmm_dispatch(x, expert_ids, weights, gate_proj, up_proj, down_proj, *, mesh,
                                 token_axes=("data", "fsdp"), expert_axis: str = "expert",
                                 interpret: bool = False):  # fmt: skip
    """`gmm_dispatch` with the experts sharded over the mesh axis `expert_axis`, inside `jax.shard_map`:
    each device holds E / n_expert experts and all of its token shard's assignments (tokens split over
    `token_axes`, replicated over `expert_axis`), runs `gmm_swiglu` on the rows of its own experts
    (group_offset = its first expert; the other rows come out 0), combines, and the partial outputs are
    summed over the expert axis:
      out_t = Σ_{devices s} Σ_{j: expert_ids[t,j] ∈ experts(s)} w_{t,j} · SwiGLU_{expert_ids[t,j]}(x_t).
    This is MaxText's all-gather + local grouped matmul + reduce scheme rather than an all-to-all of the
    sorted tokens: with the logical rules here (`sharding.DEFAULT_RULES`) the batch is not sharded over
    `expert`, so the all-gather of tokens costs nothing (every expert shard already holds them), and the
    only collective is one psum of [tokens, embed] per layer, with static shapes whatever the routing (an
    all-to-all needs per-device buffer sizes that depend on the routing, so a capacity or a second pass).
    The price: each device sorts and pads all its tokens' rows, of which ≈ 1 / n_expert are its own.
    The weights enter with only the expert axis sharded (other shardings are gathered at the boundary).
    `check_vma=False`: the Pallas kernel declares no varying-axes types for its outputs."""
    from jax.sharding import PartitionSpec as P

    token_axes = tuple(a for a in token_axes if mesh.shape[a] > 1) or None
    num_experts = gate_proj.shape[0]
    shards = mesh.shape[expert_axis]
    if num_experts % shards:
        raise ValueError(f"{num_experts} experts do not split over mesh axis {expert_axis!r} of size {shards}")
    local = num_experts // shards

    def local_experts(x, expert_ids, weights, gate_proj, up_proj, down_proj):
        tokens, k = expert_ids.shape
        order, group_sizes = _sort_by_expert(expert_ids, num_experts)
        offset = jax.lax.axis_index(expert_axis) * local
        out_sorted = gmm_swiglu(x[order // k], group_sizes, gate_proj, up_proj, down_proj, interpret=interpret,
                                group_offset=offset)  # fmt: skip
        out_pairs = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(tokens, k, -1)
        return jax.lax.psum(jnp.einsum("tkd,tk->td", out_pairs, weights.astype(x.dtype)), expert_axis)

    rows, experts = P(token_axes, None), P(expert_axis, None, None)
    return jax.shard_map(local_experts, mesh=mesh, in_specs=(rows, rows, rows, experts, experts, experts),
                         out_specs=rows, check_vma=False)(x, expert_ids, weights, gate_proj, up_proj, down_proj)  # fmt: skip


# Calls of "blocked" with at most this many tokens per expert take `few_tokens_dispatch` (`MoE.__call__`).
FEW_TOKENS_PER_EXPERT = 4

DISPATCHES = {
    "dense": dense_dispatch,
    "sorted": sorted_dispatch,
    "capacity": capacity_dispatch,
    "blocked": blocked_dispatch,
    "gmm": gmm_dispatch,
}


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

    def __call__(self, x: jax.Array, token_mask: jax.Array, kernels: DecodeKernels = NO_KERNELS):
        """x: [batch, time, embed]; token_mask: [batch, time] (padding is excluded from the aux loss).
        The routed experts run `kernels.routed_experts` where it takes them, else `_dispatch`'s choice."""
        batch, time, d = x.shape
        flat = x.reshape(batch * time, d)
        bias = self.router.e_score_correction_bias
        expert_ids, weights, scores = route(self.router(flat), None if bias is None else bias[...], self.config)
        out = kernels.routed_experts(self, flat, token_mask, expert_ids, weights)
        if out is None:
            gate, up, down = (w[...].astype(x.dtype) for w in (self.experts.gate_proj, self.experts.up_proj,
                                                               self.experts.down_proj))  # fmt: skip
            out = self._dispatch(batch * time, token_mask)(flat, expert_ids, weights, gate, up, down)
        out = out.reshape(batch, time, d)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, kernels)
        aux = load_balancing_loss(scores, expert_ids, token_mask.reshape(-1), self.config.num_experts)
        return out, aux

    def _dispatch(self, tokens: int, token_mask: jax.Array):
        """The dispatch of a call over `tokens` tokens: `config.moe_dispatch`'s, with capacity slots
        sized for the call, the Pallas kernel under a mesh in a `shard_map`, and a "blocked" call of
        at most `FEW_TOKENS_PER_EXPERT` tokens per expert through `few_tokens_dispatch` — or, for one
        or two rows, `gathered_dispatch`, since copying the few chosen experts' weights reads fewer
        bytes than running all of them. Such a decode step would otherwise be a scan over about two
        tiny blocks per expert; dropless capacity slots (the same numbers) run all experts in one
        batched matmul (timings: benchmarks/RESULTS.md, "Sampler"). Private because
        `nnx.capture(method_outputs=...)` records what public methods return, and this returns a function."""
        config = self.config
        dispatch = DISPATCHES[config.moe_dispatch]
        if dispatch is capacity_dispatch:  # slots are sized per call; padding tokens take none
            capacity = expert_capacity(tokens, config.num_experts_per_token, config.num_experts,
                                       config.moe_capacity_factor)  # fmt: skip
            return functools.partial(dispatch, capacity=capacity, token_mask=token_mask.reshape(-1))
        if dispatch is blocked_dispatch and tokens <= FEW_TOKENS_PER_EXPERT * config.num_experts:
            few_rows = 2 * tokens * config.num_experts_per_token <= config.num_experts
            return gathered_dispatch if few_rows else few_tokens_dispatch
        if dispatch is gmm_dispatch:
            interpret = config.moe_kernel_interpret
            active = active_mesh_and_rules()
            if active is not None:  # a Pallas call is not partitioned by XLA: shard_map over tokens and experts
                return functools.partial(expert_parallel_gmm_dispatch, mesh=active[0], interpret=interpret)
            return functools.partial(gmm_dispatch, interpret=interpret)
        return dispatch
