"""Keep rules, policy losses and the value losses (docs/algorithms.md §4–6).

All arrays are `[batch, time]`; masks are bool or 0/1 of the same shape. Every loss is a
token-level mean: it sums over the action tokens of the whole batch and divides by
N = Σ action_mask (1 if the batch has no action tokens, so an empty batch gives loss 0).

Policy losses share one signature, `loss(inputs: PolicyLossInputs, *, <hyperparameters>) ->
(loss, metrics)`, and are looked up by name in `POLICY_LOSSES`; the trainer binds the
hyperparameters from config with `functools.partial`. Every metrics dict has exactly the keys in
`POLICY_METRIC_KEYS`, so logging is the same whichever loss runs.

Token populations used in the metrics (all are subsets of the action tokens):
  dropped  — removed by the loss's keep rule (DIS band, IcePop band, ESTR rule); none for PPO-clip
             (either anchor) and the plain policy gradient.
  clipped  — kept by the keep rule but clipped by the PPO min/clip, so their gradient is zero:
             Â > 0 and r > 1+ε_high, or Â < 0 and r < 1−ε_low; none for DIS (it has no clip).
  masked   — dropped ∪ clipped: every action token that receives no gradient.
  kept     — action tokens that receive a gradient (action ∖ masked).
For PPO-clip, masked_fraction is therefore the usual clip fraction.
"""

from typing import Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp

from sao_jax.diagnostics import fit_metrics

Array = chex.Array


class PolicyLossInputs(NamedTuple):
    """What every policy loss reads, all `[batch, time]`.

    logp:            log π_θ(a_t) under the parameters being trained (carries the gradient).
    rollout_logp:    log μ_t(a_t), recorded by the rollout engine when it sampled the token.
    old_logp:        log π_θ_old(a_t), a trainer forward pass before the update; needed by
                     "icepop" and "ppo_clip" only, may be None for "dis" and "estr".
    advantages:      Â_t (zero or ignored on non-action tokens).
    action_mask:     1 on tokens the policy sampled.
    rollout_entropy: H_t, entropy of μ_t over the full vocabulary; read by "estr" and by the
                     entropy diagnostics of every loss.
    fresh_mask:      1 on the action tokens sampled by the very weights being trained (lag 0), where
                     log μ − log π_θ is the training–inference mismatch alone (`mismatch/*` metrics);
                     None: every action token.
    """

    logp: Array
    rollout_logp: Array
    old_logp: Array | None
    advantages: Array
    action_mask: Array
    rollout_entropy: Array
    fresh_mask: Array | None = None


POLICY_METRIC_KEYS = (
    "kept_fraction",
    "masked_fraction",
    "dropped_fraction",
    "clipped_fraction",
    "kept_entropy_mean",
    "masked_entropy_mean",
    "ratio_mean",
    "ratio_max",
    "rollout_log_ratio_mean",
    "mismatch/logprob_abs_mean",
    "mismatch/logprob_abs_max",
    "mismatch/masked_fraction",
)


# ----------------------------------------------------------------------------- reductions

def _masked_sum(x: Array, mask: Array) -> Array:
    # `where`, not `x * mask`: x may be inf/NaN on tokens outside the mask (padding).
    return jnp.sum(jnp.where(mask, x, 0.0))


def _masked_mean(x: Array, mask: Array) -> Array:
    """Σ_mask x / Σ mask, and 0 when the mask is empty."""
    count = jnp.sum(mask.astype(jnp.float32))
    return _masked_sum(x, mask) / jnp.maximum(count, 1.0)


# ----------------------------------------------------------------------------- keep rules

def dis_mask(logp: Array, rollout_logp: Array, *, eps_low: float, eps_high: float) -> Array:
    """DIS keep mask (SAO §3.1): M_t = 1[1−ε_low < sg(r_t) < 1+ε_high], an open interval.

    r_t = exp(log π_θ(a_t) − log π_rollout(a_t)). Returns bool `[batch, time]`; AND it with the
    action mask yourself.
    """
    chex.assert_equal_shape([logp, rollout_logp])
    ratio = jnp.exp(jax.lax.stop_gradient(logp) - rollout_logp)
    return (ratio > 1.0 - eps_low) & (ratio < 1.0 + eps_high)


