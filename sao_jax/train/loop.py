"""The run: SFT warm start → value pretraining → SAO RL, with evaluation, metrics and checkpoints.

The loop is thin: it moves data between the rollout side (agent loop over environments) and the pure
jitted steps (`sao_jax.train.steps`), and does the side effects — logging, checkpoints, plots.

Determinism (train.mode = "sync"): the prompts of RL step s and every PRNG key are functions of
(seed, s), and the agent loop runs in lockstep, so a run resumed from the checkpoint of step s
writes the same metrics as the uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx
from tqdm.auto import tqdm

from sao_jax import models
from sao_jax.advantages import unassigned_reward
from sao_jax.checkpoint import Checkpointer
from sao_jax.config import Config, to_dict
from sao_jax.data.tokenizers import CharTokenizer
from sao_jax.envs import environment_class
from sao_jax.metrics import MetricsWriter, plot_run, read_metrics, truncate_after
from sao_jax.optim import adamw, learning_rate_schedule, train_only
from sao_jax.rollout.agent_loop import AgentLoop, AgentLoopConfig
from sao_jax.rollout.sampler import Sampler
from sao_jax.rollout.trajectory import Trajectory, collate
from sao_jax.train import steps as steps_lib
from sao_jax.train.sft import demonstration_trajectory, make_sft_update

log = logging.getLogger(__name__)

# Stream ids folded into the seed so each consumer of randomness has its own stream.
_SFT, _VALUE_PRETRAIN, _RL, _EVAL, _INIT = range(5)


@dataclasses.dataclass
class Run:
    """Everything built once per run from the config."""

    config: Config
    tokenizer: CharTokenizer
    env_cls: Any
    env_kwargs: dict[str, Any]
    train_prompts: list[Any]
    eval_prompts: list[Any]
    policy: models.Policy
    buckets: tuple[int, ...]

    def env_factory(self, prompt):
        return self.env_cls(**self.env_kwargs)

    def agent_loop(self, *, greedy: bool) -> AgentLoop:
        r = self.config.rollout
        sampler = Sampler(
            self.policy,
            temperature=r.temperature,
            top_k=1 if greedy else r.top_k,
            top_p=1.0 if greedy else r.top_p,
            chunk_size=r.chunk_size,
        )
        loop_config = AgentLoopConfig(
            num_slots=r.num_slots,
            max_total_tokens=r.max_total_tokens,
            max_action_tokens=r.max_action_tokens,
            env_timeout_s=r.env_timeout_s,
            lockstep=self.config.train.mode == "sync",
        )
        return AgentLoop(sampler, self.tokenizer, self.env_factory, loop_config)


def build_run(config: Config) -> Run:
    tokenizer = CharTokenizer()
    env_cls = environment_class(config.env.name)
    difficulty = list(config.env.difficulty) or None
    pool = env_cls.generate_prompts(np.random.default_rng([config.seed, _RL]), config.env.train_prompts, difficulty)
    # Prompt ids become pool indices: per-prompt baselines key on them.
    train_prompts = [dataclasses.replace(p, id=i) for i, p in enumerate(pool)]
    held_out = env_cls.generate_prompts(np.random.default_rng([config.seed, _EVAL]), config.env.eval_prompts, difficulty)
    eval_prompts = [dataclasses.replace(p, id=i) for i, p in enumerate(held_out)]
    if config.model.pretrained:
        policy = models.from_pretrained(config.model.pretrained)
    else:
        preset = getattr(models, config.model.preset)
        policy = models.Policy(preset(vocab_size=tokenizer.vocab_size), rngs=nnx.Rngs(config.seed))
    length = config.rollout.max_total_tokens
    buckets = tuple(sorted({max(16, length // 2), length}))
    return Run(config, tokenizer, env_cls, {}, train_prompts, eval_prompts, policy, buckets)


def policy_weights(state: steps_lib.TrainState, graphs: steps_lib.Graphs):
    """The sampler's view of the policy: its full NNX state (params and buffers)."""
    return nnx.state(nnx.merge(graphs.policy, state.policy_params, state.policy_buffers))


