"""The run's pieces, shared by every stage: the policy, tokenizer, environments and prompt pools
(`build_run`), the RL optimizers, and where the checkpoints live.

Randomness: each consumer draws from its own stream, a seed folded with one of the stream ids below.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from sao_jax import models
from sao_jax.config import Config, ConfigError, OptimizerConfig
from sao_jax.data.chat import ChatEnv, ChatFormat, HFTokenizer
from sao_jax.data.datasets import DatasetError, read_prompt_records
from sao_jax.data.tokenizers import CharTokenizer
from sao_jax.envs import Prompt, environment_class
from sao_jax.envs.style_shift import StyleSchedule, StyleShiftEnv
from sao_jax.models import sharding
from sao_jax.optim import adamw, learning_rate_schedule, train_only
from sao_jax.outputs import join
from sao_jax.rollout.agent_loop import AgentLoop, AgentLoopConfig
from sao_jax.rollout.decode import resolve_decode_backend
from sao_jax.rollout.sampler import Sampler
from sao_jax.rollout.scaffold import ScaffoldLoop, ScaffoldSettings, command_argv
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.train import steps as steps_lib
from sao_jax.train.distributed import Cluster, ProcessRollouts
from sao_jax.train.sft import demonstration_trajectory

log = logging.getLogger(__name__)

# Stream ids folded into the seed so each consumer of randomness has its own stream.
(SFT_STREAM, VALUE_PRETRAIN_STREAM, RL_STREAM, EVAL_STREAM, INIT_STREAM, SFT_PROBE_STREAM, ADVANTAGE_PROBE_STREAM,
 CRITIC_WARMUP_STREAM, POLICY_LAG_STREAM) = range(9)


@dataclasses.dataclass
class Run:
    """Everything built once per run from the config."""

    config: Config
    tokenizer: CharTokenizer | HFTokenizer
    env_cls: Any
    env_kwargs: dict[str, Any]
    train_prompts: list[Any]  # RL's: the first `env.rl_prompts` of the training pool (all of it when 0)
    eval_prompts: list[Any]
    policy: models.Policy
    buckets: tuple[int, ...]
    cluster: Cluster = dataclasses.field(default_factory=Cluster)  # this process's part of the run
    chat_format: ChatFormat | None = None  # a pretrained model's: every episode is spoken in it
    scaffold: ScaffoldSettings | None = None  # env.name=scaffold: a scaffold runs the episodes
    # env.bad_prompts=skip: {"env.train_file" or "env.eval_file": prompts left out of it}, where any were.
    skipped_prompts: dict[str, int] = dataclasses.field(default_factory=dict)
    sft_prompts: list[Any] = dataclasses.field(default_factory=list)  # the whole training pool, SFT's

    def env_factory(self, prompt):
        return make_env(self.env_cls, self.env_kwargs, self.chat_format)

    def demonstration(self, prompt, *, weak: bool = False) -> list[str]:
        """The gold actions for `prompt` (`weak`: the weaker demonstrator's), in the chat format."""
        return demonstration_actions(self.env_cls, self.env_kwargs, self.chat_format, prompt, weak=weak)

    def agent_loop(self, *, greedy: bool, env_factory=None) -> AgentLoop | ScaffoldLoop | ProcessRollouts:
        """The rollout settings' agent loop (`greedy`: top-k 1); `env_factory` replaces `self.env_factory`.
        With a scaffold (`env.name=scaffold`), the `ScaffoldLoop` that runs it against the chat server."""
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
        if self.scaffold is not None:
            return self.cluster.rollouts(ScaffoldLoop(sampler, self.tokenizer, self.chat_format, loop_config,
                                                      self.scaffold))  # fmt: skip
        return self.cluster.rollouts(AgentLoop(sampler, self.tokenizer, env_factory or self.env_factory, loop_config))


def make_env(env_cls, env_kwargs: dict[str, Any], chat_format: ChatFormat | None):
    """A fresh environment, spoken in `chat_format` when there is one (`ChatEnv`)."""
    env = env_cls(**env_kwargs)
    return env if chat_format is None else ChatEnv(env, chat_format)


def demonstration_actions(env_cls, env_kwargs: dict[str, Any], chat_format: ChatFormat | None, prompt: Prompt, *,
                          weak: bool = False) -> list[str]:  # fmt: skip
    """The gold actions for `prompt` (`weak`: the weaker demonstrator's), in the chat format. Asked of an
    environment built with `env.options`, which may shape them (repair's `demonstrate_repair`)."""
    env = env_cls(**env_kwargs)
    actions = (env.weak_demonstration if weak else env.demonstration)(prompt)
    return actions if chat_format is None else make_env(env_cls, env_kwargs, chat_format).chat_actions(actions)


def build_run(config: Config) -> Run:
    """The run's pieces. A pretrained model (`model.pretrained`, a Hugging Face folder) brings its
    tokenizer and chat template, and the environment is spoken in that template (`ChatEnv`); a preset
    uses the character tokenizer. Prompts come from `env.train_file` / `env.eval_file` when set, each
    checked against the tokenizer and the rollout's length (`check_prompt`) before any model loads."""
    cluster = Cluster.for_config(config)
    env_cls = environment_class(config.env.name)
    scaffold = scaffold_settings(config)  # a scaffold.entry that does not import: named before anything loads
    check_env_options(config, env_cls)
    env = config.env
    model = config.model
    if model.pretrained:
        models.read_hf_config(model.pretrained)  # a missing folder or broken config.json: named before anything loads
        tokenizer = HFTokenizer.from_folder(model.pretrained)
        chat_format = ChatFormat.from_tokenizer(tokenizer)
    else:
        tokenizer, chat_format = CharTokenizer(), None
    check = functools.partial(check_prompt, config, env_cls, tokenizer, chat_format)
    # SFT demonstrates any training prompt, and its probe the first sft.probe_prompts held-out ones.
    sft = config.sft
    probed = sft.probe_prompts if sft.target_demonstration_probability > 0 and sft.steps >= sft.check_every else 0
    skipped: dict[str, list[str]] = {"env.train_file": [], "env.eval_file": []}
    train_prompts = prompt_pool(config, env_cls, env.train_file, env.train_prompts, RL_STREAM, key="env.train_file",
                                check=check, demonstrated=math.inf if sft.steps else 0,
                                skipped=skipped["env.train_file"])  # fmt: skip
    eval_prompts = prompt_pool(config, env_cls, env.eval_file, env.eval_prompts, EVAL_STREAM, key="env.eval_file",
                               check=check, demonstrated=probed, skipped=skipped["env.eval_file"])  # fmt: skip
    if env.rl_prompts > len(train_prompts):
        raise ConfigError(f"env.rl_prompts={env.rl_prompts} is more than the {len(train_prompts)} usable prompts of "
                          f"env.train_file={env.train_file}")  # fmt: skip
    rl_prompts = train_prompts[: env.rl_prompts] if env.rl_prompts else train_prompts
    skipped_prompts = {key: len(problems) for key, problems in skipped.items() if problems}
    if skipped_prompts and cluster.is_primary:
        first = next(problems[0] for problems in skipped.values() if problems)
        log.warning("env.bad_prompts=skip: left out %s (the first: %s)",
                    " and ".join(f"{n} prompts of {key}" for key, n in skipped_prompts.items()), first)
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
        policy = models.from_pretrained(model.pretrained, mesh=cluster.mesh, **overrides)
        if tokenizer.vocab_size > policy.config.vocab_size:
            raise ValueError(f"model.pretrained={model.pretrained}: the tokenizer has {tokenizer.vocab_size} tokens, "
                             f"more than the model's vocab_size {policy.config.vocab_size}")
    else:
        preset = models.PRESETS[model.preset]

        def make_policy():
            return models.Policy(preset(vocab_size=tokenizer.vocab_size, **overrides), rngs=nnx.Rngs(config.seed))

        # On a mesh each device draws only its own shards: no host ever holds the whole model.
        policy = make_policy() if cluster.mesh is None else sharding.sharded_init(make_policy, cluster.mesh)
    length = config.rollout.max_total_tokens
    buckets = tuple(sorted({max(16, length // 2), length}))
    return Run(config, tokenizer, env_cls, env_options(config), rl_prompts, eval_prompts, policy, buckets, cluster,
               chat_format, scaffold, skipped_prompts, sft_prompts=train_prompts)  # fmt: skip


def scaffold_settings(config: Config) -> ScaffoldSettings | None:
    """The `scaffold` section as the scaffold loop's settings (None unless `env.name=scaffold`); an
    `entry` that does not import is a ConfigError naming it."""
    if config.env.name != "scaffold":
        return None
    scaffold = config.scaffold
    episode_fn = None
    if scaffold.entry is not None:
        module, _, name = scaffold.entry.partition(":")
        try:
            episode_fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"scaffold.entry={scaffold.entry} cannot be loaded: {type(e).__name__}: {e}") from None
    return ScaffoldSettings(episode_fn=episode_fn, command=None if scaffold.command is None else
                            command_argv(scaffold.command), deadline_s=scaffold.deadline_s,
                            max_episode_tokens=scaffold.max_episode_tokens,
                            episodes_at_once=scaffold.episodes_at_once)  # fmt: skip


def prompt_pool(config: Config, env_cls, file: str | None, size: int, stream: int, *, key: str,
                check: Callable[..., str | None] | None = None, demonstrated: float = 0,
                skipped: list[str] | None = None) -> list[Prompt]:  # fmt: skip
    """The prompts of `file` (`read_prompt_records`; its errors name the config `key`), or `size` that the
    environment generates with the rng (seed, stream). Each prompt's id becomes its index in the pool:
    per-prompt baselines key on it. `check(prompt, line, demonstrated=)`: a file prompt's problem, or
    None; the first `demonstrated` prompts of the pool (math.inf: all) are SFT's, their demonstrations
    checked too. A record's problem (malformed, or `check`'s) is a DatasetError under
    `env.bad_prompts=error`; under `skip` the record is left out and its message appended to `skipped`."""
    if file is None:
        difficulty = list(config.env.difficulty) or None
        prompts = env_cls.generate_prompts(np.random.default_rng([config.seed, stream]), size, difficulty)
        return [dataclasses.replace(p, id=i) for i, p in enumerate(prompts)]
    problems: list[str] = []
    skip = config.env.bad_prompts == "skip"
    prompts = []
    try:
        for where, prompt, line in read_prompt_records(file, skipped=problems if skip else None):
            prompt = dataclasses.replace(prompt, id=len(prompts))
            problem = None if check is None else check(prompt, line, demonstrated=len(prompts) < demonstrated)
            if problem is None:
                prompts.append(prompt)
            elif skip:
                problems.append(f"{where}: {problem}")
            else:
                raise DatasetError(f"{where}: {problem}")
        if not prompts:
            raise DatasetError(f"{file}: none of its {len(problems)} prompts is usable (env.bad_prompts=skip); "
                               f"the first: {problems[0]}")  # fmt: skip
    except DatasetError as e:
        raise DatasetError(f"{e} ({key})") from None
    if skipped is not None:
        skipped.extend(problems)
    return prompts


def check_prompt(config: Config, env_cls, tokenizer, chat_format: ChatFormat | None, prompt: Prompt,
                 line: str | None = None, *, demonstrated: bool = False) -> str | None:  # fmt: skip
    """What stops `prompt` from being rolled out, or None: the environment cannot start on it, its text
    holds a character outside the tokenizer's vocabulary (its column in the file's `line`, when known),
    or the first observation leaves no room for an action within `rollout.max_total_tokens`. When SFT
    `demonstrated` it: also the environment cannot demonstrate it, or a demonstration (the weaker one's
    too, under `sft.weak_demonstration_fraction`) is longer than `rollout.max_total_tokens`, the length
    of SFT's longest sequence."""
    env = make_env(env_cls, env_options(config), chat_format)
    try:
        text = env.reset(prompt)
    except Exception as e:  # noqa: BLE001 — whatever the environment raises, named in one line
        return f"the environment {config.env.name!r} cannot start on this prompt ({type(e).__name__}: {e})"
    unknown = _outside_vocabulary(tokenizer, text)
    if unknown is not None:
        column = _column(line, unknown)
        return (f"character {unknown!r}{'' if column is None else f' at column {column}'} is not in the tokenizer's "
                "vocabulary")  # fmt: skip
    length = len(tokenizer.encode(text)) + (chat_format is None and tokenizer.bos_id is not None)
    budget = config.rollout.max_total_tokens
    if length >= budget:
        return (f"the prompt takes {length} tokens, leaving no room for an action within "
                f"rollout.max_total_tokens={budget}: shorten it or raise rollout.max_total_tokens")  # fmt: skip
    return _demonstration_problem(config, env_cls, tokenizer, chat_format, prompt) if demonstrated else None


def _demonstration_problem(config: Config, env_cls, tokenizer, chat_format: ChatFormat | None,
                           prompt: Prompt) -> str | None:  # fmt: skip
    """What stops SFT from training on `prompt`'s demonstrations (`check_prompt`), or None."""
    env_kwargs, budget = env_options(config), config.rollout.max_total_tokens
    weak = config.sft.weak_demonstration_fraction > 0 and hasattr(env_cls, "weak_demonstration")
    demonstrators = [("demonstration", False), *([("weaker demonstration", True)] if weak else [])]
    for which, is_weak in demonstrators:
        try:
            actions = demonstration_actions(env_cls, env_kwargs, chat_format, prompt, weak=is_weak)
            length = demonstration_trajectory(make_env(env_cls, env_kwargs, chat_format), prompt, actions, tokenizer,
                                              add_bos=chat_format is None).num_tokens  # fmt: skip
        except Exception as e:  # noqa: BLE001 — whatever the environment raises, named in one line
            return (f"the environment {config.env.name!r} cannot step through this prompt's SFT {which} "
                    f"({type(e).__name__}: {e}); set sft.steps=0 to train without SFT")  # fmt: skip
        if length > budget:
            return (f"its SFT {which} takes {length} tokens, more than rollout.max_total_tokens={budget} (SFT's "
                    "longest sequence): shorten the prompt or raise rollout.max_total_tokens")  # fmt: skip
    return None


def _outside_vocabulary(tokenizer, text: str) -> str | None:
    """The first character of `text` the tokenizer cannot encode (or maps to its unknown token), or None."""
    unk_id = getattr(tokenizer, "unk_id", None)
    try:
        ids = tokenizer.encode(text)
        if unk_id is None or unk_id not in ids:
            return None
    except ValueError:
        pass
    for char in text:
        try:
            if unk_id is None or unk_id not in tokenizer.encode(char):
                tokenizer.encode(char)
                continue
        except ValueError:
            pass
        return char
    return None


def _column(line: str | None, char: str) -> int | None:
    """1-based column of `char` in a JSON `line`, written as it stands or escaped (\\uXXXX)."""
    if line is None:
        return None
    for written in (char, json.dumps(char)[1:-1], json.dumps(char, ensure_ascii=False)[1:-1]):
        found = line.find(written) if written else -1
        if found >= 0:
            return found + 1
    return None


def check_env_options(config: Config, env_cls) -> None:
    """Build the environment once from `env.options`: an option it does not take, or a value it refuses
    (a style schedule that does not start at step 0, detail rates that are not probabilities), stops
    the run as a `ConfigError` naming `env.options` before anything loads."""
    try:
        env_cls(**env_options(config))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"env.options (env.name={config.env.name}): {e}") from None


def env_options(config: Config) -> dict[str, Any]:
    """The environment constructor's keyword arguments from `env.options`. The style-shift tasks'
    `switches` ([[step, style], ...]) become the one `StyleSchedule` every episode shares (the loop
    moves it)."""
    options = dict(config.env.options)
    if issubclass(environment_class(config.env.name), StyleShiftEnv) and "switches" in options:
        options["schedule"] = StyleSchedule(tuple(map(tuple, options.pop("switches"))))
    return options


def new_critic(policy: models.Policy, config: Config) -> models.Critic:
    """A fresh critic: `policy`'s decoder, copied, under the configured value head (`critic.value_head`),
    initialised from the seed's INIT_STREAM."""
    return models.Critic.from_policy(policy, rngs=nnx.Rngs(config.seed + INIT_STREAM),
                                     value_bins=config.critic.value_bins_or_scalar)


def policy_weights(state: steps_lib.TrainState, graphs: steps_lib.Graphs):
    """The sampler's view of the policy: its full NNX state (params and buffers)."""
    return nnx.state(nnx.merge(graphs.policy, state.policy_params, state.policy_buffers))


def usable(trajectories: list[Trajectory]) -> tuple[list[Trajectory], int]:
    """Trajectories whose reward is the task's verdict; env failures are dropped (and counted)."""
    kept = [t for t in trajectories if t.info.get("error") is None]
    return kept, len(trajectories) - len(kept)


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


def checkpoint_dir(config: Config) -> str:
    """`train.checkpoint_dir`, else OUTPUT_DIR/checkpoints."""
    return config.train.checkpoint_dir or join(config.output_dir, "checkpoints")
