"""Models: config, the NNX MoE decoder (Policy, Critic), Hugging Face import/export, sharding rules."""

from sao_jax.models.config import (
    ModelConfig,
    ModelConfigError,
    PRESETS,
    cpu_moe,
    glm45_air,
    param_count,
    qwen3_30b_a3b,
    tiny_glm4_moe,
    tiny_qwen3_moe,
)
from sao_jax.models.decoder import Critic, Decoder, Policy, compute_dtype_weights
from sao_jax.models.hf import CheckpointError, from_pretrained, hf_tensor_specs, read_hf_config, save_pretrained
from sao_jax.models.layers import KVCache

__all__ = [
    "CheckpointError",
    "Critic",
    "Decoder",
    "KVCache",
    "ModelConfig",
    "ModelConfigError",
    "PRESETS",
    "Policy",
    "compute_dtype_weights",
    "cpu_moe",
    "from_pretrained",
    "glm45_air",
    "hf_tensor_specs",
    "param_count",
    "qwen3_30b_a3b",
    "read_hf_config",
    "save_pretrained",
    "tiny_glm4_moe",
    "tiny_qwen3_moe",
]
