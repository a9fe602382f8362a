"""Forward+backward throughput of the MoE decoder with each dispatch and of a dense decoder with the
same active parameter count; then the memory of parameters, gradients and critic optimizer state with
and without the frozen-attention critic (docs/algorithms.md §7).

    python benchmarks/model.py            # d_model=512, 16×256 and 16×512, then cpu_moe (~20 min, 2 cores)
    python benchmarks/model.py --quick    # one tiny shape, 2 repeats: a smoke test (under a minute)
    python benchmarks/model.py --moe-1b 16x1024 --peak-tflops 989   # the ~1B bf16 preset (remat), the
                                                  # accelerator's dispatches against the dense twin, MFU
    bash benchmarks/accelerator.sh                # that, then the SAO updates at the fastest dispatch

A step is `jax.value_and_grad` of the mean next-token cross-entropy (+ the router aux loss) of a
Policy, jitted, float32 on the default JAX backend, one device. Timing is interleaved: each repeat
calls every variant once (and the `jnp.dot` peak) in turn, so load from other processes hits all
alike; a time is the median over repeats, after a warm-up call, each ended with `block_until_ready`.
The 1-minute load average before and after is printed: on a shared machine, compare ratios, not
absolute rates.

Model FLOPs of a step (PaLM, Chowdhery et al. 2022, appendix B; backward = 2 × forward):
    FLOPs = tokens · (6 · N_active + 12 · L · H · d_head · T)
N_active: the parameters one token multiplies (`param_count(active=True)`: top-k routed experts,
shared experts, router, attention, LM head), minus the input embedding, which is a gather. The second
term is QKᵀ and PV over the whole T×T window, which the model computes (masked) in full.
MFU-style ratio: model FLOP/s over the FLOP/s of a square float32 `jnp.dot` (2n³ FLOPs) timed in the
same interleaved loop. Every MoE row is credited the same model FLOPs, so a dispatch that does more
work shows a lower ratio: "dense" runs every expert on every token (E/k × the expert FLOPs), "sorted"
(`ragged_dot`) lowers on CPU to a masked dense matmul over all experts, "blocked" pads each expert's
tokens to whole blocks (dropless), "capacity" pads each expert to ceil(capacity_factor · tokens · k / E)
slots and drops overflow (the dropped share of assignments, measured on the step's own batch at
initialisation, is in the last column).

The dense model replaces each MoE block by one SwiGLU of width k · moe_intermediate_size: the same
active expert parameters; it lacks only the router (d · E per layer). "× dense" is a row's step time
over the dense model's at the same shape. "XLA FLOPs ÷ model" is the FLOPs XLA's cost analysis
counts in the compiled step over the model FLOPs: the work a dispatch adds (padding, every expert on
every token, recomputation under remat), whatever the timing says ("loop": the program loops, as the
blocked dispatch's scan over blocks does, and the analysis counts a loop body once). On a GPU,
`--moe-1b` adds the sorted dispatch lowered to JAX's Pallas Triton grouped matmul
(`jax_ragged_dot_use_gpu_pallas_triton_lowering`).

Memory (bytes, from abstract shapes: nothing is allocated): parameters; gradients — of all
parameters, or of the trainable ones only when the critic step differentiates just those; AdamW
state (two moments per trained parameter) with every parameter trained vs frozen attention.
"""

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax import optim
from sao_jax.cli import set_xla_flags
from sao_jax.models import Critic, ModelConfig, Policy, cpu_moe, glm45_air, param_count, qwen3_30b_a3b
from sao_jax.models.moe import MoE, capacity_slots, expert_capacity, route

FULL_SHAPES = [(16, 256), (16, 512)]
QUICK_SHAPES = [(2, 32)]
MAIN_JOB_SHAPE = (32, 96)  # cpu_moe's training batch: rollout.num_slots × rollout.max_total_tokens
DISPATCH_ROWS = {
    "MoE, capacity dispatch": "capacity",
    "MoE, blocked dispatch": "blocked",
    "MoE, sorted dispatch": "sorted",
    "MoE, dense dispatch": "dense",
}


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


