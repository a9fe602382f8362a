"""The run: SFT warm start → value pretraining → SAO RL, with evaluation, metrics and checkpoints.

The loop is thin: it moves data between the rollout side (agent loop over environments) and the pure
jitted steps (`sao_jax.train.steps`), and does the side effects — logging, checkpoints, plots.

Determinism (train.mode = "sync"): the prompts of RL step s and every PRNG key are functions of
(seed, s), and the agent loop runs in lockstep, so a run resumed from the checkpoint of step s
writes the same metrics as the uninterrupted run.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import logging
import os
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
from sao_jax.advantages import ADVANTAGE_ESTIMATORS, unassigned_reward
from sao_jax.checkpoint import Checkpointer, ResumeError, abstract_state, holds_checkpoints
from sao_jax.config import Config, ConfigError, OptimizerConfig, to_dict
from sao_jax.data.chat import ChatEnv, ChatFormat, HFTokenizer
from sao_jax.data.datasets import DatasetError, read_prompts
from sao_jax.data.tokenizers import CharTokenizer
from sao_jax.envs import Prompt, environment_class
from sao_jax.envs.judges import STYLES
from sao_jax.envs.style_shift import StyleSchedule
from sao_jax.metrics import MetricsWriter, plot_run, read_metrics, truncate_after
from sao_jax.models import sharding
from sao_jax.optim import adamw, learning_rate_schedule, train_only
from sao_jax.outputs import OutputMirror, check_writable, free_name, is_url, join
from sao_jax.rollout.agent_loop import AgentLoop, AgentLoopConfig, RolloutService
from sao_jax.rollout.decode import resolve_decode_backend
from sao_jax.rollout.engine import RolloutEngine, WeightStore
from sao_jax.rollout.sampler import Sampler
from sao_jax.rollout.trajectory import Trajectory, collate
from sao_jax.train import steps as steps_lib
from sao_jax.train.distributed import Cluster, ProcessRollouts
from sao_jax.train.sft import choice_mask, demonstration_trajectory, make_demonstration_probe, make_sft_update

log = logging.getLogger(__name__)

# Stream ids folded into the seed so each consumer of randomness has its own stream.
_SFT, _VALUE_PRETRAIN, _RL, _EVAL, _INIT, _SFT_PROBE = range(6)


@dataclasses.dataclass
class Run:
    """Everything built once per run from the config."""

    config: Config
    tokenizer: CharTokenizer | HFTokenizer
    env_cls: Any
    env_kwargs: dict[str, Any]
    train_prompts: list[Any]
    eval_prompts: list[Any]
    policy: models.Policy
    buckets: tuple[int, ...]
    cluster: Cluster = dataclasses.field(default_factory=Cluster)  # this process's part of the run
    chat_format: ChatFormat | None = None  # a pretrained model's: every episode is spoken in it

    def env_factory(self, prompt):
        env = self.env_cls(**self.env_kwargs)
        return env if self.chat_format is None else ChatEnv(env, self.chat_format)

    def demonstration(self, prompt, *, weak: bool = False) -> list[str]:
        """The gold actions for `prompt` (`weak`: the weaker demonstrator's), in the chat format."""
        actions = (self.env_cls.weak_demonstration if weak else self.env_cls.demonstration)(prompt)
        return actions if self.chat_format is None else self.env_factory(prompt).chat_actions(actions)

    def agent_loop(self, *, greedy: bool) -> AgentLoop | ProcessRollouts:
        r = self.config.rollout
        sampler = Sampler(
            self.policy,
            temperature=r.temperature,
            top_k=1 if greedy else r.top_k,
            top_p=1.0 if greedy else r.top_p,
            chunk_size=r.chunk_size,
            decode_backend=r.decode_backend,
        )
        loop_config = AgentLoopConfig(
            num_slots=r.num_slots,
            max_total_tokens=r.max_total_tokens,
            max_action_tokens=r.max_action_tokens,
            env_timeout_s=r.env_timeout_s,
            add_bos=self.chat_format is None,  # chat templates write their own start tokens
            lockstep=self.config.train.mode == "sync",
        )
        return self.cluster.rollouts(AgentLoop(sampler, self.tokenizer, self.env_factory, loop_config))


def build_run(config: Config) -> Run:
    """The run's pieces. A pretrained model (`model.pretrained`, a Hugging Face folder) brings its
    tokenizer and chat template, and the environment is spoken in that template (`ChatEnv`); a preset
    uses the character tokenizer. Prompts come from `env.train_file` / `env.eval_file` when set."""
    cluster = Cluster.for_config(config)
    env_cls = environment_class(config.env.name)
    env = config.env
    train_prompts = prompt_pool(config, env_cls, env.train_file, env.train_prompts, _RL, key="env.train_file")
    eval_prompts = prompt_pool(config, env_cls, env.eval_file, env.eval_prompts, _EVAL, key="env.eval_file")
    model = config.model
    overrides = {name: value for name, value in
                 (("moe_dispatch", model.moe_dispatch), ("dtype", model.dtype), ("param_dtype", model.param_dtype),
                  ("attention", model.attention))
                 if value is not None} | ({"remat": True} if model.remat else {})  # fmt: skip
    if model.moe_dispatch == "gmm" and jax.default_backend() != "tpu":
        raise ConfigError(f"model.moe_dispatch=gmm is the Pallas megablox kernel, which compiles only on a TPU "
                          f"(this machine's backend is {jax.default_backend()}): choose sorted, capacity or dense")
    if model.attention == "splash" and jax.default_backend() != "tpu":
        overrides["attention_kernel_interpret"] = True  # the Pallas kernel compiles only on a TPU
    try:
        resolve_decode_backend(config.rollout.decode_backend, key="rollout.decode_backend")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if model.pretrained:
        models.read_hf_config(model.pretrained)  # a missing folder or broken config.json: named before anything loads
        tokenizer = HFTokenizer.from_folder(model.pretrained)
        chat_format = ChatFormat.from_tokenizer(tokenizer)
        policy = models.from_pretrained(model.pretrained, mesh=cluster.mesh, **overrides)
        if tokenizer.vocab_size > policy.config.vocab_size:
            raise ValueError(f"model.pretrained={model.pretrained}: the tokenizer has {tokenizer.vocab_size} tokens, "
                             f"more than the model's vocab_size {policy.config.vocab_size}")
    else:
        tokenizer, chat_format = CharTokenizer(), None
        preset = models.PRESETS[model.preset]

        def make_policy():
            return models.Policy(preset(vocab_size=tokenizer.vocab_size, **overrides), rngs=nnx.Rngs(config.seed))

        # On a mesh each device draws only its own shards: no host ever holds the whole model.
        policy = make_policy() if cluster.mesh is None else sharding.sharded_init(make_policy, cluster.mesh)
    length = config.rollout.max_total_tokens
    buckets = tuple(sorted({max(16, length // 2), length}))
    return Run(config, tokenizer, env_cls, env_options(config), train_prompts, eval_prompts, policy, buckets, cluster,
               chat_format)  # fmt: skip


def prompt_pool(config: Config, env_cls, file: str | None, size: int, stream: int, *, key: str) -> list[Prompt]:
    """The prompts of `file` (`read_prompts`; its errors name the config `key`), or `size` that the
    environment generates with the rng (seed, stream). Each prompt's id becomes its index in the pool:
    per-prompt baselines key on it."""
    if file is not None:
        try:
            prompts = read_prompts(file)
        except DatasetError as e:
            raise DatasetError(f"{e} ({key})") from None
    else:
        difficulty = list(config.env.difficulty) or None
        prompts = env_cls.generate_prompts(np.random.default_rng([config.seed, stream]), size, difficulty)
    return [dataclasses.replace(p, id=i) for i, p in enumerate(prompts)]


def env_options(config: Config) -> dict[str, Any]:
    """The environment constructor's keyword arguments from `env.options`. style_shift's `switches`
    ([[step, style], ...]) become the one `StyleSchedule` every episode shares (the loop moves it)."""
    options = dict(config.env.options)
    if config.env.name == "style_shift" and "switches" in options:
        options["schedule"] = StyleSchedule(tuple(map(tuple, options.pop("switches"))))
    return options


def policy_weights(state: steps_lib.TrainState, graphs: steps_lib.Graphs):
    """The sampler's view of the policy: its full NNX state (params and buffers)."""
    return nnx.state(nnx.merge(graphs.policy, state.policy_params, state.policy_buffers))


def rollout_metrics(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    rewards = np.array([t.outcome_reward for t in trajectories])
    return {
        f"{prefix}/trajectories": len(trajectories),
        f"{prefix}/reward_mean": float(rewards.mean()) if len(rewards) else 0.0,
        f"{prefix}/success_rate": float((rewards >= 1.0).mean()) if len(rewards) else 0.0,
        f"{prefix}/num_turns": float(np.mean([t.info.get("num_turns", 0) for t in trajectories])),
        f"{prefix}/action_tokens": float(np.mean([t.action_mask.sum() for t in trajectories])),
        f"{prefix}/env_errors": float(sum(t.info.get("error") is not None for t in trajectories)),
        f"{prefix}/truncated": float(sum(t.info.get("truncated") is not None for t in trajectories)),
    }


def tool_metrics(trajectories: list[Trajectory], prefix: str, env_cls) -> dict[str, float]:
    """Share of the answered trajectories that called each of the environment's tools (environments
    with `tool_names`, whose answers report the `tools` called)."""
    if not hasattr(env_cls, "tool_names"):
        return {}
    called = [t.info.get("env_info", {}).get("tools") for t in trajectories]
    called = [tools for tools in called if tools is not None]
    return {f"{prefix}/tool_share/{name}": sum(name in tools for tools in called) / max(len(called), 1)
            for name in env_cls.tool_names()}  # fmt: skip


def style_metrics(trajectories: list[Trajectory], schedule) -> dict[str, Any]:
    """Online experiment (style_shift): the rewarded style and each style's share of the trajectories."""
    if schedule is None:
        return {}
    styles = [t.info.get("env_info", {}).get("style") for t in trajectories]
    shares = {f"train/style_share/{s}": styles.count(s) / max(len(styles), 1) for s in STYLES}
    return {"train/target_style": schedule.current_style, **shares}


def evaluate(run: Run, eval_loop: AgentLoop, weights) -> dict[str, float]:
    """Held-out success (outcome reward ≥ 1) with a fixed evaluation key: greedy decoding when
    `env.eval_greedy`, else the rollout sampling settings (temperature 1 by default)."""
    trajectories = eval_loop.rollout((weights, 0), run.eval_prompts, jax.random.key(0))
    return rollout_metrics(trajectories, "eval") | tool_metrics(trajectories, "eval", run.env_cls)


def usable(trajectories: list[Trajectory]) -> tuple[list[Trajectory], int]:
    """Trajectories whose reward is the task's verdict; env failures are dropped (and counted)."""
    kept = [t for t in trajectories if t.info.get("error") is None]
    return kept, len(trajectories) - len(kept)


def sft_cache_key(config: Config) -> str:
    """Hash of every setting the warm start depends on (not `sft.cache_dir` itself)."""
    parts = {name: to_dict(getattr(config, name)) for name in ("model", "env", "sft", "rollout", "mesh")}
    parts["sft"].pop("cache_dir")
    parts["seed"] = config.seed
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_sft(run: Run, writer: MetricsWriter) -> Any:
    """Fit the policy to demonstrations; returns the policy's trained params. With `sft.cache_dir`, a
    warm start already trained under the same settings is loaded instead (its metric lines replayed),
    and a new one is stored there."""
    sft_cfg = run.config.sft
    graph, params, buffers = steps_lib.split_model(run.policy)
    if sft_cfg.steps == 0:
        return params
    cached = Path(sft_cfg.cache_dir) / f"sft_{sft_cache_key(run.config)}.npz" if sft_cfg.cache_dir else None
    if cached is not None and cached.exists():
        with np.load(cached, allow_pickle=False) as stored:
            leaves, treedef = jax.tree.flatten(params)
            params = jax.tree.unflatten(treedef, [jnp.asarray(stored[f"leaf_{i}"], leaf.dtype)
                                                  for i, leaf in enumerate(leaves)])  # fmt: skip
            for line in json.loads(str(stored["metrics"])):
                writer.write(0, line)
        log.info("warm start loaded from %s", cached)
        return run.cluster.place(params)
    lines: list[dict[str, Any]] = []
    params = _train_sft(run, graph, params, buffers, writer, lines)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(".partial.npz")  # a crash mid-write leaves no half-written cache entry
        leaves = {f"leaf_{i}": np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(params))}
        np.savez(partial, metrics=json.dumps(lines), **leaves)
        os.replace(partial, cached)
    return params


def _train_sft(run: Run, graph, params, buffers, writer: MetricsWriter, lines: list) -> Any:
    """The SFT steps themselves, until the probe reaches its target or `sft.steps` (`SFTConfig`); each
    metric line written is also appended to `lines`."""
    sft_cfg = run.config.sft
    if sft_cfg.weak_demonstration_fraction and not hasattr(run.env_cls, "weak_demonstration"):
        raise ValueError(f"sft.weak_demonstration_fraction: environment {run.config.env.name!r} has no weak "
                         "demonstrator (set it to 0)")
    tx = optimizer(sft_cfg.optimizer)
    update = run.cluster.step(make_sft_update(graph, buffers, tx))
    params = run.cluster.place(params)
    opt_state = run.cluster.place(tx.init(params))
    rng = np.random.default_rng([run.config.seed, _SFT])
    probe = None  # built at the first check: runs too short to reach one never pay for it

    # Every batch holds the same number of weak demonstrations (at random rows): the tool choice the
    # policy learns then does not drift with the batches' own mix, which a constant rate would follow.
    num_weak = round(sft_cfg.weak_demonstration_fraction * sft_cfg.batch_size)

    with tqdm(range(sft_cfg.steps), desc="sft", leave=False) as bar:
        for i in bar:
            prompts = [run.train_prompts[j] for j in rng.integers(0, len(run.train_prompts), sft_cfg.batch_size)]
            weak = np.isin(np.arange(sft_cfg.batch_size), rng.choice(sft_cfg.batch_size, num_weak, replace=False))
            demos = [demonstration_trajectory(run.env_factory(p), p, run.demonstration(p, weak=bool(w)), run.tokenizer,
                                              add_bos=run.chat_format is None) for p, w in zip(prompts, weak)]  # fmt: skip
            batch = collate(demos, batch_size=sft_cfg.batch_size, buckets=run.buckets)
            params, opt_state, metrics = update(params, opt_state, batch)
            line = {"stage": "sft", "sft/step": i, **jax.tree.map(float, jax.device_get(metrics))}
            checked = sft_cfg.target_demonstration_probability > 0 and (i + 1) % sft_cfg.check_every == 0
            if checked:
                probe = probe or demonstration_probe(run, graph, buffers)
                line["sft/demonstration_probability"] = float(probe(params))
            reached = checked and line["sft/demonstration_probability"] >= sft_cfg.target_demonstration_probability
            last = i == sft_cfg.steps - 1
            if i % 25 == 0 or checked or reached or last:
                lines.append(line | ({"sft/stopped_at_target": int(reached)} if reached or last else {}))
                writer.write(0, lines[-1])
                bar.set_postfix(nll=f"{line['sft/nll']:.3f}", acc=f"{line['sft/token_accuracy']:.3f}",
                                **({"p_demo": f"{line['sft/demonstration_probability']:.2f}"} if checked else {}))
            if reached:
                break
    if not reached and sft_cfg.target_demonstration_probability > 0:
        log.warning("sft: the warm start did not reach sft.target_demonstration_probability=%s within sft.steps=%d",
                    sft_cfg.target_demonstration_probability, sft_cfg.steps)
    return params


def demonstration_probe(run: Run, graph, buffers):
    """`params -> mean demonstration_probability` on `sft.probe_prompts` held-out gold demonstrations
    (prompts of their own stream, or the first of `env.eval_file`); the token where the weaker
    demonstrator would branch off is the free choice left out (`sft.choice_mask`)."""
    config = run.config
    prompts = prompt_pool(config, run.env_cls, config.env.eval_file, config.sft.probe_prompts, _SFT_PROBE,
                         key="env.eval_file")
    prompts = prompts[: config.sft.probe_prompts]
    add_bos = run.chat_format is None
    gold, free = [], []
    for p in prompts:
        demo = demonstration_trajectory(run.env_factory(p), p, run.demonstration(p), run.tokenizer, add_bos=add_bos)
        weak = (demonstration_trajectory(run.env_factory(p), p, run.demonstration(p, weak=True), run.tokenizer,
                                         add_bos=add_bos) if config.sft.weak_demonstration_fraction else None)  # fmt: skip
        gold.append(demo)
        free.append(choice_mask(demo, weak))
    batch = collate(gold, buckets=run.buckets)
    free_mask = np.zeros(batch.tokens.shape, bool)
    for row, mask in enumerate(free):
        free_mask[row, : len(mask)] = mask
    return run.cluster.step(make_demonstration_probe(graph, buffers, batch, free_mask))


def run_value_pretraining(run: Run, state, graphs, rollout_loop: AgentLoop, critic_tx, writer: MetricsWriter):
    """Regress the critic on Monte-Carlo returns (λ = 1) of the initial policy's rollouts; returns the
    state with the pretrained critic and a fresh RL critic optimizer state (`critic_tx`). `state` is
    consumed (its buffers are donated)."""
    config = run.config
    critic_cfg = config.critic
    critic_free = ADVANTAGE_ESTIMATORS[config.advantage.estimator].gae is None
    if critic_cfg.pretrain_rollouts == 0 or critic_free:  # critic-free baselines never read the critic
        return run.cluster.place(state.replace(critic_opt_state=critic_tx.init(state.critic_params)))
    weights = policy_weights(state, graphs)
    rng = np.random.default_rng([config.seed, _VALUE_PRETRAIN])
    prompts = [run.train_prompts[j] for j in rng.integers(0, len(run.train_prompts), critic_cfg.pretrain_rollouts)]
    corpus, failed = usable(rollout_loop.rollout((weights, 0), prompts, jax.random.key(config.seed + 1)))
    tx, value_update = value_pretraining_update(graphs, config)
    value_update = run.cluster.step(value_update)
    pretrain_state = run.cluster.place(state.replace(critic_opt_state=tx.init(state.critic_params)))
    batch_size = config.train.batch_size
    for epoch in tqdm(range(critic_cfg.pretrain_epochs), desc="value pretraining", leave=False):
        order = rng.permutation(len(corpus))
        epoch_metrics = []
        for start in range(0, len(order) - batch_size + 1, batch_size):
            batch = collate([corpus[i] for i in order[start:start + batch_size]], batch_size=batch_size, buckets=run.buckets)
            pretrain_state, metrics = value_update(pretrain_state, batch, jax.random.key(epoch))
            epoch_metrics.append(jax.device_get(metrics))
        mean = {k: float(np.mean([m[k] for m in epoch_metrics])) for k in epoch_metrics[0]}
        writer.write(0, {"stage": "value_pretrain", "value_pretrain/epoch": epoch, "value_pretrain/corpus": len(corpus),
                         "value_pretrain/failed_rollouts": failed, **mean})  # fmt: skip
    return run.cluster.place(pretrain_state.replace(critic_opt_state=critic_tx.init(pretrain_state.critic_params)))


def value_pretraining_update(graphs: steps_lib.Graphs, config: Config):
    """(optimizer, jitted value update) of value pretraining: `critic.pretrain_lr`, on the leaves of
    `critic.pretrain_trainable_patterns` (None: `critic.trainable_patterns`, as in RL)."""
    critic_cfg = config.critic
    trainable = (critic_cfg.trainable_patterns if critic_cfg.pretrain_trainable_patterns is None
                 else critic_cfg.pretrain_trainable_patterns)
    tx = steps_lib.guard_nonfinite(train_only(adamw(critic_cfg.pretrain_lr), trainable))
    update = steps_lib.make_value_update(graphs, tx, config, trainable)
    return tx, jax.jit(steps_lib.sequence(update), donate_argnums=0)


def optimizer(opt_cfg: OptimizerConfig):
    """AdamW of an `optimizer` section: its learning rate warmed up linearly over `warmup_steps` updates."""
    lr = learning_rate_schedule(opt_cfg.lr, warmup_steps=opt_cfg.warmup_steps)
    return adamw(lr, max_grad_norm=opt_cfg.max_grad_norm, weight_decay=opt_cfg.weight_decay)


def make_optimizers(config: Config):
    """(policy, critic) optimizers of RL (`optimizer`; the critic makes K updates a step), the critic's
    on `critic.trainable_patterns` only."""
    policy_tx = steps_lib.guard_nonfinite(optimizer(config.policy.optimizer))
    critic_tx = steps_lib.guard_nonfinite(train_only(optimizer(config.critic.optimizer), config.critic.trainable_patterns))
    return policy_tx, critic_tx


def train(config: Config, *, resume: bool = False, allow_config_change: bool = False) -> dict[str, Any]:
    """Run the whole job; returns the final summary (also written to OUTDIR/summary.json). Run as
    several processes, each process does its part (`sao_jax.train.distributed`).

    `resume`: continue from the newest readable checkpoint, or start from the beginning when there is
    none (keeping a previous attempt's metrics.jsonl and tensorboard/ aside as `*.previous*`). Without
    it, a folder that already holds a run is a `ResumeError`, as is a checkpoint saved under another
    config (`checkpoint.config_changes`) unless `allow_config_change`."""
    check_writable(config.output_dir, "output_dir")
    if config.train.checkpoint_dir is not None:
        check_writable(config.train.checkpoint_dir, "train.checkpoint_dir")
    # A URL output_dir is written through a local mirror, pushed after each checkpoint (sao_jax.outputs).
    mirror = OutputMirror.fresh(config.output_dir, jax.process_index()) if is_url(config.output_dir) else None
    out = Path(config.output_dir) if mirror is None else mirror.local
    primary = jax.process_index() == 0
    # Process p > 0 writes its lines apart: they must equal process 0's.
    metrics_dir = out if primary else out / f"process_{jax.process_index()}"
    metrics_file = metrics_dir / "metrics.jsonl"
    if mirror is not None:  # this machine's mirror may be new (a recreated slice): fetch the run's files so far
        for path in (metrics_file, out / "config.yaml"):
            mirror.pull(path)
    if not resume and (holds_checkpoints(checkpoint_dir(config)) or metrics_file.exists()):
        raise ResumeError(f"{config.output_dir} already holds a run (metrics.jsonl or checkpoints); continue it "
                          "with --resume, or choose another output_dir")  # fmt: skip
    run = build_run(config)  # a mistake in the config's files is reported before anything is written
    out.mkdir(parents=True, exist_ok=True)
    checkpointer = Checkpointer(checkpoint_dir(config), config=to_dict(config), keep=config.train.keep_checkpoints,
                                after_save=None if mirror is None else mirror.push)  # fmt: skip
    cluster = run.cluster
    policy_tx, critic_tx = make_optimizers(config)

    critic = models.Critic.from_policy(run.policy, rngs=nnx.Rngs(config.seed + _INIT))
    state, graphs = steps_lib.make_train_state(
        run.policy, critic, policy_tx, critic_tx, config, num_prompts=len(run.train_prompts)
    )
    state = cluster.place(state)
    steps = steps_lib.Steps(*map(cluster.step, steps_lib.build_steps(graphs, policy_tx, critic_tx, config)))
    rollout_loop, eval_loop = run.agent_loop(greedy=False), run.agent_loop(greedy=config.env.eval_greedy)

    restored = (checkpointer.restore_latest(abstract_state(state), allow_config_change=allow_config_change)
                if resume else None)  # fmt: skip
    if restored is not None:
        checkpointer.set_aside(restored.unreadable)
        start_step, state, host = restored.step, restored.state, restored.host
        truncate_after(metrics_file, start_step)
        log.info("resumed from step %d of %s", start_step, checkpointer.directory)
    else:
        if resume:
            log.info("no checkpoint in %s, starting from the beginning", checkpointer.directory)
            for previous in (metrics_file, metrics_dir / "tensorboard"):
                if previous.exists():
                    previous.rename(free_name(previous, "previous"))
        start_step, host = 0, {}
    if primary:
        record_config(out, config, start_step)

    wandb_project = config.train.wandb_project if config.train.wandb and cluster.is_primary else None
    purge_step = None if restored is None else start_step + 1  # TensorBoard drops the killed run's later events
    with MetricsWriter(metrics_dir, tensorboard=cluster.is_primary, wandb_project=wandb_project,
                       config=to_dict(config), purge_step=purge_step) as writer:  # fmt: skip
        if restored is None:
            state = cluster.place(steps_lib.freeze_reference(state.replace(policy_params=run_sft(run, writer))))
            # The critic starts from the warm-started policy (SAO initialises V from the policy).
            sft_policy = nnx.merge(graphs.policy, state.policy_params, state.policy_buffers)
            critic = models.Critic.from_policy(sft_policy, rngs=nnx.Rngs(config.seed + _INIT))
            state = cluster.place(state.replace(critic_params=steps_lib.split_model(critic)[1]))
            state = run_value_pretraining(run, state, graphs, rollout_loop, critic_tx, writer)
            writer.write(0, evaluate(run, eval_loop, policy_weights(state, graphs)))
            writer.flush()
            checkpointer.save(0, state, {"step": 0})
        summary = rl_loop(run, state, graphs, steps, rollout_loop, eval_loop, writer, checkpointer, start_step, host)
    checkpointer.close()
    if cluster.is_primary:
        plot_run(out)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if mirror is not None:
        mirror.push()
    return summary


def record_config(out: Path, config: Config, start_step: int) -> None:
    """Keep the config on record without overwriting one: `config.yaml` holds the first start's, and a
    later start (a resume) under a config that differs from it adds `config.resume-<step>.yaml`."""
    text = yaml.safe_dump(to_dict(config), sort_keys=False)
    path = out / "config.yaml"
    if path.exists() and path.read_text() != text:
        path = free_name(path, f"resume-{start_step}")
    if not path.exists():
        path.write_text(text)


class LockstepBatches:
    """Sync mode: RL step s draws `batch_size / G` prompts with rng (seed, s) from the pool and rolls
    each out G = `advantage.group_size` times (members adjacent, each with its own key), in lockstep
    (no thread timing in the result), with the current weights. A group with an environment failure
    is dropped whole (a group baseline needs every member), as the async engine does."""

    def __init__(self, run: Run, rollout_loop: AgentLoop):
        self.run, self.rollout_loop = run, rollout_loop

    def next(self, step: int, weights) -> tuple[list[Trajectory], dict[str, float]]:
        config = self.run.config
        group = config.advantage.group_size
        rng = np.random.default_rng([config.seed, _RL, step])
        pool = self.run.train_prompts
        prompts = [pool[j] for j in rng.integers(0, len(pool), config.train.batch_size // group) for _ in range(group)]
        key = jax.random.fold_in(jax.random.key(config.seed), step)  # the i-th rollout samples with fold_in(key, i)
        trajectories = self.rollout_loop.rollout((weights, step - 1), prompts, key)
        groups = [trajectories[i:i + group] for i in range(0, len(trajectories), group)]
        failed = [group - len(usable(members)[0]) for members in groups]
        kept = [t for members, f in zip(groups, failed) if not f for t in members]
        discarded = sum(group - f for f in failed if f)  # the survivors of groups that lost a member
        return kept, {"train/env_failed": sum(failed), "train/group_members_discarded": discarded}

    def host_state(self) -> dict[str, Any]:
        """Nothing: the prompts of step s are a function of (seed, s)."""
        return {}

    def close(self) -> None:
        pass


class StreamingBatches:
    """Async mode: the rollout engine streams rollouts as they finish — single ones (SAO), or whole
    groups of G = `advantage.group_size` (members adjacent; a group with a failed or too-stale member
    is dropped whole); weights are published after every step and picked up by running rollouts
    between decode chunks.

    With P processes each runs its own engine on its own devices, with a local replica of the
    weights (`Cluster.local_replica`), over its own prompt stream (its i-th prompt is draw i·P + p
    of the pool), and contributes `batch_size / P` trajectories a step; the blocks are exchanged in
    process order, so every process trains on the same batch, and the engines' counters are summed
    (the trainer's idle fraction averaged), so every process logs the same metrics. Only the trainer thread talks to
    the other processes, once a step; the engines' threads run local computations only.

    Resume: `host_state()` holds each process's stream position after the last batch (every prompt
    it trained on has a smaller index), and an engine built with that `host` starts there, so a
    resumed run draws the prompts the interrupted one had not trained on yet, from where it was, with
    the same keys (a prompt index's key depends on the seed and the index only). Prompts in flight
    when the checkpoint was saved are not replayed.
    """

    def __init__(self, run: Run, rollout_loop: AgentLoop | ProcessRollouts, weights, start_step: int,
                 host: dict[str, Any]):  # fmt: skip
        config = run.config
        self.run, self.cluster = run, run.cluster
        self.process, self.processes = jax.process_index(), jax.process_count()
        if config.train.batch_size % self.processes:
            raise ValueError(f"train.batch_size={config.train.batch_size} must be a multiple of the {self.processes} "
                             "processes: each contributes the same number of trajectories a step")  # fmt: skip
        key = jax.random.fold_in(jax.random.key(config.seed), _RL)  # the key of prompt index p: fold_in(key, p)
        if self.processes > 1:
            key = jax.random.fold_in(key, self.process)
        positions = host.get("prompt_index", [0] * self.processes)
        if len(positions) != self.processes:
            raise ResumeError(f"the checkpoint holds the prompt streams of {len(positions)} processes; this run has "
                              f"{self.processes}")  # fmt: skip
        self.positions = list(positions)
        self.store = WeightStore(self._local(weights), version=start_step)
        local_loop = rollout_loop.loop if isinstance(rollout_loop, ProcessRollouts) else rollout_loop
        self.service = RolloutService(local_loop)
        start = self.positions[self.process]
        self.engine = RolloutEngine(
            self.service, (run.train_prompts[self.pool_index(i)] for i in itertools.count(start)), self.store, key,
            num_workers=config.rollout.num_slots, queue_capacity=config.train.queue_capacity,
            max_staleness=config.train.max_staleness, group_size=config.advantage.group_size, start_index=start,
        )  # fmt: skip

    def _local(self, weights):
        """The trainer's weights for this process's sampler: a copy (the next step donates the state's
        buffers), gathered whole onto this process's devices when the state lives on a mesh, with the
        weights the forward computes in bfloat16 stored so (`models.compute_dtype_weights`)."""
        weights = models.compute_dtype_weights(weights, self.run.policy.config)
        return _copy(weights) if self.cluster.mesh is None else self.cluster.local_replica(weights)

    def pool_index(self, prompt_index: int) -> int:
        """The pool entry of this process's `prompt_index`-th prompt."""
        config = self.run.config
        draw = prompt_index * self.processes + self.process
        return int(np.random.default_rng([config.seed, _RL, draw]).integers(len(self.run.train_prompts)))

    def next(self, step: int, weights) -> tuple[list[Trajectory], dict[str, float]]:
        if step - 1 > self.store.version:
            self.store.publish(self._local(weights), step - 1)  # the trainer's weights after step − 1
        batch = self.engine.get_batch(self.run.config.train.batch_size // self.processes)
        position = self.engine.state().next_prompt_index  # above every prompt index in the batch
        for trajectory in batch:  # the engine numbers prompts; baselines key on the pool index
            trajectory.prompt_id = self.pool_index(trajectory.prompt_id)
        blocks = self.cluster.all_gather([(batch, self.engine.metrics(), position)])
        self.positions = [position for _, _, position in blocks]
        batch = [trajectory for block, _, _ in blocks for trajectory in block]
        return batch, async_metrics([engine_metrics for _, engine_metrics, _ in blocks])

    def host_state(self) -> dict[str, Any]:
        """Each process's next prompt index after the last batch (the checkpoint's part of the stream)."""
        return {"prompt_index": self.positions}

    def close(self) -> None:
        state = self.engine.close()
        self.service.close()
        lost = len(state.unconsumed_indices) + len(state.in_flight_indices)
        if lost:
            log.info("async engine closed with %d finished-but-unused or in-flight rollouts", lost)


def async_metrics(per_process: list[dict]) -> dict[str, float]:
    """The run's async metrics from each process's `RolloutEngine.metrics()`: counts and rates summed,
    the trainer's idle fraction averaged over processes, the staleness averaged over every trajectory."""

    def total(name):
        return sum(m[name] for m in per_process)

    histogram = collections.Counter()
    for m in per_process:
        histogram.update(m["staleness_histogram"])
    seen = sum(histogram.values())
    return {
        "async/queue_depth": total("queue_depth"),
        "async/trainer_idle_fraction": total("trainer_idle_fraction") / len(per_process),
        "async/trajectories_per_s": total("trajectories_per_s"),
        "async/action_tokens_per_s": total("action_tokens_per_s"),
        "async/dropped_stale": total("trajectories_dropped_stale"),
        "async/staleness_mean": sum(k * v for k, v in histogram.items()) / max(seen, 1),
        "train/env_failed": total("trajectories_failed"),
        "train/group_members_discarded": total("trajectories_discarded"),
    }


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def checkpoint_dir(config: Config) -> str:
    """`train.checkpoint_dir`, else OUTPUT_DIR/checkpoints."""
    return config.train.checkpoint_dir or join(config.output_dir, "checkpoints")


def evaluate_checkpoint(config: Config) -> dict[str, Any]:
    """Held-out evaluation of the newest readable checkpoint under `config.output_dir`."""
    run = build_run(config)
    policy_tx, critic_tx = make_optimizers(config)
    critic = models.Critic.from_policy(run.policy, rngs=nnx.Rngs(config.seed + _INIT))
    state, graphs = steps_lib.make_train_state(
        run.policy, critic, policy_tx, critic_tx, config, num_prompts=len(run.train_prompts)
    )
    with Checkpointer(checkpoint_dir(config), config=to_dict(config)) as checkpointer:
        # Evaluation settings may differ from training's; a model that does not fit the arrays cannot.
        restored = checkpointer.restore_latest(abstract_state(run.cluster.place(state)), allow_config_change=True)
    if restored is None:
        raise ResumeError(f"no checkpoint in {checkpointer.directory}")
    weights = policy_weights(restored.state, graphs)
    return {"step": restored.step, **evaluate(run, run.agent_loop(greedy=config.env.eval_greedy), weights)}


def rl_schedule(config: Config, step: int) -> tuple[bool, bool, bool]:
    """What RL step `step` (1-based) does: (critic-only warmup, evaluate after it, checkpoint after it)."""
    train_cfg = config.train
    last = step == train_cfg.steps
    return (step <= config.critic.warmup_steps, step % train_cfg.eval_every == 0 or last,
            step % train_cfg.checkpoint_every == 0 or last)  # fmt: skip


def rl_loop(run: Run, state, graphs, steps, rollout_loop, eval_loop, writer, checkpointer, start_step: int,
            host: dict[str, Any]):  # fmt: skip
    config = run.config
    train_cfg = config.train
    base_key = jax.random.key(config.seed)
    last_eval = None
    weights = policy_weights(state, graphs)
    source = (StreamingBatches(run, rollout_loop, weights, start_step, host) if train_cfg.mode == "async"
              else LockstepBatches(run, rollout_loop))  # fmt: skip
    reads_reference = ADVANTAGE_ESTIMATORS[config.advantage.estimator].reference
    schedule = run.env_kwargs.get("schedule")  # style_shift's target-style schedule, moved per step

    def gold_tokens(trajectory: Trajectory):
        # (ours) TRACE's gold answer: the final action of the prompt's demonstration, e.g. "A: 42\n",
        # tokenized as SFT tokenizes actions, so the reference scores it in the form it was taught.
        prompt = run.train_prompts[trajectory.prompt_id]
        return run.tokenizer.encode(run.demonstration(prompt)[-1])

    try:
        bar = tqdm(range(start_step + 1, train_cfg.steps + 1), desc="rl", initial=start_step, total=train_cfg.steps)
        for step in bar:
            started = time.perf_counter()
            if schedule is not None:
                schedule.set_step(step)
            kept, source_metrics = source.next(step, policy_weights(state, graphs))
            if not kept:
                writer.write(step, {**source_metrics, "train/skipped_no_data": 1})
                continue
            batch = collate(kept, batch_size=train_cfg.batch_size, buckets=run.buckets)
            steps_lib.check_whole_groups(batch.prompt_id, config.advantage.group_size)
            if reads_reference:
                batch = steps_lib.trace_batch(batch, [gold_tokens(t) for t in kept])
            lost = float(np.abs(unassigned_reward(batch.rewards, batch.action_mask)).sum())
            if lost > 0:
                raise RuntimeError(f"step {step}: reward {lost} sits before the first action token and cannot be credited")
            warmup, evaluates, checkpoints = rl_schedule(config, step)
            update = steps.critic_warmup_step if warmup else steps.ttur_step
            state, metrics = update(state, batch, jax.random.fold_in(base_key, step))
            line = {**rollout_metrics(kept, "train"), **tool_metrics(kept, "train", run.env_cls),
                    **style_metrics(kept, schedule), **source_metrics, **jax.device_get(metrics),
                    "train/critic_warmup": int(warmup),
                    "time/step_s": time.perf_counter() - started}  # fmt: skip
            if evaluates:
                line |= evaluate(run, eval_loop, policy_weights(state, graphs))
                last_eval = line["eval/success_rate"]
            written = writer.write(step, line)
            bar.set_postfix(reward=f"{written['train/reward_mean']:.2f}", success=f"{written['train/success_rate']:.2f}",
                            eval=f"{last_eval:.2f}" if last_eval is not None else "-")  # fmt: skip
            if checkpoints:
                writer.flush()
                checkpointer.save(step, state, {"step": step, **source.host_state()})
    finally:
        source.close()
    checkpointer.wait()
    return run_summary(read_metrics(writer.path), num_eval_prompts=len(run.eval_prompts), steps=train_cfg.steps)


def run_summary(lines: list[dict[str, Any]], *, num_eval_prompts: int, steps: int) -> dict[str, Any]:
    """summary.json from the run's metric lines: the warm start (SFT steps taken, the last probed
    demonstration probability, whether it reached its target), held-out success at the first and last
    evaluation, the gain, and whether the run learned: the gain exceeds twice its standard error,

        learned ⇔ end − start > 2 · sqrt((p₀(1 − p₀) + p₁(1 − p₁)) / n),   n = held-out prompts,

    so a gain that sampling noise of the evaluation alone could make does not count."""
    sft = [line for line in lines if line.get("stage") == "sft"]
    probes = [line["sft/demonstration_probability"] for line in sft if "sft/demonstration_probability" in line]
    warm_start = {
        "sft_steps": int(sft[-1]["sft/step"]) + 1 if sft else 0,
        "demonstration_probability": probes[-1] if probes else None,
        "reached_target": bool(sft[-1].get("sft/stopped_at_target", 0)) if sft else None,
    }
    evals = [line["eval/success_rate"] for line in lines if "eval/success_rate" in line]
    summary: dict[str, Any] = {"warm_start": warm_start, "steps": steps,
                               "eval_success_start": evals[0] if evals else None,
                               "eval_success_end": evals[-1] if evals else None}  # fmt: skip
    if len(evals) >= 2:
        start, end = evals[0], evals[-1]
        standard_error = float(np.sqrt((start * (1 - start) + end * (1 - end)) / num_eval_prompts))
        summary |= {"gain": end - start, "gain_standard_error": standard_error,
                    "learned": bool(end - start > 2 * standard_error)}  # fmt: skip
    return summary


def summary_line(summary: dict[str, Any]) -> str:
    """The run's outcome in one line, for the console."""
    if summary.get("gain") is None:
        return "held-out success: not evaluated twice (no verdict)"
    start, end, gain = (100 * summary[k] for k in ("eval_success_start", "eval_success_end", "gain"))
    verdict = ("learned" if summary["learned"] else
               f"did not learn (the gain is within twice its standard error, {200 * summary['gain_standard_error']:.1f} points)")
    return f"held-out success {start:.1f}% -> {end:.1f}% ({gain:+.1f} points in {summary['steps']} RL steps): {verdict}"
