"""sao_jax: Single-rollout Asynchronous Optimization (SAO) for RL of LLM agents, in JAX/Flax."""

__version__ = "0.1.0"
