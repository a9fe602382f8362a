"""Critic: per-token values, initialisation from a policy (in memory and from a checkpoint)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import Critic, Policy, from_pretrained, save_pretrained, tiny_glm4_moe

pytestmark = pytest.mark.slow  # builds and compiles a model

DECODER = ("embed", "layers", "final_norm")


@pytest.fixture(scope="module")
def policy():
    return Policy(tiny_glm4_moe(), rngs=nnx.Rngs(0))


def _assert_decoder_equal(critic, policy):
    for name in DECODER:
        ours = nnx.to_flat_state(nnx.state(getattr(critic, name)))
        theirs = dict(nnx.to_flat_state(nnx.state(getattr(policy, name))))
        assert len(ours) == len(theirs)
        for path, variable in ours:
            assert type(variable) is type(theirs[path]), path
            np.testing.assert_array_equal(variable.get_value(), theirs[path].get_value(), err_msg=str(path))


def test_values_are_per_token_float32(policy):
    critic = Critic.from_policy(policy, rngs=nnx.Rngs(1))
    ids = jnp.array([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
    mask = jnp.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    values, hidden = nnx.jit(
        lambda critic, policy: (critic(ids, attention_mask=mask), policy.hidden_states(ids, attention_mask=mask)[0])
    )(critic, policy)
    assert values.shape == (2, 5) and values.dtype == jnp.float32
    # v = final hidden state · kernel + bias, with the policy's trunk
    expected = hidden @ critic.value_head.kernel[...] + critic.value_head.bias[...]
    np.testing.assert_allclose(values, expected, rtol=1e-5, atol=1e-6)
    assert not hasattr(critic, "lm_head")


def test_from_policy_copies_the_decoder(policy):
    critic = Critic.from_policy(policy, rngs=nnx.Rngs(1))
    _assert_decoder_equal(critic, policy)
    # a copy, not shared buffers: donating or editing one model's arrays leaves the other intact
    policy_embedding = policy.embed.embedding[...]
    assert critic.embed.embedding[...].unsafe_buffer_pointer() != policy_embedding.unsafe_buffer_pointer()
    assert critic.value_head.kernel[...].shape == (policy.config.hidden_size,)


def test_from_pretrained_critic_loads_the_policy_trunk(policy, tmp_path):
    save_pretrained(policy, tmp_path)
    critic = from_pretrained(tmp_path, kind="critic", rngs=nnx.Rngs(3))
    assert isinstance(critic, Critic)
    _assert_decoder_equal(critic, policy)
    assert isinstance(critic.value_head.kernel, nnx.Param) and not hasattr(critic, "lm_head")


def test_value_head_adds_its_bias(policy):
    critic = Critic.from_policy(policy, rngs=nnx.Rngs(1))
    ids = jnp.array([[1, 2, 3, 4]])
    values = nnx.jit(lambda critic: critic(ids))
    before = values(critic)
    critic.value_head.bias[...] = jnp.asarray(0.75, jnp.float32)
    np.testing.assert_allclose(values(critic) - before, 0.75, rtol=1e-6)
