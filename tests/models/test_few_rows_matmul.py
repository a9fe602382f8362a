"""The decode steps' projection kernel (`native.decode.few_rows_matmul`) against float64 numpy products,
and where the "native_cpu" decode backend's kernels (`rollout.decode.NativeCpuKernels`) run it in the
model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax import native
from sao_jax.models import Policy, layers, tiny_glm4_moe, tiny_qwen3_moe
from sao_jax.models.layers import Attention, Projection
from sao_jax.native.decode import FEW_ROWS, few_rows_matmul, few_rows_matmul_takes
from sao_jax.rollout.decode import NativeCpuKernels
from sao_jax.rollout.sampler import Sampler

KERNEL = "sao_few_rows_matmul"
KERNELS = NativeCpuKernels()  # no packed experts: these tests run no MoE decode step


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 13, 32])
def test_kernel_equals_a_float64_product(rows):
    """Rows go 8, 4, 2, 1 at a time (13 = 8 + 4 + 1, 7 = 4 + 2 + 1, 3 = 2 + 1); groups of one or two
    rows sum alternate depths in separate chains (depth 20: five rounds of four). Width 400 is 25
    16-column strips, split into one range per pool thread (unevenly for 2, 3, 4 … threads)."""
    rng = np.random.default_rng(rows)
    x, w = rng.normal(size=(rows, 20)), rng.normal(size=(20, 400))
    args = (jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    lowered = jax.jit(few_rows_matmul).lower(*args)
    assert KERNEL in lowered.as_text()
    got = np.asarray(lowered.compile()(*args))
    want = np.asarray(args[0], np.float64) @ np.asarray(args[1], np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "rows, depth, width, dtype, kernel",
    [(FEW_ROWS, 32, 16, jnp.float32, True), (FEW_ROWS + 1, 32, 16, jnp.float32, False),
     (4, 30, 16, jnp.float32, False), (4, 32, 24, jnp.float32, False), (4, 32, 16, jnp.bfloat16, False)],
)  # fmt: skip
def test_the_kernel_takes_few_float32_rows_of_whole_strips(rows, depth, width, dtype, kernel):
    """Up to FEW_ROWS float32 rows, depth a multiple of 4, width of 16."""
    assert few_rows_matmul_takes(rows, depth, width, dtype) == kernel


@pytest.mark.parametrize("equation, x_shape, kernel_shape", [
    ("btd,dhk->bthk", (6, 1, 32), (32, 2, 16)),  # q, k, v: contracts one axis
    ("bthk,hkd->btd", (6, 1, 2, 16), (2, 16, 48)),  # o: contracts heads and head_dim
])  # fmt: skip
def test_projection_of_a_decode_step_runs_the_kernel_and_equals_the_einsum(equation, x_shape, kernel_shape):
    rng = np.random.default_rng(2)
    config = tiny_qwen3_moe()
    projection = Projection(equation, kernel_shape, (None,) * len(kernel_shape), None, None, config, nnx.Rngs(0))
    projection.kernel.value = jnp.asarray(rng.normal(size=kernel_shape), jnp.float32)
    graphdef, state = nnx.split(projection)
    apply = jax.jit(lambda x, kernels: nnx.merge(graphdef, state)(x, kernels), static_argnums=1)
    for time in (1, 3):  # a decode step runs the kernel; a longer chunk the einsum
        x = jnp.asarray(rng.normal(size=(x_shape[0], time, *x_shape[2:])), jnp.float32)
        assert KERNEL not in apply.lower(x, layers.NO_KERNELS).as_text()  # the model as written
        lowered = apply.lower(x, KERNELS)
        assert (KERNEL in lowered.as_text()) == (time == 1)
        want = np.einsum(equation, np.asarray(x, np.float64), np.asarray(projection.kernel.value, np.float64))
        np.testing.assert_allclose(np.asarray(lowered.compile()(x)), want, rtol=1e-5, atol=1e-5)


def test_without_the_kernel_a_decode_projection_is_the_einsum(monkeypatch):
    """No compiler: the einsum's numbers, and no custom call."""
    monkeypatch.setattr(native, "few_rows_matmul_available", lambda: False)
    projection = Projection("btd,dhk->bthk", (32, 2, 16), (None,) * 3, None, None, tiny_qwen3_moe(), nnx.Rngs(0))
    graphdef, state = nnx.split(projection)
    x = jnp.ones((4, 1, 32), jnp.float32)
    lowered = jax.jit(lambda x: nnx.merge(graphdef, state)(x, KERNELS)).lower(x)
    assert KERNEL not in lowered.as_text()
    want = np.einsum("btd,dhk->bthk", np.ones((4, 1, 32)), np.asarray(projection.kernel.value, np.float64))
    np.testing.assert_allclose(np.asarray(lowered.compile()(x)), want, rtol=1e-5, atol=1e-5)