def icepop_mask(old_logp: Array, rollout_logp: Array, *, alpha: float = 0.5, beta: float = 5.0) -> Array:
    """IcePop keep mask (Ring-1T): M_t = 1[α ≤ k_t ≤ β], k_t = π_θ_old(a_t) / π_rollout(a_t).

    Returns bool `[batch, time]`; AND it with the action mask yourself.
    """
    chex.assert_equal_shape([old_logp, rollout_logp])
    train_infer_ratio = jnp.exp(jax.lax.stop_gradient(old_logp) - rollout_logp)
    return (train_infer_ratio >= alpha) & (train_infer_ratio <= beta)


def estr_mask(
    logp: Array, rollout_logp: Array, rollout_entropy: Array, *, tau: float, eps: float = 0.01
) -> Array:
    """ESTR keep mask: M_t = 1[δ_t² ≤ τ·(H_t + ε)], δ_t = sg(log π_θ(a_t)) − log μ_t(a_t).

    H_t is the entropy of the behaviour policy μ_t at token t. Returns bool `[batch, time]`; AND it
    with the action mask yourself.
    """
    chex.assert_equal_shape([logp, rollout_logp, rollout_entropy])
    log_ratio = jax.lax.stop_gradient(logp) - rollout_logp
    return jnp.square(log_ratio) <= tau * (rollout_entropy + eps)


def calibrate_estr_tau(
    logp: Array,
    rollout_logp: Array,
    rollout_entropy: Array,
    action_mask: Array,
    *,
    target_masked_fraction: float,
    eps: float = 0.01,
) -> Array:
    """The ESTR τ that masks `target_masked_fraction` q of the action tokens.

    A token is masked iff its score s_t = δ_t² / (H_t + ε) exceeds τ, so τ is the (1−q) quantile of
    s over the action tokens: with s sorted ascending s_(1) ≤ … ≤ s_(N) and k = round(q·N) tokens
    to mask (at most N−1, so at least one token is kept), τ = (s_(N−k) + s_(N−k+1)) / 2, the
    midpoint between the largest kept and the smallest masked score (robust to the rounding of
    δ² ≤ τ(H+ε) against δ²/(H+ε)); for k = 0, τ = 2·s_(N). The masked count is then within one
    token of q·N unless scores tie. Returns a scalar (inf when there are no action tokens); jit-able.
    """
    if isinstance(target_masked_fraction, (int, float)) and not 0.0 <= target_masked_fraction <= 1.0:
        raise ValueError(
            f"calibrate_estr_tau: target_masked_fraction must be in [0, 1], got {target_masked_fraction}"
        )
    chex.assert_equal_shape([logp, rollout_logp, rollout_entropy, action_mask])
    is_action = action_mask.astype(bool).reshape(-1)
    log_ratio = (jax.lax.stop_gradient(logp) - rollout_logp).reshape(-1)
    score = jnp.square(log_ratio) / (rollout_entropy.reshape(-1) + eps)
    # Non-action tokens sort to the end, so the first N sorted entries are the action scores.
    sorted_score = jnp.sort(jnp.where(is_action, score, jnp.inf))
    num_action = jnp.sum(is_action)
    num_masked = jnp.clip(jnp.round(target_masked_fraction * num_action).astype(num_action.dtype),
                          0, jnp.maximum(num_action - 1, 0))
    num_kept = num_action - num_masked
    largest_kept = sorted_score[jnp.maximum(num_kept - 1, 0)]
    smallest_masked = sorted_score[jnp.minimum(num_kept, sorted_score.size - 1)]
    return jnp.where(num_masked > 0, 0.5 * (largest_kept + smallest_masked), 2.0 * largest_kept)


# ----------------------------------------------------------------------------- policy losses