def moe_1b() -> ModelConfig:
    """~1.0B parameters, ~0.2B active: 16 layers of width 1024, 16 heads × 64 (4 KV heads), 32 experts
    of width 512 with top-4 routing, vocab 32768; bfloat16 weights and compute."""
    return ModelConfig(
        model_type="qwen3_moe", vocab_size=32768, hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=4,
        head_dim=64, intermediate_size=2816, num_experts=32, num_experts_per_token=4, moe_intermediate_size=512,
        router_aux_loss_coef=0.001, max_position_embeddings=8192, dtype="bfloat16", param_dtype="bfloat16",
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


def accelerator_models(big: ModelConfig, backend: str) -> tuple[dict[str, ModelConfig], frozenset]:
    """The `--moe-1b` rows: the accelerator dispatches only (blocked is the CPU's; dense computes every
    expert): capacity, sorted (`ragged_dot`), on a GPU sorted again through JAX's Pallas Triton
    grouped matmul (XLA's own `ragged_dot` may pad every group to the whole batch), on a TPU the
    megablox kernel ("gmm", TPU only), and the dense twin. Returns (rows, the rows lowered with Triton)."""
    models = {"MoE, capacity dispatch": big.replace(moe_dispatch="capacity"),
              "MoE, sorted dispatch": big.replace(moe_dispatch="sorted")}  # fmt: skip
    triton = frozenset()
    if backend == "gpu":
        triton = frozenset({"MoE, sorted dispatch, Triton ragged_dot"})
        models |= dict.fromkeys(triton, big.replace(moe_dispatch="sorted"))
    if backend == "tpu":
        models["MoE, gmm dispatch (megablox)"] = big.replace(moe_dispatch="gmm")
    models["dense, same active"] = dense_twin(big)
    return models, triton


def interleaved_median_seconds(calls: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each zero-argument call; each repeat runs every call once, in turn."""
    for call in calls.values():
        jax.block_until_ready(call())  # compile and warm up
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def matmul_peak(n: int, dtype=jnp.float32, times: int = 8):
    """(call, FLOPs): `times` square `jnp.dot`s of size n (2n³ FLOPs each). Several per call, so one
    slow dispatch beside the big programs it is interleaved with does not set the reference rate."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    dot = jax.jit(jnp.dot)
    return (lambda: [dot(a, b) for _ in range(times)]), times * 2 * n**3


def next_token_loss(model: Policy, input_ids: jax.Array) -> jax.Array:
    """Mean over positions t < T−1 of −log p(x_{t+1} | x_{≤t}) = logsumexp(z_t) − z_t[x_{t+1}], plus
    `router_aux_loss_coef` · aux loss. Targets are the ids shifted left and the last position is
    weighted 0: slicing the [batch, time, vocab] logits instead would copy them (~15% of the step)."""
    logits, _, aux_loss = model.forward(input_ids)
    targets = jnp.roll(input_ids, -1, axis=1)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = jax.nn.logsumexp(logits, axis=-1) - target_logits
    return jnp.mean(nll[:, :-1]) + model.config.router_aux_loss_coef * aux_loss


def train_step(graphdef):
    """(state, input_ids) -> (loss, grads) of `next_token_loss`, jitted."""
    return jax.jit(jax.value_and_grad(lambda state, input_ids: next_token_loss(nnx.merge(graphdef, state), input_ids)))


def dropped_fraction(policy: Policy, input_ids: jax.Array) -> float:
    """Share of the real (token, expert) assignments that the capacity dispatch drops, over all MoE
    layers, for this batch: router logits are captured from one forward and re-routed."""
    config = policy.config
    forward = nnx.capture(lambda model, ids: model(ids), nnx.Intermediate, method_outputs=nnx.Intermediate)
    # capture sees nothing inside a remat layer: route with the same parameters in a graph without remat
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Policy(config.replace(remat=False), rngs=nnx.Rngs(0))))
    state = nnx.state(policy)
    _, captured = jax.jit(lambda state, ids: forward(nnx.merge(graphdef, state), ids))(state, input_ids)
    capacity = expert_capacity(input_ids.size, config.num_experts_per_token, config.num_experts,
                               config.moe_capacity_factor)  # fmt: skip
    kept, total = 0, 0
    for i, layer in enumerate(policy.layers):
        if isinstance(layer.mlp, MoE):
            (router_logits,) = captured["layers"][i]["mlp"]["router"]["__call__"].get_value()
            bias = layer.mlp.router.e_score_correction_bias
            expert_ids, _, _ = route(router_logits, None if bias is None else bias[...], config)
            kept += int(jnp.sum(capacity_slots(expert_ids, config.num_experts, capacity)[1]))
            total += expert_ids.size
    return 1 - kept / total


