"""`model.attention="splash"`: the Pallas flash kernel (interpreted on CPU: `attention_kernel_interpret`)
against the einsum softmax attention, alone, inside the policy, and sharded over 8 fake devices."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import ModelConfigError, Policy, sharding, tiny_qwen3_moe
from sao_jax.models import layers
from sao_jax.models.layers import AttentionLayout, dot_product_attention, splash_attention

pytestmark = pytest.mark.filterwarnings("ignore:model.attention=splash off TPU")


def reference_attention(q, k, v, token_mask):
    """Plain numpy, one query at a time: softmax over the earlier real keys of the same head group."""
    q, k, v, token_mask = (np.asarray(x, np.float64) for x in (q, k, v, token_mask))
    batch, time, heads, head_dim = q.shape
    group = heads // k.shape[2]
    out = np.zeros(q.shape)
    for b in range(batch):
        for t in range(time):
            keys = [s for s in range(t + 1) if token_mask[b, s]]
            if not token_mask[b, t] or not keys:
                continue
            for h in range(heads):
                logits = np.array([q[b, t, h] @ k[b, s, h // group] for s in keys]) / np.sqrt(head_dim)
                p = np.exp(logits - logits.max())
                out[b, t, h] = (p / p.sum()) @ v[b, keys, h // group]
    return out


def qkv(batch=2, time=40, heads=4, kv_heads=2, head_dim=16):
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (batch, time, heads, head_dim))
    k, v = (jax.random.normal(key, (batch, time, kv_heads, head_dim)) for key in ks[1:])
    lengths = jnp.array([time, time - 15])[:batch]
    mask = (jnp.arange(time)[None] < lengths[:, None]).at[-1, :5].set(False)  # right and left padding
    return q, k, v, mask


@pytest.mark.parametrize("time", [40, 300])  # one block of 128; two blocks of 512 (padded)
def test_splash_equals_softmax_attention_on_real_tokens(time):
    q, k, v, mask = qkv(time=time)
    got = splash_attention(q, k, v, mask, interpret=True)
    real = np.asarray(mask)[..., None, None]
    want = reference_attention(q, k, v, mask) if time == 40 else dot_product_attention(
        q, k, v, AttentionLayout.build(mask, None, None).allowed)  # fmt: skip
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), rtol=1e-5, atol=1e-5)


def test_splash_gradients_equal_softmax_attention_gradients():
    q, k, v, mask = qkv()
    allowed = AttentionLayout.build(mask, None, None).allowed
    weights = jax.random.normal(jax.random.key(1), q.shape) * mask[..., None, None]

    def loss(attend):
        return lambda q, k, v: jnp.sum(weights * attend(q, k, v))

    want = jax.jit(jax.grad(loss(lambda q, k, v: dot_product_attention(q, k, v, allowed)), argnums=(0, 1, 2)))(q, k, v)
    got = jax.jit(jax.grad(loss(lambda q, k, v: splash_attention(q, k, v, mask, interpret=True)), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def policies():
    config = tiny_qwen3_moe()
    xla = Policy(config, rngs=nnx.Rngs(0))
    splash = Policy(dataclasses.replace(config, attention="splash", attention_kernel_interpret=True), rngs=nnx.Rngs(0))
    return xla, splash


def test_a_splash_policy_gives_the_xla_policys_logits(policies):
    xla, splash = policies
    tokens = jax.random.randint(jax.random.key(2), (2, 24), 0, 97)
    mask = jnp.arange(24)[None] < jnp.array([[24], [17]])
    real = np.asarray(mask)[..., None]
    np.testing.assert_allclose(np.where(real, splash(tokens, attention_mask=mask), 0),
                               np.where(real, xla(tokens, attention_mask=mask), 0), rtol=1e-4, atol=1e-5)  # fmt: skip


def test_a_splash_policy_runs_in_two_jitted_functions(policies):
    """The kernel is cached; made inside the first jit's trace, its mask arrays were that trace's
    tracers, and the second function failed with UnexpectedTracerError."""
    _, splash = policies
    layers._splash_kernel.cache_clear()
    graph, state = nnx.split(splash)
    tokens = jax.random.randint(jax.random.key(4), (2, 20), 0, 97)
    once = jax.jit(lambda state, tokens: nnx.merge(graph, state)(tokens))(state, tokens)
    twice = jax.jit(lambda state, tokens: 2 * nnx.merge(graph, state)(tokens))(state, tokens)
    np.testing.assert_allclose(twice, 2 * once, rtol=1e-6)


@pytest.mark.slow
def test_splash_attention_sharded_over_a_mesh_matches_one_device(policies):
    """Batch over data × fsdp = 4 and kv heads over tensor = 2: the kernel runs in a shard_map."""
    _, splash = policies
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    tokens = jax.random.randint(jax.random.key(3), (4, 24), 0, 97)
    graph, state = nnx.split(splash)
    forward = jax.jit(lambda state, tokens: nnx.merge(graph, state)(tokens))
    single = forward(state, tokens)
    with sharding.use_mesh(mesh):
        sharded = forward(state, jax.device_put(tokens, sharding.logical_sharding(mesh, ("batch", "length"))))
    np.testing.assert_allclose(sharded, single, rtol=1e-5, atol=1e-5)


def test_an_unknown_attention_is_a_clear_error():
    with pytest.raises(ModelConfigError, match="ModelConfig.attention must be one of"):
        tiny_qwen3_moe(attention="flash")


def test_a_run_off_tpu_interprets_the_kernel():
    """`sao-train` with `model.attention=splash` on the CPU builds the policy with the kernel in
    interpret mode (it compiles for TPU only); the default attention leaves the flag off."""
    from sao_jax.config import load_config
    from sao_jax.train.loop import build_run

    tiny = ["model.preset=tiny_qwen3_moe", "env.train_prompts=2", "env.eval_prompts=1"]
    assert build_run(load_config(None, [*tiny, "model.attention=splash"])).policy.config.attention_kernel_interpret
    assert not build_run(load_config(None, tiny)).policy.config.attention_kernel_interpret
