"""The warm-start stages before RL: SFT on demonstrations (until the held-out probe reaches its
target), value pretraining of the critic on Monte-Carlo returns of the warm-started policy's
rollouts (docs/algorithms.md §8), both cached by settings in `sft.cache_dir`, then the critic's warmup
steps: RL's critic updates on fresh batches of the same policy, before the first policy update.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from sao_jax.advantages import ADVANTAGE_ESTIMATORS
from sao_jax.config import Config, to_dict
from sao_jax.metrics import MetricsWriter
from sao_jax.outputs import free_name
from sao_jax.optim import adamw, train_only
from sao_jax.rollout.agent_loop import AgentLoop
from sao_jax.rollout.failures import DeadEnvironmentError, FailureTally
from sao_jax.rollout.trajectory import collate
from sao_jax.train import steps as steps_lib
from sao_jax.train.build import (
    CRITIC_WARMUP_STREAM,
    SFT_PROBE_STREAM,
    SFT_STREAM,
    VALUE_PRETRAIN_STREAM,
    Run,
    optimizer,
    policy_weights,
    prompt_pool,
    usable,
)
from sao_jax.train.distributed import process_block
from sao_jax.train.sft import choice_mask, demonstration_trajectory, make_demonstration_probe, make_sft_update
from sao_jax.train.signals import Interrupted, StopRequests

log = logging.getLogger(__name__)


def sft_cache_key(config: Config) -> str:
    """Hash of every setting the warm start depends on (not `sft.cache_dir` itself)."""
    parts = {name: to_dict(getattr(config, name)) for name in ("model", "env", "sft", "rollout", "mesh")}
    parts["sft"].pop("cache_dir")
    parts["env"].pop("rl_prompts")  # SFT demonstrates the whole pool, whatever share of it RL draws from
    for name in ("policy_lag", "policy_lag_spread"):  # RL's sampling only: the rows of any lag share one
        parts["rollout"].pop(name)
    parts["seed"] = config.seed
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def value_pretraining_cache_key(config: Config) -> str:
    """Hash of every setting value pretraining depends on: the warm start's (`sft_cache_key`); RL's
    prompts (`env.rl_prompts`); the critic's but its RL optimizer, K and warmup steps; the advantage
    settings, the value clip, the scaffold and the batch shape. Rows that differ only in their policy
    loss, their policy lag or their RL budget share one pretrained critic."""
    critic = to_dict(config.critic)
    for name in ("optimizer", "updates_per_policy_update", "warmup_steps"):
        critic.pop(name)
    parts = {"warm_start": sft_cache_key(config), "critic": critic, "advantage": to_dict(config.advantage),
             "value_clip_eps": config.loss.value_clip_eps, "scaffold": to_dict(config.scaffold),
             "train": {name: getattr(config.train, name) for name in ("batch_size", "micro_batch_size", "logit_chunk")}}
    if config.env.rl_prompts:  # its prompts; absent at 0 (the whole pool), as in the keys stored before it existed
        parts["rl_prompts"] = config.env.rl_prompts
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_sft(run: Run, writer: MetricsWriter, *, stops: StopRequests | None = None) -> Any:
    """Fit the policy to demonstrations; returns the policy's trained params. With `sft.cache_dir`, a
    warm start already trained under the same settings is loaded instead (its metric lines replayed),
    and a new one is stored there. An entry that does not load (truncated, corrupt, other shapes) is
    named in one warning, moved aside to `<entry>.unreadable.npz` and trained again. With `stops`, a
    signal ends it after the SFT step in hand (`Interrupted`; nothing is stored)."""
    sft_cfg = run.config.sft
    graph, params, buffers = steps_lib.split_model(run.policy)
    if sft_cfg.steps == 0:
        return params
    cached = Path(sft_cfg.cache_dir) / f"sft_{sft_cache_key(run.config)}.npz" if sft_cfg.cache_dir else None
    loaded = _replay_cache_entry(run, cached, params, writer, "SFT")
    if loaded is not None:
        return run.cluster.place(loaded)
    lines: list[dict[str, Any]] = []
    params = _train_sft(run, graph, params, buffers, writer, lines, stops)
    _write_cache_entry(cached, params, lines)
    return params


def _replay_cache_entry(run: Run, path: Path | None, params, writer: MetricsWriter, what: str) -> Any | None:
    """The params stored in the warm-start cache entry at `path`, with the metric lines that trained
    them written again to `writer`; None when there is no entry. An entry that does not load
    (truncated, corrupt, other shapes) is named in one warning and moved aside to
    `<entry>.unreadable.npz`, and None is returned: `what` is then trained again."""
    if path is None or not path.exists():
        return None
    try:
        loaded, lines = _load_cache_entry(path, params)
    except Exception as error:  # noqa: BLE001 — any unreadable entry is redone, named in one line
        aside = free_name(path, "unreadable")
        if run.cluster.is_primary:  # the cache may be shared by the processes: one moves it
            os.replace(path, aside)
        log.warning("the %s cache entry %s is unreadable (%s: %s); moved it aside to %s and training it again",
                    what, path, type(error).__name__, str(error).splitlines()[0][:200] if str(error) else "", aside)
        return None
    for line in lines:
        writer.write(0, line)
    log.info("%s loaded from the cache entry %s, its metric lines replayed", what, path)
    return loaded


def _write_cache_entry(path: Path | None, params, lines: list[dict[str, Any]]) -> None:
    """Store `params` and the metric lines that produced them at `path` (nothing when None); a crash
    mid-write leaves no half-written entry, and processes sharing the folder never write one file."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".partial{jax.process_index()}.npz")
    leaves = {f"leaf_{i}": np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(params))}
    np.savez(partial, metrics=json.dumps(lines), **leaves)
    os.replace(partial, path)


