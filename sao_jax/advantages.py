"""Advantage estimators: the GAE family, λ schedules, baselines and TRACE turn credit.

Every function here is pure and jit-able and has its equation in its docstring. Token arrays are
`[batch, time]`; masks are bool or 0/1 of the same shape. docs/algorithms.md gives the sources; a
choice no source fixes is marked "(ours)".

Trajectory notation: `prompt ‖ a_0 ‖ o_0 ‖ a_1 ‖ … ‖ a_n`. Action spans `a_i` have
`action_mask = 1`; observation, prompt and padding tokens have `action_mask = 0`.
"""

import dataclasses
from typing import Any, Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp

from sao_jax import native

Array = chex.Array

GAE_METHODS = ("auto", "scan", "associative", "kernel")


# ----------------------------------------------------------------------------------------------
# Shared pieces.


def _check_token_arrays(*arrays: Array) -> None:
    chex.assert_rank(arrays[0], 2)
    chex.assert_equal_shape(arrays)


def _compute_dtype(*arrays: Array):
    """Promoted float dtype of the inputs, at least float32 (bf16 values are summed in f32)."""
    return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)


def _per_sequence(x, batch: int, dtype, name: str) -> Array:
    """A scalar or a `[batch]` array (per-sequence γ or λ) as a `[batch]` array."""
    x = jnp.asarray(x, dtype)
    if x.ndim == 0:
        return jnp.broadcast_to(x, (batch,))
    if x.shape != (batch,):
        raise ValueError(f"{name} must be a scalar or have shape [batch] = ({batch},), got {x.shape}")
    return x


def _shift_left(x: Array) -> Array:
    """`y[:, t] = x[:, t + 1]`, zero at the last step."""
    return jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)


def _shift_right(x: Array) -> Array:
    """`y[:, t] = x[:, t - 1]`, zero (False) at the first step."""
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)


def _resolve_method(method: str, caller: str, kernel: bool = False) -> str:
    """Resolves "auto" (`skip_observation_gae` says how); `kernel`: whether the caller has one."""
    methods = GAE_METHODS if kernel else tuple(m for m in GAE_METHODS if m != "kernel")
    if method not in methods:
        raise ValueError(f"{caller}: method must be one of {methods}, got {method!r}")
    if method == "kernel" and not native.gae_kernel_available():
        raise RuntimeError(f"{caller}: the CPU GAE kernel could not be built (see the log)")
    if method != "auto":
        return method
    if jax.default_backend() != "cpu":
        return "associative"
    return "kernel" if kernel and native.gae_kernel_available() else "scan"


def _reverse_linear_recurrence(offset: Array, decay: Array, decays: Array, method: str) -> Array:
    """Solves `x_t = offset_t + c_t·x_{t+1}`, `x_T = 0`, along the time axis of `[batch, time]`,
    where `c_t = decay` (per row, `[batch]`) on the steps where `decays` is true and 1 elsewhere.

    "scan": a reverse `lax.scan` over time with the batch vectorised inside each step (depth T).
    "associative": each step is the affine map `x ↦ d_t + c_t·x`; two composed are again affine,
    `(c_t, d_t) ∘ (c_u, d_u) = (c_t·c_u, d_t + c_t·d_u)`, so `lax.associative_scan` composes every
    suffix at once (depth O(log T)), and with `x_T = 0` the offset of the suffix map from t is x_t.

    Why no blocked (chunked) scan on CPU: splitting time into chunks of C, solving the chunks side by
    side with a C-step scan, scanning the chunk carries and fixing each token up elementwise
    (`x_t = local_t + Π_{s≥t in chunk} c_s · carry`) needs transposes into and out of the chunk
    layout that cost more than the whole plain scan, which XLA:CPU runs as one compiled loop when a
    step touches little memory. Reading the `[batch, time]` arrays column by column (no transposes)
    hits cache-set conflicts at power-of-two row lengths. Both are slower than "scan" at the
    benchmark shapes (benchmarks/RESULTS.md).
    """
    if method == "scan":
        # The scan reads the bool mask rather than a float coefficient array: fewer bytes to
        # transpose to time-major, and those transposes are much of this scan's cost on CPU.
        def step(x_next, offset_and_decays):
            offset_t, decays_t = offset_and_decays
            x = offset_t + jnp.where(decays_t, decay, 1) * x_next
            return x, x

        # unroll=1: unrolling is slower on XLA:CPU (benchmarks/RESULTS.md).
        _, solution = jax.lax.scan(step, jnp.zeros_like(offset[:, 0]), (offset.T, decays.T),
                                   reverse=True)
        return solution.T

    def compose(suffix, step):
        # With reverse=True the first argument is the already composed later part.
        suffix_coeff, suffix_offset = suffix
        step_coeff, step_offset = step
        return step_coeff * suffix_coeff, step_offset + step_coeff * suffix_offset

    coeff = jnp.where(decays, decay[:, None], 1)
    _, solution = jax.lax.associative_scan(compose, (coeff, offset), reverse=True, axis=1)
    return solution


