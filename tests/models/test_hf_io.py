"""from_pretrained / save_pretrained: clear errors that name the offending tensor, the spec table
covering exactly the model's variables, bfloat16 and loading onto a device mesh."""

import json
import re

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from sao_jax.models import (
    CheckpointError,
    Critic,
    ModelConfigError,
    Policy,
    from_pretrained,
    hf_tensor_specs,
    save_pretrained,
    tiny_glm4_moe,
    tiny_qwen3_moe,
)


@pytest.fixture(scope="module")
def saved_glm(tmp_path_factory):
    """tiny_glm4_moe: layer 0 dense, layers 1-2 MoE with 8 experts; hidden 32, 2 kv heads of 16."""
    folder = tmp_path_factory.mktemp("glm")
    save_pretrained(Policy(tiny_glm4_moe(), rngs=nnx.Rngs(0)), folder)
    return folder


def _edited_copy(source, target, edit):
    """Copy a single-file checkpoint, applying `edit(tensors: dict)` to its tensors."""
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("make_config", [tiny_qwen3_moe, tiny_glm4_moe])
def test_tensor_specs_cover_exactly_the_model_variables(make_config):
    config = make_config()
    model = nnx.eval_shape(lambda: Policy(config, rngs=nnx.Rngs(0)))
    paths = {path for path, _ in nnx.to_flat_state(nnx.state(model))}
    specs = hf_tensor_specs(config)
    assert {spec.path for spec in specs} == paths
    assert len({spec.hf_name for spec in specs}) == len(specs)


@pytest.mark.parametrize("make_config", [tiny_qwen3_moe, tiny_glm4_moe])
def test_params_carry_logical_axes_and_router_bias_is_not_a_param(make_config):
    config = make_config()
    model = nnx.eval_shape(lambda: Critic(config, rngs=nnx.Rngs(0)))
    logical = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "expert", None}
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        axes = variable.get_metadata()["out_sharding"]
        assert len(axes) == variable.get_value().ndim and set(axes) <= logical, path
        assert path[-1] != "e_score_correction_bias"
    buffers = [path for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.Param)))]
    moe_layers = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
    expected = [("layers", i, "mlp", "router", "e_score_correction_bias") for i in moe_layers]
    assert buffers == (expected if config.router_correction_bias else [])


def test_unknown_model_type_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelConfigError, match="unsupported model_type 'llama'"):
        from_pretrained(tmp_path)


def test_missing_folder_contents_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_qwen3_moe().to_hf()))
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        from_pretrained(tmp_path)


@pytest.mark.slow  # builds a model
def test_missing_tensor_is_named(saved_glm, tmp_path):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    folder = _edited_copy(saved_glm, tmp_path / "ckpt", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"1 tensor\\(s\\) missing .*'{name}'"):
        from_pretrained(folder)


