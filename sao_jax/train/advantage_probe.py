"""The advantage-quality probe: does the run's advantage estimator track the true advantage of each
decision? It is measured against Monte-Carlo estimates made with the current policy.

Every `train.probe_every` RL steps, each of `train.probe_prompts` fixed training prompts is rolled out
once with the current policy. The prompts are drawn once, from their own stream. Turn k of such a
rollout, action a_k, is a decision taken in state s_k, the history before a_k.

V̂(s_k) is the mean return, from turn k on, of M = `train.probe_continuations` rollouts that continue
from s_k with the same policy. Each replays the episode's first k actions (`ReplayEnv`) and then
samples. After the last turn n nothing more is earned, so V̂(s_n) = 0. The Monte-Carlo advantage is

    A_MC(s_k, a_k) = r_k + V̂(s_{k+1}) − V̂(s_k)        (undiscounted: the probe needs γ = 1)

For a deterministic environment this is an unbiased estimate of Q(s_k, a_k) − V(s_k). Its noise does
not depend on the estimator being probed: with 0/1 rewards each V̂ has variance at most 1/(4M).

The estimator's advantage at the decision is the one the policy gradient gives a_k's first token
(`steps.estimator_advantages`). It is computed on the probe rollouts with the current critic, or
with the running-mean baseline read as it stands, without being updated. Group estimators (GRPO,
RLOO, TRACE) need several rollouts of a prompt to give any advantage, so they cannot be probed this
way; the config refuses them.

The logged metrics, over every decision of the probe's rollouts:
  probe/advantage_correlation  Pearson r between the estimator's advantages and A_MC (left out when
                               either side is constant)
  probe/advantage_rmse         √mean (A − A_MC)², which is also sensitive to scale
  probe/mc_advantage_std       the spread of A_MC: how much there is to track
  probe/decisions              how many decisions were compared
  probe/inexact_replays        rollouts left out because a replay did not match them (below)

The replayed history is given to the policy as text: the prompt, then each action and observation.
Its tokens can differ from the original rollout's: a special token the policy sampled (an end of
sequence closing an action) has no text, and a subword tokenizer may split the joined text
differently from the pieces it was sampled in. Each continuation's context is checked against the
original, token for token; a rollout with any state that does not match is left out of the
comparison and counted in `probe/inexact_replays`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from sao_jax.rollout.trajectory import collate
from sao_jax.train import steps as steps_lib
from sao_jax.train.build import ADVANTAGE_PROBE_STREAM, Run


def monte_carlo_advantages(rewards: Sequence[float], values: Sequence[float]) -> np.ndarray:
    """A_MC[k] = r_k + V̂[k+1] − V̂[k] with V̂[n] = 0; `rewards` and `values` [n], one per turn."""
    rewards, values = np.asarray(rewards, np.float64), np.asarray(values, np.float64)
    return rewards + np.append(values[1:], 0.0) - values


def first_action_token(action_mask: np.ndarray, turn_index: np.ndarray, turn: int) -> int:
    """The position of the first token of action `turn` in one row (masks: [time])."""
    return int(np.flatnonzero(action_mask & (turn_index == turn))[0])


def first_token_values(x: np.ndarray, action_mask: np.ndarray, turn_index: np.ndarray, num_turns: int) -> np.ndarray:
    """x at the first action token of each turn 0..num_turns−1 of one row (x, masks: [time])."""
    return np.array([x[first_action_token(action_mask, turn_index, k)] for k in range(num_turns)], np.float64)


def correlation(x: np.ndarray, y: np.ndarray) -> float | None:
    """Pearson's r of two equal-length vectors, or None when either is constant (r is undefined)."""
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


@dataclasses.dataclass(frozen=True)
class Continuation:
    """`prompt` with its episode's first actions already taken: what `ReplayEnv` resets to."""

    prompt: Any
    actions: tuple[str, ...]

    @property
    def id(self) -> int:
        return self.prompt.id

    @property
    def difficulty(self) -> int | None:
        return getattr(self.prompt, "difficulty", None)


class ReplayEnv:
    """An environment whose episode starts partway: `reset` resets `env` to the continuation's prompt
    and steps it through the continuation's actions. It returns the history as the first text: the
    prompt, then each action and its observation. The turn budget left is the rest of `env`'s. The
    replayed steps' rewards are not part of the new episode's return."""

    def __init__(self, env):
        self.env = env
        self.stop_strings = env.stop_strings
        self._replayed = 0

    @property
    def max_turns(self) -> int:
        return self.env.max_turns - self._replayed

    def reset(self, continuation: Continuation) -> str:
        text = self.env.reset(continuation.prompt)
        for action in continuation.actions:
            result = self.env.step(action)
            if result.done:
                raise RuntimeError(f"replaying {continuation.actions!r}: the episode ended before its last action")
            text += action + result.observation
        self._replayed = len(continuation.actions)
        return text

    def step(self, action: str):
        return self.env.step(action)