def unassigned_reward(rewards: Array, action_mask: Array) -> Array:
    """Reward that no action can be credited with: `Σ_{t < p_0} r_t`, float `[batch]`.

    `p_0` is the row's first action token; a row without action tokens has all of its reward
    unassigned. The GAE estimators leave this reward out (nothing precedes it to credit), so
    callers check it is zero — the trainer counts and raises on it — instead of losing it silently.
    """
    _check_token_arrays(rewards, action_mask)
    before_first_action = jnp.cumsum(action_mask.astype(jnp.int32), axis=1) == 0
    return jnp.sum(jnp.where(before_first_action, rewards, 0), axis=1)


# ----------------------------------------------------------------------------------------------
# Token-level GAE.


def skip_observation_gae(
    rewards: Array,
    values: Array,
    action_mask: Array,
    *,
    gamma,
    lam,
    method: str = "auto",
) -> tuple[Array, Array]:
    """Token-level GAE over action tokens only, bridging observations (SAO §3.2, Eq. 4–5).

    With `p_0 < p_1 < … < p_{m-1}` the action positions of a row and `p_m = T`:

        R_j = Σ_{p_j ≤ t < p_{j+1}} r_t     (the action's reward and the rewards on the
                                              observation/padding tokens up to the next action)
        δ_j = R_j + γ·V[p_{j+1}] − V[p_j],   δ_{m-1} = R_{m-1} − V[p_{m-1}]
        A_j = δ_j + γ·λ·A_{j+1},             A_m = 0
        G_j = A_j + V[p_j]

    γ is applied once across an observation gap, however many tokens it holds. A reward on an
    observation or padding token is credited to the transition that crosses it (verl and Tunix
    drop it). Rewards before `p_0` cannot be credited: check `unassigned_reward(...) == 0`.

    Args:
      rewards, values: float `[batch, time]`.
      action_mask: bool or 0/1 `[batch, time]`, true on tokens the policy sampled.
      gamma, lam: scalars or `[batch]` (e.g. from `length_adaptive_lambda`).
      method: "kernel" — CPU only: one XLA FFI call into `sao_jax/native/gae_cpu.cc`, a single
        reverse pass over each row in place (built with the system C++ compiler on first use;
        gradients by the "scan" path's VJP); "scan" — a reverse `lax.scan` over time with the
        batch vectorised inside each step (depth T, least work of the XLA paths); "associative" —
        `lax.associative_scan` of affine maps (depth O(log T), about twice the work and many more
        passes over memory); "auto" — "kernel" on CPU ("scan" if no compiler is found),
        "associative" elsewhere. On CPU "scan" is the faster of the two XLA paths at every benchmark
        shape (benchmarks/RESULTS.md); on GPU/TPU every scan iteration is a device loop step, so for
        long sequences the O(log T) depth is expected to win there.

    Returns:
      `(advantages, returns)`, float `[batch, time]`, holding `A_j` and `G_j` at `p_j` and zero on
      every non-action token. Not whitened (see `masked_whiten`).
    """
    _check_token_arrays(rewards, values, action_mask)
    batch = rewards.shape[0]
    method = _resolve_method(method, "skip_observation_gae", kernel=True)
    dtype = _compute_dtype(rewards, values)
    rewards = rewards.astype(dtype)
    values = values.astype(dtype)
    is_action = action_mask.astype(bool)
    gamma = _per_sequence(gamma, batch, dtype, "gamma")
    lam = _per_sequence(lam, batch, dtype, "lam")
    if method == "kernel":
        return _skip_observation_gae_kernel(rewards, values, is_action, gamma, lam)
    return _skip_observation_gae_xla(rewards, values, is_action, gamma, lam, method)