def rollout_metrics(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    rewards = np.array([t.outcome_reward for t in trajectories])
    return {
        f"{prefix}/reward_mean": float(rewards.mean()) if len(rewards) else 0.0,
        f"{prefix}/success_rate": float((rewards >= 1.0).mean()) if len(rewards) else 0.0,
        f"{prefix}/num_turns": float(np.mean([t.info.get("num_turns", 0) for t in trajectories])),
        f"{prefix}/action_tokens": float(np.mean([t.action_mask.sum() for t in trajectories])),
        f"{prefix}/env_errors": float(sum(t.info.get("error") is not None for t in trajectories)),
        f"{prefix}/truncated": float(sum(t.info.get("truncated") is not None for t in trajectories)),
    }


def evaluate(run: Run, eval_loop: AgentLoop, weights) -> dict[str, float]:
    """Held-out success (outcome reward ≥ 1) with a fixed evaluation key: greedy decoding when
    `env.eval_greedy`, else the rollout sampling settings (temperature 1 by default)."""
    trajectories = eval_loop.rollout((weights, 0), run.eval_prompts, jax.random.key(0))
    return rollout_metrics(trajectories, "eval")


def usable(trajectories: list[Trajectory]) -> tuple[list[Trajectory], int]:
    """Trajectories whose reward is the task's verdict; env failures are dropped (and counted)."""
    kept = [t for t in trajectories if t.info.get("error") is None]
    return kept, len(trajectories) - len(kept)


def run_sft(run: Run, writer: MetricsWriter) -> Any:
    """Fit the policy to demonstrations; returns the policy's trained params."""
    cfg = run.config.sft
    graph, params, buffers = steps_lib.split_model(run.policy)
    if cfg.steps == 0:
        return params
    tx = adamw(learning_rate_schedule(cfg.optimizer.lr, warmup_steps=cfg.optimizer.warmup_steps,
                                      total_steps=max(cfg.steps, cfg.optimizer.warmup_steps + 1)),
               max_grad_norm=cfg.optimizer.max_grad_norm)  # fmt: skip
    update = make_sft_update(graph, buffers, tx)
    opt_state = tx.init(params)
    rng = np.random.default_rng([run.config.seed, _SFT])

    def demonstrate(prompt):
        if cfg.direct_answer_fraction and rng.random() < cfg.direct_answer_fraction:
            return run.env_cls.direct_demonstration(prompt)
        return run.env_cls.demonstration(prompt)

    with tqdm(range(cfg.steps), desc="sft", leave=False) as bar:
        for i in bar:
            prompts = [run.train_prompts[j] for j in rng.integers(0, len(run.train_prompts), cfg.batch_size)]
            demos = [demonstration_trajectory(run.env_factory(p), p, demonstrate(p), run.tokenizer) for p in prompts]
            batch = collate(demos, batch_size=cfg.batch_size, buckets=run.buckets)
            params, opt_state, metrics = update(params, opt_state, batch)
            if i % 25 == 0 or i == cfg.steps - 1:
                line = writer.write(0, {"stage": "sft", "sft/step": i, **jax.device_get(metrics)})
                bar.set_postfix(nll=f"{line['sft/nll']:.3f}", acc=f"{line['sft/token_accuracy']:.3f}")
    return params


def run_value_pretraining(run: Run, state, graphs, rollout_loop: AgentLoop, critic_tx, writer: MetricsWriter):
    """Regress the critic on Monte-Carlo returns (λ = 1) of the initial policy's rollouts; returns the
    state with the pretrained critic and a fresh RL critic optimizer state (`critic_tx`). `state` is
    consumed (its buffers are donated)."""
    config = run.config
    cfg = config.critic
    if cfg.pretrain_rollouts == 0:
        return state.replace(critic_opt_state=critic_tx.init(state.critic_params))
    weights = policy_weights(state, graphs)
    rng = np.random.default_rng([config.seed, _VALUE_PRETRAIN])
    prompts = [run.train_prompts[j] for j in rng.integers(0, len(run.train_prompts), cfg.pretrain_rollouts)]
    corpus, failed = usable(rollout_loop.rollout((weights, 0), prompts, jax.random.key(config.seed + 1)))
    # All critic parameters train here (ours): the freeze applies to RL, where the paper reports it.
    tx = steps_lib.guard_nonfinite(adamw(cfg.pretrain_lr))
    value_update = jax.jit(steps_lib.sequence(steps_lib.make_value_update(graphs, tx, config)), donate_argnums=0)
    pretrain_state = state.replace(critic_opt_state=tx.init(state.critic_params))
    batch_size = config.train.batch_size
    for epoch in tqdm(range(cfg.pretrain_epochs), desc="value pretraining", leave=False):
        order = rng.permutation(len(corpus))
        epoch_metrics = []
        for start in range(0, len(order) - batch_size + 1, batch_size):
            batch = collate([corpus[i] for i in order[start:start + batch_size]], batch_size=batch_size, buckets=run.buckets)
            pretrain_state, metrics = value_update(pretrain_state, batch, jax.random.key(epoch))
            epoch_metrics.append(jax.device_get(metrics))
        mean = {k: float(np.mean([m[k] for m in epoch_metrics])) for k in epoch_metrics[0]}
        writer.write(0, {"stage": "value_pretrain", "value_pretrain/epoch": epoch, "value_pretrain/corpus": len(corpus),
                         "value_pretrain/failed_rollouts": failed, **mean})  # fmt: skip
    return pretrain_state.replace(critic_opt_state=critic_tx.init(pretrain_state.critic_params))


def make_optimizers(config: Config):
    policy_tx = steps_lib.guard_nonfinite(
        adamw(config.policy.optimizer.lr, max_grad_norm=config.policy.optimizer.max_grad_norm,
              weight_decay=config.policy.optimizer.weight_decay)  # fmt: skip
    )
    critic_tx = steps_lib.guard_nonfinite(
        train_only(
            adamw(config.critic.optimizer.lr, max_grad_norm=config.critic.optimizer.max_grad_norm,
                  weight_decay=config.critic.optimizer.weight_decay),  # fmt: skip
            config.critic.trainable_patterns,
        )
    )
    return policy_tx, critic_tx


def train(config: Config, *, resume: bool = False) -> dict[str, Any]:
    """Run the whole job; returns the final summary (also written to OUTDIR/summary.json)."""
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    run = build_run(config)
    policy_tx, critic_tx = make_optimizers(config)
    checkpointer = Checkpointer(out / "checkpoints", keep=config.train.keep_checkpoints)

    critic = models.Critic.from_policy(run.policy, rngs=nnx.Rngs(config.seed + _INIT))
    state, graphs = steps_lib.make_train_state(
        run.policy, critic, policy_tx, critic_tx, config, num_prompts=len(run.train_prompts)
    )
    steps = steps_lib.build_steps(graphs, policy_tx, critic_tx, config)
    rollout_loop, eval_loop = run.agent_loop(greedy=False), run.agent_loop(greedy=config.env.eval_greedy)

    restored = checkpointer.restore_latest(jax.eval_shape(lambda: state)) if resume else None
    if restored is not None:
        start_step, state, host = restored
        truncate_after(out / "metrics.jsonl", start_step)
        log.info("resumed from step %d", start_step)
    else:
        (out / "metrics.jsonl").unlink(missing_ok=True)
        start_step = 0

    with MetricsWriter(out) as writer:
        if restored is None:
            state = state.replace(policy_params=run_sft(run, writer))
            # The critic starts from the warm-started policy (SAO initialises V from the policy).
            sft_policy = nnx.merge(graphs.policy, state.policy_params, state.policy_buffers)
            critic = models.Critic.from_policy(sft_policy, rngs=nnx.Rngs(config.seed + _INIT))
            state = state.replace(critic_params=steps_lib.split_model(critic)[1])
            state = run_value_pretraining(run, state, graphs, rollout_loop, critic_tx, writer)
            writer.write(0, evaluate(run, eval_loop, policy_weights(state, graphs)))
            checkpointer.save(0, state, {"step": 0})
        summary = rl_loop(run, state, graphs, steps, rollout_loop, eval_loop, writer, checkpointer, start_step)
    checkpointer.close()
    plot_run(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


class LockstepBatches:
    """Sync mode: RL step s rolls out `batch_size` prompts drawn with rng (seed, s) from the pool, in
    lockstep (no thread timing in the result), with the current weights."""

    def __init__(self, run: Run, rollout_loop: AgentLoop):
        self.run, self.rollout_loop = run, rollout_loop

    def next(self, step: int, weights) -> tuple[list[Trajectory], dict[str, float]]:
        config = self.run.config
        rng = np.random.default_rng([config.seed, _RL, step])
        pool = self.run.train_prompts
        prompts = [pool[j] for j in rng.integers(0, len(pool), config.train.batch_size)]
        key = jax.random.fold_in(jax.random.key(config.seed), step)
        trajectories = self.rollout_loop.rollout((weights, step - 1), prompts, key)
        kept, failed = usable(trajectories)
        return kept, {"train/env_failed": failed}

    def close(self) -> None:
        pass


class StreamingBatches:
    """Async mode: the rollout engine streams single rollouts (group size 1) as they finish; weights
    are published after every step and picked up by running rollouts between decode chunks."""

    def __init__(self, run: Run, rollout_loop: AgentLoop, weights, start_step: int):
        from sao_jax.rollout.agent_loop import RolloutService
        from sao_jax.rollout.engine import RolloutEngine, WeightStore

        config = run.config
        self.run = run
        self.store = WeightStore(_copy(weights), version=start_step)
        self.service = RolloutService(rollout_loop)
        self.engine = RolloutEngine(
            self.service, (run.train_prompts[self.pool_index(i)] for i in itertools.count()), self.store,
            jax.random.fold_in(jax.random.key(config.seed), start_step), num_workers=config.rollout.num_slots,
            queue_capacity=config.train.queue_capacity, max_staleness=config.train.max_staleness,
        )  # fmt: skip

    def pool_index(self, prompt_index: int) -> int:
        config = self.run.config
        return int(np.random.default_rng([config.seed, _RL, prompt_index]).integers(len(self.run.train_prompts)))

    def next(self, step: int, weights) -> tuple[list[Trajectory], dict[str, float]]:
        if step - 1 > self.store.version:
            # The trainer's weights after step − 1 (a copy: the next step donates the state's buffers).
            self.store.publish(_copy(weights), step - 1)
        batch = self.engine.get_batch(self.run.config.train.batch_size)
        for trajectory in batch:  # the engine numbers prompts; baselines key on the pool index
            trajectory.prompt_id = self.pool_index(trajectory.prompt_id)
        metrics = self.engine.metrics()
        histogram = metrics["staleness_histogram"]
        seen = sum(histogram.values())
        return batch, {
            "async/queue_depth": metrics["queue_depth"],
            "async/trainer_idle_fraction": metrics["trainer_idle_fraction"],
            "async/trajectories_per_s": metrics["trajectories_per_s"],
            "async/action_tokens_per_s": metrics["action_tokens_per_s"],
            "async/dropped_stale": metrics["trajectories_dropped_stale"],
            "async/staleness_mean": sum(k * v for k, v in histogram.items()) / max(seen, 1),
            "train/env_failed": metrics["trajectories_failed"],
        }

    def close(self) -> None:
        state = self.engine.close()
        self.service.close()
        lost = len(state.unconsumed_indices) + len(state.in_flight_indices)
        if lost:
            log.info("async engine closed with %d finished-but-unused or in-flight rollouts", lost)


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def evaluate_checkpoint(config: Config) -> dict[str, Any]:
    """Held-out evaluation of the newest readable checkpoint under `config.output_dir`."""
    run = build_run(config)
    policy_tx, critic_tx = make_optimizers(config)
    critic = models.Critic.from_policy(run.policy, rngs=nnx.Rngs(config.seed + _INIT))
    state, graphs = steps_lib.make_train_state(
        run.policy, critic, policy_tx, critic_tx, config, num_prompts=len(run.train_prompts)
    )
    with Checkpointer(Path(config.output_dir) / "checkpoints") as checkpointer:
        restored = checkpointer.restore_latest(jax.eval_shape(lambda: state))
    if restored is None:
        raise FileNotFoundError(f"no readable checkpoint under {Path(config.output_dir) / 'checkpoints'}")
    step, state, _ = restored
    return {"step": step, **evaluate(run, run.agent_loop(greedy=config.env.eval_greedy), policy_weights(state, graphs))}


def rl_loop(run: Run, state, graphs, steps, rollout_loop, eval_loop, writer, checkpointer, start_step: int):
    config = run.config
    cfg = config.train
    base_key = jax.random.key(config.seed)
    last_eval = None
    weights = policy_weights(state, graphs)
    source = (StreamingBatches(run, rollout_loop, weights, start_step) if cfg.mode == "async"
              else LockstepBatches(run, rollout_loop))  # fmt: skip
    try:
        bar = tqdm(range(start_step + 1, cfg.steps + 1), desc="rl", initial=start_step, total=cfg.steps)
        for step in bar:
            started = time.perf_counter()
            kept, source_metrics = source.next(step, policy_weights(state, graphs))
            if not kept:
                writer.write(step, {**source_metrics, "train/skipped_no_data": 1})
                continue
            batch = collate(kept, batch_size=cfg.batch_size, buckets=run.buckets)
            lost = float(np.abs(unassigned_reward(batch.rewards, batch.action_mask)).sum())
            if lost > 0:
                raise RuntimeError(f"step {step}: reward {lost} sits before the first action token and cannot be credited")
            warmup = step <= config.critic.warmup_steps
            update = steps.critic_warmup_step if warmup else steps.ttur_step
            state, metrics = update(state, batch, jax.random.fold_in(base_key, step))
            line = {**rollout_metrics(kept, "train"), **source_metrics, **jax.device_get(metrics),
                    "train/critic_warmup": int(warmup), "time/step_s": time.perf_counter() - started}  # fmt: skip
            if step % cfg.eval_every == 0 or step == cfg.steps:
                line |= evaluate(run, eval_loop, policy_weights(state, graphs))
                last_eval = line["eval/success_rate"]
            written = writer.write(step, line)
            bar.set_postfix(reward=f"{written['train/reward_mean']:.2f}", success=f"{written['train/success_rate']:.2f}",
                            eval=f"{last_eval:.2f}" if last_eval is not None else "-")  # fmt: skip
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                checkpointer.save(step, state, {"step": step})
    finally:
        source.close()
    checkpointer.wait()
    evals = [line for line in read_metrics(Path(config.output_dir) / "metrics.jsonl") if "eval/success_rate" in line]
    return {
        "eval_success_start": evals[0]["eval/success_rate"] if evals else None,
        "eval_success_end": evals[-1]["eval/success_rate"] if evals else None,
        "steps": cfg.steps,
    }
