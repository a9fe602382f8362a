"""`compute_dtype_weights`: float32 masters stored in the bfloat16 compute dtype where the forward
casts them anyway, against the forward from the float32 masters themselves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import Policy, compute_dtype_weights, tiny_glm4_moe, tiny_qwen3_moe

PRESETS = {"qwen3_moe": tiny_qwen3_moe, "glm4_moe": tiny_glm4_moe}  # glm: qkv biases, shared experts, router bias


def logits(graphdef, state, input_ids, mask):
    return nnx.merge(graphdef, state)(input_ids, attention_mask=mask)


@pytest.fixture(scope="module", params=sorted(PRESETS))
def model(request):
    config = PRESETS[request.param](dtype="bfloat16", param_dtype="float32")
    graphdef, state = nnx.split(Policy(config, rngs=nnx.Rngs(0)))
    input_ids = jax.random.randint(jax.random.key(1), (2, 12), 1, config.vocab_size)
    mask = jnp.arange(12)[None, :] < jnp.array([[12], [7]])  # one row right-padded
    return config, graphdef, state, input_ids, mask, jax.jit(logits, static_argnums=0)


def nbytes(state):
    return sum(v.get_value().nbytes for _, v in nnx.to_flat_state(state))


def test_the_forward_from_the_cast_weights_is_bit_identical(model):
    config, graphdef, state, input_ids, mask, forward = model
    cast = compute_dtype_weights(state, config)
    np.testing.assert_array_equal(forward(graphdef, cast, input_ids, mask), forward(graphdef, state, input_ids, mask))
    dtypes = {"/".join(map(str, path)): v.get_value().dtype for path, v in nnx.to_flat_state(cast)}
    assert dtypes["layers/1/mlp/experts/gate_proj"] == jnp.bfloat16
    assert dtypes["layers/0/attn/q_proj/kernel"] == jnp.bfloat16
    assert dtypes["embed/embedding"] == jnp.bfloat16
    assert dtypes["layers/1/mlp/router/kernel"] == jnp.float32  # routing is computed in float32
    assert dtypes["final_norm/scale"] == jnp.float32  # scale · normed is a float32 product
    assert nbytes(cast) < 0.55 * nbytes(state)


def test_casting_every_float_parameter_would_change_the_forward(model):
    """The control: the norms and the router are read in float32, so rounding them too is visible."""
    config, graphdef, state, input_ids, mask, forward = model
    everything = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, state)
    assert not np.array_equal(forward(graphdef, everything, input_ids, mask), forward(graphdef, state, input_ids, mask))


@pytest.mark.parametrize("dtype, param_dtype", [("float32", "float32"), ("float32", "bfloat16"),
                                                ("bfloat16", "bfloat16")])  # fmt: skip
def test_weights_are_never_widened_or_copied_for_nothing(dtype, param_dtype):
    config = tiny_qwen3_moe(dtype=dtype, param_dtype=param_dtype)
    state = nnx.state(Policy(config, rngs=nnx.Rngs(0)))
    assert compute_dtype_weights(state, config) is state
