"""Typed, frozen run configuration loaded from YAML with `base:` inheritance and CLI overrides.

A config file may name `base: other.yaml` (relative to itself) and then hold only what differs, so an
ablation's whole meaning is a few lines. `key.sub=value` overrides from the command line are applied
last; values are parsed as YAML scalars (`critic.lr=5e-6`, `loss.name=estr`). An unknown key or a wrong
type is one `ConfigError` naming the key, the file and a close match.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from sao_jax.advantages import ADVANTAGE_ESTIMATORS
from sao_jax.optim import CRITIC_FROZEN_ATTENTION_TRAINABLE


class ConfigError(ValueError):
    """A malformed config: says which key, where, and what would fix it."""


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """How advantages and critic targets are computed (ALGORITHMS.md §1–3, §9, §10)."""

    estimator: str = "skip_observation_gae"
    gamma: float = 1.0
    lam_critic: float = 1.0  # decoupled λ: critic targets use λ = 1 (VAPO; SAO)
    lam_policy: float = 0.95  # used when length_adaptive_alpha is None
    length_adaptive_alpha: float | None = 1.5  # λ_policy = 1 − 1/(α·l); SAO uses α = 1.5
    running_mean_window: int = 8
    running_mean_scope: str = "per_prompt"  # or "global"
    group_size: int = 1  # rollouts per prompt; grpo, rloo and trace normalise within each group
    # TRACE turn credit (ALGORITHMS.md §10): horizon K, γ_td, λ_term, α_out, α_turn.
    trace_k: int = 3
    trace_gamma_td: float = 0.8
    trace_lambda_term: float = 2.0
    trace_alpha_out: float = 1.0
    trace_alpha_turn: float = 0.2

    def problems(self) -> list[tuple[str, str]]:
        out = [(n, f"must be in [0, 1] (got {v})") for n, v in
               (("gamma", self.gamma), ("lam_critic", self.lam_critic), ("lam_policy", self.lam_policy))
               if not 0.0 <= v <= 1.0]
        if self.running_mean_scope not in ("per_prompt", "global"):
            out.append(("running_mean_scope", f"must be per_prompt or global (got {self.running_mean_scope!r})"))
        if self.estimator not in ADVANTAGE_ESTIMATORS:
            close = difflib.get_close_matches(self.estimator, ADVANTAGE_ESTIMATORS, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            out.append(("estimator", f"must be one of {', '.join(ADVANTAGE_ESTIMATORS)} (got {self.estimator!r}){hint}"))
        if self.group_size < 1:
            out.append(("group_size", f"must be >= 1 (got {self.group_size})"))
        elif self.group_size < 2 and getattr(ADVANTAGE_ESTIMATORS.get(self.estimator), "grouped", False):
            out.append(("group_size", f"must be >= 2 for estimator {self.estimator} (got {self.group_size})"))
        if self.trace_k < 1:
            out.append(("trace_k", f"must be >= 1 (got {self.trace_k})"))
        return out


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy loss and keep rule (ALGORITHMS.md §4–5)."""

    name: str = "dis"
    eps_low: float = 0.3
    eps_high: float = 5.0
    icepop_alpha: float = 0.5
    icepop_beta: float = 5.0
    estr_tau: float = 1.0
    estr_eps: float = 0.01
    value_clip_eps: float | None = None

    def problems(self) -> list[tuple[str, str]]:
        from sao_jax.losses import POLICY_LOSSES

        if self.name in POLICY_LOSSES:
            return []
        close = difflib.get_close_matches(self.name, POLICY_LOSSES, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        return [("name", f"must be one of {', '.join(POLICY_LOSSES)} (got {self.name!r}){hint}")]


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_steps: int = 0


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    """The critic and TTUR (ALGORITHMS.md §6–8)."""

    updates_per_policy_update: int = 2  # K in TTUR
    warmup_steps: int = 5  # critic-only steps before the first policy update (SAO: 10)
    # Regexes over "/"-joined parameter paths (sao_jax.optim): MoE projections + value head train,
    # attention, embeddings and norms are frozen. "w/o frozen attention" is `[".*"]`.
    trainable_patterns: tuple[str, ...] = CRITIC_FROZEN_ATTENTION_TRAINABLE
    # The embedded default's tiny models take larger steps than SAO's 30B critic (5e-6). Measured on
    # the default job (seed 0): at 1e-3 the explained variance fell from 0.51 after pretraining to
    # ~0.1 within the warmup and RL stayed flat; at 2e-4 it climbed to ~0.4 and success rose.
    optimizer: OptimizerConfig = OptimizerConfig(lr=2e-4)
    pretrain_rollouts: int = 256  # value-pretraining corpus size ("scaled value pretraining" = more)
    pretrain_epochs: int = 4
    pretrain_lr: float = 1e-3
    # What value pretraining trains. None: `trainable_patterns`, the RL set: the critic's attention stays
    # the policy's from its initialisation on, its frozen leaves hold no optimizer state in pretraining
    # either (a critic that fits RL's memory fits pretraining's), and the "w/o frozen attention" ablation
    # pretrains everything too. `[".*"]`: every parameter trains in pretraining, the RL set after it.
    pretrain_trainable_patterns: tuple[str, ...] | None = None

    def problems(self) -> list[tuple[str, str]]:
        k = self.updates_per_policy_update
        return [("updates_per_policy_update", f"must be >= 1 (got {k})")] if k < 1 else []


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    optimizer: OptimizerConfig = OptimizerConfig(lr=1e-4)  # SAO's 30B actor: 1e-6


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The policy's architecture: a preset of `sao_jax.models` (vocab sized to the tokenizer), or a
    Hugging Face folder for `from_pretrained`."""

    preset: str = "cpu_moe"
    pretrained: str | None = None
    # Routing of the MoE layers (None: the preset's). "capacity" drops overflow assignments, differently
    # in decode steps and full forwards: a train/inference mismatch, which keep rules need to matter.
    moe_dispatch: str | None = None
    # Compute and storage dtypes ("float32", "bfloat16", "float16"); None: the preset's, and for a
    # pretrained folder float32 compute with parameters stored in the compute dtype.
    dtype: str | None = None
    param_dtype: str | None = None
    # Recompute each layer's activations in the backward pass (memory for about one extra forward).
    remat: bool = False
    # Attention of full-sequence forwards: "xla" (einsum softmax; [time, time] scores in memory) or
    # "splash" (the Pallas TPU flash kernel; interpreted, slowly, off TPU). None: the preset's ("xla").
    attention: str | None = None

    def problems(self) -> list[tuple[str, str]]:
        from sao_jax.models.config import ATTENTIONS, DTYPES

        out = [(name, f"must be one of {', '.join(DTYPES)} or null (got {value!r})")
               for name, value in (("dtype", self.dtype), ("param_dtype", self.param_dtype))
               if value is not None and value not in DTYPES]  # fmt: skip
        if self.attention is not None and self.attention not in ATTENTIONS:
            out.append(("attention", f"must be one of {', '.join(ATTENTIONS)} or null (got {self.attention!r})"))
        return out


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    name: str = "calculator"
    # Levels to draw uniformly from (a level listed twice counts twice); empty = the env's full mix.
    # The default task weights the calculator toward its longest problems: SFT on them switches the copy
    # skill on in every seed measured (3 of 3 by 400 steps, vs 1 of 3 on the even 1-2-3 mix).
    difficulty: tuple[int, ...] = (2, 3, 3)
    train_prompts: int = 4096  # size of the training prompt pool (per-prompt baselines key on it)
    eval_prompts: int = 128  # held-out prompts, drawn from a separate stream
    eval_greedy: bool = False  # held-out decoding: greedy (top-k 1), or the rollout sampling settings
    # Prompt files (JSONL or Parquet with `prompt`, `answer`): when set they replace the generator.
    train_file: str | None = None
    eval_file: str | None = None
    # Keyword arguments of the environment's constructor (e.g. style_shift's `switches`).
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    num_slots: int = 32  # trajectories decoded together
    max_total_tokens: int = 96
    max_action_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    chunk_size: int = 16
    env_timeout_s: float = 5.0


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    steps: int = 400  # the copy skill switched on between steps ~225 and ~325 in the 3 seeds measured
    batch_size: int = 32
    # Share of demonstrations from a weaker demonstrator (`weak_demonstration` of the env class; the
    # calculator's calls an estimator): the starting policy then sometimes picks the worse tool, and RL
    # must learn that the exact one pays. At 0.5 the warm start succeeds 30-47 % of the time (3 seeds).
    weak_demonstration_fraction: float = 0.5
    optimizer: OptimizerConfig = OptimizerConfig(lr=3e-3, warmup_steps=20)
    # A folder of finished warm starts, keyed by everything SFT depends on (seed, model, env, sft,
    # rollout, mesh): runs that share one (ablation rows of a seed) train it once. None: no cache.
    cache_dir: str | None = None

    def problems(self) -> list[tuple[str, str]]:
        f = self.weak_demonstration_fraction
        return [] if 0.0 <= f <= 1.0 else [("weak_demonstration_fraction", f"must be in [0, 1] (got {f})")]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The RL stage."""

    steps: int = 200
    batch_size: int = 32
    eval_every: int = 25
    checkpoint_every: int = 25
    keep_checkpoints: int = 3
    # Where checkpoints go: None = OUTPUT_DIR/checkpoints. A gs:// URL is written by Orbax directly,
    # with no bucket mount (metrics, TensorBoard and plots still go to output_dir).
    checkpoint_dir: str | None = None
    mode: str = "sync"  # "sync": deterministic lockstep; "async": streaming single rollouts
    max_staleness: int = 4  # async: drop trajectories sampled more than this many versions ago
    queue_capacity: int = 64  # async: finished trajectories waiting for the trainer
    # Memory of a train step (the numbers do not change): rows per micro-batch, their gradients summed
    # (0 = the whole batch at once; must divide the batch), and positions per piece of the policy's
    # logits, each piece made and dropped (0 = the whole sequence's [time, vocab] logits at once).
    micro_batch_size: int = 0
    logit_chunk: int = 0
    wandb: bool = False  # also log every metrics line to Weights & Biases (needs `pip install wandb`)
    wandb_project: str = "sao_jax"

    def problems(self) -> list[tuple[str, str]]:
        out = [(n, f"must be >= 1 (got {v})") for n, v in
               (("batch_size", self.batch_size), ("eval_every", self.eval_every),
                ("checkpoint_every", self.checkpoint_every), ("keep_checkpoints", self.keep_checkpoints))
               if v < 1]  # fmt: skip
        out += [(n, f"must be >= 0 (got {v})") for n, v in
                (("micro_batch_size", self.micro_batch_size), ("logit_chunk", self.logit_chunk)) if v < 0]  # fmt: skip
        if self.micro_batch_size and self.batch_size % self.micro_batch_size:
            out.append(("micro_batch_size", f"must divide batch_size={self.batch_size} (got {self.micro_batch_size})"))
        if self.mode not in ("sync", "async"):
            out.append(("mode", f"must be sync or async (got {self.mode!r})"))
        return out


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh (axes of `sao_jax.models.sharding`); one axis may be -1 = the remaining devices.

    With `rollout_devices` = r > 0 every process keeps its first r devices for its sampler and the
    mesh is built from the rest of every process's devices (`train.distributed.Cluster`): in async mode
    sampling and training then run at once on separate chips.
    """

    data: int = 1
    fsdp: int = -1
    expert: int = 1
    tensor: int = 1
    rollout_devices: int = 0

    def shape(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp, "expert": self.expert, "tensor": self.tensor}

    def problems(self) -> list[tuple[str, str]]:
        sizes = self.shape()
        out = [(n, f"must be >= 1 or -1 (got {v})") for n, v in sizes.items() if v == 0 or v < -1]
        if sum(v == -1 for v in sizes.values()) > 1:
            out.append(("fsdp", "at most one mesh axis may be -1"))
        if self.rollout_devices < 0:
            out.append(("rollout_devices", f"must be >= 0 (got {self.rollout_devices})"))
        return out


@dataclasses.dataclass(frozen=True)
class Config:
    """One run. `seed` and `output_dir` always exist (the CLI contract)."""

    seed: int = 0
    output_dir: str = "runs/default"
    model: ModelConfig = ModelConfig()
    env: EnvConfig = EnvConfig()
    rollout: RolloutConfig = RolloutConfig()
    sft: SFTConfig = SFTConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    loss: LossConfig = LossConfig()
    critic: CriticConfig = CriticConfig()
    policy: PolicyConfig = PolicyConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()

    def problems(self) -> list[tuple[str, str]]:
        group, batch = self.advantage.group_size, self.train.batch_size
        if batch % group:
            return [("train.batch_size", f"must be a multiple of advantage.group_size={group} (got {batch})")]
        return []


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    schema: type = Config,
) -> Any:
    """Read `path` (following `base:` links), apply `key.sub=value` overrides, build `schema`."""
    raw: dict[str, Any] = _read_with_bases(Path(path), seen=()) if path is not None else {}
    source = str(path) if path is not None else "<defaults>"
    if overrides:
        source += " with command-line overrides"
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        _set_dotted(raw, key.strip().split("."), yaml.safe_load(text))
    return _build(schema(), raw, prefix="", source=source)


def to_dict(config: Any) -> dict[str, Any]:
    """Plain nested dict of a config (for YAML dumps, checkpoints and logs)."""
    return dataclasses.asdict(config)


def _read_with_bases(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"config base cycle: {' -> '.join(str(p) for p in (*seen, path))}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    merged = _read_with_bases(path.parent / base, seen=(*seen, path))
    _deep_update(merged, data)
    return merged


def _deep_update(into: dict[str, Any], new: Mapping[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _deep_update(into[key], value)
        else:
            into[key] = value


def _set_dotted(raw: dict[str, Any], keys: list[str], value: Any) -> None:
    node = raw
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {'.'.join(keys)}: {key} is not a section")
    node[keys[-1]] = value


def _build(default: Any, raw: Mapping[str, Any], *, prefix: str, source: str) -> Any:
    """`default` with the keys of `raw` replaced; nested sections recurse from their own defaults."""
    fields = {f.name for f in dataclasses.fields(default)}
    hints = typing.get_type_hints(type(default))
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; known keys: {', '.join(sorted(fields))}"
            raise ConfigError(f"unknown config key {prefix}{key} in {source}{hint}")
    changes = {}
    for name, value in raw.items():
        key = prefix + name
        if dataclasses.is_dataclass(hints[name]):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key} must be a section (mapping) (got {value!r}) in {source}")
            changes[name] = _build(getattr(default, name), value, prefix=key + ".", source=source)
        else:
            changes[name] = _coerce(hints[name], value, key=key, source=source)
    built = dataclasses.replace(default, **changes)
    for name, problem in getattr(built, "problems", lambda: [])():
        raise ConfigError(f"{prefix}{name} {problem} in {source}")
    return built


def _coerce(hint: Any, value: Any, *, key: str, source: str) -> Any:
    def fail(expected: str) -> ConfigError:
        return ConfigError(f"{key} must be {expected} (got {value!r}) in {source}")

    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, key=key, source=source)
            except ConfigError as e:
                errors.append(e)
        raise fail(" or ".join(getattr(o, "__name__", str(o)) for o in options))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise fail("a mapping")
        return dict(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise fail("a list")
        (item_type, _) = typing.get_args(hint)
        return tuple(_coerce(item_type, v, key=f"{key}[{i}]", source=source) for i, v in enumerate(value))
    if hint is bool:
        if not isinstance(value, bool):
            raise fail("true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail("an integer")
        return value
    if hint is float:
        if isinstance(value, str):  # PyYAML reads `1e-6` (no dot) as a string: YAML 1.1's float rule
            try:
                return float(value)
            except ValueError:
                raise fail("a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail("a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise fail("a string")
        return value
    raise ConfigError(f"{key}: unsupported config type {hint!r}")