def _check_inputs(inputs: PolicyLossInputs, loss_name: str, needs_old_logp: bool) -> None:
    if needs_old_logp and inputs.old_logp is None:
        raise ValueError(
            f"policy loss {loss_name!r} needs PolicyLossInputs.old_logp (log π_θ_old from a trainer "
            "forward pass before the update), got None"
        )
    if inputs.rollout_entropy is None:
        raise ValueError(
            f"policy loss {loss_name!r} needs PolicyLossInputs.rollout_entropy (every loss logs the "
            "entropy of its masked tokens, docs/algorithms.md §5), got None"
        )
    arrays = [inputs.logp, inputs.rollout_logp, inputs.advantages, inputs.action_mask,
              inputs.rollout_entropy]
    if needs_old_logp:
        arrays.append(inputs.old_logp)
    chex.assert_rank(arrays, 2)
    chex.assert_equal_shape(arrays)


def _ppo_clip_objective(ratio: Array, advantages: Array, eps_low: float, eps_high: float):
    """Per-token min(r·Â, clip(r, 1−ε_low, 1+ε_high)·Â) and where the clipped branch wins strictly.

    A token is clipped (zero gradient) iff Â > 0 and r > 1+ε_high, or Â < 0 and r < 1−ε_low.
    """
    clipped_ratio = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    objective = jnp.minimum(ratio * advantages, clipped_ratio * advantages)
    clipped = ((advantages > 0) & (ratio > 1.0 + eps_high)) | ((advantages < 0) & (ratio < 1.0 - eps_low))
    return objective, clipped


def _clipped_surrogate_loss(
    inputs: PolicyLossInputs, reference_logp: Array, keep: Array, eps_low: float, eps_high: float
):
    """−Σ_{keep ∧ action} min(r Â, clip(r) Â) / N, r = π_θ / π_reference: the PPO family's core.

    Returns (loss, ratio for metrics, clipped mask).
    """
    is_action = inputs.action_mask.astype(bool)
    contributes = is_action & keep
    # Zero the log-ratio where the token contributes nothing, so an extreme or non-finite logp on a
    # dropped or padding token cannot turn its zero gradient into NaN (0·inf) through exp.
    log_ratio = jnp.where(contributes, inputs.logp - reference_logp, 0.0)
    advantages = jax.lax.stop_gradient(inputs.advantages)
    objective, clipped = _ppo_clip_objective(jnp.exp(log_ratio), advantages, eps_low, eps_high)
    num_action = jnp.maximum(jnp.sum(is_action.astype(jnp.float32)), 1.0)
    loss = -_masked_sum(objective, contributes) / num_action
    ratio = jnp.exp(jax.lax.stop_gradient(inputs.logp) - reference_logp)
    return loss, ratio, clipped & contributes


