"""Tunix's PPO learner updates, actor and critic, on a Tunix Qwen3 of a chosen size: the peer row
that `benchmarks/train_step.py` times beside our `ttur_step`.

    python benchmarks/tunix_ppo.py           # tiny demo: build, run and time both updates (seconds)
    python benchmarks/tunix_ppo.py --d512    # the reference model: dense d512, 4 layers, 16 × 256 tokens

What runs (google-tunix 0.1.6). `tunix.rl.ppo.ppo_learner.PPOLearner` cannot be built without an
`RLCluster` (a rollout engine, a tokenizer, meshes), so we go one level down, to the objects the
learner drives once a batch of rollouts has become a `TrainExample`:
  * the trainers: `tunix.rl.trainer.Trainer` (the class `RLCluster` makes its `actor_trainer` and
    `critic_trainer` from), configured as `PPOLearner.__init__` configures them —
    `with_loss_fn(registry.get("policy_loss_fn", "ppo"), has_aux=True)` for the actor and
    `with_loss_fn(ppo_learner.ppo_value_loss_fn, has_aux=True)` for the critic, and a
    `with_gen_model_input_fn` passing the same keyword arguments (ε_low, ε_high, ε_c, entropy
    coefficient, clip range of the value, pad and EOS ids; the values of a default `PPOConfig`);
  * one update = the trainer's own jitted step, `Trainer.jit_train_and_eval_step(cache_nnx_graph=True)`,
    which is what `Trainer.train` calls once per mini-batch: `nnx.value_and_grad` of the loss, the
    gradient's global norm, `nnx.Optimizer.update` (optax AdamW after global-norm clipping at 1).
    Left out: `Trainer.train`'s host-side bookkeeping around that call (metrics buffering,
    checkpoint-manager calls, the progress bar), which is not the update;
  * the losses: `ppo_policy_loss_fn` (clipped ratio surrogate, token mean) runs the actor through
    `tunix.rl.common.compute_per_token_logps`; `ppo_value_loss_fn` (clipped value loss,
    ½ · token mean) runs the critic through `tunix.rl.common.compute_score`;
  * the models: `tunix.models.qwen3.model.Qwen3` (actor) and, for the critic, the same Qwen3 under a
    linear value head on its final hidden state (`Qwen3WithValueHead` below: Tunix ships such a head
    for Gemma only, `GemmaWithScoreHead`, built the same way). Tunix's Qwen3 initialises its MLP
    kernels to zero (it expects checkpoint weights), so their gradients stay zero; the matmuls and
    their FLOPs are the same as with any weights;
  * the inputs: a `ppo_learner.TrainExample` laid out as `PPOLearner._generate_and_compute_advantage`
    lays one out — left-padded prompts, completions ending in EOS then right-padded, old log-probs
    from `common.compute_per_token_logps`, old values from `common.compute_score` shifted to the
    completion, advantages and returns from `ppo_helpers.compute_gae_advantages` on a terminal
    reward. The rewards are whole numbers (0 or 1): Tunix 0.1.x builds the reward array with the
    dtype of the token ids (`jnp.zeros_like(jax_completion_ids)`, ppo_learner.py line 350), so a
    fractional reward would be truncated (tests/test_tunix_ppo_bench.py shows it).

Model FLOPs of one update (forward + backward = 3 × forward; PaLM appendix B), as benchmarks/model.py:
    FLOPs = batch · seq · (6 · N_matmul + 12 · L · H · d_head · seq)
N_matmul: the parameters a token multiplies — attention and MLP projections of every layer, plus the
LM head (d · V, the tied embedding when tied) for the actor, or the value head (d) for the critic,
whose unused logits XLA drops. The input embedding is a gather and the RMSNorm weights are
elementwise: neither counts. With experts, the router and the top-k experts count (active
parameters), though Tunix's `MoELayer` runs every expert on every token.
"""

import argparse
import inspect
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.models.qwen3 import model as qwen3
from tunix.rl import common
from tunix.rl import trainer as rl_trainer
from tunix.rl.ppo import ppo_learner

try:
    from tunix.rl.ppo import ppo_helpers
except ImportError:  # some google-tunix 0.1.7 wheels keep the PPO helpers in algo_core
    from tunix.rl import algo_core as ppo_helpers
from tunix.sft import peft_trainer

PAD_ID = 0
EOS_ID = 1
FIRST_WORD_ID = 2  # sampled tokens are never pad or EOS
ACTOR_UPDATE = "tunix actor update"
CRITIC_UPDATE = "tunix critic update"


