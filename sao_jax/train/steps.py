"""Pure training steps over one `TrainState` pytree (docs/algorithms.md §6).

    ttur_step = sequence(repeat(value_update, K), policy_update)

- `value_update`: critic targets G from λ_critic over the critic's own stop-gradient values, then one
  optimizer step on `value_loss(V, G)` (only the critic's trainable leaves move: frozen attention).
- `policy_update`: values recomputed with the *updated* critic, advantages with λ_policy (fixed or
  length-adaptive), then one optimizer step on the configured policy loss (DIS by default).
- `critic_warmup_step = repeat(value_update, K)`: the critic-only steps before the first policy update.
- With `loss.value_clip_eps` set, each of the K value updates is clipped around the critic's values
  before the first (`critic_updates`).
- Mechanism diagnostics (`sao_jax.diagnostics`) ride along: gradient norms by module group in both
  updates, and the critic's fit on the batch before its K updates and after them (the critic lag).

Critic-free rows (running mean, GRPO, RLOO, TRACE) skip the critic: ttur_step = policy_update. Group
estimators read a batch whose rows come in whole groups (`check_whole_groups`); TRACE also reads a frozen
reference policy (`TrainState.reference_params`) and a `TraceBatch` (`trace_batch`).

Every step is `(state, batch, key) -> (state, metrics)`, jitted once per batch shape. The variants
the paper compares are rows of `advantages.ADVANTAGE_ESTIMATORS` and `losses.POLICY_LOSSES`, looked up once
when the steps are built. A non-finite loss or gradient skips that update (`optax.apply_if_finite`:
parameters and optimizer moments unchanged) and is counted in `*/skipped_updates`.

Alignment: a model's output at position t has read tokens ≤ t, so the value of the state in which
token t is generated is read at t−1, like its log-prob (`losses.token_logprobs`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from sao_jax import advantages as adv
from sao_jax import diagnostics, losses, optim
from sao_jax.config import Config
from sao_jax.models import sharding
from sao_jax.rollout.trajectory import TrajectoryBatch

Metrics = dict[str, jax.Array]
Update = Callable[["TrainState", TrajectoryBatch, jax.Array], tuple["TrainState", Metrics]]

# Consecutive non-finite updates tolerated before optax.apply_if_finite would apply one anyway:
# never, here — a skipped update is logged and the run goes on.
_NEVER_APPLY_NONFINITE = 2**30


@struct.dataclass
class TrainState:
    """Everything a training step reads and writes; checkpointed whole.

    `*_params` are the `nnx.Param` leaves; `*_buffers` the models' other variables (e.g. GLM's
    `e_score_correction_bias`), carried so `nnx.merge(graphdef, params, buffers)` rebuilds the model.
    `reference_params`: the frozen reference policy's params when an estimator reads one (TRACE) or
    the policy loss is penalised toward it (`loss.kl_coef` > 0); `freeze_reference` sets them, else
    None. It shares `policy_buffers`, which no step changes.
    """

    policy_params: Any
    policy_buffers: Any
    policy_opt_state: Any
    critic_params: Any
    critic_buffers: Any
    critic_opt_state: Any
    baseline: adv.RunningMeanState
    step: jax.Array
    reference_params: Any = None


class Graphs(NamedTuple):
    """The static halves of the two models (`nnx.split`), bound into the steps when they are built,
    and each model's router load-balancing loss coefficient (its `ModelConfig.router_aux_loss_coef`)."""

    policy: nnx.GraphDef
    critic: nnx.GraphDef
    policy_aux_coef: float = 0.0
    critic_aux_coef: float = 0.0


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, Any, Any]:
    """(graphdef, params, buffers) of an NNX model."""
    return nnx.split(model, nnx.Param, ...)


def policy_logits(graphdef, params, buffers, batch: TrajectoryBatch) -> tuple[jax.Array, jax.Array]:
    """(logits float32 [batch, time, vocab], router aux loss)."""
    model = nnx.merge(graphdef, params, buffers)
    logits, _, aux_loss = model.forward(batch.tokens, attention_mask=batch.valid_mask)
    return logits, aux_loss


