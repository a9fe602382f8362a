"""MoE routing, the three dispatches and the load-balancing loss against plain numpy loops written
from the formulas (and transformers' `load_balancing_loss_func`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import tiny_glm4_moe, tiny_qwen3_moe
from sao_jax.models.config import MOE_DISPATCHES
from sao_jax.models.moe import (
    DISPATCHES,
    MoE,
    blocked_dispatch,
    capacity_dispatch,
    capacity_slots,
    dense_dispatch,
    expert_capacity,
    few_tokens_dispatch,
    gathered_dispatch,
    load_balancing_loss,
    route,
    sorted_dispatch,
)
from sao_jax.native.decode import pack_experts, routed_swiglu_packed
from sao_jax.rollout import decode


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _dispatch_reference(x, expert_ids, weights, gate, up, down, kept=None):
    """out_t = Σ_j kept_tj · w_tj · (silu(x_t G_e) ⊙ x_t U_e) D_e with e = expert_ids[t, j], one
    token at a time (kept: all assignments unless given)."""
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        for j in range(expert_ids.shape[1]):
            if kept is None or kept[t, j]:
                e = expert_ids[t, j]
                out[t] += weights[t, j] * ((_silu(x[t] @ gate[e]) * (x[t] @ up[e])) @ down[e])
    return out


def _kept_reference(expert_ids, num_experts, capacity, token_mask):
    """Which assignments get one of `capacity` slots: first choices of all tokens in token order,
    then second choices, ...; padding tokens take none."""
    tokens, k = expert_ids.shape
    used = [0] * num_experts
    kept = np.zeros((tokens, k), bool)
    for j in range(k):
        for t in range(tokens):
            e = expert_ids[t, j]
            if token_mask[t] and used[e] < capacity:
                kept[t, j] = True
                used[e] += 1
    return kept


def _uneven_routing(rng, tokens, num_experts, k):
    """Distinct experts per token drawn from a skewed distribution; the last two experts get none."""
    popularity = np.array([2.0**-i for i in range(num_experts)])
    popularity[-2:] = 0.0
    popularity /= popularity.sum()
    ids = np.stack([rng.choice(num_experts, k, replace=False, p=popularity) for _ in range(tokens)])
    return ids.astype(np.int32), rng.uniform(0.1, 1.0, (tokens, k)).astype(np.float32)


@pytest.mark.parametrize("tokens,num_experts,k", [(13, 6, 1), (24, 8, 2), (17, 8, 3), (150, 4, 2)])
def test_every_dispatch_matches_reference(tokens, num_experts, k):
    rng = np.random.default_rng(tokens)
    d, f = 8, 5
    x = rng.normal(size=(tokens, d)).astype(np.float32)
    gate, up = (rng.normal(size=(num_experts, d, f)).astype(np.float32) for _ in range(2))
    down = rng.normal(size=(num_experts, f, d)).astype(np.float32)
    expert_ids, weights = _uneven_routing(rng, tokens, num_experts, k)
    assert np.bincount(expert_ids.ravel(), minlength=num_experts)[-2:].sum() == 0  # empty experts

    reference = _dispatch_reference(x, expert_ids, weights, gate, up, down)
    dropless_capacity = functools.partial(capacity_dispatch, capacity=tokens)
    for dispatch in (dense_dispatch, sorted_dispatch, dropless_capacity, blocked_dispatch, gathered_dispatch,
                     few_tokens_dispatch):  # fmt: skip
        out = dispatch(*map(jnp.asarray, (x, expert_ids, weights, gate, up, down)))
        np.testing.assert_allclose(np.asarray(out), reference, rtol=1e-4, atol=1e-4, err_msg=str(dispatch))


@pytest.mark.parametrize("routing", ["all_to_one_expert", "whole_blocks", "one_past_whole_blocks", "one_token"])
def test_blocked_dispatch_fits_extreme_routings(routing):
    """The static block count holds for any routing: everything on one expert, counts that are exact
    multiples of the block size (8 here), counts one past a multiple (the most blocks: the bound is
    tight), a single token."""
    rng = np.random.default_rng(7)
    num_experts, d, f = 4, 8, 5
    expert_ids = {
        "all_to_one_expert": np.zeros((64, 1), np.int32),
        "whole_blocks": np.repeat(np.array([[0, 1], [2, 3]], np.int32), 32, axis=0),  # 32 per expert
        "one_past_whole_blocks": np.repeat(np.arange(num_experts, dtype=np.int32), 9)[:, None],  # 2 blocks each
        "one_token": np.array([[3, 1]], np.int32),
    }[routing]
    tokens, k = expert_ids.shape
    x = rng.normal(size=(tokens, d)).astype(np.float32)
    weights = rng.uniform(0.1, 1.0, (tokens, k)).astype(np.float32)
    gate, up = (rng.normal(size=(num_experts, d, f)).astype(np.float32) for _ in range(2))
    down = rng.normal(size=(num_experts, f, d)).astype(np.float32)
    out = blocked_dispatch(*map(jnp.asarray, (x, expert_ids, weights, gate, up, down)))
    expected = _dispatch_reference(x, expert_ids, weights, gate, up, down)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("d, f", [(8, 5), (16, 32)])
@pytest.mark.parametrize("routing", ["balanced", "all_on_two_experts"])
def test_few_tokens_dispatch_drops_nothing_with_balanced_or_piled_up_routing(routing, d, f):
    """32 tokens, top 2 of 8 experts: 16 slots per expert suffice for a balanced routing (8 each);
    with every token on experts 0 and 1 (32 each) it must take the room-for-every-token branch."""
    rng = np.random.default_rng(3)
    tokens, num_experts = 32, 8
    expert_ids = {
        "balanced": np.stack([np.arange(tokens) % 8, (np.arange(tokens) + 3) % 8], axis=1),
        "all_on_two_experts": np.tile(np.array([[0, 1]]), (tokens, 1)),
    }[routing].astype(np.int32)
    x = rng.normal(size=(tokens, d)).astype(np.float32)
    weights = rng.uniform(0.1, 1.0, (tokens, 2)).astype(np.float32)
    gate, up = (rng.normal(size=(num_experts, d, f)).astype(np.float32) for _ in range(2))
    down = rng.normal(size=(num_experts, f, d)).astype(np.float32)
    out = jax.jit(few_tokens_dispatch)(*map(jnp.asarray, (x, expert_ids, weights, gate, up, down)))
    expected = _dispatch_reference(x, expert_ids, weights, gate, up, down)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-4)


def _routed_packed(x, expert_ids, weights, gate, up, down):
    return routed_swiglu_packed(x, expert_ids, weights, pack_experts(gate, up, down))


@pytest.mark.parametrize("counts", [[0, 1, 3, 4, 5, 8, 13, 17], [0, 0, 0, 51, 0, 0, 0, 0]])
def test_routed_swiglu_kernel_equals_the_per_token_sum(counts):
    """The CPU kernel groups the assignments by expert and runs each expert's tokens 8, 4, 2 and 1
    rows at a time (0, 1, 3, 4, 5, 8, 13 and 17 assignments take every combination; 51 on one
    expert: six blocks of 8 and 2 + 1), reading the weights packed (`pack_experts`) a 16-column
    strip at a time (mlp 48: 3 strips); experts no token chose are skipped, and an id outside
    [0, experts) adds 0."""
    rng = np.random.default_rng(5)
    num_experts, tokens, k, d, f = 8, 17, 3, 32, 48
    ids = np.concatenate([np.full(n, e) for e, n in enumerate(counts)])  # exactly counts[e] of expert e
    ids = rng.permutation(np.concatenate([ids, np.full(tokens * k - len(ids), -1)])).reshape(tokens, k)
    ids[ids < 0] = rng.choice([-1, num_experts, 99], size=int((ids < 0).sum()))  # out of range: dropped
    x = rng.normal(size=(tokens, d))
    weights = rng.uniform(0.1, 1.0, (tokens, k))
    gate, up = (rng.normal(size=(num_experts, d, f)) * 0.3 for _ in range(2))
    down = rng.normal(size=(num_experts, f, d)) * 0.3
    floats = [jnp.asarray(a, jnp.float32) for a in (x, weights, gate, up, down)]
    args = (floats[0], jnp.asarray(ids, jnp.int32), *floats[1:])
    lowered = jax.jit(_routed_packed).lower(*args)
    assert "@sao_expert_swiglu_packed(" in lowered.as_text()
    got = np.asarray(lowered.compile()(*args))
    x, weights, gate, up, down = (np.asarray(a, np.float64) for a in floats)
    in_range = (ids >= 0) & (ids < num_experts)
    want = _dispatch_reference(x, np.where(in_range, ids, 0), weights, gate, up, down, kept=in_range)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_pack_experts_stores_each_matrix_strip_by_strip():
    """Expert e's G, U, D one after the other, each [depth, width] matrix as [width / 16][depth][16]:
    w[k, c] at (c // 16) · depth · 16 + k · 16 + c % 16 of its block."""
    rng = np.random.default_rng(8)
    gate, up = (rng.normal(size=(3, 32, 48)) for _ in range(2))
    down = rng.normal(size=(3, 48, 32))
    packed = np.asarray(pack_experts(*(jnp.asarray(w, jnp.float32) for w in (gate, up, down))))
    assert packed.shape == (3, 3 * 32 * 48)
    for e in range(3):
        offset = 0
        for w in (gate[e], up[e], down[e]):
            depth, width = w.shape
            for k in range(depth):
                for c in range(width):
                    assert packed[e, offset + (c // 16) * depth * 16 + k * 16 + c % 16] == np.float32(w[k, c])
            offset += depth * width


def _dispatch_problem(seed, tokens=20, num_experts=6, k=2, d=8, f=4):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(tokens, d)), jnp.float32)
    params = tuple(jnp.asarray(rng.normal(scale=s[1] ** -0.5, size=s), jnp.float32) for s in
                   [(num_experts, d, f), (num_experts, d, f), (num_experts, f, d)])  # fmt: skip (outputs O(1))
    expert_ids, weights = map(jnp.asarray, _uneven_routing(rng, tokens, num_experts, k))
    return x, expert_ids, weights, params


def _grads(dispatch, x, expert_ids, weights, params):
    """Gradients of Σ sin(dispatch(...)) with respect to x, weights and the expert parameters."""

    def loss(x, weights, params):
        return jnp.sum(jnp.sin(dispatch(x, expert_ids, weights, *params)))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, weights, params)


