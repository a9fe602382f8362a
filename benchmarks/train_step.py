"""Throughput of the SAO training step — `ttur_step` = K=2 critic updates + 1 policy update — and of
each update alone, against a `jnp.dot` peak timed in the same process and, on CPU, Tunix's PPO
actor and critic updates on a model of the same size and batch.

    python benchmarks/train_step.py                    # d_model 512 MoE, 16×256, float32, + Tunix (CPU)
    python benchmarks/train_step.py --quick            # tiny shapes, a smoke test
    python benchmarks/train_step.py --preset d512-dense  # the same with dense MLPs (Tunix's exact twin)
    python benchmarks/train_step.py --preset moe_1b --dispatch sorted --batch 16 --seq 1024 --remat --no-tunix
                                                       # ~1B-parameter MoE in bfloat16, for accelerators
    bash benchmarks/accelerator.sh                     # a GPU/TPU session's first checks (model.py + this, moe_1b)

The steps are the trainer's own (`sao_jax.train.steps.build_steps` with the default config: frozen-
attention critic, DIS loss, skip-observation GAE with length-adaptive λ), on a synthetic batch with
the layout of a multi-turn trajectory (prompt, then action spans separated by observation spans).
Timing is interleaved (each repeat calls every variant once, in turn) and a time is the median over
repeats after a warm-up call, each ended with `block_until_ready`; the 1-minute load average is
printed before and after, so on a shared machine compare ratios rather than absolute rates.

Model FLOPs (PaLM, Chowdhery et al. 2022, appendix B; backward = 2 × forward), per token of the batch,
N = the matmul parameters one token multiplies (`model.active_matmul_params`), A = the attention
term 4 · L · H · d_head · T of one forward over the full T×T window:
    value update   = 3 · (2·N_critic + A)                      (forward + backward of the critic)
    policy update  = (2·N_critic + A) + 3 · (2·N_policy + A)   (critic values, then the policy step)
    ttur_step      = K · value update + policy update
Every row is credited these model FLOPs, so work the implementation skips (frozen attention needs no
attention weight gradients) shows up as a higher rate, as it should. MFU on an accelerator is model
FLOP/s over the device's dense peak (`--peak-tflops`, e.g. 989 for an H100/H200 SXM in bf16); the
`jnp.dot` row is the achievable matmul rate measured here.

Tunix side (CPU, `bench` extra): `benchmarks/tunix_ppo.py` builds Tunix's PPO actor update and critic
update (Tunix's own loss functions and model, sized like ours). The target it is held to:
    SAO step ≤ Tunix actor update + 2 × Tunix critic update
(one SAO step does one more critic update than Tunix's PPO iteration).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import active_matmul_params, bench_moe, interleaved_median_seconds, matmul_peak, moe_1b  # noqa: E402

from sao_jax.cli import set_xla_flags  # noqa: E402
from sao_jax.config import Config  # noqa: E402
from sao_jax.models import Critic, ModelConfig, Policy, param_count  # noqa: E402
from sao_jax.optim import ALL_TRAINABLE, adamw, train_only  # noqa: E402
from sao_jax.rollout.trajectory import TrajectoryBatch  # noqa: E402
from sao_jax.train import steps as steps_lib  # noqa: E402


PRESETS = {
    "d512": lambda quick: bench_moe(quick),
    # every layer a dense SwiGLU as wide as the two active experts: Tunix's twin exactly, so the
    # per-FLOP rows compare the frameworks without the MoE dispatch
    "d512-dense": lambda quick: (c := bench_moe(quick)).replace(dense_layers=tuple(range(c.num_layers))),
    "moe_1b": lambda quick: moe_1b(),
}


def synthetic_batch(config: ModelConfig, batch: int, seq: int, seed: int = 0) -> TrajectoryBatch:
    """A [batch, seq] batch laid out like multi-turn trajectories: the first eighth of each row is the
    prompt, then action spans of 24 tokens alternate with observation spans of 8; the outcome reward
    (0 or 1) sits on the last action token. Rollout log-probs are log(1/vocab), what a fresh model
    gives, so DIS keeps most tokens, as in a real step."""
    rng = np.random.default_rng(seed)
    t = np.arange(seq)
    in_turns = t >= seq // 8
    action = in_turns & (((t - seq // 8) % 32) < 24)
    action_mask = np.broadcast_to(action, (batch, seq)).copy()
    last_action = int(np.nonzero(action)[0][-1])
    rewards = np.zeros((batch, seq), np.float32)
    rewards[:, last_action] = rng.integers(0, 2, batch)
    turn = np.where(in_turns, (t - seq // 8) // 32, -1)
    return TrajectoryBatch(
        tokens=jnp.asarray(rng.integers(3, config.vocab_size, (batch, seq)), jnp.int32),
        action_mask=jnp.asarray(action_mask),
        valid_mask=jnp.ones((batch, seq), bool),
        rollout_logprobs=jnp.full((batch, seq), -np.log(config.vocab_size), jnp.float32),
        rollout_entropy=jnp.full((batch, seq), np.log(config.vocab_size), jnp.float32),
        policy_version=jnp.zeros((batch, seq), jnp.int32),
        staleness=jnp.zeros((batch, seq), jnp.int32),
        rewards=jnp.asarray(rewards),
        turn_index=jnp.asarray(np.broadcast_to(turn, (batch, seq)), jnp.int32),
        prompt_id=jnp.arange(batch, dtype=jnp.int32),
    )


def critic_matmul_params(config: ModelConfig) -> int:
    """N_critic: the policy's active matmul parameters without the LM head, plus the value head."""
    return active_matmul_params(config) - config.vocab_size * config.hidden_size + config.hidden_size


