"""Per-chip memory and step-time plan for SAO (policy + critic) on a TPU mesh, from the model presets.

    python scripts/memory_plan.py --preset qwen3_30b_a3b --accelerator v5p-64 --mesh fsdp=-1 \
        --rollout-mesh data=8,tensor=4 --markdown

Nothing is typed in by hand: the parameter tree is the real `Policy` / `Critic` built abstractly
(`nnx.eval_shape`, no memory), trainable leaves are labelled by `sao_jax.optim.label_params`, the
optimizer state is `jax.eval_shape` of the real `optim.train_only(optim.adamw(...))`, the KV cache
is `jax.eval_shape` of `KVCache.init`, and every array is divided over the mesh by the logical axes it
carries and `sharding.DEFAULT_RULES`. Per-chip bytes of an array = itemsize · Π_i ceil(dim_i / n_i),
n_i = product of the mesh axis sizes that shard dimension i (`sharding.logical_to_spec`).

Precision (flags): `weights` is the dtype the weights are stored in (`ModelConfig.param_dtype`; the
layers cast them to the compute dtype `ModelConfig.dtype`). Without `master_f32` the optimizer updates
the weights themselves and gradients and AdamW moments take their dtype (optax's default, what
`sao_jax.optim.adamw` does today) — so f32 weights with bf16 compute need no extra copy. With
`master_f32` (bf16 weights only) the optimizer updates an f32 master copy of the *trainable* leaves,
gradients and moments are f32, and the bf16 weights are re-cast from the master after each step.
A rollout copy of the policy on its own mesh is cast to the compute dtype. Frozen leaves (the critic's
attention, embeddings and norms under `CRITIC_FROZEN_ATTENTION_TRAINABLE`) hold only weights: no
master, no gradient (`optim.zero_frozen` makes them constant zeros XLA need not materialise), no moments.

Activations per chip for one train micro-batch, with full rematerialisation (each decoder layer
under `jax.checkpoint`, only its input saved), b = sequences per chip = ceil(micro_batch / (data·fsdp)),
T = sequence length, c = compute itemsize:
    kept      = L · b · T · d · c                                (every layer's input [b, T, d])
    layer     = b · T · c · (e_attn + max(e_moe, e_dense))
                (one layer rematerialised during its backward: its intermediates, alive together — an
                estimate, XLA's scheduler decides), with per-token element counts
                e_attn  = 3d + (2⌈h/t⌉ + 2⌈kv/t⌉)·hd              normed x, q, k, v, attn out, o out, residual
                e_moe   = 2d + 2E·4/c + (k/x)(2d + 3⌈f/t⌉) + 3⌈s·f/t⌉
                          normed h, output; router logits and scores (f32); per routed assignment (split
                          over the x expert shards) its input, output, gate, up and activation; shared experts
                e_dense = 2d + 3⌈F/t⌉
                t = tensor axis size; a flash/splash attention kernel is assumed (no [T, T] scores kept)
    logits    = 2 · b · T_chunk · ⌈V/t⌉ · 4   (policy only: f32 logits and their cotangent over T_chunk tokens)
Gradients are held once (twice — accumulator + current — when train_batch > micro_batch). The policy
and critic updates run one after another (TTUR), so the train peak is
    persistent (both models' weights, masters, moments) + max(policy grads + acts, critic grads + acts).
KV cache (rollout): 2 · L · B · T_max · kv · hd · c, sharded by ("batch", "length", "kv_heads", "head_dim"),
    + its RoPE table 2 · T_max · r/2 · 4 (r = rotary dims; on every chip) + lengths 4 · B.

Step time from FLOPs (N = matmul parameters one token uses: every ≥2-d weight except the embedding
gather, routed experts scaled by k/E; N_train = its trainable part; causal attention with a kernel that
skips masked blocks):
    update (one model, D tokens in sequences of T) = (4N + 2N_train)·D + 6·L·h·hd·T·D
                  (forward 2N, input gradients 2N, weight gradients 2N_train only for trainable weights)
    forward (critic values for advantages)       = 2N·D + 2·L·h·hd·T·D
    RL step = K · critic update + critic forward + policy update;   time = FLOPs / (chips · peak · MFU)
    rollout (B sequences of T generated tokens)  = 2N·B·T + 2·L·h·hd·T²·B,  also bounded below by
                  bandwidth: T decode steps, each reading from HBM the chip's non-expert weights, the
                  expected share 1 − (1 − k/E)^b of its expert weights hit by the step's b tokens per
                  replica (uniform routing) and half its KV cache (average fill), or — if slower —
                  all-gathering its fsdp-sharded weights over ICI: (per-chip bytes)·(fsdp − 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from sao_jax import models, optim
from sao_jax.models.layers import KVCache
from sao_jax.models.sharding import DEFAULT_RULES, MESH_AXES, LogicalRules, logical_to_spec, mesh_sizes

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: float
    peak_bf16_flops: float  # per chip
    hbm_bytes_per_s: float
    ici_bytes_per_s: float  # inter-chip interconnect, per chip
    tensorcores_per_chip: int  # the number in an accelerator type like "v5p-64" counts TensorCores
    chips_per_host: int  # one sao-train process each; `mesh.rollout_devices` counts chips per host


# Google Cloud "TPU v5p" page (cloud.google.com/tpu/docs/v5p): per chip 459 TFLOP/s bf16, HBM2e 95 GB
# at 2765 GB/s, inter-chip interconnect 4800 Gbps (600 GB/s); "v5p-N" names N TensorCores, 2 per chip
# (v5p-64 = 32 chips on 8 hosts). 95 GB is read as 95·10⁹ bytes (88.5 GiB), the conservative reading;
# `--hbm-gb` overrides it.
CHIPS = {"v5p": Chip("v5p", hbm_bytes=95e9, peak_bf16_flops=459e12, hbm_bytes_per_s=2765e9, ici_bytes_per_s=600e9,
                     tensorcores_per_chip=2, chips_per_host=4)}  # fmt: skip


def accelerator_chips(accelerator_type: str) -> tuple[Chip, int]:
    """(chip, number of chips) of a Cloud TPU accelerator type, e.g. "v5p-64" -> (v5p, 32)."""
    match = re.fullmatch(r"(v\w+?)-(\d+)", accelerator_type)
    if not match or match.group(1) not in CHIPS:
        raise ValueError(f"unknown accelerator type {accelerator_type!r}; known: {', '.join(f'{c}-N' for c in CHIPS)}")
    chip = CHIPS[match.group(1)]
    cores = int(match.group(2))
    if cores % chip.tensorcores_per_chip:
        raise ValueError(f"{accelerator_type}: {cores} TensorCores is not a whole number of {chip.name} chips")
    return chip, cores // chip.tensorcores_per_chip


def parse_mesh(text: str) -> dict[str, int]:
    """"data=2,fsdp=-1" -> {"data": 2, "fsdp": -1}."""
    shape = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        axis, sep, size = item.partition("=")
        if not sep or axis not in MESH_AXES:
            raise ValueError(f"mesh item {item!r} must be AXIS=SIZE with AXIS one of {MESH_AXES}")
        shape[axis] = int(size)
    return shape


def resolve_mesh(shape: Mapping[str, int], chips: int) -> dict[str, int]:
    """All four mesh axes with sizes (`sharding.mesh_sizes`): unnamed axes are 1, one may be -1."""
    return mesh_sizes(shape, chips)


def shard_shape(shape: Sequence[int], logical_axes: Sequence[str | None], mesh: Mapping[str, int],
                rules: LogicalRules = DEFAULT_RULES) -> tuple[tuple[int, ...], bool]:  # fmt: skip
    """(per-chip shape, evenly divisible?) of an array whose dimensions carry `logical_axes`."""
    spec = logical_to_spec(logical_axes, rules) if logical_axes else ()
    parts = [1] * len(shape)
    for i, entry in enumerate(spec):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        parts[i] = math.prod(mesh[a] for a in axes)
    return tuple(-(-dim // n) for dim, n in zip(shape, parts)), all(dim % n == 0 for dim, n in zip(shape, parts))


# ------------------------------------------------------------------------------ parameter trees


@dataclasses.dataclass(frozen=True)
class Leaf:
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    axes: tuple[str | None, ...]
    trainable: bool


@functools.lru_cache(maxsize=8)
def abstract_params(config: models.ModelConfig, kind: str) -> nnx.State:
    """The `nnx.Param` state of a Policy or Critic built abstractly (shapes and dtypes, no memory)."""
    cls = {"policy": models.Policy, "critic": models.Critic}[kind]
    with nnx.use_eager_sharding(False):
        return nnx.state(nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0))), nnx.Param)


def leaves(params: nnx.State, trainable_patterns: Sequence[str]) -> list[Leaf]:
    """Every parameter with its path, shape, dtype, logical axes and trainable label (`optim.label_params`)."""
    labels = jax.tree.leaves(optim.label_params(params, trainable_patterns))
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return [
        Leaf(optim.param_path(key_path), tuple(var.get_value().shape), np.dtype(var.get_value().dtype),
             tuple(var.get_metadata().get("out_sharding") or ()), label == optim.TRAINABLE)  # fmt: skip
        for (key_path, var), label in zip(flat, labels, strict=True)
    ]


def _bytes(shape, dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def _split(shape, axes, dtype, mesh) -> dict[str, int]:
    local, _ = shard_shape(shape, axes, mesh)
    return {"total": _bytes(shape, dtype), "per_chip": _bytes(local, dtype)}


def _add(*parts: dict[str, int]) -> dict[str, int]:
    return {key: sum(p[key] for p in parts) for key in ("total", "per_chip")}


ZERO = {"total": 0, "per_chip": 0}


def weight_bytes(params: nnx.State, mesh: Mapping[str, int]) -> dict[str, Any]:
    """Bytes of the weights as stored, total and per chip — routed experts and everything else — and
    `gathered`: the bytes a chip receives to all-gather its fsdp-sharded weights whole for a forward,
    Σ over leaves split by fsdp of (per-chip bytes) · (fsdp − 1)."""
    parts: dict[str, Any] = {"experts": dict(ZERO), "other": dict(ZERO), "gathered": 0}
    for leaf in leaves(params, optim.ALL_TRAINABLE):
        part = "experts" if "/experts/" in leaf.path else "other"
        split = _split(leaf.shape, leaf.axes, leaf.dtype, mesh)
        parts[part] = _add(parts[part], split)
        if "fsdp" in jax.tree.leaves(tuple(logical_to_spec(leaf.axes, DEFAULT_RULES))):
            parts["gathered"] += split["per_chip"] * (mesh["fsdp"] - 1)
    return parts


def model_state_bytes(params: nnx.State, trainable_patterns: Sequence[str], mesh: Mapping[str, int], *,
                      master_f32: bool, learning_rate: float = 1e-6) -> dict[str, Any]:  # fmt: skip
    """Weights, f32 master, gradients and AdamW state of one model, in total and per chip.

    The optimizer state is `jax.eval_shape` of the real `train_only(adamw)` over the tree the optimizer
    updates (trainable leaves cast to f32 with `master_f32`); each of its leaves is sharded like the
    parameter whose path it ends with (moments mirror the parameters), other leaves (step counts) are
    replicated. Also returns the parameter counts and the leaves whose dims do not divide evenly.
    """
    table = leaves(params, trainable_patterns)
    opt_dtype = {leaf.path: np.dtype(np.float32) if master_f32 and leaf.trainable else leaf.dtype for leaf in table}
    weights = _add(ZERO, *(_split(leaf.shape, leaf.axes, leaf.dtype, mesh) for leaf in table))
    master = _add(ZERO, *(_split(leaf.shape, leaf.axes, np.float32, mesh) for leaf in table
                          if master_f32 and leaf.trainable and leaf.dtype != np.float32))  # fmt: skip
    grads = _add(ZERO, *(_split(leaf.shape, leaf.axes, opt_dtype[leaf.path], mesh) for leaf in table if leaf.trainable))

    opt_params = jax.tree_util.tree_map_with_path(
        lambda kp, var: var.replace(jax.ShapeDtypeStruct(var.get_value().shape, opt_dtype[optim.param_path(kp)])),
        params, is_leaf=lambda x: isinstance(x, nnx.Variable),
    )  # fmt: skip
    tx = optim.train_only(optim.adamw(learning_rate), trainable_patterns)
    opt_state = jax.eval_shape(tx.init, opt_params)
    by_path = {leaf.path: leaf for leaf in table}
    optimizer = dict(ZERO)
    for key_path, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        parts = optim.param_path(key_path).removesuffix("/value").split("/")
        owner = next((by_path[p] for p in ("/".join(parts[i:]) for i in range(len(parts))) if p in by_path), None)
        optimizer = _add(optimizer, _split(x.shape, owner.axes if owner else (), x.dtype, mesh))
    if optimizer["total"] != optim.tree_bytes(opt_state):
        raise AssertionError("optimizer leaves were not all counted")  # the walk above must see every leaf
    return {
        "params": sum(math.prod(leaf.shape) for leaf in table),
        "trainable_params": sum(math.prod(leaf.shape) for leaf in table if leaf.trainable),
        "weights": weights,
        "master": master,
        "grads": grads,
        "optimizer": optimizer,
        "uneven": sorted({leaf.path for leaf in table if not shard_shape(leaf.shape, leaf.axes, mesh)[1]}),
    }


def matmul_params_per_token(params: nnx.State, trainable_patterns: Sequence[str], config: models.ModelConfig,
                            kind: str) -> tuple[float, float]:  # fmt: skip
    """(N, N_train): parameters one token multiplies by — every ≥2-d weight except the embedding table
    (a gather; counted when the Policy ties it as its LM head), routed experts scaled by k/E."""
    n = n_train = 0.0
    for leaf in leaves(params, trainable_patterns):
        if len(leaf.shape) < 2 or (leaf.path == "embed/embedding" and not (kind == "policy" and config.tie_word_embeddings)):
            continue
        used = math.prod(leaf.shape) * (config.num_experts_per_token / config.num_experts if "/experts/" in leaf.path else 1)
        n += used
        n_train += used * leaf.trainable
    return n, n_train


# ------------------------------------------------------------------------------ activations and KV


def kv_cache_bytes(config: models.ModelConfig, batch: int, max_len: int, mesh: Mapping[str, int]) -> dict[str, int]:
    """Bytes of `KVCache.init(config, batch, max_len)` (shapes from `jax.eval_shape`), total and per chip."""
    cache = jax.eval_shape(lambda: KVCache.init(config, batch, max_len))
    axes = ("batch", "length", "kv_heads", "head_dim")
    parts = [_split(a.shape, axes, a.dtype, mesh) for a in (*cache.keys, *cache.values)]
    parts += [_split(a.shape, (), a.dtype, mesh) for a in cache.rope]  # replicated
    return _add(_split(cache.lengths.shape, ("batch",), cache.lengths.dtype, mesh), *parts)


def activation_bytes(config: models.ModelConfig, micro_batch: int, seq_len: int, mesh: Mapping[str, int], *,
                     kind: str, logit_chunk: int = 0) -> dict[str, int]:  # fmt: skip
    """Per-chip activation bytes of one train micro-batch with per-layer remat (module docstring)."""
    c = np.dtype(config.compute_dtype).itemsize
    (b, t_len, _), _ = shard_shape((micro_batch, seq_len, config.hidden_size), ("batch", "length", "embed"), mesh)
    t, x = mesh["tensor"], mesh["expert"]
    d, hd, f = config.hidden_size, config.head_dim, config.moe_intermediate_size
    up = lambda n: -(-n // t)  # noqa: E731 — a dimension split over the tensor axis
    e_attn = 3 * d + (2 * up(config.num_heads) + 2 * up(config.num_kv_heads)) * hd
    moe_layers = [config.is_moe_layer(i) for i in range(config.num_layers)]
    k, e, s = config.num_experts_per_token, config.num_experts, config.num_shared_experts
    e_moe = 2 * d + 2 * e * 4 / c + k / x * (2 * d + 3 * up(f)) + 3 * up(s * f)
    e_dense = 2 * d + 3 * up(config.intermediate_size)
    e_mlp = max(e_moe if any(moe_layers) else 0, e_dense if not all(moe_layers) else 0)
    kept = config.num_layers * b * t_len * d * c
    layer = int(b * t_len * c * (e_attn + e_mlp))
    logits = 2 * b * min(logit_chunk or t_len, t_len) * up(config.vocab_size) * 4 if kind == "policy" else 0
    scores_if_materialized = b * up(config.num_heads) * t_len * t_len * (4 + c)
    return {"kept": kept, "layer": layer, "logits": logits, "total": kept + layer + logits,
            "scores_if_materialized": scores_if_materialized}  # fmt: skip


# ------------------------------------------------------------------------------ the plan


def plan(
    model_config: models.ModelConfig,
    mesh_shape: Mapping[str, int],
    *,
    chips: int,
    chip: Chip = CHIPS["v5p"],
    rollout_mesh_shape: Mapping[str, int] | None = None,
    rollout_chips: int = 0,
    weights: str = "float32",
    master_f32: bool = False,
    critic_trainable: Sequence[str] = optim.CRITIC_FROZEN_ATTENTION_TRAINABLE,
    rollout_batch: int = 64,
    rollout_tokens: int = 131072,
    train_seq_len: int = 32768,
    micro_batch: int | None = None,
    train_batch: int = 64,
    critic_updates: int = 2,
    mfu: float = 0.4,
    logit_chunk: int = 0,
) -> dict[str, Any]:
    """The plan as a JSON-able dict (bytes, FLOPs, seconds); see the module docstring for every formula.

    `mesh_shape` is the train mesh. `rollout_chips` = 0: rollouts time-share the train chips, on
    `rollout_mesh_shape` (a second mesh over the same chips; default the train mesh itself, reading the
    train weights in place). `rollout_chips` > 0: a disjoint rollout sub-mesh of that many chips, the
    train mesh on the other `chips - rollout_chips`. `micro_batch` (global sequences per micro-step)
    defaults to one sequence per batch shard (data·fsdp), at most `train_batch`.
    """
    if weights not in ("bfloat16", "float32"):
        raise ValueError(f"weights must be bfloat16 or float32 (got {weights!r})")
    if master_f32 and weights == "float32":
        raise ValueError("master_f32 needs bfloat16 weights (float32 weights are their own master)")
    if micro_batch is not None and not 1 <= micro_batch <= train_batch:
        raise ValueError(f"micro_batch must be in [1, train_batch={train_batch}] (got {micro_batch})")
    if not 0 <= rollout_chips < chips:
        raise ValueError(f"rollout_chips must be in [0, {chips}) (got {rollout_chips})")
    config = model_config.replace(param_dtype=weights)
    train_chips = chips - rollout_chips
    mesh = resolve_mesh(mesh_shape, train_chips)
    rollout_mesh = resolve_mesh(rollout_mesh_shape or mesh, rollout_chips or chips)
    batch_shards = mesh["data"] * mesh["fsdp"]
    micro_batch = min(batch_shards, train_batch) if micro_batch is None else micro_batch
    accumulate = train_batch > micro_batch

    trainable = {"policy": optim.ALL_TRAINABLE, "critic": tuple(critic_trainable)}
    models_out, flops = {}, {}
    for kind in ("policy", "critic"):
        params = abstract_params(config, kind)
        state = model_state_bytes(params, trainable[kind], mesh, master_f32=master_f32)
        acts = activation_bytes(config, micro_batch, train_seq_len, mesh, kind=kind, logit_chunk=logit_chunk)
        grads_held = {key: v * (2 if accumulate else 1) for key, v in state["grads"].items()}
        state["activations"] = acts
        state["persistent"] = _add(state["weights"], state["master"], state["optimizer"])
        state["transient_per_chip"] = grads_held["per_chip"] + acts["total"]
        n, n_train = matmul_params_per_token(params, trainable[kind], config, kind)
        state["matmul_params_per_token"], state["trainable_matmul_params_per_token"] = n, n_train
        models_out[kind] = state
        flops[kind] = (n, n_train)
        if kind == "critic":
            # The "w/o frozen attention" ablation, for comparison.
            unfrozen = model_state_bytes(params, optim.ALL_TRAINABLE, mesh, master_f32=master_f32)
            state["all_trainable"] = {key: unfrozen[key] for key in ("master", "grads", "optimizer", "trainable_params")}
            state["all_trainable"]["matmul_params_per_token"] = matmul_params_per_token(
                params, optim.ALL_TRAINABLE, config, kind)[1]  # fmt: skip

    persistent = sum(models_out[k]["persistent"]["per_chip"] for k in models_out)
    train_transient = max(models_out[k]["transient_per_chip"] for k in models_out)
    # Rollout: the policy's weights on the rollout mesh — read in place when that is the train mesh
    # itself, else a copy cast to the compute dtype as it is resharded — and the KV cache.
    in_place = not rollout_chips and rollout_mesh_shape is None
    rollout_config = config if in_place else config.replace(param_dtype=config.dtype)
    on_rollout_mesh = weight_bytes(abstract_params(rollout_config, "policy"), rollout_mesh)
    rollout_weights = _add(on_rollout_mesh["experts"], on_rollout_mesh["other"])
    weights_copy = 0 if in_place else rollout_weights["per_chip"]
    kv = kv_cache_bytes(config, rollout_batch, rollout_tokens, rollout_mesh)
    rollout_peak = weights_copy + kv["per_chip"]
    if rollout_chips:
        chip_peaks = {"train": persistent + train_transient, "rollout": rollout_peak}
    else:
        chip_peaks = {"shared": persistent + max(train_transient, rollout_peak)}

    # FLOPs and time
    L, h, hd = config.num_layers, config.num_heads, config.head_dim
    train_tokens = train_batch * train_seq_len
    attention_train = 6 * L * h * hd * train_seq_len * train_tokens
    update = {k: (4 * n + 2 * n_train) * train_tokens + attention_train for k, (n, n_train) in flops.items()}
    critic_forward = 2 * flops["critic"][0] * train_tokens + attention_train / 3
    rl_step_flops = critic_updates * update["critic"] + critic_forward + update["policy"]
    rl_step_s = rl_step_flops / (train_chips * chip.peak_bf16_flops * mfu)
    n_policy = flops["policy"][0]
    rollout_flops = 2 * n_policy * rollout_batch * rollout_tokens + 2 * L * h * hd * rollout_tokens**2 * rollout_batch
    n_rollout_chips = rollout_chips or chips
    rollout_compute_s = rollout_flops / (n_rollout_chips * chip.peak_bf16_flops * mfu)
    # A decode step reads the chip's non-expert weights, the share of its expert weights that the
    # step's tokens route to (uniform routing: 1 − (1 − k/E)^tokens), and its KV cache filled so far
    # (half of it on average) from HBM; fsdp-sharded weights must first be all-gathered over ICI.
    tokens_per_step = -(-rollout_batch // (rollout_mesh["data"] * rollout_mesh["fsdp"]))
    experts_touched = 1 - (1 - config.num_experts_per_token / config.num_experts) ** tokens_per_step if config.num_experts else 0.0
    step_bytes = (on_rollout_mesh["other"]["per_chip"] + experts_touched * on_rollout_mesh["experts"]["per_chip"]
                  + kv["per_chip"] / 2)  # fmt: skip
    step_s = max(step_bytes / chip.hbm_bytes_per_s, on_rollout_mesh["gathered"] / chip.ici_bytes_per_s)
    rollout_bandwidth_s = rollout_tokens * step_s

    return {
        "model": model_config.model_type,
        "chip": dataclasses.asdict(chip),
        "chips": chips,
        "train_chips": train_chips,
        "rollout_chips": rollout_chips,
        "mesh": mesh,
        "rollout_mesh": rollout_mesh,
        "rules": [list(rule) for rule in DEFAULT_RULES],
        "precision": {"weights": weights, "compute": model_config.dtype, "master_f32": master_f32},
        "critic_trainable": list(critic_trainable),
        "workload": {"rollout_batch": rollout_batch, "rollout_tokens": rollout_tokens, "train_seq_len": train_seq_len,
                     "micro_batch": micro_batch, "train_batch": train_batch, "critic_updates": critic_updates,
                     "gradient_accumulation": accumulate, "logit_chunk": logit_chunk, "mfu": mfu},  # fmt: skip
        "policy": models_out["policy"],
        "critic": models_out["critic"],
        "persistent_per_chip": persistent,
        "train_transient_per_chip": train_transient,
        "rollout_weights": rollout_weights,
        "rollout_weights_copy_per_chip": weights_copy,
        "kv_cache": kv,
        "decode_tokens_per_step": tokens_per_step,
        "experts_touched": experts_touched,
        "decode_step_bytes_read": step_bytes,
        "decode_step_bytes_gathered": on_rollout_mesh["gathered"],
        "kv_bytes_per_sequence": kv["total"] // rollout_batch,
        "chip_peaks": chip_peaks,
        "hbm_bytes": chip.hbm_bytes,
        "fits": all(p <= chip.hbm_bytes for p in chip_peaks.values()),
        "flops": {"critic_update": update["critic"], "policy_update": update["policy"],
                  "critic_forward": critic_forward, "rl_step": rl_step_flops, "rollout": rollout_flops},  # fmt: skip
        "rl_step_s": rl_step_s,
        "rollout_compute_s": rollout_compute_s,
        "rollout_bandwidth_s": rollout_bandwidth_s,
        "rollout_s": max(rollout_compute_s, rollout_bandwidth_s),
    }


# ------------------------------------------------------------------------------ output


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _mesh_text(mesh: Mapping[str, int]) -> str:
    return ", ".join(f"{axis}={size}" for axis, size in mesh.items())


def axis_table(rules: LogicalRules = DEFAULT_RULES) -> str:
    """Markdown: which logical dimensions (parameters, activations, KV cache) each mesh axis shards."""
    carries = {axis: [] for axis in MESH_AXES}
    for logical, target in rules:
        for axis in (target,) if isinstance(target, str) else tuple(target or ()):
            carries[axis].append(logical)
    replicated = [logical for logical, target in rules if not target]
    lines = ["| mesh axis | shards the logical dimensions |", "|---|---|"]
    lines += [f"| {axis} | {', '.join(names) or '—'} |" for axis, names in carries.items()]
    lines.append(f"| (none) | {', '.join(replicated)} (replicated) |")
    return "\n".join(lines)


def to_markdown(p: dict[str, Any]) -> str:
    """A plan as Markdown tables (per-chip GiB; HBM read as `chip.hbm_bytes`)."""
    pol, cri, w = p["policy"], p["critic"], p["workload"]
    prec = p["precision"]
    mode = (f"disjoint sub-meshes: train {p['train_chips']} chips ({_mesh_text(p['mesh'])}), rollout "
            f"{p['rollout_chips']} chips ({_mesh_text(p['rollout_mesh'])})" if p["rollout_chips"] else
            f"{p['chips']} chips time-shared: train mesh ({_mesh_text(p['mesh'])}), rollout mesh "
            f"({_mesh_text(p['rollout_mesh'])})")  # fmt: skip
    out = [
        f"**{p['model']}** on {p['chips']} {p['chip']['name']} chips — {mode}. "
        f"Weights {prec['weights']}{' + f32 master' if prec['master_f32'] else ''}, compute {prec['compute']}.",
        "",
        "| per chip, GiB | policy | critic (frozen attention) | critic (all trainable) |",
        "|---|---:|---:|---:|",
        f"| parameters (count, whole model) | {pol['params'] / 1e9:.2f} B | {cri['params'] / 1e9:.2f} B | {cri['params'] / 1e9:.2f} B |",
        f"| trainable parameters (count) | {pol['trainable_params'] / 1e9:.2f} B | {cri['trainable_params'] / 1e9:.2f} B | "
        f"{cri['all_trainable']['trainable_params'] / 1e9:.2f} B |",
        f"| weights ({prec['weights']}) | {_gib(pol['weights']['per_chip'])} | {_gib(cri['weights']['per_chip'])} | "
        f"{_gib(cri['weights']['per_chip'])} |",
        f"| f32 master copy | {_gib(pol['master']['per_chip'])} | {_gib(cri['master']['per_chip'])} | "
        f"{_gib(cri['all_trainable']['master']['per_chip'])} |",
        f"| gradients | {_gib(pol['grads']['per_chip'])} | {_gib(cri['grads']['per_chip'])} | "
        f"{_gib(cri['all_trainable']['grads']['per_chip'])} |",
        f"| AdamW state | {_gib(pol['optimizer']['per_chip'])} | {_gib(cri['optimizer']['per_chip'])} | "
        f"{_gib(cri['all_trainable']['optimizer']['per_chip'])} |",
        f"| activations: layer inputs kept | {_gib(pol['activations']['kept'])} | {_gib(cri['activations']['kept'])} | "
        f"{_gib(cri['activations']['kept'])} |",
        f"| activations: one remat layer | {_gib(pol['activations']['layer'])} | {_gib(cri['activations']['layer'])} | "
        f"{_gib(cri['activations']['layer'])} |",
        f"| activations: f32 logits + grad | {_gib(pol['activations']['logits'])} | — | — |",
        "",
        f"Train micro-batch {w['micro_batch']} × {w['train_seq_len']} tokens "
        f"({'with' if w['gradient_accumulation'] else 'no'} gradient accumulation to {w['train_batch']} sequences"
        f"{', logits in chunks of ' + str(w['logit_chunk']) if w['logit_chunk'] else ''}). "
        f"Not counted (`model.attention: splash` avoids it): attention scores materialised as "
        f"`model.attention: xla` does, {_gib(pol['activations']['scores_if_materialized'])} GiB per chip per layer.",
        "",
        "| per chip, GiB | |",
        "|---|---:|",
        f"| persistent: both models' weights + masters + AdamW | {_gib(p['persistent_per_chip'])} |",
        f"| train transient: max over the two updates of gradients + activations | {_gib(p['train_transient_per_chip'])} |",
        f"| rollout weights copy (policy on the rollout mesh; 0 = read in place) | "
        f"{_gib(p['rollout_weights_copy_per_chip'])} |",
        f"| KV cache: {w['rollout_batch']} sequences × {w['rollout_tokens']} tokens "
        f"({_gib(p['kv_bytes_per_sequence'])} GiB per sequence in total) | {_gib(p['kv_cache']['per_chip'])} |",
    ]
    for name, peak in p["chip_peaks"].items():
        verdict = "fits" if peak <= p["hbm_bytes"] else "DOES NOT FIT"
        out.append(f"| **peak, {name} chip** vs HBM {_gib(p['hbm_bytes'])} | **{_gib(peak)}** ({verdict}) |")
    f = p["flops"]
    out += [
        "",
        f"| time at {w['mfu']:.0%} MFU, {p['chip']['peak_bf16_flops'] / 1e12:.0f} TFLOP/s per chip | FLOPs | seconds |",
        "|---|---:|---:|",
        f"| RL step: {w['critic_updates']} critic updates + critic forward + policy update, "
        f"{w['train_batch']} × {w['train_seq_len']} tokens | {f['rl_step']:.3g} | {p['rl_step_s']:.1f} |",
        f"| rollout: {w['rollout_batch']} sequences × {w['rollout_tokens']} generated tokens, compute | "
        f"{f['rollout']:.3g} | {p['rollout_compute_s']:.1f} |",
        f"| same rollout, bandwidth bound: {w['rollout_tokens']} steps, each reading {_gib(p['decode_step_bytes_read'])} GiB "
        f"per chip from HBM ({p['experts_touched']:.0%} of experts hit by {p['decode_tokens_per_step']} tokens/step; "
        f"{p['chip']['hbm_bytes_per_s'] / 1e9:.0f} GB/s) and gathering {_gib(p['decode_step_bytes_gathered'])} GiB "
        f"of fsdp-sharded weights over ICI ({p['chip']['ici_bytes_per_s'] / 1e9:.0f} GB/s) | — | {p['rollout_bandwidth_s']:.1f} |",
        "",
        f"Per token: N = {pol['matmul_params_per_token'] / 1e9:.2f} B matmul parameters (policy); critic "
        f"N_train = {cri['trainable_matmul_params_per_token'] / 1e9:.2f} B with frozen attention vs "
        f"{cri['all_trainable']['matmul_params_per_token'] / 1e9:.2f} B all-trainable.",
    ]
    uneven = sorted(set(pol["uneven"]) | set(cri["uneven"]))
    if uneven:
        out += ["", f"Uneven shards (a dimension not divisible by its mesh axes; JAX pads or refuses): "
                f"{', '.join(uneven[:6])}{' …' if len(uneven) > 6 else ''}"]  # fmt: skip
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3_30b_a3b", help="a preset of sao_jax.models (qwen3_30b_a3b, glm45_air, ...)")
    parser.add_argument("--accelerator", default="v5p-64", help="Cloud TPU accelerator type, e.g. v5p-64 (= 32 chips)")
    parser.add_argument("--chips", type=int, help="number of chips (overrides the count from --accelerator)")
    parser.add_argument("--hbm-gb", type=float, help="HBM per chip in 10^9 bytes (default: the chip's spec)")
    parser.add_argument("--mesh", default="fsdp=-1", help="train mesh, e.g. data=2,fsdp=-1,expert=1,tensor=1")
    parser.add_argument("--rollout-mesh", help="rollout mesh (default: the train mesh, weights read in place)")
    parser.add_argument("--rollout-chips", type=int, default=0, help="chips of a disjoint rollout sub-mesh over the whole slice (0: time-share); "
                        "the config's mesh.rollout_devices=r is r chips per host: hosts x r here")
    parser.add_argument("--weights", choices=("bf16", "f32"), default="f32",
                        help="dtype the weights are stored in (the forward casts them to the compute dtype)")
    parser.add_argument("--master-f32", action=argparse.BooleanOptionalAction, default=False,
                        help="with --weights bf16: an f32 master copy of the trainable weights (f32 gradients, moments)")  # fmt: skip
    parser.add_argument("--critic", choices=("frozen-attention", "all-trainable"), default="frozen-attention")
    parser.add_argument("--rollout-batch", type=int, default=64, help="sequences decoded at once (global)")
    parser.add_argument("--rollout-tokens", type=int, default=131072, help="KV-cache length and tokens generated")
    parser.add_argument("--train-seq-len", type=int, default=32768)
    parser.add_argument("--micro-batch", type=int, help="sequences per micro-step (default: data·fsdp)")
    parser.add_argument("--train-batch", type=int, default=64, help="sequences per RL step")
    parser.add_argument("--critic-updates", type=int, default=2, help="K of TTUR")
    parser.add_argument("--mfu", type=float, default=0.4)
    parser.add_argument("--logit-chunk", type=int, default=0, help="tokens per logit chunk (0: whole sequence)")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--markdown", action="store_true", help="Markdown tables (docs/scaling.md)")
    out.add_argument("--json", action="store_true", help="the whole plan as JSON")
    args = parser.parse_args(argv)

    chip, chips = accelerator_chips(args.accelerator)
    if args.hbm_gb:
        chip = dataclasses.replace(chip, hbm_bytes=args.hbm_gb * 1e9)
    preset = models.PRESETS.get(args.preset)
    if preset is None:
        parser.error(f"--preset {args.preset!r} is not one of {', '.join(models.PRESETS)}")
    try:
        result = plan(
            preset(), parse_mesh(args.mesh), chips=args.chips or chips, chip=chip,
            rollout_mesh_shape=parse_mesh(args.rollout_mesh) if args.rollout_mesh else None,
            rollout_chips=args.rollout_chips, weights={"bf16": "bfloat16", "f32": "float32"}[args.weights],
            master_f32=args.master_f32,
            critic_trainable=optim.CRITIC_FROZEN_ATTENTION_TRAINABLE if args.critic == "frozen-attention" else optim.ALL_TRAINABLE,
            rollout_batch=args.rollout_batch, rollout_tokens=args.rollout_tokens, train_seq_len=args.train_seq_len,
            micro_batch=args.micro_batch, train_batch=args.train_batch, critic_updates=args.critic_updates,
            mfu=args.mfu, logit_chunk=args.logit_chunk,
        )  # fmt: skip
    except ValueError as error:
        print(f"memory_plan: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    elif args.markdown:
        print(to_markdown(result))
    else:
        peaks = ", ".join(f"{name} {_gib(v)} GiB" for name, v in result["chip_peaks"].items())
        print(f"{args.preset} on {result['chips']} chips: peak per chip {peaks} of {_gib(result['hbm_bytes'])} GiB HBM; "
              f"RL step {result['rl_step_s']:.1f} s, rollout {result['rollout_s']:.1f} s (--markdown for the tables)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
