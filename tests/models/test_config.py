"""ModelConfig: Hugging Face config.json translation, validation errors, presets, parameter counts."""

import pytest

from sao_jax.models import (
    ModelConfig,
    ModelConfigError,
    cpu_moe,
    glm45_air,
    param_count,
    qwen3_30b_a3b,
    tiny_glm4_moe,
    tiny_qwen3_moe,
)


@pytest.mark.parametrize("make_config", [tiny_qwen3_moe, tiny_glm4_moe, cpu_moe, qwen3_30b_a3b, glm45_air])
def test_to_hf_then_from_hf_is_the_identity(make_config):
    config = make_config()
    ours = dict(dtype=config.dtype, param_dtype=config.param_dtype, moe_dispatch=config.moe_dispatch)
    assert ModelConfig.from_hf(config.to_hf(), **ours) == config


@pytest.mark.parametrize("make_config", [tiny_qwen3_moe, tiny_glm4_moe])
def test_transformers_config_class_reads_and_writes_the_same_model(make_config):
    """transformers' own config class, fed our config.json, describes the same model when read back."""
    transformers = pytest.importorskip("transformers")
    config = make_config()
    hf_config = transformers.AutoConfig.for_model(**config.to_hf())
    assert ModelConfig.from_hf(hf_config.to_dict()) == config


def test_from_hf_uses_transformers_defaults_for_missing_keys():
    glm = ModelConfig.from_hf({"model_type": "glm4_moe", "num_hidden_layers": 2, "head_dim": 128})
    assert (glm.num_experts, glm.partial_rotary_factor, glm.first_dense_layers) == (128, 0.5, 1)
    assert (glm.router_scoring, glm.router_correction_bias, glm.qk_norm) == ("sigmoid", True, False)
    qwen = ModelConfig.from_hf({"model_type": "qwen3_moe"})
    assert (qwen.head_dim, qwen.norm_topk_prob, qwen.num_kv_heads) == (2048 // 32, False, 4)


@pytest.mark.parametrize(
    "hf, message",
    [
        ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        ({"model_type": "qwen3_moe", "hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"model_type": "qwen3_moe", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"model_type": "qwen3_moe", "use_sliding_window": True}, "use_sliding_window"),
        ({"model_type": "qwen3_moe", "num_key_value_heads": 5}, "num_kv_heads (5)"),
    ],
)
def test_from_hf_rejects_what_we_cannot_run(hf, message):
    with pytest.raises(ModelConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_hf(hf)


def test_to_hf_rejects_features_the_family_cannot_express():
    with pytest.raises(ModelConfigError, match="num_shared_experts=1 cannot be written as a qwen3_moe"):
        tiny_qwen3_moe(num_shared_experts=1).to_hf()
    with pytest.raises(ModelConfigError, match="dense_layers=\\(2,\\) cannot be written as a glm4_moe"):
        tiny_glm4_moe(dense_layers=(2,)).to_hf()


def test_replace_names_the_closest_field():
    with pytest.raises(ModelConfigError, match="no field 'num_expert' \\(did you mean 'num_experts'\\?\\)"):
        tiny_qwen3_moe(num_expert=4)


def test_is_moe_layer_follows_both_families_rules():
    qwen = tiny_qwen3_moe(num_layers=6, dense_layers=(0, 4), moe_layer_step=2)
    assert [qwen.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, True]
    glm = tiny_glm4_moe(num_layers=4, first_dense_layers=2)
    assert [glm.is_moe_layer(i) for i in range(4)] == [False, False, True, True]


def test_large_presets_match_published_parameter_counts():
    """Qwen3-30B-A3B model card: 30.5B total, 3.3B activated, 29.9B non-embedding.
    GLM-4.5-Air: 106B total, 12B active (excluding embeddings; its MTP layer is not part of our model)."""
    qwen = qwen3_30b_a3b()
    assert param_count(qwen) == pytest.approx(30.5e9, rel=0.005)
    assert param_count(qwen, active=True) == pytest.approx(3.3e9, rel=0.02)
    assert param_count(qwen) - 2 * qwen.vocab_size * qwen.hidden_size == pytest.approx(29.9e9, rel=0.005)
    glm = glm45_air()
    assert param_count(glm) == pytest.approx(106e9, rel=0.01)
    embeddings = 2 * glm.vocab_size * glm.hidden_size
    assert param_count(glm, active=True) - embeddings == pytest.approx(12e9, rel=0.02)


def test_cpu_preset_is_small():
    assert 1e6 <= param_count(cpu_moe()) <= 3e6


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"partial_rotary_factor": 0.375}, "even number >= 2 \\(got 0.375 \\* 8\\)"),  # 3 rotary dims
        ({"moe_capacity_factor": 0.0}, "moe_capacity_factor must be > 0"),
        ({"moe_layer_step": 0}, "moe_layer_step must be >= 1"),
        ({"num_experts_per_token": 5}, "num_experts_per_token must be in \\[1, num_experts=4\\]"),
    ],
)
def test_invalid_model_configs_are_rejected(changes, message):
    with pytest.raises(ModelConfigError, match=message):
        tiny_qwen3_moe(**changes)


def test_group_limited_routing_needs_two_experts_per_group():
    with pytest.raises(ModelConfigError, match=">= 2 experts per group"):
        tiny_glm4_moe(num_expert_groups=8)  # 8 experts in 8 groups


def test_every_expert_may_be_selected():
    assert tiny_qwen3_moe(num_experts_per_token=4).num_experts_per_token == 4


def test_tiny_parameter_counts_by_hand():
    """tiny_qwen3_moe, counted in tests/test_memory_plan.py's docstring: trunk 20320, LM head 3104,
    value head 33; one token uses 2 of the 4 routed experts (6144 / 2 elements fewer)."""
    config = tiny_qwen3_moe()
    assert param_count(config) == 20320 + 3104
    assert param_count(config, active=True) == 20320 + 3104 - 6144 // 2
    assert param_count(config, kind="critic") == 20320 + 33
    assert param_count(tiny_qwen3_moe(tie_word_embeddings=True)) == 20320