def _skip_observation_gae_xla(rewards, values, is_action, gamma, lam, method):
    """`skip_observation_gae` in XLA ops ("scan" or "associative"), inputs already checked."""
    # One recurrence over all tokens. z_t is what the action before t bootstraps from:
    # z_{p_j + 1} = Σ_{p_j < t < p_{j+1}} r_t + γ·V[p_{j+1}] + γ·λ·A_{j+1}, so A_j = r − V + z there.
    # A non-action token adds its reward (z_t = r_t + z_{t+1}); an action token p starts afresh:
    # z_p = γ·V_p + γ·λ·A_p = γ·V_p + γ·λ·(r_p − V_p) + γ·λ·z_{p+1}.
    g, gl = gamma[:, None], (gamma * lam)[:, None]
    offset = jnp.where(is_action, g * values + gl * (rewards - values), rewards)
    bootstrap = _shift_left(_reverse_linear_recurrence(offset, gamma * lam, is_action, method))
    advantages = jnp.where(is_action, rewards - values + bootstrap, 0)
    returns = jnp.where(is_action, advantages + values, 0)
    return advantages, returns


@jax.custom_vjp
def _skip_observation_gae_kernel(rewards, values, is_action, gamma, lam):
    """`skip_observation_gae` as one call of the CPU kernel (the same recurrence, in C++)."""
    result = jax.ShapeDtypeStruct(rewards.shape, rewards.dtype)
    # broadcast_all: under vmap every operand gains the same leading axes, which the kernel reads
    # as more rows (γ and λ stay one value per row).
    call = jax.ffi.ffi_call(native.GAE_TARGET, (result, result), vmap_method="broadcast_all")
    return tuple(call(rewards, values, is_action, gamma, lam))


def _skip_observation_gae_kernel_fwd(rewards, values, is_action, gamma, lam):
    outputs = _skip_observation_gae_kernel(rewards, values, is_action, gamma, lam)
    return outputs, (rewards, values, is_action, gamma, lam)


def _skip_observation_gae_kernel_bwd(inputs, cotangents):
    # The kernel has no transpose of its own: reuse the scan path's VJP (the same function).
    rewards, values, is_action, gamma, lam = inputs
    _, vjp = jax.vjp(lambda r, v, g, l: _skip_observation_gae_xla(r, v, is_action, g, l, "scan"),
                     rewards, values, gamma, lam)
    d_rewards, d_values, d_gamma, d_lam = vjp(cotangents)
    return d_rewards, d_values, None, d_gamma, d_lam


_skip_observation_gae_kernel.defvjp(_skip_observation_gae_kernel_fwd,
                                    _skip_observation_gae_kernel_bwd)