def _load_cache_entry(path: Path, params) -> tuple[Any, list[dict[str, Any]]]:
    """(params, metric lines) of a cache entry, every leaf of the shape and dtype of `params`'s; raises
    whatever a truncated or foreign file raises, before anything is written."""
    with np.load(path, allow_pickle=False) as stored:
        leaves, treedef = jax.tree.flatten(params)
        arrays = [stored[f"leaf_{i}"] for i in range(len(leaves))]
        for i, (array, leaf) in enumerate(zip(arrays, leaves)):
            if array.shape != leaf.shape:
                raise ValueError(f"leaf_{i} has shape {array.shape}, the model's {leaf.shape}")
        lines = json.loads(str(stored["metrics"]))
    return jax.tree.unflatten(treedef, [jnp.asarray(a, leaf.dtype) for a, leaf in zip(arrays, leaves)]), lines


def _train_sft(run: Run, graph, params, buffers, writer: MetricsWriter, lines: list, stops: StopRequests | None) -> Any:
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
    rng = np.random.default_rng([run.config.seed, SFT_STREAM])
    probe = None  # built at the first check: runs too short to reach one never pay for it

    # Every batch holds the same number of weak demonstrations (at random rows): the tool choice the
    # policy learns then does not drift with the batches' own mix, which a constant rate would follow.
    num_weak = round(sft_cfg.weak_demonstration_fraction * sft_cfg.batch_size)

    with tqdm(range(sft_cfg.steps), desc="sft", leave=False) as bar:
        for i in bar:
            prompts = [run.sft_prompts[j] for j in rng.integers(0, len(run.sft_prompts), sft_cfg.batch_size)]
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
            if stops is not None and stops.agreed()[0]:
                raise Interrupted(stops.signum, None, "SFT")
    if not reached and sft_cfg.target_demonstration_probability > 0:
        log.warning("sft: the warm start did not reach sft.target_demonstration_probability=%s within sft.steps=%d",
                    sft_cfg.target_demonstration_probability, sft_cfg.steps)
    return params


def demonstration_probe(run: Run, graph, buffers):
    """`params -> mean demonstration_probability` on `sft.probe_prompts` held-out gold demonstrations
    (prompts of their own stream, or the first of `env.eval_file`); the token where the weaker
    demonstrator would branch off is the free choice left out (`sft.choice_mask`)."""
    config = run.config
    prompts = run.eval_prompts if config.env.eval_file is not None else prompt_pool(
        config, run.env_cls, None, config.sft.probe_prompts, SFT_PROBE_STREAM, key="env.eval_file")
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