def policy_logprobs(graphdef, params, buffers, batch: TrajectoryBatch, config: Config) -> tuple[jax.Array, jax.Array]:
    """(log π(token_t | tokens_<t) float32 [batch, time], router aux loss), in micro-batches of
    `train.micro_batch_size` rows with logits made `train.logit_chunk` positions at a time."""

    def forward(tokens, valid_mask):
        model = nnx.merge(graphdef, params, buffers)
        return model.token_logprobs(tokens, valid_mask, chunk=config.train.logit_chunk)

    return in_micro_batches(forward, batch.tokens, batch.valid_mask, config.train.micro_batch_size)


def critic_head(graphdef, params, buffers, batch: TrajectoryBatch, config: Config) -> tuple[jax.Array, jax.Array]:
    """(the value head's output for the state before each token — V [batch, time], or value-histogram
    logits [batch, time, bins] with `critic.value_head: hl_gauss` — and the router aux loss), in
    micro-batches of `train.micro_batch_size` rows."""

    def forward(tokens, valid_mask):
        raw, _, aux_loss = nnx.merge(graphdef, params, buffers).forward(tokens, attention_mask=valid_mask)
        return raw, aux_loss

    raw, aux_loss = in_micro_batches(forward, batch.tokens, batch.valid_mask, config.train.micro_batch_size)
    return jnp.pad(raw[:, :-1], ((0, 0), (1, 0)) + ((0, 0),) * (raw.ndim - 2)), aux_loss


def value_edges(config: Config) -> jax.Array:
    """The histogram head's bin edges (`losses.hl_gauss_support` of `critic.value_range`, `value_bins`)."""
    low, high = config.critic.value_range
    return losses.hl_gauss_support(low, high, config.critic.value_bins)


def head_values(head: jax.Array, config: Config) -> jax.Array:
    """V [batch, time] from the value head's output: itself (scalar head) or the histogram's mean."""
    return losses.hl_gauss_values(head, value_edges(config)) if config.critic.value_head == "hl_gauss" else head


def critic_values(graphdef, params, buffers, batch: TrajectoryBatch, config: Config) -> tuple[jax.Array, jax.Array]:
    """(V [batch, time] with V[t] the value of the state before token t, router aux loss)."""
    head, aux_loss = critic_head(graphdef, params, buffers, batch, config)
    return head_values(head, config), aux_loss


def in_micro_batches(forward, tokens: jax.Array, valid_mask: jax.Array, micro_batch_size: int):
    """`forward(tokens, valid_mask) -> (per-token [rows, time], aux loss)` over slices of
    `micro_batch_size` rows, one after another: gradient accumulation without an accumulator to keep.

    Each slice runs under `jax.checkpoint` inside `lax.map`, so the backward pass keeps only the
    per-token outputs, remakes one slice's activations at a time, and the scan's backward sums the
    slices' parameter gradients. The outputs are the whole batch's, in row order, so every loss and
    metric computed from them is the whole batch's; the aux loss is the mean of the slices' (a router
    load-balancing loss is not linear in the batch, and a capacity MoE dispatch sizes its expert slots
    per call). Slice i holds rows i, i+n, i+2n, … of n slices, so rows sharded over devices in blocks
    stay spread over the devices within a slice. 0, or ≥ the rows: the whole batch in one call.
    """
    rows = tokens.shape[0]
    if not micro_batch_size or micro_batch_size >= rows:
        return forward(tokens, valid_mask)
    if rows % micro_batch_size:
        raise ValueError(f"train.micro_batch_size={micro_batch_size} must divide the batch's {rows} rows")
    slices = rows // micro_batch_size

    def split(x):  # [rows, ...] -> [slices, micro_batch_size, ...]
        return x.reshape(micro_batch_size, slices, *x.shape[1:]).swapaxes(0, 1)

    per_token, aux = jax.lax.map(lambda xs: jax.checkpoint(forward)(*xs), (split(tokens), split(valid_mask)))
    return per_token.swapaxes(0, 1).reshape(rows, *per_token.shape[2:]), jnp.mean(aux)


# ------------------------------------------------------------------------------------ advantages