def tunix_qwen3_config(
    *,
    d_model: int,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    mlp_dim: int,
    vocab: int,
    num_kv_heads: int | None = None,
    num_experts: int | None = None,
    num_experts_per_token: int = 2,
    tie_embeddings: bool = True,
) -> qwen3.ModelConfig:
    """Tunix's Qwen3 config of these sizes; `mlp_dim` is each expert's width when `num_experts` is set.

    The reference size that `benchmarks/train_step.py` compares at (`D512_SIZES`: dense d512, 4 layers,
    13.6M parameters) is d_model=512, 4 layers, 8 heads × 64 (4 KV heads), mlp_dim=1024, vocab 8192,
    tied embeddings.
    """
    if vocab <= FIRST_WORD_ID:
        raise ValueError(f"vocab must be > {FIRST_WORD_ID} (pad and EOS take ids 0 and 1), got {vocab}")
    if num_experts is not None and not 1 <= num_experts_per_token <= num_experts:
        raise ValueError(
            f"num_experts_per_token must be in [1, num_experts={num_experts}], got {num_experts_per_token}"
        )
    return qwen3.ModelConfig(
        num_layers=num_layers, vocab_size=vocab, embed_dim=d_model, hidden_dim=mlp_dim, num_heads=num_heads,
        head_dim=head_dim, num_kv_heads=num_kv_heads or num_heads, rope_theta=1_000_000, norm_eps=1e-6,
        use_tied_embedding=tie_embeddings, num_experts=num_experts,
        num_experts_per_tok=num_experts_per_token if num_experts is not None else None,
    )  # fmt: skip


class Qwen3WithValueHead(nnx.Module):
    """A Tunix Qwen3 with a linear value head: V[b, t] = h_L[b, t] · w_v, shape [batch, time, 1].

    h_L is the final (RMS-normed) hidden state, which `Qwen3.__call__` sows as an `nnx.Intermediate`
    when `output_hidden_states=True`; the logits it also returns are unused, so XLA drops the LM head.
    Called the way `tunix.rl.common.compute_score` calls a value model.
    """

    def __init__(self, config: qwen3.ModelConfig, *, rngs: nnx.Rngs):
        self.backbone = qwen3.Qwen3(config, rngs=rngs)
        self.value_head = nnx.Linear(config.embed_dim, 1, use_bias=False, rngs=rngs)

    def __call__(self, input_tokens, positions, cache, attention_mask=None, segment_ids=None):
        # later 0.1.7 wheels of `compute_score` may pass segment_ids (packed rows) instead of a mask
        extra = {} if segment_ids is None else {"segment_ids": segment_ids}
        self.backbone(input_tokens, positions, cache, attention_mask, output_hidden_states=True, **extra)
        (final_hidden,) = nnx.pop(self.backbone, nnx.Intermediate)["all_hidden_states"].get_value()
        return self.value_head(final_hidden)


def tunix_param_counts(config: qwen3.ModelConfig) -> dict[str, int]:
    """{"actor": parameters of the Tunix Qwen3, "critic": those of `Qwen3WithValueHead`}, from abstract
    shapes (nothing is allocated)."""

    def count(make_model):
        params = nnx.state(nnx.eval_shape(make_model), nnx.Param)
        return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))

    return {
        "actor": count(lambda: qwen3.Qwen3(config, rngs=nnx.Rngs(0))),
        "critic": count(lambda: Qwen3WithValueHead(config, rngs=nnx.Rngs(0))),
    }


def layer_matmul_params(config: qwen3.ModelConfig) -> int:
    """Parameters one token multiplies in one decoder layer: q, k, v, o and the (active) MLP."""
    d, dh = config.embed_dim, config.head_dim
    attention = d * config.num_heads * dh + 2 * d * config.num_kv_heads * dh + config.num_heads * dh * d
    if config.num_experts is None:
        mlp = 3 * d * config.hidden_dim
    else:
        mlp = d * config.num_experts + config.num_experts_per_tok * 3 * d * config.hidden_dim
    return attention + mlp


def tunix_update_flops(config: qwen3.ModelConfig, *, batch: int, seq: int) -> dict[str, float]:
    """Model FLOPs of one update: batch · seq · (6 · N_matmul + 12 · L · H · d_head · seq), by update."""
    layers = config.num_layers * layer_matmul_params(config)
    attention = 12 * config.num_layers * config.num_heads * config.head_dim * seq
    n_matmul = {ACTOR_UPDATE: layers + config.embed_dim * config.vocab_size, CRITIC_UPDATE: layers + config.embed_dim}
    return {name: float(batch * seq * (6 * n + attention)) for name, n in n_matmul.items()}


