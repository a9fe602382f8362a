"""Forward+backward throughput of the MoE decoder, of a dense decoder with the same active parameter
count, and of the two MoE dispatches; then the memory of parameters, gradients and critic optimizer
state with and without the frozen-attention critic (ALGORITHMS.md §7).

    python benchmarks/model.py            # d_model=512, batch×seq 16×256 and 16×512 (run on an idle machine)
    python benchmarks/model.py --quick    # one tiny shape, 2 repeats: a smoke test (under a minute)

A step is `jax.value_and_grad` of the mean next-token cross-entropy (+ the router aux loss) of a
Policy, jitted; times are the median of `--repeats` calls after a warm-up call, each ended with
`block_until_ready`, float32 on the default JAX backend, one device.

Model FLOPs of a step (PaLM, Chowdhery et al. 2022, appendix B; backward = 2 × forward):
    FLOPs = tokens · (6 · N_active + 12 · L · H · d_head · T)
N_active: the parameters one token multiplies (`param_count(active=True)`: top-k routed experts,
shared experts, router, attention, LM head), minus the input embedding, which is a gather. The second
term is QKᵀ and PV over the whole T×T window, which the model computes (masked) in full.
MFU-style ratio: model FLOP/s over the median FLOP/s of a square float32 `jnp.dot` (2n³ FLOPs)
measured in the same process. The "dense dispatch" row runs every expert on every token, so the same
model FLOPs take it longer: its ratio shows the waste the sorted dispatch avoids.

The dense model replaces each MoE block by one SwiGLU of width k · moe_intermediate_size: the same
active expert parameters; it lacks only the router (d · E per layer).

Memory (bytes, from abstract shapes: nothing is allocated): parameters; gradients — of all
parameters, or of the trainable ones only when the critic step differentiates just those; AdamW
state (two moments per trained parameter) with every parameter trained vs frozen attention.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax import optim
from sao_jax.models import Critic, ModelConfig, Policy, glm45_air, param_count, qwen3_30b_a3b

FULL_SHAPES = [(16, 256), (16, 512)]
QUICK_SHAPES = [(2, 32)]


def bench_moe(quick: bool) -> ModelConfig:
    """d_model 512: 4 layers, 8 heads × 64, 8 experts of width 512, top-2 (quick: d_model 64)."""
    if quick:
        return ModelConfig(
            model_type="qwen3_moe", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, intermediate_size=128, num_experts=4, num_experts_per_token=2, moe_intermediate_size=64,
            router_aux_loss_coef=0.001,
        )  # fmt: skip
    return ModelConfig(
        model_type="qwen3_moe", vocab_size=8192, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
        head_dim=64, intermediate_size=1024, num_experts=8, num_experts_per_token=2, moe_intermediate_size=512,
        router_aux_loss_coef=0.001,
    )  # fmt: skip


def dense_twin(moe: ModelConfig) -> ModelConfig:
    """The same decoder with each MoE block replaced by a SwiGLU as wide as the active experts."""
    width = moe.num_experts_per_token * moe.moe_intermediate_size + moe.num_shared_experts * moe.moe_intermediate_size
    return moe.replace(num_experts=0, num_experts_per_token=1, moe_intermediate_size=0, intermediate_size=width)


def active_matmul_params(config: ModelConfig) -> int:
    """N_active: parameters one token multiplies, i.e. the active ones without the input embedding."""
    return param_count(config, active=True) - config.vocab_size * config.hidden_size


def step_flops(config: ModelConfig, batch: int, seq: int) -> float:
    """tokens · (6 · N_active + 12 · L · H · d_head · T)."""
    attention = 12 * config.num_layers * config.num_heads * config.head_dim * seq
    return batch * seq * (6 * active_matmul_params(config) + attention)


def median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak_flops(n: int, repeats: int) -> float:
    """FLOP/s of a square float32 `jnp.dot` (2n³ FLOPs)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    return 2 * n**3 / median_seconds(jax.jit(jnp.dot), a, b, repeats=repeats)


