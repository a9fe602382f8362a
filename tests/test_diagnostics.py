"""Mechanism diagnostics against hand computations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax import advantages, diagnostics, models
from sao_jax.optim import param_path, param_paths

# The group of each parameter of the tiny critic, written out by hand from its paths.
HAND_GROUPS = {
    "embed/embedding": "embeddings_norms", "final_norm/scale": "embeddings_norms",
    "layers/0/input_norm/scale": "embeddings_norms", "layers/0/post_attn_norm/scale": "embeddings_norms",
    "layers/0/attn/q_proj/kernel": "attention", "layers/0/attn/k_proj/kernel": "attention",
    "layers/0/attn/v_proj/kernel": "attention", "layers/0/attn/o_proj/kernel": "attention",
    "layers/0/attn/q_norm/scale": "attention", "layers/0/attn/k_norm/scale": "attention",
    "layers/0/mlp/gate_proj": "dense_mlp", "layers/0/mlp/up_proj": "dense_mlp", "layers/0/mlp/down_proj": "dense_mlp",
    "layers/1/input_norm/scale": "embeddings_norms", "layers/1/post_attn_norm/scale": "embeddings_norms",
    "layers/1/attn/q_proj/kernel": "attention", "layers/1/attn/k_proj/kernel": "attention",
    "layers/1/attn/v_proj/kernel": "attention", "layers/1/attn/o_proj/kernel": "attention",
    "layers/1/attn/q_norm/scale": "attention", "layers/1/attn/k_norm/scale": "attention",
    "layers/1/mlp/router/kernel": "router", "layers/1/mlp/experts/gate_proj": "experts",
    "layers/1/mlp/experts/up_proj": "experts", "layers/1/mlp/experts/down_proj": "experts",
    "value_head/kernel": "value_head", "value_head/bias": "value_head",
}  # fmt: skip
SLOPE = {"embeddings_norms": 0.5, "attention": 3.0, "dense_mlp": 1.5, "router": 2.0, "experts": 0.25, "value_head": 7.0}


def test_group_grad_norms_on_a_loss_whose_gradient_is_known_per_group():
    """L = Σ_params slope(group) · Σ param has ∂L/∂param = slope(group) everywhere, so group g's
    gradient norm is slope(g) · sqrt(number of its scalars)."""
    policy = models.Policy(models.tiny_qwen3_moe(vocab_size=50), rngs=nnx.Rngs(0))
    critic = models.Critic.from_policy(policy, rngs=nnx.Rngs(1))
    params = nnx.state(critic, nnx.Param)
    paths = param_paths(params)
    assert sorted(paths) == sorted(HAND_GROUPS)

    def loss(params):
        leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
        return sum(SLOPE[HAND_GROUPS[param_path(p)]] * jnp.sum(leaf.get_value()) for p, leaf in leaves)

    norms = diagnostics.group_grad_norms(jax.grad(loss)(params))
    sizes = {group: 0 for group in SLOPE}
    for (path, leaf) in zip(paths, jax.tree.leaves(params)):
        sizes[HAND_GROUPS[path]] += leaf.size
    assert set(norms) == set(SLOPE)
    for group, slope in SLOPE.items():
        assert float(norms[group]) == pytest.approx(slope * np.sqrt(sizes[group]), rel=1e-5)


def test_a_group_the_model_lacks_has_norm_zero():
    norms = diagnostics.group_grad_norms({"layers": {"0": {"attn": {"q_proj": {"kernel": jnp.full((2, 2), 2.0)}}}}})
    assert float(norms["attention"]) == pytest.approx(4.0)  # sqrt(4 · 2²)
    assert float(norms["experts"]) == 0.0 and float(norms["value_head"]) == 0.0


def test_fit_metrics_by_hand():
    values = jnp.array([[0.0, 1.0, 2.0, 9.0]])
    targets = jnp.array([[1.0, 1.0, 4.0, -3.0]])
    mask = jnp.array([[True, True, True, False]])
    # over the 3 masked tokens: G = (1, 1, 4), mean 2, Var[G] = (1 + 1 + 4) / 3 = 2;
    # G − V = (1, 0, 2), mean 1, Var = (0 + 1 + 1) / 3 = 2/3; EV = 1 − (2/3) / 2 = 2/3; MSE = (1 + 0 + 4) / 3
    fit = diagnostics.fit_metrics(values, targets, mask)
    assert float(fit["explained_variance"]) == pytest.approx(2 / 3)
    assert float(fit["mse"]) == pytest.approx(5 / 3)
    assert float(diagnostics.fit_metrics(values, jnp.ones_like(targets), mask)["explained_variance"]) == 0.0
    # constant targets that float rounding leaves with a variance of ~1e-15 (returns of 1.0 summed
    # from pieces) explain nothing, rather than −1e13
    rounded = jnp.ones_like(targets).at[0, 0].add(1.2e-7)  # the next float32 above 1
    assert float(diagnostics.fit_metrics(values, rounded, mask)["explained_variance"]) == 0.0


def test_fit_metrics_of_step_returns_without_reward_is_0_not_rounding_noise():
    """Step-average returns A_i + V_i of a batch whose rewards are all 0 (γ = λ = 1) are 0 up to the
    values' rounding; such a batch once logged an explained variance of −1.6e15."""
    key_values, key_spans = jax.random.split(jax.random.key(0))
    values = jax.random.uniform(key_values, (16, 40), minval=0.05, maxval=0.6)
    action_mask = jax.random.bernoulli(key_spans, 0.7, (16, 40))
    rewards = jnp.zeros((16, 40))
    _, returns = advantages.step_gae(rewards, values, action_mask, gamma=1.0, lam=1.0, value_reduce="mean")
    is_action = np.asarray(action_mask)
    assert np.abs(np.asarray(returns)[is_action]).max() < 1e-5  # 0 up to rounding …
    assert np.asarray(returns)[is_action].std() > 0  # … which is not exactly 0
    assert float(diagnostics.fit_metrics(values, returns, action_mask)["explained_variance"]) == 0.0
    # and a fit to real variance is still measured: targets spread over [0, 1] against V = 0.3
    spread = jnp.linspace(0.0, 1.0, 40)[None].repeat(16, axis=0)
    fit = diagnostics.fit_metrics(jnp.full((16, 40), 0.3), spread, jnp.ones((16, 40), bool))
    assert float(fit["explained_variance"]) == pytest.approx(0.0, abs=1e-5)  # a constant V explains nothing
    fit = diagnostics.fit_metrics(spread + 0.1, spread, jnp.ones((16, 40), bool))
    assert float(fit["explained_variance"]) == pytest.approx(1.0, abs=1e-5)  # a shifted copy explains all


