"""Rollouts driven by an agent scaffold: the scaffold owns the episode loop and calls the policy through
the chat server (`sao_jax.rollout.server`); the trajectory is assembled from the server's records.

An episode (`ScaffoldLoop._episode`):

    id = "ep-<hex>";  server.open_episode(id, key, weights, token budget)
    reward = run(prompt, base_url, id)          on a worker thread (an episode function), or
             COMMAND                            as a process (a command; below), with a deadline
    record = server.close_episode(id)           the token-exact segments of every request
    Trajectory = the record's last segment, the reward on its last action token

Only the last segment becomes the trajectory: a segment is one sequence the policy conditioned on, and
the last one holds the final action. Earlier segments (the scaffold rewrote its history, see the
server's docstring) are not spliced onto it; `info["prefix_mismatches"]` counts them and
`info["dropped_action_tokens"]` their action tokens. Layout, as the agent loop's:

    tokens          prompt | a_0 | o_0 | a_1 | … | a_n        (rendered by the chat template)
    action_mask       0    |  1  |  0  |  1  | … |  1
    turn_index       -1    |  0  |  0  |  1  | … |  n
    rewards: the episode's reward on the last token of a_n;  rollout_logprobs, rollout_entropy,
    policy_version: the sampler's, on action tokens (version: the one each request was admitted with)

Failures cost one trajectory (`info["error"]`, `info["error_kind"]`; `stats["scaffold_<kind>"]`) and
never the batch: "exception" (the episode function raised, or the command exited non-zero),
"timeout" (past `deadline_s`: a thread is abandoned, a process group killed; the server refuses the
episode's later requests), "token_budget" (the episode asked for more than
`max_episode_tokens` generated tokens), "invalid_result" (the reward is not a finite real number),
"no_requests" (the scaffold never called the model). As with the agent loop, the trainer drops them
(`__call__` raises `EnvFailure`, as `RolloutService` does). A request that did not fit the cache sets
`info["truncated"] = "max_total_tokens"`; the trajectory is kept, as the agent loop keeps one.

A command is run with the environment variables OPENAI_BASE_URL, OPENAI_API_KEY (= the episode id),
SAO_BASE_URL, SAO_EPISODE_ID and SAO_PROMPT (the prompt text), the prompt record as JSON on stdin
({"id", "text", "answer", "difficulty", "metadata"}); the last line it prints is its reward.

Randomness: request r of the episode whose key is k samples with fold_in(k, r); `rollout` gives the
i-th prompt fold_in(key, first_index + i), as the agent loop does. The draws do not depend on what
ran beside a request, but the scaffold's timing decides which requests share a batch, so its numbers
may differ in the last float bits between runs (sync mode is not bit-for-bit reproducible here).

Concurrency: `rollout` runs `episodes_at_once` episodes at a time; as the async engine's rollout
function the engine's workers (`rollout.num_slots` of them) each run one. Requests of all running
episodes share the sampler's batch (`num_slots` rows).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import math
import numbers
import os
import shlex
import signal
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from sao_jax.rollout.agent_loop import AgentLoopConfig, EnvFailure, weights_getter
from sao_jax.rollout.sampler import Sampler
from sao_jax.rollout.server import ChatServer, EpisodeRecord, GenerationEngine
from sao_jax.rollout.trajectory import Trajectory

EpisodeFn = Callable[[Any, str, str], float]  # run(prompt, base_url, episode_id) -> reward


@dataclasses.dataclass(frozen=True)
class ScaffoldSettings:
    """episode_fn: `run(prompt, base_url, episode_id) -> reward`, run on a thread; or command: argv run
    as a process (exactly one). deadline_s: wall-clock limit of one episode. max_episode_tokens: most
    tokens the policy generates in one episode. episodes_at_once: episodes run concurrently by `rollout`."""

    episode_fn: EpisodeFn | None = None
    command: tuple[str, ...] | None = None
    deadline_s: float = 600.0
    max_episode_tokens: int = 4096
    episodes_at_once: int = 8

    def __post_init__(self):
        if (self.episode_fn is None) == (self.command is None):
            raise ValueError("ScaffoldSettings needs exactly one of episode_fn and command")
        if not self.deadline_s > 0:
            raise ValueError(f"ScaffoldSettings.deadline_s must be > 0 (got {self.deadline_s})")
        for name in ("max_episode_tokens", "episodes_at_once"):
            if getattr(self, name) < 1:
                raise ValueError(f"ScaffoldSettings.{name} must be >= 1 (got {getattr(self, name)})")


class _Failure(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class ScaffoldLoop:
    """Scaffold episodes against a chat server on `sampler` (module docstring); the agent loop's
    interface: `rollout(weights, prompts, key, first_index=0, on_trajectory=None)` and, for the async
    engine, `__call__(prompt, weights, key) -> Trajectory` (thread-safe; raises EnvFailure).

    config: the agent loop's settings that apply (num_slots: the server's batch rows;
    max_total_tokens: its cache; max_action_tokens: most tokens of one completion). The server starts
    on first use, on 127.0.0.1 at a free port; `close()` stops it. `stats` counts trajectories,
    scaffold_<failure kind>, truncated_max_total_tokens and, from the server, prefix_mismatch.
    """

    def __init__(self, sampler: Sampler, tokenizer, chat_format, config: AgentLoopConfig, settings: ScaffoldSettings):
        self.sampler, self.tokenizer, self.chat_format = sampler, tokenizer, chat_format
        self.config, self.settings = config, settings
        self._stats: collections.Counter = collections.Counter()
        self._server: ChatServer | None = None
        self._lock = threading.Lock()

    @property
    def stats(self) -> collections.Counter:
        server = {} if self._server is None else {"prefix_mismatch": self._server.stats["prefix_mismatch"]}
        return self._stats + collections.Counter(server)

    @property
    def server(self) -> ChatServer:
        with self._lock:
            if self._server is None:
                engine = GenerationEngine(self.sampler, self.tokenizer.decode, num_slots=self.config.num_slots,
                                          max_total_tokens=self.config.max_total_tokens)  # fmt: skip
                self._server = ChatServer(engine, self.tokenizer, self.chat_format,
                                          max_action_tokens=self.config.max_action_tokens).start()  # fmt: skip
            return self._server

    def close(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.close()
                self._server.engine.close()
                self._server = None

    def rollout(self, weights, prompts: Iterable[Any], key: jax.Array, *, first_index: int = 0,
                on_trajectory: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:  # fmt: skip
        """One scaffold episode per prompt, `episodes_at_once` at a time; trajectories in prompt order.
        weights: a `(params, version)` pair, a callable returning one, or an object with `latest()`."""
        weights_now = weights_getter(weights)
        prompts = list(prompts)
        with concurrent.futures.ThreadPoolExecutor(self.settings.episodes_at_once, "scaffold-episode") as pool:
            futures = [pool.submit(self._episode, p, jax.random.fold_in(key, first_index + i), weights_now)
                       for i, p in enumerate(prompts)]  # fmt: skip
            trajectories = []
            for future in futures:
                trajectories.append(future.result())
                if on_trajectory is not None:
                    on_trajectory(trajectories[-1])
        return trajectories

    def __call__(self, prompt, weights, key: jax.Array) -> Trajectory:
        trajectory = self._episode(prompt, key, weights_getter(weights))
        if trajectory.info["error"] is not None:
            raise EnvFailure(trajectory.info["error_kind"], trajectory.info["error"])
        return trajectory

    # --- one episode ------------------------------------------------------------------------------------------

    def _episode(self, prompt, key: jax.Array, weights_now) -> Trajectory:
        server = self.server
        episode_id = f"ep-{uuid.uuid4().hex}"
        server.open_episode(episode_id, key=key, weights=weights_now, token_budget=self.settings.max_episode_tokens)
        failure, reward = None, 0.0
        try:
            reward = self._run(prompt, server.base_url, episode_id)
        except _Failure as e:
            failure = e
        record = server.close_episode(episode_id)
        if failure is None and record.failure is not None:
            failure = _Failure("token_budget", record.failure[1])
        if failure is None and not record.segments:
            failure = _Failure("no_requests", "the scaffold returned without calling the model")
        return self._trajectory(prompt, record, reward, failure)

    def _run(self, prompt, base_url: str, episode_id: str) -> float:
        settings = self.settings
        if settings.command is not None:
            reward = self._run_command(prompt, base_url, episode_id)
        else:
            outcome: dict[str, Any] = {}

            def target():
                try:
                    outcome["reward"] = settings.episode_fn(prompt, base_url, episode_id)
                except BaseException as e:  # noqa: BLE001 — a scaffold's error ends only its trajectory
                    outcome["error"] = e

            thread = threading.Thread(target=target, daemon=True, name=f"scaffold-{episode_id}")
            thread.start()
            thread.join(settings.deadline_s)
            if thread.is_alive():  # abandoned: Python cannot stop a thread; the server refuses it from now
                raise _Failure("timeout", f"the episode function did not return within {settings.deadline_s} s")
            if "error" in outcome:
                error = outcome["error"]
                raise _Failure("exception", f"the episode function raised {type(error).__name__}: {error}")
            reward = outcome["reward"]
        if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise _Failure("invalid_result", f"the scaffold's reward is {reward!r}, expected a finite real number")
        return float(reward)

    def _run_command(self, prompt, base_url: str, episode_id: str) -> float:
        record = {name: getattr(prompt, name, None) for name in ("id", "text", "answer", "difficulty")}
        record["metadata"] = dict(getattr(prompt, "metadata", {}) or {})
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": episode_id, "SAO_BASE_URL": base_url,
               "SAO_EPISODE_ID": episode_id, "SAO_PROMPT": str(record["text"])}  # fmt: skip
        process = subprocess.Popen(self.settings.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, env=env, text=True, start_new_session=True)  # fmt: skip
        try:
            out, err = process.communicate(json.dumps(record, default=str), timeout=self.settings.deadline_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise _Failure("timeout", f"the command did not exit within {self.settings.deadline_s} s") from None
        if process.returncode != 0:
            raise _Failure("exception", f"the command exited with status {process.returncode}: {err.strip()[-500:]}")
        lines = out.strip().splitlines()
        try:
            return float(lines[-1])
        except (IndexError, ValueError):
            raise _Failure("invalid_result", f"the command's last line is not a reward: {lines[-1:]!r}") from None

    def _trajectory(self, prompt, record: EpisodeRecord, reward: float, failure: _Failure | None) -> Trajectory:
        last = record.segments[-1] if record.segments else None
        columns = (("tokens", np.int32), ("action_mask", bool), ("rollout_logprobs", np.float32),
                   ("rollout_entropy", np.float32), ("policy_version", np.int32), ("turn_index", np.int32))
        fields = {name: (np.zeros(0) if last is None else last.array(name)).astype(dtype) for name, dtype in columns}
        rewards = np.zeros(len(fields["tokens"]), np.float32)
        if failure is None:
            rewards[np.flatnonzero(fields["action_mask"])[-1]] = reward
        truncated = "max_total_tokens" if record.truncated else None
        info = dict(
            num_turns=0 if last is None else last.num_actions, done=failure is None, truncated=truncated,
            error=None if failure is None else str(failure), error_kind=None if failure is None else failure.kind,
            final_action="" if last is None else last.last_action, env_info={"reward": reward},
            unterminated_actions=0 if last is None else last.unterminated_actions,
            difficulty=getattr(prompt, "difficulty", None), episode_id=record.episode_id, requests=record.requests,
            segments=len(record.segments), prefix_mismatches=record.prefix_mismatches,
            dropped_action_tokens=int(sum(s.array("action_mask").astype(bool).sum() for s in record.segments[:-1])),
        )  # fmt: skip
        with self._lock:
            self._stats["trajectories"] += 1
            if failure is not None:
                self._stats[f"scaffold_{failure.kind}"] += 1
            if truncated is not None:
                self._stats["truncated_max_total_tokens"] += 1
        return Trajectory(rewards=rewards, prompt_id=getattr(prompt, "id", 0), info=info, **fields)


def command_argv(command: str | Sequence[str]) -> tuple[str, ...]:
    """A command line as argv: a string is split as a shell would (no shell runs it)."""
    return tuple(shlex.split(command) if isinstance(command, str) else command)