@pytest.mark.slow  # builds a model
def test_wrong_shape_names_tensor_and_both_shapes(saved_glm, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"  # [kv_heads * head_dim, hidden] = (32, 32)
    folder = _edited_copy(saved_glm, tmp_path / "ckpt", lambda t: t.update({name: np.zeros((16, 32), np.float32)}))
    with pytest.raises(CheckpointError, match=f"'{name}' .* has shape \\(16, 32\\), expected \\(32, 32\\)"):
        from_pretrained(folder)


@pytest.mark.slow  # builds a model
def test_unexpected_tensor_is_named(saved_glm, tmp_path):
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"  # layer 0 is dense in tiny_glm4_moe
    folder = _edited_copy(saved_glm, tmp_path / "ckpt", lambda t: t.update({name: np.zeros((16, 32), np.float32)}))
    with pytest.raises(CheckpointError, match=f"unexpected tensor '{name}'"):
        from_pretrained(folder)


@pytest.mark.slow  # builds a model
def test_glm_multi_token_prediction_layer_is_ignored(tmp_path):
    """GLM-4.5 checkpoints carry their MTP layer as model.layers.<num_layers>.*; transformers skips it."""
    config = tiny_glm4_moe(num_mtp_layers=1)
    policy = Policy(config, rngs=nnx.Rngs(0))
    source = tmp_path / "source"
    save_pretrained(policy, source)
    mtp = f"model.layers.{config.num_layers}.eh_proj.weight"
    folder = _edited_copy(source, tmp_path / "ckpt", lambda t: t.update({mtp: np.zeros((32, 64), np.float32)}))
    loaded = from_pretrained(folder)
    np.testing.assert_array_equal(loaded.embed.embedding[...], policy.embed.embedding[...])


@pytest.mark.slow  # builds a model
@pytest.mark.parametrize("num_mtp_layers", [0, 1])
def test_a_layer_past_the_multi_token_prediction_layers_is_unexpected(saved_glm, tmp_path, num_mtp_layers):
    """Only layers num_layers .. num_layers + num_mtp_layers - 1 may be skipped; the next one is an error."""
    hf_config = json.loads((saved_glm / "config.json").read_text())
    name = f"model.layers.{hf_config['num_hidden_layers'] + num_mtp_layers}.input_layernorm.weight"
    folder = _edited_copy(saved_glm, tmp_path / "ckpt", lambda t: t.update({name: np.ones(32, np.float32)}))
    (folder / "config.json").write_text(json.dumps({**hf_config, "num_nextn_predict_layers": num_mtp_layers}))
    with pytest.raises(CheckpointError, match=f"unexpected tensor '{re.escape(name)}'"):
        from_pretrained(folder)


@pytest.mark.slow  # builds a model
def test_a_tensor_in_two_shards_is_named_with_both_files(saved_glm, tmp_path):
    tensors = load_file(saved_glm / "model.safetensors")
    names = sorted(tensors)
    duplicate = "model.embed_tokens.weight"
    shards = {
        "model-00001-of-00002.safetensors": {*names[: len(names) // 2], duplicate},
        "model-00002-of-00002.safetensors": {*names[len(names) // 2 :], duplicate},
    }
    weight_map = {}
    for filename, shard in shards.items():
        save_file({n: tensors[n] for n in shard}, tmp_path / filename, metadata={"format": "pt"})
        weight_map.update({n: filename for n in shard})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text((saved_glm / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"'model\.embed_tokens\.weight' appears twice \(model-00001-of-00002"
                       r"\.safetensors and model-00002-of-00002\.safetensors\)"):
        from_pretrained(tmp_path)


@pytest.mark.slow  # builds a model
def test_bfloat16_parameters_round_trip(saved_glm, tmp_path):
    import jax.numpy as jnp

    policy = from_pretrained(saved_glm, dtype=jnp.bfloat16)
    assert policy.layers[1].mlp.experts.gate_proj[...].dtype == jnp.bfloat16
    save_pretrained(policy, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["torch_dtype"] == written["dtype"] == "bfloat16"  # 4.x's and 5.x's spelling
    again = from_pretrained(tmp_path, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(again.layers[1].mlp.experts.gate_proj[...], np.float32),
        np.asarray(policy.layers[1].mlp.experts.gate_proj[...], np.float32),
    )


def test_save_pretrained_refuses_a_critic(tmp_path):
    critic = nnx.eval_shape(lambda: Critic(tiny_glm4_moe(), rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match="got Critic"):
        save_pretrained(critic, tmp_path)


@pytest.mark.slow  # builds a model
def test_load_onto_a_mesh_shards_each_parameter_by_its_logical_axes(saved_glm):
    import jax

    from sao_jax.models.sharding import MESH_AXES

    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices")
    mesh = jax.make_mesh((2, 2, 2, 1), MESH_AXES)
    policy = from_pretrained(saved_glm, mesh=mesh)
    experts = policy.layers[1].mlp.experts.gate_proj[...]  # ("expert", "embed", "mlp")
    assert experts.sharding.spec == jax.sharding.PartitionSpec("expert", "fsdp", "tensor")
    assert len(experts.addressable_shards) == 8 and experts.addressable_shards[0].data.shape == (4, 16, 16)
    reference = from_pretrained(saved_glm)
    np.testing.assert_array_equal(np.asarray(experts), np.asarray(reference.layers[1].mlp.experts.gate_proj[...]))
