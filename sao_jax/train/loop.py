"""The run: SFT warm start → value pretraining → SAO RL, with evaluation, metrics and checkpoints.

The loop is thin: it moves data between the rollout side (agent loop over environments) and the pure
jitted steps (`sao_jax.train.steps`), and does the side effects — logging, checkpoints, plots.

Determinism (train.mode = "sync"): the prompts of RL step s and every PRNG key are functions of
(seed, s), and the agent loop runs in lockstep, so a run resumed from the checkpoint of step s
writes the same metrics as the uninterrupted run.

Faults while it runs (`sao_jax.train.signals`): SIGTERM or SIGINT stops the run after the step in
hand, saved (`Interrupted`); a checkpoint that fails to save stops it at the end of the step during
which the failure became known (`CheckpointSaveError`), with the summary and plots of the steps
trained and every earlier checkpoint kept. Every process of a multi-process run stops after the same
step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml
from flax import nnx
from tqdm.auto import tqdm

from sao_jax.advantages import ADVANTAGE_ESTIMATORS, unassigned_reward
from sao_jax.checkpoint import CheckpointSaveError, Checkpointer, ResumeError, abstract_state, holds_checkpoints
from sao_jax.config import Config, to_dict
from sao_jax.diagnostics import ROW_METRICS_PREFIX
from sao_jax.metrics import MetricsWriter, plot_run, read_metrics, truncate_after
from sao_jax.outputs import FolderLock, OutputMirror, check_writable, free_name, is_url
from sao_jax.rollout.failures import DeadEnvironmentError, FailureTally
from sao_jax.rollout.trajectory import Trajectory, collate
from sao_jax.train import steps as steps_lib
from sao_jax.train.advantage_probe import AdvantageProbe
from sao_jax.train.batches import LockstepBatches, PolicyLagRing, StreamingBatches
from sao_jax.train.build import Run, build_run, checkpoint_dir, make_optimizers, new_critic, policy_weights
from sao_jax.train.evaluation import (evaluate, quality_metrics, repair_metrics, rollout_metrics, run_summary,
                                     style_advantage_metrics, style_metrics, tool_metrics)
from sao_jax.train.signals import Interrupted, StopRequests
from sao_jax.train.warm_start import run_critic_warmup, run_sft, run_value_pretraining

log = logging.getLogger(__name__)


def train(config: Config, *, resume: bool = False, allow_config_change: bool = False) -> dict[str, Any]:
    """Run the whole job; returns the final summary (also written to OUTDIR/summary.json). Run as
    several processes, each process does its part (`sao_jax.train.distributed`).

    `resume`: continue from the newest readable checkpoint, or start from the beginning when there is
    none (keeping a previous attempt's metrics.jsonl and tensorboard/ aside as `*.previous*`). Without
    it, a folder that already holds a run is a `ResumeError`, as is a checkpoint saved under another
    config (`checkpoint.config_changes`) unless `allow_config_change`, or one past `train.steps`.

    One run per folder: the run holds an exclusive lock on output_dir (and train.checkpoint_dir) while
    it works (`outputs.FolderLock`); a second one on the same folder is a `FolderBusyError`.

    An environment that gives nothing usable (`train.max_steps_without_data`,
    `critic.pretrain_min_usable_fraction`) raises `DeadEnvironmentError` once the saves in flight have
    finished and the plots are drawn; no summary.json is written then (the run did not finish).

    SIGTERM or SIGINT (in the main thread) raises `Interrupted` once the step in hand is saved, a save
    that fails `CheckpointSaveError` (module docstring)."""
    check_writable(config.output_dir, "output_dir")
    if config.train.checkpoint_dir is not None:
        check_writable(config.train.checkpoint_dir, "train.checkpoint_dir")
    with run_folder_locks(config), StopRequests(config.train.signal_grace_s) as stops:
        return _train(config, stops, resume=resume, allow_config_change=allow_config_change)


def run_folder_locks(config: Config) -> contextlib.ExitStack:
    """The locks of a run's folders (`outputs.FolderLock`), held until the stack closes: output_dir (a
    URL's local mirror on this machine) and a local train.checkpoint_dir. The processes of one run
    share them: process 0 locks them, process p > 0 its own folder of output_dir (`process_<p>`)."""
    process = jax.process_index()
    stack = contextlib.ExitStack()
    with stack:
        if is_url(config.output_dir):
            mirror = OutputMirror.local_path(config.output_dir, process)
            stack.enter_context(FolderLock(mirror.parent, f"{mirror.name}.lock", key="output_dir",
                                           shown=config.output_dir))  # fmt: skip
        elif process == 0:
            stack.enter_context(FolderLock(config.output_dir, key="output_dir"))
        else:
            stack.enter_context(FolderLock(Path(config.output_dir) / f"process_{process}", key="output_dir"))
        if process == 0 and config.train.checkpoint_dir is not None and not is_url(config.train.checkpoint_dir):
            stack.enter_context(FolderLock(config.train.checkpoint_dir, key="train.checkpoint_dir"))
        return stack.pop_all()


def _train(config: Config, stops: StopRequests, *, resume: bool, allow_config_change: bool) -> dict[str, Any]:
    """`train`, with the run's folders locked and its signals handled by `stops`."""
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

    critic = new_critic(run.policy, config)
    state, graphs = steps_lib.make_train_state(
        run.policy, critic, policy_tx, critic_tx, config, num_prompts=len(run.train_prompts)
    )
    state = cluster.place(state)
    steps = steps_lib.Steps(*map(cluster.step, steps_lib.build_steps(graphs, policy_tx, critic_tx, config)))
    rollout_loop, eval_loop = run.agent_loop(greedy=False), run.agent_loop(greedy=config.env.eval_greedy)

    lag = config.rollout.policy_lag
    # The lag's weight versions: each shaped as the sampler's weights.
    abstract_lagged = [abstract_state(policy_weights(state, graphs))] * lag if lag else None
    restored = (checkpointer.restore_latest(abstract_state(state), allow_config_change=allow_config_change,
                                            abstract_lagged_policy=abstract_lagged) if resume else None)  # fmt: skip
    if restored is not None and restored.step > config.train.steps:
        raise ResumeError(f"the run in {checkpointer.directory} has reached step {restored.step}, past "
                          f"train.steps={config.train.steps}: raise train.steps to train it further, or evaluate it "
                          "with sao-eval")  # fmt: skip
    ring = None
    if restored is not None:
        checkpointer.set_aside(restored.unreadable)
        start_step, state, host = restored.step, restored.state, restored.host
        if lag:
            ring = PolicyLagRing.restored(lag, start_step, restored.lagged_policy, place_weights(cluster))
        truncate_after(metrics_file, start_step)
        log.info("resumed from step %d of %s", start_step, checkpointer.directory)
    else:
        if resume:
            log.info("no checkpoint in %s, starting from the beginning", checkpointer.directory)
            for previous in (metrics_file, metrics_dir / "tensorboard"):
                if previous.exists():
                    previous.rename(free_name(previous, "previous"))
        start_step, host = 0, {}
        ring = PolicyLagRing(lag, place_weights(cluster)) if lag else None
    if primary:
        record_config(out, config, start_step)

    wandb_project = config.train.wandb_project if config.train.wandb and cluster.is_primary else None
    purge_step = None if restored is None else start_step + 1  # TensorBoard drops the killed run's later events
    try:
        with MetricsWriter(metrics_dir, tensorboard=cluster.is_primary, wandb_project=wandb_project,
                           config=to_dict(config), purge_step=purge_step) as writer:  # fmt: skip
            if restored is None:
                params = run_sft(run, writer, stops=stops)
                state = cluster.place(steps_lib.freeze_reference(state.replace(policy_params=params)))
                # The critic starts from the warm-started policy (SAO initialises V from the policy).
                sft_policy = nnx.merge(graphs.policy, state.policy_params, state.policy_buffers)
                critic = new_critic(sft_policy, config)
                state = cluster.place(state.replace(critic_params=steps_lib.split_model(critic)[1]))
                state = run_value_pretraining(run, state, graphs, rollout_loop, critic_tx, writer, stops=stops)
                state = run_critic_warmup(run, state, graphs, steps.critic_warmup_step, rollout_loop, writer,
                                          stops=stops)  # fmt: skip
                writer.write(0, evaluate(run, eval_loop, policy_weights(state, graphs)))
                end_step(0, state, {}, writer, checkpointer, stops, save=True,
                         lagged=lambda: lagged_policy(ring, 0, state, graphs))  # fmt: skip
            try:
                summary = rl_loop(run, state, graphs, steps, rollout_loop, eval_loop, writer, checkpointer,
                                  start_step, host, stops, ring)  # fmt: skip
            except DeadEnvironmentError as error:  # keep what was trained: the saves finish, metrics, plots
                summary, stopped = None, error
            else:
                stopped = None
    except CheckpointSaveError:
        # What was trained stays readable: the summary and plots of the steps written so far (unless
        # output_dir's disk is the full one: the error says so already).
        if cluster.is_primary:
            lines = read_metrics(metrics_file)
            trained = max((line["step"] for line in lines), default=0)
            with contextlib.suppress(OSError):
                write_results(out, run_summary(lines, num_eval_prompts=len(run.eval_prompts), steps=trained,
                                               skipped_prompts=run.skipped_prompts))  # fmt: skip
        raise
    except Interrupted:
        if mirror is not None:
            mirror.push()
        raise
    checkpointer.close()
    if cluster.is_primary:
        write_results(out, summary)
    if mirror is not None:
        mirror.push()
    if stopped is not None:
        raise stopped
    return summary


def write_results(out: Path, summary: dict[str, Any] | None) -> None:
    """`plots/*.png` and `summary.json` in `out` (no summary.json for a run that did not finish: None)."""
    plot_run(out)
    if summary is not None:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))