def _policy_metrics(
    inputs: PolicyLossInputs, ratio: Array, dropped: Array, clipped: Array
) -> dict[str, Array]:
    """The uniform metrics dict (keys = POLICY_METRIC_KEYS); populations as in the module docstring.

    ratio: the ratio the loss itself uses (π_θ/π_rollout for DIS, ESTR, PPO-clip against the rollout
    and the plain policy gradient, π_θ/π_θ_old for PPO-clip and IcePop). rollout_log_ratio_mean = mean
    of log π_θ − log π_rollout over action tokens, the drift of stale tokens and the train/inference
    mismatch together; its negative is the k1 estimate of KL(μ ‖ π_θ). The mismatch alone, on the
    fresh tokens F (`PolicyLossInputs.fresh_mask`), before the update:

        mismatch/logprob_abs_mean = Σ_F |log μ_t − log π_θ(a_t)| / |F|,  mismatch/logprob_abs_max = max_F,
        mismatch/masked_fraction  = |F ∩ masked| / |F|,

    each NaN when F is empty (every action token stale).
    """
    is_action = inputs.action_mask.astype(bool)
    dropped = dropped & is_action
    clipped = clipped & is_action
    masked = dropped | clipped
    kept = is_action & ~masked
    entropy = jax.lax.stop_gradient(inputs.rollout_entropy)
    ratio = jax.lax.stop_gradient(ratio)
    rollout_log_ratio = jax.lax.stop_gradient(inputs.logp) - inputs.rollout_logp
    fresh = is_action if inputs.fresh_mask is None else is_action & inputs.fresh_mask.astype(bool)
    some_fresh = jnp.any(fresh)
    mismatch = jnp.abs(rollout_log_ratio)
    return {
        "kept_fraction": _masked_mean(kept.astype(jnp.float32), is_action),
        "masked_fraction": _masked_mean(masked.astype(jnp.float32), is_action),
        "dropped_fraction": _masked_mean(dropped.astype(jnp.float32), is_action),
        "clipped_fraction": _masked_mean(clipped.astype(jnp.float32), is_action),
        "kept_entropy_mean": _masked_mean(entropy, kept),
        "masked_entropy_mean": _masked_mean(entropy, masked),
        "ratio_mean": _masked_mean(ratio, is_action),
        # Ratios are positive, so 0 stands for "no action tokens".
        "ratio_max": jnp.max(jnp.where(is_action, ratio, 0.0)),
        "rollout_log_ratio_mean": _masked_mean(rollout_log_ratio, is_action),
        "mismatch/logprob_abs_mean": jnp.where(some_fresh, _masked_mean(mismatch, fresh), jnp.nan),
        "mismatch/logprob_abs_max": jnp.where(some_fresh, jnp.max(jnp.where(fresh, mismatch, 0.0)), jnp.nan),
        "mismatch/masked_fraction": jnp.where(some_fresh, _masked_mean(masked.astype(jnp.float32), fresh), jnp.nan),
    }


def dis_loss(inputs: PolicyLossInputs, *, eps_low: float, eps_high: float):
    """DIS policy loss (SAO §3.1): L = −Σ_t M_t · r_t · Â_t / N, no PPO min/clip.

    r_t = π_θ(a_t)/π_rollout(a_t), M_t = dis_mask ∧ action_mask (stop-gradient). Gradient
    ∇L = −Σ_t M_t r_t Â_t ∇log π_θ(a_t) / N, exactly zero on dropped tokens. SAO uses
    (ε_low, ε_high) = (0.3, 5.0) for math-with-Python and (0.8, 3.0) for the coding agent.
    Does not read old_logp.
    """
    _check_inputs(inputs, "dis", needs_old_logp=False)
    is_action = inputs.action_mask.astype(bool)
    keep = dis_mask(inputs.logp, inputs.rollout_logp, eps_low=eps_low, eps_high=eps_high) & is_action
    # The ratio is built from the masked log-ratio so dropped tokens get an exact-zero gradient
    # even when their ratio overflows; r itself carries the gradient (∇r = r ∇log π).
    ratio = jnp.exp(jnp.where(keep, inputs.logp - inputs.rollout_logp, 0.0))
    advantages = jax.lax.stop_gradient(inputs.advantages)
    num_action = jnp.maximum(jnp.sum(is_action.astype(jnp.float32)), 1.0)
    loss = -_masked_sum(ratio * advantages, keep) / num_action
    metrics_ratio = jnp.exp(jax.lax.stop_gradient(inputs.logp) - inputs.rollout_logp)
    return loss, _policy_metrics(inputs, metrics_ratio, dropped=~keep, clipped=jnp.zeros_like(keep))


def ppo_clip_loss(inputs: PolicyLossInputs, *, eps_low: float = 0.2, eps_high: float = 0.28):
    """PPO-clip with clip-higher (vanilla VAPO, "no DIS").

    L = −Σ_t min(r Â, clip(r, 1−ε_low, 1+ε_high) Â) / N over action tokens,
    r_t = π_θ(a_t)/π_θ_old(a_t); no train/inference mismatch mask. Needs old_logp. The defaults are
    VAPO's (0.2, 0.28). masked_fraction is the clip fraction.
    """
    _check_inputs(inputs, "ppo_clip", needs_old_logp=True)
    keep = jnp.ones(inputs.action_mask.shape, bool)
    loss, ratio, clipped = _clipped_surrogate_loss(inputs, inputs.old_logp, keep, eps_low, eps_high)
    return loss, _policy_metrics(inputs, ratio, dropped=~keep, clipped=clipped)


