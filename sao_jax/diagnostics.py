"""Mechanism diagnostics: what an SAO mechanism does to the critic and the policy, measured directly.

Each is a pure function of arrays, logged by the train steps (`train.steps`) beside the losses:

* `group_grad_norms` — the gradient's L2 norm per module group (attention, routed experts, router,
  dense MLP, embeddings and norms, value head), before clipping: `critic/grad_norm/<group>` and
  `policy/grad_norm/<group>`. The paper traces the critic's instability to gradients far larger than
  the policy's, concentrated in the full-attention layers; with the attention frozen its group is 0.
* `fit_metrics` — the critic's explained variance and mean squared error against its λ_critic
  targets on a batch: `critic/before_updates/*` on the fresh batch before the critic trains on it,
  `critic/after_updates/*` after its K updates (read where the policy update recomputes the values).
  The gap is the critic lag that TTUR is meant to close.

* `action_edge_advantages` — the mean advantage on the first token of each action and on its last:
  `policy/advantage_first_action_token`, `policy/advantage_last_action_token`. Bootstrapped token-level
  GAE can put an episode's credit on either end; an outcome baseline gives both the same.
* `first_action_advantages` — per row, the advantage on its first action token, `[batch]`, returned by
  the policy update as `policy/rows/first_action_advantage` (`ROW_METRICS_PREFIX`: the loop takes the
  per-row values out of the metric line and logs what they say per trajectory, e.g. the online
  experiment's first-action advantage by the style the trajectory wrote).

The advantage's per-token spread over action tokens is `policy/advantage_std` (`advantages.masked_var`).
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp

from sao_jax.optim import param_path

# (group, regex over "/"-joined parameter paths); the first group whose regex matches a whole path
# takes the parameter, and a parameter no regex matches is counted in "embeddings_norms".
MODULE_GROUPS: tuple[tuple[str, str], ...] = (
    ("value_head", r"(.*/)?value_head/.*"),
    ("router", r"(.*/)?mlp/router/.*"),
    ("experts", r"(.*/)?mlp/(experts|shared_experts)/.*"),
    ("dense_mlp", r"(.*/)?mlp/(gate_proj|up_proj|down_proj)(/.*)?"),
    ("attention", r"(.*/)?attn/.*"),
)
OTHER_GROUP = "embeddings_norms"


def module_group(path: str) -> str:
    """The group of a parameter path (`MODULE_GROUPS`, else `OTHER_GROUP`)."""
    for name, pattern in MODULE_GROUPS:
        if re.fullmatch(pattern, path):
            return name
    return OTHER_GROUP


def group_grad_norms(grads: Any) -> dict[str, jax.Array]:
    """Per module group g, ‖∇_g‖₂ = sqrt(Σ_{leaves in g} Σ x²); 0 for a group the model lacks. The
    grouping is decided from the paths when traced, so it costs one reduction per leaf."""
    squares = {name: jnp.zeros((), jnp.float32) for name, _ in MODULE_GROUPS} | {OTHER_GROUP: jnp.zeros((), jnp.float32)}
    leaves = jax.tree_util.tree_flatten_with_path(grads, is_leaf=lambda x: hasattr(x, "get_value"))[0]
    for key_path, leaf in leaves:
        value = leaf.get_value() if hasattr(leaf, "get_value") else leaf
        squares[module_group(param_path(key_path))] += jnp.sum(jnp.square(value.astype(jnp.float32)))
    return {name: jnp.sqrt(total) for name, total in squares.items()}


# The least explained variance `fit_metrics` can report (see there).
EXPLAINED_VARIANCE_FLOOR = -1.0 - 2e6


def fit_metrics(values: jax.Array, targets: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """Over the tokens of `mask`: explained variance 1 − Var[G − V] / Var[G] and mean squared error
    mean (V − G)² (population variances, as `losses.value_loss` reports them).

    Where the targets are constant up to float rounding, Var[G] ≤ 1e-6 · (mean G² + mean V²), the
    explained variance is 0: there is nothing to explain, and the ratio would divide by rounding
    noise. The scale includes V because targets built from the values carry the values' rounding:
    step-level returns A_i + V_i of a batch without reward are 0 up to ~1e-8, not exactly 0. So the
    explained variance is bounded below: Var[G − V] ≤ 2 Var[V] + 2 Var[G] gives
    EV ≥ −1 − 2·10⁶ = `EXPLAINED_VARIANCE_FLOOR`."""
    mask = mask.astype(bool)
    count = jnp.maximum(jnp.sum(mask), 1)

    def mean(x):
        return jnp.sum(jnp.where(mask, x, 0.0)) / count

    error = values - targets
    target_variance = mean(jnp.square(targets - mean(targets)))
    error_variance = mean(jnp.square(error - mean(error)))
    varies = target_variance > 1e-6 * (mean(jnp.square(targets)) + mean(jnp.square(values)))
    explained = jnp.where(varies, 1.0 - error_variance / jnp.where(varies, target_variance, 1.0), 0.0)
    return {"explained_variance": explained, "mse": mean(jnp.square(error))}


def action_edge_advantages(advantages: jax.Array, action_mask: jax.Array) -> dict[str, jax.Array]:
    """Mean of `advantages` [batch, time] over the first token of every action (an action token whose
    predecessor is not one) and over the last (an action token whose successor is not one); 0 without
    actions. Keys: `advantage_first_action_token`, `advantage_last_action_token`."""
    action = action_mask.astype(bool)
    outside = jnp.zeros_like(action[:, :1])
    first = action & ~jnp.concatenate([outside, action[:, :-1]], axis=1)
    last = action & ~jnp.concatenate([action[:, 1:], outside], axis=1)

    def mean(mask):
        return jnp.sum(jnp.where(mask, advantages, 0.0)) / jnp.maximum(jnp.sum(mask), 1)

    return {"advantage_first_action_token": mean(first), "advantage_last_action_token": mean(last)}


# Metrics with a value per batch row (`[batch]`, not scalars) carry this prefix after their model's
# ("policy/rows/..."): the loop takes them out of the metric line before it is written.
ROW_METRICS_PREFIX = "rows/"


def first_action_advantages(advantages: jax.Array, action_mask: jax.Array) -> jax.Array:
    """`[batch]`: each row's advantage on its first action token (the first True of `action_mask`);
    0 for a row without actions. In a one-turn task whose first token is the style marker, the push
    the update gives that row's style choice."""
    action = action_mask.astype(bool)
    first = jnp.argmax(action, axis=1)
    value = jnp.take_along_axis(advantages, first[:, None], axis=1)[:, 0]
    return jnp.where(jnp.any(action, axis=1), value, 0.0)