def check_whole_groups(prompt_id: np.ndarray, group_size: int) -> None:
    """Raise unless the rows come in whole groups: rows [g·G, (g+1)·G) share one prompt id, real rows
    first, and the real rows are a multiple of G (so padding rows, id −1, also form whole groups).

    The group estimators find a group by position (a prompt may be drawn twice in one batch, so ids
    alone do not tell groups apart). The batch sources keep this invariant: a group that lost a member
    to an environment failure or to staleness is dropped whole, never trained on in part.
    """
    prompt_id = np.asarray(prompt_id)
    if len(prompt_id) % group_size:
        raise ValueError(f"batch of {len(prompt_id)} rows is not a multiple of advantage.group_size={group_size}")
    blocks = prompt_id.reshape(-1, group_size)
    split = np.flatnonzero(np.any(blocks != blocks[:, :1], axis=1))
    if split.size:
        raise ValueError(f"rows {split[0] * group_size}..{(split[0] + 1) * group_size - 1} are not one group "
                         f"(prompt ids {blocks[split[0]].tolist()}); advantage.group_size={group_size}")
    real = prompt_id >= 0
    if np.any(real[1:] & ~real[:-1]):
        raise ValueError(f"padding rows must come after the real rows (prompt ids {prompt_id.tolist()})")


def _outcome_advantages(name: str, batch: TrajectoryBatch, baseline, config: Config):
    """Per-sequence advantages `[batch]` of the critic-free estimators, and the new baseline state.

    grpo / rloo: rows [g·G, (g+1)·G) are group g (`check_whole_groups`); every padding row is in a
    padding group, whose outcomes are all 0, so it gets A = 0 (and has no action tokens anyway).
    """
    outcome = jnp.sum(jnp.where(batch.valid_mask, batch.rewards, 0.0), axis=1)
    real = batch.prompt_id >= 0
    if name == "running_mean":
        advantage, baseline = adv.running_mean_advantages(baseline, running_mean_keys(batch, config), outcome, valid=real)
        return advantage, baseline
    groups = outcome.reshape(-1, config.advantage.group_size)
    grouped = adv.grpo_advantages(groups) if name == "grpo" else adv.rloo_advantages(groups)
    return grouped.reshape(-1), baseline


def running_mean_keys(batch: TrajectoryBatch, config: Config) -> jax.Array:
    """The running mean's key per row: the prompt id (`advantage.running_mean_scope: per_prompt`,
    SAO §4.3) or 0 for every row (`global`, SAO §4.5)."""
    if config.advantage.running_mean_scope == "per_prompt":
        return jnp.maximum(batch.prompt_id, 0)
    return jnp.zeros_like(batch.prompt_id)


def window_fill_metrics(baseline: adv.RunningMeanState, batch: TrajectoryBatch, config: Config) -> Metrics:
    """`advantage/window_fill`: the mean number of earlier rewards in the running-mean windows the
    batch's trajectories read (`advantages.running_mean_window_fill`), and `advantage/window_empty`:
    the share of trajectories whose window is empty (baseline 0: no baseline at all)."""
    real = batch.prompt_id >= 0
    fill = adv.running_mean_window_fill(baseline, running_mean_keys(batch, config), valid=real)
    return {"advantage/window_fill": adv.masked_mean(fill, real),
            "advantage/window_empty": adv.masked_mean((fill == 0).astype(jnp.float32), real)}


def policy_lambda(batch: TrajectoryBatch, config: Config) -> jax.Array:
    """λ_policy per sequence: length-adaptive `1 − 1/(α·l)` when α is set, with l the estimator's
    recursion length (`Estimator.recursion_length`), else the fixed value."""
    alpha = config.advantage.length_adaptive_alpha
    if alpha is None:
        return jnp.full(batch.tokens.shape[:1], config.advantage.lam_policy, jnp.float32)
    estimator = adv.ADVANTAGE_ESTIMATORS[config.advantage.estimator]
    return adv.length_adaptive_lambda(estimator.recursion_length(batch), alpha)


# ------------------------------------------------------------------------------------ TRACE


