"""Sampling throughput: our jitted KV-cache sampler against transformers `generate` (torch, CPU) and
Tunix's native sampler, on identical weights, side by side in one run.

    python benchmarks/sampler.py            # the full shapes (minutes; run it on an idle machine)
    python benchmarks/sampler.py --quick    # a tiny model and short sequences: a smoke test
    python benchmarks/sampler.py --models d256 --batches 32 --repeats 5

For each model a random Qwen3-MoE policy is written with `save_pretrained` and every side loads that
folder (ours with `from_pretrained`, transformers with `AutoModelForCausalLM.from_pretrained`, Tunix
with its Qwen3 `create_model_from_safe_tensors`), so the weights are the same bytes; a full forward
of one prompt is compared first (max |Δ logit|). RoPE θ is Qwen3's 1e6 because Tunix's Qwen3 applies
RoPE with that θ whatever its config says (tunix 0.1.7).
Each run: a batch of random prompts of `--prompt-len` tokens, then `--new-tokens` sampled tokens per
row at temperature 1 with no top-k / top-p and no stop token (so every row decodes the same count).
Times are medians of `--repeats` runs after one warm-up run (compilation excluded); the runs of
every side take turns (`interleaved_medians`), so a drift in the machine's speed reaches all sides.

Columns, tok/s (each side's plain column: batch · new tokens / (prefill + decode) time; `dec`: the
tokens after the prefill over the time after it):
  ours     float32, chunks of `--chunk` tokens (`Sampler.generate`: each chunk attends over the
           cache window its rows need); decode: batch · new tokens / (total − prefill alone)
  hf       `model.generate(do_sample=True, top_k=0, min_new_tokens=max_new_tokens)`, float32,
           torch.no_grad; decode: batch · (new tokens − 1) / (total − the same call for 1 new token)
  tunix    Tunix's `Sampler.__call__` (prefill + decode, one jit each; temperature 1, top_p 1: its
           `jax.random.categorical` path), float32; prompts are given as token ids through a
           pass-through tokenizer; decode as for hf. Blank without the `bench` extra. MoE layers
           run Tunix's CPU fallback, which computes every expert.
  ÷ hf, ÷ tunix          ours ÷ theirs, tok/s (> 1: ours is faster)
  dec ÷ hf, dec ÷ tunix  the same for decode tok/s
"""

import argparse
import statistics
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from sao_jax.cli import set_xla_flags
from sao_jax.models import ModelConfig, Policy, from_pretrained, param_count, save_pretrained
from sao_jax.rollout.sampler import Sampler


def bench_config(hidden_size: int, num_layers: int, vocab_size: int = 1024) -> ModelConfig:
    """Qwen3-MoE, head_dim 64, 8 experts of width 2·hidden (top 2): the active MLP matches a dense
    SwiGLU of width 4·hidden, so d256 has about the active size of a 4.7M-parameter dense Qwen3."""
    return ModelConfig(
        model_type="qwen3_moe", vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=hidden_size // 64, num_kv_heads=max(1, hidden_size // 128), head_dim=64,
        intermediate_size=4 * hidden_size, max_position_embeddings=4096, num_experts=8, num_experts_per_token=2,
        moe_intermediate_size=2 * hidden_size, norm_topk_prob=True, rope_theta=1e6,
        moe_dispatch="blocked",  # exact, and the fastest exact dispatch on XLA:CPU (benchmarks/model.py)
    )  # fmt: skip


MODELS = {
    "d256": bench_config(256, 4),
    # every layer dense (Qwen3-MoE's mlp_only_layers): the 4.7M-parameter dense Qwen3 shape
    "d256-dense": bench_config(256, 4).replace(dense_layers=(0, 1, 2, 3)),
    "d512": bench_config(512, 4),
}
QUICK_MODELS = {"d64": bench_config(64, 2, vocab_size=128)}


