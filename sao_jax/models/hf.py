"""Hugging Face checkpoints in and out: `from_pretrained` and `save_pretrained`.

A checkpoint folder holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`, in the layout that transformers 4.x and 5.x both write
(`Qwen3MoeForCausalLM`, `Glm4MoeForCausalLM`): one tensor per expert
(`model.layers.3.mlp.experts.7.gate_proj.weight`; 5.x fuses a layer's experts in memory and splits
them on save) and Linear weights stored [out, in]. Our parameters keep heads and experts as their
own axes and store kernels [in, out]; `hf_tensor_specs` is the one table that relates the two.

Loading reads shard by shard with `safe_open`, converts each tensor into its slot of a host buffer
and moves a parameter to the device as soon as all its tensors (all experts) have arrived, so the
model is never held twice. Saving streams one shard at a time.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from sao_jax.errors import UserError
from sao_jax.models.config import ModelConfig
from sao_jax.models.decoder import Critic, Policy, ValueHead
from sao_jax.models.sharding import DEFAULT_RULES, LogicalRules, logical_to_spec

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
MODEL_KINDS = {"policy": Policy, "critic": Critic}
FUSED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")  # transformers 5.x's in-memory names


class CheckpointError(UserError, ValueError):
    """A checkpoint folder that is missing, unreadable, or does not match the model its config.json describes."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of a Hugging Face checkpoint and where it lives in our model.

    path: our state path, e.g. ("layers", 3, "mlp", "experts", "gate_proj").
    expert: index into the leading (stacked expert) axis of that parameter, or None for all of it.
    transpose: an HF Linear weight [out, in] whose transpose, reshaped, is our [in, ...] kernel.
    """

    hf_name: str
    path: tuple
    hf_shape: tuple[int, ...]
    expert: int | None = None
    transpose: bool = False

    def to_ours(self, tensor: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return (tensor.T if self.transpose else tensor).reshape(shape)

    def to_hf(self, value: np.ndarray) -> np.ndarray:
        if self.transpose:
            return np.ascontiguousarray(value.reshape(self.hf_shape[::-1]).T)
        return value.reshape(self.hf_shape)


def hf_tensor_specs(config: ModelConfig, *, lm_head: bool = True) -> list[TensorSpec]:
    """Every tensor of the HF checkpoint of `config`, in checkpoint order (lm_head only if untied and
    `lm_head`)."""
    d, h, kv, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim

    def linear(name, path, out_features, in_features, expert=None):
        return TensorSpec(f"{name}.weight", path, (out_features, in_features), expert, transpose=True)

    def vector(name, path, size):
        return TensorSpec(name, path, (size,))

    specs = [TensorSpec("model.embed_tokens.weight", ("embed", "embedding"), (config.vocab_size, d))]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", ("layers", i)
        attn, our_attn = hf + "self_attn.", ours + ("attn",)
        specs.append(vector(hf + "input_layernorm.weight", ours + ("input_norm", "scale"), d))
        for proj, out_heads in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
            specs.append(linear(attn + proj, our_attn + (proj, "kernel"), out_heads * hd, d))
            if config.attention_bias:
                specs.append(vector(f"{attn}{proj}.bias", our_attn + (proj, "bias"), out_heads * hd))
        specs.append(linear(attn + "o_proj", our_attn + ("o_proj", "kernel"), d, h * hd))
        if config.o_proj_bias:
            specs.append(vector(attn + "o_proj.bias", our_attn + ("o_proj", "bias"), d))
        if config.qk_norm:
            specs.append(vector(attn + "q_norm.weight", our_attn + ("q_norm", "scale"), hd))
            specs.append(vector(attn + "k_norm.weight", our_attn + ("k_norm", "scale"), hd))
        specs.append(vector(hf + "post_attention_layernorm.weight", ours + ("post_attn_norm", "scale"), d))
        mlp, our_mlp = hf + "mlp.", ours + ("mlp",)
        if config.is_moe_layer(i):
            f = config.moe_intermediate_size
            specs.append(linear(mlp + "gate", our_mlp + ("router", "kernel"), config.num_experts, d))
            if config.router_correction_bias:
                specs.append(vector(mlp + "gate.e_score_correction_bias",
                                    our_mlp + ("router", "e_score_correction_bias"), config.num_experts))  # fmt: skip
            for e in range(config.num_experts):
                experts = our_mlp + ("experts",)
                specs.append(linear(f"{mlp}experts.{e}.gate_proj", experts + ("gate_proj",), f, d, e))
                specs.append(linear(f"{mlp}experts.{e}.up_proj", experts + ("up_proj",), f, d, e))
                specs.append(linear(f"{mlp}experts.{e}.down_proj", experts + ("down_proj",), d, f, e))
            if config.num_shared_experts:
                shared, width = our_mlp + ("shared_experts",), config.num_shared_experts * f
                specs.append(linear(mlp + "shared_experts.gate_proj", shared + ("gate_proj",), width, d))
                specs.append(linear(mlp + "shared_experts.up_proj", shared + ("up_proj",), width, d))
                specs.append(linear(mlp + "shared_experts.down_proj", shared + ("down_proj",), d, width))
        else:
            width = config.intermediate_size
            specs.append(linear(mlp + "gate_proj", our_mlp + ("gate_proj",), width, d))
            specs.append(linear(mlp + "up_proj", our_mlp + ("up_proj",), width, d))
            specs.append(linear(mlp + "down_proj", our_mlp + ("down_proj",), d, width))
    specs.append(vector("model.norm.weight", ("final_norm", "scale"), d))
    if lm_head and not config.tie_word_embeddings:
        specs.append(linear("lm_head", ("lm_head", "kernel"), config.vocab_size, d))
    return specs


def _ignored(name: str, config: ModelConfig) -> bool:
    """Tensors a valid checkpoint may hold that this model does not use: GLM's multi-token-prediction
    layers (`model.layers.{num_layers + j}.*`, which transformers also skips) and `lm_head.weight`
    when the head is tied or a critic is loaded."""
    if name == "lm_head.weight":
        return True  # only reached when no spec claims it
    mtp_layers = range(config.num_layers, config.num_layers + config.num_mtp_layers)
    return any(name.startswith(f"model.layers.{i}.") for i in mtp_layers)


def _checkpoint_files(folder: Path) -> list[Path]:
    if (folder / INDEX).exists():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / SAFETENSORS).exists():
        return [folder / SAFETENSORS]
    raise CheckpointError(f"{folder} holds neither {SAFETENSORS} nor {INDEX}")


def _dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def read_hf_config(folder: str | Path) -> dict:
    """The `config.json` of a Hugging Face folder; a `CheckpointError` naming the path when the folder
    or the file is missing or the file is not JSON."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"no such folder ({folder})")
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"no config.json in {folder}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"config.json is not valid JSON ({e.msg}, line {e.lineno} column {e.colno}) ({path})") from None