@struct.dataclass
class TraceBatch(TrajectoryBatch):
    """A `TrajectoryBatch` plus what TRACE's reference scoring reads (docs/algorithms.md §10).

    gold_tokens  int32 `[batch, gold_time]`: the gold answer's ids, left-aligned, 0 past gold_length
    gold_length  int32 `[batch]`: 0 for padding rows
    turn_start   int32 `[batch, turn_slots]`: n_s = the number of tokens before turn s, so the state
                 after s action–observation pairs is `tokens[:n_s]`; the row's length for s >= T
    num_turns    int32 `[batch]`: T, the number of action–observation pairs (0 for padding rows)
    """

    gold_tokens: Any
    gold_length: Any
    turn_start: Any
    num_turns: Any


def _power_of_two_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


def trace_batch(batch: TrajectoryBatch, gold_tokens: Sequence[Sequence[int]]) -> TraceBatch:
    """`batch` (from `collate`, host arrays) with the TRACE fields; `gold_tokens[i]`: row i's gold ids.

    Row i's turns are read from `turn_index` (prompt −1, turn k's action and observation k). Turn
    slots and gold length are padded to powers of two, so the step compiles for a few shapes only.
    """
    valid, turn = np.asarray(batch.valid_mask), np.asarray(batch.turn_index)
    rows = len(valid)
    real = np.asarray(batch.prompt_id) >= 0
    if len(gold_tokens) != real.sum():
        raise ValueError(f"trace_batch: {len(gold_tokens)} gold answers for {real.sum()} real rows")
    gold_length = np.zeros(rows, np.int32)
    gold_length[: len(gold_tokens)] = [len(g) for g in gold_tokens]
    missing = np.flatnonzero(real & (gold_length == 0))
    if missing.size:
        raise ValueError(f"trace_batch: TRACE needs a gold answer; row {missing[0]} has none")
    gold = np.zeros((rows, _power_of_two_at_least(int(gold_length.max()), 8)), np.int32)
    for i, ids in enumerate(gold_tokens):
        gold[i, : len(ids)] = ids
    num_turns = (np.max(np.where(valid, turn, -1), axis=1) + 1).astype(np.int32)
    slots = np.arange(_power_of_two_at_least(int(num_turns.max()) + 1, 2))
    turn_start = np.sum(valid[:, None, :] & (turn[:, None, :] < slots[None, :, None]), axis=2, dtype=np.int32)
    return TraceBatch(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)},
                      gold_tokens=gold, gold_length=gold_length, turn_start=turn_start, num_turns=num_turns)


def reference_gold_logprob_mean(graphdef, params, buffers, batch: TraceBatch, *, logit_chunk: int = 0) -> jax.Array:
    """ℓ̄ `[batch, turn_slots]`: the reference's mean teacher-forced log-prob of the gold answer g after
    each turn slot s,

        ℓ̄[b, s] = (1/|g_b|) · Σ_j log π_ref(g_b,j | tokens_b[:n_bs] ‖ g_b,<j),   n_bs = turn_start[b, s].

    The sequences `tokens[:n] ‖ g` are gathered on device, `[batch, time + gold_time]`, one batched
    forward per slot; `lax.map` runs the slots in turn, so memory stays that of one batch forward
    (logits made `logit_chunk` positions at a time, `Policy.token_logprobs`).
    """
    time, gold_time = batch.tokens.shape[1], batch.gold_tokens.shape[1]
    position = jnp.arange(time + gold_time)

    def score(prefix_length):  # [batch]
        gold_position = position - prefix_length[:, None]
        in_prefix = gold_position < 0
        in_gold = (gold_position >= 0) & (gold_position < batch.gold_length[:, None])
        prefix = jnp.take(batch.tokens, jnp.minimum(position, time - 1), axis=1)
        gold = jnp.take_along_axis(batch.gold_tokens, jnp.clip(gold_position, 0, gold_time - 1), axis=1)
        tokens = jnp.where(in_prefix, prefix, jnp.where(in_gold, gold, 0))
        model = nnx.merge(graphdef, params, buffers)
        logp, _ = model.token_logprobs(tokens, in_prefix | in_gold, chunk=logit_chunk)
        return jnp.sum(jnp.where(in_gold, logp, 0.0), axis=1) / jnp.maximum(batch.gold_length, 1)

    return jax.lax.map(score, batch.turn_start.T).T


