"""Pure training steps over one `TrainState` pytree (ALGORITHMS.md §6).

    ttur_step = sequence(repeat(value_update, K), policy_update)

- `value_update`: critic targets G from λ_critic over the critic's own stop-gradient values, then one
  optimizer step on `value_loss(V, G)` (only the critic's trainable leaves move: frozen attention).
- `policy_update`: values recomputed with the *updated* critic, advantages with λ_policy (fixed or
  length-adaptive), then one optimizer step on the configured policy loss (DIS by default).
- `critic_warmup_step = repeat(value_update, K)`: the critic-only steps before the first policy update.

Every step is `(state, batch, key) -> (state, metrics)`, jitted once per batch shape. The variants
the paper compares are rows of `ADVANTAGE_ESTIMATORS` and `losses.POLICY_LOSSES`, looked up once
when the steps are built. A non-finite loss or gradient skips that update (`optax.apply_if_finite`:
parameters and optimizer moments unchanged) and is counted in `*/skipped_updates`.

Alignment: a model's output at position t has read tokens ≤ t, so the value of the state in which
token t is generated is read at t−1, like its log-prob (`losses.token_logprobs`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from sao_jax import advantages as adv
from sao_jax import losses, optim
from sao_jax.config import Config
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
    """

    policy_params: Any
    policy_buffers: Any
    policy_opt_state: Any
    critic_params: Any
    critic_buffers: Any
    critic_opt_state: Any
    baseline: adv.RunningMeanState
    step: jax.Array


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


def critic_values(graphdef, params, buffers, batch: TrajectoryBatch) -> tuple[jax.Array, jax.Array]:
    """(V [batch, time] with V[t] the value of the state before token t, router aux loss)."""
    model = nnx.merge(graphdef, params, buffers)
    raw, _, aux_loss = model.forward(batch.tokens, attention_mask=batch.valid_mask)
    return jnp.pad(raw[:, :-1], ((0, 0), (1, 0))), aux_loss


# ------------------------------------------------------------------------------------ advantages


@dataclasses.dataclass(frozen=True)
class Estimator:
    """One row of the advantage table.

    gae: `(batch, values, gamma, lam) -> (advantages, returns)` for critic-based rows, else None.
    value_mask: `batch -> mask` of the tokens the critic is trained on.
    """

    gae: Callable[..., tuple[jax.Array, jax.Array]] | None
    value_mask: Callable[[TrajectoryBatch], jax.Array] = lambda b: b.action_mask


def _on_batch(fn, **fixed):
    return lambda b, values, gamma, lam: fn(b.rewards, values, b.action_mask, gamma=gamma, lam=lam, **fixed)


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "skip_observation_gae": Estimator(_on_batch(adv.skip_observation_gae)),
    "cross_observation_gae": Estimator(
        lambda b, values, gamma, lam: adv.cross_observation_gae(
            b.rewards, values, b.action_mask, b.valid_mask, gamma=gamma, lam=lam
        ),
        value_mask=lambda b: b.valid_mask,  # (ours) every valid token is a step, so every one has a target
    ),
    "step_gae_mean": Estimator(_on_batch(adv.step_gae, value_reduce="mean")),
    "step_gae_last": Estimator(_on_batch(adv.step_gae, value_reduce="last")),
    # Critic-free rows: one outcome advantage per sequence, on all of its action tokens.
    "running_mean": Estimator(None),
    "grpo": Estimator(None),
    "rloo": Estimator(None),
}


def _outcome_advantages(name: str, batch: TrajectoryBatch, baseline, config: Config):
    """Per-sequence advantages `[batch]` of the critic-free estimators, and the new baseline state."""
    outcome = jnp.sum(jnp.where(batch.valid_mask, batch.rewards, 0.0), axis=1)
    real = batch.prompt_id >= 0
    if name == "running_mean":
        per_prompt = config.advantage.running_mean_scope == "per_prompt"
        keys = jnp.maximum(batch.prompt_id, 0) if per_prompt else jnp.zeros_like(batch.prompt_id)
        advantage, baseline = adv.running_mean_advantages(baseline, keys, outcome, valid=real)
        return advantage, baseline
    groups = outcome.reshape(-1, config.advantage.group_size)
    grouped = adv.grpo_advantages(groups) if name == "grpo" else adv.rloo_advantages(groups)
    return grouped.reshape(-1), baseline


def policy_lambda(batch: TrajectoryBatch, config: Config) -> jax.Array:
    """λ_policy per sequence: length-adaptive `1 − 1/(α·l)` when α is set, else the fixed value."""
    alpha = config.advantage.length_adaptive_alpha
    if alpha is None:
        return jnp.full(batch.tokens.shape[:1], config.advantage.lam_policy, jnp.float32)
    return adv.length_adaptive_lambda(jnp.sum(batch.action_mask, axis=1), alpha)


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