def run_value_pretraining(run: Run, state, graphs, rollout_loop: AgentLoop, critic_tx, writer: MetricsWriter, *,
                          stops: StopRequests | None = None):  # fmt: skip
    """Regress the critic on Monte-Carlo returns (λ = 1) of the initial policy's rollouts; returns the
    state with the pretrained critic and a fresh RL critic optimizer state (`critic_tx`). `state` is
    consumed (its buffers are donated). With `sft.cache_dir`, a critic pretrained under the same
    settings (`value_pretraining_cache_key`) is loaded instead, its metric lines replayed, and a new
    one is stored there. With `stops`, a signal ends it after the rollouts or the batch in hand
    (`Interrupted`; nothing is stored)."""
    config = run.config
    critic_cfg = config.critic
    critic_free = ADVANTAGE_ESTIMATORS[config.advantage.estimator].gae is None
    if critic_cfg.pretrain_rollouts == 0 or critic_free:  # critic-free baselines never read the critic
        return run.cluster.place(state.replace(critic_opt_state=critic_tx.init(state.critic_params)))
    cache_dir = config.sft.cache_dir
    cached = Path(cache_dir) / f"critic_{value_pretraining_cache_key(config)}.npz" if cache_dir else None
    critic_params = _replay_cache_entry(run, cached, state.critic_params, writer, "value pretraining")
    if critic_params is not None:
        return run.cluster.place(state.replace(critic_params=critic_params, critic_opt_state=critic_tx.init(critic_params)))
    weights = policy_weights(state, graphs)
    rng = np.random.default_rng([config.seed, VALUE_PRETRAIN_STREAM])
    prompts = [run.train_prompts[j] for j in rng.integers(0, len(run.train_prompts), critic_cfg.pretrain_rollouts)]
    mine = process_block(len(prompts), jax.process_index(), jax.process_count())  # the rollouts this process runs
    with tqdm(total=len(mine), desc="value-pretraining rollouts", leave=False) as bar:
        rollouts = rollout_loop.rollout((weights, 0), prompts, jax.random.key(config.seed + 1),
                                        on_trajectory=lambda _: bar.update())  # fmt: skip
    corpus, failed = usable(rollouts)
    check_pretraining_corpus(config, rollouts, len(corpus))

    def check_stop():
        if stops is not None and stops.agreed()[0]:
            raise Interrupted(stops.signum, None, "value pretraining")

    check_stop()
    tx, value_update = value_pretraining_update(graphs, config)
    value_update = run.cluster.step(value_update)
    pretrain_state = run.cluster.place(state.replace(critic_opt_state=tx.init(state.critic_params)))
    batch_size = config.train.batch_size
    lines: list[dict[str, Any]] = []
    for epoch in tqdm(range(critic_cfg.pretrain_epochs), desc="value pretraining", leave=False):
        order = rng.permutation(len(corpus))
        epoch_metrics = []
        for start in range(0, len(order) - batch_size + 1, batch_size):
            batch = collate([corpus[i] for i in order[start:start + batch_size]], batch_size=batch_size, buckets=run.buckets)
            pretrain_state, metrics = value_update(pretrain_state, batch, jax.random.key(epoch))
            epoch_metrics.append(jax.device_get(metrics))
            check_stop()
        mean = {k: float(np.mean([m[k] for m in epoch_metrics])) for k in epoch_metrics[0]}
        lines.append({"stage": "value_pretrain", "value_pretrain/epoch": epoch, "value_pretrain/corpus": len(corpus),
                      "value_pretrain/failed_rollouts": failed, **mean})  # fmt: skip
        writer.write(0, lines[-1])
    _write_cache_entry(cached, pretrain_state.critic_params, lines)
    return run.cluster.place(pretrain_state.replace(critic_opt_state=critic_tx.init(pretrain_state.critic_params)))