def from_pretrained(
    path,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    kind: str = "policy",
    rngs: nnx.Rngs | None = None,
    mesh: Mesh | None = None,
    rules: LogicalRules = DEFAULT_RULES,
    **config_overrides,
):
    """Load a Hugging Face Qwen3-MoE / GLM-4.5-MoE folder as a `Policy` (or, `kind="critic"`, a
    `Critic` whose decoder is the checkpoint's and whose value head is fresh from `rngs`).

    dtype: compute dtype; param_dtype: storage dtype of the parameters (defaults to `dtype`).
    mesh: if given, each parameter goes straight to its `NamedSharding` on `mesh` (its logical axes
    mapped by `rules`), so no device ever holds the whole model.
    `config_overrides` set other `ModelConfig` fields (e.g. `moe_dispatch="dense"`).
    Raises `ModelConfigError` for an unsupported config.json and `CheckpointError` naming the tensor
    for a missing, unexpected, duplicated or mis-shaped tensor.
    """
    folder = Path(path)
    if kind not in MODEL_KINDS:
        raise ValueError(f"from_pretrained kind must be one of {sorted(MODEL_KINDS)} (got {kind!r})")
    if kind == "critic" and rngs is None:
        raise ValueError("from_pretrained(kind='critic') needs rngs= for the fresh value head")
    config = ModelConfig.from_hf(
        read_hf_config(folder),
        dtype=_dtype_name(dtype),
        param_dtype=_dtype_name(param_dtype or dtype),
        **config_overrides,
    )
    model_cls = MODEL_KINDS[kind]
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0))))
    variables = dict(nnx.to_flat_state(state))  # path -> Variable holding a ShapeDtypeStruct
    specs = {spec.hf_name: spec for spec in hf_tensor_specs(config, lm_head=kind == "policy")}

    buffers: dict[tuple, np.ndarray] = {}
    pending = {}  # path -> number of tensors still to arrive
    for spec in specs.values():
        pending[spec.path] = pending.get(spec.path, 0) + 1
    seen: dict[str, Path] = {}
    for file in _checkpoint_files(folder):
        with safe_open(file, framework="numpy") as reader:
            for name in reader.keys():
                spec = specs.get(name)
                if spec is None:
                    if _ignored(name, config):
                        continue
                    if name.endswith(FUSED_EXPERTS):
                        raise CheckpointError(
                            f"tensor {name!r} in {file.name} holds all of a layer's experts, as transformers 5.x "
                            "saves with save_pretrained(save_original_format=False); sao_jax reads one tensor "
                            "per expert, the default save_original_format=True"
                        )
                    raise CheckpointError(
                        f"unexpected tensor {name!r} in {file.name}: not part of a {config.model_type} "
                        f"{kind} with this config.json"
                    )
                if name in seen:
                    raise CheckpointError(f"tensor {name!r} appears twice ({seen[name].name} and {file.name})")
                seen[name] = file
                shape = tuple(reader.get_slice(name).get_shape())
                if shape != spec.hf_shape:
                    raise CheckpointError(
                        f"tensor {name!r} in {file.name} has shape {shape}, expected {spec.hf_shape}"
                    )
                target = variables[spec.path].get_value()
                if spec.path not in buffers:
                    buffers[spec.path] = np.empty(target.shape, target.dtype)
                slot = buffers[spec.path] if spec.expert is None else buffers[spec.path][spec.expert]
                slot[...] = spec.to_ours(reader.get_tensor(name), slot.shape).astype(target.dtype)
                pending[spec.path] -= 1
                if pending[spec.path] == 0:
                    variable = variables[spec.path]
                    sharding = None if mesh is None else NamedSharding(
                        mesh, logical_to_spec(variable.get_metadata()["out_sharding"], rules))  # fmt: skip
                    variable.set_value(jax.device_put(buffers.pop(spec.path), sharding))
    missing = [name for name in specs if name not in seen]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        more = " ..." if len(missing) > 5 else ""
        raise CheckpointError(f"{len(missing)} tensor(s) missing from {folder}: {shown}{more}")
    model = nnx.merge(graphdef, state)
    if kind == "critic":
        model.value_head = ValueHead(config, rngs=rngs)
    return model