def update_flops(config: ModelConfig, batch: int, seq: int, k: int) -> dict[str, float]:
    tokens = batch * seq
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * seq
    critic_forward = 2 * critic_matmul_params(config) + attention
    policy_forward = 2 * active_matmul_params(config) + attention
    value = tokens * 3 * critic_forward
    policy = tokens * (critic_forward + 3 * policy_forward)
    return {"value": value, "policy": policy, "ttur": k * value + policy}


def sao_calls(model_config: ModelConfig, batch: TrajectoryBatch, config: Config, *, frozen_only: bool = False) -> dict:
    """Zero-argument calls running each of our updates once on `batch` (state donated and replaced)."""
    policy = Policy(model_config, rngs=nnx.Rngs(0))
    calls = {}
    variants = [("frozen attention", config.critic.trainable_patterns)]
    variants += [] if frozen_only else [("all trainable", ALL_TRAINABLE)]
    for label, patterns in variants:
        run_config = dataclasses.replace(config, critic=dataclasses.replace(config.critic, trainable_patterns=patterns))
        policy_tx = steps_lib.guard_nonfinite(adamw(1e-6))
        critic_tx = steps_lib.guard_nonfinite(train_only(adamw(5e-6), patterns))
        critic = Critic.from_policy(policy, rngs=nnx.Rngs(1))
        state, graphs = steps_lib.make_train_state(policy, critic, policy_tx, critic_tx, run_config)
        steps = steps_lib.build_steps(graphs, policy_tx, critic_tx, run_config)
        holder = {"state": jax.tree.map(jnp.copy, state)}  # own buffers: the steps donate them

        def call(step, holder=holder):
            holder["state"], metrics = step(holder["state"], batch, jax.random.key(0))
            return metrics

        if label == "frozen attention":
            calls["SAO value update (frozen attention)"] = lambda call=call, s=steps: call(s.value_update)
            calls["SAO policy update"] = lambda call=call, s=steps: call(s.policy_update)
            calls["SAO ttur_step (K=2, frozen attention)"] = lambda call=call, s=steps: call(s.ttur_step)
        else:
            calls["SAO value update (all trainable)"] = lambda call=call, s=steps: call(s.value_update)
            calls["SAO ttur_step (K=2, all trainable)"] = lambda call=call, s=steps: call(s.ttur_step)
    return calls


def tunix_calls(tunix_ppo, config: ModelConfig, batch: int, seq: int, row_flops: dict) -> dict:
    """Tunix's PPO actor and critic updates on a dense Qwen3 of our model's widths, its MLP as wide as
    our active experts (k · moe_intermediate_size): the same active FLOPs per token. (Tunix's MoE layer
    runs every expert on every token, so a dense twin is the fair peer.) Adds their FLOPs to `row_flops`."""
    sizes = dict(
        d_model=config.hidden_size, num_layers=config.num_layers, num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, vocab=config.vocab_size,
        mlp_dim=config.num_experts_per_token * config.moe_intermediate_size if config.num_experts else config.intermediate_size,
        tie_embeddings=config.tie_word_embeddings,
    )  # fmt: skip
    calls = tunix_ppo.make_tunix_updates(batch=batch, seq=seq, **sizes)
    row_flops |= tunix_ppo.tunix_update_flops(tunix_ppo.tunix_qwen3_config(**sizes), batch=batch, seq=seq)
    return calls