def test_action_edge_advantages_by_hand():
    # row 0: prompt, action [1, 2, 3], observation, action [4, 5]; row 1: a one-token action [6], padding
    advantages = jnp.array([[9.0, 1.0, 2.0, 3.0, 9.0, 4.0, 5.0], [9.0, 6.0, 9.0, 9.0, 9.0, 9.0, 9.0]])
    action = jnp.array([[0, 1, 1, 1, 0, 1, 1], [0, 1, 0, 0, 0, 0, 0]])
    got = diagnostics.action_edge_advantages(advantages, action)
    assert float(got["advantage_first_action_token"]) == pytest.approx((1 + 4 + 6) / 3)
    assert float(got["advantage_last_action_token"]) == pytest.approx((3 + 5 + 6) / 3)
    empty = diagnostics.action_edge_advantages(advantages, jnp.zeros_like(action))
    assert float(empty["advantage_first_action_token"]) == 0.0 and float(empty["advantage_last_action_token"]) == 0.0


def test_first_action_advantages_read_each_rows_first_action_token():
    # row 0: its first action starts at position 1 (a second action later); row 1 at 3; row 2 has none
    advantages = jnp.array([[9.0, 1.0, 2.0, 9.0, 4.0], [9.0, 9.0, 9.0, 6.0, 7.0], [5.0, 5.0, 5.0, 5.0, 5.0]])
    action = jnp.array([[0, 1, 1, 0, 1], [0, 0, 0, 1, 1], [0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(diagnostics.first_action_advantages(advantages, action), [1.0, 6.0, 0.0])
