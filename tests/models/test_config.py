"""ModelConfig: Hugging Face config.json translation (both transformers generations' schemas),
validation errors, presets, parameter counts."""

import json
import re
from pathlib import Path

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
from sao_jax.models.config import _FAMILIES
from tests.models.hf_cases import CASES

HF_CONFIGS = Path(__file__).parent / "hf_configs"


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


# HF config keys of the cases in hf_cases.py and the ModelConfig field each one sets
OUR_FIELD = dict(
    vocab_size="vocab_size", hidden_size="hidden_size", num_hidden_layers="num_layers",
    num_attention_heads="num_heads", num_key_value_heads="num_kv_heads", head_dim="head_dim",
    intermediate_size="intermediate_size", moe_intermediate_size="moe_intermediate_size",
    initializer_range="initializer_range", max_position_embeddings="max_position_embeddings",
    rope_theta="rope_theta", rms_norm_eps="rms_norm_eps", tie_word_embeddings="tie_word_embeddings",
    attention_bias="attention_bias", num_experts_per_tok="num_experts_per_token", norm_topk_prob="norm_topk_prob",
    num_experts="num_experts", mlp_only_layers="dense_layers", decoder_sparse_step="moe_layer_step",
    n_routed_experts="num_experts", n_group="num_expert_groups", topk_group="num_selected_groups",
    n_shared_experts="num_shared_experts", first_k_dense_replace="first_dense_layers",
    partial_rotary_factor="partial_rotary_factor", use_qk_norm="qk_norm",
    routed_scaling_factor="routed_scaling_factor", num_nextn_predict_layers="num_mtp_layers",
)  # fmt: skip
RECORDED = ("4.57.1", "5.24.0")  # the transformers versions that wrote hf_configs/ (record_hf_configs.py)