def cross_observation_gae(
    rewards: Array,
    values: Array,
    action_mask: Array,
    valid_mask: Array,
    *,
    gamma,
    lam,
    method: str = "auto",
) -> tuple[Array, Array]:
    """Token-level GAE in which every valid token is a step, observations included (docs/algorithms.md §2).

    The design SAO argues against. With `q_0 < q_1 < …` the valid (non-padding) positions:

        δ_{q_i} = r_{q_i} + γ·V[q_{i+1}] − V[q_i],   A_{q_i} = δ_{q_i} + γ·λ·A_{q_{i+1}},

    bootstrapping 0 after the last valid token; γ and λ apply per token. This is
    `skip_observation_gae` with `valid_mask` as its action mask (a reward on a padding token is
    credited to the valid token before it).

    Returns:
      `(advantages, returns)`. Advantages on action tokens only, zero elsewhere (the policy uses
      nothing else). Returns `A_t + V_t` on every valid token — observation and prompt tokens
      too, since in this design the critic values them as well (ours) — and zero on padding.
      `action_mask` is expected to lie within `valid_mask`.
    """
    _check_token_arrays(rewards, values, action_mask, valid_mask)
    advantages, returns = skip_observation_gae(
        rewards, values, valid_mask, gamma=gamma, lam=lam, method=method)
    return jnp.where(action_mask.astype(bool), advantages, 0), returns


# ----------------------------------------------------------------------------------------------
# Step-level GAE.


def action_span_index(action_mask: Array) -> Array:
    """Index of the action span each token belongs to or follows, int32 `[batch, time]`.

    `i` on the tokens of span `a_i` and on the observation `o_i` after it, −1 before the first
    action token. On action tokens it is the turn index TRACE needs (one action span per turn).
    """
    chex.assert_rank(action_mask, 2)
    is_action = action_mask.astype(bool)
    span_start = is_action & ~_shift_right(is_action)
    return jnp.cumsum(span_start.astype(jnp.int32), axis=1) - 1


def step_gae(
    rewards: Array,
    values: Array,
    action_mask: Array,
    *,
    gamma,
    lam,
    value_reduce: str,
    method: str = "auto",
) -> tuple[Array, Array]:
    """Step-level GAE: each contiguous action span `a_i` is one step (SAO Table 5, App. A).

        R_i = Σ r over a_i and the observation o_i after it (the last span: everything after it)
        V_i = mean of V over a_i ("mean", step-average) or V at a_i's last token ("last")
        δ_i = R_i + γ·V_{i+1} − V_i,   V_n = 0 after the row's last span
        A_i = δ_i + γ·λ·A_{i+1},       A_n = 0

    Rewards before the first action token are not credited (see `unassigned_reward`). A row of
    T tokens has at most ⌈T/2⌉ spans; the per-span sums are `segment_sum`s over that bound.

    `method` solves the span recurrence as in `skip_observation_gae`.

    Returns:
      `(advantages, returns)`, float `[batch, time]`: every token of span i holds `A_i` and the
      return `A_i + V_i` (the step value, not the token's own value); zero on non-action tokens.
    """
    _check_token_arrays(rewards, values, action_mask)
    if value_reduce not in ("mean", "last"):
        raise ValueError(f"step_gae: value_reduce must be 'mean' or 'last', got {value_reduce!r}")
    batch, time = rewards.shape
    method = _resolve_method(method, "step_gae")
    max_spans = (time + 1) // 2
    dtype = _compute_dtype(rewards, values)
    rewards = rewards.astype(dtype)
    values = values.astype(dtype)
    is_action = action_mask.astype(bool)
    gamma = _per_sequence(gamma, batch, dtype, "gamma")
    lam = _per_sequence(lam, batch, dtype, "lam")

    span = action_span_index(is_action)
    span_or_0 = jnp.maximum(span, 0)  # tokens before the first span are zeroed before summing
    per_span_sum = jax.vmap(lambda x, ids: jax.ops.segment_sum(x, ids, num_segments=max_spans))

    step_reward = per_span_sum(jnp.where(span >= 0, rewards, 0), span_or_0)
    if value_reduce == "mean":
        span_length = per_span_sum(is_action.astype(dtype), span_or_0)
        step_value = per_span_sum(jnp.where(is_action, values, 0), span_or_0) / jnp.maximum(
            span_length, 1)
    else:
        last_of_span = is_action & ~_shift_left(is_action)
        step_value = per_span_sum(jnp.where(last_of_span, values, 0), span_or_0)

    # Span slots past the row's last span hold R = V = 0, so δ = 0 and A = 0 there.
    delta = step_reward + gamma[:, None] * _shift_left(step_value) - step_value
    every_span = jnp.ones(delta.shape, bool)
    step_advantage = _reverse_linear_recurrence(delta, gamma * lam, every_span, method)

    def to_tokens(per_span):
        return jnp.where(is_action, jnp.take_along_axis(per_span, span_or_0, axis=1), 0)

    return to_tokens(step_advantage), to_tokens(step_advantage + step_value)


