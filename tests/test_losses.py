"""Keep rules, policy losses and value loss against numpy written from docs/algorithms.md §4–6 and rlax."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import rlax

from sao_jax import losses
from sao_jax.losses import PolicyLossInputs

BATCH, TIME = 4, 16


def _random_inputs(seed, *, batch=BATCH, time=TIME, padding_logp=None):
    """Float32 inputs whose ratios straddle every band used below, with some padding tokens.

    log π_rollout is arbitrary; log π_old − log π_rollout ∈ [−1.5, 1.5] (IcePop k ∈ [0.22, 4.5]);
    log π_θ − log π_old ∈ [−0.6, 0.6] (PPO ratio in [0.55, 1.8]),
    so log π_θ − log π_rollout ∈ [−2.1, 2.1] (DIS ratio in [0.12, 8.2]).
    """
    rng = np.random.default_rng(seed)
    shape = (batch, time)
    rollout_logp = -rng.uniform(0.05, 4.0, shape)
    old_logp = rollout_logp + rng.uniform(-1.5, 1.5, shape)
    logp = old_logp + rng.uniform(-0.6, 0.6, shape)
    action_mask = rng.uniform(size=shape) < 0.75
    action_mask[:, 0] = False  # a prompt token in every row
    if padding_logp is not None:
        logp = np.where(action_mask, logp, padding_logp)
    advantages = rng.normal(size=shape) * action_mask
    rollout_entropy = rng.uniform(0.0, 3.0, shape)
    fresh_mask = rng.uniform(size=shape) < 0.6  # the tokens the trained weights sampled themselves (lag 0)
    return PolicyLossInputs(
        logp=jnp.asarray(logp, jnp.float32),
        rollout_logp=jnp.asarray(rollout_logp, jnp.float32),
        old_logp=jnp.asarray(old_logp, jnp.float32),
        advantages=jnp.asarray(advantages, jnp.float32),
        action_mask=jnp.asarray(action_mask),
        rollout_entropy=jnp.asarray(rollout_entropy, jnp.float32),
        fresh_mask=jnp.asarray(fresh_mask),
    )


def _np(inputs):
    """The inputs as float64 numpy arrays (the masks as bool; fresh_mask all-True when None)."""
    out = {k: np.asarray(v, np.float64) for k, v in inputs._asdict().items() if v is not None}
    out["action_mask"] = np.asarray(inputs.action_mask).astype(bool)
    fresh = inputs.fresh_mask if inputs.fresh_mask is not None else np.ones(inputs.action_mask.shape)
    out["fresh_mask"] = np.asarray(fresh).astype(bool)
    return out


def _x_with_exp_equal_to(value):
    """A float32 x with jnp.exp(x) == value exactly (searched around log(value))."""
    x = np.float32(np.log(value))
    for _ in range(8):
        exp_x = float(jnp.exp(x))
        if exp_x == value:
            return x
        x = np.nextafter(x, np.float32(np.inf if exp_x < value else -np.inf))
    raise AssertionError(f"no float32 x with exp(x) == {value}")


def _next_x_with_exp_past(x, direction):
    """The first float32 after x (towards sign(direction)) whose exp differs from exp(x)."""
    exp_x = float(jnp.exp(x))
    while float(jnp.exp(x)) == exp_x:
        x = np.nextafter(x, np.float32(direction * np.inf))
    return x


# ----------------------------------------------------------------------------- numpy references

def np_dis_keep(logp, rollout_logp, eps_low, eps_high):
    ratio = np.exp(logp - rollout_logp)
    return (1 - eps_low < ratio) & (ratio < 1 + eps_high)


def np_icepop_keep(old_logp, rollout_logp, alpha, beta):
    k = np.exp(old_logp - rollout_logp)
    return (alpha <= k) & (k <= beta)


def np_estr_keep(logp, rollout_logp, entropy, tau, eps):
    delta = logp - rollout_logp
    return delta**2 <= tau * (entropy + eps)


def np_ppo_family(x, reference_logp, keep, eps_low, eps_high):
    """Reference for PPO-clip / IcePop / ESTR: loss, gradient w.r.t. logp, dropped and clipped masks.

    The gradient of −min(rA, clip(r)A) w.r.t. log π is −rA where the unclipped branch is the
    smaller one (strictly, or r inside the clip range), and 0 where the clipped (constant) branch is.
    """
    action = x["action_mask"]
    num_action = max(action.sum(), 1)
    ratio = np.exp(x["logp"] - reference_logp)
    unclipped = ratio * x["advantages"]
    clipped_term = np.clip(ratio, 1 - eps_low, 1 + eps_high) * x["advantages"]
    contributes = action & keep
    loss = -np.sum(np.minimum(unclipped, clipped_term)[contributes]) / num_action
    clipped = contributes & (clipped_term < unclipped)
    grad = np.where(contributes & ~clipped, -unclipped / num_action, 0.0)
    return loss, grad, action & ~keep, clipped, ratio


def np_metrics(x, ratio, dropped, clipped):
    action = x["action_mask"]
    masked = (dropped | clipped) & action
    kept = action & ~masked
    entropy = x["rollout_entropy"]
    n = action.sum()
    return {
        "kept_fraction": kept.sum() / n,
        "masked_fraction": masked.sum() / n,
        "dropped_fraction": (dropped & action).sum() / n,
        "clipped_fraction": (clipped & action).sum() / n,
        "kept_entropy_mean": entropy[kept].mean() if kept.any() else 0.0,
        "masked_entropy_mean": entropy[masked].mean() if masked.any() else 0.0,
        "ratio_mean": ratio[action].mean(),
        "ratio_max": ratio[action].max(),
        "rollout_log_ratio_mean": (x["logp"] - x["rollout_logp"])[action].mean(),
        **np_mismatch(x, masked),
    }


def np_mismatch(x, masked):
    """|log μ − log π_θ| over the fresh action tokens (mean, max) and the share of them masked; NaN
    without a fresh token."""
    fresh = x["action_mask"] & x["fresh_mask"]
    gap = np.abs(x["rollout_logp"] - x["logp"])[fresh]
    if not fresh.any():
        return dict.fromkeys(("mismatch/logprob_abs_mean", "mismatch/logprob_abs_max", "mismatch/masked_fraction"),
                             np.nan)
    return {"mismatch/logprob_abs_mean": gap.mean(), "mismatch/logprob_abs_max": gap.max(),
            "mismatch/masked_fraction": masked[fresh].mean()}


def _assert_metrics_close(metrics, expected):
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(float(metrics[key]), value, rtol=1e-5, atol=1e-6, err_msg=key)


DIS_EPS = dict(eps_low=0.3, eps_high=5.0)
PPO_EPS = dict(eps_low=0.2, eps_high=0.28)
ESTR_TAU = 0.5


@pytest.fixture(scope="module")
def loss_and_grad():
    """Jitted (loss, metrics), d loss / d logp for each registered loss with fixed hyperparameters."""
    bound = {
        "dis": functools.partial(losses.POLICY_LOSSES["dis"], **DIS_EPS),
        "ppo_clip": functools.partial(losses.POLICY_LOSSES["ppo_clip"], **PPO_EPS),
        "icepop": functools.partial(losses.POLICY_LOSSES["icepop"], alpha=0.5, beta=5.0, **PPO_EPS),
        "estr": functools.partial(losses.POLICY_LOSSES["estr"], tau=ESTR_TAU, eps=0.01, **PPO_EPS),
        "ppo_clip_rollout": functools.partial(losses.POLICY_LOSSES["ppo_clip_rollout"], **PPO_EPS),
        "pg": losses.POLICY_LOSSES["pg"],
    }

    def make(loss_fn):
        def with_logp(logp, inputs):
            return loss_fn(inputs._replace(logp=logp))

        grad_fn = jax.value_and_grad(with_logp, has_aux=True)
        return jax.jit(lambda inputs: grad_fn(inputs.logp, inputs))

    return {name: make(fn) for name, fn in bound.items()}


# ----------------------------------------------------------------------------- keep masks

@pytest.mark.parametrize("seed", [0, 1])
def test_dis_mask_matches_formula_on_random_tokens(seed):
    x = _random_inputs(seed)
    for eps_low, eps_high in [(0.3, 5.0), (0.8, 3.0), (0.2, 0.28)]:
        mask = losses.dis_mask(x.logp, x.rollout_logp, eps_low=eps_low, eps_high=eps_high)
        expected = np_dis_keep(_np(x)["logp"], _np(x)["rollout_logp"], eps_low, eps_high)
        assert mask.dtype == jnp.bool_
        assert 0 < expected.sum() < expected.size
        np.testing.assert_array_equal(np.asarray(mask), expected)


def test_dis_mask_drops_ratios_exactly_on_either_bound():
    # Bounds 1−0.5 = 0.5 and 1+1 = 2 are exact in float32; x_* make exp(x) hit them exactly.
    x_low, x_high = _x_with_exp_equal_to(0.5), _x_with_exp_equal_to(2.0)
    inside_low, inside_high = _next_x_with_exp_past(x_low, +1), _next_x_with_exp_past(x_high, -1)
    assert 0.5 < float(jnp.exp(inside_low)) and float(jnp.exp(inside_high)) < 2.0
    logp = jnp.array([[x_low, inside_low, 0.0, inside_high, x_high]], jnp.float32)
    mask = losses.dis_mask(logp, jnp.zeros_like(logp), eps_low=0.5, eps_high=1.0)
    np.testing.assert_array_equal(np.asarray(mask), [[False, True, True, True, False]])
    # ε_low = 0: a ratio of exactly 1 is on the (open) lower bound.
    assert not bool(losses.dis_mask(jnp.zeros((1, 1)), jnp.zeros((1, 1)), eps_low=0.0, eps_high=1.0)[0, 0])


@pytest.mark.parametrize("seed", [0, 1])
def test_icepop_mask_matches_formula_on_random_tokens(seed):
    x = _random_inputs(seed)
    mask = losses.icepop_mask(x.old_logp, x.rollout_logp, alpha=0.5, beta=2.0)
    expected = np_icepop_keep(_np(x)["old_logp"], _np(x)["rollout_logp"], 0.5, 2.0)
    assert 0 < expected.sum() < expected.size
    np.testing.assert_array_equal(np.asarray(mask), expected)


def test_icepop_mask_keeps_ratios_exactly_on_either_bound():
    x_low, x_high = _x_with_exp_equal_to(0.5), _x_with_exp_equal_to(2.0)
    outside_low, outside_high = _next_x_with_exp_past(x_low, -1), _next_x_with_exp_past(x_high, +1)
    assert float(jnp.exp(outside_low)) < 0.5 and float(jnp.exp(outside_high)) > 2.0
    old_logp = jnp.array([[outside_low, x_low, 0.0, x_high, outside_high]], jnp.float32)
    mask = losses.icepop_mask(old_logp, jnp.zeros_like(old_logp), alpha=0.5, beta=2.0)
    np.testing.assert_array_equal(np.asarray(mask), [[False, True, True, True, False]])


@pytest.mark.parametrize("seed", [0, 1])
def test_estr_mask_matches_formula_on_random_tokens(seed):
    x = _random_inputs(seed)
    mask = losses.estr_mask(x.logp, x.rollout_logp, x.rollout_entropy, tau=ESTR_TAU, eps=0.01)
    n = _np(x)
    expected = np_estr_keep(n["logp"], n["rollout_logp"], n["rollout_entropy"], ESTR_TAU, 0.01)
    assert 0 < expected.sum() < expected.size
    np.testing.assert_array_equal(np.asarray(mask), expected)


def test_estr_mask_keeps_equality_and_drops_just_above():
    # δ = 0.5, H + ε = 1, τ = 0.25: δ² = τ(H+ε) exactly, kept; δ one ulp larger, dropped.
    delta = np.array([[0.5, np.nextafter(np.float32(0.5), np.float32(1.0)), -0.5]], np.float32)
    rollout_logp = np.full_like(delta, -1.0)
    logp = rollout_logp + delta
    assert np.array_equal(logp - rollout_logp, delta)  # the ulp survives the round trip
    mask = losses.estr_mask(
        jnp.asarray(logp), jnp.asarray(rollout_logp), jnp.ones_like(delta), tau=0.25, eps=0.0
    )
    np.testing.assert_array_equal(np.asarray(mask), [[True, False, True]])


def test_estr_mask_keeps_a_band_of_width_eps_where_the_rollout_was_certain():
    # H = 0 (a deterministic sampling step): the band is τ·ε alone. τ = 0.5, ε = 0.02 keep |δ| ≤ 0.1.
    delta = np.array([[0.0, 0.05, -0.099, 0.101, -0.2]], np.float32)
    rollout_logp = np.full_like(delta, -0.5)
    mask = losses.estr_mask(jnp.asarray(rollout_logp + delta), jnp.asarray(rollout_logp),
                            jnp.zeros_like(delta), tau=0.5, eps=0.02)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(mask), [[True, True, True, False, False]])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_calibrate_estr_tau_masks_the_target_fraction_within_one_token(seed):
    rng = np.random.default_rng(seed)
    shape = (8, 32)
    rollout_logp = jnp.asarray(-rng.uniform(0.1, 3.0, shape), jnp.float32)
    logp = rollout_logp + jnp.asarray(rng.normal(0.0, 0.3, shape), jnp.float32)
    entropy = jnp.asarray(rng.uniform(0.0, 2.0, shape), jnp.float32)
    action_mask = jnp.asarray(rng.uniform(size=shape) < 0.6)
    num_action = int(action_mask.sum())
    calibrate = jax.jit(functools.partial(losses.calibrate_estr_tau, eps=0.01))
    for target in [0.0, 0.013, 0.1, 0.37, 0.5, 0.9, 1.0]:
        tau = calibrate(logp, rollout_logp, entropy, action_mask, target_masked_fraction=target)
        keep = np_estr_keep(np.asarray(logp, np.float64), np.asarray(rollout_logp, np.float64),
                            np.asarray(entropy, np.float64), float(tau), 0.01)
        num_masked = int((~keep & np.asarray(action_mask)).sum())
        assert abs(num_masked - target * num_action) <= 1, (target, num_masked, num_action)


# ----------------------------------------------------------------------------- DIS

def test_dis_gradient_is_ratio_times_advantage_inside_band_and_exactly_zero_outside(loss_and_grad):
    # Padding tokens carry a huge logp (ratio overflows to inf) that must not leak NaN into the gradient.
    x = _random_inputs(3, padding_logp=200.0)
    # Also put overflowing ratios on a few action tokens: they are outside the band, so dropped.
    logp = np.asarray(x.logp).copy()
    logp[0, 1:4] = 150.0
    x = x._replace(logp=jnp.asarray(logp), action_mask=x.action_mask.at[0, 1:4].set(True))
    n = _np(x)
    keep = np_dis_keep(n["logp"], n["rollout_logp"], **DIS_EPS) & n["action_mask"]
    assert 0 < keep.sum() < n["action_mask"].sum()
    ratio = np.exp(n["logp"] - n["rollout_logp"])
    num_action = n["action_mask"].sum()
    expected_grad = np.where(keep, -ratio * n["advantages"] / num_action, 0.0)
    expected_loss = -np.sum((ratio * n["advantages"])[keep]) / num_action

    (loss, _), grad = loss_and_grad["dis"](x)
    np.testing.assert_allclose(float(loss), expected_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(grad)[~keep] == 0.0)


def test_dis_parameter_gradient_of_softmax_policy_matches_hand_derivation():
    # Policy: π(·|s_t) = softmax(s_t W); ∇_W log π(a|s) = s ⊗ (onehot(a) − π(·|s)).
    rng = np.random.default_rng(4)
    batch, time, dim, vocab = 2, 6, 3, 5
    states = rng.normal(size=(batch, time, dim))
    actions = rng.integers(0, vocab, size=(batch, time))
    weights = rng.normal(size=(dim, vocab))
    action_mask = np.ones((batch, time), bool)
    action_mask[:, 0] = False
    advantages = rng.normal(size=(batch, time))
    rollout_entropy = rng.uniform(0.0, 2.0, size=(batch, time))

    def policy_logp(w):
        log_probs = jax.nn.log_softmax(jnp.asarray(states, jnp.float32) @ w, axis=-1)
        return jnp.take_along_axis(log_probs, jnp.asarray(actions)[..., None], axis=-1)[..., 0]

    mismatch = rng.uniform(-1.5, 1.5, (batch, time))
    rollout_logp = np.asarray(policy_logp(jnp.asarray(weights, jnp.float32))) + mismatch

    def loss_of_weights(w):
        inputs = PolicyLossInputs(
            logp=policy_logp(w),
            rollout_logp=jnp.asarray(rollout_logp, jnp.float32),
            old_logp=None,
            advantages=jnp.asarray(advantages, jnp.float32),
            action_mask=jnp.asarray(action_mask),
            rollout_entropy=jnp.asarray(rollout_entropy, jnp.float32),
        )
        return losses.dis_loss(inputs, eps_low=0.3, eps_high=1.0)[0]

    grad = jax.grad(loss_of_weights)(jnp.asarray(weights, jnp.float32))

    logits = states @ weights
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    logp = np.log(probs[np.arange(batch)[:, None], np.arange(time)[None, :], actions])
    ratio = np.exp(logp - rollout_logp)
    keep = action_mask & (0.7 < ratio) & (ratio < 2.0)
    assert 0 < keep.sum() < action_mask.sum()
    expected = np.zeros_like(weights)
    for b in range(batch):
        for t in range(time):
            if keep[b, t]:
                score = np.eye(vocab)[actions[b, t]] - probs[b, t]
                expected += ratio[b, t] * advantages[b, t] * np.outer(states[b, t], score)
    expected *= -1.0 / action_mask.sum()
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- PPO family

@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_clip_matches_rlax_for_symmetric_epsilon(seed):
    x = _random_inputs(seed, padding_logp=100.0)
    action_index = np.flatnonzero(np.asarray(x.action_mask))

    def rlax_loss(logp):
        # rlax takes rank-1 arrays and means over them: pass the action tokens only.
        ratio = jnp.exp(logp.reshape(-1)[action_index] - x.old_logp.reshape(-1)[action_index])
        return rlax.clipped_surrogate_pg_loss(ratio, x.advantages.reshape(-1)[action_index], 0.2)

    def ours(logp):
        return losses.ppo_clip_loss(x._replace(logp=logp), eps_low=0.2, eps_high=0.2)[0]

    expected_loss, expected_grad = jax.value_and_grad(rlax_loss)(x.logp)
    loss, grad = jax.value_and_grad(ours)(x.logp)
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(expected_grad), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_clip_with_clip_higher_matches_numpy(seed, loss_and_grad):
    x = _random_inputs(seed, padding_logp=100.0)
    n = _np(x)
    keep_all = np.ones_like(n["action_mask"])
    loss_np, grad_np, dropped, clipped, ratio = np_ppo_family(n, n["old_logp"], keep_all, **PPO_EPS)
    assert clipped.any() and (n["action_mask"] & ~clipped).any()
    (loss, metrics), grad = loss_and_grad["ppo_clip"](x)
    np.testing.assert_allclose(float(loss), loss_np, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), grad_np, rtol=1e-5, atol=1e-7)
    _assert_metrics_close(metrics, np_metrics(n, ratio, dropped, clipped))


@pytest.mark.parametrize("seed", [0, 1])
def test_icepop_drops_by_old_over_rollout_and_clips_the_rest_like_numpy(seed, loss_and_grad):
    x = _random_inputs(seed, padding_logp=100.0)
    n = _np(x)
    keep = np_icepop_keep(n["old_logp"], n["rollout_logp"], 0.5, 5.0)
    loss_np, grad_np, dropped, clipped, ratio = np_ppo_family(n, n["old_logp"], keep, **PPO_EPS)
    assert dropped.any() and clipped.any()
    (loss, metrics), grad = loss_and_grad["icepop"](x)
    np.testing.assert_allclose(float(loss), loss_np, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), grad_np, rtol=1e-5, atol=1e-7)
    _assert_metrics_close(metrics, np_metrics(n, ratio, dropped, clipped))


@pytest.mark.parametrize("seed", [0, 1])
def test_estr_drops_by_entropy_scaled_mismatch_and_clips_ratio_to_rollout_like_numpy(seed, loss_and_grad):
    x = _random_inputs(seed, padding_logp=100.0)
    n = _np(x)
    keep = np_estr_keep(n["logp"], n["rollout_logp"], n["rollout_entropy"], ESTR_TAU, 0.01)
    loss_np, grad_np, dropped, clipped, ratio = np_ppo_family(n, n["rollout_logp"], keep, **PPO_EPS)
    assert dropped.any() and clipped.any()
    (loss, metrics), grad = loss_and_grad["estr"](x)
    np.testing.assert_allclose(float(loss), loss_np, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), grad_np, rtol=1e-5, atol=1e-7)
    _assert_metrics_close(metrics, np_metrics(n, ratio, dropped, clipped))


@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_clip_against_the_rollout_clips_the_ratio_to_mu_and_drops_nothing_like_numpy(seed, loss_and_grad):
    x = _random_inputs(seed, padding_logp=100.0)
    n = _np(x)
    keep_all = np.ones_like(n["action_mask"])
    loss_np, grad_np, dropped, clipped, ratio = np_ppo_family(n, n["rollout_logp"], keep_all, **PPO_EPS)
    assert clipped.any() and (n["action_mask"] & ~clipped).any() and not dropped.any()
    (loss, metrics), grad = loss_and_grad["ppo_clip_rollout"](x)
    np.testing.assert_allclose(float(loss), loss_np, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), grad_np, rtol=1e-5, atol=1e-7)
    _assert_metrics_close(metrics, np_metrics(n, ratio, dropped, clipped))


def test_plain_policy_gradient_weighs_every_action_token_by_its_advantage_alone(loss_and_grad):
    # L = −Σ Â log π_θ / N, written out token by token: however far π_θ drifted from μ (ratios up to
    # e^2.1 here), nothing is reweighted, clipped or dropped.
    x = _random_inputs(8, padding_logp=100.0)
    n = _np(x)
    total, count, grad = 0.0, 0, np.zeros_like(n["logp"])
    for b in range(BATCH):
        for t in range(TIME):
            if n["action_mask"][b, t]:
                total += n["advantages"][b, t] * n["logp"][b, t]
                count += 1
    for b in range(BATCH):
        for t in range(TIME):
            if n["action_mask"][b, t]:
                grad[b, t] = -n["advantages"][b, t] / count
    (loss, metrics), got = loss_and_grad["pg"](x)
    np.testing.assert_allclose(float(loss), -total / count, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got), grad, rtol=1e-5, atol=1e-8)
    nothing = np.zeros_like(n["action_mask"])
    _assert_metrics_close(metrics, np_metrics(n, np.exp(n["logp"] - n["rollout_logp"]), nothing, nothing))
    assert float(metrics["masked_fraction"]) == 0.0 and float(metrics["ratio_max"]) > 2.0


def test_mismatch_is_measured_on_fresh_action_tokens_only_and_is_nan_without_one(loss_and_grad):
    # Two rows, three action tokens each; row 0 fresh (lag 0), row 1 stale. |log μ − log π_θ| on row 0:
    # 0.1, 0.5, 2.0 → mean 0.8667, max 2.0; DIS (0.3, 5.0) drops ratio e^−2 < 0.7: 1 of 3 masked.
    # Row 1's larger gaps (3.0) do not count.
    logp = jnp.asarray([[0.0, -1.1, -0.5, -3.0], [0.0, -1.0, -1.0, -1.0]], jnp.float32)
    rollout_logp = jnp.asarray([[0.0, -1.0, -1.0, -1.0], [0.0, -4.0, 2.0, -4.0]], jnp.float32)
    action = jnp.asarray([[False, True, True, True]] * 2)
    inputs = PolicyLossInputs(logp=logp, rollout_logp=rollout_logp, old_logp=logp, advantages=jnp.ones_like(logp),
                              action_mask=action, rollout_entropy=jnp.ones_like(logp),
                              fresh_mask=jnp.asarray([[True] * 4, [False] * 4]))  # fmt: skip
    (_, metrics), _ = loss_and_grad["dis"](inputs)
    np.testing.assert_allclose(float(metrics["mismatch/logprob_abs_mean"]), (0.1 + 0.5 + 2.0) / 3, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["mismatch/logprob_abs_max"]), 2.0, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["mismatch/masked_fraction"]), 1 / 3, rtol=1e-6)
    # Over all action tokens: row 0's one and all three of row 1's (ratios e^3, e^−3, e^3).
    np.testing.assert_allclose(float(metrics["masked_fraction"]), 4 / 6, rtol=1e-6)
    (_, stale), _ = loss_and_grad["dis"](inputs._replace(fresh_mask=jnp.zeros_like(action)))
    assert all(np.isnan(float(stale[k])) for k in stale if k.startswith("mismatch/"))
    (_, all_fresh), _ = loss_and_grad["dis"](inputs._replace(fresh_mask=None))  # None: every action token
    np.testing.assert_allclose(float(all_fresh["mismatch/logprob_abs_max"]), 3.0, rtol=1e-6)


def test_dis_metrics_match_numpy(loss_and_grad):
    x = _random_inputs(5, padding_logp=100.0)
    n = _np(x)
    keep = np_dis_keep(n["logp"], n["rollout_logp"], **DIS_EPS)
    ratio = np.exp(n["logp"] - n["rollout_logp"])
    (_, metrics), _ = loss_and_grad["dis"](x)
    expected = np_metrics(n, ratio, n["action_mask"] & ~keep, np.zeros_like(keep))
    assert 0 < expected["masked_entropy_mean"]
    _assert_metrics_close(metrics, expected)


# ----------------------------------------------------------------------------- uniform interface

def test_every_loss_jits_and_returns_the_same_metric_keys_and_finite_gradients(loss_and_grad):
    x = _random_inputs(6, padding_logp=1e4)
    assert set(loss_and_grad) == set(losses.POLICY_LOSSES)
    for name, fn in loss_and_grad.items():
        (loss, metrics), grad = fn(x)
        assert set(metrics) == set(losses.POLICY_METRIC_KEYS), name
        assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad))), name
        assert np.all(np.asarray(grad)[~np.asarray(x.action_mask)] == 0.0), name


def test_batch_without_action_tokens_gives_zero_loss_zero_metrics_and_no_mismatch(loss_and_grad):
    x = _random_inputs(7)
    x = x._replace(action_mask=jnp.zeros_like(x.action_mask))
    for name, fn in loss_and_grad.items():
        (loss, metrics), grad = fn(x)
        assert float(loss) == 0.0 and not np.any(np.asarray(grad)), name
        assert all(float(v) == 0.0 for k, v in metrics.items() if not k.startswith("mismatch/")), name
        assert all(np.isnan(float(v)) for k, v in metrics.items() if k.startswith("mismatch/")), name


@pytest.mark.parametrize("name", ["ppo_clip", "icepop"])
def test_losses_that_need_old_logp_say_so(name):
    x = _random_inputs(0)._replace(old_logp=None)
    with pytest.raises(ValueError, match="old_logp"):
        losses.POLICY_LOSSES[name](x)


@pytest.mark.parametrize("name", ["dis", "estr", "ppo_clip_rollout", "pg"])
def test_losses_against_the_rollout_run_without_old_logp(name):
    x = _random_inputs(0)._replace(old_logp=None)
    hyper = {"dis": DIS_EPS, "estr": {"tau": ESTR_TAU}, "ppo_clip_rollout": PPO_EPS, "pg": {}}[name]
    loss, _ = losses.POLICY_LOSSES[name](x, **hyper)
    assert np.isfinite(float(loss))


# ----------------------------------------------------------------------------- KL penalty

def test_kl_penalty_matches_verls_low_var_kl_in_plain_python():
    # verl core_algos.kl_penalty(..., "low_var_kl"): kl = ref − logp; exp(kl) − kl − 1, averaged over
    # the response mask. Written out token by token here, with padding tokens that hold -inf.
    rng = np.random.default_rng(7)
    logp = -rng.uniform(0.01, 3.0, (3, 9))
    reference_logp = -rng.uniform(0.01, 3.0, (3, 9))
    action_mask = rng.uniform(size=(3, 9)) < 0.7
    action_mask[0, :2] = False
    total, count = 0.0, 0
    for b in range(3):
        for t in range(9):
            if action_mask[b, t]:
                delta = reference_logp[b, t] - logp[b, t]
                total += np.exp(delta) - delta - 1.0
                count += 1
    padded = np.where(action_mask, logp, -np.inf)
    got = losses.kl_penalty(jnp.asarray(padded, jnp.float32), jnp.asarray(reference_logp, jnp.float32),
                            jnp.asarray(action_mask))
    np.testing.assert_allclose(float(got), total / count, rtol=1e-5)
    assert float(losses.kl_penalty(jnp.asarray(logp), jnp.asarray(logp), jnp.asarray(action_mask))) == 0.0


def test_kl_penalty_gradient_on_policy_samples_is_the_mass_covering_kl_gradient():
    # One state, a softmax policy over 4 actions with logits w. Weighting each action's loss by its
    # probability (the expectation over on-policy samples, with π a constant as in sampling) must give
    # the closed-form gradient of KL(π_ref ‖ π_w) = Σ_a π_ref(a) (log π_ref(a) − log π_w(a)).
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=4), jnp.float32)
    reference_logp = jnp.asarray(np.log(rng.dirichlet(np.ones(4))), jnp.float32)
    probs = jax.nn.softmax(w)
    mask = jnp.ones((1, 1), bool)

    def expected_loss(weights):
        logp = jax.nn.log_softmax(weights)
        per_action = [losses.kl_penalty(logp[a].reshape(1, 1), reference_logp[a].reshape(1, 1), mask)
                      for a in range(4)]
        return sum(probs[a] * per_action[a] for a in range(4))

    def mass_covering_kl(weights):
        return jnp.sum(jnp.exp(reference_logp) * (reference_logp - jax.nn.log_softmax(weights)))

    # ∇_w KL(π_ref ‖ π_w) = π_w − π_ref for softmax logits, by hand.
    by_hand = np.asarray(probs) - np.exp(np.asarray(reference_logp))
    np.testing.assert_allclose(np.asarray(jax.grad(mass_covering_kl)(w)), by_hand, atol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(expected_loss)(w)), by_hand, atol=1e-6)


# ----------------------------------------------------------------------------- value loss

def _value_data(seed):
    rng = np.random.default_rng(seed)
    shape = (3, 10)
    values = rng.normal(size=shape)
    returns = values + rng.normal(0.0, 0.8, size=shape)
    old_values = values + rng.normal(0.0, 0.3, size=shape)
    action_mask = rng.uniform(size=shape) < 0.7
    return values, returns, old_values, action_mask


@pytest.mark.parametrize("seed", [0, 1])
def test_value_loss_and_explained_variance_match_numpy(seed):
    values, returns, _, action_mask = _value_data(seed)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    (loss, metrics), grad = jax.jit(jax.value_and_grad(losses.value_loss, has_aux=True))(
        f32(values), f32(returns), jnp.asarray(action_mask)
    )
    v, g = values[action_mask], returns[action_mask]
    n = action_mask.sum()
    np.testing.assert_allclose(float(loss), 0.5 * np.mean((v - g) ** 2), rtol=1e-5)
    expected_grad = np.where(action_mask, (values - returns) / n, 0.0)
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(metrics["explained_variance"]), 1 - np.var(g - v) / np.var(g), rtol=1e-4)
    np.testing.assert_allclose(float(metrics["value_mean"]), v.mean(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["return_mean"]), g.mean(), rtol=1e-5, atol=1e-6)
    assert float(metrics["clip_fraction"]) == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_value_clipping_takes_the_larger_error_and_blocks_gradient_where_clipped(seed):
    values, returns, old_values, action_mask = _value_data(seed)
    clip_eps = 0.2
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)

    def loss_fn(v):
        return losses.value_loss(
            v, f32(returns), jnp.asarray(action_mask), old_values=f32(old_values), clip_eps=clip_eps
        )

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(f32(values))
    unclipped = (values - returns) ** 2
    clipped_values = np.clip(values, old_values - clip_eps, old_values + clip_eps)
    clipped_error = (clipped_values - returns) ** 2
    clipped = action_mask & (clipped_error > unclipped)
    n = action_mask.sum()
    assert clipped.any() and (action_mask & ~clipped).any()
    expected_loss = 0.5 * np.maximum(unclipped, clipped_error)[action_mask].mean()
    np.testing.assert_allclose(float(loss), expected_loss, rtol=1e-5)
    expected_grad = np.where(action_mask & ~clipped, (values - returns) / n, 0.0)
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(metrics["clip_fraction"]), clipped.sum() / n, rtol=1e-6)


def test_explained_variance_is_zero_when_returns_are_constant_and_one_when_values_are_exact():
    action_mask = jnp.ones((2, 4), bool)
    returns = jnp.full((2, 4), 3.0)
    _, metrics = losses.value_loss(returns + 1.0, returns, action_mask)
    assert float(metrics["explained_variance"]) == 0.0
    varied = jnp.arange(8.0).reshape(2, 4)
    _, metrics = losses.value_loss(varied, varied, action_mask)
    assert float(metrics["explained_variance"]) == 1.0


def test_value_clipping_needs_both_old_values_and_clip_eps():
    values = jnp.zeros((1, 3))
    with pytest.raises(ValueError, match="old_values"):
        losses.value_loss(values, values, jnp.ones((1, 3), bool), clip_eps=0.2)


def test_token_logprobs_reads_the_previous_positions_prediction():
    from sao_jax.losses import token_logprobs

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    tokens = rng.integers(0, 7, size=(2, 5))
    got = np.asarray(token_logprobs(jnp.asarray(logits), jnp.asarray(tokens)))
    for b in range(2):
        assert got[b, 0] == 0.0
        for t in range(1, 5):
            row = logits[b, t - 1].astype(np.float64)
            expected = row[tokens[b, t]] - np.log(np.sum(np.exp(row)))
            np.testing.assert_allclose(got[b, t], expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------- HL-Gauss value head


def ref_hl_gauss_target(g, low, high, bins, sigma):
    """Plain Python, from the definition: N(g, σ²) truncated to [low, high], its mass per bin."""
    g = min(max(g, low), high)
    edges = [low + (high - low) * i / bins for i in range(bins + 1)]
    cdf = [0.5 * (1 + math.erf((e - g) / (sigma * math.sqrt(2)))) for e in edges]
    total = cdf[-1] - cdf[0]
    return [(cdf[i + 1] - cdf[i]) / total for i in range(bins)]


@pytest.mark.parametrize("g", [-3.0, -0.5, 0.0, 0.13, 0.5, 1.0, 1.5, 7.0])
def test_hl_gauss_target_is_the_truncated_normal_mass_per_bin(g):
    low, high, bins = -0.5, 1.5, 8
    sigma = 0.75 * (high - low) / bins
    got = np.asarray(losses.hl_gauss_target(jnp.asarray([g]), losses.hl_gauss_support(low, high, bins), sigma))[0]
    np.testing.assert_allclose(got, ref_hl_gauss_target(g, low, high, bins, sigma), atol=1e-6)
    assert abs(got.sum() - 1) < 1e-5


def test_hl_gauss_value_and_loss_against_numpy():
    rng = np.random.default_rng(3)
    low, high, bins, sigma = 0.0, 1.0, 5, 0.15
    logits = rng.normal(size=(2, 3, bins)).astype(np.float32)
    returns = rng.uniform(-0.2, 1.2, size=(2, 3)).astype(np.float32)
    mask = np.array([[1, 0, 1], [1, 1, 0]], bool)
    edges = losses.hl_gauss_support(low, high, bins)
    centers = (np.linspace(low, high, bins + 1)[:-1] + np.linspace(low, high, bins + 1)[1:]) / 2
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(losses.hl_gauss_values(jnp.asarray(logits), edges), probs @ centers, rtol=1e-5)
    loss, metrics = losses.hl_gauss_value_loss(jnp.asarray(logits), jnp.asarray(returns), jnp.asarray(mask),
                                               edges=edges, sigma=sigma)  # fmt: skip
    cross_entropy = [-sum(p * math.log(q) for p, q in zip(ref_hl_gauss_target(float(returns[b, t]), low, high, bins,
                                                                               sigma), probs[b, t]))
                     for b, t in zip(*np.nonzero(mask))]  # fmt: skip
    np.testing.assert_allclose(float(loss), np.mean(cross_entropy), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["value_mean"]), (probs @ centers)[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["return_mean"]), returns[mask].mean(), rtol=1e-5)


def test_minimising_the_hl_gauss_loss_predicts_the_return():
    # Free logits per token, trained to convergence: the predicted value lands on each return (to a
    # small fraction of a bin), including returns between bin centres.
    returns = jnp.asarray([[0.0, 0.3, 1.0, 0.77]])
    edges = losses.hl_gauss_support(-0.5, 1.5, 20)
    logits = jnp.zeros((1, 4, 20))
    tx = optax.adam(0.1)
    opt_state = tx.init(logits)
    grad = jax.jit(jax.grad(lambda x: losses.hl_gauss_value_loss(x, returns, jnp.ones((1, 4)), edges=edges,
                                                                 sigma=0.075)[0]))  # fmt: skip
    for _ in range(300):
        updates, opt_state = tx.update(grad(logits), opt_state)
        logits = optax.apply_updates(logits, updates)
    np.testing.assert_allclose(losses.hl_gauss_values(logits, edges), returns, atol=0.01)