def train_step(graphdef):
    """(state, input_ids) -> (loss, grads): next-token cross-entropy + router aux loss of a Policy."""

    def loss(state, input_ids):
        model = nnx.merge(graphdef, state)
        logits, _, aux_loss = model.forward(input_ids)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(logp, input_ids[:, 1:, None], axis=-1)[..., 0]
        return jnp.mean(nll) + model.config.router_aux_loss_coef * aux_loss

    return jax.jit(jax.value_and_grad(loss))


def throughput_rows(models: dict[str, ModelConfig], shapes, peak: float, repeats: int) -> list[list[str]]:
    rows = []
    for name, config in models.items():
        graphdef, state = nnx.split(Policy(config, rngs=nnx.Rngs(0)))
        step = train_step(graphdef)
        for batch, seq in shapes:
            input_ids = jax.random.randint(jax.random.key(2), (batch, seq), 0, config.vocab_size)
            seconds = median_seconds(step, state, input_ids, repeats=repeats)
            flops = step_flops(config, batch, seq) / seconds
            rows.append([
                name, f"{batch}×{seq}", f"{active_matmul_params(config) / 1e6:.3f}M",
                f"{seconds * 1e3:.1f}", f"{batch * seq / seconds:,.0f}", f"{flops / 1e9:.1f}", f"{flops / peak:.1%}",
            ])  # fmt: skip
    return rows


def memory_rows(models: dict[str, ModelConfig]) -> list[list[str]]:
    rows = []
    for name, config in models.items():
        params = nnx.state(nnx.eval_shape(lambda config=config: Critic(config, rngs=nnx.Rngs(0))), nnx.Param)
        labels = optim.label_params(params, optim.CRITIC_FROZEN_ATTENTION_TRAINABLE)
        trainable = jax.tree.map(lambda label, p: p if label == optim.TRAINABLE else None, labels, params)
        state_bytes = {
            patterns: optim.tree_bytes(jax.eval_shape(optim.train_only(optim.adamw(1e-5), patterns).init, params))
            for patterns in (optim.ALL_TRAINABLE, optim.CRITIC_FROZEN_ATTENTION_TRAINABLE)
        }
        all_state, frozen_state = state_bytes[optim.ALL_TRAINABLE], state_bytes[optim.CRITIC_FROZEN_ATTENTION_TRAINABLE]
        rows.append([
            name, gib(optim.tree_bytes(params)), gib(optim.tree_bytes(params)), gib(optim.tree_bytes(trainable)),
            gib(all_state), gib(frozen_state), f"{1 - frozen_state / all_state:.1%}",
        ])  # fmt: skip
    return rows


def gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.3f}" if num_bytes >= 2**27 else f"{num_bytes / 2**20:.2f} MiB"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per row (default 10; quick 2)")
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 10)
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES

    moe = bench_moe(args.quick)
    peak = matmul_peak_flops(256 if args.quick else 2048, repeats)
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}); "
          f"float32 jnp.dot peak {peak / 1e9:.1f} GFLOP/s; median of {repeats}\n")  # fmt: skip
    models = {
        "MoE, sorted dispatch": moe.replace(moe_dispatch="sorted"),
        "MoE, dense dispatch": moe.replace(moe_dispatch="dense"),
        "dense, same active": dense_twin(moe),
    }
    header = ["model", "batch×seq", "N_active", "ms/step", "tokens/s", "model GFLOP/s", "of dot peak"]
    print(markdown_table(header, throughput_rows(models, shapes, peak, repeats)))

    print("\nCritic memory, GiB unless marked; gradients of trainable only = frozen-attention step")
    header = ["critic", "params", "grads (all)", "grads (trainable)", "AdamW (all trained)",
              "AdamW (frozen attn)", "AdamW saved"]  # fmt: skip
    sizes = {"bench MoE": moe, "Qwen3-30B-A3B": qwen3_30b_a3b(), "GLM-4.5-Air": glm45_air()}
    print(markdown_table(header, memory_rows(sizes)))


if __name__ == "__main__":
    main()