def icepop_loss(
    inputs: PolicyLossInputs,
    *,
    alpha: float = 0.5,
    beta: float = 5.0,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
):
    """IcePop (Ring-1T): drop tokens with k = π_θ_old/π_rollout ∉ [α, β], PPO-clip the rest.

    L = −Σ_t M_t min(r Â, clip(r, 1−ε_low, 1+ε_high) Â) / N, M_t = icepop_mask ∧ action_mask,
    r_t = π_θ(a_t)/π_θ_old(a_t). Needs old_logp. The clip defaults are VAPO's (ours: the IcePop
    source fixes α, β only).
    """
    _check_inputs(inputs, "icepop", needs_old_logp=True)
    keep = icepop_mask(inputs.old_logp, inputs.rollout_logp, alpha=alpha, beta=beta)
    loss, ratio, clipped = _clipped_surrogate_loss(inputs, inputs.old_logp, keep, eps_low, eps_high)
    return loss, _policy_metrics(inputs, ratio, dropped=~keep, clipped=clipped)


def estr_loss(
    inputs: PolicyLossInputs,
    *,
    tau: float,
    eps: float = 0.01,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
):
    """ESTR: drop tokens with δ² > τ(H+ε) against the behaviour policy μ, PPO-clip the rest.

    L = −Σ_t M_t min(r Â, clip(r, 1−ε_low, 1+ε_high) Â) / N, M_t = estr_mask ∧ action_mask,
    r_t = π_θ(a_t)/μ_t(a_t). τ has no published value: calibrate it with `calibrate_estr_tau`.
    The clip defaults are VAPO's (ours). Does not read old_logp.
    """
    _check_inputs(inputs, "estr", needs_old_logp=False)
    keep = estr_mask(inputs.logp, inputs.rollout_logp, inputs.rollout_entropy, tau=tau, eps=eps)
    loss, ratio, clipped = _clipped_surrogate_loss(inputs, inputs.rollout_logp, keep, eps_low, eps_high)
    return loss, _policy_metrics(inputs, ratio, dropped=~keep, clipped=clipped)


def ppo_clip_rollout_loss(inputs: PolicyLossInputs, *, eps_low: float = 0.2, eps_high: float = 0.28):
    """PPO-clip anchored at the rollout policy μ, with no keep rule.

    L = −Σ_t min(r Â, clip(r, 1−ε_low, 1+ε_high) Â) / N over action tokens, r_t = π_θ(a_t)/μ_t(a_t):
    the ratio's drift on stale tokens (and the train/inference mismatch) is clipped, never dropped —
    ESTR without its keep rule (τ = ∞). masked_fraction is the clip fraction. Does not read old_logp.
    """
    _check_inputs(inputs, "ppo_clip_rollout", needs_old_logp=False)
    keep = jnp.ones(inputs.action_mask.shape, bool)
    loss, ratio, clipped = _clipped_surrogate_loss(inputs, inputs.rollout_logp, keep, eps_low, eps_high)
    return loss, _policy_metrics(inputs, ratio, dropped=~keep, clipped=clipped)


def pg_loss(inputs: PolicyLossInputs):
    """The plain policy gradient, no off-policy correction: L = −Σ_t Â_t log π_θ(a_t) / N over
    action tokens.

    ∇L = −Σ_t Â_t ∇log π_θ(a_t) / N: every token weighs as if π_θ had sampled it, however stale (no
    ratio, no keep rule, no clip; nothing masked). On fresh tokens it is the gradient PPO-clip
    against π_θ_old = π_θ gives at the pre-update point. Metrics' ratio: π_θ/μ, the drift it ignores.
    Does not read old_logp.
    """
    _check_inputs(inputs, "pg", needs_old_logp=False)
    is_action = inputs.action_mask.astype(bool)
    advantages = jax.lax.stop_gradient(inputs.advantages)
    num_action = jnp.maximum(jnp.sum(is_action.astype(jnp.float32)), 1.0)
    loss = -_masked_sum(inputs.logp * advantages, is_action) / num_action
    ratio = jnp.exp(jax.lax.stop_gradient(inputs.logp) - inputs.rollout_logp)
    nothing = jnp.zeros(is_action.shape, bool)
    return loss, _policy_metrics(inputs, ratio, dropped=nothing, clipped=nothing)


