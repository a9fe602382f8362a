"""Our decoder against the installed transformers (torch, CPU, float32) on tiny random Qwen3-MoE / GLM-4.5-MoE
(`hf_cases.py`; the suite pins a 5.x, `make test-hf4` runs this file with 4.57.1).

Each case builds a randomly initialised HF model from a config dict (random norm weights, biases and
GLM routing-correction biases, so nothing is at its neutral value), saves it, loads it with
`from_pretrained`, compares logits on a padded batch, then saves ours back and loads it with
transformers.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import CheckpointError, ModelConfig, from_pretrained, param_count, save_pretrained
from tests.models.hf_cases import CASES, HF_SHARDED

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

BATCH, TIME = 3, 9
# row 0: no padding; row 1: 3 padding tokens on the right; row 2: 2 on the left
ATTENTION_MASK = np.ones((BATCH, TIME), np.int64)
ATTENTION_MASK[1, -3:] = 0
ATTENTION_MASK[2, :2] = 0


def _randomize(model, seed):
    """Move every norm weight, bias and routing-correction bias away from its neutral init."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("norm.weight"):
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=generator))
            elif name.endswith(".bias") or name.endswith("e_score_correction_bias"):
                tensor.copy_(0.2 * torch.randn(tensor.shape, generator=generator))


def _hf_logits(model, input_ids):
    # transformers' own positions for a padded batch (as in `generate`): count of earlier real tokens
    position_ids = np.maximum(np.cumsum(ATTENTION_MASK, axis=1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(input_ids),
            attention_mask=torch.tensor(ATTENTION_MASK),
            position_ids=torch.tensor(position_ids),
        )
    return out.logits.numpy()


def _assert_logits_close(ours, reference):
    real = ATTENTION_MASK.astype(bool)
    scale = np.max(np.abs(reference[real]))
    np.testing.assert_allclose(ours[real], reference[real], rtol=1e-4, atol=1e-4 * scale)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(name, HF model, its folder, our loaded policy, jitted forward, input ids, HF logits)."""
    name = request.param
    hf_config = transformers.AutoConfig.for_model(**CASES[name])
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    _randomize(hf_model, seed=1)
    folder = tmp_path_factory.mktemp(name)
    hf_model.save_pretrained(folder, max_shard_size="40KB" if name in HF_SHARDED else "1GB")
    input_ids = np.random.default_rng(2).integers(0, hf_config.vocab_size, (BATCH, TIME))
    policy = from_pretrained(folder)
    graphdef, _ = nnx.split(policy)
    forward = jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state)(ids, attention_mask=mask))
    return name, hf_model, folder, policy, forward, input_ids, _hf_logits(hf_model, input_ids)


def test_from_pretrained_logits_match_transformers(case):
    name, _, folder, policy, forward, input_ids, hf_logits = case
    if name in HF_SHARDED:
        assert (folder / "model.safetensors.index.json").exists()  # the sharded path was exercised
    ours = np.asarray(forward(nnx.state(policy), jnp.asarray(input_ids), jnp.asarray(ATTENTION_MASK)))
    assert ours.dtype == np.float32 and ours.shape == hf_logits.shape
    _assert_logits_close(ours, hf_logits)
    if name.startswith("glm4"):
        # the match is only meaningful if the random e_score_correction_bias changes expert choice
        unbiased = nnx.clone(policy)
        for layer in unbiased.layers:
            if layer.is_moe:
                bias = layer.mlp.router.e_score_correction_bias
                bias.set_value(jnp.zeros_like(bias.get_value()))
        ours = np.asarray(forward(nnx.state(unbiased), jnp.asarray(input_ids), jnp.asarray(ATTENTION_MASK)))
        real = ATTENTION_MASK.astype(bool)
        assert np.max(np.abs(ours[real] - hf_logits[real])) > 1e-3


def test_save_pretrained_round_trips_through_transformers(case, tmp_path):
    name, hf_model, _, policy, _, input_ids, hf_logits = case
    sharded = name not in HF_SHARDED
    save_pretrained(policy, tmp_path, max_shard_bytes=30_000 if sharded else 2**30)
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == CASES[name]["model_type"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    original = hf_model.state_dict()
    restored = reloaded.state_dict()
    assert sorted(restored) == sorted(original)
    for key, tensor in original.items():
        torch.testing.assert_close(restored[key], tensor, rtol=0, atol=0, msg=key)
    _assert_logits_close(_hf_logits(reloaded, input_ids), hf_logits)


def test_param_count_matches_transformers(case):
    name, hf_model, _, policy, *_ = case
    config = ModelConfig.from_hf(hf_model.config.to_dict())
    assert param_count(config) == hf_model.num_parameters()
    ours = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(policy, nnx.Param)))
    assert ours == hf_model.num_parameters()


@pytest.mark.parametrize("name", ["qwen3_moe_untied", "glm4_moe_tied"])
def test_bfloat16_checkpoints_round_trip_through_transformers(name, tmp_path):
    """A bfloat16 model saved by transformers (sharded) loads as bfloat16 parameters holding the same
    bits; saved back (sharded), transformers reads it as bfloat16 with every tensor unchanged."""
    hf_config = transformers.AutoConfig.for_model(**CASES[name])
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    _randomize(hf_model, seed=1)
    hf_model = hf_model.to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    policy = from_pretrained(tmp_path / "hf", dtype=jnp.bfloat16)
    assert policy.embed.embedding[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(  # the same bits, not just close
        np.asarray(policy.embed.embedding[...]).view(np.uint16),
        hf_model.model.embed_tokens.weight.detach().view(torch.int16).numpy().view(np.uint16),
    )
    save_pretrained(policy, tmp_path / "ours", max_shard_bytes=20_000)
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype="auto")
    assert reloaded.dtype == torch.bfloat16
    original, restored = hf_model.state_dict(), reloaded.state_dict()
    assert sorted(restored) == sorted(original)
    for key, tensor in original.items():  # GLM's router loads as float32 (transformers keeps it so): same values
        torch.testing.assert_close(restored[key].to(tensor.dtype), tensor, rtol=0, atol=0, msg=key)


def test_fused_expert_tensors_are_named_with_the_way_to_save_them(tmp_path):
    """transformers 5.x can save its in-memory layout (a layer's experts in one gate_up_proj tensor)."""
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4.x has no fused expert layout")
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**CASES["glm4_moe_tied"]))
    hf_model.save_pretrained(tmp_path, save_original_format=False)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.experts\.(gate_up|down)_proj' .*"
                       r"save_original_format=False"):
        from_pretrained(tmp_path)