def make_value_update(graphs: Graphs, critic_tx, config: Config) -> Update:
    """One critic step on targets G = GAE(λ_critic) computed from the critic's own values."""
    estimator = ADVANTAGE_ESTIMATORS[config.advantage.estimator]
    gamma, lam = config.advantage.gamma, config.advantage.lam_critic
    aux_coef = graphs.critic_aux_coef
    trainable = config.critic.trainable_patterns

    def value_update(state: TrainState, batch: TrajectoryBatch, key: jax.Array):
        del key  # deterministic; the signature is shared by all steps
        mask = estimator.value_mask(batch)

        def loss_fn(params):
            values, aux_loss = critic_values(graphs.critic, params, state.critic_buffers, batch)
            _, targets = estimator.gae(batch, jax.lax.stop_gradient(values), gamma, lam)
            loss, metrics = losses.value_loss(values, targets, mask)
            return loss + aux_coef * aux_loss, {**metrics, "value_loss": loss, "router_aux_loss": aux_loss}

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.critic_params)
        grads = optim.zero_frozen(grads, trainable)  # frozen attention: no weight gradients computed
        params, opt_state = _optimizer_step(critic_tx, state.critic_params, state.critic_opt_state, grads)
        metrics |= {"grad_norm": optax.global_norm(grads), "skipped_updates": skipped_updates(opt_state)}
        state = state.replace(critic_params=params, critic_opt_state=opt_state)
        return state, {f"critic/{k}": v for k, v in metrics.items()}

    return value_update


def make_policy_update(graphs: Graphs, policy_tx, config: Config) -> Update:
    """Advantages with λ_policy from the current critic (or a critic-free baseline), one policy step."""
    name = config.advantage.estimator
    estimator = ADVANTAGE_ESTIMATORS[name]
    loss_cfg = config.loss
    policy_loss = _bind_policy_loss(loss_cfg)
    needs_old = loss_cfg.name in ("ppo_clip", "icepop")
    aux_coef = graphs.policy_aux_coef

    def policy_update(state: TrainState, batch: TrajectoryBatch, key: jax.Array):
        del key
        baseline = state.baseline
        if estimator.gae is not None:
            values, _ = critic_values(graphs.critic, state.critic_params, state.critic_buffers, batch)
            advantages, _ = estimator.gae(batch, values, config.advantage.gamma, policy_lambda(batch, config))
        else:
            per_sequence, baseline = _outcome_advantages(name, batch, baseline, config)
            advantages = jnp.where(batch.action_mask, per_sequence[:, None], 0.0)

        def loss_fn(params):
            logits, aux_loss = policy_logits(graphs.policy, params, state.policy_buffers, batch)
            logp = losses.token_logprobs(logits, batch.tokens)
            # One update per batch: π_θ_old is the pre-update policy, i.e. these very parameters.
            old_logp = jax.lax.stop_gradient(logp) if needs_old else None
            inputs = losses.PolicyLossInputs(
                logp=logp,
                rollout_logp=batch.rollout_logprobs,
                old_logp=old_logp,
                advantages=jax.lax.stop_gradient(advantages),
                action_mask=batch.action_mask,
                rollout_entropy=batch.rollout_entropy,
            )
            loss, metrics = policy_loss(inputs)
            return loss + aux_coef * aux_loss, {**metrics, "loss": loss, "router_aux_loss": aux_loss}

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.policy_params)
        params, opt_state = _optimizer_step(policy_tx, state.policy_params, state.policy_opt_state, grads)
        action = batch.action_mask
        metrics |= {
            "grad_norm": optax.global_norm(grads),
            "skipped_updates": skipped_updates(opt_state),
            "advantage_mean": adv.masked_mean(advantages, action),
            "advantage_std": jnp.sqrt(adv.masked_var(advantages, action, unbiased=False)),
        }
        state = state.replace(policy_params=params, policy_opt_state=opt_state, baseline=baseline)
        return state, {f"policy/{k}": v for k, v in metrics.items()}

    return policy_update


def _bind_policy_loss(loss_cfg) -> Callable[[losses.PolicyLossInputs], tuple[jax.Array, Metrics]]:
    if loss_cfg.name not in losses.POLICY_LOSSES:
        raise ValueError(f"loss.name must be one of {sorted(losses.POLICY_LOSSES)} (got {loss_cfg.name!r})")
    clip = {"eps_low": loss_cfg.eps_low, "eps_high": loss_cfg.eps_high}
    hyper = {
        "dis": clip,
        "ppo_clip": clip,
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
    (`make_train_state` wraps them in `guard_nonfinite`). Critic-free estimators skip the critic.
    """
    estimator_name = config.advantage.estimator
    if estimator_name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"advantage.estimator must be one of {sorted(ADVANTAGE_ESTIMATORS)} (got {estimator_name!r})"
        )
    value_update = make_value_update(graphs, critic_tx, config)
    policy_update = make_policy_update(graphs, policy_tx, config)
    k = config.critic.updates_per_policy_update
    if ADVANTAGE_ESTIMATORS[estimator_name].gae is None:
        ttur = sequence(policy_update)
        warmup = sequence(lambda state, batch, key: (state, {}))
    else:
        ttur = sequence(repeat(value_update, k), policy_update)
        warmup = sequence(repeat(value_update, k))
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
    """Split the models, initialise both optimizer states and the running-mean baseline."""
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
    )
    graphs = Graphs(
        policy=policy_graph,
        critic=critic_graph,
        policy_aux_coef=policy.config.router_aux_loss_coef,
        critic_aux_coef=critic.config.router_aux_loss_coef,
    )
    return state, graphs