@dataclasses.dataclass(frozen=True)
class Estimator:
    """One row of `ADVANTAGE_ESTIMATORS`; `batch` is a `TrajectoryBatch` (rewards, action_mask, valid_mask).

    gae: `(batch, values, gamma, lam) -> (advantages, returns)` for critic-based rows, else None.
    value_mask: `batch -> mask` of the tokens the critic is trained on.
    recursion_length: `batch -> [batch]` the number of steps the advantage recursion takes over a
        sequence's response, the `l` of the length-adaptive λ (`length_adaptive_lambda`): its action
        tokens for skip-observation and step GAE, every token from the first action on for
        cross-observation GAE, whose recursion steps through the observations too.
    grouped: compares the G = `advantage.group_size` rollouts of a prompt (needs G >= 2).
    reference: reads the frozen reference policy and a `TraceBatch`.
    """

    gae: Callable[..., tuple[Array, Array]] | None
    value_mask: Callable[[Any], Array] = lambda batch: batch.action_mask
    recursion_length: Callable[[Any], Array] = lambda batch: jnp.sum(batch.action_mask, axis=1)
    grouped: bool = False
    reference: bool = False


def _on_batch(fn, **fixed):
    return lambda b, values, gamma, lam: fn(b.rewards, values, b.action_mask, gamma=gamma, lam=lam, **fixed)


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "skip_observation_gae": Estimator(_on_batch(skip_observation_gae)),
    "cross_observation_gae": Estimator(
        lambda b, values, gamma, lam: cross_observation_gae(
            b.rewards, values, b.action_mask, b.valid_mask, gamma=gamma, lam=lam
        ),
        value_mask=lambda b: b.valid_mask,  # (ours) every valid token is a step, so every one has a target
        recursion_length=lambda b: response_length(b.action_mask, b.valid_mask),
    ),
    "step_gae_mean": Estimator(_on_batch(step_gae, value_reduce="mean")),
    "step_gae_last": Estimator(_on_batch(step_gae, value_reduce="last")),
    # Critic-free rows: one outcome advantage per sequence, on all of its action tokens.
    "running_mean": Estimator(None),
    "grpo": Estimator(None, grouped=True),
    "rloo": Estimator(None, grouped=True),
    "trace": Estimator(None, grouped=True, reference=True),
}
"""The config's `advantage.estimator` names: read by config validation and by the step builder."""


def response_length(action_mask: Array, valid_mask: Array) -> Array:
    """`[batch]` number of valid tokens from the first action token to the end (observations
    included): the tokens the cross-observation recursion steps through; 0 with no action token."""
    _check_token_arrays(action_mask, valid_mask)
    after_first_action = jnp.cumsum(action_mask.astype(jnp.int32), axis=1) > 0
    return jnp.sum(after_first_action & valid_mask.astype(bool), axis=1)


def length_adaptive_lambda(recursion_length: Array, alpha) -> Array:
    """Length-adaptive λ = 1 − 1/(α·l), clipped to [0, 1) (VAPO §4; α = 1.5 in SAO, 0.05 in VAPO).

    `l` (`[batch]`) = the number of steps the advantage recursion takes over the sequence
    (`Estimator.recursion_length`): VAPO's response length, counted in the recursion's steps, so
    that the horizon 1/(1 − λ) = α·l is the same fraction of every sequence, whichever tokens the
    estimator steps through. l = 0 gives λ = 0. The upper clip keeps λ < 1 where float32 would round
    1 − 1/(α·l) up to 1.
    """
    length = jnp.asarray(recursion_length, jnp.float32)
    lam = 1.0 - 1.0 / (alpha * length)
    return jnp.clip(lam, 0.0, jnp.nextafter(jnp.float32(1), jnp.float32(0)))


