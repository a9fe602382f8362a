"""Per-layer rematerialisation (`ModelConfig.remat`): same numbers, recomputed activations."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models import Policy, tiny_glm4_moe


def _loss_and_grads(remat: bool):
    policy = Policy(tiny_glm4_moe(remat=remat), rngs=nnx.Rngs(0))  # same seed: same weights either way
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 12)), jnp.int32)
    mask = jnp.ones_like(ids).at[1, 9:].set(0)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(2, 12, 97)), jnp.float32)

    def loss(model):
        return jnp.sum(model(ids, attention_mask=mask) * weights)

    graph, params, rest = nnx.split(policy, nnx.Param, ...)

    def pure(params):
        return loss(nnx.merge(graph, params, rest))

    jaxpr = str(jax.make_jaxpr(jax.grad(pure))(params))
    value, grads = jax.jit(jax.value_and_grad(pure))(params)  # one compile, not op-by-op dispatch
    return value, grads, jaxpr


def test_remat_gives_the_same_loss_and_gradients_and_recomputes():
    value, grads, plain_jaxpr = _loss_and_grads(remat=False)
    value_r, grads_r, remat_jaxpr = _loss_and_grads(remat=True)
    np.testing.assert_allclose(value_r, value, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads_r, grads)
    # The backward pass recomputes the layers' forward matmuls: more of them than without remat.
    assert remat_jaxpr.count("dot_general[") > plain_jaxpr.count("dot_general[")
    assert "remat" in remat_jaxpr and "remat" not in plain_jaxpr