def compiled_flops(compiled) -> float | None:
    """FLOPs XLA's cost analysis counts in a compiled program (what it will execute); None when the
    program has a loop, whose body the analysis counts once rather than once per iteration."""
    if " while(" in compiled.as_text():
        return None
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def throughput_rows(models: dict[str, ModelConfig], shapes, repeats: int, reference: str,
                    triton_ragged_dot: frozenset = frozenset()) -> list[list[str]]:  # fmt: skip
    """One row per model and shape; the `jnp.dot` peak and `reference` (for "× dense") are timed in
    the same interleaved loop. Rows named in `triton_ragged_dot` are lowered with JAX's Pallas Triton
    `ragged_dot` (GPU only; elsewhere the flag changes nothing)."""
    rows = []
    for batch, seq in shapes:
        calls, flops, xla_flops, dropped = {}, {}, {}, {}
        for name, config in models.items():
            policy = Policy(config, rngs=nnx.Rngs(0))
            graphdef, state = nnx.split(policy)
            input_ids = jax.random.randint(jax.random.key(2), (batch, seq), 0, config.vocab_size)
            triton = name in triton_ragged_dot
            if triton:  # the flag counts at lowering only
                jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", True)
            try:
                step = train_step(graphdef).lower(state, input_ids).compile()
            finally:
                if triton:
                    jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", False)
            calls[name] = lambda step=step, state=state, input_ids=input_ids: step(state, input_ids)
            flops[name] = step_flops(config, batch, seq)
            xla_flops[name] = compiled_flops(step)
            if config.num_experts and config.moe_dispatch == "capacity":
                dropped[name] = f"{dropped_fraction(policy, input_ids):.1%}"
        dtype = next(iter(models.values())).compute_dtype
        on_cpu = jax.default_backend() == "cpu"
        peak_call, peak_flops = matmul_peak(256 if batch * seq <= 256 else 2048 if on_cpu else 8192, dtype)
        calls["jnp.dot"] = peak_call
        load_before = os.getloadavg()[0]
        seconds = interleaved_median_seconds(calls, repeats)
        load_after = os.getloadavg()[0]
        peak = peak_flops / seconds.pop("jnp.dot")
        print(f"{batch}×{seq}: {jnp.dtype(dtype).name} jnp.dot peak {peak / 1e9:.1f} GFLOP/s; "
              f"1-min load {load_before:.1f} → {load_after:.1f}")  # fmt: skip
        for name, config in models.items():
            rate = flops[name] / seconds[name]
            compiled = "loop" if xla_flops[name] is None else f"{xla_flops[name] / flops[name]:.2f}"
            rows.append([
                name, f"{batch}×{seq}", f"{active_matmul_params(config) / 1e6:.3f}M", f"{seconds[name] * 1e3:.1f}",
                f"{batch * seq / seconds[name]:,.0f}", f"{rate / 1e9:.1f}", f"{rate / peak:.1%}",
                f"{seconds[name] / seconds[reference]:.2f}", compiled, dropped.get(name, ""),
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
    set_xla_flags()  # XLA:CPU's scheduler as `sao-train` sets it, before any JAX call (sao_jax/cli.py)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per row (default 5; quick 2)")
    parser.add_argument("--moe-1b", metavar="BATCHxSEQ", help="only the ~1B bf16 preset (with remat) at this "
                        "shape, e.g. 16x1024: the dispatches on an accelerator")  # fmt: skip
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="with --moe-1b: the device's dense peak for an MFU column (bf16: 989 on H100/H200)")
    parser.add_argument("--smoke", action="store_true",
                        help="with --moe-1b: the tiny preset instead of moe_1b (a CPU check of the script)")
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}); median of {repeats}, interleaved\n")
    header = ["model", "batch×seq", "N_active", "ms/step", "tokens/s", "model GFLOP/s", "of dot peak",
              "× dense", "XLA FLOPs ÷ model", "dropped"]  # fmt: skip

    if args.moe_1b:
        big = (bench_moe(quick=True) if args.smoke else moe_1b()).replace(remat=True)
        models, triton = accelerator_models(big, jax.default_backend())
        shape = tuple(int(n) for n in args.moe_1b.split("x"))
        rows = throughput_rows(models, [shape], repeats, "dense, same active", triton)
        if args.peak_tflops:  # model GFLOP/s over the peak
            header.append(f"MFU ({args.peak_tflops:g} TFLOP/s)")
            for row in rows:
                row.append(f"{float(row[5]) / (args.peak_tflops * 1e3):.1%}")
        print(markdown_table(header, rows))
        fastest = min((row for row in rows if row[0] != "dense, same active"), key=lambda row: float(row[3]))
        config = models[fastest[0]]
        print(f"fastest dispatch: {config.moe_dispatch}{' triton' if fastest[0] in triton else ''}")
        return

    moe = bench_moe(args.quick)
    models = {name: moe.replace(moe_dispatch=dispatch) for name, dispatch in DISPATCH_ROWS.items()}
    models["dense, same active"] = dense_twin(moe)
    print(markdown_table(header, throughput_rows(models, shapes, repeats, reference="dense, same active")))

    print("\nThe main job's model (`cpu_moe`) at its training batch")
    small = cpu_moe()
    models = {name: small.replace(moe_dispatch=dispatch) for name, dispatch in DISPATCH_ROWS.items()}
    models["dense, same active"] = dense_twin(small)
    main_shape = [(2, 32)] if args.quick else [MAIN_JOB_SHAPE]
    print(markdown_table(header, throughput_rows(models, main_shape, repeats, reference="dense, same active")))

    print("\nCritic memory, GiB unless marked; gradients of trainable only = frozen-attention step")
    header = ["critic", "params", "grads (all)", "grads (trainable)", "AdamW (all trained)",
              "AdamW (frozen attn)", "AdamW saved"]  # fmt: skip
    sizes = {"bench MoE": moe, "Qwen3-30B-A3B": qwen3_30b_a3b(), "GLM-4.5-Air": glm45_air()}
    print(markdown_table(header, memory_rows(sizes)))


if __name__ == "__main__":
    main()
