"""The sampler's decode backends (`sao_jax.rollout.decode`): the choice by name, and what each runs in
the sampler's programs — "xla" the model as written (no custom call), "native_cpu" the three decode
kernels — with the MoE layers' few-token calls under "native_cpu"."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import Policy, tiny_qwen3_moe
from sao_jax.models.moe import MoE, dense_dispatch, route
from sao_jax.rollout import decode
from sao_jax.rollout.sampler import Sampler

KERNELS = ("sao_cached_attention", "sao_few_rows_matmul", "sao_expert_swiglu_packed")


def test_names_resolve_per_platform_and_a_wrong_one_names_its_key(monkeypatch):
    assert decode.resolve_decode_backend("auto") == "native_cpu"  # the tests run on the CPU
    assert decode.resolve_decode_backend("xla") == "xla"
    assert decode.resolve_decode_backend("native_cpu") == "native_cpu"
    with pytest.raises(ValueError, match=r"^rollout\.decode_backend must be one of auto, xla, native_cpu \(got 'gpu'\)$"):
        decode.resolve_decode_backend("gpu", key="rollout.decode_backend")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert decode.resolve_decode_backend("auto") == "xla"
    with pytest.raises(ValueError, match=r"^rollout\.decode_backend=native_cpu runs C\+\+ kernels through XLA:CPU only"):
        decode.resolve_decode_backend("native_cpu", key="rollout.decode_backend")


@pytest.fixture(scope="module")
def policy():
    return Policy(tiny_qwen3_moe(vocab_size=112, moe_dispatch="blocked"), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("backend", ["xla", "native_cpu"])
def test_the_decode_program_runs_the_kernels_of_its_backend_only(policy, backend):
    sampler = Sampler(policy, chunk_size=2, decode_backend=backend)
    params = nnx.state(policy)
    state = sampler.init_state(2, 16)
    keys = jax.random.split(jax.random.key(0), 2)
    budgets, stop_ids = jnp.full((2,), 2, jnp.int32), jnp.full((2, 1), -1, jnp.int32)
    text = sampler._decode_chunk.lower(params, sampler.backend.prepare(params), state, keys, budgets, stop_ids,
                                       16).as_text()  # fmt: skip
    assert [kernel in text for kernel in KERNELS] == [backend == "native_cpu"] * 3


@pytest.mark.parametrize("dispatch, time, kernel", [
    ("blocked", 5, True),  # 10 tokens on 4 experts: the few-token calls
    ("blocked", 20, False),  # 40 tokens: the blocks
    ("sorted", 1, False),  # only "blocked"'s calls: its weights are the ones packed
])  # fmt: skip
def test_native_cpu_runs_the_experts_kernel_where_blocked_takes_its_few_token_dispatch(dispatch, time, kernel):
    config = tiny_qwen3_moe(moe_dispatch=dispatch, initializer_range=0.5)  # 4 experts, k 2, embed 32, mlp 16
    block = MoE(config, rngs=nnx.Rngs(3))
    backend = decode.NativeCpuDecode(nnx.split(block)[0], config)
    assert backend.packs_experts == (dispatch == "blocked")
    graphdef, state = nnx.split(block)

    def call(state, prepared, x, mask):
        block = nnx.merge(graphdef, state)
        return block(x, mask, backend.kernels(block, prepared))[0]

    x = jax.random.normal(jax.random.key(1), (2, time, 32))
    mask = jnp.ones((2, time), bool)
    prepared = backend.prepare(state) if dispatch == "blocked" else ()
    lowered = jax.jit(call).lower(state, prepared, x, mask)
    assert ("sao_expert_swiglu_packed" in lowered.as_text()) == kernel
    expert_ids, weights, _ = route(block.router(x.reshape(-1, 32)), None, config)
    experts = (block.experts.gate_proj[...], block.experts.up_proj[...], block.experts.down_proj[...])
    want = dense_dispatch(x.reshape(-1, 32), expert_ids, weights, *experts).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(lowered.compile()(state, prepared, x, mask)), np.asarray(want),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
