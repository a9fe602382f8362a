"""Skip-observation GAE: sao_jax against Tunix, rlax and a numpy loop, side by side in one run.

    python benchmarks/gae.py            # the full shapes (minutes; run it on an idle machine)
    python benchmarks/gae.py --quick    # tiny shapes, a few repeats: a smoke test in seconds
    python benchmarks/gae.py --shapes 16x32768 --repeats 9   # chosen shapes

Every row is a batch of agent trajectories: a prompt, then alternating action spans and
observation spans, about 30 % observation tokens, a terminal reward and a small reward on some
observation tokens. float32 on the default JAX backend.

Timing is interleaved: after one warm-up (compiling) call each, every repeat calls each JAX
contender once, in a fresh random order, each call ended with `block_until_ready`; a cell is the
median over repeats. On a shared machine the load then falls on every contender alike, so the
ratios are steadier than the absolute times. The numpy loop, a thousand times slower, is timed on
its own afterwards (3 calls), so that the second it holds the CPU does not sit between the others.
The load average is printed with the table.

What each column computes:
  ours kernel / ours scan / ours associative — `skip_observation_gae` with that method:
               advantages and returns ("kernel": the C++ CPU kernel of sao_jax/native).
  ours+whiten — ours with the method "auto" picks, then `masked_whiten` over the action tokens.
  tunix      — `tunix.rl.ppo.ppo_helpers.compute_gae_advantages` with `completion_mask` = action
               mask: a reverse scan carrying state across masked tokens (dropping their rewards),
               whitening inside; so the like-for-like ratio is tunix ÷ ours+whiten.
  rlax       — `rlax.truncated_generalized_advantage_estimation` vmapped over rows, plus
               returns = A + V: plain GAE over every token (it cannot skip observations), the
               cost floor of a scan-based GAE.
  numpy      — a reverse Python loop over time, batch-vectorised numpy, of the same recurrence;
               its result is also checked against ours.
Ratios are peer time ÷ ours time (> 1: ours is faster), "ours" being the method "auto" picks.
"""

import argparse
import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.advantages import _resolve_method, masked_whiten, skip_observation_gae
from sao_jax.cli import set_xla_flags

try:
    from tunix.rl.ppo import ppo_helpers as tunix_ppo
except ImportError:
    try:  # some google-tunix 0.1.7 wheels keep the PPO helpers in algo_core
        from tunix.rl import algo_core as tunix_ppo
    except ImportError:  # the bench extra is not installed
        tunix_ppo = None
try:
    import rlax
except ImportError:
    rlax = None

FULL_SHAPES = [(128, 1024), (16, 32768), (1, 131072), (8, 131072)]
QUICK_SHAPES = [(4, 256), (2, 2048)]
GAMMA = 1.0
LAM = 0.95


def make_batch(batch: int, time_steps: int, rng: np.random.Generator):
    """Rows of prompt ‖ a_0 ‖ o_0 ‖ a_1 ‖ …, action spans 64–512 tokens, observations 32–192."""
    action_mask = np.zeros((batch, time_steps), bool)
    rewards = np.zeros((batch, time_steps), np.float32)
    for row in range(batch):
        t = int(rng.integers(16, 64))  # the prompt
        while t < time_steps:
            action_end = min(t + int(rng.integers(64, 513)), time_steps)
            action_mask[row, t:action_end] = True
            observation_end = min(action_end + int(rng.integers(32, 193)), time_steps)
            if observation_end > action_end:
                rewards[row, action_end] = 0.1  # e.g. a tool-call format reward
            t = observation_end
        rewards[row, np.flatnonzero(action_mask[row])[-1]] = 1.0
    values = rng.normal(size=(batch, time_steps)).astype(np.float32)
    return rewards, values, action_mask


def numpy_skip_observation_gae(rewards, values, action_mask, gamma, lam):
    """The skip-observation recurrence as a reverse loop over time, rows vectorised."""
    batch, time_steps = rewards.shape
    advantages = np.zeros_like(rewards)
    next_advantage = np.zeros(batch, np.float32)
    next_value = np.zeros(batch, np.float32)
    gap_reward = np.zeros(batch, np.float32)
    for t in range(time_steps - 1, -1, -1):
        action = action_mask[:, t]
        delta = rewards[:, t] + gap_reward + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = np.where(action, advantage, 0)
        next_advantage = np.where(action, advantage, next_advantage)
        next_value = np.where(action, values[:, t], next_value)
        gap_reward = np.where(action, 0, gap_reward + rewards[:, t])
    return advantages, np.where(action_mask, advantages + values, 0)


