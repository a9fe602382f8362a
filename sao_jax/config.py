"""Typed, frozen run configuration loaded from YAML with `base:` inheritance and CLI overrides.

A config file may name `base: other.yaml` (relative to itself) and then hold only what differs, so an
ablation's whole meaning is a few lines. `key.sub=value` overrides from the command line are applied
last; values are parsed as YAML scalars (`critic.lr=5e-6`, `loss.name=estr`). An unknown key or a wrong
type is one `ConfigError` naming the key, the file and a close match.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from sao_jax.advantages import ADVANTAGE_ESTIMATORS
from sao_jax.envs import ENVIRONMENTS
from sao_jax.errors import UserError
from sao_jax.losses import POLICY_LOSSES
from sao_jax.models.config import ATTENTIONS, DTYPES, MOE_DISPATCHES, PRESETS
from sao_jax.optim import CRITIC_FROZEN_ATTENTION_TRAINABLE


VALUE_HEADS = ("scalar", "hl_gauss")


class ConfigError(UserError, ValueError):
    """A malformed config: says which key, where, and what would fix it."""


@dataclasses.dataclass(frozen=True)
class Range:
    """The valid values of a numeric field (of each item, for a tuple): `low <= v` (`low < v` when
    `open_low`) and `v <= high`, or one of `also`. None, where a field allows it, is always valid."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    also: tuple[float, ...] = ()

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            text = f"in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}]"
        elif self.low is not None:
            text = f"{'>' if self.open_low else '>='} {self.low:g}"
        else:
            text = f"<= {self.high:g}"
        return " or ".join([text, *(f"{v:g}" for v in self.also)])

    def holds(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.open_low else value >= self.low)
        return value in self.also or (above and (self.high is None or value <= self.high))


POSITIVE = Range(0, open_low=True)
NON_NEGATIVE = Range(0)
AT_LEAST_1 = Range(1)
UNIT = Range(0, 1)


def ranged(default: Any, valid: Range) -> Any:
    """A dataclass field holding a number in `valid`, checked when a config is loaded."""
    return dataclasses.field(default=default, metadata={"range": valid})


