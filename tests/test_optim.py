"""The frozen-attention critic optimizer (docs/algorithms.md §7) on the real tiny GLM-4.5-MoE critic, and the
optimizer factories against their formulas."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sao_jax import optim
from sao_jax.models import Critic, tiny_glm4_moe

NUM_STEPS = 3


def keyed_leaves(tree):
    """{"/"-joined key path: leaf} of every array in `tree`, written here independently of sao_jax."""
    out = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in key_path]
        out["/".join(names)] = leaf
    return out


def trained_in_sao(path: str) -> bool:
    """The paper's trainable set, spelled out by hand: MoE router/experts/shared experts, value head."""
    parts = path.split("/")
    if parts[0] == "value_head":
        return True
    is_moe_part = len(parts) >= 4 and parts[0] == "layers" and parts[2] == "mlp"
    return is_moe_part and parts[3] in ("router", "experts", "shared_experts")


def make_critic():
    # GLM preset: a dense first layer, MoE layers with shared experts and the non-Param router bias.
    return Critic(tiny_glm4_moe(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def abstract_split():
    """(graphdef, params, buffers) of the critic as shapes only: labels need paths and types, not values."""
    return nnx.split(nnx.eval_shape(make_critic), nnx.Param, ...)


@pytest.fixture(scope="module")
def params(abstract_split):
    return abstract_split[1]


def param_paths_by_hand(params):
    # Params are Variables holding one array; their key paths end in ".value".
    return {path.removesuffix("/value"): leaf for path, leaf in keyed_leaves(params).items()}


def test_default_labels_train_only_moe_projections_and_value_head(params):
    labels = optim.label_params(params, optim.CRITIC_FROZEN_ATTENTION_TRAINABLE)
    got = dict(zip(optim.param_paths(params), jax.tree.leaves(labels)))
    expected = {path: "trainable" if trained_in_sao(path) else "frozen" for path in param_paths_by_hand(params)}
    assert got == expected
    # (ours) the dense FFN of layer 0 is frozen under the faithful default
    assert got["layers/0/mlp/gate_proj"] == "frozen"
    assert got["layers/1/mlp/shared_experts/up_proj"] == "trainable"


def test_buffers_are_frozen_even_when_a_pattern_matches_them(abstract_split):
    _, params, buffers = abstract_split
    full_state = nnx.merge_state(params, buffers)
    labels = dict(zip(optim.param_paths(full_state), jax.tree.leaves(optim.label_params(full_state, optim.ALL_TRAINABLE))))
    assert labels["layers/1/mlp/router/e_score_correction_bias"] == "frozen"
    assert labels["layers/1/mlp/router/kernel"] == "trainable"


def test_labels_on_a_plain_dict_match_labels_on_the_nnx_state(params):
    on_state = jax.tree.leaves(optim.label_params(params, optim.CRITIC_FROZEN_ATTENTION_TRAINABLE))
    on_dict = jax.tree.leaves(optim.label_params(params.to_pure_dict(), optim.CRITIC_FROZEN_ATTENTION_TRAINABLE))
    assert on_state == on_dict


def test_all_trainable_labels_every_param(params):
    assert set(jax.tree.leaves(optim.label_params(params, optim.ALL_TRAINABLE))) == {"trainable"}


@pytest.mark.parametrize("pattern", ["value_haed/.*", "attn", "layers/1/mlp/router"])
def test_pattern_matching_no_whole_path_is_an_error_naming_it(params, pattern):
    # "attn" and "layers/1/mlp/router" occur inside paths but match no whole path
    with pytest.raises(ValueError, match=f"'{pattern}'"):
        optim.label_params(params, [r"(.*/)?value_head/.*", pattern])


def test_invalid_regex_and_bare_string_are_errors(params):
    with pytest.raises(ValueError, match=r"'layers/\(' is not a valid regex"):
        optim.label_params(params, ["layers/("])
    with pytest.raises(TypeError, match="sequence of patterns"):
        optim.label_params(params, "value_head/.*")


def test_train_only_reports_a_typo_when_the_optimizer_is_initialised(params):
    tx = optim.train_only(optax.sgd(0.1), ["vale_head/.*"])
    with pytest.raises(ValueError, match="vale_head"):
        jax.eval_shape(tx.init, params)


def test_zero_frozen_zeroes_exactly_the_frozen_gradients(params):
    ones = jax.tree.map(lambda leaf: jnp.ones(leaf.shape, leaf.dtype), params)
    zeroed = param_paths_by_hand(optim.zero_frozen(ones, optim.CRITIC_FROZEN_ATTENTION_TRAINABLE))
    assert zeroed.keys() == param_paths_by_hand(params).keys()
    for path, leaf in zeroed.items():
        assert np.all(np.asarray(leaf) == (1.0 if trained_in_sao(path) else 0.0)), path


def test_zero_frozen_gradients_are_not_computed():
    """Why `zero_frozen` exists: XLA then drops the frozen weights' gradient matmuls from the program."""
    graphdef, params, buffers = nnx.split(make_critic(), nnx.Param, ...)
    input_ids = jnp.zeros((4, 32), jnp.int32)

    def grads(params, zero):
        g = jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p, buffers).forward(input_ids)[0]))(params)
        return optim.zero_frozen(g, optim.CRITIC_FROZEN_ATTENTION_TRAINABLE) if zero else g

    def flops(zero):
        return jax.jit(grads, static_argnums=1).lower(params, zero).compile().cost_analysis()["flops"]

    # the weight gradient of a projection x [tokens, d] · W [d, n] is 2 · tokens · d · n FLOPs
    attention = [leaf for path, leaf in param_paths_by_hand(params).items()
                 if "/attn/" in path and path.endswith("/kernel")]  # fmt: skip
    assert len(attention) == 4 * tiny_glm4_moe().num_layers
    weight_grad_flops = sum(2 * input_ids.size * leaf.size for leaf in attention)
    assert flops(False) - flops(True) >= weight_grad_flops


