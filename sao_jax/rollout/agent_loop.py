"""The agent loop: many multi-turn trajectories at once, the environment ↔ sampler exchange of each.

Every trajectory owns one row ("slot") of the sampler's batch and its KV cache, and moves through

    reset (worker thread) ─► prefill prompt ─► decode action ─► env.step (worker thread) ─┐
                                     ▲                                                     │
                                     └──────── prefill observation ◄───── not done ◄───────┘

until the environment says done, the turn budget is spent, or the next observation would not fit
`max_total_tokens` (the KV cache length). A finished slot takes the next prompt at once (continuous
batching), so a trajectory is handed on (`on_trajectory`) the moment it ends.

Per loop iteration the host makes at most one prefill call (not waited on) and one decode-chunk call
whose outputs it reads: one host↔device round trip per decode chunk. Environment calls run on daemon
threads while the other rows keep decoding; each call has a deadline of `env_timeout_s`.

Failures are per trajectory: an environment (or its factory) that raises, does not answer within its
deadline, or returns something that is not `StepResult(observation: str, reward: real, done: bool,
info: dict)` (or a non-str first observation, or text outside the tokenizer's vocabulary) ends that
trajectory with `info["error"]` / `info["error_kind"]` set and `stats` counted; the batch goes on.
A hung call's thread is abandoned (Python cannot kill it), never joined. Such a trajectory's reward
is not the task's verdict: the engine or trainer should drop it (`RolloutService` raises it as
`EnvFailure`). Nothing is printed per failure: the first one's traceback is logged at DEBUG level
(`sao_jax.rollout.failures`), the rest are only counted.

Trajectory layout (`sao_jax.rollout.trajectory.Trajectory`), with turn k = action a_k and observation o_k:

    tokens          [bos] prompt | a_0 (stop token included) | o_0 | a_1 | … | a_n
    action_mask        0     0   |  1                        |  0  |  1  | … |  1
    turn_index        -1    -1   |  0                        |  0  |  1  | … |  n
    rewards: the reward of step k on the last token of a_k (0 elsewhere)
    rollout_logprobs, rollout_entropy: the sampler's log μ and H(μ) on action tokens (0 elsewhere)
    policy_version: the version of the weights that sampled each action token (-1 elsewhere)

`info` keys (always present): num_turns, done (the environment ended the episode), truncated (None,
"max_turns" or "max_total_tokens"), error, error_kind (None, "exception", "timeout", "invalid_result",
"prompt_too_long"), final_action (text of the last action), env_info (the last StepResult.info),
unterminated_actions (actions cut by `max_action_tokens` or the cache instead of a stop token),
difficulty (the prompt's, if it has one).

Entry points:
  AgentLoop.rollout(weights, prompts, key) -> list[Trajectory]   a batch of prompts, in prompt order
  RolloutService(loop)(prompt, weights, key) -> Trajectory       the rollout engine's `rollout_fn`:
      concurrent callers (engine workers) share one loop, each waits for its own trajectory
Weights: a fixed `(params, version)` pair, a callable returning the current pair, or an object with
`latest() -> (params, version)` (the engine's WeightStore). It is read once per loop iteration,
before the prefill and the decode chunk, so new weights are picked up between decode chunks and every
action token records the version that sampled it. An observation prefilled with newer weights than
the earlier cache entries is accepted (the cache then mixes versions, as in any in-flight update).
Keys: each trajectory has its own PRNG key (`rollout`: `fold_in(key, i)` for the i-th prompt; the
service: the caller's key) and the sampler folds in each token's position, so a trajectory's draws do
not depend on which slot it ran in or what ran beside it (its numbers may still differ in the last
float bits with the batch composition, and environment timing decides which slot it gets).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import numbers
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.rollout.failures import EnvFailure, log_first_failure
from sao_jax.rollout.sampler import Sampler, stop_token_ids
from sao_jax.rollout.trajectory import Trajectory

_NO_MORE = object()  # the prompt source is exhausted
PROMPT_POLL_S = 0.005  # how often a loop with a free slot looks for a new prompt while it waits
MAX_STOP_IDS = 8  # width of the per-row stop-id table (fixed so the decode step compiles once)
MIN_PREFILL_WIDTH = 8  # prefill widths are powers of two from here: few compiled shapes


@dataclasses.dataclass(frozen=True)
class AgentLoopConfig:
    """num_slots: trajectories decoded together (the sampler batch).
    max_total_tokens: most tokens of one trajectory (bos, prompt, actions, observations); the KV cache
      length. max_action_tokens: most tokens of one action.
    max_turns: most environment steps per trajectory, on top of the environment's own `max_turns`
      (None: only the environment's). env_timeout_s: deadline of one reset or step call.
    add_bos: start every trajectory with the tokenizer's `bos_id` (skipped when it is None: chat
        templates write their own start tokens).
    lockstep: wait for every pending environment call before the next decode chunk, and apply the
      results in slot order. The sequence of prefill/decode calls is then a function of the inputs
      alone, not of thread timing — the deterministic training mode. Without it, rows whose
      environment is still working do not hold up the others."""

    num_slots: int = 8
    max_total_tokens: int = 512
    max_action_tokens: int = 64
    max_turns: int | None = None
    env_timeout_s: float = 10.0
    add_bos: bool = True
    lockstep: bool = False

    def __post_init__(self):
        for name in ("num_slots", "max_total_tokens", "max_action_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"AgentLoopConfig.{name} must be >= 1 (got {getattr(self, name)})")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"AgentLoopConfig.max_turns must be >= 1 or None (got {self.max_turns})")
        if not self.env_timeout_s > 0:
            raise ValueError(f"AgentLoopConfig.env_timeout_s must be > 0 (got {self.env_timeout_s})")


class _Phase(enum.Enum):
    WAITING_ENV = "waiting for an environment call"
    PREFILL = "tokens to feed into the cache"
    DECODE = "sampling an action"


@dataclasses.dataclass
class _Episode:
    """Everything the loop knows about the trajectory in one slot."""

    tag: Any  # the caller's handle for this trajectory (its prompt's position, or a reply slot)
    prompt: Any
    key: jax.Array  # this trajectory's PRNG key (the sampler folds in the cache slot of each token)
    phase: _Phase = _Phase.WAITING_ENV
    env: Any = None
    turn_budget: int = 0
    stop_ids: np.ndarray | None = None
    pending: np.ndarray | None = None  # tokens to prefill
    fresh: bool = True  # the pending tokens start a new sequence (the prompt)
    num_turns: int = 0
    unterminated_actions: int = 0
    last_action: str = ""
    env_info: dict = dataclasses.field(default_factory=dict)
    segments: dict[str, list] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    action: dict[str, list] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))

    @property
    def length(self) -> int:
        return sum(len(t) for t in self.segments["tokens"]) + sum(len(t) for t in self.action["tokens"])

    def add_context(self, tokens: np.ndarray, turn: int) -> None:
        n = len(tokens)
        self._append(tokens=tokens, action_mask=np.zeros(n, bool), rollout_logprobs=np.zeros(n, np.float32),
                     rollout_entropy=np.zeros(n, np.float32), policy_version=np.full(n, -1, np.int32),
                     rewards=np.zeros(n, np.float32), turn_index=np.full(n, turn, np.int32))  # fmt: skip

    def close_action(self) -> np.ndarray:
        """Move the sampled action into the trajectory; returns its tokens."""
        tokens = np.concatenate(self.action["tokens"]).astype(np.int32)
        n = len(tokens)
        self._append(tokens=tokens, action_mask=np.ones(n, bool),
                     rollout_logprobs=np.concatenate(self.action["logprobs"]).astype(np.float32),
                     rollout_entropy=np.concatenate(self.action["entropy"]).astype(np.float32),
                     policy_version=np.concatenate(self.action["versions"]).astype(np.int32),
                     rewards=np.zeros(n, np.float32), turn_index=np.full(n, self.num_turns, np.int32))  # fmt: skip
        self.action.clear()
        return tokens

    def _append(self, **fields) -> None:
        for name, value in fields.items():
            self.segments[name].append(value)

    def build(self, info: dict) -> Trajectory:
        fields = {name: np.concatenate(parts) for name, parts in self.segments.items()}
        if not fields:  # failed before the prompt was known
            fields = dict(tokens=np.zeros(0, np.int32), action_mask=np.zeros(0, bool),
                          rollout_logprobs=np.zeros(0, np.float32), rollout_entropy=np.zeros(0, np.float32),
                          policy_version=np.zeros(0, np.int32), rewards=np.zeros(0, np.float32),
                          turn_index=np.zeros(0, np.int32))  # fmt: skip
        return Trajectory(prompt_id=self.prompt.id, info=info, **fields)


class _EnvCalls:
    """Runs environment calls on daemon threads with deadlines; results come back on one queue."""

    def __init__(self):
        self._results: queue.Queue = queue.Queue()
        self._pending: dict[int, tuple[int, float, str]] = {}  # call id -> (slot, deadline, what)
        self._next_id = 0

    def submit(self, slot: int, what: str, fn: Callable[[], Any], timeout_s: float) -> None:
        call_id, self._next_id = self._next_id, self._next_id + 1
        self._pending[call_id] = (slot, time.monotonic() + timeout_s, what)

        def run():
            try:
                outcome = (True, fn())
            except BaseException as e:  # noqa: BLE001 — anything an environment raises ends only its trajectory
                outcome = (False, e)
            self._results.put((call_id, outcome))

        threading.Thread(target=run, daemon=True, name=f"env-slot{slot}-{what}").start()

    def __len__(self) -> int:
        return len(self._pending)

    def collect_all(self) -> list[tuple[int, Any]]:
        """Every pending call's result (or EnvFailure at its deadline), in slot order."""
        done = []
        while self._pending:
            done += self.collect(block=True)
        return sorted(done, key=lambda item: item[0])

    def collect(self, *, block: bool, max_wait_s: float = math.inf) -> list[tuple[int, Any]]:
        """Finished calls as (slot, value or EnvFailure). With `block`, waits until at least one call
        finished or passed its deadline (if any call is pending), or `max_wait_s` passed."""
        give_up = time.monotonic() + max_wait_s
        done = []
        while True:
            try:
                while True:
                    call_id, (ok, value) = self._results.get_nowait()
                    if call_id in self._pending:  # else: answered after its deadline, already failed
                        slot, _, what = self._pending.pop(call_id)
                        if not ok:
                            failure = EnvFailure("exception", f"{what} raised {type(value).__name__}: {value}")
                            failure.__cause__, value = value, failure  # its traceback, for --debug
                        done.append((slot, value))
            except queue.Empty:
                pass
            now = time.monotonic()
            for call_id, (slot, deadline, what) in list(self._pending.items()):
                if now >= deadline:
                    del self._pending[call_id]
                    done.append((slot, EnvFailure("timeout", f"{what} did not return within its deadline")))
            if done or not block or not self._pending or now >= give_up:
                return done
            wait = min(give_up, *(deadline for _, deadline, _ in self._pending.values())) - now
            try:
                self._results.put(self._results.get(timeout=max(wait, 0.0)))  # wake up, handle above
            except queue.Empty:
                pass