def range_problems(section: Any) -> list[tuple[str, str]]:
    """(field, problem) for each field of `section` whose value is outside its declared `Range`."""
    out = []
    for f in dataclasses.fields(section):
        valid, value = f.metadata.get("range"), getattr(section, f.name)
        if valid is None or value is None:
            continue
        bad = [v for v in (value if isinstance(value, tuple) else (value,)) if not valid.holds(v)]
        if bad:
            out.append((f.name, f"must be {valid}{' (each item)' if isinstance(value, tuple) else ''} (got {value})"))
    return out


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """How advantages and critic targets are computed (docs/algorithms.md §1–3, §9, §10)."""

    estimator: str = "skip_observation_gae"
    gamma: float = ranged(1.0, UNIT)
    lam_critic: float = ranged(1.0, UNIT)  # decoupled λ: critic targets use λ = 1 (VAPO; SAO)
    lam_policy: float = ranged(0.95, UNIT)  # used when length_adaptive_alpha is None
    length_adaptive_alpha: float | None = ranged(1.5, POSITIVE)  # λ_policy = 1 − 1/(α·l); SAO uses α = 1.5
    running_mean_window: int = ranged(8, AT_LEAST_1)
    running_mean_scope: str = "per_prompt"  # or "global"
    group_size: int = ranged(1, AT_LEAST_1)  # rollouts per prompt; grpo, rloo and trace normalise within each group
    # TRACE turn credit (docs/algorithms.md §10): horizon K, γ_td, λ_term, α_out, α_turn.
    trace_k: int = ranged(3, AT_LEAST_1)
    trace_gamma_td: float = ranged(0.8, UNIT)
    trace_lambda_term: float = ranged(2.0, NON_NEGATIVE)
    trace_alpha_out: float = ranged(1.0, NON_NEGATIVE)
    trace_alpha_turn: float = ranged(0.2, NON_NEGATIVE)

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if self.running_mean_scope not in ("per_prompt", "global"):
            out.append(("running_mean_scope", f"must be per_prompt or global (got {self.running_mean_scope!r})"))
        if self.estimator not in ADVANTAGE_ESTIMATORS:
            out.append(("estimator", _not_one_of(self.estimator, ADVANTAGE_ESTIMATORS)))
        elif self.group_size < 2 and ADVANTAGE_ESTIMATORS[self.estimator].grouped:
            out.append(("group_size", f"must be >= 2 for estimator {self.estimator} (got {self.group_size})"))
        return out


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy loss and keep rule (docs/algorithms.md §4–5)."""

    name: str = "dis"
    eps_low: float = ranged(0.3, UNIT)  # keep ratios above 1 − eps_low
    eps_high: float = ranged(5.0, NON_NEGATIVE)  # and below 1 + eps_high
    icepop_alpha: float = ranged(0.5, NON_NEGATIVE)  # icepop keeps train/inference ratios in [α, β]
    icepop_beta: float = ranged(5.0, POSITIVE)
    estr_tau: float = ranged(1.0, POSITIVE)
    estr_eps: float = ranged(0.01, NON_NEGATIVE)
    # PPO value clipping of the critic's RL updates: each of a step's K value updates is clipped to ±ε
    # around the critic's values before the first (so it needs K >= 2). None: no clipping (SAO's).
    value_clip_eps: float | None = ranged(None, POSITIVE)
    # β of the KL penalty toward the frozen warm start, added to every policy loss (losses.kl_penalty).
    # 0: no penalty and no reference copy of the policy (SAO's).
    kl_coef: float = ranged(0.0, NON_NEGATIVE)

    def problems(self) -> list[tuple[str, str]]:
        out = [] if self.name in POLICY_LOSSES else [("name", _not_one_of(self.name, POLICY_LOSSES))]
        if self.icepop_alpha >= self.icepop_beta:
            out.append(("icepop_alpha", f"must be below icepop_beta={self.icepop_beta} (got {self.icepop_alpha})"))
        return out


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW after global-norm clipping; the learning rate rises linearly from 0 over `warmup_steps`
    updates, then stays at `lr`."""

    lr: float = ranged(1e-6, POSITIVE)
    weight_decay: float = ranged(0.0, NON_NEGATIVE)
    max_grad_norm: float = ranged(1.0, POSITIVE)
    warmup_steps: int = ranged(0, NON_NEGATIVE)


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    """The critic and TTUR (docs/algorithms.md §6–8)."""

    updates_per_policy_update: int = ranged(2, AT_LEAST_1)  # K in TTUR
    # Critic-only steps on fresh batches before RL step 1, on top of train.steps (SAO: 10).
    warmup_steps: int = ranged(5, NON_NEGATIVE)
    # Regexes over "/"-joined parameter paths (sao_jax.optim): MoE projections + value head train,
    # attention, embeddings and norms are frozen. "w/o frozen attention" is `[".*"]`.
    trainable_patterns: tuple[str, ...] = CRITIC_FROZEN_ATTENTION_TRAINABLE
    # The embedded default's tiny models take larger steps than SAO's 30B critic (5e-6). Measured on
    # the default job (seed 0): at 1e-3 the explained variance fell from 0.51 after pretraining to
    # ~0.1 within the warmup and RL stayed flat; at 2e-4 it climbed to ~0.4 and success rose.
    optimizer: OptimizerConfig = OptimizerConfig(lr=2e-4)
    # Value-pretraining corpus size ("scaled value pretraining" = more); 0: no value pretraining.
    pretrain_rollouts: int = ranged(256, NON_NEGATIVE)
    pretrain_epochs: int = ranged(4, AT_LEAST_1)
    # The share of the `pretrain_rollouts` that must be usable (the environment did not fail them), and
    # never fewer than one batch (train.batch_size); below it the run stops naming the environment's
    # most frequent error, instead of pretraining the critic on what little is left.
    pretrain_min_usable_fraction: float = ranged(0.5, UNIT)
    pretrain_lr: float = ranged(1e-3, POSITIVE)
    # What value pretraining trains. None (the default): `trainable_patterns`, the RL set. SAO's reason to
    # freeze attention (§3.2: the policy's attention already reads the right tokens; the critic learns
    # what to read out of them) holds before RL as much as during it, the results were measured so, and
    # the "w/o frozen attention" ablation then pretrains every parameter too, changing one thing.
    # `[".*"]`: every parameter trains in pretraining, the RL set after it.
    pretrain_trainable_patterns: tuple[str, ...] | None = None
    # The value head (docs/algorithms.md §6): "scalar" regresses V on the return G with the squared
    # error (SAO's); "hl_gauss" predicts a histogram of `value_bins` equal bins over `value_range`,
    # trained by cross-entropy to the HL-Gauss target of G (Farebrother et al. 2024), V its mean.
    value_head: str = "scalar"
    value_bins: int = ranged(51, Range(2))
    value_range: tuple[float, ...] = ranged((-0.5, 1.5), Range(-1e6, 1e6))  # (low, high): returns outside are clipped into it
    hl_gauss_sigma: float = ranged(0.75, POSITIVE)  # the target's σ, in bin widths (the paper's 0.75)

    def problems(self) -> list[tuple[str, str]]:
        out = [(name, "must name at least one pattern (got [])") for name, patterns in
               (("trainable_patterns", self.trainable_patterns),
                ("pretrain_trainable_patterns", self.pretrain_trainable_patterns)) if patterns == ()]  # fmt: skip
        if self.value_head not in VALUE_HEADS:
            out.append(("value_head", _not_one_of(self.value_head, VALUE_HEADS)))
        if len(self.value_range) != 2 or not self.value_range[0] < self.value_range[1]:
            out.append(("value_range", f"must be [low, high] with low < high (got {list(self.value_range)})"))
        return out

    @property
    def value_bins_or_scalar(self) -> int:
        """The value head's width: `value_bins` for a histogram head, 0 for the scalar one."""
        return self.value_bins if self.value_head == "hl_gauss" else 0


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    optimizer: OptimizerConfig = OptimizerConfig(lr=1e-4)  # SAO's 30B actor: 1e-6