def interleaved_median_seconds(calls: dict, repeats: int, rng: np.random.Generator) -> dict:
    """Name → median seconds per call of `calls` (name → (function, args)), called in turn."""
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))  # warm-up: compile
    names = list(calls)
    times = {name: [] for name in names}
    for _ in range(repeats):
        # A fresh order each repeat: no contender always runs right after the same other one.
        for name in rng.permutation(names):
            fn, args = calls[name]
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def contenders():
    """Name → (function, which inputs it takes: r rewards, v values, m bool mask, f float mask);
    "numpy" takes the numpy arrays (rewards, values, action_mask)."""
    ours = {method: jax.jit(functools.partial(skip_observation_gae, gamma=GAMMA, lam=LAM,
                                              method=method))
            for method in ("kernel", "scan", "associative")}

    @jax.jit
    def ours_whitened(rewards, values, action_mask):
        advantages, returns = skip_observation_gae(rewards, values, action_mask, gamma=GAMMA,
                                                   lam=LAM)
        return masked_whiten(advantages, action_mask), returns

    table = {
        "ours kernel": (ours["kernel"], "rvm"),
        "ours scan": (ours["scan"], "rvm"),
        "ours associative": (ours["associative"], "rvm"),
        "ours+whiten": (ours_whitened, "rvm"),
    }
    if tunix_ppo is not None:
        table["tunix"] = (functools.partial(tunix_ppo.compute_gae_advantages, gamma=GAMMA,
                                            gae_lambda=LAM), "rvf")
    if rlax is not None:

        def rlax_row(rewards, values):
            bootstrapped = jnp.append(values, 0.0)  # rlax wants V at times [0, T]
            return rlax.truncated_generalized_advantage_estimation(
                rewards, jnp.full_like(rewards, GAMMA), LAM, bootstrapped)

        @jax.jit
        def rlax_gae(rewards, values):
            advantages = jax.vmap(rlax_row)(rewards, values)
            return advantages, advantages + values

        table["rlax"] = (rlax_gae, "rv")
    table["numpy"] = (lambda r, v, m: numpy_skip_observation_gae(r, v, m, GAMMA, LAM), None)
    return table


def ratio_columns(names, ours: str):
    """(header, numerator, denominator) of the ratio columns; > 1 means ours is faster."""
    columns = []
    if "tunix" in names:
        columns += [("tunix ÷ ours+whiten", "tunix", "ours+whiten"),
                    ("tunix ÷ ours", "tunix", ours)]
    if "rlax" in names:
        columns.append(("rlax ÷ ours", "rlax", ours))
    columns += [("numpy ÷ ours", "numpy", ours),
                ("scan ÷ kernel", "ours scan", "ours kernel"),
                ("associative ÷ scan", "ours associative", "ours scan")]
    return columns


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f} (5 min {five:.1f}) on {os.cpu_count()} CPUs"


def main():
    set_xla_flags()  # XLA:CPU's scheduler as `sao-train` sets it, before any JAX call (sao_jax/cli.py)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 3 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per cell (≥ 7)")
    parser.add_argument("--shapes", nargs="+", default=None, help="BATCHxTIME, e.g. 16x32768")
    args = parser.parse_args()
    if args.shapes:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes]
    else:
        shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    repeats = args.repeats or (3 if args.quick else 9)

    table = contenders()
    names = list(table)
    auto_method = _resolve_method("auto", "benchmarks/gae.py", kernel=True)
    ours = f"ours {auto_method}"
    print(f"backend={jax.default_backend()} devices={len(jax.devices())} repeats={repeats} "
          f"auto={auto_method}{'' if tunix_ppo else ' (tunix not installed)'}"
          f"{'' if rlax else ' (rlax not installed)'}; before: {load_average()}")
    rng = np.random.default_rng(0)
    order_rng = np.random.default_rng(1)
    rows = []
    for batch, time_steps in shapes:
        rewards_np, values_np, mask_np = make_batch(batch, time_steps, rng)
        inputs = {
            "r": jnp.asarray(rewards_np), "v": jnp.asarray(values_np), "m": jnp.asarray(mask_np),
            "f": jnp.asarray(mask_np, jnp.float32),
        }
        numpy_advantages, _ = numpy_skip_observation_gae(rewards_np, values_np, mask_np, GAMMA, LAM)
        for method in ("ours kernel", "ours scan", "ours associative"):
            advantages, _ = table[method][0](inputs["r"], inputs["v"], inputs["m"])
            np.testing.assert_allclose(advantages, numpy_advantages, rtol=1e-4, atol=1e-3)

        calls = {name: (fn, tuple(inputs[k] for k in takes))
                 for name, (fn, takes) in table.items() if name != "numpy"}
        seconds = interleaved_median_seconds(calls, repeats, order_rng)
        seconds.update(interleaved_median_seconds(
            {"numpy": (table["numpy"][0], (rewards_np, values_np, mask_np))}, 3, order_rng))
        rows.append((batch, time_steps, 1 - mask_np.mean(), seconds))

    ratios = ratio_columns(names, ours)
    print(f"after: {load_average()}\n")
    print("| shape | obs % | " + " | ".join(f"{n} ms" for n in names) + " | "
          + " | ".join(header for header, _, _ in ratios) + " |")
    print("|" + "---|" * (2 + len(names) + len(ratios)))
    for batch, time_steps, observation_fraction, seconds in rows:
        cells = [f"{batch}×{time_steps}", f"{100 * observation_fraction:.0f}"]
        cells += [f"{1e3 * seconds[n]:.3f}" for n in names]
        cells += [f"{seconds[a] / seconds[b]:.2f}" for _, a, b in ratios]
        print("| " + " | ".join(cells) + " |")
    if "tunix" in names and "rlax" in names:
        targets = [("tunix ÷ ours ≥ 3", "tunix", ours, 3), ("tunix ÷ ours+whiten ≥ 3", "tunix",
                    "ours+whiten", 3), ("rlax ÷ ours ≥ 1", "rlax", ours, 1)]
        print("\ntargets, at every shape: " + "; ".join(
            f"{name}: {'met' if all(s[a] / s[b] >= bound for *_, s in rows) else 'not met'}"
            for name, a, b, bound in targets))


if __name__ == "__main__":
    main()