@pytest.fixture(scope="module")
def critic_run():
    """NUM_STEPS frozen-attention AdamW steps of the critic's value loss on random tokens and targets."""
    graphdef, params, buffers = nnx.split(make_critic(), nnx.Param, ...)
    # weight decay 0: a trainable leaf can only move by its gradient
    tx = optim.train_only(optim.adamw(1e-2, weight_decay=0.0), optim.CRITIC_FROZEN_ATTENTION_TRAINABLE)

    def value_loss(params, input_ids, targets):
        values, _, aux_loss = nnx.merge(graphdef, params, buffers).forward(input_ids)
        return jnp.mean((values - targets) ** 2) + 0.01 * aux_loss

    @jax.jit
    def step(params, opt_state, input_ids, targets):
        grads = jax.grad(value_loss)(params, input_ids, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    key_ids, key_targets = jax.random.split(jax.random.key(1))
    input_ids = jax.random.randint(key_ids, (4, 12), 0, tiny_glm4_moe().vocab_size)
    targets = jax.random.normal(key_targets, (4, 12))
    opt_state = tx.init(params)
    new_params = params
    for _ in range(NUM_STEPS):
        new_params, opt_state = step(new_params, opt_state, input_ids, targets)
    return params, new_params, opt_state


@pytest.mark.slow
def test_frozen_params_bit_identical_and_trainable_params_moved(critic_run):
    before, after, _ = critic_run
    before, after = param_paths_by_hand(before), param_paths_by_hand(after)
    assert before.keys() == after.keys()
    for path in before:
        same = np.array_equal(np.asarray(before[path]), np.asarray(after[path]))
        if trained_in_sao(path):
            assert not same, f"trainable {path} did not move"
        else:
            assert same, f"frozen {path} changed"


@pytest.mark.slow
def test_optimizer_state_holds_no_arrays_for_frozen_params(critic_run):
    params, _, opt_state = critic_run
    trainable = {p: leaf for p, leaf in param_paths_by_hand(params).items() if trained_in_sao(p)}
    for moment in ("mu", "nu"):
        [(_, moments)] = optax.tree_utils.tree_get_all_with_path(opt_state, moment)
        assert set(param_paths_by_hand(moments)) == set(trainable)
    # every array in the state is a moment of a trainable parameter or a step count
    count_bytes = sum(leaf.nbytes for path, leaf in keyed_leaves(opt_state).items() if path.endswith("/count"))
    trainable_bytes = sum(leaf.nbytes for leaf in trainable.values())
    frozen_state_bytes = optim.tree_bytes(opt_state)
    assert frozen_state_bytes == 2 * trainable_bytes + count_bytes

    all_params_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    full_state = optim.train_only(optim.adamw(1e-2), optim.ALL_TRAINABLE).init(params)
    full_state_bytes = optim.tree_bytes(full_state)
    assert full_state_bytes == 2 * all_params_bytes + count_bytes
    print(
        f"\ntiny GLM critic AdamW state: {full_state_bytes} B all trainable, {frozen_state_bytes} B frozen "
        f"attention, saved {full_state_bytes - frozen_state_bytes} B "
        f"({1 - frozen_state_bytes / full_state_bytes:.0%})"
    )


def test_clipping_and_weight_decay_see_only_trainable_params():
    params = {"attn": jnp.full((3,), 2.0), "value_head": jnp.array([1.0, -2.0])}
    tx = optim.train_only(optim.adamw(0.1, max_grad_norm=1.0, weight_decay=0.5), [r"value_head"])
    small = {"attn": jnp.zeros(3), "value_head": jnp.array([3.0, 4.0])}
    huge = {"attn": jnp.full((3,), 1e6), "value_head": jnp.array([3.0, 4.0])}
    updates_small, _ = tx.update(small, tx.init(params), params)
    updates_huge, _ = tx.update(huge, tx.init(params), params)
    np.testing.assert_array_equal(updates_huge["value_head"], updates_small["value_head"])
    np.testing.assert_array_equal(updates_huge["attn"], np.zeros(3))


def test_adamw_with_clipping_matches_formula():
    lr, b1, b2, eps, wd, max_norm = 0.1, 0.9, 0.99, 1e-8, 0.01, 1.0
    params = {"w": np.array([0.5, -1.0, 2.0]), "b": np.array([0.3])}
    grads = [{"w": np.array([3.0, 0.0, -4.0]), "b": np.array([0.0])}, {"w": np.array([0.1, 0.2, 0.3]), "b": np.array([-0.4])}]
    tx = optim.adamw(lr, max_grad_norm=max_norm, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    state, got = tx.init(jax.tree.map(jnp.asarray, params)), jax.tree.map(jnp.asarray, params)

    expected = {k: v.copy() for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v = {k: np.zeros_like(x) for k, x in params.items()}
    for t, g in enumerate(grads, start=1):
        norm = math.sqrt(sum(float(np.sum(x**2)) for x in g.values()))
        scale = min(1.0, max_norm / norm)
        for k in params:
            gk = g[k] * scale
            m[k] = b1 * m[k] + (1 - b1) * gk
            v[k] = b2 * v[k] + (1 - b2) * gk**2
            m_hat, v_hat = m[k] / (1 - b1**t), v[k] / (1 - b2**t)
            expected[k] = expected[k] - lr * (m_hat / (np.sqrt(v_hat) + eps) + wd * expected[k])
        updates, state = tx.update(jax.tree.map(jnp.asarray, g), state, got)
        got = optax.apply_updates(got, updates)
    for k in params:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("warmup, total", [(0, None), (4, None), (0, 10), (3, 10)])
def test_learning_rate_schedule_matches_formula(warmup, total):
    peak, end = 2e-3, 1e-4
    schedule = optim.learning_rate_schedule(peak, warmup_steps=warmup, total_steps=total, end_value=end)
    for t in range(14):
        if t < warmup:
            expected = peak * t / warmup
        elif total is None:
            expected = peak
        elif t <= total:
            expected = end + (peak - end) * 0.5 * (1 + math.cos(math.pi * (t - warmup) / (total - warmup)))
        else:
            expected = end
        assert float(schedule(t)) == pytest.approx(expected, rel=1e-5), t


def test_learning_rate_schedule_rejects_bad_steps():
    with pytest.raises(ValueError, match="total_steps"):
        optim.learning_rate_schedule(1e-3, warmup_steps=5, total_steps=5)
    with pytest.raises(ValueError, match="warmup_steps"):
        optim.learning_rate_schedule(1e-3, warmup_steps=-1)