POLICY_LOSSES: dict[str, Callable[..., tuple[Array, dict[str, Array]]]] = {
    "dis": dis_loss,
    "icepop": icepop_loss,
    "estr": estr_loss,
    "ppo_clip": ppo_clip_loss,
    "ppo_clip_rollout": ppo_clip_rollout_loss,
    "pg": pg_loss,
}


# ----------------------------------------------------------------------------- KL penalty

def kl_penalty(logp: Array, reference_logp: Array, action_mask: Array) -> Array:
    """Token-mean k3 estimate of the KL to a frozen reference: Σ_t k_t / N over action tokens,
    k_t = exp(δ_t) − δ_t − 1, δ_t = log π_ref(a_t) − log π_θ(a_t) (Schulman's low-variance estimator,
    verl's "low_var_kl"; k_t ≥ 0, and 0 iff the two log-probs agree).

    On tokens sampled from π_θ, E[k_t] = KL(π_θ ‖ π_ref) at that position, while the gradient of this
    loss, E[(1 − π_ref/π_θ) ∇log π_θ] = Σ_a (π_θ − π_ref) ∇log π_θ(a) = ∇KL(π_ref ‖ π_θ), is that
    of the mass-covering KL: it grows without bound as π_θ(a) → 0 for an action the reference takes,
    so a penalised policy keeps every option of the reference alive. `reference_logp` carries no
    gradient.
    """
    chex.assert_equal_shape([logp, reference_logp, action_mask])
    is_action = action_mask.astype(bool)
    # Zero δ off the action tokens, so padding with non-finite log-probs cannot leak NaN through exp.
    delta = jnp.where(is_action, jax.lax.stop_gradient(reference_logp) - logp, 0.0)
    return _masked_mean(jnp.exp(delta) - delta - 1.0, is_action)


# ----------------------------------------------------------------------------- value loss

def value_loss(
    values: Array,
    returns: Array,
    action_mask: Array,
    *,
    old_values: Array | None = None,
    clip_eps: float | None = None,
):
    """Critic regression: L = ½ Σ_t (V_t − G_t)² / N over action tokens.

    With old_values and clip_eps (PPO-style value clipping):
        L = ½ Σ_t max((V_t − G_t)², (clip(V_t, V_old − ε, V_old + ε) − G_t)²) / N.
    Metrics: the fit of V to G before this update (`diagnostics.fit_metrics`: explained_variance and
    mse over action tokens), value_mean, return_mean, and
    clip_fraction = share of action tokens where the clipped term is strictly larger, i.e. whose
    value gets no gradient (0 without clipping).
    """
    chex.assert_rank([values, returns, action_mask], 2)
    chex.assert_equal_shape([values, returns, action_mask])
    if (old_values is None) != (clip_eps is None):
        raise ValueError(
            "value_loss: value clipping needs both old_values and clip_eps "
            f"(got old_values={'set' if old_values is not None else None}, clip_eps={clip_eps})"
        )
    is_action = action_mask.astype(bool)
    returns = jax.lax.stop_gradient(returns)
    squared_error = jnp.square(values - returns)
    if clip_eps is None:
        clipped = jnp.zeros(is_action.shape, bool)
    else:
        chex.assert_equal_shape([values, old_values])
        old_values = jax.lax.stop_gradient(old_values)
        clipped_values = jnp.clip(values, old_values - clip_eps, old_values + clip_eps)
        clipped_squared_error = jnp.square(clipped_values - returns)
        clipped = clipped_squared_error > squared_error
        squared_error = jnp.maximum(squared_error, clipped_squared_error)
    loss = 0.5 * _masked_mean(squared_error, is_action)

    values = jax.lax.stop_gradient(values)
    metrics = {
        **fit_metrics(values, returns, is_action),
        "value_mean": _masked_mean(values, is_action),
        "return_mean": _masked_mean(returns, is_action),
        "clip_fraction": _masked_mean((clipped & is_action).astype(jnp.float32), is_action),
    }
    return loss, metrics


