"""benchmarks/model.py's count of the FLOPs a compiled program executes, against FLOPs worked out by hand."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "model.py"
spec = importlib.util.spec_from_file_location("model_bench", SCRIPT)
model_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(model_bench)


def test_compiled_flops_counts_a_matmul_and_refuses_a_loop():
    a, b = jnp.ones((64, 32)), jnp.ones((32, 48))
    assert model_bench.compiled_flops(jax.jit(jnp.dot).lower(a, b).compile()) == 2 * 64 * 32 * 48

    def looped(a, b):  # 4 matmuls, but the analysis would count the loop body once
        return jax.lax.fori_loop(0, 4, lambda i, x: x + a @ b, jnp.zeros((64, 48)))

    assert model_bench.compiled_flops(jax.jit(looped).lower(a, b).compile()) is None