def _recorded(name, version):
    return json.loads((HF_CONFIGS / f"{name}.{version}.json").read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_json_of_transformers_4_and_5_give_the_same_model(name):
    """The config.json that transformers 4.57.1 and 5.24.0 wrote for the same model (the schemas
    differ: num_experts / num_local_experts, rope_theta / rope_parameters) give one ModelConfig, and
    every key of the case lands in its field — the RoPE θ and expert count among them."""
    written = {version: _recorded(name, version) for version in RECORDED}
    assert "rope_theta" in written["4.57.1"] and "rope_theta" not in written["5.24.0"]  # the two schemas
    assert "num_local_experts" in written["5.24.0"] or CASES[name]["model_type"] == "glm4_moe"
    old, new = (ModelConfig.from_hf(written[version]) for version in RECORDED)
    assert old == new
    for key, value in CASES[name].items():
        if key != "model_type":
            assert getattr(new, OUR_FIELD[key]) == (tuple(value) if isinstance(value, list) else value), key


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_json_of_the_installed_transformers_gives_the_recorded_model(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.AutoConfig.for_model(**CASES[name]).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert ModelConfig.from_hf(written) == ModelConfig.from_hf(_recorded(name, RECORDED[0]))


SHAPES = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=48, moe_intermediate_size=16, num_experts_per_tok=2,
)  # fmt: skip
MINIMAL = {  # the keys without a default (they set shapes), in each family's 4.x spelling
    "qwen3_moe": dict(SHAPES, num_experts=4),
    "glm4_moe": dict(SHAPES, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1),
}


@pytest.mark.parametrize("model_type", sorted(MINIMAL))
def test_absent_keys_take_the_defaults_of_the_installed_transformers(model_type):
    """A config.json with only the shape keys reads as the installed transformers' config class
    fills it in (`AutoConfig.for_model` with the same keys)."""
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.AutoConfig.for_model(model_type=model_type, **MINIMAL[model_type])
    minimal = dict(MINIMAL[model_type], model_type=model_type, transformers_version=transformers.__version__)
    assert ModelConfig.from_hf(minimal) == ModelConfig.from_hf(hf_config.to_dict())


def test_absent_keys_take_the_defaults_of_the_version_that_wrote_the_file():
    for version, mtp_layers in (("4.57.1", 0), ("5.24.0", 1)):
        glm = ModelConfig.from_hf(dict(MINIMAL["glm4_moe"], model_type="glm4_moe", transformers_version=version))
        assert (glm.rope_theta, glm.partial_rotary_factor, glm.qk_norm, glm.norm_topk_prob) == (1e4, 0.5, False, True)
        assert (glm.rms_norm_eps, glm.num_expert_groups, glm.routed_scaling_factor) == (1e-5, 1, 1.0)
        assert glm.num_mtp_layers == mtp_layers  # a 5.x field (num_mtp_layers=1); 4.x has none
        qwen = ModelConfig.from_hf(dict(MINIMAL["qwen3_moe"], model_type="qwen3_moe", transformers_version=version))
        assert (qwen.rope_theta, qwen.norm_topk_prob, qwen.dense_layers, qwen.moe_layer_step) == (1e4, False, (), 1)
        assert (qwen.rms_norm_eps, qwen.head_dim, qwen.num_experts) == (1e-6, 32 // 4, 4)


@pytest.mark.parametrize(
    "model_type, absent, message",
    [
        ("qwen3_moe", "num_experts", "no 'num_experts' or 'num_local_experts': it sets the model's shapes"),
        ("glm4_moe", "n_routed_experts", "no 'n_routed_experts' or 'num_local_experts': it sets"),
        ("glm4_moe", "first_k_dense_replace", "no 'first_k_dense_replace': it sets the model's shapes"),
        ("qwen3_moe", "hidden_size", "no 'hidden_size': it sets the model's shapes"),
    ],
)
def test_an_absent_shape_key_is_an_error_naming_it(model_type, absent, message):
    hf = dict(MINIMAL[model_type], model_type=model_type, transformers_version="5.24.0")
    del hf[absent]
    with pytest.raises(ModelConfigError, match=re.escape(message)):
        ModelConfig.from_hf(hf)


def test_without_transformers_version_an_absent_key_is_an_error_naming_it():
    hf = tiny_qwen3_moe().to_hf()
    del hf["rope_theta"], hf["rope_parameters"]["rope_theta"]
    with pytest.raises(ModelConfigError, match=re.escape(
        "no 'rope_theta' or 'rope_parameters.rope_theta', and no transformers_version says whose default"
    )):  # fmt: skip
        ModelConfig.from_hf(hf)
    with pytest.raises(ModelConfigError, match="transformers_version '6.0.0' says whose default"):
        ModelConfig.from_hf({**hf, "transformers_version": "6.0.0"})
    assert ModelConfig.from_hf({**hf, "transformers_version": "5.24.0"}).rope_theta == 10000.0


def test_two_spellings_that_disagree_are_an_error_naming_both():
    hf = {**tiny_qwen3_moe().to_hf(), "num_local_experts": 8}
    with pytest.raises(ModelConfigError, match="gives num_experts=4 and num_local_experts=8: they must agree"):
        ModelConfig.from_hf(hf)
    hf = tiny_glm4_moe().to_hf()
    hf["rope_parameters"] = {**hf["rope_parameters"], "rope_theta": 5e5}
    with pytest.raises(ModelConfigError, match="gives rope_theta=10000.0 and rope_parameters.rope_theta=500000.0"):
        ModelConfig.from_hf(hf)
    hf["rope_parameters"]["rope_theta"] = 10000  # an int equal to the float: the same θ
    assert ModelConfig.from_hf(hf).rope_theta == 10000.0


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None}, "RoPE {'rope_scaling'"),
        ({"rope_scaling": {"factor": 4.0}}, "RoPE {'rope_scaling': {'factor': 4.0}"),
        ({"rope_theta": None, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "'yarn'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"num_key_value_heads": 5}, "num_kv_heads (5)"),
    ],
)
def test_from_hf_rejects_what_we_cannot_run(changes, message):
    with pytest.raises(ModelConfigError, match=re.escape(message)):
        ModelConfig.from_hf({**tiny_qwen3_moe().to_hf(), **changes})


def test_the_key_audit_lists_every_key_read():
    """docs/hf_config.md's table names every spelling of every key that from_hf reads."""
    audit = (Path(__file__).parents[2] / "docs" / "hf_config.md").read_text()
    for family in _FAMILIES.values():
        for key in family.keys.values():
            for spelling in key.spellings:
                assert f"`{spelling}`" in audit, spelling


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