def ppo_train_example(
    actor: nnx.Module,
    critic: nnx.Module,
    ppo_config: ppo_learner.PPOConfig,
    *,
    batch: int,
    prompt_len: int,
    completion_len: int,
    vocab: int,
    key: jax.Array,
) -> ppo_learner.TrainExample:
    """A PPO mini-batch as `PPOLearner._generate_and_compute_advantage` would return it.

    Prompts: [batch, prompt_len], left-padded, each row 1…prompt_len real tokens. Completions:
    [batch, completion_len], each row ⌈completion_len/2⌉…completion_len tokens, the last EOS, then
    pad. Reward: 0 or 1 on each row's EOS token (whole numbers; see the module docstring). Old
    log-probs and values come from the models as they are now, so the first update's ratio is 1 and
    its clipped value is the old value.
    """
    prompt_key, prompt_len_key, completion_key, completion_len_key, reward_key = jax.random.split(key, 5)
    prompt_lengths = jax.random.randint(prompt_len_key, (batch, 1), 1, prompt_len + 1)
    prompt_ids = jax.random.randint(prompt_key, (batch, prompt_len), FIRST_WORD_ID, vocab)
    prompt_ids = jnp.where(jnp.arange(prompt_len) >= prompt_len - prompt_lengths, prompt_ids, PAD_ID)
    shortest_completion = (completion_len + 1) // 2
    completion_lengths = jax.random.randint(completion_len_key, (batch, 1), shortest_completion, completion_len + 1)
    position = jnp.arange(completion_len)
    completion_ids = jax.random.randint(completion_key, (batch, completion_len), FIRST_WORD_ID, vocab)
    completion_ids = jnp.where(position == completion_lengths - 1, EOS_ID, completion_ids)
    completion_ids = jnp.where(position < completion_lengths, completion_ids, PAD_ID)
    completion_mask = completion_ids != PAD_ID

    graphdef, state = nnx.split(actor)
    old_logps = common.compute_per_token_logps(graphdef, state, prompt_ids, completion_ids, PAD_ID, EOS_ID)
    # The value model's output at position t values the state before token t+1: shift by one.
    old_values = common.compute_score(critic, prompt_ids, completion_ids, PAD_ID, EOS_ID)
    old_values = old_values[:, -completion_len - 1 : -1] * completion_mask
    scores = jax.random.bernoulli(reward_key, 0.5, (batch, 1)).astype(jnp.float32)
    rewards = jnp.where(position == completion_lengths - 1, scores, 0.0)
    advantages, returns = ppo_helpers.compute_gae_advantages(
        rewards, old_values, completion_mask, gamma=ppo_config.gamma, gae_lambda=ppo_config.gae_lambda
    )
    return ppo_learner.TrainExample(
        prompt_ids=prompt_ids, prompt_mask=(prompt_ids != PAD_ID).astype(jnp.int32), completion_ids=completion_ids,
        completion_mask=completion_mask, advantages=advantages, ref_per_token_logps=None,
        old_per_token_logps=old_logps, returns=returns, old_values=old_values,
    )  # fmt: skip


def ppo_trainers(
    actor: nnx.Module, critic: nnx.Module, ppo_config: ppo_learner.PPOConfig, *, learning_rate: float
) -> dict[str, rl_trainer.Trainer]:
    """{actor update: Trainer, critic update: Trainer}, each with the loss and the loss arguments
    that `PPOLearner.__init__` gives `rl_cluster.actor_trainer` / `rl_cluster.critic_trainer`."""
    training_config = peft_trainer.TrainingConfig(eval_every_n_steps=1, max_steps=None)

    def trainer(model):
        optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(learning_rate))
        return rl_trainer.Trainer(model, optimizer, training_config, custom_checkpoint_metadata_fn=dict)

    policy_loss = ppo_learner.registry.get("policy_loss_fn", ppo_config.policy_loss_fn)
    if "algo_config" in inspect.signature(policy_loss).parameters:  # later 0.1.7 wheels read the config
        clip = {"algo_config": ppo_config}
    else:
        clip = {"epsilon_low": ppo_config.epsilon_low, "epsilon_high": ppo_config.epsilon_high,
                "epsilon_c": ppo_config.epsilon_c, "entropy_coef": ppo_config.entropy_coef}  # fmt: skip
    actor_trainer = trainer(actor).with_loss_fn(policy_loss, has_aux=True)
    actor_trainer.with_gen_model_input_fn(lambda example: {"train_example": example, "pad_id": PAD_ID,
                                                           "eos_id": EOS_ID, **clip})  # fmt: skip
    value_loss = (ppo_learner.registry.get("value_loss_fn", ppo_config.value_loss_fn)
                  if hasattr(ppo_config, "value_loss_fn") else ppo_learner.ppo_value_loss_fn)
    critic_trainer = trainer(critic).with_loss_fn(value_loss, has_aux=True)
    critic_trainer.with_gen_model_input_fn(
        lambda example: {
            "train_example": example, "clip_range_value": ppo_config.clip_range_value, "pad_id": PAD_ID,
            "eos_id": EOS_ID,
        }  # fmt: skip
    )
    return {ACTOR_UPDATE: actor_trainer, CRITIC_UPDATE: critic_trainer}