def _trace_advantages(state: TrainState, batch: TraceBatch, graphs: Graphs, config: Config):
    """TRACE token advantages `α_out·A_out + α_turn·r_k` (docs/algorithms.md §10), A_out from GRPO."""
    if not isinstance(batch, TraceBatch):
        raise TypeError("advantage.estimator=trace reads a TraceBatch (steps.trace_batch), got "
                        f"{type(batch).__name__}")
    if state.reference_params is None:
        raise ValueError("advantage.estimator=trace needs TrainState.reference_params (make_train_state "
                         "keeps them when the estimator reads a reference)")
    cfg = config.advantage
    outcome_advantage, _ = _outcome_advantages("grpo", batch, state.baseline, config)
    gold_logprob = jax.lax.stop_gradient(
        reference_gold_logprob_mean(graphs.policy, state.reference_params, state.policy_buffers, batch,
                                    logit_chunk=config.train.logit_chunk))
    turn_rewards = adv.trace_turn_rewards(gold_logprob, batch.num_turns, outcome_advantage, k=cfg.trace_k,
                                          gamma_td=cfg.trace_gamma_td, lambda_term=cfg.trace_lambda_term)
    advantages = adv.trace_token_advantages(turn_rewards, outcome_advantage, batch.turn_index, batch.action_mask,
                                            alpha_out=cfg.trace_alpha_out, alpha_turn=cfg.trace_alpha_turn)
    real = batch.num_turns > 0
    at_end = jnp.take_along_axis(gold_logprob, batch.num_turns[:, None], axis=1)[:, 0]
    turns = jnp.arange(turn_rewards.shape[1]) < batch.num_turns[:, None]
    metrics = {
        "trace_gold_logprob_start": adv.masked_mean(gold_logprob[:, 0], real),
        "trace_gold_logprob_end": adv.masked_mean(at_end, real),
        "trace_turn_reward_mean": adv.masked_mean(turn_rewards, turns),
    }
    return advantages, metrics


def keeps_reference(config: Config) -> bool:
    """Whether a run needs the frozen reference policy: TRACE reads it, the KL penalty pulls toward it."""
    return adv.ADVANTAGE_ESTIMATORS[config.advantage.estimator].reference or config.loss.kl_coef > 0


def freeze_reference(state: TrainState) -> TrainState:
    """`state` with its reference set to a copy of the current policy params (TRACE's reference is
    the initial policy after SFT); unchanged when the state keeps no reference."""
    if state.reference_params is None:
        return state
    return state.replace(reference_params=jax.tree.map(jnp.copy, state.policy_params))


# ------------------------------------------------------------------------------------ the steps