def check_pretraining_corpus(config: Config, rollouts, num_usable: int) -> None:
    """Raise `DeadEnvironmentError` when fewer rollouts are usable than value pretraining's floor:
    `critic.pretrain_min_usable_fraction` of `critic.pretrain_rollouts`, and one batch at least."""
    critic_cfg = config.critic
    floor = max(math.ceil(critic_cfg.pretrain_min_usable_fraction * critic_cfg.pretrain_rollouts),
                config.train.batch_size)  # fmt: skip
    if num_usable >= floor:
        return
    errors = FailureTally(t.info["error"] for t in rollouts if t.info.get("error") is not None)
    raise DeadEnvironmentError(
        f"value pretraining got {num_usable} usable rollouts of {len(rollouts)}, fewer than its floor of {floor} "
        f"(critic.pretrain_min_usable_fraction={critic_cfg.pretrain_min_usable_fraction} of "
        f"critic.pretrain_rollouts={critic_cfg.pretrain_rollouts}, and one train.batch_size at least): the "
        f"environment failed {errors.total}, {errors.describe()}")  # fmt: skip


def value_pretraining_update(graphs: steps_lib.Graphs, config: Config):
    """(optimizer, jitted value update) of value pretraining: `critic.pretrain_lr`, on the leaves of
    `critic.pretrain_trainable_patterns` (None: `critic.trainable_patterns`, as in RL)."""
    critic_cfg = config.critic
    trainable = (critic_cfg.trainable_patterns if critic_cfg.pretrain_trainable_patterns is None
                 else critic_cfg.pretrain_trainable_patterns)
    tx = steps_lib.guard_nonfinite(train_only(adamw(critic_cfg.pretrain_lr), trainable))
    update = steps_lib.make_value_update(graphs, tx, config, trainable)
    return tx, jax.jit(steps_lib.sequence(update), donate_argnums=0)


def run_critic_warmup(run: Run, state, graphs, critic_warmup_step, rollout_loop: AgentLoop, writer: MetricsWriter, *,
                      stops: StopRequests | None = None):  # fmt: skip
    """`critic.warmup_steps` critic-only steps (TTUR's K value updates, RL's critic optimizer) on
    fresh batches of `train.batch_size` rollouts of the starting policy, before RL step 1; returns
    the state. SAO runs 10 such steps before its first policy update; here they come on top of the RL
    budget, so every row of a comparison makes `train.steps` policy updates. Their prompts and keys
    come from a stream of their own, so RL step s draws the same prompts in every row. Logged at
    step 0, one line a step, `"stage": "critic_warmup"`. With `stops`, a signal ends it after the
    step in hand (`Interrupted`; the run is not checkpointed yet, so `--resume` starts over)."""
    config = run.config
    if config.critic.warmup_steps == 0 or ADVANTAGE_ESTIMATORS[config.advantage.estimator].gae is None:
        return state
    rng = np.random.default_rng([config.seed, CRITIC_WARMUP_STREAM])
    base_key = jax.random.key(config.seed + CRITIC_WARMUP_STREAM)
    batch_size = config.train.batch_size
    for i in tqdm(range(config.critic.warmup_steps), desc="critic warmup", leave=False):
        prompts = [run.train_prompts[j] for j in rng.integers(0, len(run.train_prompts), batch_size)]
        rollout_key, step_key = jax.random.split(jax.random.fold_in(base_key, i))
        # The policy's weights from this step's state: each step donates the state it is given.
        kept, failed = usable(rollout_loop.rollout((policy_weights(state, graphs), 0), prompts, rollout_key))
        if not kept:
            writer.write(0, {"stage": "critic_warmup", "critic_warmup/step": i, "critic_warmup/failed_rollouts": failed})
            continue
        batch = collate(kept, batch_size=batch_size, buckets=run.buckets)
        state, metrics = critic_warmup_step(state, batch, step_key)
        writer.write(0, {"stage": "critic_warmup", "critic_warmup/step": i, "critic_warmup/failed_rollouts": failed,
                         **jax.tree.map(float, jax.device_get(metrics))})  # fmt: skip
        if stops is not None and stops.agreed()[0]:
            raise Interrupted(stops.signum, None, "the critic warmup")
    return state