def record_config(out: Path, config: Config, start_step: int) -> None:
    """Keep the config on record without overwriting one: `config.yaml` holds the first start's, and a
    later start (a resume) under a config that differs from it adds `config.resume-<step>.yaml`."""
    text = yaml.safe_dump(to_dict(config), sort_keys=False)
    path = out / "config.yaml"
    if path.exists() and path.read_text() != text:
        path = free_name(path, f"resume-{start_step}")
    if not path.exists():
        path.write_text(text)


def place_weights(cluster):
    """Where the lag's weight versions go to sample: the run's mesh, as the trainer's weights, or the
    default device."""
    return jax.device_put if cluster.mesh is None else cluster.place


def lagged_policy(ring: PolicyLagRing | None, step: int, state, graphs):
    """The checkpoint's `lagged_policy` item after RL step `step` (None without a lag)."""
    return None if ring is None else ring.saved(step, policy_weights(state, graphs))


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


def rl_schedule(config: Config, step: int) -> tuple[bool, bool]:
    """What RL step `step` (1-based) does after its update: (evaluate, checkpoint)."""
    train_cfg = config.train
    last = step == train_cfg.steps
    return step % train_cfg.eval_every == 0 or last, step % train_cfg.checkpoint_every == 0 or last


def end_step(step: int, state, host: dict[str, Any], writer: MetricsWriter, checkpointer: Checkpointer,
             stops: StopRequests, *, save: bool, lagged: Callable[[], Any] = lambda: None) -> None:
    """After step `step`'s metric line: raise the failure of an earlier save (`CheckpointSaveError`),
    or save `state` (with `host`, the batch source's stream position, and `lagged()`, the lag's
    weight versions) when `save` or a stop is asked for, and on a stop raise `Interrupted` once that
    save is complete. Every process decides alike (`StopRequests.agreed`)."""
    failure = checkpointer.failure()
    stop, failed = stops.agreed(failure)
    if failed:
        raise failure or CheckpointSaveError(None, checkpointer.directory, "the save failed on another process")
    if save or stop:
        writer.flush()
        checkpointer.save(step, state, {"step": step, **host}, lagged_policy=lagged())
    if stop:
        checkpointer.wait()
        raise Interrupted(stops.signum, step)