# ----------------------------------------------------------------------------------------------
# Masked statistics.


def masked_mean(x: Array, mask: Array, axis=None) -> Array:
    """`Σ m·x / Σ m` over `axis` (all axes by default); 0 where the mask is empty."""
    chex.assert_equal_shape([x, mask])
    mask = mask.astype(bool)
    total = jnp.sum(jnp.where(mask, x, 0), axis=axis)
    return total / jnp.maximum(jnp.sum(mask, axis=axis), 1)


def masked_var(x: Array, mask: Array, *, unbiased: bool = True) -> Array:
    """Variance of the masked entries: `Σ m·(x − μ)² / (n − 1)` (Bessel, as Tunix and verl), or
    `/ n` with `unbiased=False`. 0 when there are too few entries."""
    chex.assert_equal_shape([x, mask])
    mask = mask.astype(bool)
    count = jnp.sum(mask)
    squared_error = jnp.where(mask, jnp.square(x - masked_mean(x, mask)), 0)
    return jnp.sum(squared_error) / jnp.maximum(count - 1 if unbiased else count, 1)


def masked_whiten(x: Array, mask: Array, shift_mean: bool = True, eps: float = 1e-8) -> Array:
    """`(x − μ) / √(σ² + ε)` with μ, σ² (`masked_var`) over the masked entries; `+ μ` added back
    when `shift_mean` is false. Zero outside the mask (ours: advantages stay zero off actions)."""
    mean = masked_mean(x, mask)
    whitened = (x - mean) * jax.lax.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return jnp.where(mask.astype(bool), whitened, 0)


# ----------------------------------------------------------------------------------------------
# Outcome baselines (one reward per sequence).


def grpo_advantages(rewards: Array, eps: float = 1e-6) -> Array:
    """GRPO: `A_i = (r_i − mean_g) / (std_g + ε)` within each group (docs/algorithms.md §9).

    `rewards`: `[num_groups, group_size]`, group_size ≥ 2. std is the sample std (ddof = 1, as
    Tunix's GRPO). A group whose rewards are all equal gets A = 0.
    """
    chex.assert_rank(rewards, 2)
    if rewards.shape[1] < 2:
        raise ValueError(f"grpo_advantages: group_size must be >= 2, got rewards of shape "
                         f"{rewards.shape}")
    mean = jnp.mean(rewards, axis=1, keepdims=True)
    std = jnp.std(rewards, axis=1, keepdims=True, ddof=1)
    return (rewards - mean) / (std + eps)


def rloo_advantages(rewards: Array) -> Array:
    """RLOO: `A_i = r_i − mean_{j≠i} r_j` within each group; `rewards`: `[num_groups, n]`, n ≥ 2."""
    chex.assert_rank(rewards, 2)
    n = rewards.shape[1]
    if n < 2:
        raise ValueError(f"rloo_advantages: group size must be >= 2, got rewards of shape "
                         f"{rewards.shape}")
    leave_one_out_mean = (jnp.sum(rewards, axis=1, keepdims=True) - rewards) / (n - 1)
    return rewards - leave_one_out_mean


class RunningMeanState(NamedTuple):
    """Ring buffers of the most recent rewards, one per key.

    rewards: float32 `[num_keys, window]`; slot `count % window` is written next, unwritten
             slots hold 0.
    count:   int32 `[num_keys]`, rewards seen so far per key.
    """

    rewards: Array
    count: Array