def test_all_dispatches_have_the_same_gradients_when_nothing_is_dropped():
    x, expert_ids, weights, params = _dispatch_problem(0)
    tokens = x.shape[0]
    grads_dense = _grads(dense_dispatch, x, expert_ids, weights, params)
    for dispatch in (sorted_dispatch, functools.partial(capacity_dispatch, capacity=tokens), blocked_dispatch,
                     gathered_dispatch):  # fmt: skip
        grads = _grads(dispatch, x, expert_ids, weights, params)
        for dense, other in zip(jax.tree.leaves(grads_dense), jax.tree.leaves(grads)):
            np.testing.assert_allclose(np.asarray(other), np.asarray(dense), rtol=1e-5, atol=1e-5,
                                       err_msg=str(dispatch))  # fmt: skip


def test_blocked_dispatch_gradients_in_bfloat16_keep_dtypes_and_follow_float32():
    """The written-out backward of `expert_blocks` in bfloat16: every gradient comes back in its
    input's dtype, within bfloat16 rounding of the float32 reference's (accumulated in float32)."""
    x, expert_ids, weights, params = _dispatch_problem(1, tokens=64)
    reference = _grads(dense_dispatch, x, expert_ids, weights, params)
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (x, weights, params))
    grads = _grads(blocked_dispatch, half[0], expert_ids, half[1], half[2])
    for ref, got in zip(jax.tree.leaves(reference), jax.tree.leaves(grads)):
        assert got.dtype == jnp.bfloat16
        scale = float(jnp.max(jnp.abs(ref)))
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref), atol=0.05 * scale)