def rl_loop(run: Run, state, graphs, steps, rollout_loop, eval_loop, writer, checkpointer, start_step: int,
            host: dict[str, Any], stops: StopRequests, ring: PolicyLagRing | None = None):  # fmt: skip
    """RL steps `start_step` + 1 … `train.steps`; returns the run's summary. Each step ends in
    `end_step`."""
    config = run.config
    train_cfg = config.train
    base_key = jax.random.key(config.seed)
    last_eval = None
    weights = policy_weights(state, graphs)
    source = (StreamingBatches(run, rollout_loop, weights, start_step, host) if train_cfg.mode == "async"
              else LockstepBatches(run, rollout_loop, ring))  # fmt: skip
    reads_reference = ADVANTAGE_ESTIMATORS[config.advantage.estimator].reference
    schedule = run.env_kwargs.get("schedule")  # style_shift's target-style schedule, moved per step
    probe = AdvantageProbe(run, graphs) if train_cfg.probe_every else None

    def gold_tokens(trajectory: Trajectory):
        # (ours) TRACE's gold answer: the final action of the prompt's demonstration, e.g. "A: 42\n",
        # tokenized as SFT tokenizes actions, so the reference scores it in the form it was taught.
        prompt = run.train_prompts[trajectory.prompt_id]
        return run.tokenizer.encode(run.demonstration(prompt)[-1])

    streak, without_data = 0, FailureTally()  # steps in a row with no usable trajectory, their failed rollouts
    bar = tqdm(range(start_step + 1, train_cfg.steps + 1), desc="rl", initial=start_step, total=train_cfg.steps)
    try:
        for step in bar:
            started = time.perf_counter()
            if schedule is not None:
                schedule.set_step(step)
            kept, source_metrics = source.next(step, policy_weights(state, graphs))
            if not kept:
                writer.write(step, {**source_metrics, "train/skipped_no_data": 1})
                streak += 1
                without_data.update(source.step_errors.counts.elements())
                if streak >= train_cfg.max_steps_without_data:
                    raise DeadEnvironmentError(
                        f"no usable trajectory in {streak} RL steps in a row (steps {step - streak + 1}-{step}; "
                        f"train.max_steps_without_data={train_cfg.max_steps_without_data}): the environment failed "
                        f"{without_data.total} rollouts, {without_data.describe()}")  # fmt: skip
                end_step(step, state, source.host_state(), writer, checkpointer, stops, save=False,
                         lagged=lambda: lagged_policy(ring, step, state, graphs))  # fmt: skip
                continue
            streak, without_data = 0, FailureTally()
            batch = collate(kept, batch_size=train_cfg.batch_size, buckets=run.buckets, trainer_version=step - 1)
            steps_lib.check_whole_groups(batch.prompt_id, config.advantage.group_size)
            if reads_reference:
                batch = steps_lib.trace_batch(batch, [gold_tokens(t) for t in kept])
            lost = float(np.abs(unassigned_reward(batch.rewards, batch.action_mask)).sum())
            if lost > 0:
                raise RuntimeError(f"step {step}: reward {lost} sits before the first action token and cannot be credited")
            evaluates, checkpoints = rl_schedule(config, step)
            state, metrics = steps.ttur_step(state, batch, jax.random.fold_in(base_key, step))
            metrics, rows = split_row_metrics(jax.device_get(metrics))
            line = {**rollout_metrics(kept, "train"), **tool_metrics(kept, "train", run.env_cls),
                    **repair_metrics(kept, "train", run.env_cls), **quality_metrics(kept, run.train_prompts, "train"),
                    **style_metrics(kept, schedule),
                    **style_advantage_metrics(kept, rows.get("policy/first_action_advantage"), schedule),
                    **source_metrics, **metrics,
                    "time/step_s": time.perf_counter() - started}  # fmt: skip
            if evaluates:
                line |= evaluate(run, eval_loop, policy_weights(state, graphs))
                last_eval = line["eval/success_rate"]
            if probe is not None and step % train_cfg.probe_every == 0:
                line |= probe(state, policy_weights(state, graphs), step)
            written = writer.write(step, line)
            bar.set_postfix(reward=f"{written['train/reward_mean']:.2f}", success=f"{written['train/success_rate']:.2f}",
                            eval=f"{last_eval:.2f}" if last_eval is not None else "-")  # fmt: skip
            end_step(step, state, source.host_state(), writer, checkpointer, stops, save=checkpoints,
                     lagged=lambda: lagged_policy(ring, step, state, graphs))  # fmt: skip
    except Interrupted as interrupted:
        bar.close()
        interrupted.dropped_prompts = source.close()
        raise
    except BaseException:
        source.close()
        raise
    source.close()
    if source.errors.total and run.cluster.is_primary:  # counted as they came, summed up once
        log.warning("the environment failed %d rollouts in RL, %s (train/env_failed in metrics.jsonl counts them "
                    "by step; --debug shows the first one's traceback)", source.errors.total, source.errors.describe())
    checkpointer.wait()
    return run_summary(read_metrics(writer.path), num_eval_prompts=len(run.eval_prompts),
                       skipped_prompts=run.skipped_prompts)
