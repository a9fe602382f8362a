"""MoE routing, both dispatches and the load-balancing loss against plain numpy loops written from
the formulas (and transformers' `load_balancing_loss_func`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import tiny_glm4_moe, tiny_qwen3_moe
from sao_jax.models.config import MOE_DISPATCHES
from sao_jax.models.moe import DISPATCHES, MoE, dense_dispatch, load_balancing_loss, route, sorted_dispatch


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _dispatch_reference(x, expert_ids, weights, gate, up, down):
    """out_t = Σ_j w_tj · (silu(x_t G_e) ⊙ x_t U_e) D_e with e = expert_ids[t, j], one token at a time."""
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        for j in range(expert_ids.shape[1]):
            e = expert_ids[t, j]
            out[t] += weights[t, j] * ((_silu(x[t] @ gate[e]) * (x[t] @ up[e])) @ down[e])
    return out


def _uneven_routing(rng, tokens, num_experts, k):
    """Distinct experts per token drawn from a skewed distribution; the last two experts get none."""
    popularity = np.array([2.0**-i for i in range(num_experts)])
    popularity[-2:] = 0.0
    popularity /= popularity.sum()
    ids = np.stack([rng.choice(num_experts, k, replace=False, p=popularity) for _ in range(tokens)])
    return ids.astype(np.int32), rng.uniform(0.1, 1.0, (tokens, k)).astype(np.float32)


@pytest.mark.parametrize("tokens,num_experts,k", [(13, 6, 1), (24, 8, 2), (17, 8, 3)])
def test_dense_and_sorted_dispatch_match_reference(tokens, num_experts, k):
    rng = np.random.default_rng(tokens)
    d, f = 8, 5
    x = rng.normal(size=(tokens, d)).astype(np.float32)
    gate, up = (rng.normal(size=(num_experts, d, f)).astype(np.float32) for _ in range(2))
    down = rng.normal(size=(num_experts, f, d)).astype(np.float32)
    expert_ids, weights = _uneven_routing(rng, tokens, num_experts, k)
    assert np.bincount(expert_ids.ravel(), minlength=num_experts)[-2:].sum() == 0  # empty experts

    reference = _dispatch_reference(x, expert_ids, weights, gate, up, down)
    for dispatch in (dense_dispatch, sorted_dispatch):
        out = dispatch(*map(jnp.asarray, (x, expert_ids, weights, gate, up, down)))
        np.testing.assert_allclose(np.asarray(out), reference, rtol=1e-4, atol=1e-4, err_msg=dispatch.__name__)


def test_sorted_dispatch_gradients_match_dense():
    rng = np.random.default_rng(0)
    tokens, num_experts, k, d, f = 20, 6, 2, 8, 4
    x = jnp.asarray(rng.normal(size=(tokens, d)), jnp.float32)
    params = tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in
                   [(num_experts, d, f), (num_experts, d, f), (num_experts, f, d)])  # fmt: skip
    expert_ids, weights = map(jnp.asarray, _uneven_routing(rng, tokens, num_experts, k))

    def loss(dispatch, x, weights, params):
        return jnp.sum(jnp.sin(dispatch(x, expert_ids, weights, *params)))

    grads_dense = jax.jit(jax.grad(lambda *a: loss(dense_dispatch, *a), argnums=(0, 1, 2)))(x, weights, params)
    grads_sorted = jax.jit(jax.grad(lambda *a: loss(sorted_dispatch, *a), argnums=(0, 1, 2)))(x, weights, params)
    for dense, sort in zip(jax.tree.leaves(grads_dense), jax.tree.leaves(grads_sorted)):
        np.testing.assert_allclose(np.asarray(sort), np.asarray(dense), rtol=1e-4, atol=1e-4)


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
            kept = set(np.argsort(group_score)[-config.num_selected_groups:])
            choice = np.array([c if e // per_group in kept else 0.0 for e, c in enumerate(choice)])
        top = np.argsort(choice)[-config.num_experts_per_token:]
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
def test_moe_block_is_the_same_with_either_dispatch():
    """Same parameters (same init key), dense vs sorted dispatch: same output and aux loss (GLM
    routing: groups, correction bias, shared expert)."""
    assert set(DISPATCHES) == set(MOE_DISPATCHES)  # every name the config accepts has a dispatch
    x = jax.random.normal(jax.random.key(0), (2, 5, 32))
    token_mask = jnp.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    outputs = []
    for dispatch in ("dense", "sorted"):
        block = MoE(tiny_glm4_moe(moe_dispatch=dispatch, initializer_range=0.5), rngs=nnx.Rngs(7))
        outputs.append(nnx.jit(lambda block, x, mask: block(x, mask))(block, x, token_mask))
    (dense_out, dense_aux), (sorted_out, sorted_aux) = outputs
    np.testing.assert_allclose(np.asarray(sorted_out), np.asarray(dense_out), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(sorted_aux), float(dense_aux), rtol=1e-6)