def make_tunix_setup(
    *, batch: int, seq: int, prompt_len: int | None = None, learning_rate: float = 1e-5, seed: int = 0, **sizes: Any
) -> tuple[dict[str, rl_trainer.Trainer], ppo_learner.TrainExample]:
    """(trainers, train_example): the two Tunix trainers of `ppo_trainers` on fresh models of `sizes`
    (the keyword arguments of `tunix_qwen3_config`), and one mini-batch of `batch` rows of `seq` tokens
    (`prompt_len`, default seq // 4, of prompt, the rest completion). Default `PPOConfig` hyper-parameters."""
    prompt_len = seq // 4 if prompt_len is None else prompt_len
    if not 1 <= prompt_len < seq:
        raise ValueError(f"prompt_len must be in [1, seq={seq}), got {prompt_len}")
    config = tunix_qwen3_config(**sizes)
    ppo_config = ppo_learner.PPOConfig()
    rngs = nnx.Rngs(seed)
    actor = qwen3.Qwen3(config, rngs=rngs)
    critic = Qwen3WithValueHead(config, rngs=rngs)
    example = ppo_train_example(
        actor, critic, ppo_config, batch=batch, prompt_len=prompt_len, completion_len=seq - prompt_len,
        vocab=config.vocab_size,
        key=jax.random.key(seed + 1),
    )  # fmt: skip
    return ppo_trainers(actor, critic, ppo_config, learning_rate=learning_rate), example


def make_tunix_updates(**setup: Any) -> dict[str, Callable[[], Any]]:
    """{"tunix actor update": f, "tunix critic update": g}: each call is one real update of that model
    (forward, backward, AdamW step) by its Tunix trainer's jitted step, on the same mini-batch every
    time, returning (loss, aux, grad_norm) un-synced. The first call compiles. `setup`: the keyword
    arguments of `make_tunix_setup` (the build is deterministic in `seed`). FLOPs per call:
    `tunix_update_flops(tunix_qwen3_config(...), batch=, seq=)`; parameters:
    `tunix_param_counts(tunix_qwen3_config(...))`."""
    trainers, example = make_tunix_setup(**setup)
    calls = {}
    for name, trainer in trainers.items():
        train_step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)
        calls[name] = lambda train_step=train_step: train_step(example)
    return calls


D512_SIZES = dict(d_model=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64, mlp_dim=1024, vocab=8192)
D512_SHAPE = (16, 256)
DEMO_SIZES = dict(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, vocab=256)
DEMO_SHAPE = (4, 64)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d512", action="store_true", help="the reference d512 model and batch (else a tiny demo)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sizes, (batch, seq) = (D512_SIZES, D512_SHAPE) if args.d512 else (DEMO_SIZES, DEMO_SHAPE)
    config = tunix_qwen3_config(**sizes)
    params = tunix_param_counts(config)
    flops = tunix_update_flops(config, batch=batch, seq=seq)
    print(f"Tunix Qwen3 {sizes}, batch {batch} × {seq} tokens, {jax.default_backend()}")
    print(f"parameters: actor {params['actor'] / 1e6:.2f}M, critic {params['critic'] / 1e6:.2f}M")
    calls = make_tunix_updates(batch=batch, seq=seq, **sizes)
    for name, call in calls.items():
        start = time.perf_counter()
        loss, _, grad_norm = jax.block_until_ready(call())
        print(f"{name}: first call (compiles) {time.perf_counter() - start:.1f} s, loss {float(loss):.4f}, "
              f"grad norm {float(grad_norm):.3g}")  # fmt: skip
    load_before = os.getloadavg()[0]
    seconds = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            seconds[name].append(time.perf_counter() - start)
    print(f"median of {args.repeats}, interleaved; 1-min load {load_before:.1f} → {os.getloadavg()[0]:.1f}")
    for name, times in seconds.items():
        median = statistics.median(times)
        rate = flops[name] / median
        print(f"  {name}: {median * 1e3:.1f} ms, {flops[name] / 1e9:.2f} GFLOP, {rate / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