def main(argv=None) -> None:
    set_xla_flags()  # XLA:CPU's scheduler as `sao-train` sets it, before any JAX call (sao_jax/cli.py)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="d512")
    parser.add_argument("--dispatch", choices=("blocked", "capacity", "sorted", "dense", "gmm"), default="blocked",
                        help="MoE dispatch (blocked: exact and fastest on CPU; sorted = ragged_dot, for GPU/TPU; "
                             "gmm = the megablox kernel, TPU only)")  # fmt: skip
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=None, help="device dense peak for MFU (bf16: 989 on H100/H200)")
    parser.add_argument("--no-tunix", action="store_true", help="skip the Tunix PPO rows")
    parser.add_argument("--remat", action="store_true", help="recompute each layer in the backward pass (big models)")
    parser.add_argument("--frozen-only", action="store_true", help="skip the all-trainable critic rows (fewer compiles)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 repeats: a smoke test")
    parser.add_argument("--ragged-dot-triton", action="store_true",
                        help="GPU: lower `ragged_dot` (the sorted dispatch) to JAX's Pallas Triton grouped matmul "
                             "instead of XLA's default, which may pad every group to the whole batch")  # fmt: skip
    args = parser.parse_args(argv)
    if args.ragged_dot_triton:
        jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", True)
    if args.quick:
        args.batch, args.seq, args.repeats = 2, 64, 2

    model_config = PRESETS[args.preset](args.quick).replace(moe_dispatch=args.dispatch, remat=args.remat)
    config = Config()
    if not model_config.num_experts or len(model_config.dense_layers) == model_config.num_layers:
        # no MoE projections to train: the frozen-attention critic trains its dense MLPs instead
        patterns = (r"(.*/)?mlp/(gate_proj|up_proj|down_proj)", r"(.*/)?value_head/.*")
        config = dataclasses.replace(config, critic=dataclasses.replace(config.critic, trainable_patterns=patterns))
    k = config.critic.updates_per_policy_update
    batch = synthetic_batch(model_config, args.batch, args.seq)
    flops = update_flops(model_config, args.batch, args.seq, k)
    calls = sao_calls(model_config, batch, config, frozen_only=args.frozen_only)
    row_flops = {name: flops["ttur" if "ttur" in name else "value" if "value" in name else "policy"] for name in calls}

    if not args.no_tunix:
        try:
            import tunix_ppo
        except ImportError as e:  # the `bench` extra is not installed
            print(f"Tunix rows skipped: {e}")
        else:
            calls |= tunix_calls(tunix_ppo, model_config, args.batch, args.seq, row_flops)

    dtype = model_config.compute_dtype
    peak_n = 256 if args.quick else (4096 if jax.default_backend() != "cpu" else 1024)
    calls["jnp.dot"], dot_flops = matmul_peak(peak_n, dtype)
    load_before = os.getloadavg()[0]
    seconds = interleaved_median_seconds(calls, args.repeats)
    load_after = os.getloadavg()[0]
    dot_rate = dot_flops / seconds.pop("jnp.dot")

    device = jax.devices()[0]
    print(f"device {device.platform}:{device.device_kind}; preset {args.preset} ({param_count(model_config) / 1e6:.1f}M "
          f"params, {active_matmul_params(model_config) / 1e6:.1f}M active matmul), dispatch {args.dispatch}"
          f"{' (Triton ragged_dot)' if args.ragged_dot_triton else ''}, "
          f"{model_config.dtype}, batch {args.batch}×{args.seq}")  # fmt: skip
    print(f"jnp.dot {peak_n}² {jnp.dtype(dtype).name}: {dot_rate / 1e12:.3f} TFLOP/s; 1-min load {load_before:.1f} → {load_after:.1f}")
    header = ["update", "ms", "tokens/s", "model TFLOP/s", "of jnp.dot"] + (["MFU"] if args.peak_tflops else [])
    rows = []
    for name, s in seconds.items():
        rate = row_flops[name] / s
        row = [name, f"{s * 1e3:.1f}", f"{args.batch * args.seq / s:,.0f}", f"{rate / 1e12:.3f}", f"{rate / dot_rate:.1%}"]
        if args.peak_tflops:
            row.append(f"{rate / (args.peak_tflops * 1e12):.1%}")
        rows.append(row)
    print_table(header, rows)
    if "tunix actor update" in seconds:
        budget = seconds["tunix actor update"] + 2 * seconds["tunix critic update"]
        ours = seconds["SAO ttur_step (K=2, frozen attention)"]
        print(f"SAO step / (Tunix actor + 2 × Tunix critic) = {ours:.3f} s / {budget:.3f} s = {ours / budget:.2f}  (target ≤ 1.00)")
        for ours_name, theirs in (("SAO policy update", "tunix actor update"),
                                  ("SAO value update (all trainable)", "tunix critic update")):  # fmt: skip
            ours_rate, their_rate = row_flops[ours_name] / seconds[ours_name], row_flops[theirs] / seconds[theirs]
            print(f"  FLOP/s {ours_name} ÷ {theirs}: {ours_rate / their_rate:.2f}  (target ≥ 1.00)")


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |")


if __name__ == "__main__":
    main()