def save_pretrained(model: Policy, path, *, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write `model` as a Hugging Face folder (config.json + safetensors) that transformers 4.57
    and 5.x `AutoModelForCausalLM.from_pretrained` load. Tensors are split into shards of at most
    `max_shard_bytes` (a larger single tensor gets a shard of its own) listed in
    `model.safetensors.index.json`; a single shard is written as `model.safetensors`."""
    if not isinstance(model, Policy):
        raise TypeError(f"save_pretrained writes a Policy (a causal LM); got {type(model).__name__}")
    config = model.config
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    variables = dict(nnx.to_flat_state(nnx.state(model)))
    specs = hf_tensor_specs(config)
    shards = _plan_shards(specs, variables, max_shard_bytes)
    weight_map, total_bytes = {}, 0
    for number, shard in enumerate(shards, start=1):
        filename = SAFETENSORS if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = dict(_hf_tensors(shard, variables))
        save_file(tensors, str(folder / filename), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = filename
            total_bytes += tensor.nbytes
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (folder / INDEX).write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(config.to_hf(), indent=2))


def _plan_shards(specs, variables, max_shard_bytes) -> list[list[TensorSpec]]:
    shards, size = [[]], 0
    for spec in specs:
        nbytes = math.prod(spec.hf_shape) * variables[spec.path].get_value().dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _hf_tensors(specs, variables) -> Iterator[tuple[str, np.ndarray]]:
    """(name, tensor) in HF layout; each parameter is copied to the host once, not once per expert."""
    host_path, host_value = None, None
    for spec in specs:
        if spec.path != host_path:
            host_path, host_value = spec.path, np.asarray(jax.device_get(variables[spec.path].get_value()))
        value = host_value if spec.expert is None else host_value[spec.expert]
        yield spec.hf_name, spec.to_hf(value)