def interleaved_medians(runs: dict, repeats: int) -> dict:
    """{name: median seconds of runs[name]()}: one warm-up call each (compiles), then `repeats`
    rounds that call every run in turn, so that a machine slowing down or speeding up during the
    benchmark moves every side's times alike instead of one side's."""
    for run in runs.values():
        run()
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def ours_runs(policy, prompts, new_tokens: int, chunk: int) -> dict:
    """{"total": prefill and decode, "prefill": prefill alone} for our sampler."""
    batch, prompt_len = prompts.shape
    sampler = Sampler(policy, chunk_size=chunk)
    params = nnx.state(policy)
    mask = np.ones_like(prompts, bool)
    budgets = np.full(batch, new_tokens, np.int32)
    no_stop = np.full((batch, 1), -1, np.int32)
    key = jax.random.key(0)

    def prefill():
        state = sampler.init_state(batch, prompt_len + new_tokens)
        state = sampler.prefill(params, state, prompts, mask)
        jax.block_until_ready(state)
        return state

    def total():
        state, generation = sampler.generate(params, prefill(), key, budgets, no_stop)
        assert (generation.lengths == new_tokens).all()

    return {"total": total, "prefill": prefill}


def hf_runs(hf_model, prompts, new_tokens: int) -> dict:
    """{"total": `new_tokens` sampled, "first": 1 sampled (the prefill and one token)} for transformers."""
    import torch

    ids = torch.from_numpy(prompts.astype(np.int64))
    mask = torch.ones_like(ids)

    def run(count):
        with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                                    max_new_tokens=count, min_new_tokens=count, pad_token_id=0)  # fmt: skip
        assert out.shape[1] == prompts.shape[1] + count

    return {"total": lambda: run(new_tokens), "first": lambda: run(1)}


class _TokenIds:
    """A pass-through "tokenizer" for Tunix's sampler: prompts are space-separated token ids."""

    def encode(self, text):
        return [int(token) for token in text.split()]

    def decode(self, ids):
        return " ".join(map(str, ids))

    def bos_id(self):
        return 0  # falsy: Tunix then prepends nothing

    def eos_id(self):
        return -1  # never sampled: every row decodes the full budget

    def pad_id(self):
        return 0  # prompts draw ids from 3 up, so no prompt token is taken for padding


def load_tunix(folder: str, config: ModelConfig):
    """Tunix's Qwen3 (dense, or MoE in every layer) on the weights in `folder`; None without tunix."""
    try:
        from tunix.models.qwen3 import model as qwen3, params as qwen3_params
    except ImportError:
        return None
    dense = not config.num_experts or set(config.dense_layers) == set(range(config.num_layers))
    if not dense and config.dense_layers:
        return None  # Tunix's Qwen3 has no per-layer mix of dense and MoE
    tunix_config = qwen3.ModelConfig(
        num_layers=config.num_layers, vocab_size=config.vocab_size, embed_dim=config.hidden_size,
        hidden_dim=config.intermediate_size if dense else config.moe_intermediate_size,
        num_heads=config.num_heads, head_dim=config.head_dim, num_kv_heads=config.num_kv_heads,
        rope_theta=int(config.rope_theta), norm_eps=config.rms_norm_eps,
        use_tied_embedding=config.tie_word_embeddings, num_experts=None if dense else config.num_experts,
        num_experts_per_tok=None if dense else config.num_experts_per_token,
    )  # fmt: skip
    return qwen3_params.create_model_from_safe_tensors(folder, tunix_config)


def tunix_runs(model, config: ModelConfig, prompts, new_tokens: int) -> dict:
    """{"total": `new_tokens` sampled, "first": 1 sampled} for Tunix's sampler."""
    from tunix.generate import sampler as tunix_sampler

    batch, prompt_len = prompts.shape
    cache = tunix_sampler.CacheConfig(cache_size=prompt_len + new_tokens, num_layers=config.num_layers,
                                      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)  # fmt: skip
    sampler = tunix_sampler.Sampler(model, _TokenIds(), cache)
    texts = [" ".join(map(str, row)) for row in prompts]

    def run(count):
        out = sampler(texts, max_generation_steps=count, max_prompt_length=prompt_len, temperature=1.0,
                      top_p=1.0, eos_tokens=[-1], seed=0, pad_output=True)  # fmt: skip
        assert all(len(tokens) == count for tokens in out.tokens)

    return {"total": lambda: run(new_tokens), "first": lambda: run(1)}


def tunix_logit_gap(policy, tunix_model, prompt) -> float:
    import jax.numpy as jnp

    length = len(prompt)
    ours = np.asarray(policy(prompt[None]))
    causal = jnp.tril(jnp.ones((1, length, length), bool))
    theirs, _ = tunix_model(jnp.asarray(prompt[None]), jnp.arange(length)[None], None, causal)
    return float(np.max(np.abs(ours - np.asarray(theirs))))


