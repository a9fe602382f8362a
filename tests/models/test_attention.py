"""`causal_attention` (query blocks over their causal prefix of keys) against a plain numpy softmax
attention and against the full [time, time] einsum attention's gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.models.layers import AttentionLayout, causal_attention, dot_product_attention
from tests.models.test_splash_attention import qkv, reference_attention


@pytest.mark.parametrize("time", [40, 200])  # one block; blocks of 64, 64, 64 and a ragged 8
def test_causal_attention_equals_softmax_over_earlier_real_keys(time):
    q, k, v, mask = qkv(time=time)
    got = causal_attention(q, k, v, AttentionLayout.build(mask, None, None).allowed)
    real = np.asarray(mask)[..., None, None]
    want = reference_attention(q, k, v, mask)
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), rtol=1e-5, atol=1e-5)


def test_causal_attention_gradients_equal_the_full_attention_gradients():
    q, k, v, mask = qkv(time=200)
    allowed = AttentionLayout.build(mask, None, None).allowed
    weights = jax.random.normal(jax.random.key(1), q.shape) * mask[..., None, None]  # real queries only

    def grads(attend):
        loss = lambda q, k, v: jnp.sum(weights * attend(q, k, v, allowed))  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    for got, want in zip(grads(causal_attention), grads(dot_product_attention)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
