"""Skip-observation GAE: sao_jax against Tunix, rlax and a numpy loop, side by side in one run.

    python benchmarks/gae.py            # the full shapes (minutes; run it on an idle machine)
    python benchmarks/gae.py --quick    # tiny shapes, a few repeats: a smoke test in seconds
    python benchmarks/gae.py --shapes 16x32768 --repeats 5   # chosen shapes

Every row is a batch of agent trajectories: a prompt, then alternating action spans and
observation spans, about 30 % observation tokens, a terminal reward and a small reward on some
observation tokens. Times are the median of `--repeats` jitted calls after a warm-up call, each
ended with `block_until_ready`, float32 on the default JAX backend.

What each column computes:
  ours scan / ours associative — `skip_observation_gae` with that method: advantages and returns.
  ours auto  — the method "auto" picks for the shape (what the trainer gets).
  ours+whiten — ours auto followed by `masked_whiten` over the action tokens.
  tunix      — `tunix.rl.ppo.ppo_helpers.compute_gae_advantages` with `completion_mask` = action
               mask: a reverse scan carrying state across masked tokens (dropping their rewards),
               whitening inside; compare it with ours+whiten.
  rlax       — `rlax.truncated_generalized_advantage_estimation` vmapped over rows, plus
               returns = A + V: plain GAE over every token (it cannot skip observations), the
               cost floor of a scan-based GAE.
  numpy      — a reverse Python loop over time, batch-vectorised numpy, of the same recurrence;
               its result is also checked against ours.
Ratios are peer time / ours auto time (> 1: ours is faster).
"""

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.advantages import masked_whiten, skip_observation_gae

try:
    from tunix.rl.ppo import ppo_helpers as tunix_ppo
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


def median_seconds(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # warm-up: compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def contenders():
    """Name → (function, which inputs it takes)."""
    ours = {method: jax.jit(functools.partial(skip_observation_gae, gamma=GAMMA, lam=LAM,
                                              method=method))
            for method in ("scan", "associative", "auto")}

    @jax.jit
    def ours_whitened(rewards, values, action_mask):
        advantages, returns = ours["auto"](rewards, values, action_mask)
        return masked_whiten(advantages, action_mask), returns

    table = {
        "ours scan": (ours["scan"], "rvm"),
        "ours associative": (ours["associative"], "rvm"),
        "ours auto": (ours["auto"], "rvm"),
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
    table["numpy"] = (lambda r, v, m: numpy_skip_observation_gae(r, v, m, GAMMA, LAM), "np")
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 3 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per cell (≥ 5)")
    parser.add_argument("--shapes", nargs="+", default=None, help="BATCHxTIME, e.g. 16x32768")
    args = parser.parse_args()
    if args.shapes:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes]
    else:
        shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    repeats = args.repeats or (3 if args.quick else 7)

    table = contenders()
    names = list(table)
    print(f"backend={jax.default_backend()} devices={len(jax.devices())} repeats={repeats}"
          f"{'' if tunix_ppo else ' (tunix not installed)'}{'' if rlax else ' (rlax not installed)'}")
    rng = np.random.default_rng(0)
    rows = []
    for batch, time_steps in shapes:
        rewards_np, values_np, mask_np = make_batch(batch, time_steps, rng)
        inputs = {
            "r": jnp.asarray(rewards_np), "v": jnp.asarray(values_np), "m": jnp.asarray(mask_np),
            "f": jnp.asarray(mask_np, jnp.float32),
        }
        numpy_advantages, _ = numpy_skip_observation_gae(rewards_np, values_np, mask_np, GAMMA, LAM)
        ours_advantages, _ = table["ours auto"][0](inputs["r"], inputs["v"], inputs["m"])
        np.testing.assert_allclose(ours_advantages, numpy_advantages, rtol=1e-4, atol=1e-3)

        seconds = {}
        for name in names:
            fn, takes = table[name]
            call_args = ((rewards_np, values_np, mask_np) if takes == "np"
                         else tuple(inputs[k] for k in takes))
            seconds[name] = median_seconds(fn, call_args, repeats)
        rows.append((batch, time_steps, 1 - mask_np.mean(), seconds))

    print()
    print("| shape | obs % | " + " | ".join(f"{n} ms" for n in names) + " | "
          + " | ".join(f"{n} / ours" for n in names if not n.startswith("ours")) + " |")
    print("|" + "---|" * (2 + len(names) + sum(not n.startswith("ours") for n in names)))
    for batch, time_steps, observation_fraction, seconds in rows:
        ours = seconds["ours auto"]
        cells = [f"{batch}×{time_steps}", f"{100 * observation_fraction:.0f}"]
        cells += [f"{1e3 * seconds[n]:.3f}" for n in names]
        cells += [f"{seconds[n] / ours:.2f}" for n in names if not n.startswith("ours")]
        print("| " + " | ".join(cells) + " |")
    if "tunix" in seconds:
        print("\ntunix whitens inside; tunix / ours+whiten per shape: " + ", ".join(
            f"{b}×{t} {s['tunix'] / s['ours+whiten']:.2f}" for b, t, _, s in rows))


if __name__ == "__main__":
    main()