def logit_gap(policy, hf_model, prompt) -> float:
    import torch

    ours = np.asarray(policy(prompt[None]))
    with torch.no_grad():
        theirs = hf_model(torch.from_numpy(prompt[None].astype(np.int64))).logits.numpy()
    return float(np.max(np.abs(ours - theirs)))


def main():
    set_xla_flags()  # XLA:CPU's scheduler as `sao-train` sets it, before any JAX call (sao_jax/cli.py)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and sequences: a smoke test")
    parser.add_argument("--models", nargs="*", help=f"subset of {sorted(MODELS)}")
    parser.add_argument("--batches", nargs="*", type=int)
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--chunk", type=int, default=32, help="decode chunk size of our sampler")
    parser.add_argument("--repeats", type=int)
    args = parser.parse_args()
    models = QUICK_MODELS if args.quick else {name: MODELS[name] for name in (args.models or MODELS)}
    batches = args.batches or ([1, 4] if args.quick else [1, 32])
    prompt_len = args.prompt_len or (16 if args.quick else 128)
    new_tokens = args.new_tokens or (16 if args.quick else 128)
    repeats = args.repeats or (2 if args.quick else 5)

    from transformers import AutoModelForCausalLM

    print(f"prompt {prompt_len} + {new_tokens} new tokens, median of {repeats}, JAX {jax.default_backend()}")
    names = ["ours", "ours dec", "hf", "hf dec", "÷ hf", "dec ÷ hf", "tunix", "tunix dec", "÷ tunix", "dec ÷ tunix"]
    header = f"{'model':>10} {'params':>8} {'active':>8} {'batch':>5} " + " ".join(f"{n:>11}" for n in names)
    rows = []
    for name, config in models.items():
        with tempfile.TemporaryDirectory() as folder:
            save_pretrained(Policy(config, rngs=nnx.Rngs(0)), folder)
            policy = from_pretrained(folder, moe_dispatch=config.moe_dispatch)  # the folder does not carry it
            hf_model = AutoModelForCausalLM.from_pretrained(folder).eval()
            tunix_model = load_tunix(folder, config)
        rng = np.random.default_rng(0)
        prompt = rng.integers(3, config.vocab_size, prompt_len).astype(np.int32)
        print(f"{name}: max |ours - transformers| logit on a {prompt_len}-token prompt = "
              f"{logit_gap(policy, hf_model, prompt):.2e}", end="")  # fmt: skip
        print("" if tunix_model is None else f"; ours - tunix = {tunix_logit_gap(policy, tunix_model, prompt):.2e}")
        for batch in batches:
            prompts = rng.integers(3, config.vocab_size, (batch, prompt_len)).astype(np.int32)
            runs = {f"ours {k}": run for k, run in ours_runs(policy, prompts, new_tokens, args.chunk).items()}
            runs.update({f"hf {k}": run for k, run in hf_runs(hf_model, prompts, new_tokens).items()})
            if tunix_model is not None:
                tunix_sides = tunix_runs(tunix_model, config, prompts, new_tokens)
                runs.update({f"tunix {k}": run for k, run in tunix_sides.items()})
            t = interleaved_medians(runs, repeats)
            ours = t["ours total"]
            ours_decode = batch * new_tokens / (ours - t["ours prefill"])
            hf = t["hf total"]
            hf_decode = batch * (new_tokens - 1) / (hf - t["hf first"])  # tokens 2.. (the first came with the prefill)
            produced = batch * new_tokens
            tunix = ""
            if tunix_model is not None:
                tunix_total = t["tunix total"]
                tunix_decode = batch * (new_tokens - 1) / (tunix_total - t["tunix first"])
                tunix = (f"{produced / tunix_total:>11.0f} {tunix_decode:>11.0f} {tunix_total / ours:>11.1f} "
                         f"{ours_decode / tunix_decode:>11.1f}")  # fmt: skip
            total_m, active_m = param_count(config) / 1e6, param_count(config, active=True) / 1e6
            rows.append(f"{name:>10} {total_m:>7.1f}M {active_m:>7.1f}M {batch:>5} {produced / ours:>11.0f} "
                        f"{ours_decode:>11.0f} {produced / hf:>11.0f} {hf_decode:>11.0f} {hf / ours:>11.1f} "
                        f"{ours_decode / hf_decode:>11.1f} {tunix}")  # fmt: skip
            print(rows[-1] if len(rows) > 1 else header + "\n" + rows[-1], flush=True)
    print("\n" + header + "\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
