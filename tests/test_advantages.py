"""Advantage estimators against slow plain-Python references written from docs/algorithms.md, against
rlax and Tunix, and against properties that must hold (hypothesis)."""

import collections
import functools
import math

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rlax
from hypothesis import given, settings
from hypothesis import strategies as st

from sao_jax import advantages as adv

METHODS = ("scan", "associative", "kernel")  # skip_observation_gae (and cross_observation_gae)
STEP_METHODS = ("scan", "associative")  # step_gae has no kernel
RTOL = ATOL = 2e-5


# ----------------------------------------------------------------------------------------------
# Plain-Python references, one row at a time, float64, written from the formulas.


def ref_skip_observation_gae(r, v, m, gamma, lam):
    """docs/algorithms.md §1 with p_j the action positions, R_j = Σ r[p_j : p_{j+1}]."""
    time = len(r)
    p = [t for t in range(time) if m[t]]
    advantages, returns = np.zeros(time), np.zeros(time)
    next_advantage = 0.0
    for j in reversed(range(len(p))):
        end = p[j + 1] if j + 1 < len(p) else time
        reward = sum(float(r[t]) for t in range(p[j], end))
        next_value = float(v[p[j + 1]]) if j + 1 < len(p) else 0.0
        delta = reward + gamma * next_value - float(v[p[j]])
        next_advantage = delta + gamma * lam * next_advantage
        advantages[p[j]] = next_advantage
        returns[p[j]] = next_advantage + float(v[p[j]])
    return advantages, returns


def ref_cross_observation_gae(r, v, action, valid, gamma, lam):
    """Every valid token a step; padding rewards go to the valid token before them."""
    time = len(r)
    q = [t for t in range(time) if valid[t]]
    advantages, returns = np.zeros(time), np.zeros(time)
    next_advantage = 0.0
    for i in reversed(range(len(q))):
        end = q[i + 1] if i + 1 < len(q) else time
        reward = sum(float(r[t]) for t in range(q[i], end))
        next_value = float(v[q[i + 1]]) if i + 1 < len(q) else 0.0
        next_advantage = reward + gamma * next_value - float(v[q[i]]) + gamma * lam * next_advantage
        advantages[q[i]] = next_advantage if action[q[i]] else 0.0
        returns[q[i]] = next_advantage + float(v[q[i]])
    return advantages, returns


def ref_spans(m):
    """[(start, end)] of the contiguous action spans."""
    spans, t = [], 0
    while t < len(m):
        if m[t]:
            start = t
            while t < len(m) and m[t]:
                t += 1
            spans.append((start, t))
        else:
            t += 1
    return spans


def ref_step_gae(r, v, m, gamma, lam, value_reduce):
    time = len(r)
    spans = ref_spans(m)
    n = len(spans)
    step_reward = [sum(float(x) for x in r[s:(spans[i + 1][0] if i + 1 < n else time)])
                   for i, (s, _) in enumerate(spans)]
    step_value = [float(np.mean(np.asarray(v[s:e], np.float64))) if value_reduce == "mean"
                  else float(v[e - 1]) for s, e in spans]
    advantages, returns = np.zeros(time), np.zeros(time)
    next_advantage = 0.0
    for i in reversed(range(n)):
        next_value = step_value[i + 1] if i + 1 < n else 0.0
        next_advantage = (step_reward[i] + gamma * next_value - step_value[i]
                          + gamma * lam * next_advantage)
        s, e = spans[i]
        advantages[s:e] = next_advantage
        returns[s:e] = next_advantage + step_value[i]
    return advantages, returns


def ref_batch(ref, *arrays, gamma, lam, **kwargs):
    """Applies a row reference to every row; γ and λ scalars or per row."""
    batch = arrays[0].shape[0]
    lam = np.broadcast_to(np.asarray(lam, np.float64), (batch,))
    rows = [ref(*(a[b] for a in arrays), gamma, float(lam[b]), **kwargs) for b in range(batch)]
    return np.stack([a for a, _ in rows]), np.stack([g for _, g in rows])


# ----------------------------------------------------------------------------------------------
# Batches.

B, T = 6, 24  # random batches; one shape so each jitted function compiles once