def test_expert_capacity_is_the_even_split_times_the_factor_at_most_all_tokens():
    assert expert_capacity(tokens=4096, k=2, num_experts=8, capacity_factor=1.25) == 1280
    assert expert_capacity(tokens=10, k=2, num_experts=6, capacity_factor=1.0) == 4  # ceil(20 / 6)
    assert expert_capacity(tokens=10, k=2, num_experts=6, capacity_factor=3.0) == 10  # never drops


@pytest.mark.parametrize("capacity", [1, 3, 5])
def test_capacity_slots_queue_first_choices_first_and_skip_padding(capacity):
    rng = np.random.default_rng(capacity)
    tokens, num_experts, k = 30, 6, 3
    expert_ids, _ = _uneven_routing(rng, tokens, num_experts, k)
    token_mask = rng.uniform(size=tokens) < 0.8
    _, kept = capacity_slots(jnp.asarray(expert_ids), num_experts, capacity, jnp.asarray(token_mask))
    expected = _kept_reference(expert_ids, num_experts, capacity, token_mask)
    assert 0 < expected.sum() < k * token_mask.sum()  # some assignments dropped, some kept
    np.testing.assert_array_equal(np.asarray(kept), expected)


def test_capacity_dispatch_drops_overflowing_assignments():
    """With few slots, the output is the dense reference without the dropped assignments; their
    weights get zero gradient and every other gradient is that of the reduced dense sum."""
    x, expert_ids, weights, params = _dispatch_problem(1, tokens=24)
    capacity = expert_capacity(24, 2, 6, capacity_factor=1.0)  # 8 slots; the skewed routing overflows
    token_mask = np.ones(24, bool)
    token_mask[[3, 17]] = False  # padding: takes no slot, outputs 0
    kept = _kept_reference(np.asarray(expert_ids), 6, capacity, token_mask)
    assert 0 < kept.sum() < 2 * token_mask.sum()
    dispatch = functools.partial(capacity_dispatch, capacity=capacity, token_mask=jnp.asarray(token_mask))

    out = dispatch(x, expert_ids, weights, *params)
    expected = _dispatch_reference(*map(np.asarray, (x, expert_ids, weights, *params)), kept=kept)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-4)

    def reduced_dense(x, expert_ids, weights, *params):
        return dense_dispatch(x, expert_ids, weights * kept, *params)

    grads_reduced = _grads(reduced_dense, x, expert_ids, weights, params)
    grads = _grads(dispatch, x, expert_ids, weights, params)
    for reduced, got in zip(jax.tree.leaves(grads_reduced), jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(reduced), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(grads[1])[~kept] == 0.0)