@dataclasses.dataclass(frozen=True)
class RunModelConfig:
    """The run config's `model` section: which architecture the policy has, a preset of
    `sao_jax.models` (vocab sized to the tokenizer) or a Hugging Face folder for `from_pretrained`,
    and overrides of its dtypes, dispatch, remat and attention. The architecture itself is
    `sao_jax.models.ModelConfig`, built from this section."""

    preset: str = "cpu_moe"  # a name in sao_jax.models.PRESETS; unused with `pretrained`
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
    # GPU: lower `jax.lax.ragged_dot` (the "sorted" dispatch) through JAX's Pallas Triton grouped matmul
    # instead of XLA's own lowering (`jax_ragged_dot_use_gpu_pallas_triton_lowering`). A JAX flag: the
    # entry point (`sao-train`, `sao-eval`: `jax_flags`) sets it before anything compiles; other
    # backends ignore it.
    ragged_dot_triton: bool = False

    def problems(self) -> list[tuple[str, str]]:
        choices = (("preset", self.preset, PRESETS), ("moe_dispatch", self.moe_dispatch, MOE_DISPATCHES),
                   ("dtype", self.dtype, DTYPES), ("param_dtype", self.param_dtype, DTYPES),
                   ("attention", self.attention, ATTENTIONS))  # fmt: skip
        return [(name, _not_one_of(value, known, nullable=name != "preset"))
                for name, value, known in choices if value is not None and value not in known]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    name: str = "calculator"  # a name in sao_jax.envs.ENVIRONMENTS
    # Levels to draw uniformly from (a level listed twice counts twice); empty = the env's full mix.
    # The default task weights the calculator toward its longest problems: SFT on them switches the copy
    # skill on in every seed measured (3 of 3 by 400 steps, vs 1 of 3 on the even 1-2-3 mix).
    difficulty: tuple[int, ...] = ranged((2, 3, 3), AT_LEAST_1)
    # Size of the training prompt pool (per-prompt baselines key on it); unused with `train_file`.
    train_prompts: int = ranged(4096, AT_LEAST_1)
    # RL's prompts: the first `rl_prompts` of the training pool (0: all of it). RL's prompt stream, value
    # pretraining, the critic warmup and the advantage probe draw from them; SFT demonstrates the whole
    # pool, so a small pool that recurs in RL keeps the warm start of the full one (results/DESIGN.md,
    # critic suite: SFT on 200 prompts alone memorises them and samples each the same way every time).
    rl_prompts: int = ranged(0, NON_NEGATIVE)
    # Held-out prompts, drawn from a separate stream. 256: the sampling noise of one evaluation (a
    # standard error of ~3 points at 50 % success) stays below the differences a user looks for.
    eval_prompts: int = ranged(256, AT_LEAST_1)
    eval_greedy: bool = False  # held-out decoding: greedy (top-k 1), or the rollout sampling settings
    # Prompt files (JSONL or Parquet with `prompt`, `answer`): when set they replace the generator.
    train_file: str | None = None
    eval_file: str | None = None
    # A prompt of those files that cannot be used (malformed, a character outside the tokenizer, longer than
    # the rollout's or SFT's length): "error" stops the run before any work, naming its file and line;
    # "skip" leaves it out, counts it (`summary.json`'s `skipped_prompts`) and says so in one line.
    bad_prompts: str = "error"
    # Keyword arguments of the environment's constructor (e.g. style_shift's `switches`).
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def problems(self) -> list[tuple[str, str]]:
        out = [] if self.name in ENVIRONMENTS else [("name", _not_one_of(self.name, ENVIRONMENTS))]
        if self.bad_prompts not in ("error", "skip"):
            out.append(("bad_prompts", f"must be error or skip (got {self.bad_prompts!r})"))
        if self.train_file is None and self.rl_prompts > self.train_prompts:
            out.append(("rl_prompts", f"must be at most env.train_prompts={self.train_prompts}, the pool it is the "
                                      f"first prompts of (got {self.rl_prompts})"))  # fmt: skip
        return out


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    num_slots: int = ranged(32, AT_LEAST_1)  # trajectories decoded together
    max_total_tokens: int = ranged(96, AT_LEAST_1)
    max_action_tokens: int = ranged(32, AT_LEAST_1)
    temperature: float = ranged(1.0, POSITIVE)  # greedy decoding is top_k = 1
    top_k: int = ranged(0, NON_NEGATIVE)  # 0: no top-k cut
    top_p: float = ranged(1.0, Range(0, 1, open_low=True))
    chunk_size: int = ranged(16, AT_LEAST_1)
    env_timeout_s: float = ranged(5.0, POSITIVE)
    # What runs the sampler's decode (`sao_jax.rollout.decode`): "xla" (any platform), "native_cpu"
    # (C++ kernels, XLA:CPU only; the same numbers, several times faster there) or "auto" (native_cpu
    # where JAX's backend is the CPU, else xla). Checked against the machine when the run is built.
    decode_backend: str = "auto"
    # Sync mode's deterministic policy lag L (docs/algorithms.md §13): RL step t samples its batch with
    # the policy weights of version t − 1 − L, those after step t − 1 − L (the warm start, version 0,
    # while t − 1 − L < 0), from a ring of the L versions before the current one kept on the host and in
    # every checkpoint. 0: the trainer's current weights, sync mode as it is without a lag.
    policy_lag: int = ranged(0, NON_NEGATIVE)
    # How each trajectory's lag is set: "fixed" (every trajectory L) or "uniform" (each trajectory its
    # own, uniform on 0..L, drawn from the seed and the step: staleness spread as the async engine's is).
    policy_lag_spread: str = "fixed"

    def problems(self) -> list[tuple[str, str]]:
        if self.policy_lag_spread not in ("fixed", "uniform"):
            return [("policy_lag_spread", f"must be fixed or uniform (got {self.policy_lag_spread!r})")]
        return []


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """The warm start: SFT on demonstrations until the policy reproduces held-out ones.

    Every `check_every` steps the policy scores `probe_prompts` held-out gold demonstrations
    (`sft.demonstration_probability`: the chance that sampling writes the demonstration's actions,
    given the gold tool choice); SFT stops at the first check whose mean reaches
    `target_demonstration_probability`, or after `steps` (the cap). A target of 0 runs all `steps`.
    The learning rate warms up, then stays constant: the stopping point, not a schedule, ends SFT.
    """

    steps: int = ranged(1500, NON_NEGATIVE)  # the cap
    target_demonstration_probability: float = ranged(0.8, UNIT)
    check_every: int = ranged(25, AT_LEAST_1)
    probe_prompts: int = ranged(64, AT_LEAST_1)
    batch_size: int = ranged(32, AT_LEAST_1)
    # Share of demonstrations from a weaker demonstrator (`weak_demonstration` of the env class; the
    # calculator's calls an estimator): the starting policy then sometimes picks the worse tool, and RL
    # must learn that the exact one pays.
    weak_demonstration_fraction: float = ranged(0.5, UNIT)
    optimizer: OptimizerConfig = OptimizerConfig(lr=3e-3, warmup_steps=20)
    # A folder of finished warm starts: SFT's policies, keyed by everything SFT depends on (seed, model,
    # env, sft, rollout, mesh), and value pretraining's critics, keyed by that and the critic's settings
    # (`warm_start.value_pretraining_cache_key`): runs that share one (ablation rows of a seed) train it
    # once. None: no cache.
    cache_dir: str | None = None


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The RL stage."""

    steps: int = ranged(200, NON_NEGATIVE)
    batch_size: int = ranged(32, AT_LEAST_1)
    eval_every: int = ranged(25, AT_LEAST_1)
    checkpoint_every: int = ranged(25, AT_LEAST_1)
    keep_checkpoints: int = ranged(3, AT_LEAST_1)
    # Seconds from the first SIGTERM or SIGINT to exit (sao_jax.train.signals): the step in hand is
    # finished and saved within them, else the process exits without that save. Keep it below the
    # platform's notice: Cloud TPU and GCE Spot VMs stop about 30 s after SIGTERM, as GKE does by default.
    signal_grace_s: float = ranged(25.0, POSITIVE)
    # Where checkpoints go: None = OUTPUT_DIR/checkpoints. A gs:// URL is written by Orbax directly,
    # with no bucket mount (metrics, TensorBoard and plots still go to output_dir).
    checkpoint_dir: str | None = None
    mode: str = "sync"  # "sync": deterministic lockstep; "async": streaming single rollouts
    max_staleness: int = ranged(4, NON_NEGATIVE)  # async: drop trajectories sampled more than this many versions ago
    queue_capacity: int = ranged(64, AT_LEAST_1)  # async: finished trajectories waiting for the trainer
    # RL steps in a row without one usable trajectory (every rollout, or a member of every group, failed
    # in the environment) before the run stops with one line naming the environment's most frequent
    # error (exit 3). Async: that many steps' worth of rollouts failing in a row.
    max_steps_without_data: int = ranged(3, AT_LEAST_1)
    # Memory of a train step (the numbers do not change): rows per micro-batch, their gradients summed
    # (0 = the whole batch at once; must divide the batch), and positions per piece of the policy's
    # logits, each piece made and dropped (0 = the whole sequence's [time, vocab] logits at once).
    micro_batch_size: int = ranged(0, NON_NEGATIVE)
    logit_chunk: int = ranged(0, NON_NEGATIVE)
    # The advantage-quality probe (sao_jax.train.advantage_probe): every `probe_every` RL steps, one
    # rollout of each of `probe_prompts` fixed training prompts, and each of its decisions' advantage
    # set against a Monte-Carlo estimate from `probe_continuations` rollouts continued from it. 0 = off:
    # each probe costs about probe_prompts × turns × probe_continuations extra rollouts.
    probe_every: int = ranged(0, NON_NEGATIVE)
    probe_prompts: int = ranged(16, AT_LEAST_1)
    probe_continuations: int = ranged(8, AT_LEAST_1)
    wandb: bool = False  # also log every metrics line to Weights & Biases (needs `pip install wandb`)
    wandb_project: str = "sao_jax"

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if self.micro_batch_size and self.batch_size % self.micro_batch_size:
            out.append(("micro_batch_size", f"must divide batch_size={self.batch_size} (got {self.micro_batch_size})"))
        if self.mode not in ("sync", "async"):
            out.append(("mode", f"must be sync or async (got {self.mode!r})"))
        return out


@dataclasses.dataclass(frozen=True)
class ScaffoldConfig:
    """`env.name=scaffold`: an agent scaffold runs each episode against the policy's OpenAI-compatible
    chat server (`sao_jax.rollout.scaffold`, `sao_jax.rollout.server`). Exactly one of `entry` (a
    `module:function` with signature `run(prompt, base_url, episode_id) -> reward`, run on a thread) and
    `command` (a command line run as a process; its last printed line is the reward)."""

    entry: str | None = None
    command: str | None = None
    # Wall-clock limit of one episode; past it the episode costs its trajectory (counted) and the run goes on.
    deadline_s: float = ranged(600.0, POSITIVE)
    # Most tokens the policy generates in one episode, over all its requests; a scaffold that asks for
    # more costs its trajectory.
    max_episode_tokens: int = ranged(4096, AT_LEAST_1)
    # Episodes run at once by a sync-mode rollout (async mode: the engine's rollout.num_slots workers);
    # their requests share the sampler's rollout.num_slots rows.
    episodes_at_once: int = ranged(8, AT_LEAST_1)

    def problems(self) -> list[tuple[str, str]]:
        if self.entry is not None and not re.fullmatch(r"[\w.]+:[\w.]+", self.entry):
            return [("entry", f"must be module:function, e.g. sao_jax.envs.toy_repo:smolagents_episode (got "
                              f"{self.entry!r})")]  # fmt: skip
        return []


_MESH_AXIS = Range(1, also=(-1,))


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh (axes of `sao_jax.models.sharding`); one axis may be -1 = the remaining devices.

    With `rollout_devices` = r > 0 every process keeps its first r devices for its sampler and the
    mesh is built from the rest of every process's devices (`train.distributed.Cluster`): in async mode
    sampling and training then run at once on separate chips.
    """

    data: int = ranged(1, _MESH_AXIS)
    fsdp: int = ranged(-1, _MESH_AXIS)
    expert: int = ranged(1, _MESH_AXIS)
    tensor: int = ranged(1, _MESH_AXIS)
    rollout_devices: int = ranged(0, NON_NEGATIVE)

    def shape(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp, "expert": self.expert, "tensor": self.tensor}

    def problems(self) -> list[tuple[str, str]]:
        return [("fsdp", "at most one mesh axis may be -1")] if list(self.shape().values()).count(-1) > 1 else []