def random_trajectories(rng, batch=B, time=T, padding=True):
    """prompt ‖ a ‖ o ‖ a ‖ … ‖ padding, with rewards everywhere a reward can be credited."""
    action = np.zeros((batch, time), bool)
    valid = np.ones((batch, time), bool)
    for row in range(batch):
        t = int(rng.integers(0, 4))  # prompt
        end = time - (int(rng.integers(0, 4)) if padding else 0)
        valid[row, end:] = False
        while t < end:
            span = int(rng.integers(1, 6))
            action[row, t:min(t + span, end)] = True
            t += span + int(rng.integers(0, 4))
    rewards = rng.normal(size=(batch, time)).astype(np.float32)
    rewards[np.cumsum(action, axis=1) == 0] = 0  # nothing before the first action
    rewards[~valid] = 0
    values = rng.normal(size=(batch, time)).astype(np.float32)
    return rewards, values, action, valid


def edge_case_trajectories():
    """Hand-built rows, time 12. 1 = action, 0 = observation/prompt, 'p' = padding."""
    layouts = [
        "000000000000",  # no action tokens at all
        "111111111111",  # all action tokens
        "001100111000",  # leading prompt, trailing observation after the last action
        "110011001100",  # no prompt, rewards on observations
        "0111100100pp",  # prompt, observation, padding
        "1ppppppppppp",  # a single action, then padding
    ]
    action = np.array([[c == "1" for c in row] for row in layouts])
    valid = np.array([[c != "p" for c in row] for row in layouts])
    rng = np.random.default_rng(7)
    rewards = rng.normal(size=action.shape).astype(np.float32)
    rewards[np.cumsum(action, axis=1) == 0] = 0
    rewards[~valid] = 0
    rewards[2, 9:] = [0.5, -1.0, 2.0]  # trailing observation rewards are credited to the last action
    values = rng.normal(size=action.shape).astype(np.float32)
    return rewards, values, action, valid


@pytest.fixture(scope="module")
def skip_gae():
    """method → jitted skip_observation_gae with γ, λ as traced arguments."""
    return {method: jax.jit(lambda r, v, m, g, l, method=method: adv.skip_observation_gae(
        r, v, m, gamma=g, lam=l, method=method)) for method in METHODS}


GAMMA_LAM = [(0.9, 0.8), (1.0, 1.0), (0.0, 0.7), (0.8, 0.0), (1.0, 0.0), (0.0, 1.0)]


# ----------------------------------------------------------------------------------------------
# skip_observation_gae


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("gamma,lam", GAMMA_LAM)
def test_skip_observation_gae_matches_reference_on_random_batches(skip_gae, method, gamma, lam):
    rewards, values, action, _ = random_trajectories(np.random.default_rng(0))
    got = skip_gae[method](rewards, values, action, gamma, lam)
    want = ref_batch(ref_skip_observation_gae, rewards, values, action, gamma=gamma, lam=lam)
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got[1], want[1], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("gamma,lam", GAMMA_LAM)
def test_skip_observation_gae_matches_reference_on_edge_cases(skip_gae, method, gamma, lam):
    rewards, values, action, _ = edge_case_trajectories()
    got_advantages, got_returns = skip_gae[method](rewards, values, action, gamma, lam)
    want = ref_batch(ref_skip_observation_gae, rewards, values, action, gamma=gamma, lam=lam)
    np.testing.assert_allclose(got_advantages, want[0], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got_returns, want[1], rtol=RTOL, atol=ATOL)
    assert not np.any(got_advantages[0]) and not np.any(got_returns[0])  # no actions: all zero
    assert not np.any(np.asarray(got_advantages)[~action])


@pytest.mark.parametrize("method", METHODS)
def test_skip_observation_gae_per_sequence_lambda(skip_gae, method):
    rewards, values, action, _ = random_trajectories(np.random.default_rng(1))
    lam = np.array([0.0, 0.3, 0.5, 0.9, 0.99, 1.0], np.float32)
    got_advantages, _ = skip_gae[method](rewards, values, action, 0.95, lam)
    want, _ = ref_batch(ref_skip_observation_gae, rewards, values, action, gamma=0.95, lam=lam)
    np.testing.assert_allclose(got_advantages, want, rtol=RTOL, atol=ATOL)


