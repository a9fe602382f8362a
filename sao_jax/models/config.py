"""Model configuration: one frozen dataclass for the Qwen3-MoE and GLM-4.5-MoE decoder families.

`ModelConfig` names what the decoder needs in our words; `from_hf` / `to_hf` translate from and to
the `config.json` of a Hugging Face checkpoint (`Qwen3MoeForCausalLM`, `Glm4MoeForCausalLM`) as
transformers 4.x and 5.x write it (docs/hf_config.md: every key, both spellings, the defaults).
The two families differ only by data here:

| feature                  | Qwen3-MoE                         | GLM-4.5-MoE                              |
|--------------------------|-----------------------------------|------------------------------------------|
| router score             | softmax over experts              | sigmoid, + `e_score_correction_bias` for choice |
| expert groups            | none                              | `n_group` / `topk_group`                 |
| shared experts           | none                              | `n_shared_experts`                       |
| dense layers             | `mlp_only_layers`, `decoder_sparse_step` | first `first_k_dense_replace` layers |
| rotary dims              | all of `head_dim`                 | first `partial_rotary_factor * head_dim` |
| q/k RMSNorm per head     | always                            | `use_qk_norm`                            |
| attention bias           | q, k, v and o (`attention_bias`)  | q, k, v only (`attention_bias`)          |
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import jax.numpy as jnp

ROUTER_SCORINGS = ("softmax", "sigmoid")
MOE_DISPATCHES = ("dense", "sorted", "capacity", "blocked", "gmm")
ATTENTIONS = ("xla", "splash")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class ModelConfigError(ValueError):
    """A model configuration (ours or a Hugging Face `config.json`) that we cannot use."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and behaviour of a decoder-only MoE transformer.

    A layer `i` is a MoE layer iff `num_experts > 0`, `i >= first_dense_layers`,
    `i not in dense_layers` and `(i + 1) % moe_layer_step == 0` (see `is_moe_layer`); otherwise its
    MLP is a dense SwiGLU of width `intermediate_size`.

    Routing of a token x with router logits z = x·W_router (float32):
      s = softmax(z) or sigmoid(z)                           (`router_scoring`)
      choice = s + b  (b = `e_score_correction_bias` iff `router_correction_bias`, else 0),
               restricted to the `num_selected_groups` best of `num_expert_groups` groups
      E_top = top-`num_experts_per_token` experts of `choice`
      w_e = s_e / Σ_{E_top} s (iff `norm_topk_prob`) · `routed_scaling_factor`
    MoE output = Σ_{e∈E_top} w_e · SwiGLU_e(x) + SwiGLU_shared(x) (shared width
    `num_shared_experts * moe_intermediate_size`, absent when 0).

    `router_aux_loss_coef` is carried for the trainer (the model returns the raw aux loss).
    `moe_dispatch`: "dense" (every expert on every token; the readable reference), "sorted"
    (tokens sorted by expert, `jax.lax.ragged_dot`), "gmm" (the same sorted tokens through the
    Pallas megablox grouped matmul, for TPUs; under a mesh, a `shard_map` over the token and
    `expert` mesh axes), "blocked" (tokens grouped by expert in fixed-size blocks of batched matmuls) —
    these four give the same numbers — or "capacity" (each
    expert has ceil(`moe_capacity_factor` · tokens · k / num_experts) slots per call; assignments
    beyond that are dropped, so a token's output then depends on the other tokens of the call).
    `moe_kernel_interpret`: run the "gmm" kernel in Pallas interpret mode (exact and slow: for tests
    and CPU runs; the kernel compiles only for TPU otherwise).
    `dtype` is the compute dtype, `param_dtype` the storage dtype of parameters.
    `remat`: recompute each layer's intermediates in the backward pass (`jax.checkpoint` per layer)
    instead of keeping them, so training keeps only the layer inputs — the [batch, time, embed]
    residual stream per layer — for about one extra forward of compute. No effect on the numbers.
    `attention` of full-sequence forwards (training, prefill without a cache): "xla" (the einsum
    softmax, [time, time] scores in memory) or "splash" (the Pallas TPU flash kernel, which never
    stores the scores). Cached decoding ignores it (`layers.cached_attention`, or what the caller's
    `layers.DecodeKernels` run instead).
    `attention_kernel_interpret`: run the "splash" kernel in Pallas interpret mode (exact and slow:
    for tests and CPU runs, where `sao-train` sets it; the kernel compiles only for TPU otherwise).
    """

    model_type: str  # "qwen3_moe" | "glm4_moe": which Hugging Face family this maps to
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # width of the dense (non-MoE) MLP layers
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0  # fraction of head_dim that is rotated (its first dims)
    qk_norm: bool = True  # RMSNorm over head_dim on q and k before RoPE
    attention_bias: bool = False  # bias on q, k, v projections
    o_proj_bias: bool = False  # bias on the output projection
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    # mixture of experts
    num_experts: int = 0
    num_experts_per_token: int = 1
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    norm_topk_prob: bool = True
    router_scoring: str = "softmax"
    router_correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    num_expert_groups: int = 1
    num_selected_groups: int = 1
    first_dense_layers: int = 0
    dense_layers: tuple[int, ...] = ()
    moe_layer_step: int = 1
    router_aux_loss_coef: float = 0.0
    num_mtp_layers: int = 0  # GLM multi-token-prediction layers: stored in checkpoints, unused here
    # computation
    moe_dispatch: str = "sorted"
    moe_capacity_factor: float = 1.25  # slots per expert relative to an even split (capacity dispatch)
    moe_kernel_interpret: bool = False  # "gmm" in Pallas interpret mode (off TPU)
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False
    attention: str = "xla"
    attention_kernel_interpret: bool = False  # "splash" in Pallas interpret mode (off TPU)

    def __post_init__(self):
        object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"ModelConfig.{name} must be >= 1 (got {getattr(self, name)})")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ModelConfigError(
                f"ModelConfig.partial_rotary_factor * head_dim must be an even number >= 2 "
                f"(got {self.partial_rotary_factor} * {self.head_dim})"
            )
        _check_choice("router_scoring", self.router_scoring, ROUTER_SCORINGS)
        _check_choice("moe_dispatch", self.moe_dispatch, MOE_DISPATCHES)
        _check_choice("attention", self.attention, ATTENTIONS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("param_dtype", self.param_dtype, DTYPES)
        if self.num_experts:
            if not 1 <= self.num_experts_per_token <= self.num_experts:
                raise ModelConfigError(
                    f"ModelConfig.num_experts_per_token must be in [1, num_experts={self.num_experts}] "
                    f"(got {self.num_experts_per_token})"
                )
            if self.moe_intermediate_size < 1:
                raise ModelConfigError("ModelConfig.moe_intermediate_size must be >= 1 when num_experts > 0")
            if self.num_experts % self.num_expert_groups:
                raise ModelConfigError(
                    f"ModelConfig.num_experts ({self.num_experts}) must be a multiple of "
                    f"num_expert_groups ({self.num_expert_groups})"
                )
            if not 1 <= self.num_selected_groups <= self.num_expert_groups:
                raise ModelConfigError(
                    f"ModelConfig.num_selected_groups must be in [1, num_expert_groups={self.num_expert_groups}] "
                    f"(got {self.num_selected_groups})"
                )
            if self.num_expert_groups > 1 and self.num_experts // self.num_expert_groups < 2:
                raise ModelConfigError("ModelConfig: group-limited routing needs >= 2 experts per group")
        if self.moe_capacity_factor <= 0:
            raise ModelConfigError(f"ModelConfig.moe_capacity_factor must be > 0 (got {self.moe_capacity_factor})")
        if self.moe_layer_step < 1:
            raise ModelConfigError(f"ModelConfig.moe_layer_step must be >= 1 (got {self.moe_layer_step})")

    @property
    def rotary_dim(self) -> int:
        """Number of leading head dims that RoPE rotates (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def weight_dtype(self):
        return DTYPES[self.param_dtype]

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer >= self.first_dense_layers
            and layer not in self.dense_layers
            and (layer + 1) % self.moe_layer_step == 0
        )

    def replace(self, **changes) -> ModelConfig:
        """A copy with `changes`; an unknown field name is an error naming the closest field."""
        fields = {f.name for f in dataclasses.fields(self)}
        for key in changes:
            if key not in fields:
                raise ModelConfigError(f"ModelConfig has no field {key!r}{_did_you_mean(key, fields)}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], **overrides) -> ModelConfig:
        """Our config from a Hugging Face `config.json` dict; `overrides` set our own fields (dtype, ...).

        Reads the spellings of both transformers generations (4.x: `num_experts`, `rope_theta`;
        5.x: `num_local_experts`, `rope_parameters.rope_theta`, ...). A key absent in every spelling
        takes the default of the config class of the transformers that wrote the file
        (`transformers_version`: 4.x or 5.x), except the keys that set shapes, which have no
        default (the class defaults are one published model's sizes). Without a known
        `transformers_version` an absent key is an error naming it. docs/hf_config.md lists every
        key read, its spellings and defaults.
        """
        model_type = hf.get("model_type")
        if model_type not in _FAMILIES:
            raise ModelConfigError(
                f"unsupported model_type {model_type!r} in config.json; supported: {sorted(_FAMILIES)}"
            )
        read = _Reader(hf, _FAMILIES[model_type].keys)
        if read("hidden_act") != "silu":
            raise ModelConfigError(f"config.json hidden_act={read('hidden_act')!r} is not supported (only 'silu')")
        scaling = hf.get("rope_scaling")
        untyped_scaling = bool(scaling) and not (isinstance(scaling, dict) and {"rope_type", "type"} & set(scaling))
        if read("rope_type") != "default" or untyped_scaling:
            rope = {key: hf[key] for key in ("rope_scaling", "rope_parameters") if hf.get(key) is not None}
            raise ModelConfigError(f"config.json RoPE {rope} is not supported (only rope_type 'default')")
        common = dict(
            model_type=model_type,
            vocab_size=read("vocab_size"),
            hidden_size=read("hidden_size"),
            num_layers=read("num_hidden_layers"),
            num_heads=read("num_attention_heads"),
            num_kv_heads=read("num_key_value_heads"),
            head_dim=read("head_dim") or read("hidden_size") // read("num_attention_heads"),
            intermediate_size=read("intermediate_size"),
            rope_theta=float(read("rope_theta")),
            rms_norm_eps=float(read("rms_norm_eps")),
            tie_word_embeddings=bool(read("tie_word_embeddings")),
            max_position_embeddings=read("max_position_embeddings"),
            initializer_range=float(read("initializer_range")),
            attention_bias=bool(read("attention_bias")),
            moe_intermediate_size=read("moe_intermediate_size"),
            num_experts_per_token=read("num_experts_per_tok"),
            norm_topk_prob=bool(read("norm_topk_prob")),
        )
        return cls(**common, **_FAMILIES[model_type].from_hf(read)).replace(**overrides)

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict (with `architectures`) that transformers 4.57 and 5.x
        load to the same model: where the generations spell a key differently (`rope_theta` /
        `rope_parameters`, `torch_dtype` / `dtype`, `num_experts` / `num_local_experts`), it
        holds both spellings."""
        family = _FAMILIES[self.model_type]
        family_keys = family.to_hf(self)
        rope_parameters = dict(rope_type="default", rope_theta=self.rope_theta)
        if "partial_rotary_factor" in family_keys:
            rope_parameters["partial_rotary_factor"] = family_keys["partial_rotary_factor"]
        hf = dict(
            architectures=[family.architecture],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            hidden_act="silu",
            rope_theta=self.rope_theta,
            rope_scaling=None,
            rope_parameters=rope_parameters,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.initializer_range,
            attention_bias=self.attention_bias,
            moe_intermediate_size=self.moe_intermediate_size,
            num_experts_per_tok=self.num_experts_per_token,
            norm_topk_prob=self.norm_topk_prob,
            torch_dtype=self.param_dtype,
            dtype=self.param_dtype,
        )
        return {**hf, **family_keys}


def _check_choice(name: str, value: str, choices) -> None:
    if value not in choices:
        raise ModelConfigError(f"ModelConfig.{name} must be one of {sorted(choices)} (got {value!r})")


def _did_you_mean(key: str, names) -> str:
    close = difflib.get_close_matches(key, sorted(names), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _require(config: ModelConfig, model_type: str, **expected) -> None:
    """Raise if `config` uses a feature that `model_type`'s config.json cannot express."""
    for name, value in expected.items():
        if getattr(config, name) != value:
            raise ModelConfigError(
                f"ModelConfig.{name}={getattr(config, name)!r} cannot be written as a {model_type} "
                f"config.json (it needs {value!r})"
            )


# --- reading config.json: every key, its spellings in transformers 4.x and 5.x, its default -----

_REQUIRED = "required"  # no default: the key sets a shape, and the config classes' defaults are a published model's
_WRITERS = ("4", "5")  # major versions of transformers whose config classes' defaults `_Key` holds


@dataclasses.dataclass(frozen=True)
class _Key:
    """A quantity of config.json: its spellings (4.x's first; "a.b" is key b of the dict at key a)
    and its default when every spelling is absent or null — one value when the config classes of
    transformers 4.57.1 and 5.24.0 agree, {"4": ..., "5": ...} when they differ, or _REQUIRED."""

    spellings: tuple[str, ...]
    default: Any = _REQUIRED


def _keys(rms_norm_eps, max_position_embeddings, norm_topk_prob, **family) -> dict[str, _Key]:
    """Both families' keys (with the family's class defaults) and `family`'s own."""
    keys = dict(
        vocab_size=_Key(("vocab_size",)),
        hidden_size=_Key(("hidden_size",)),
        num_hidden_layers=_Key(("num_hidden_layers",)),
        num_attention_heads=_Key(("num_attention_heads",)),
        num_key_value_heads=_Key(("num_key_value_heads",)),
        head_dim=_Key(("head_dim",), None),  # absent: hidden_size // num_attention_heads, as the modeling code
        intermediate_size=_Key(("intermediate_size",)),
        moe_intermediate_size=_Key(("moe_intermediate_size",)),
        num_experts_per_tok=_Key(("num_experts_per_tok",)),
        hidden_act=_Key(("hidden_act",), "silu"),
        rope_theta=_Key(("rope_theta", "rope_parameters.rope_theta"), 10000.0),
        rope_type=_Key(("rope_scaling.rope_type", "rope_scaling.type", "rope_parameters.rope_type"), "default"),
        rms_norm_eps=_Key(("rms_norm_eps",), rms_norm_eps),
        tie_word_embeddings=_Key(("tie_word_embeddings",), False),
        max_position_embeddings=_Key(("max_position_embeddings",), max_position_embeddings),
        initializer_range=_Key(("initializer_range",), 0.02),
        attention_bias=_Key(("attention_bias",), False),
        norm_topk_prob=_Key(("norm_topk_prob",), norm_topk_prob),
    )
    return {**keys, **family}


class _Reader:
    """`read(name)`: the value of key `name` of a config.json dict, in whichever spelling it has."""

    def __init__(self, hf: dict[str, Any], keys: dict[str, _Key]):
        self.hf, self.keys = hf, keys
        self.version = hf.get("transformers_version")
        self.writer = None if self.version is None else str(self.version).split(".")[0]

    def _lookup(self, spelling: str):
        value = self.hf
        for part in spelling.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return value

    def __call__(self, name: str):
        key = self.keys[name]
        found = {spelling: value for spelling in key.spellings if (value := self._lookup(spelling)) is not None}
        values = list(found.values())
        if any(value != values[0] for value in values):
            given = " and ".join(f"{spelling}={value!r}" for spelling, value in found.items())
            raise ModelConfigError(f"config.json gives {given}: they must agree")
        if values:
            return values[0]
        named = " or ".join(repr(spelling) for spelling in key.spellings)
        if key.default is _REQUIRED:
            raise ModelConfigError(f"config.json has no {named}: it sets the model's shapes and has no default")
        if self.writer in _WRITERS:
            return key.default[self.writer] if isinstance(key.default, dict) else key.default
        writer = "no transformers_version" if self.version is None else f"transformers_version {self.version!r}"
        raise ModelConfigError(
            f"config.json has no {named}, and {writer} says whose default to take (known: 4.x, 5.x)"
        )


# --- the two families: their keys and the translation to and from our fields ---------------------


@dataclasses.dataclass(frozen=True)
class _Family:
    architecture: str
    keys: dict[str, _Key]
    from_hf: Any  # read (a _Reader) -> our family-specific fields
    to_hf: Any  # ModelConfig -> family-specific hf keys


def _qwen3_moe_from_hf(read):
    if read("use_sliding_window"):
        raise ModelConfigError("config.json use_sliding_window=true is not supported")
    return dict(
        num_experts=read("num_experts"),
        router_scoring="softmax",
        qk_norm=True,
        o_proj_bias=bool(read("attention_bias")),
        dense_layers=tuple(read("mlp_only_layers")),
        moe_layer_step=read("decoder_sparse_step"),
        router_aux_loss_coef=float(read("router_aux_loss_coef")),
    )


def _qwen3_moe_to_hf(c: ModelConfig):
    _require(
        c, "qwen3_moe", router_scoring="softmax", router_correction_bias=False, num_shared_experts=0,
        routed_scaling_factor=1.0, num_expert_groups=1, num_selected_groups=1, first_dense_layers=0,
        partial_rotary_factor=1.0, qk_norm=True, o_proj_bias=c.attention_bias, num_mtp_layers=0,
    )  # fmt: skip
    return dict(
        num_experts=c.num_experts,
        num_local_experts=c.num_experts,
        mlp_only_layers=list(c.dense_layers),
        decoder_sparse_step=c.moe_layer_step,
        router_aux_loss_coef=c.router_aux_loss_coef,
        use_sliding_window=False,
    )


def _glm4_moe_from_hf(read):
    return dict(
        num_experts=read("n_routed_experts"),
        router_scoring="sigmoid",
        router_correction_bias=True,
        num_shared_experts=read("n_shared_experts"),
        routed_scaling_factor=float(read("routed_scaling_factor")),
        num_expert_groups=read("n_group"),
        num_selected_groups=read("topk_group"),
        first_dense_layers=read("first_k_dense_replace"),
        partial_rotary_factor=float(read("partial_rotary_factor")),
        qk_norm=bool(read("use_qk_norm")),
        o_proj_bias=False,
        num_mtp_layers=read("num_nextn_predict_layers"),
    )


def _glm4_moe_to_hf(c: ModelConfig):
    _require(
        c, "glm4_moe", router_scoring="sigmoid", router_correction_bias=True, dense_layers=(),
        moe_layer_step=1, o_proj_bias=False,
    )  # fmt: skip
    if c.num_shared_experts < 1:
        raise ModelConfigError("ModelConfig.num_shared_experts must be >= 1 for glm4_moe (HF always builds them)")
    return dict(
        n_routed_experts=c.num_experts,
        n_shared_experts=c.num_shared_experts,
        routed_scaling_factor=c.routed_scaling_factor,
        n_group=c.num_expert_groups,
        topk_group=c.num_selected_groups,
        first_k_dense_replace=c.first_dense_layers,
        partial_rotary_factor=c.partial_rotary_factor,
        use_qk_norm=c.qk_norm,
        num_nextn_predict_layers=c.num_mtp_layers,
    )


_FAMILIES = {
    "qwen3_moe": _Family(
        architecture="Qwen3MoeForCausalLM",
        keys=_keys(
            rms_norm_eps=1e-6, max_position_embeddings=32768, norm_topk_prob=False,
            num_experts=_Key(("num_experts", "num_local_experts")),
            use_sliding_window=_Key(("use_sliding_window",), False),
            mlp_only_layers=_Key(("mlp_only_layers",), []),
            decoder_sparse_step=_Key(("decoder_sparse_step",), 1),
            router_aux_loss_coef=_Key(("router_aux_loss_coef",), 0.001),
        ),  # fmt: skip
        from_hf=_qwen3_moe_from_hf,
        to_hf=_qwen3_moe_to_hf,
    ),
    "glm4_moe": _Family(
        architecture="Glm4MoeForCausalLM",
        keys=_keys(
            rms_norm_eps=1e-5, max_position_embeddings=131072, norm_topk_prob=True,
            n_routed_experts=_Key(("n_routed_experts", "num_local_experts")),
            n_shared_experts=_Key(("n_shared_experts",)),
            first_k_dense_replace=_Key(("first_k_dense_replace",)),
            routed_scaling_factor=_Key(("routed_scaling_factor",), 1.0),
            n_group=_Key(("n_group",), 1),
            topk_group=_Key(("topk_group",), 1),
            partial_rotary_factor=_Key(("partial_rotary_factor", "rope_parameters.partial_rotary_factor"), 0.5),
            use_qk_norm=_Key(("use_qk_norm",), False),
            # 4.x has no such field (and skips the MTP layers' tensors); 5.x's num_mtp_layers defaults to 1
            num_nextn_predict_layers=_Key(("num_nextn_predict_layers", "num_mtp_layers"), {"4": 0, "5": 1}),
        ),  # fmt: skip
        from_hf=_glm4_moe_from_hf,
        to_hf=_glm4_moe_to_hf,
    ),
}


# --- presets -------------------------------------------------------------------------------------


def tiny_qwen3_moe(**overrides) -> ModelConfig:
    """A few-thousand-parameter Qwen3-MoE for tests: layer 0 dense, layer 1 MoE (4 experts, top 2)."""
    config = ModelConfig(
        model_type="qwen3_moe", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=8, intermediate_size=48, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=256,
        num_experts=4, num_experts_per_token=2, moe_intermediate_size=16, norm_topk_prob=True,
        dense_layers=(0,), router_aux_loss_coef=0.001,
    )  # fmt: skip
    return config.replace(**overrides)


def tiny_glm4_moe(**overrides) -> ModelConfig:
    """A tiny GLM-4.5-MoE for tests: layer 0 dense, layers 1-2 MoE (8 experts in 4 groups, top 2,
    1 shared expert), partial rotary 0.5, q/k norm, attention bias, routed scaling 2.5."""
    config = ModelConfig(
        model_type="glm4_moe", vocab_size=97, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=48, rope_theta=10000.0, partial_rotary_factor=0.5, qk_norm=True,
        attention_bias=True, rms_norm_eps=1e-5, max_position_embeddings=256, num_experts=8,
        num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1, norm_topk_prob=True,
        router_scoring="sigmoid", router_correction_bias=True, routed_scaling_factor=2.5,
        num_expert_groups=4, num_selected_groups=2, first_dense_layers=1,
    )  # fmt: skip
    return config.replace(**overrides)


def cpu_moe(vocab_size: int = 128, **overrides) -> ModelConfig:
    """The main job's model on 2 CPU cores (~1.4M parameters, ~0.5M active per token):
    Qwen3-style, 4 layers of width 128, 8 experts of width 96 with top-2 routing. Blocked dispatch:
    the fastest exact one on the CPU, near the dense model with the same active parameters
    (`ragged_dot` lowers on CPU to a masked dense matmul); the capacity dispatch drops assignments,
    differently in decode steps and full forwards: a train/inference mismatch (timings and the
    dropped share: benchmarks/RESULTS.md, "Model forward and backward")."""
    config = ModelConfig(
        model_type="qwen3_moe", vocab_size=vocab_size, hidden_size=128, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=32, intermediate_size=256, rope_theta=10000.0, rms_norm_eps=1e-6,
        max_position_embeddings=2048, tie_word_embeddings=True, num_experts=8, num_experts_per_token=2,
        moe_intermediate_size=96, norm_topk_prob=True, router_aux_loss_coef=0.01, moe_dispatch="blocked",
    )  # fmt: skip
    return config.replace(**overrides)


def qwen3_30b_a3b(**overrides) -> ModelConfig:
    """Shapes of Qwen/Qwen3-30B-A3B (its config.json). For memory plans; too big to build in tests."""
    config = ModelConfig(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, intermediate_size=6144, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        max_position_embeddings=40960, num_experts=128, num_experts_per_token=8, moe_intermediate_size=768,
        norm_topk_prob=True, router_aux_loss_coef=0.001, dtype="bfloat16", param_dtype="bfloat16",
    )  # fmt: skip
    return config.replace(**overrides)


def glm45_air(**overrides) -> ModelConfig:
    """Shapes of zai-org/GLM-4.5-Air (its config.json). For memory plans; too big to build in tests."""
    config = ModelConfig(
        model_type="glm4_moe", vocab_size=151552, hidden_size=4096, num_layers=46, num_heads=96,
        num_kv_heads=8, head_dim=128, intermediate_size=10944, rope_theta=1_000_000.0,
        partial_rotary_factor=0.5, qk_norm=False, attention_bias=True, rms_norm_eps=1e-5,
        max_position_embeddings=131072, num_experts=128, num_experts_per_token=8, moe_intermediate_size=1408,
        num_shared_experts=1, norm_topk_prob=True, router_scoring="sigmoid", router_correction_bias=True,
        routed_scaling_factor=1.0, num_expert_groups=1, num_selected_groups=1, first_dense_layers=1,
        num_mtp_layers=1, dtype="bfloat16", param_dtype="bfloat16",
    )  # fmt: skip
    return config.replace(**overrides)


PRESETS = {"cpu_moe": cpu_moe, "tiny_qwen3_moe": tiny_qwen3_moe, "tiny_glm4_moe": tiny_glm4_moe,
           "qwen3_30b_a3b": qwen3_30b_a3b, "glm45_air": glm45_air}  # fmt: skip
"""The config's `model.preset` names: each `(vocab_size=…, **overrides) -> ModelConfig`."""


# --- parameter counts ----------------------------------------------------------------------------


def param_count(config: ModelConfig, *, active: bool = False, kind: str = "policy") -> int:
    """Number of trained parameters of a Policy (`kind="policy"`) or Critic (`kind="critic"`).

    `active=True` counts only what one token uses: `num_experts_per_token` routed experts instead of
    all `num_experts` (the count behind "A3B" and behind MFU's 6·N_active·tokens). Buffers such as
    `e_score_correction_bias` are not parameters and are not counted.
    """
    if kind not in ("policy", "critic"):
        raise ModelConfigError(f"param_count kind must be 'policy' or 'critic' (got {kind!r})")
    d, h, kv, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    attention = d * h * hd + 2 * d * kv * hd + h * hd * d
    attention += (h * hd + 2 * kv * hd) * config.attention_bias + d * config.o_proj_bias + 2 * hd * config.qk_norm
    experts_used = config.num_experts_per_token if active else config.num_experts
    moe = (
        d * config.num_experts  # router
        + experts_used * 3 * d * config.moe_intermediate_size
        + config.num_shared_experts * 3 * d * config.moe_intermediate_size
    )
    dense = 3 * d * config.intermediate_size
    layers = sum(
        2 * d + attention + (moe if config.is_moe_layer(i) else dense) for i in range(config.num_layers)
    )
    total = config.vocab_size * d + layers + d  # embedding, layers, final norm
    if kind == "critic":
        return total + d + 1  # value head kernel and bias
    return total + (0 if config.tie_word_embeddings else config.vocab_size * d)
