"""The run: SFT warm start → value pretraining → SAO RL, with evaluation, metrics and checkpoints.

The loop is thin: it moves data between the rollout side (agent loop over environments) and the pure
jitted steps (`sao_jax.train.steps`), and does the side effects — logging, checkpoints, plots.

Determinism (train.mode = "sync"): the prompts of RL step s and every PRNG key are functions of
(seed, s), and the agent loop runs in lockstep, so a run resumed from the checkpoint of step s
writes the same metrics as the uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml
from flax import nnx
from tqdm.auto import tqdm

from sao_jax import models
from sao_jax.advantages import ADVANTAGE_ESTIMATORS, unassigned_reward
from sao_jax.checkpoint import Checkpointer, ResumeError, abstract_state, holds_checkpoints
from sao_jax.config import Config, to_dict
from sao_jax.diagnostics import ROW_METRICS_PREFIX
from sao_jax.metrics import MetricsWriter, plot_run, read_metrics, truncate_after
from sao_jax.outputs import OutputMirror, check_writable, free_name, is_url
from sao_jax.rollout.trajectory import Trajectory, collate
from sao_jax.train import steps as steps_lib
from sao_jax.train.advantage_probe import AdvantageProbe
from sao_jax.train.batches import LockstepBatches, StreamingBatches
from sao_jax.train.build import INIT_STREAM, Run, build_run, checkpoint_dir, make_optimizers, policy_weights
from sao_jax.train.evaluation import (evaluate, quality_metrics, repair_metrics, rollout_metrics, run_summary,
                                     style_advantage_metrics, style_metrics, tool_metrics)
from sao_jax.train.warm_start import run_sft, run_value_pretraining

log = logging.getLogger(__name__)


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

    critic = models.Critic.from_policy(run.policy, rngs=nnx.Rngs(config.seed + INIT_STREAM))
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
            critic = models.Critic.from_policy(sft_policy, rngs=nnx.Rngs(config.seed + INIT_STREAM))
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


def split_row_metrics(metrics: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the scalar metrics, the per-row ones) of a train step's metrics: a key "<model>/rows/<name>"
    (`diagnostics.ROW_METRICS_PREFIX`) holds one value per batch row and goes to the second dict as
    "<model>/<name>"."""
    scalars, rows = {}, {}
    for key, value in metrics.items():
        model, _, rest = key.partition("/")
        if rest.startswith(ROW_METRICS_PREFIX):
            rows[f"{model}/{rest[len(ROW_METRICS_PREFIX):]}"] = value
        else:
            scalars[key] = value
    return scalars, rows


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
    probe = AdvantageProbe(run, graphs) if train_cfg.probe_every else None

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
            metrics, rows = split_row_metrics(jax.device_get(metrics))
            line = {**rollout_metrics(kept, "train"), **tool_metrics(kept, "train", run.env_cls),
                    **repair_metrics(kept, "train", run.env_cls), **quality_metrics(kept, run.train_prompts, "train"),
                    **style_metrics(kept, schedule),
                    **style_advantage_metrics(kept, rows.get("policy/first_action_advantage"), schedule),
                    **source_metrics, **metrics,
                    "train/critic_warmup": int(warmup),
                    "time/step_s": time.perf_counter() - started}  # fmt: skip
            if evaluates:
                line |= evaluate(run, eval_loop, policy_weights(state, graphs))
                last_eval = line["eval/success_rate"]
            if probe is not None and step % train_cfg.probe_every == 0:
                line |= probe(state, policy_weights(state, graphs), step)
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