def test_reward_on_observation_is_credited_to_crossing_transition():
    # a_0 o o a_1: a reward on an observation token reaches a_0 only, undiscounted.
    action = np.array([[True, False, False, True]])
    values = np.zeros((1, 4), np.float32)
    rewards = np.array([[0.0, 1.0, 0.0, 0.0]], np.float32)
    for method in METHODS:
        advantages, _ = jax.jit(functools.partial(
            adv.skip_observation_gae, gamma=0.5, lam=0.5, method=method))(rewards, values, action)
        np.testing.assert_allclose(advantages, [[1.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize("method", METHODS)
def test_skip_observation_gae_equals_rlax_without_observations(skip_gae, method):
    rng = np.random.default_rng(2)
    rewards = rng.normal(size=(B, T)).astype(np.float32)
    values = rng.normal(size=(B, T)).astype(np.float32)
    lam = rng.uniform(size=B).astype(np.float32)
    gamma = 0.97

    def rlax_row(r, v, l):
        # rlax convention: r_t, discount_t at times 1..T and V at times 0..T; V_T = 0 bootstraps.
        return rlax.truncated_generalized_advantage_estimation(
            r, jnp.full_like(r, gamma), l, jnp.append(v, 0.0))

    want = jax.vmap(rlax_row)(rewards, values, lam)
    got, _ = skip_gae[method](rewards, values, np.ones((B, T), bool), gamma, lam)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.slow  # importing Tunix takes several seconds
def test_skip_observation_gae_matches_tunix_when_observations_carry_no_reward():
    pytest.importorskip("tunix")
    try:
        from tunix.rl.ppo import ppo_helpers
    except ImportError:  # some google-tunix 0.1.7 wheels keep the PPO helpers in algo_core
        from tunix.rl import algo_core as ppo_helpers
    rewards, values, action, _ = random_trajectories(np.random.default_rng(3))
    rewards[~action] = 0  # Tunix drops rewards on masked tokens; ours credits them
    tunix_advantages, tunix_returns = ppo_helpers.compute_gae_advantages(
        rewards, values, action.astype(np.float32), 0.9, 0.8)
    advantages, returns = adv.skip_observation_gae(rewards, values, action, gamma=0.9, lam=0.8)
    # Tunix whitens its advantages inside (Bessel-corrected variance, as masked_whiten).
    np.testing.assert_allclose(adv.masked_whiten(advantages, action)[action],
                               np.asarray(tunix_advantages)[action], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(returns[action], np.asarray(tunix_returns)[action], rtol=RTOL,
                               atol=ATOL)


def test_unassigned_reward_is_the_reward_before_the_first_action():
    rewards, _, action, _ = edge_case_trajectories()
    rewards = rewards + 1.0  # now every token carries reward
    got = jax.jit(adv.unassigned_reward)(rewards, action)
    want = [sum(float(x) for x in rewards[b, :(np.flatnonzero(action[b])[0] if action[b].any()
                                                 else len(action[b]))])
            for b in range(len(rewards))]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[0] > 0 and got[1] == 0  # the row without actions loses everything


def test_gae_errors_name_the_bad_argument():
    rewards, values, action, _ = random_trajectories(np.random.default_rng(0))
    with pytest.raises(ValueError, match="method"):
        adv.skip_observation_gae(rewards, values, action, gamma=1.0, lam=1.0, method="fast")
    with pytest.raises(ValueError, match="lam"):
        adv.skip_observation_gae(rewards, values, action, gamma=1.0, lam=np.ones(B + 1))
    with pytest.raises(ValueError, match="value_reduce"):
        adv.step_gae(rewards, values, action, gamma=1.0, lam=1.0, value_reduce="max")
    with pytest.raises(AssertionError):  # chex: shapes differ
        adv.skip_observation_gae(rewards, values[:, 1:], action, gamma=1.0, lam=1.0)


# ----------------------------------------------------------------------------------------------
# Hypothesis properties (fixed small shapes: one compilation per jitted function).

HB, HT = 3, 16
masks = hnp.arrays(np.bool_, (HB, HT))
floats = hnp.arrays(np.float32, (HB, HT), elements=st.floats(-2, 2, width=32))
FEW = settings(max_examples=30, deadline=None)


@FEW
@given(action=masks, rewards=floats, values=floats, method=st.sampled_from(METHODS))
def test_returns_are_reward_to_go_when_gamma_and_lambda_are_one(skip_gae, action, rewards, values,
                                                                 method):
    rewards = np.where(np.cumsum(action, axis=1) > 0, rewards, 0).astype(np.float32)
    _, returns = skip_gae[method](rewards, values, action, 1.0, 1.0)
    reward_to_go = np.cumsum(rewards[:, ::-1].astype(np.float64), axis=1)[:, ::-1]
    np.testing.assert_allclose(np.asarray(returns)[action], reward_to_go[action], rtol=1e-4,
                               atol=1e-4)


@FEW
@given(action=hnp.arrays(np.bool_, (HB, HT - 4)),
       rewards=hnp.arrays(np.float32, (HB, HT - 4), elements=st.floats(-2, 2, width=32)),
       values=floats, insert_at=st.lists(st.integers(0, HT - 4), min_size=4, max_size=4),
       method=st.sampled_from(METHODS))
def test_inserting_zero_reward_observations_leaves_action_advantages_unchanged(
        skip_gae, action, rewards, values, insert_at, method):
    base_values = values[:, :HT - 4]
    before, _ = skip_gae[method](rewards, base_values, action, 0.9, 0.7)
    # np.insert places the 4 new tokens before the given original positions.
    positions = sorted(insert_at)
    longer_action = np.insert(action, positions, False, axis=1)
    longer_rewards = np.insert(rewards, positions, 0.0, axis=1)
    longer_values = np.insert(base_values, positions, 0.0, axis=1)
    inserted = np.insert(np.zeros_like(action), positions, True, axis=1)
    longer_values[inserted] = values[:, HT - 4:].reshape(-1)  # arbitrary critic values there
    after, _ = skip_gae[method](longer_rewards, longer_values, longer_action, 0.9, 0.7)
    np.testing.assert_allclose(np.asarray(after)[longer_action], np.asarray(before)[action],
                               rtol=1e-5, atol=1e-5)


@FEW
@given(action=masks, rewards=floats, values=floats, method=st.sampled_from(METHODS))
def test_moving_observation_reward_to_preceding_action_leaves_advantages_unchanged(
        skip_gae, action, rewards, values, method):
    moved = np.zeros_like(rewards)
    for b in range(HB):
        last_action = -1
        for t in range(HT):
            last_action = t if action[b, t] else last_action
            if last_action >= 0:  # rewards before the first action are not credited anyway
                moved[b, last_action] += rewards[b, t]
    before, _ = skip_gae[method](rewards, values, action, 0.9, 0.7)
    after, _ = skip_gae[method](moved, values, action, 0.9, 0.7)
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# jit, vmap, grad


@pytest.mark.parametrize("method", METHODS)
def test_jit_compiles_once_per_shape(method):
    traces = []

    @jax.jit
    def gae(rewards, values, action, lam):
        traces.append(None)
        return adv.skip_observation_gae(rewards, values, action, gamma=1.0, lam=lam, method=method)

    for seed in (0, 1):
        rewards, values, action, _ = random_trajectories(np.random.default_rng(seed))
        gae(rewards, values, action, np.full(B, 0.5 + 0.1 * seed, np.float32))
    assert len(traces) == 1
    assert gae._cache_size() == 1


@pytest.mark.parametrize("method", METHODS)
def test_vmap_over_an_extra_leading_axis(method):
    rng = np.random.default_rng(4)
    batches = [random_trajectories(rng)[:3] for _ in range(2)]
    stacked = [np.stack(parts) for parts in zip(*batches)]
    got, _ = jax.jit(jax.vmap(functools.partial(
        adv.skip_observation_gae, gamma=0.9, lam=0.8, method=method)))(*stacked)
    for i, (rewards, values, action) in enumerate(batches):
        want, _ = ref_batch(ref_skip_observation_gae, rewards, values, action, gamma=0.9, lam=0.8)
        np.testing.assert_allclose(got[i], want, rtol=RTOL, atol=ATOL)


def finite_difference_value_gradient(ref, rewards, values, action, weights, **kwargs):
    """∂/∂V of Σ w·A for a reference that is linear in V: exact with unit steps."""
    base = np.sum(weights * ref_batch(ref, rewards, values, action, **kwargs)[0])
    gradient = np.zeros(values.shape)
    for index in np.ndindex(values.shape):
        bumped = values.astype(np.float64)
        bumped[index] += 1.0
        gradient[index] = np.sum(weights * ref_batch(ref, rewards, bumped, action, **kwargs)[0]) - base
    return gradient


@pytest.mark.parametrize("method", METHODS)
def test_gradient_with_respect_to_values(method):
    rewards, values, action, _ = random_trajectories(np.random.default_rng(5), batch=2, time=10)
    weights = np.random.default_rng(6).normal(size=values.shape)

    def weighted_advantage(values):
        advantages, _ = adv.skip_observation_gae(rewards, values, action, gamma=0.9, lam=0.8,
                                                 method=method)
        return jnp.sum(weights * advantages)

    got = jax.jit(jax.grad(weighted_advantage))(values)
    want = finite_difference_value_gradient(ref_skip_observation_gae, rewards, values, action,
                                            weights, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# cross_observation_gae, step_gae


@pytest.fixture(scope="module")
def cross_gae():
    return {method: jax.jit(lambda r, v, m, valid, g, l, method=method: adv.cross_observation_gae(
        r, v, m, valid, gamma=g, lam=l, method=method)) for method in METHODS}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("gamma,lam", [(0.9, 0.8), (1.0, 1.0), (0.0, 0.5)])
def test_cross_observation_gae_matches_reference(cross_gae, method, gamma, lam):
    for rewards, values, action, valid in (random_trajectories(np.random.default_rng(8)),
                                           edge_case_trajectories()):
        rewards = np.where(valid, rewards + 0.25, 0).astype(np.float32)  # prompt rewards too
        got_advantages, got_returns = cross_gae[method](rewards, values, action, valid, gamma, lam)
        want = [np.stack(x) for x in zip(*(
            ref_cross_observation_gae(rewards[b], values[b], action[b], valid[b], gamma, lam)
            for b in range(len(rewards))))]
        np.testing.assert_allclose(got_advantages, want[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(got_returns, want[1], rtol=RTOL, atol=ATOL)


def test_cross_observation_gae_differs_from_skip_when_observations_have_values():
    # Guards against the two collapsing into one: the observation's value enters the cross δ.
    action = np.array([[True, False, True]])
    rewards = np.zeros((1, 3), np.float32)
    values = np.array([[0.0, 5.0, 0.0]], np.float32)
    skip, _ = adv.skip_observation_gae(rewards, values, action, gamma=1.0, lam=0.0)
    cross, _ = adv.cross_observation_gae(rewards, values, action, np.ones_like(action), gamma=1.0,
                                         lam=0.0)
    assert float(skip[0, 0]) == 0.0 and float(cross[0, 0]) == 5.0


@pytest.fixture(scope="module")
def step_gae():
    """(value_reduce, method) → jitted step_gae with γ, λ as traced arguments."""
    return {(reduce, method): jax.jit(
        lambda r, v, m, g, l, reduce=reduce, method=method: adv.step_gae(
            r, v, m, gamma=g, lam=l, value_reduce=reduce, method=method))
        for reduce in ("mean", "last") for method in STEP_METHODS}


@pytest.mark.parametrize("method", STEP_METHODS)
@pytest.mark.parametrize("value_reduce", ["mean", "last"])
@pytest.mark.parametrize("gamma,lam", [(0.9, 0.8), (1.0, 1.0), (0.0, 0.5), (0.7, 0.0)])
def test_step_gae_matches_reference(step_gae, method, value_reduce, gamma, lam):
    for rewards, values, action, _ in (random_trajectories(np.random.default_rng(9)),
                                       edge_case_trajectories()):
        lam_per_row = np.linspace(0, lam, len(rewards)).astype(np.float32)  # per-sequence λ
        got_advantages, got_returns = step_gae[value_reduce, method](
            rewards, values, action, gamma, lam_per_row)
        want = ref_batch(ref_step_gae, rewards, values, action, gamma=gamma, lam=lam_per_row,
                         value_reduce=value_reduce)
        np.testing.assert_allclose(got_advantages, want[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(got_returns, want[1], rtol=RTOL, atol=ATOL)


def test_step_gae_gradient_with_respect_to_values():
    rewards, values, action, _ = random_trajectories(np.random.default_rng(10), batch=2, time=10)
    weights = np.random.default_rng(11).normal(size=values.shape)

    def weighted_advantage(values):
        advantages, _ = adv.step_gae(rewards, values, action, gamma=0.9, lam=0.8,
                                     value_reduce="mean")
        return jnp.sum(weights * advantages)

    got = jax.jit(jax.grad(weighted_advantage))(values)
    want = finite_difference_value_gradient(ref_step_gae, rewards, values, action, weights,
                                            gamma=0.9, lam=0.8, value_reduce="mean")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_action_span_index():
    _, _, action, _ = random_trajectories(np.random.default_rng(12))
    got = np.asarray(adv.action_span_index(action))
    for b in range(B):
        want = np.full(T, -1)
        for i, (start, _) in enumerate(ref_spans(action[b])):
            want[start:] = i
        np.testing.assert_array_equal(got[b], want)


# ----------------------------------------------------------------------------------------------
# λ schedule, masked statistics, outcome baselines


def test_length_adaptive_lambda():
    lengths = np.array([0, 1, 2, 10, 1000, 10**9])
    got = np.asarray(adv.length_adaptive_lambda(lengths, 1.5))
    want = [0.0, 1 - 1 / 1.5, 1 - 1 / 3, 1 - 1 / 15, 1 - 1 / 1500]
    np.testing.assert_allclose(got[:5], want, rtol=1e-6)
    assert 0.999 < got[5] < 1.0  # clipped below 1 even where f32 rounds to 1


def test_masked_statistics_match_numpy():
    rng = np.random.default_rng(13)
    x = rng.normal(size=(4, 9)).astype(np.float32)
    mask = rng.random((4, 9)) < 0.6
    np.testing.assert_allclose(adv.masked_mean(x, mask), x[mask].mean(), rtol=1e-6)
    np.testing.assert_allclose(adv.masked_mean(x, mask, axis=1),
                               [x[b][mask[b]].mean() for b in range(4)], rtol=1e-6)
    np.testing.assert_allclose(adv.masked_var(x, mask), x[mask].var(ddof=1), rtol=1e-5)
    np.testing.assert_allclose(adv.masked_var(x, mask, unbiased=False), x[mask].var(), rtol=1e-5)
    whitened = np.asarray(adv.masked_whiten(x, mask))
    np.testing.assert_allclose(whitened[mask], (x[mask] - x[mask].mean())
                               / np.sqrt(x[mask].var(ddof=1) + 1e-8), rtol=1e-5, atol=1e-6)
    assert not whitened[~mask].any()
    unshifted = np.asarray(adv.masked_whiten(x, mask, shift_mean=False))
    np.testing.assert_allclose(unshifted[mask], whitened[mask] + x[mask].mean(), rtol=1e-5,
                               atol=1e-6)
    assert float(adv.masked_mean(x, np.zeros_like(mask))) == 0.0


def test_grpo_advantages_match_numpy_and_zero_std_groups_get_zero():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.5, 2.0, -1.0, 0.0]],
                       np.float32)
    got = np.asarray(adv.grpo_advantages(rewards))
    mean = rewards.mean(axis=1, keepdims=True)
    std = rewards.std(axis=1, ddof=1, keepdims=True)
    np.testing.assert_allclose(got, (rewards - mean) / (std + 1e-6), rtol=1e-5)
    assert not got[1].any()
    with pytest.raises(ValueError, match="group_size"):
        adv.grpo_advantages(rewards[:, :1])


def test_rloo_advantages_match_leave_one_out_loop():
    rewards = np.random.default_rng(14).normal(size=(3, 5)).astype(np.float32)
    want = [[rewards[g, i] - np.mean(np.delete(rewards[g], i)) for i in range(5)] for g in range(3)]
    np.testing.assert_allclose(adv.rloo_advantages(rewards), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="group size"):
        adv.rloo_advantages(rewards[:, :1])


@pytest.mark.parametrize("num_keys,window", [(5, 8), (1, 128), (3, 2)])
def test_running_mean_matches_deque_reference(num_keys, window):
    rng = np.random.default_rng(15)
    update = jax.jit(adv.running_mean_advantages)
    state = adv.running_mean_init(num_keys, window)
    history = [collections.deque(maxlen=window) for _ in range(num_keys)]
    seen = np.zeros(num_keys, int)
    for _ in range(6):  # enough batches for every window to wrap around
        keys = rng.integers(0, num_keys, size=32)  # repeated keys within a batch too
        rewards = rng.normal(size=32).astype(np.float32)
        got, state = update(state, keys, rewards)
        want = []
        for key, reward in zip(keys, rewards):
            baseline = np.mean(history[key]) if history[key] else 0.0
            want.append(reward - baseline)
            history[key].append(float(reward))
            seen[key] += 1
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(state.count, seen)


def test_running_mean_invalid_rows_neither_read_nor_write():
    rng = np.random.default_rng(17)
    keys = rng.integers(0, 3, size=12)
    rewards = rng.normal(size=12).astype(np.float32)
    valid = rng.random(12) < 0.6
    got, state = adv.running_mean_advantages(adv.running_mean_init(3, 4), keys, rewards, valid=valid)
    # the same as feeding only the valid elements, with 0 for the rest
    want, want_state = adv.running_mean_advantages(adv.running_mean_init(3, 4), keys[valid], rewards[valid])
    np.testing.assert_allclose(np.asarray(got)[valid], want, rtol=1e-6)
    assert not np.asarray(got)[~valid].any()
    np.testing.assert_array_equal(state.count, want_state.count)
    np.testing.assert_array_equal(state.rewards, want_state.rewards)


# ----------------------------------------------------------------------------------------------
# TRACE


def ref_trace_turn_rewards(logprob, num_turns, outcome, k, gamma_td, lambda_term, max_turns):
    distance = [-float(logprob[s]) + 0.1 for s in range(num_turns + 1)]
    value = [math.log(distance[0] / distance[s]) for s in range(num_turns + 1)]
    td = [value[s + 1] - value[s] for s in range(num_turns)]
    rewards = [0.0] * max_turns
    for turn in range(num_turns):
        horizon = min(turn + k - 1, num_turns - 1)
        weights = [gamma_td ** (u - turn) for u in range(turn, horizon + 1)]
        credit = sum(w * td[u] for w, u in zip(weights, range(turn, horizon + 1))) / sum(weights)
        if horizon == num_turns - 1:
            credit += lambda_term * gamma_td ** (num_turns - turn) * outcome
        rewards[turn] = credit
    return rewards


@pytest.mark.parametrize("k", [1, 3, 4])
def test_trace_turn_rewards_match_reference(k):
    rng = np.random.default_rng(16)
    max_turns = 6
    num_turns = np.array([0, 1, 2, 3, 5, 6])  # T < K, T = K, T > K, full
    logprob = -rng.uniform(0.05, 4.0, size=(6, max_turns + 1)).astype(np.float32)
    for b, turns in enumerate(num_turns):
        logprob[b, turns + 1:] = 5.0  # padding garbage: d ≤ 0 there would give NaN if read
    outcome = np.asarray(adv.grpo_advantages(rng.normal(size=(2, 3)).astype(np.float32))).ravel()
    got = np.asarray(jax.jit(functools.partial(adv.trace_turn_rewards, k=k))(
        logprob, num_turns, outcome))
    want = [ref_trace_turn_rewards(logprob[b], num_turns[b], outcome[b], k, 0.8, 2.0, max_turns)
            for b in range(6)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.isfinite(got).all()


def test_trace_terminal_term_reaches_only_the_last_k_turns():
    # Flat reference log-probs: δ = 0, so r_k is the terminal term alone.
    logprob = np.full((1, 6), -1.0, np.float32)
    got = np.asarray(adv.trace_turn_rewards(logprob, np.array([5]), np.array([1.0]), k=3))
    want = [0.0, 0.0] + [2.0 * 0.8 ** (5 - k) for k in (2, 3, 4)]
    np.testing.assert_allclose(got[0], want, rtol=1e-6)


def test_trace_token_advantages():
    rng = np.random.default_rng(17)
    _, _, action, _ = random_trajectories(rng)
    turn_index = np.asarray(adv.action_span_index(action))
    max_turns = int(turn_index.max()) + 1
    turn_rewards = rng.normal(size=(B, max_turns)).astype(np.float32)
    outcome = rng.normal(size=B).astype(np.float32)
    got = np.asarray(adv.trace_token_advantages(turn_rewards, outcome, turn_index, action,
                                                alpha_out=1.0, alpha_turn=0.2))
    want = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            if action[b, t]:
                want[b, t] = outcome[b] + 0.2 * turn_rewards[b, turn_index[b, t]]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    chex.assert_shape(got, (B, T))
