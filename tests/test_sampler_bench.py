"""benchmarks/sampler.py's Tunix side on tiny models: Tunix's Qwen3, loaded from our `save_pretrained`
folder, gives our logits (dense and MoE layers), and its sampler decodes the full budget of new
tokens from token-id prompts. Skipped without the `bench` extra (tunix)."""

import importlib.util
import pathlib
import tempfile

import numpy as np
import pytest
from flax import nnx

pytest.importorskip("tunix.models.qwen3.params")
from sao_jax.models import Policy, from_pretrained, save_pretrained  # noqa: E402

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "sampler.py"
_spec = importlib.util.spec_from_file_location("sampler_bench", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.slow
@pytest.mark.parametrize("dense", [False, True])
def test_tunix_loads_our_weights_and_samples_the_full_budget(dense):
    config = bench.bench_config(64, 2, vocab_size=128)
    config = config.replace(dense_layers=(0, 1)) if dense else config
    with tempfile.TemporaryDirectory() as folder:
        save_pretrained(Policy(config, rngs=nnx.Rngs(0)), folder)
        policy = from_pretrained(folder, moe_dispatch=config.moe_dispatch)
        tunix_model = bench.load_tunix(folder, config)
    prompts = np.random.default_rng(0).integers(3, config.vocab_size, (2, 12)).astype(np.int32)
    assert bench.tunix_logit_gap(policy, tunix_model, prompts[0]) < 1e-4
    runs = bench.tunix_runs(tunix_model, config, prompts, new_tokens=5)
    assert min(bench.interleaved_medians(runs, repeats=1).values()) > 0  # the runs assert 5 and 1 tokens a row