# ------------------------------------------------------------------- distributional value head

def hl_gauss_support(low: float, high: float, bins: int) -> Array:
    """The `bins + 1` edges `e_0 = low < … < e_B = high` of a histogram value head's equal bins."""
    return jnp.linspace(low, high, bins + 1, dtype=jnp.float32)


def hl_gauss_values(logits: Array, edges: Array) -> Array:
    """The value a histogram head predicts: V = Σ_i softmax(logits)_i · c_i, c_i = (e_i + e_{i+1}) / 2.

    logits `[..., B]`, edges `[B + 1]` (`hl_gauss_support`); returns `[...]` float32.
    """
    centers = (edges[:-1] + edges[1:]) / 2
    return jnp.sum(jax.nn.softmax(logits.astype(jnp.float32), axis=-1) * centers, axis=-1)


def hl_gauss_target(returns: Array, edges: Array, sigma: float) -> Array:
    """HL-Gauss target histogram (Farebrother et al. 2024, "Stop Regressing", §3): the mass that
    N(G, σ²), truncated to [e_0, e_B], puts in each bin,

        p_i(G) = [Φ((e_{i+1} − G)/σ) − Φ((e_i − G)/σ)] / [Φ((e_B − G)/σ) − Φ((e_0 − G)/σ)].

    returns `[...]`, edges `[B + 1]`; returns `[..., B]`, each row summing to 1. A return outside
    [e_0, e_B] is clipped into it first (its mass would otherwise fall outside every bin).
    """
    g = jnp.clip(returns.astype(jnp.float32), edges[0], edges[-1])[..., None]
    cdf = jax.scipy.special.ndtr((edges - g) / sigma)
    return (cdf[..., 1:] - cdf[..., :-1]) / (cdf[..., -1:] - cdf[..., :1])


def hl_gauss_value_loss(logits: Array, returns: Array, target_mask: Array, *, edges: Array, sigma: float):
    """Critic loss of a histogram value head: cross-entropy to the HL-Gauss target of the return,

        L = − Σ_t m_t Σ_i p_i(G_t) · log softmax(logits_t)_i / Σ_t m_t,

    with p(G) = `hl_gauss_target` (σ = `critic.hl_gauss_sigma` bin widths). logits `[batch, time, B]`,
    returns and target_mask `[batch, time]`. Metrics as `value_loss`'s (the fit of
    V = `hl_gauss_values(logits)` to G; clip_fraction 0: no value clipping).
    """
    chex.assert_rank([logits, returns, target_mask], [3, 2, 2])
    is_target = target_mask.astype(bool)
    returns = jax.lax.stop_gradient(returns)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    cross_entropy = -jnp.sum(hl_gauss_target(returns, edges, sigma) * log_probs, axis=-1)
    loss = _masked_mean(cross_entropy, is_target)
    values = jax.lax.stop_gradient(hl_gauss_values(logits, edges))
    metrics = {
        **fit_metrics(values, returns, is_target),
        "value_mean": _masked_mean(values, is_target),
        "return_mean": _masked_mean(returns, is_target),
        "clip_fraction": jnp.zeros((), jnp.float32),
    }
    return loss, metrics


# ----------------------------------------------------------------------------- teacher forcing

def token_logprobs(logits: Array, tokens: Array) -> Array:
    """Teacher-forced log π(token_t | tokens_<t), float32 `[batch, time]`; 0 at t = 0.

    `logits[:, t]` (the model's output after reading token t) predicts token t+1, so the log-prob of
    token t is read from `logits[:, t−1]`. The first token has no prediction; it is a prompt token.
    """
    chex.assert_rank([logits, tokens], [3, 2])
    logprobs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logprobs, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(picked, ((0, 0), (1, 0)))
