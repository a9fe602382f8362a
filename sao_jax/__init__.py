"""sao_jax: Single-rollout Asynchronous Optimization (SAO) for RL of LLM agents, in JAX/Flax."""

import os

__version__ = "0.1.0"

# XLA:CPU's default scheduler orders a program so that independent ops can run at once, and keeps
# their buffers alive together. In a TTUR step (K critic updates, then a policy update) that keeps
# every update's temporaries at the same time, and the one program runs slower than the same updates
# called one by one; with the memory-ordered scheduler it is the faster (benchmarks/RESULTS.md). The
# option is read from XLA_FLAGS when the first backend starts (`jax.jit(compiler_options=...)` does
# not reach it), so it is set here, on import, unless XLA_FLAGS already names it. Other backends
# ignore it.
_CPU_SCHEDULER_FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"
if _CPU_SCHEDULER_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_CPU_SCHEDULER_FLAG}=false".strip()