def _route_reference(logits, bias, config):
    """Expert choice and weights one token at a time, from the routing equations in ModelConfig."""
    logits = logits.astype(np.float64)
    per_group = config.num_experts // config.num_expert_groups
    ids, weights = [], []
    for z in logits:
        if config.router_scoring == "softmax":
            scores = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        else:
            scores = 1.0 / (1.0 + np.exp(-z))
        choice = scores + (0.0 if bias is None else bias)
        if config.num_expert_groups > 1:
            group_score = [np.sort(choice[g * per_group:(g + 1) * per_group])[-2:].sum()
                           for g in range(config.num_expert_groups)]  # fmt: skip
            # ties go to the lower index, as in jax.lax.top_k
            kept = set(np.argsort(-np.array(group_score), kind="stable")[: config.num_selected_groups])
            choice = np.array([c if e // per_group in kept else 0.0 for e, c in enumerate(choice)])
        top = np.argsort(-choice, kind="stable")[: config.num_experts_per_token]
        w = scores[top]
        if config.norm_topk_prob:
            w = w / w.sum()
        order = np.argsort(top)
        ids.append(top[order])
        weights.append(w[order] * config.routed_scaling_factor)
    return np.array(ids), np.array(weights)


@pytest.mark.parametrize(
    "config",
    [
        tiny_qwen3_moe(num_experts=6, num_experts_per_token=3, norm_topk_prob=False),
        tiny_qwen3_moe(),
        tiny_glm4_moe(),  # 4 groups, keep 2, scaling 2.5
        tiny_glm4_moe(num_expert_groups=1, num_selected_groups=1, norm_topk_prob=False),
    ],
    ids=["softmax_top3", "softmax_top2_norm", "sigmoid_groups", "sigmoid_nogroups"],
)
def test_route_matches_reference(config):
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(32, config.num_experts)).astype(np.float32)
    bias = rng.normal(scale=0.3, size=config.num_experts).astype(np.float32) if config.router_correction_bias else None
    expert_ids, weights, scores = route(jnp.asarray(logits), None if bias is None else jnp.asarray(bias), config)
    ref_ids, ref_weights = _route_reference(logits, bias, config)
    order = np.argsort(np.asarray(expert_ids), axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(expert_ids), order, 1), ref_ids)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, 1), ref_weights, rtol=1e-5)