def _check_step_result(result) -> tuple[str, float, bool, dict]:
    """(observation, reward, done, info) of a StepResult, or EnvFailure("invalid_result") naming the field."""
    try:
        observation, reward, done, info = result.observation, result.reward, result.done, result.info
    except AttributeError:
        raise EnvFailure("invalid_result", f"env.step returned {type(result).__name__}, not a StepResult") from None
    problems = []
    if not isinstance(observation, str):
        problems.append(f"observation is {type(observation).__name__}, expected str")
    if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        problems.append(f"reward is {reward!r} ({type(reward).__name__}), expected a finite real number")
    if not isinstance(done, (bool, np.bool_)):
        problems.append(f"done is {type(done).__name__}, expected bool")
    if not isinstance(info, dict):
        problems.append(f"info is {type(info).__name__}, expected dict")
    if problems:
        raise EnvFailure("invalid_result", "env.step returned an invalid StepResult: " + "; ".join(problems))
    return observation, float(reward), bool(done), info


def weights_getter(weights) -> Callable[[], tuple[Any, int]]:
    """() -> (params, version) from a fixed pair, a callable, or an object with `latest()`."""
    if hasattr(weights, "latest"):
        return weights.latest
    return weights if callable(weights) else (lambda: weights)


class AgentLoop:
    """Drives `env_factory(prompt)` environments against a `Sampler` (see the module docstring).

    tokenizer: `encode(text) -> ids`, `decode(ids) -> text`, `bos_id`, and `eos_id` (also a stop
    token when present). `stats` counts, over all calls: trajectories, env_exception, env_timeout,
    env_invalid_result, prompt_too_long, truncated_max_turns, truncated_max_total_tokens,
    unterminated_actions, decode_chunks, prefills.
    """

    def __init__(self, sampler: Sampler, tokenizer, env_factory: Callable[[Any], Any],
                 config: AgentLoopConfig = AgentLoopConfig()):  # fmt: skip
        self.sampler, self.tokenizer, self.env_factory, self.config = sampler, tokenizer, env_factory, config
        self.stats: collections.Counter = collections.Counter()
        eos = getattr(tokenizer, "eos_id", None)
        self._extra_stop_ids = [] if eos is None else [int(eos)]

    def rollout(self, weights, prompts: Iterable[Any], key: jax.Array, *, first_index: int = 0,
                indices: Sequence[int] | None = None,
                on_trajectory: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:  # fmt: skip
        """One trajectory per prompt, returned in prompt order; `on_trajectory` gets each as it ends.

        weights: `(params, version)`, a callable returning the current `(params, version)`, or an
        object with such a `latest()` method (the engine's WeightStore).
        prompts: objects with an integer `id` (e.g. `sao_jax.envs.Prompt`), each passed to
        `env_factory` and then to `env.reset`; consumed lazily, one whenever a slot is free.
        key: the i-th prompt's trajectory samples with `fold_in(key, first_index + i)` and nothing else
        (`first_index`: where these prompts start in a list shared out over processes), or with
        `fold_in(key, indices[i])` when `indices` is given (a subset of a list, each at its place there).
        """
        todo = enumerate(prompts, start=first_index)
        finished: dict[int, Trajectory] = {}

        def take(block: bool):
            i, prompt = next(todo, (None, None))
            if i is None:
                return _NO_MORE
            return prompt, jax.random.fold_in(key, i if indices is None else indices[i - first_index]), i

        def deliver(order: int, trajectory: Trajectory) -> None:
            finished[order] = trajectory
            if on_trajectory is not None:
                on_trajectory(trajectory)

        self._run(weights_getter(weights), take, deliver)
        return [finished[i] for i in sorted(finished)]

    def _run(self, weights_now, take, deliver) -> None:
        """The loop of the module docstring. take(block) -> (prompt, key, tag), None (no prompt now) or
        _NO_MORE; it may block only when `block` (every slot is free). deliver(tag, trajectory)."""
        config = self.config
        slots: list[_Episode | None] = [None] * config.num_slots
        calls = _EnvCalls()
        state = self.sampler.init_state(config.num_slots, config.max_total_tokens)
        exhausted = False

        def finish_slot(b: int, **outcome) -> None:
            episode, slots[b] = slots[b], None
            deliver(episode.tag, self._finish(episode, **outcome))

        while True:
            for b in range(config.num_slots):  # refill free slots
                if slots[b] is not None:
                    continue
                item = _NO_MORE if exhausted else take(block=all(s is None for s in slots))
                if item is _NO_MORE:
                    exhausted = True
                if item is None or item is _NO_MORE:
                    break
                prompt, key, tag = item
                slots[b] = _Episode(tag=tag, prompt=prompt, key=key)
                calls.submit(b, "env.reset", lambda p=prompt: self._start_env(p), config.env_timeout_s)
            if all(s is None for s in slots):
                if exhausted:
                    return
                continue

            busy = any(s is not None and s.phase is not _Phase.WAITING_ENV for s in slots)
            # with a free slot and a source that may deliver later, look again for prompts soon
            max_wait_s = PROMPT_POLL_S if not exhausted and any(s is None for s in slots) else math.inf
            results = calls.collect_all() if config.lockstep else calls.collect(block=not busy, max_wait_s=max_wait_s)
            for b, value in results:
                if isinstance(value, EnvFailure):
                    finish_slot(b, failure=value)
                    continue
                try:
                    ending = self._on_env_result(slots[b], value)
                except EnvFailure as failure:
                    ending = dict(failure=failure)
                if ending is not None:
                    finish_slot(b, **ending)

            params, version = weights_now()
            prefilling = [s if s is not None and s.phase is _Phase.PREFILL else None for s in slots]
            if any(prefilling):
                state = self._prefill(params, state, prefilling)
            if any(s is not None and s.phase is _Phase.DECODE for s in slots):
                state = self._decode(params, version, state, slots, calls)

    # --- environment side (worker threads run `_start_env` and `env.step`) ---------------------------

    def _start_env(self, prompt) -> tuple[Any, str, int, tuple]:
        env = self.env_factory(prompt)
        text = env.reset(prompt)
        return env, text, env.max_turns, tuple(env.stop_strings)

    def _on_env_result(self, episode: _Episode, value) -> dict | None:
        """Apply a reset or step result to the episode (next phase PREFILL or DECODE). Returns None,
        or how the trajectory ends here (`_finish` keywords); raises EnvFailure for a bad result."""
        config = self.config
        if episode.env is None:  # the reset call
            env, text, turn_budget, stop_strings = value
            if not isinstance(text, str):
                raise EnvFailure("invalid_result", f"env.reset returned {type(text).__name__}, expected str")
            if not isinstance(turn_budget, numbers.Integral) or turn_budget < 1:
                raise EnvFailure("invalid_result", f"env.max_turns is {turn_budget!r}, expected an int >= 1")
            try:
                stop_ids = stop_token_ids(self.tokenizer, stop_strings) + self._extra_stop_ids
            except ValueError as e:
                raise EnvFailure("invalid_result", f"env.stop_strings: {e}") from None
            if len(stop_ids) > MAX_STOP_IDS:
                raise EnvFailure("invalid_result", f"{len(stop_ids)} stop tokens, at most {MAX_STOP_IDS}")
            episode.env = env
            episode.turn_budget = min(int(turn_budget), config.max_turns or int(turn_budget))
            episode.stop_ids = np.full(MAX_STOP_IDS, -1, np.int32)
            episode.stop_ids[: len(stop_ids)] = stop_ids
            tokens = self._encode(text, "env.reset")
            if config.add_bos and self.tokenizer.bos_id is not None:
                tokens = np.concatenate([[self.tokenizer.bos_id], tokens]).astype(np.int32)
            if len(tokens) == 0 or len(tokens) >= config.max_total_tokens:
                raise EnvFailure("prompt_too_long" if len(tokens) else "invalid_result",
                                 f"prompt of {len(tokens)} tokens leaves no room for an action within "
                                 f"max_total_tokens={config.max_total_tokens}")  # fmt: skip
            episode.add_context(tokens, turn=-1)
            episode.pending, episode.fresh, episode.phase = tokens, True, _Phase.PREFILL
            return None
        observation, reward, done, info = _check_step_result(value)
        goes_on = not done and episode.num_turns + 1 < episode.turn_budget
        tokens = self._encode(observation, "env.step observation") if goes_on else None  # validate first
        episode.segments["rewards"][-1][-1] += reward  # on the last token of the action just taken
        episode.env_info = info
        episode.num_turns += 1
        if done:
            return dict(done=True)
        if not goes_on:
            return dict(truncated="max_turns")
        if episode.length + len(tokens) + 1 > config.max_total_tokens:
            return dict(truncated="max_total_tokens")
        episode.add_context(tokens, turn=episode.num_turns - 1)
        episode.pending, episode.fresh = tokens, False
        episode.phase = _Phase.PREFILL if len(tokens) else _Phase.DECODE
        return None

    def _encode(self, text: str, what: str) -> np.ndarray:
        try:
            return np.asarray(self.tokenizer.encode(text), np.int32)
        except ValueError as e:
            raise EnvFailure("invalid_result", f"{what} text cannot be tokenized: {e}") from None

    def _finish(self, episode: _Episode, *, done: bool = False, truncated: str | None = None,
                failure: EnvFailure | None = None) -> Trajectory:  # fmt: skip
        info = dict(
            num_turns=episode.num_turns, done=done, truncated=truncated,
            error=None if failure is None else str(failure), error_kind=None if failure is None else failure.kind,
            final_action=episode.last_action, env_info=episode.env_info,
            unterminated_actions=episode.unterminated_actions,
            difficulty=getattr(episode.prompt, "difficulty", None),
        )  # fmt: skip
        self.stats["trajectories"] += 1
        if failure is not None:
            log_first_failure(failure, f"prompt {episode.prompt.id}")
            self.stats["prompt_too_long" if failure.kind == "prompt_too_long" else f"env_{failure.kind}"] += 1
        if truncated is not None:
            self.stats[f"truncated_{truncated}"] += 1
        return episode.build(info)

    # --- device side ----------------------------------------------------------------------------------

    def _prefill(self, params, state, episodes):
        """Feed every PREFILL slot's pending tokens in one call; those slots start decoding."""
        longest = max(len(e.pending) for e in episodes if e is not None)
        width = min(max(MIN_PREFILL_WIDTH, 1 << (longest - 1).bit_length()), self.config.max_total_tokens)
        tokens = np.zeros((len(episodes), width), np.int32)
        mask = np.zeros((len(episodes), width), bool)
        reset = np.zeros(len(episodes), bool)
        for b, episode in enumerate(episodes):
            if episode is None:
                continue
            n = len(episode.pending)
            tokens[b, :n], mask[b, :n], reset[b] = episode.pending, True, episode.fresh
            episode.pending, episode.phase = None, _Phase.DECODE
        self.stats["prefills"] += 1
        return self.sampler.prefill(params, state, tokens, mask, reset)

    def _decode(self, params, version: int, state, slots: list[_Episode | None], calls: _EnvCalls):
        """One decode chunk for the DECODE slots; a slot whose action ended submits `env.step`."""
        config = self.config
        max_new = np.zeros(len(slots), np.int32)
        stop_ids = np.full((len(slots), MAX_STOP_IDS), -1, np.int32)
        for b, episode in enumerate(slots):
            if episode is not None and episode.phase is _Phase.DECODE:
                sampled = sum(len(t) for t in episode.action["tokens"])
                max_new[b] = min(config.max_action_tokens - sampled, config.max_total_tokens - episode.length)
                stop_ids[b] = episode.stop_ids
        longest = max(slots[b].length + min(max_new[b], self.sampler.chunk_size) for b in np.flatnonzero(max_new))
        some_key = next(s.key for s in slots if s is not None)  # idle rows need a key; it is not used
        keys = jnp.stack([some_key if s is None else s.key for s in slots])
        state, chunk = self.sampler.decode_chunk(params, state, keys, max_new, stop_ids,
                                                 self.sampler.window_for(state, longest))  # fmt: skip
        chunk = jax.device_get(chunk)  # the one host sync of this iteration
        self.stats["decode_chunks"] += 1
        for b, episode in enumerate(slots):
            if max_new[b] == 0:
                continue
            n = int(chunk.num_tokens[b])
            episode.action["tokens"].append(chunk.tokens[b, :n])
            episode.action["logprobs"].append(chunk.logprobs[b, :n])
            episode.action["entropy"].append(chunk.entropy[b, :n])
            episode.action["versions"].append(np.full(n, version, np.int32))
            if not chunk.finished[b]:  # budget left: the next chunk goes on
                continue
            tokens = episode.close_action()
            if tokens[-1] not in episode.stop_ids:
                episode.unterminated_actions += 1
                self.stats["unterminated_actions"] += 1
            episode.last_action = self.tokenizer.decode(tokens)
            episode.phase = _Phase.WAITING_ENV
            calls.submit(b, "env.step", lambda env=episode.env, text=episode.last_action: env.step(text),
                         config.env_timeout_s)  # fmt: skip
        return state


class RolloutService:
    """The agent loop behind the rollout engine's `rollout_fn(prompt, weights, key) -> Trajectory`.

    The engine calls `rollout_fn` from many worker threads, one prompt per call. A service is such a
    callable that batches the calls: each caller's prompt joins one agent loop, which runs on the
    service's own thread, in the next free slot, and the caller gets its trajectory back the moment
    it ends. So `num_slots` engine workers keep the sampler's batch full.

    weights: whatever the callers pass (the engine's WeightStore: `latest() -> (params, version)`),
    read before every decode chunk. A trajectory that ended with an environment failure
    (`info["error"]`) raises `EnvFailure` in its caller, so the engine counts it as a failed rollout
    instead of training on a reward the task never gave. If the loop itself fails (a device error),
    every waiting and later call raises. `close()` ends the loop thread once its trajectories are done.
    """

    def __init__(self, loop: AgentLoop):
        self.loop = loop
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._weights = None
        self._thread: threading.Thread | None = None
        self._waiting: set[_Reply] = set()
        self._failure: BaseException | None = None

    def __call__(self, prompt, weights, key: jax.Array) -> Trajectory:
        reply = _Reply()
        with self._lock:
            if self._failure is not None:
                raise RuntimeError("the agent loop of this RolloutService has failed") from self._failure
            self._weights = weights
            self._waiting.add(reply)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, daemon=True, name="agent-loop")
                self._thread.start()
        self._inbox.put((prompt, key, reply))
        trajectory = reply.wait()
        if trajectory.info["error"] is not None:
            raise EnvFailure(trajectory.info["error_kind"], trajectory.info["error"])
        return trajectory

    def close(self) -> None:
        self._inbox.put(_NO_MORE)
        if self._thread is not None:
            self._thread.join()

    def _serve(self) -> None:
        def take(block: bool):
            try:
                return self._inbox.get(block=block)
            except queue.Empty:
                return None

        def deliver(reply: _Reply, trajectory: Trajectory) -> None:
            with self._lock:
                self._waiting.discard(reply)
            reply.set(trajectory)

        try:
            self.loop._run(lambda: weights_getter(self._weights)(), take, deliver)
        except BaseException as failure:  # noqa: BLE001 — handed to every caller instead
            with self._lock:
                self._failure = failure
                waiting, self._waiting = self._waiting, set()
            for reply in waiting:
                reply.set(failure)


class _Reply:
    """A one-shot result handed from the loop thread to a waiting caller (a Trajectory or an error)."""

    def __init__(self):
        self._ready = threading.Event()
        self._value = None

    def set(self, value) -> None:
        self._value = value
        self._ready.set()

    def wait(self) -> Trajectory:
        self._ready.wait()
        if isinstance(self._value, BaseException):
            raise RuntimeError("the agent loop of this RolloutService has failed") from self._value
        return self._value