class AdvantageProbe:
    """The probe of the module docstring, for one run: `probe(state, graphs, step)` -> metrics."""

    def __init__(self, run: Run, graphs: steps_lib.Graphs):
        config = run.config
        self.run, self.config = run, config
        rng = np.random.default_rng([config.seed, ADVANTAGE_PROBE_STREAM])
        pool = run.train_prompts  # the running mean's per-prompt baselines key on training prompt ids
        self.prompts = [pool[i] for i in rng.choice(len(pool), min(config.train.probe_prompts, len(pool)), replace=False)]
        self.prompts_by_id = {p.id: p for p in self.prompts}
        self.loop = run.agent_loop(greedy=False, env_factory=lambda c: ReplayEnv(run.env_factory(c.prompt)))

        def advantages(state, batch):
            return steps_lib.estimator_advantages(state, batch, graphs, config)[0]

        self._advantages = run.cluster.step(jax.jit(advantages))

    def __call__(self, state: steps_lib.TrainState, weights, step: int) -> dict[str, float]:
        key = jax.random.fold_in(jax.random.key(self.config.seed), ADVANTAGE_PROBE_STREAM)
        rollouts = self.loop.rollout((weights, step), [Continuation(p, ()) for p in self.prompts],
                                     jax.random.fold_in(jax.random.fold_in(key, step), 0))  # fmt: skip
        rollouts = [t for t in rollouts if t.info["error"] is None and t.info["num_turns"] > 0]
        if not rollouts:
            return {"probe/decisions": 0, "probe/inexact_replays": 0}
        decode = self.run.tokenizer.decode
        starts = []  # (rollout, turn): the continuation from s_turn
        for i, t in enumerate(rollouts):
            actions = tuple(decode(t.tokens[t.action_mask & (t.turn_index == k)]) for k in range(t.info["num_turns"]))
            starts += [(i, k, Continuation(self.prompts_by_id[t.prompt_id], actions[:k]))
                       for k in range(t.info["num_turns"])]  # fmt: skip
        m = self.config.train.probe_continuations
        continued = self.loop.rollout((weights, step), [c for _, _, c in starts for _ in range(m)],
                                      jax.random.fold_in(jax.random.fold_in(key, step), 1))  # fmt: skip
        returns: dict[tuple[int, int], list[float]] = {}
        inexact = set()  # rollouts with a state whose replay is not the original's context, token for token
        for j, (i, k, _) in enumerate(starts):
            t = rollouts[i]
            context = t.tokens[: first_action_token(t.action_mask, t.turn_index, k)]
            returns[i, k] = []
            for c in continued[j * m:(j + 1) * m]:
                if c.info["error"] is not None or not c.action_mask.any():
                    continue
                if not np.array_equal(c.tokens[: first_action_token(c.action_mask, c.turn_index, 0)], context):
                    inexact.add(i)
                returns[i, k].append(c.outcome_reward)
        batch_rows = self.config.train.batch_size * math.ceil(len(rollouts) / self.config.train.batch_size)
        estimated = np.asarray(jax.device_get(self._advantages(state, collate(rollouts, batch_size=batch_rows,
                                                                              buckets=self.run.buckets))))  # fmt: skip
        ours, monte_carlo = [], []
        for i, t in enumerate(rollouts):
            n = t.info["num_turns"]
            if i in inexact or any(not returns[i, k] for k in range(n)):  # or every continuation of a state failed
                continue
            turn_rewards = [t.rewards[t.action_mask & (t.turn_index == k)].sum() for k in range(n)]
            values = [np.mean(returns[i, k]) for k in range(n)]
            monte_carlo.append(monte_carlo_advantages(turn_rewards, values))
            ours.append(first_token_values(estimated[i, : t.num_tokens], t.action_mask, t.turn_index, n))
        if not ours:
            return {"probe/decisions": 0, "probe/inexact_replays": len(inexact)}
        ours, monte_carlo = np.concatenate(ours), np.concatenate(monte_carlo)
        metrics = {"probe/decisions": len(ours), "probe/inexact_replays": len(inexact), "probe/advantage_rmse": float(np.sqrt(np.mean((ours - monte_carlo) ** 2))),
                   "probe/mc_advantage_std": float(np.std(monte_carlo))}  # fmt: skip
        r = correlation(ours, monte_carlo)
        return metrics if r is None else {**metrics, "probe/advantage_correlation": r}

