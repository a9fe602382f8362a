"""Parameter labels, the frozen-attention critic optimizer, and optimizer factories (docs/algorithms.md §7).

During RL the critic trains only its MoE projections (router, routed experts, shared experts) and its
value head; attention, embeddings and norms are frozen. Freezing is an optax partition:

    tx_frozen = partition({"trainable": tx, "frozen": set_to_zero()}, labels)

so a frozen parameter gets a zero update and — because `set_to_zero` is stateless and `tx` only sees
the trainable subset — holds no optimizer state at all.

Which parameters train is data: a tuple of regular expressions over parameter paths. A path is the
"/"-joined key path of the parameter in the params pytree (`nnx.state(model, nnx.Param)`, the state
half of `nnx.split`, or a plain nested dict), e.g. `layers/0/attn/q_proj/kernel`.

Match rule: a parameter is trainable iff at least one pattern matches its *whole* path
(`re.fullmatch`); otherwise it is frozen. Every pattern must match at least one parameter, or labelling
fails with an error naming the pattern — a typo in an ablation config must not silently freeze the
whole model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

TRAINABLE = "trainable"
FROZEN = "frozen"

# SAO §3.2: router, routed experts, shared experts of every MoE layer, plus the value head. One
# alternation covers the three MoE parts so the preset also fits models without shared experts
# (Qwen3-MoE) under the every-pattern-must-match rule. (ours) Dense-FFN layers (`mlp/gate_proj` etc.,
# e.g. GLM's first dense layers) are NOT trained: §3.2 names only the MoE projections; add
# r"(.*/)?mlp/(gate_proj|up_proj|down_proj)" to train them too.
CRITIC_FROZEN_ATTENTION_TRAINABLE: tuple[str, ...] = (
    r"(.*/)?mlp/(router|experts|shared_experts)/.*",
    r"(.*/)?value_head/.*",
)

# "w/o frozen attention": every parameter trains.
ALL_TRAINABLE: tuple[str, ...] = (r".*",)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def param_path(key_path: Sequence[Any]) -> str:
    """The "/"-joined path of a parameter from a JAX key path, e.g. `layers/0/attn/q_proj/kernel`."""
    return "/".join(_key_name(k) for k in key_path)


def param_paths(params: Any) -> list[str]:
    """Paths of all parameters in `params` (an `nnx.State` or nested dict), in pytree order."""
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]
    return [param_path(key_path) for key_path, _ in leaves]


def label_params(params: Any, trainable_patterns: Sequence[str]) -> Any:
    """`"trainable"`/`"frozen"` for each parameter of `params`, as a pytree prefix of `params`.

    trainable(path) = any(re.fullmatch(pattern, path) for pattern in trainable_patterns)

    NNX variables that are not `nnx.Param` (buffers) are always frozen, whatever their path.
    Raises ValueError naming any pattern that is not a valid regex or matches no parameter.
    """
    if isinstance(trainable_patterns, str):
        raise TypeError(f"trainable_patterns must be a sequence of patterns, got the string {trainable_patterns!r}")
    compiled = []
    for pattern in trainable_patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as err:
            raise ValueError(f"trainable parameter pattern {pattern!r} is not a valid regex: {err}") from None
    matched = [False] * len(compiled)

    def label(key_path: Any, leaf: Any) -> str:
        if isinstance(leaf, nnx.Variable) and not isinstance(leaf, nnx.Param):
            return FROZEN  # buffers (GLM's e_score_correction_bias, RNG state) never train by gradient
        path = param_path(key_path)
        hits = [i for i, regex in enumerate(compiled) if regex.fullmatch(path)]
        for i in hits:
            matched[i] = True
        return TRAINABLE if hits else FROZEN

    labels = jax.tree_util.tree_map_with_path(label, params, is_leaf=_is_variable)
    unmatched = [p for p, hit in zip(trainable_patterns, matched) if not hit]
    if unmatched:
        example = ", ".join(param_paths(params)[:4])
        raise ValueError(
            f"trainable parameter pattern(s) {unmatched} match no parameter; patterns must match a whole "
            f"'/'-joined path such as {example}"
        )
    return labels


def train_only(tx: optax.GradientTransformation, trainable_patterns: Sequence[str]) -> optax.GradientTransformation:
    """`tx` on the parameters matching `trainable_patterns`; zero update and no state for the rest.

    Anything inside `tx` (e.g. global-norm clipping) sees only the trainable gradients.
    """
    patterns = tuple(trainable_patterns)
    return optax.partition(
        {TRAINABLE: tx, FROZEN: optax.set_to_zero()},
        lambda params: label_params(params, patterns),
    )


def zero_frozen(grads: Any, trainable_patterns: Sequence[str]) -> Any:
    """`grads` with every frozen leaf replaced by constant zeros.

    `train_only` already ignores frozen gradients; zeroing them where they are made lets XLA drop
    their computation (the weight gradients of frozen attention) instead of computing and discarding it.
    """
    labels = label_params(grads, tuple(trainable_patterns))
    return jax.tree.map(
        lambda label, g: g if label == TRAINABLE else jax.tree.map(jnp.zeros_like, g), labels, grads
    )


def learning_rate_schedule(
    peak_value: float, *, warmup_steps: int = 0, total_steps: int | None = None, end_value: float = 0.0
) -> optax.Schedule:
    """Linear warmup, then constant or cosine decay.

    lr(t) = peak · t / warmup                                           for t < warmup
    lr(t) = peak                                                        after, if total_steps is None
    lr(t) = end + (peak − end) · ½ (1 + cos(π (t − warmup) / (total − warmup)))   for warmup ≤ t ≤ total
    lr(t) = end                                                         for t > total
    """
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0 (got {warmup_steps})")
    if total_steps is None:
        if warmup_steps == 0:  # optax's warmup schedules stay at 0 when warmup_steps is 0
            return optax.constant_schedule(peak_value)
        return optax.warmup_constant_schedule(0.0, peak_value, warmup_steps)
    if total_steps <= warmup_steps:
        raise ValueError(f"total_steps must exceed warmup_steps (got total_steps={total_steps}, warmup_steps={warmup_steps})")
    return optax.warmup_cosine_decay_schedule(0.0, peak_value, warmup_steps, total_steps, end_value)


def adamw(
    learning_rate: float | optax.Schedule,
    *,
    max_grad_norm: float | None = 1.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
    """AdamW after clipping gradients to global norm `max_grad_norm` (None: no clipping).

    g ← g · min(1, max_grad_norm / ‖g‖₂)        (‖·‖₂ over all leaves the transform sees)
    m ← β₁ m + (1 − β₁) g,   v ← β₂ v + (1 − β₂) g²,   m̂ = m / (1 − β₁ᵗ),   v̂ = v / (1 − β₂ᵗ)
    p ← p − lr_t · (m̂ / (√v̂ + ε) + weight_decay · p)
    Moments are kept in the parameters' dtype (optax's default).
    """
    adam = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if max_grad_norm is None:
        return adam
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), adam)


def tree_bytes(tree: Any) -> int:
    """Total bytes of the arrays in a pytree: parameters, gradients or an optimizer state. Abstract
    leaves count too, so `tree_bytes(jax.eval_shape(tx.init, params))` sizes an optimizer state for a
    model too big to build (`params` from `nnx.eval_shape`)."""
    return sum(
        math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree) if hasattr(leaf, "dtype")
    )