def running_mean_init(num_keys: int, window: int) -> RunningMeanState:
    """Empty running-mean state. Per-prompt (SAO §4.3): one key per prompt, window 8.
    Global (SAO §4.5): `num_keys=1`, window 128, every key 0."""
    if num_keys < 1 or window < 1:
        raise ValueError(f"running_mean_init: num_keys and window must be >= 1, got "
                         f"num_keys={num_keys}, window={window}")
    return RunningMeanState(jnp.zeros((num_keys, window), jnp.float32),
                            jnp.zeros((num_keys,), jnp.int32))


def running_mean_advantages(state: RunningMeanState, keys: Array, rewards: Array,
                            valid: Array | None = None) -> tuple[Array, RunningMeanState]:
    """Running-mean baseline `A = r − mean(window of the key)` (SAO §4.3, §4.5).

    Batch elements are applied in order (ours): element b's baseline is the mean of its key's
    last `window` rewards before it — its own reward excluded, an empty window giving 0 — and
    then its reward enters the window, so a later element with the same key sees it.

    Args:
      state: from `running_mean_init` or a previous call.
      keys: int `[batch]` in `[0, num_keys)` (prompt ids, or all 0 for the global baseline).
      rewards: float `[batch]`.
      valid: optional bool `[batch]`; an invalid element (a padding row) neither reads nor writes
        the state and gets advantage 0.

    Returns:
      `(advantages [batch], new_state)`.
    """
    chex.assert_rank([keys, rewards], 1)
    chex.assert_equal_shape([keys, rewards])
    window = state.rewards.shape[1]

    valid = jnp.ones(keys.shape, bool) if valid is None else valid.astype(bool)

    def apply(state, element):
        key, reward, is_valid = element
        baseline = jnp.sum(state.rewards[key]) / jnp.maximum(jnp.minimum(state.count[key], window), 1)
        slot = state.count[key] % window
        written = RunningMeanState(state.rewards.at[key, slot].set(reward), state.count.at[key].add(1))
        state = jax.tree.map(lambda new, old: jnp.where(is_valid, new, old), written, state)
        return state, jnp.where(is_valid, reward - baseline, 0.0)

    state, advantages = jax.lax.scan(apply, state, (keys, rewards.astype(jnp.float32), valid))
    return advantages, state


def running_mean_window_fill(state: RunningMeanState, keys: Array, valid: Array | None = None) -> Array:
    """How many earlier rewards each element's baseline averages: `min(n_b, window)`, where n_b is
    the key's count in `state` plus the valid elements with the same key earlier in the batch (the
    order `running_mean_advantages` applies them in). 0 means an empty window, i.e. baseline 0.

    Returns float32 `[batch]`, 0 for invalid elements.
    """
    chex.assert_rank(keys, 1)
    window = state.rewards.shape[1]
    valid = jnp.ones(keys.shape, bool) if valid is None else valid.astype(bool)
    index = jnp.arange(keys.shape[0])
    earlier_same_key = (keys[None, :] == keys[:, None]) & (index[None, :] < index[:, None]) & valid[None, :]
    seen = state.count[keys] + jnp.sum(earlier_same_key, axis=1)
    return jnp.where(valid, jnp.minimum(seen, window), 0).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# TRACE turn credit (arXiv 2607.13988).