def test_route_scores_the_experts_of_unselected_groups_zero_not_minus_inf():
    """Transformers' GLM-4.5 router fills unselected groups' choice scores with 0: when the correction
    bias makes every choice score negative, the top-k comes from the unselected groups (their tie
    at 0 goes to the lower expert index)."""
    config = tiny_glm4_moe()
    per_group = config.num_experts // config.num_expert_groups
    logits = np.random.default_rng(4).normal(size=(8, config.num_experts)).astype(np.float32)
    bias = np.full(config.num_experts, -2.0, np.float32)  # sigmoid scores < 1, so every choice < −1
    expert_ids, weights, _ = route(jnp.asarray(logits), jnp.asarray(bias), config)
    ref_ids, ref_weights = _route_reference(logits, bias, config)
    order = np.argsort(np.asarray(expert_ids), axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(expert_ids), order, 1), ref_ids)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, 1), ref_weights, rtol=1e-5)
    choice = 1 / (1 + np.exp(-logits.astype(np.float64))) + bias
    group_scores = np.sort(choice.reshape(len(logits), config.num_expert_groups, per_group), axis=-1)[..., -2:].sum(-1)
    selected = np.argsort(-group_scores, axis=1, kind="stable")[:, : config.num_selected_groups]
    for ids, groups in zip(ref_ids, selected):
        assert not set(ids // per_group) & set(groups)


def _aux_loss_reference(scores, expert_ids, token_mask, num_experts):
    """E · Σ_e f_e · P_e over real tokens, f_e = share of tokens routed to e, P_e = mean normalised score."""
    real = [t for t in range(len(scores)) if token_mask[t]]
    total = 0.0
    for e in range(num_experts):
        f_e = sum(e in expert_ids[t] for t in real) / len(real)
        p_e = sum(scores[t][e] / sum(scores[t]) for t in real) / len(real)
        total += f_e * p_e
    return num_experts * total


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_load_balancing_loss_matches_reference(scoring):
    rng = np.random.default_rng(4)
    tokens, num_experts, k = 40, 8, 2
    logits = rng.normal(size=(tokens, num_experts)) + np.linspace(0, 2, num_experts)  # uneven
    if scoring == "softmax":
        scores = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    expert_ids = np.argsort(-scores, axis=1)[:, :k]
    token_mask = rng.uniform(size=tokens) < 0.7
    got = load_balancing_loss(
        jnp.asarray(scores, jnp.float32), jnp.asarray(expert_ids), jnp.asarray(token_mask), num_experts
    )
    expected = _aux_loss_reference(scores, expert_ids, token_mask, num_experts)
    np.testing.assert_allclose(float(got), expected, rtol=1e-5)


@pytest.mark.slow
def test_load_balancing_loss_matches_transformers_for_one_layer():
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = np.random.default_rng(5)
    batch, time, num_experts, k = 3, 7, 6, 2
    logits = rng.normal(size=(batch * time, num_experts)).astype(np.float32)
    attention_mask = (rng.uniform(size=(batch, time)) < 0.8).astype(np.int64)
    expected = load_balancing_loss_func((torch.tensor(logits),), num_experts, k, torch.tensor(attention_mask))
    scores = jax.nn.softmax(jnp.asarray(logits), axis=-1)
    _, expert_ids = jax.lax.top_k(scores, k)
    got = load_balancing_loss(scores, expert_ids, jnp.asarray(attention_mask.reshape(-1)), num_experts)
    np.testing.assert_allclose(float(got), float(expected), rtol=1e-5)


@pytest.mark.slow
# "blocked" with 2 tokens: the gathered experts; 10: the few-token capacity path; 40: blocks
@pytest.mark.parametrize("time", [1, 5, 20])
def test_moe_block_is_the_same_with_every_dispatch(time):
    """Same parameters (same init key), every dispatch (capacity with enough slots for all): same
    output at real tokens and same aux loss (GLM routing: groups, correction bias, shared expert)."""
    assert set(DISPATCHES) == set(MOE_DISPATCHES)  # every name the config accepts has a dispatch
    x = jax.random.normal(jax.random.key(0), (2, time, 32))
    token_mask = jnp.arange(time)[None, :] < jnp.array([[time], [time - 2]])
    outputs = {}
    for dispatch in MOE_DISPATCHES:
        config = tiny_glm4_moe(moe_dispatch=dispatch, initializer_range=0.5, moe_capacity_factor=4.0,
                               moe_kernel_interpret=True)  # 8 experts, k 2; "gmm" interpreted on the CPU
        block = MoE(config, rngs=nnx.Rngs(7))
        outputs[dispatch] = nnx.jit(lambda block, x, mask: block(x, mask))(block, x, token_mask)
    dense_out, dense_aux = outputs["dense"]
    for dispatch, (out, aux) in outputs.items():
        np.testing.assert_allclose(np.asarray(out)[token_mask], np.asarray(dense_out)[token_mask],
                                   rtol=1e-5, atol=1e-5, err_msg=dispatch)  # fmt: skip (outputs reach ~10)
        np.testing.assert_allclose(float(aux), float(dense_aux), rtol=1e-6, err_msg=dispatch)


def _native_cpu_moe(graphdef, state):
    """The MoE layer of `graphdef` / `state` under the "native_cpu" decode backend's kernels, its
    experts packed as the sampler packs them."""

    def call(x, mask):
        block = nnx.merge(graphdef, state)
        return block(x, mask, decode.NativeCpuKernels(block, decode.pack_experts(block)))[0]

    return jax.jit(call)


@pytest.mark.parametrize("time", [1, 2])
def test_a_decode_step_of_many_rows_runs_the_experts_kernel(time):
    """48 rows, 4 experts: 24 assignments an expert, past the few-token rule (4 an expert). Under the
    "native_cpu" decode backend a decode step (time 1) still runs the CPU kernel, and gives the
    blocks' numbers; 48 rows of 2 positions run the blocks. Without its kernels no step does."""
    config = tiny_qwen3_moe(moe_dispatch="blocked", initializer_range=0.5)  # 4 experts, embed 32, mlp 16
    block = MoE(config, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(1), (48, time, 32))
    mask = jnp.ones((48, time), bool)
    graphdef, state = nnx.split(block)
    assert "sao_" not in jax.jit(lambda x, mask: nnx.merge(graphdef, state)(x, mask)[0]).lower(x, mask).as_text()
    lowered = _native_cpu_moe(graphdef, state).lower(x, mask)
    assert ("sao_expert_swiglu_packed" in lowered.as_text()) == (time == 1)
    flat_params = (block.experts.gate_proj[...], block.experts.up_proj[...], block.experts.down_proj[...])
    expert_ids, weights, _ = route(block.router(x.reshape(-1, 32)), None, config)
    want = blocked_dispatch(x.reshape(-1, 32), expert_ids, weights, *flat_params).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(lowered.compile()(x, mask)), np.asarray(want), rtol=1e-5, atol=1e-5)
