"""SFT warm start on synthetic demonstrations from the environment's own generator.

A demonstration trajectory is laid out exactly as the agent loop lays out a sampled one
(`sao_jax.rollout.agent_loop`): `[bos] prompt | a_0 | o_0 | a_1 | … | a_n`, with the gold actions
(`env.demonstration(prompt)`) stepped through a real environment so the observations are the
environment's own. The SFT loss is the token-mean negative log-likelihood of the action tokens:

    L = −Σ_t action_mask_t · log π(x_t | x_<t) / Σ_t action_mask_t

SFT stops when the policy reproduces held-out demonstrations (`demonstration_probability`), so the
warm start's skill is a measured quantity rather than whatever a fixed number of steps reached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sao_jax import advantages as adv
from sao_jax import losses
from sao_jax.rollout.trajectory import Trajectory, TrajectoryBatch
from sao_jax.train.steps import policy_logits


def demonstration_trajectory(env: Any, prompt: Any, demonstration: list[str], tokenizer, *,
                             add_bos: bool = True) -> Trajectory:
    """Step `env` through the gold `demonstration` actions and record the trajectory it makes
    (starting with the tokenizer's BOS when `add_bos`, as the agent loop's rollouts do). It ends with
    the last demonstrated action, as a rollout ends with an action: a demonstration that stops before
    the episode ends (repair's weak one without the repair) leaves out the observation it would get."""
    pieces: list[tuple[np.ndarray, bool, int, float]] = []  # (ids, is_action, turn, reward on last)
    if add_bos and tokenizer.bos_id is not None:  # chat templates write their own start tokens
        pieces.append((np.array([tokenizer.bos_id], np.int32), False, -1, 0.0))
    pieces.append((tokenizer.encode(env.reset(prompt)), False, -1, 0.0))
    for turn, action in enumerate(demonstration):
        result = env.step(action)
        pieces.append((tokenizer.encode(action), True, turn, float(result.reward)))
        if result.done or turn == len(demonstration) - 1:
            break
        pieces.append((tokenizer.encode(result.observation), False, turn, 0.0))
    tokens = np.concatenate([ids for ids, *_ in pieces]).astype(np.int32)
    action = np.concatenate([np.full(len(ids), is_action) for ids, is_action, *_ in pieces])
    turn = np.concatenate([np.full(len(ids), t, np.int32) for ids, _, t, _ in pieces])
    rewards = np.zeros(len(tokens), np.float32)
    end = 0
    for ids, is_action, _, reward in pieces:
        end += len(ids)
        if is_action:
            rewards[end - 1] = reward
    zeros = np.zeros(len(tokens), np.float32)
    return Trajectory(
        tokens=tokens,
        action_mask=action,
        rollout_logprobs=zeros,
        rollout_entropy=zeros.copy(),
        policy_version=np.full(len(tokens), -1, np.int32),  # not sampled by any policy
        rewards=rewards,
        turn_index=turn,
        prompt_id=int(prompt.id) % (2**31),
        info={"demonstration": True},
    )


def choice_mask(gold: Trajectory, alternative: Trajectory | None) -> np.ndarray:
    """The demonstrators' free choice in `gold`: True at the first action token where `alternative`
    (the weaker demonstrator's trajectory for the same prompt) differs from it, False elsewhere. With
    no alternative, or none that differs, nothing is free."""
    free = np.zeros(gold.num_tokens, bool)
    if alternative is None:
        return free
    n = min(gold.num_tokens, alternative.num_tokens)
    differ = np.flatnonzero(gold.tokens[:n] != alternative.tokens[:n])
    first = int(differ[0]) if len(differ) else (n if gold.num_tokens != alternative.num_tokens else -1)
    if 0 <= first < gold.num_tokens and gold.action_mask[first]:
        free[first] = True
    return free


def demonstration_probability(logprobs: jax.Array, action_mask: jax.Array, free_mask: jax.Array) -> jax.Array:
    """Per row, the probability that sampling from the policy at temperature 1 writes the
    demonstration's actions, given its observations and the demonstrators' free choice:

        p_i = exp( Σ_t action_mask_it · (1 − free_it) · log π(x_it | x_i,<t) )

    The environment is deterministic, so this is exactly the chance that a rollout which makes the
    gold choice then copies, formats and answers as the demonstration does. `logprobs` are
    `losses.token_logprobs`; `free_mask` marks the tokens left out (`choice_mask`)."""
    counted = action_mask & ~free_mask
    return jnp.exp(jnp.sum(jnp.where(counted, logprobs, 0.0), axis=-1))


def make_sft_update(policy_graph, policy_buffers, tx: optax.GradientTransformation) -> Callable:
    """Jitted `(params, opt_state, batch) -> (params, opt_state, metrics)`: one step on the NLL above."""

    def sft_update(params, opt_state, batch: TrajectoryBatch):
        def loss_fn(params):
            logits, _ = policy_logits(policy_graph, params, policy_buffers, batch)
            logp = losses.token_logprobs(logits, batch.tokens)
            nll = -adv.masked_mean(logp, batch.action_mask)
            accuracy = adv.masked_mean(
                jnp.pad(jnp.argmax(logits[:, :-1], axis=-1) == batch.tokens[:, 1:], ((0, 0), (1, 0))),
                batch.action_mask,
            )
            return nll, {"sft/nll": nll, "sft/token_accuracy": accuracy}

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    return jax.jit(sft_update, donate_argnums=(0, 1))


def make_demonstration_probe(policy_graph, policy_buffers, probe: TrajectoryBatch, free_mask: np.ndarray) -> Callable:
    """Jitted `params -> mean demonstration_probability` over the valid rows of `probe`."""
    rows = jnp.asarray(probe.valid_mask.any(axis=-1))
    free = jnp.asarray(free_mask)

    def probability(params):
        logits, _ = policy_logits(policy_graph, params, policy_buffers, probe)
        p = demonstration_probability(losses.token_logprobs(logits, probe.tokens), probe.action_mask, free)
        return jnp.sum(jnp.where(rows, p, 0.0)) / jnp.sum(rows)

    return jax.jit(probability)