def test_several_einsums_are_one_kernel_call_with_the_float64_products():
    rng = np.random.default_rng(5)
    args = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((6, 1, 32), (32, 16), (32, 48), (32, 32))]
    lowered = jax.jit(lambda x, *ws: KERNELS.einsums("btd,dv->btv", x, ws)).lower(*args)
    assert lowered.as_text().count(f"@{KERNEL}") == 1
    products = lowered.compile()(*args)
    assert len(products) == 3
    for got, w in zip(products, args[1:]):
        want = np.asarray(args[0], np.float64) @ np.asarray(w, np.float64)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", [tiny_qwen3_moe(), tiny_glm4_moe()], ids=["qwen3", "glm4 (q, k, v bias)"])
def test_q_k_v_of_a_decode_step_are_one_kernel_call_and_equal_the_einsums(config):
    rng = np.random.default_rng(6)
    attention = Attention(config, rngs=nnx.Rngs(0))
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    for projection in projections:
        projection.kernel.value = jnp.asarray(rng.normal(size=projection.kernel.value.shape), jnp.float32)
        if projection.bias is not None:
            projection.bias.value = jnp.asarray(rng.normal(size=projection.bias.value.shape), jnp.float32)
    graphdef, state = nnx.split(attention)
    project_qkv = jax.jit(lambda x: nnx.merge(graphdef, state).project_qkv(x, KERNELS))
    for time in (1, 3):  # a decode step: one call for the three; a longer chunk: the einsums
        x = jnp.asarray(rng.normal(size=(5, time, config.hidden_size)), jnp.float32)
        lowered = project_qkv.lower(x)
        assert lowered.as_text().count(f"@{KERNEL}") == (time == 1)
        for got, projection in zip(lowered.compile()(x), projections):
            kernel = np.asarray(projection.kernel.value, np.float64)
            want = np.einsum("btd,dhk->bthk", np.asarray(x, np.float64), kernel)
            if projection.bias is not None:
                want = want + np.asarray(projection.bias.value, np.float64)
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_the_decode_loop_carries_the_side_by_side_weights_rather_than_joining_them_each_step():
    """The weights do not change in a decode chunk, so XLA hoists their concatenation out of the
    loop: the while loop carries q | k | v [32, 64] (both layers) and the dense layer's gate | up
    [32, 96]."""
    config = tiny_qwen3_moe()
    policy = Policy(config, rngs=nnx.Rngs(0))
    sampler = Sampler(policy, chunk_size=4)
    state = sampler.init_state(2, 16)
    keys = jax.random.split(jax.random.key(0), 2)
    budgets, stop_ids = jnp.full((2,), 4, jnp.int32), jnp.full((2, 1), -1, jnp.int32)
    params = nnx.state(policy)
    compiled = sampler._decode_chunk.lower(params, sampler.backend.prepare(params), state, keys, budgets, stop_ids,
                                           16).compile()  # fmt: skip
    (loop,) = [line for line in compiled.as_text().splitlines() if " while(" in line]
    assert loop.count("f32[32,64]") == 2 and loop.count("f32[32,96]") == 1


def test_a_decode_step_of_the_policy_runs_every_projection_through_the_kernel():
    """Layer 0 dense (q | k | v, o, gate | up, down), layer 1 MoE (q | k | v, o), the LM head (vocab
    112): 7 kernel calls; the logits equal the first position of a 2-token forward (XLA's dots). The
    model as written (no kernels) runs none."""
    config = tiny_qwen3_moe(vocab_size=112, initializer_range=0.3)
    graphdef, state = nnx.split(Policy(config, rngs=nnx.Rngs(0)))
    forward = jax.jit(lambda ids, kernels: nnx.merge(graphdef, state).forward(ids, kernels=kernels)[0],
                      static_argnums=1)  # fmt: skip
    ids = jnp.asarray(np.random.default_rng(4).integers(0, 112, (5, 2)), jnp.int32)
    assert "sao_" not in forward.lower(ids[:, :1], layers.NO_KERNELS).as_text()
    lowered = forward.lower(ids[:, :1], KERNELS)
    assert lowered.as_text().count(f"@{KERNEL}") == 7
    np.testing.assert_allclose(np.asarray(lowered.compile()(ids[:, :1])), np.asarray(forward(ids, KERNELS))[:, :1],
                               rtol=1e-5, atol=1e-5)  # fmt: skip