def trace_turn_rewards(
    ref_gold_logprob_mean: Array,
    num_turns: Array,
    outcome_advantage: Array,
    *,
    k: int = 3,
    gamma_td: float = 0.8,
    lambda_term: float = 2.0,
) -> Array:
    """TRACE per-turn rewards from a frozen reference's gold-answer log-probs (docs/algorithms.md §10).

    For a row with T = `num_turns` turns and ℓ̄_s = `ref_gold_logprob_mean[s]` (s = 0..T: the mean
    teacher-forced log-prob of the gold answer after s action–observation pairs):

        d_s = −ℓ̄_s + 0.1,   V(S_s) = log(d_0 / d_s),   δ_s = V(S_{s+1}) − V(S_s)
        h   = min(k + K − 1, T − 1)
        c_k = Σ_{u=k}^{h} γ_td^{u−k}·δ_u / Σ_{u=k}^{h} γ_td^{u−k}
        r_k = c_k + 1[h = T − 1]·λ_term·γ_td^{T−k}·A_out

    Args:
      ref_gold_logprob_mean: float `[batch, max_turns + 1]`, ℓ̄ < 0.1; entries past T are ignored.
      num_turns: int `[batch]`, T ≤ max_turns.
      outcome_advantage: float `[batch]`, A_out (GRPO-normalised, see `grpo_advantages`).
      k: the credit horizon K (static).

    Returns:
      float `[batch, max_turns]`: r_k for k < T, zero for k ≥ T.
    """
    chex.assert_rank([ref_gold_logprob_mean, num_turns, outcome_advantage], [2, 1, 1])
    chex.assert_equal_shape_prefix([ref_gold_logprob_mean, num_turns, outcome_advantage], 1)
    max_turns = ref_gold_logprob_mean.shape[1] - 1
    if max_turns < 1 or k < 1:
        raise ValueError(f"trace_turn_rewards: need max_turns >= 1 and k >= 1, got "
                         f"ref_gold_logprob_mean of shape {ref_gold_logprob_mean.shape} and k={k}")
    num_turns = num_turns[:, None]

    # Entries past T are padding; replacing them by ℓ̄_0 keeps garbage (log of ≤ 0) out of δ.
    logprob = ref_gold_logprob_mean.astype(jnp.float32)
    logprob = jnp.where(jnp.arange(max_turns + 1) <= num_turns, logprob, logprob[:, :1])
    gold_distance = -logprob + 0.1
    state_value = jnp.log(gold_distance[:, :1] / gold_distance)
    td = state_value[:, 1:] - state_value[:, :-1]  # δ_s for s = 0..max_turns−1

    turn = jnp.arange(max_turns)  # k
    offset = jnp.arange(k)  # u − k
    u = turn[:, None] + offset[None, :]  # [max_turns, K]
    weight = jnp.where(u < num_turns[:, :, None], gamma_td ** offset.astype(jnp.float32), 0)
    td_window = jnp.take(td, jnp.minimum(u, max_turns - 1), axis=1)  # [batch, max_turns, K]
    # Σ weight > 0 for every real turn (u = k is in its window); padded turns are zeroed below.
    credit = jnp.sum(weight * td_window, axis=2) / jnp.maximum(jnp.sum(weight, axis=2), 1e-30)

    reaches_end = turn + k - 1 >= num_turns - 1  # h = T − 1
    terminal = lambda_term * gamma_td ** (num_turns - turn).astype(jnp.float32) * (
        outcome_advantage[:, None])
    return jnp.where(turn < num_turns, credit + jnp.where(reaches_end, terminal, 0), 0)


def trace_token_advantages(
    turn_rewards: Array,
    outcome_advantage: Array,
    turn_index: Array,
    action_mask: Array,
    *,
    alpha_out: float = 1.0,
    alpha_turn: float = 0.2,
) -> Array:
    """TRACE token advantage `α_out·A_out + α_turn·r_k` on turn k's action tokens, 0 elsewhere.

    Args:
      turn_rewards: float `[batch, max_turns]` from `trace_turn_rewards`.
      outcome_advantage: float `[batch]`, A_out.
      turn_index: int `[batch, time]`, the turn of each action token (`action_span_index` when
        each turn is one action span); read only where `action_mask` is true.
      action_mask: bool or 0/1 `[batch, time]`; observation tokens get 0.
    """
    chex.assert_rank([turn_rewards, outcome_advantage, turn_index], [2, 1, 2])
    chex.assert_equal_shape([turn_index, action_mask])
    turn_index = jnp.clip(turn_index, 0, turn_rewards.shape[1] - 1)
    turn_reward = jnp.take_along_axis(turn_rewards, turn_index, axis=1)
    advantage = alpha_out * outcome_advantage[:, None] + alpha_turn * turn_reward
    return jnp.where(action_mask.astype(bool), advantage, 0)
