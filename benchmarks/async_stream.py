"""Streaming single rollouts vs synchronous groups: trainer idle time and throughput of the real engine.

    python benchmarks/async_stream.py          # defaults: 20 steps of 32, about half a minute
    python benchmarks/async_stream.py --steps 3 --batch-size 8 --workers 8 \\
        --median-latency-s 0.01 --train-step-s 0.01                         # a smoke run, seconds

Both modes do the same work: steps × batch_size rollouts whose latencies are drawn once from a
lognormal (median m, log-standard-deviation σ, seeded) and handed out in prompt order, so each mode
rolls out the same latencies in the same order. Everything but the model is real: the rollout
function is a fake that sleeps its latency in `DECODE_CHUNKS` equal chunks, reading the weight store
before each chunk and stamping the version it read on that chunk's action tokens (what the agent
loop's `RolloutService` does between decode chunks); the engine, the weight store, the queue and
the metrics are `sao_jax.rollout.engine`'s. A training step is a sleep of `--train-step-s`, after
which the trainer publishes weights version s.

stream  `RolloutEngine(group_size=1)` (SAO): every worker rolls out one prompt after another; each
        step takes the first batch_size trajectories to finish (completion order). Rollouts keep
        running while the trainer trains and pick up the new version at their next chunk.
sync    `RolloutEngine(group_size=8)` (`--group-size`) behind a prompt source that releases one
        step's batch_size / 8 prompts at a time, the next step's only after the trainer has published
        (`StepGatedPrompts`): every rollout of step s runs with the weights of step s − 1, the step
        waits for whole groups — for the slowest rollout of the batch — and the workers sit idle
        while the trainer trains. This is the on-policy GRPO schedule.
Both use `--workers` threads and a queue of `--queue-capacity` trajectories (default: the batch
size, so the streaming workers run at most one batch ahead); no staleness bound, nothing dropped.

Columns (one row per mode):
  traj_per_s       the engine's `trajectories_per_s`: trajectories produced / engine wall time
  idle             the engine's `trainer_idle_fraction`: time inside `get_batch` / engine wall time
  idle_steady      the trainer's own timing of steps 2 … S−1: time in get_batch / time from the end of
                   the first get_batch to the start of the last (nan below 3 steps)
  fill_s, drain_s  the first and the last get_batch (s). A finite run has two end effects: the first
                   batch waits for the pipeline to fill, and the last for every remaining rollout,
                   stragglers included. Both are fixed costs, so their share of `idle` falls as 1/steps.
  staleness_mean   mean of the engine's staleness histogram (store version − oldest token version)
  wall_s           engine wall time, construction to close
  trajectories     trajectories consumed by the trainer
  taken consumed dropped failed unconsumed in_flight   the engine's prompt accounting at close
                   (`EngineState`); `taken` must equal consumed + the rest, and here every prompt
                   must be consumed.
Then the ratio line (stream ÷ sync throughput), the target for streaming (idle ≤ 10 %), and the
ideal sync wall time (the same latencies list-scheduled on the workers with no engine overhead).
Timings are only meaningful on an otherwise idle machine; the load average is printed with them.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import os
import threading
import time

import jax
import numpy as np

from sao_jax.cli import set_xla_flags
from sao_jax.rollout.engine import RolloutEngine, WeightStore, rollout_key
from sao_jax.rollout.trajectory import Trajectory

DECODE_CHUNKS = 4  # weight-store reads per rollout, as the agent loop does between decode chunks
TOKENS_PER_CHUNK = 4
TARGET_STREAM_IDLE = 0.10  # the streaming trainer should wait for data at most this share of the time
COLUMNS = ("mode", "traj_per_s", "idle", "idle_steady", "fill_s", "drain_s", "staleness_mean", "wall_s",
           "trajectories", "taken", "consumed", "dropped", "failed", "unconsumed", "in_flight")


@dataclasses.dataclass
class SimulatedPrompt:
    """One prompt: the latencies of its group members, handed to members in the order they start."""

    latencies_s: list[float]
    _taken: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def next_latency_s(self) -> float:
        with self._lock:  # members of one group may start on several workers at once
            latency_s = self.latencies_s[self._taken]
            self._taken += 1
        return latency_s


def sleeping_rollout(prompt: SimulatedPrompt, weights: WeightStore, key: jax.Array) -> Trajectory:
    """The rollout function: sleeps the prompt's next latency in `DECODE_CHUNKS` chunks.

    A one-token prompt, then `DECODE_CHUNKS × TOKENS_PER_CHUNK` action tokens; before each chunk it
    reads `weights.latest()` and records that version on the chunk's tokens.
    """
    del key  # the sleep stands in for sampling; nothing here is random
    chunk_s = prompt.next_latency_s() / DECODE_CHUNKS
    versions = []
    for _ in range(DECODE_CHUNKS):
        _, version = weights.latest()
        versions += [version] * TOKENS_PER_CHUNK
        time.sleep(chunk_s)
    num_tokens = 1 + len(versions)
    action_mask = np.arange(num_tokens) > 0
    return Trajectory(
        tokens=np.zeros(num_tokens, np.int32),
        action_mask=action_mask,
        rollout_logprobs=np.zeros(num_tokens, np.float32),
        rollout_entropy=np.zeros(num_tokens, np.float32),
        policy_version=np.array([-1] + versions, np.int32),
        rewards=np.zeros(num_tokens, np.float32),
        turn_index=np.where(action_mask, 0, -1).astype(np.int32),
        prompt_id=0,  # the engine sets the prompt index
    )


class StepGatedPrompts:
    """Prompt source of the sync mode: `per_step` prompts, then `next` blocks until `release()`.

    The trainer calls `release()` after publishing a step's weights, so no rollout of step s + 1
    starts before the weights of step s exist. `stop()` ends the source (unblocking any waiter).
    """

    def __init__(self, prompts: list[SimulatedPrompt], per_step: int):
        self._prompts, self._per_step = prompts, per_step
        self._drawn, self._released = 0, per_step
        self._stopped = False
        self._cond = threading.Condition()

    def __iter__(self):
        return self

    def __next__(self) -> SimulatedPrompt:
        with self._cond:
            while self._drawn < len(self._prompts) and self._drawn >= self._released and not self._stopped:
                self._cond.wait()
            if self._drawn >= len(self._prompts) or self._stopped:
                raise StopIteration
            self._drawn += 1
            return self._prompts[self._drawn - 1]

    def release(self) -> None:
        with self._cond:
            self._released += self._per_step
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


def draw_latencies(args) -> np.ndarray:
    """steps × batch_size rollout latencies (s): lognormal with median `median_latency_s`, log-sd σ."""
    rng = np.random.default_rng(args.seed)
    count = args.steps * args.batch_size
    return args.median_latency_s * np.exp(args.sigma * rng.standard_normal(count))


def run_mode(mode: str, latencies_s: np.ndarray, args) -> dict:
    """Train `args.steps` simulated steps on the engine in `mode` ("stream" or "sync"); one table row."""
    group_size = 1 if mode == "stream" else args.group_size
    prompts = [SimulatedPrompt(list(latencies_s[i: i + group_size]))
               for i in range(0, len(latencies_s), group_size)]
    gate = StepGatedPrompts(prompts, args.batch_size // group_size) if mode == "sync" else None
    store = WeightStore(params=None, version=0)
    engine = RolloutEngine(
        sleeping_rollout, gate if gate is not None else prompts, store, jax.random.key(args.seed),
        num_workers=args.workers, queue_capacity=args.queue_capacity or args.batch_size,
        group_size=group_size, max_staleness=None,
    )  # fmt: skip
    waits = []  # (began_s, ended_s) of each get_batch, timed by the trainer loop
    try:
        for step in range(1, args.steps + 1):
            began_s = time.monotonic()
            batch = engine.get_batch(args.batch_size)
            waits.append((began_s, time.monotonic()))
            if len(batch) != args.batch_size:
                raise RuntimeError(f"{mode}: step {step} got {len(batch)} of {args.batch_size} trajectories")
            time.sleep(args.train_step_s)
            store.publish(None, step)
            if gate is not None:
                gate.release()
    finally:
        if gate is not None:
            gate.stop()
        state = engine.close()
    metrics = engine.metrics()
    histogram = metrics["staleness_histogram"]
    # The engine's wall time (construction to close), the denominator of both of its rates.
    wall_s = metrics["trajectories_produced"] / metrics["trajectories_per_s"]
    return {
        "mode": mode,
        "traj_per_s": metrics["trajectories_per_s"],
        "idle": metrics["trainer_idle_fraction"],
        "idle_steady": steady_idle_fraction(waits),
        "fill_s": waits[0][1] - waits[0][0],
        "drain_s": waits[-1][1] - waits[-1][0],
        "staleness_mean": sum(k * n for k, n in histogram.items()) / max(sum(histogram.values()), 1),
        "wall_s": wall_s,
        "trajectories": metrics["trajectories_consumed"],
        "taken": state.next_prompt_index - state.start_index,
        "consumed": state.prompts_consumed,
        "dropped": state.prompts_dropped,
        "failed": state.prompts_failed,
        "unconsumed": len(state.unconsumed_indices),
        "in_flight": len(state.in_flight_indices),
    }


def steady_idle_fraction(waits: list[tuple[float, float]]) -> float:
    """Share of the time between the first and the last get_batch that steps 2 … S−1 spent in it."""
    if len(waits) < 3:
        return float("nan")
    between_s = waits[-1][0] - waits[0][1]
    return sum(ended_s - began_s for began_s, ended_s in waits[1:-1]) / between_s


def ideal_sync_wall_s(latencies_s: np.ndarray, args) -> float:
    """Lockstep wall time with no engine overhead: each step's rollouts, in prompt order, each on the
    worker free first (how the engine hands them out), then the train step."""
    wall_s = 0.0
    for step_latencies in latencies_s.reshape(args.steps, args.batch_size):
        free_at = [0.0] * args.workers
        for latency_s in step_latencies:
            heapq.heappush(free_at, heapq.heappop(free_at) + latency_s)
        wall_s += max(free_at) + args.train_step_s
    return wall_s


def format_line(cells: dict) -> str:
    """One table line: the mode left-aligned, then each column right-aligned, at least 6 wide."""
    return "  ".join(f"{cells[name]:<6}" if name == "mode" else f"{cells[name]:>{max(len(name), 6)}}"
                     for name in COLUMNS)


def format_row(row: dict) -> str:
    def text(name: str) -> str:
        value = row[name]
        if isinstance(value, str | int):
            return str(value)
        return f"{value:.2f}" if name.endswith("_s") else f"{value:.3f}"

    return format_line({name: text(name) for name in COLUMNS})


def main(argv=None) -> None:
    set_xla_flags()  # XLA:CPU's scheduler as `sao-train` sets it, before any JAX call (sao_jax/cli.py)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=32, help="engine worker threads (rollouts at once)")
    parser.add_argument("--batch-size", type=int, default=32, help="trajectories per train step")
    parser.add_argument("--steps", type=int, default=20, help="train steps per mode")
    parser.add_argument("--median-latency-s", type=float, default=0.1, help="median rollout latency")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-standard-deviation of the latency")
    parser.add_argument("--train-step-s", type=float, default=0.25, help="simulated train step time")
    parser.add_argument("--group-size", type=int, default=8, help="group size of the sync mode")
    parser.add_argument("--queue-capacity", type=int, default=None,
                        help="engine queue capacity in trajectories (default: the batch size)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.batch_size % args.group_size:
        parser.error(f"--batch-size {args.batch_size} must be a multiple of --group-size {args.group_size}")
    if args.queue_capacity is not None and args.queue_capacity < args.group_size:
        parser.error(f"--queue-capacity {args.queue_capacity} cannot hold one group of {args.group_size}")

    latencies_s = draw_latencies(args)
    # The engine derives each rollout's key with jax.random.fold_in: compile that before any timing.
    jax.block_until_ready(rollout_key(jax.random.key(args.seed), 0, 0))
    one, five, _ = os.getloadavg()
    print(f"{args.steps} steps × {args.batch_size} rollouts per mode, {args.workers} workers; latency "
          f"lognormal median {args.median_latency_s} s σ {args.sigma} (seed {args.seed}): mean "
          f"{latencies_s.mean():.3f} s, max {latencies_s.max():.3f} s; train step {args.train_step_s} s; "
          f"load average {one:.2f} (1 min) {five:.2f} (5 min), {os.cpu_count()} CPUs")
    rows = [run_mode(mode, latencies_s, args) for mode in ("stream", "sync")]
    print(format_line({name: name for name in COLUMNS}))
    for row in rows:
        print(format_row(row))
    stream, sync = rows
    print(f"ratio stream/sync: {stream['traj_per_s'] / sync['traj_per_s']:.2f}x trajectories/s, "
          f"trainer idle {stream['idle']:.1%} vs {sync['idle']:.1%}")
    verdict = "met" if stream["idle"] <= TARGET_STREAM_IDLE else "NOT met"
    print(f"target stream idle <= {TARGET_STREAM_IDLE:.0%}: {verdict} ({stream['idle']:.1%} overall; "
          f"{stream['idle_steady']:.1%} between the first and last batch, fill {stream['fill_s']:.2f} s, "
          f"drain {stream['drain_s']:.2f} s)")
    ideal_s = ideal_sync_wall_s(latencies_s, args)
    print(f"ideal sync wall {ideal_s:.2f} s (no engine overhead); measured {sync['wall_s']:.2f} s "
          f"(+{sync['wall_s'] / ideal_s - 1:.1%})")


if __name__ == "__main__":
    main()