def _optimizer_step(tx, params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def skipped_updates(opt_state) -> jax.Array:
    """How many updates `optax.apply_if_finite` has skipped for non-finite gradients."""
    return opt_state.total_notfinite


def guard_nonfinite(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` that leaves parameters and moments unchanged when a gradient is NaN/inf, and counts it."""
    return optax.apply_if_finite(tx, max_consecutive_errors=_NEVER_APPLY_NONFINITE)


def make_value_update(graphs: Graphs, critic_tx, config: Config, trainable: Sequence[str]) -> Update:
    """One critic step on targets G = GAE(λ_critic) computed from the critic's own values: the
    squared error (`losses.value_loss`), or with `critic.value_head: hl_gauss` the cross-entropy to
    G's HL-Gauss histogram (`losses.hl_gauss_value_loss`, σ = `critic.hl_gauss_sigma` bin widths).

    `trainable`: the parameter patterns `critic_tx` was made with (`optim.train_only`); the other
    leaves get zero gradients, which XLA then does not compute. The update takes an optional
    `old_values` `[batch, time]`: given, the value loss is clipped to ±`loss.value_clip_eps` around
    them (`losses.value_loss`; `critic_updates` passes the critic's values before a step's K updates).
    """
    estimator = adv.ADVANTAGE_ESTIMATORS[config.advantage.estimator]
    gamma, lam = config.advantage.gamma, config.advantage.lam_critic
    aux_coef = graphs.critic_aux_coef
    trainable = tuple(trainable)
    histogram = config.critic.value_head == "hl_gauss"
    low, high = config.critic.value_range
    sigma = config.critic.hl_gauss_sigma * (high - low) / config.critic.value_bins  # in return units

    def value_update(state: TrainState, batch: TrajectoryBatch, key: jax.Array, old_values=None):
        del key  # deterministic; the signature is shared by all steps
        mask = estimator.value_mask(batch)
        clip_eps = None if old_values is None else config.loss.value_clip_eps

        def loss_fn(params):
            head, aux_loss = critic_head(graphs.critic, params, state.critic_buffers, batch, config)
            values = head_values(head, config)
            _, targets = estimator.gae(batch, jax.lax.stop_gradient(values), gamma, lam)
            if histogram:
                loss, metrics = losses.hl_gauss_value_loss(head, targets, mask, edges=value_edges(config),
                                                           sigma=sigma)  # fmt: skip
            else:
                loss, metrics = losses.value_loss(values, targets, mask, old_values=old_values, clip_eps=clip_eps)
            return loss + aux_coef * aux_loss, {**metrics, "value_loss": loss, "router_aux_loss": aux_loss}

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.critic_params)
        grads = optim.zero_frozen(grads, trainable)
        params, opt_state = _optimizer_step(critic_tx, state.critic_params, state.critic_opt_state, grads)
        metrics |= {"grad_norm": optax.global_norm(grads), "skipped_updates": skipped_updates(opt_state),
                    **{f"grad_norm/{group}": norm for group, norm in diagnostics.group_grad_norms(grads).items()}}
        state = state.replace(critic_params=params, critic_opt_state=opt_state)
        return state, {f"critic/{k}": v for k, v in metrics.items()}

    return value_update


def critic_updates(value_update: Update, times: int, graphs: Graphs, config: Config) -> Update:
    """`repeat(value_update, times)`, with the critic's fit to its targets on the fresh batch, before
    the first update, kept as `critic/before_updates/*` (an update's metrics are measured before it
    moves the critic, so the first one's are the fit before any). With `loss.value_clip_eps` set, every
    update is clipped around the values of the critic before the first (PPO's V_old)."""

    def updates(state, batch, key):
        update = value_update
        if config.loss.value_clip_eps is not None:
            old_values, _ = critic_values(graphs.critic, state.critic_params, state.critic_buffers, batch, config)
            update = functools.partial(value_update, old_values=jax.lax.stop_gradient(old_values))
        first_key, rest_key = jax.random.split(key)
        state, metrics = update(state, batch, first_key)
        before = {f"critic/before_updates/{name}": metrics[f"critic/{name}"] for name in _FIT_METRICS}
        if times > 1:
            state, metrics = repeat(update, times - 1)(state, batch, rest_key)
        return state, metrics | before

    return updates


_FIT_METRICS = ("explained_variance", "mse")


def estimator_advantages(state: TrainState, batch: TrajectoryBatch, graphs: Graphs, config: Config):
    """(advantages [batch, time], values or None, new baseline state) of the configured estimator,
    a critic-based one (GAE with λ_policy over the current critic's values) or an outcome one (one
    advantage per sequence on its action tokens). Not TRACE, which reads a `TraceBatch`."""
    name = config.advantage.estimator
    estimator = adv.ADVANTAGE_ESTIMATORS[name]
    if estimator.gae is not None:
        values, _ = critic_values(graphs.critic, state.critic_params, state.critic_buffers, batch, config)
        advantages, _ = estimator.gae(batch, values, config.advantage.gamma, policy_lambda(batch, config))
        return advantages, values, state.baseline
    per_sequence, baseline = _outcome_advantages(name, batch, state.baseline, config)
    return jnp.where(batch.action_mask, per_sequence[:, None], 0.0), None, baseline


def make_policy_update(graphs: Graphs, policy_tx, config: Config) -> Update:
    """Advantages with λ_policy from the current critic (or a critic-free baseline), one policy step
    on the configured loss plus, with `loss.kl_coef` = β > 0, β · `losses.kl_penalty` toward the frozen
    reference (logged as `policy/kl_to_reference`)."""
    name = config.advantage.estimator
    estimator = adv.ADVANTAGE_ESTIMATORS[name]
    loss_cfg = config.loss
    policy_loss = _bind_policy_loss(loss_cfg)
    needs_old = loss_cfg.name in ("ppo_clip", "icepop")
    aux_coef = graphs.policy_aux_coef
    kl_coef = loss_cfg.kl_coef

    def policy_update(state: TrainState, batch: TrajectoryBatch, key: jax.Array):
        del key
        baseline = state.baseline
        extra: Metrics = {}
        reference_logp = None
        if kl_coef > 0:
            reference_logp, _ = policy_logprobs(graphs.policy, state.reference_params, state.policy_buffers, batch,
                                                config)
            reference_logp = jax.lax.stop_gradient(reference_logp)
        critic_fit: Metrics = {}
        baseline_metrics = window_fill_metrics(state.baseline, batch, config) if name == "running_mean" else {}
        if estimator.reference:
            advantages, extra = _trace_advantages(state, batch, graphs, config)
        else:
            advantages, values, baseline = estimator_advantages(state, batch, graphs, config)
        if estimator.gae is not None:
            # The critic as this update reads it (after its K updates), against its own λ_critic targets.
            _, targets = estimator.gae(batch, values, config.advantage.gamma, config.advantage.lam_critic)
            critic_fit = diagnostics.fit_metrics(values, targets, estimator.value_mask(batch))

        def loss_fn(params):
            logp, aux_loss = policy_logprobs(graphs.policy, params, state.policy_buffers, batch, config)
            # One update per batch: π_θ_old is the pre-update policy, i.e. these very parameters.
            old_logp = jax.lax.stop_gradient(logp) if needs_old else None
            inputs = losses.PolicyLossInputs(
                logp=logp,
                rollout_logp=batch.rollout_logprobs,
                old_logp=old_logp,
                advantages=jax.lax.stop_gradient(advantages),
                action_mask=batch.action_mask,
                rollout_entropy=batch.rollout_entropy,
                fresh_mask=batch.staleness == 0,
            )
            loss, metrics = policy_loss(inputs)
            total = loss + aux_coef * aux_loss
            if reference_logp is not None:
                kl = losses.kl_penalty(logp, reference_logp, batch.action_mask)
                total, metrics = total + kl_coef * kl, {**metrics, "kl_to_reference": kl}
            return total, {**metrics, "loss": loss, "router_aux_loss": aux_loss}

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.policy_params)
        params, opt_state = _optimizer_step(policy_tx, state.policy_params, state.policy_opt_state, grads)
        action = batch.action_mask
        metrics |= {
            "grad_norm": optax.global_norm(grads),
            "skipped_updates": skipped_updates(opt_state),
            "advantage_mean": adv.masked_mean(advantages, action),
            "advantage_std": jnp.sqrt(adv.masked_var(advantages, action, unbiased=False)),
            **diagnostics.action_edge_advantages(advantages, action),
            # Per row (the loop takes it out of the line): replicated, so every process can read it.
            diagnostics.ROW_METRICS_PREFIX + "first_action_advantage": sharding.with_logical_constraint(
                diagnostics.first_action_advantages(advantages, action), (None,)),
            **{f"grad_norm/{group}": norm for group, norm in diagnostics.group_grad_norms(grads).items()},
            **extra,
        }
        state = state.replace(policy_params=params, policy_opt_state=opt_state, baseline=baseline)
        return state, ({k if k.startswith("mismatch/") else f"policy/{k}": v for k, v in metrics.items()}
                       | baseline_metrics
                       | {f"critic/after_updates/{k}": v for k, v in critic_fit.items()})  # fmt: skip

    return policy_update


def _bind_policy_loss(loss_cfg) -> Callable[[losses.PolicyLossInputs], tuple[jax.Array, Metrics]]:
    if loss_cfg.name not in losses.POLICY_LOSSES:
        raise ValueError(f"loss.name must be one of {sorted(losses.POLICY_LOSSES)} (got {loss_cfg.name!r})")
    clip = {"eps_low": loss_cfg.eps_low, "eps_high": loss_cfg.eps_high}
    hyper = {
        "dis": clip,
        "ppo_clip": clip,
        "ppo_clip_rollout": clip,
        "pg": {},
        "icepop": {**clip, "alpha": loss_cfg.icepop_alpha, "beta": loss_cfg.icepop_beta},
        "estr": {**clip, "tau": loss_cfg.estr_tau, "eps": loss_cfg.estr_eps},
    }[loss_cfg.name]
    return functools.partial(losses.POLICY_LOSSES[loss_cfg.name], **hyper)


def repeat(update: Update, times: int) -> Update:
    """`update` applied `times` times in a row to the same batch; metrics of the last application."""
    if times < 1:
        raise ValueError(f"repeat needs times >= 1 (got {times})")

    def repeated(state, batch, key):
        for subkey in jax.random.split(key, times):  # K is small and static: unrolled on purpose
            state, metrics = update(state, batch, subkey)
        return state, metrics

    return repeated


def sequence(*updates: Update) -> Update:
    """The updates applied in order to the same batch; their metrics merged, then the step counted."""

    def run(state, batch, key):
        metrics: Metrics = {}
        for update, subkey in zip(updates, jax.random.split(key, len(updates))):
            state, new = update(state, batch, subkey)
            metrics |= new
        return state.replace(step=state.step + 1), metrics

    return run


class Steps(NamedTuple):
    """The jitted steps of one run (each compiled once per batch shape)."""

    ttur_step: Update
    critic_warmup_step: Update
    value_update: Update
    policy_update: Update


def build_steps(graphs: Graphs, policy_tx, critic_tx, config: Config) -> Steps:
    """Look the variants up once and compose: ttur_step = sequence(repeat(value_update, K), policy_update).

    `policy_tx` / `critic_tx` must be the transforms the state's optimizer states were made with
    (`make_train_state` wraps them in `guard_nonfinite`), the critic's restricted to
    `critic.trainable_patterns` (`optim.train_only`). Critic-free estimators skip the critic.
    """
    estimator = adv.ADVANTAGE_ESTIMATORS[config.advantage.estimator]
    value_update = make_value_update(graphs, critic_tx, config, config.critic.trainable_patterns)
    policy_update = make_policy_update(graphs, policy_tx, config)
    if estimator.gae is None:
        ttur = sequence(policy_update)
        warmup = sequence(lambda state, batch, key: (state, {}))
    else:
        k_value_updates = critic_updates(value_update, config.critic.updates_per_policy_update, graphs, config)
        ttur = sequence(k_value_updates, policy_update)
        warmup = sequence(k_value_updates)
    jit = functools.partial(jax.jit, donate_argnums=0)
    return Steps(
        ttur_step=jit(ttur),
        critic_warmup_step=jit(warmup),
        value_update=jit(sequence(value_update)),
        policy_update=jit(sequence(policy_update)),
    )


def make_train_state(
    policy: nnx.Module,
    critic: nnx.Module,
    policy_tx: optax.GradientTransformation,
    critic_tx: optax.GradientTransformation,
    config: Config,
    *,
    num_prompts: int = 1,
) -> tuple[TrainState, Graphs]:
    """Split the models, initialise both optimizer states and the running-mean baseline; keep a
    reference copy of the policy when the estimator reads one or the loss is penalised toward it
    (`freeze_reference` re-takes it)."""
    policy_graph, policy_params, policy_buffers = split_model(policy)
    critic_graph, critic_params, critic_buffers = split_model(critic)
    scope_keys = num_prompts if config.advantage.running_mean_scope == "per_prompt" else 1
    state = TrainState(
        policy_params=policy_params,
        policy_buffers=policy_buffers,
        policy_opt_state=policy_tx.init(policy_params),
        critic_params=critic_params,
        critic_buffers=critic_buffers,
        critic_opt_state=critic_tx.init(critic_params),
        baseline=adv.running_mean_init(scope_keys, config.advantage.running_mean_window),
        step=jnp.zeros((), jnp.int32),
        reference_params=jax.tree.map(jnp.copy, policy_params) if keeps_reference(config) else None,
    )
    graphs = Graphs(
        policy=policy_graph,
        critic=critic_graph,
        policy_aux_coef=policy.config.router_aux_loss_coef,
        critic_aux_coef=critic.config.router_aux_loss_coef,
    )
    return state, graphs
