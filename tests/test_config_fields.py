"""The config contract: every field is checked against a documented range, and has an effect.

Walking the dataclasses of `sao_jax.config` recursively, every leaf field must

- if numeric, declare a `Range` that loading enforces: the field set just outside it is a
  `ConfigError` naming the key (and values no one could mean, written out by hand, are refused too);
- change what a run is built from when it is perturbed (`EFFECTS`: a value, and the settings under
  which the field matters), or be on `ALLOWED_WITHOUT_EFFECT_TEST` with where its effect is tested.

A field added without either fails here, so a key that does nothing cannot come back unnoticed.

"What a run is built from" (`built`), compared piece by piece, cheapest first: the device mesh, the
RL schedule (evaluation / checkpoint of each step), the checkpoint folder, the run's pieces
(`build_run`: environment, prompts, the policy's architecture), its two agent loops (sampler and loop
settings), and the jaxprs of the TTUR step and the value-pretraining update (on a fixed tiny model).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import types
import typing

import jax
import numpy as np
import pytest
from flax import nnx

from sao_jax import config as config_lib
from sao_jax.advantages import ADVANTAGE_ESTIMATORS
from sao_jax.config import Config, ConfigError, load_config
from sao_jax.models import Critic, Policy, tiny_qwen3_moe
from sao_jax.train import steps as steps_lib
from sao_jax.train.distributed import Cluster
from sao_jax.train.build import build_run, checkpoint_dir, make_optimizers
from sao_jax.train.loop import rl_schedule
from sao_jax.train.warm_start import value_pretraining_update
from tests.train.test_steps import synthetic_batch


def leaf_fields(schema=Config, prefix=""):
    """(dotted key, type hint, field) of every non-section field, recursively."""
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            yield from leaf_fields(hint, f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}", hint, field


def is_numeric(hint) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(is_numeric(option) for option in typing.get_args(hint) if option is not type(None))
    if typing.get_origin(hint) is tuple:
        return is_numeric(typing.get_args(hint)[0])
    return hint in (int, float)


NUMERIC = [(key, hint, field) for key, hint, field in leaf_fields() if is_numeric(hint)]
ALL_KEYS = [key for key, _, _ in leaf_fields()]


# ---------------------------------------------------------------------------------------- ranges


def outside(valid: config_lib.Range, hint):
    """A value just outside `valid` (a one-item list for a tuple field)."""
    value = valid.low if valid.open_low else valid.low - 1 if valid.low is not None else valid.high + 1
    return [value] if typing.get_origin(hint) is tuple else value


@pytest.mark.parametrize(("key", "hint", "field"), NUMERIC, ids=[key for key, _, _ in NUMERIC])
def test_every_numeric_field_declares_a_range_that_loading_enforces(key, hint, field):
    valid = field.metadata.get("range")
    assert isinstance(valid, config_lib.Range), f"{key} declares no valid range (config.ranged)"
    bad = outside(valid, hint)
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} must be .*\(got "):
        load_config(None, [f"{key}={json.dumps(bad)}"])


def test_every_default_is_in_its_range():
    sections = [Config()]
    while sections:
        section = sections.pop()
        assert config_lib.range_problems(section) == [], type(section).__name__
        sections += [getattr(section, f.name) for f in dataclasses.fields(section)
                     if dataclasses.is_dataclass(getattr(section, f.name))]  # fmt: skip


@pytest.mark.parametrize(("override", "key"), [
    ("policy.optimizer.lr=-1e-4", "policy.optimizer.lr"),
    ("train.steps=-3", "train.steps"),
    ("sft.steps=-5", "sft.steps"),
    ("loss.eps_low=-1", "loss.eps_low"),
    ("env.eval_prompts=0", "env.eval_prompts"),
    ("sft.batch_size=-4", "sft.batch_size"),
    ("rollout.temperature=0", "rollout.temperature"),
    ("rollout.top_p=0", "rollout.top_p"),
    ("critic.optimizer.max_grad_norm=0", "critic.optimizer.max_grad_norm"),
    ("mesh.data=0", "mesh.data"),
    ("env.difficulty=[1, 0]", "env.difficulty"),
    ("loss.value_clip_eps=-0.1", "loss.value_clip_eps"),
    ("loss.kl_coef=-0.1", "loss.kl_coef"),
    ("seed=-1", "seed"),
    ("env.bad_prompts=ignore", "env.bad_prompts"),
])  # fmt: skip
def test_values_that_cannot_be_meant_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} must be "):
        load_config(None, [override])


@pytest.mark.parametrize(("overrides", "key"), [
    (["loss.icepop_alpha=6"], "loss.icepop_alpha"),  # above icepop_beta = 5
    (["critic.pretrain_rollouts=8", "train.batch_size=16"], "critic.pretrain_rollouts"),
    (["loss.value_clip_eps=0.2", "critic.updates_per_policy_update=1"], "loss.value_clip_eps"),
    (["critic.trainable_patterns=[]"], "critic.trainable_patterns"),
    (["loss.value_clip_eps=0.2", "critic.value_head=hl_gauss"], "loss.value_clip_eps"),
    (["critic.value_range=[1.0, 0.0]"], "critic.value_range"),
    (["critic.value_range=[0.0]"], "critic.value_range"),
    (["critic.value_head=histogram"], "critic.value_head"),
])  # fmt: skip
def test_settings_that_contradict_each_other_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} "):
        load_config(None, overrides)


# --------------------------------------------------------------------------------------- effects

BASE = ["model.preset=tiny_qwen3_moe", "env.train_prompts=8", "env.eval_prompts=2", "env.difficulty=[1]",
        "train.steps=4", "train.batch_size=4", "train.eval_every=2", "train.checkpoint_every=2",
        "critic.warmup_steps=1", "critic.pretrain_rollouts=4", "sft.batch_size=4", "output_dir=/tmp/sao_fields"]  # fmt: skip
TRACE = ["advantage.estimator=trace", "advantage.group_size=2"]
# A mesh over 4 of the 8 fake CPU devices (tests/conftest.py), the other 4 kept for rollouts.
MESH = ["mesh.rollout_devices=4"]

# key -> (perturbed value, the settings under which the key matters, added to BASE)
EFFECTS: dict[str, tuple[typing.Any, list[str]]] = {
    "seed": (1, []),
    "output_dir": ("/tmp/sao_fields_other", []),
    "model.preset": ("tiny_glm4_moe", []),
    "model.moe_dispatch": ("dense", []),
    "model.dtype": ("bfloat16", []),
    "model.param_dtype": ("bfloat16", []),
    "model.remat": (True, []),
    "model.attention": ("splash", []),
    "env.name": ("guessing", []),
    "env.difficulty": ([2], []),
    "env.train_prompts": (9, []),
    "env.rl_prompts": (4, []),
    "env.eval_prompts": (3, []),
    "env.eval_greedy": (True, []),
    "env.train_file": ("PROMPT_FILE", []),
    "env.eval_file": ("PROMPT_FILE", []),
    "env.options": ({"max_turns": 2}, []),
    "rollout.num_slots": (3, []),
    "rollout.max_total_tokens": (80, []),
    "rollout.max_action_tokens": (8, []),
    "rollout.temperature": (0.7, []),
    "rollout.top_k": (5, []),
    "rollout.top_p": (0.9, []),
    "rollout.chunk_size": (4, []),
    "rollout.env_timeout_s": (1.0, []),
    "rollout.decode_backend": ("xla", []),  # the tests run on the CPU, where "auto" is native_cpu
    "advantage.estimator": ("cross_observation_gae", []),
    "advantage.gamma": (0.9, []),
    "advantage.lam_critic": (0.9, []),
    "advantage.lam_policy": (0.8, ["advantage.length_adaptive_alpha=null"]),
    "advantage.length_adaptive_alpha": (3.0, []),
    "advantage.running_mean_window": (3, ["advantage.estimator=running_mean"]),
    "advantage.running_mean_scope": ("global", ["advantage.estimator=running_mean"]),
    "advantage.group_size": (4, ["advantage.estimator=grpo", "advantage.group_size=2"]),
    "advantage.trace_k": (2, TRACE),
    "advantage.trace_gamma_td": (0.5, TRACE),
    "advantage.trace_lambda_term": (1.0, TRACE),
    "advantage.trace_alpha_out": (0.5, TRACE),
    "advantage.trace_alpha_turn": (0.5, TRACE),
    "loss.name": ("ppo_clip", []),
    "loss.eps_low": (0.2, []),
    "loss.eps_high": (2.0, []),
    "loss.icepop_alpha": (0.25, ["loss.name=icepop"]),
    "loss.icepop_beta": (4.0, ["loss.name=icepop"]),
    "loss.estr_tau": (2.0, ["loss.name=estr"]),
    "loss.estr_eps": (0.1, ["loss.name=estr"]),
    "loss.value_clip_eps": (0.2, []),
    "loss.kl_coef": (0.05, []),
    "critic.updates_per_policy_update": (3, []),
    "critic.trainable_patterns": ([".*"], []),
    "critic.pretrain_lr": (1e-4, []),
    "critic.pretrain_trainable_patterns": ([".*"], []),
    "critic.value_head": ("hl_gauss", []),
    "critic.value_bins": (11, ["critic.value_head=hl_gauss"]),
    "critic.value_range": ([0.0, 1.0], ["critic.value_head=hl_gauss"]),
    "critic.hl_gauss_sigma": (0.5, ["critic.value_head=hl_gauss"]),
    "train.checkpoint_dir": ("/tmp/sao_fields_checkpoints", []),
    "train.steps": (5, []),
    "train.eval_every": (1, []),
    "train.checkpoint_every": (1, []),
    "train.mode": ("async", []),
    "train.micro_batch_size": (2, []),
    "train.logit_chunk": (8, []),
    "mesh.data": (2, MESH),
    "mesh.fsdp": (2, [*MESH, "mesh.data=-1", "mesh.fsdp=1"]),
    "mesh.expert": (2, MESH),
    "mesh.tensor": (2, MESH),
    "mesh.rollout_devices": (4, []),
}
for _section in ("policy", "critic"):
    for _name, _value in (("lr", 0.5), ("weight_decay", 0.1), ("max_grad_norm", 0.01), ("warmup_steps", 3)):
        EFFECTS[f"{_section}.optimizer.{_name}"] = (_value, [])

# Keys that act only while a run runs, in a stage `built` does not build: where each acts, and the
# tests that run that stage with the key set.
ALLOWED_WITHOUT_EFFECT_TEST: dict[str, str] = {
    "model.pretrained": "a Hugging Face folder to load (build_run): tests/train/test_real_inputs.py",
    "model.ragged_dot_triton": "a JAX lowering flag the entry point sets (cli.jax_flags): tests/test_cli.py",
    "env.bad_prompts": "what build_run does with a prompt file's unusable lines (error or skip), so under it one of "
                       "the two builds fails: tests/train/test_prompt_checks.py",
    **{f"sft.{name}": "the SFT stage (train.warm_start.run_sft): tests/train/test_sft.py, tests/train/test_loop_metrics.py"
       for name in ("steps", "target_demonstration_probability", "check_every", "probe_prompts", "batch_size",
                    "weak_demonstration_fraction", "optimizer.lr", "optimizer.weight_decay", "optimizer.max_grad_norm",
                    "optimizer.warmup_steps", "cache_dir")},  # fmt: skip
    "critic.warmup_steps": "the critic's warmup steps before RL step 1 (warm_start.run_critic_warmup): "
                           "tests/train/test_real_inputs.py",
    "critic.pretrain_rollouts": "value pretraining's corpus (run_value_pretraining): tests/train/test_multiprocess.py",
    "critic.pretrain_epochs": "value pretraining's epochs (run_value_pretraining): tests/train/test_multiprocess.py",
    "critic.pretrain_min_usable_fraction": "value pretraining's floor (check_pretraining_corpus): "
                                           "tests/train/test_loop_metrics.py, tests/train/test_dead_environment.py",
    "train.max_steps_without_data": "the RL loop's and the async engine's bound (rl_loop, StreamingBatches): "
                                    "tests/train/test_dead_environment.py",
    "train.batch_size": "the rows each batch source collates (rl_loop): tests/train/test_groups_trace.py",
    "train.keep_checkpoints": "the Checkpointer's retention (train): tests/test_checkpoint.py",
    "train.signal_grace_s": "the bound on a stop after a signal (train.signals): tests/train/test_faults.py",
    "train.max_staleness": "the async rollout engine (StreamingBatches): tests/rollout/test_engine.py",
    "rollout.policy_lag": "the sync batch source's weight versions (LockstepBatches): tests/train/test_policy_lag.py",
    "rollout.policy_lag_spread": "the sync batch source's lag draw (LockstepBatches): tests/train/test_policy_lag.py",
    "train.queue_capacity": "the async rollout engine (StreamingBatches): tests/rollout/test_engine.py",
    **{f"train.probe_{name}": "the advantage probe (train.advantage_probe): tests/train/test_advantage_probe.py"
       for name in ("every", "prompts", "continuations")},
    **{f"scaffold.{name}": "the scaffold loop of env.name=scaffold, which needs a chat model folder "
                           "(build.scaffold_settings, rollout.scaffold): tests/rollout/test_server.py"
       for name in ("entry", "command", "deadline_s", "max_episode_tokens", "episodes_at_once")},
    "train.wandb": "the metrics writer's W&B sink (train): tests/test_wandb.py",
    "train.wandb_project": "the metrics writer's W&B sink (train): tests/test_wandb.py",
}


def test_every_field_has_an_effect_test_or_a_documented_reason():
    listed = set(EFFECTS) | set(ALLOWED_WITHOUT_EFFECT_TEST)
    assert not set(EFFECTS) & set(ALLOWED_WITHOUT_EFFECT_TEST)
    assert set(ALL_KEYS) - listed == set(), "a field with neither an effect test nor a reason"
    assert listed - set(ALL_KEYS) == set(), "listed keys that are not config fields"


@functools.cache
def fixed_models(value_bins: int):
    policy = Policy(tiny_qwen3_moe(), rngs=nnx.Rngs(0))
    return policy, Critic.from_policy(policy, rngs=nnx.Rngs(1), value_bins=value_bins)


def step_jaxprs(config: Config) -> list[str]:
    """The jaxprs of the TTUR step and the value-pretraining update, on a fixed tiny model."""
    policy, critic = fixed_models(config.critic.value_bins_or_scalar)
    policy_tx, critic_tx = make_optimizers(config)
    state, graphs = steps_lib.make_train_state(policy, critic, policy_tx, critic_tx, config, num_prompts=8)
    batch = synthetic_batch()
    if config.advantage.estimator == "trace":
        batch = steps_lib.trace_batch(jax.tree.map(np.asarray, batch), [[5, 6, 7]] * 4)
    key = jax.random.key(0)
    ttur = steps_lib.build_steps(graphs, policy_tx, critic_tx, config).ttur_step
    jaxprs = [str(jax.make_jaxpr(ttur)(state, batch, key))]
    if ADVANTAGE_ESTIMATORS[config.advantage.estimator].gae is not None:  # critic-free rows pretrain no critic
        tx, pretrain = value_pretraining_update(graphs, config)
        pretrain_state = state.replace(critic_opt_state=tx.init(state.critic_params))
        jaxprs.append(str(jax.make_jaxpr(pretrain)(pretrain_state, batch, key)))
    return jaxprs


def run_pieces(config: Config):
    run = build_run(config)
    prompts = [(p.text, p.answer) for p in run.train_prompts + run.eval_prompts]
    loops = []
    for greedy in (False, config.env.eval_greedy):
        loop = run.agent_loop(greedy=greedy)
        loops.append((loop.sampler.log_probs.keywords, loop.sampler.chunk_size, loop.sampler.backend.name,
                      loop.config))  # fmt: skip
    return (run.env_cls, run.env_kwargs, prompts, run.policy.config, run.buckets), loops


def cluster(config: Config):
    c = Cluster.for_config(config)
    return None if c.mesh is None else dict(c.mesh.shape), len(c.rollout_devices)


PIECES = {
    "mesh": cluster,
    "schedule": lambda config: [rl_schedule(config, step) for step in range(1, 9)],
    "checkpoints": checkpoint_dir,
    "run": lambda config: run_pieces(config)[0],
    "agent loops": lambda config: run_pieces(config)[1],
    "step jaxprs": step_jaxprs,
}


def first_difference(base: Config, perturbed: Config) -> str | None:
    for name, piece in PIECES.items():
        if piece(base) != piece(perturbed):
            return name
    return None


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q: {i}+1=?", "answer": str(i + 1), "expression": f"{i}+1"}) + "\n"
                            for i in range(5)))  # fmt: skip
    return str(path)


def test_the_pieces_are_the_same_for_the_same_config():
    config = load_config(None, BASE)
    assert first_difference(config, load_config(None, BASE)) is None


@pytest.mark.parametrize("key", sorted(EFFECTS))
def test_perturbing_a_field_changes_what_the_run_is_built_from(key, prompt_file):
    value, context = EFFECTS[key]
    value = prompt_file if value == "PROMPT_FILE" else value
    base = load_config(None, [*BASE, *context])
    perturbed = load_config(None, [*BASE, *context, f"{key}={json.dumps(value)}"])
    assert perturbed != base, f"{key}={value!r} is its value in the base config: perturb it to another"
    assert first_difference(base, perturbed) is not None, f"{key}={value!r} changed nothing the run is built from"