@dataclasses.dataclass(frozen=True)
class Config:
    """One run. `seed` and `output_dir` always exist (the CLI contract)."""

    seed: int = ranged(0, NON_NEGATIVE)
    output_dir: str = "runs/default"
    model: RunModelConfig = RunModelConfig()
    env: EnvConfig = EnvConfig()
    rollout: RolloutConfig = RolloutConfig()
    sft: SFTConfig = SFTConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    loss: LossConfig = LossConfig()
    critic: CriticConfig = CriticConfig()
    policy: PolicyConfig = PolicyConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()
    scaffold: ScaffoldConfig = ScaffoldConfig()

    def problems(self) -> list[tuple[str, str]]:
        out = []
        group, batch = self.advantage.group_size, self.train.batch_size
        if batch % group:
            out.append(("train.batch_size", f"must be a multiple of advantage.group_size={group} (got {batch})"))
        rollouts = self.critic.pretrain_rollouts
        if 0 < rollouts < batch:
            out.append(("critic.pretrain_rollouts", f"must be 0 or at least train.batch_size={batch}, one value "
                                                    f"pretraining batch (got {rollouts})"))  # fmt: skip
        if self.train.probe_every:
            estimator = ADVANTAGE_ESTIMATORS.get(self.advantage.estimator)
            if estimator is not None and estimator.grouped:
                out.append(("train.probe_every", f"the advantage probe needs an estimator that gives one rollout an "
                                                 f"advantage; {self.advantage.estimator} compares a group"))  # fmt: skip
            if self.advantage.gamma != 1.0:
                out.append(("train.probe_every", f"the advantage probe's Monte-Carlo estimate is undiscounted: it needs "
                                                 f"advantage.gamma = 1 (got {self.advantage.gamma})"))  # fmt: skip
        if self.env.name == "scaffold":
            out += self._scaffold_problems()
        if self.rollout.policy_lag and self.train.mode != "sync":
            out.append(("rollout.policy_lag", f"is sync mode's lag (train.mode=sync); async mode's staleness comes "
                                              f"from its engine (got train.mode={self.train.mode})"))  # fmt: skip
        k = self.critic.updates_per_policy_update
        if self.loss.value_clip_eps is not None and k < 2:
            out.append(("loss.value_clip_eps", f"needs critic.updates_per_policy_update >= 2: the clip is around the "
                                               f"critic before a step's first update (got K={k})"))  # fmt: skip
        if self.loss.value_clip_eps is not None and self.critic.value_head != "scalar":
            out.append(("loss.value_clip_eps", f"clips a scalar value head's squared error; critic.value_head="
                                               f"{self.critic.value_head} has no value clipping (set it to null)"))  # fmt: skip
        return out


    def _scaffold_problems(self) -> list[tuple[str, str]]:
        """What `env.name=scaffold` needs: one way to run an episode, a chat template, no SFT, no probe."""
        out = []
        if (self.scaffold.entry is None) == (self.scaffold.command is None):
            out.append(("scaffold.entry", "or scaffold.command (exactly one) must be set with env.name=scaffold"))
        if self.model.pretrained is None:
            out.append(("model.pretrained", "must name a Hugging Face folder with a chat template for "
                                            "env.name=scaffold: the scaffold speaks to the model in chat messages"))
        if self.sft.steps:
            out.append(("sft.steps", f"must be 0 with env.name=scaffold: a scaffold has no demonstrations "
                                     f"(got {self.sft.steps})"))
        if self.train.probe_every:
            out.append(("train.probe_every", "must be 0 with env.name=scaffold: the probe replays environment steps"))
        return out


def _not_one_of(value: Any, known: Any, *, nullable: bool = False) -> str:
    """"must be one of …" for a name not in `known`, with the closest known name."""
    close = difflib.get_close_matches(str(value), list(known), n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"must be one of {', '.join(known)}{' or null' if nullable else ''} (got {value!r}){hint}"


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
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"the value of override {item!r} is not valid YAML ({_yaml_problem(e)})") from None
        _set_dotted(raw, key.strip().split("."), value)
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
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML ({_yaml_problem(e)}) ({path})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    merged = _read_with_bases(path.parent / base, seen=(*seen, path))
    _deep_update(merged, data)
    return merged


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's error in a few words, with the line and column where it was found."""
    problem = getattr(error, "problem", None) or type(error).__name__
    mark = getattr(error, "problem_mark", None)
    return problem if mark is None else f"{problem}, line {mark.line + 1} column {mark.column + 1}"


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
    for name, problem in range_problems(built) + getattr(built, "problems", lambda: [])():
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
