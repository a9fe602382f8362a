"""The work the MoE dispatches compile to, against the model FLOPs of the routed experts.

Model FLOPs of one MoE layer's forward: each of the tokens · k assignments multiplies its token by
three [d_model, d_ff] expert matrices (gate, up, down), 2 FLOPs a multiply-add:
    F_model = 2 · tokens · k · 3 · d_model · d_ff
(the router, the SwiGLU's elementwise work and the weighted combine are not counted: they are
O(tokens · (E + k·d_ff + k·d_model)), ~1/(3·d_ff) of it here). Compiled FLOPs: XLA's cost analysis of
the jitted dispatch on the CPU, which counts every dot and elementwise op it will execute.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.config import load_config
from sao_jax.models import PRESETS
from sao_jax.models.moe import capacity_dispatch, dense_dispatch, expert_capacity, gmm_padded_rows, gmm_tiling

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the config that selects the capacity dispatch: the dispatch ablation, on the CPU preset
CAPACITY_CONFIG = ROOT / "configs" / "ablations" / "open" / "dis.yaml"


def _capacity_shape():
    """(model config, tokens of a training forward) of the run config that selects "capacity"."""
    run = load_config(CAPACITY_CONFIG)
    assert run.model.moe_dispatch == "capacity"
    model = PRESETS[run.model.preset]().replace(moe_dispatch="capacity")
    return model, run.rollout.num_slots * run.rollout.max_total_tokens


def _compiled_flops(fn, *args):
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def _arguments(model, tokens, seed=0):
    rng = np.random.default_rng(seed)
    e, d, f, k = model.num_experts, model.hidden_size, model.moe_intermediate_size, model.num_experts_per_token
    x = jnp.asarray(rng.normal(size=(tokens, d)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(tokens, k)), jnp.float32)
    params = [jnp.zeros(s, jnp.float32) for s in [(e, d, f), (e, d, f), (e, f, d)]]
    return x, ids, weights, *params


def test_capacity_dispatch_compiles_to_its_capacity_factor_times_the_model_flops():
    """cpu_moe (d 128, d_ff 96, 8 experts, top 2) at the dispatch ablation's training batch (32 × 96
    tokens): E · C slots of C = ceil(1.25 · tokens · k / E) give 1.25 × F_model in the expert matmuls;
    everything else the compiled forward counts must stay under a further 0.05. The dense dispatch
    (every expert on every token) is checked by the same count to come to E / k = 4 ×."""
    model, tokens = _capacity_shape()
    e, d, f, k = model.num_experts, model.hidden_size, model.moe_intermediate_size, model.num_experts_per_token
    model_flops = 2 * tokens * k * 3 * d * f
    capacity = expert_capacity(tokens, k, e, model.moe_capacity_factor)
    args = _arguments(model, tokens)
    ratio = _compiled_flops(lambda *a: capacity_dispatch(*a, capacity=capacity), *args) / model_flops
    dense_ratio = _compiled_flops(dense_dispatch, *args) / model_flops
    print(f"compiled ÷ model FLOPs at {tokens} tokens: capacity {ratio:.3f}, dense {dense_ratio:.3f}")
    slots_ratio = e * capacity / (tokens * k)  # 1.25 exactly here
    assert slots_ratio <= ratio <= 1.3
    assert abs(dense_ratio - e / k) < 0.05 * e / k


@pytest.mark.parametrize("itemsize", [4, 2])
def test_gmm_row_work_at_the_same_shape_is_bounded_by_its_tiling(itemsize):
    """gmm's forward computes `gmm_padded_rows` rows per matmul, at most ceil(R / tm) · tm + (E − 1) · tm
    for R = tokens · k rows: 6144 rows over 8 experts take tm 128 (f32) or 128 (bf16: the bound is
    on rows, not bytes), so padded ÷ real <= 1 + 128 · 8 / 6144 = 1.167 for any routing; the model
    FLOPs times that ratio is the kernel's work. Checked on the worst routing (every group starting
    one row into a tile) and on the balanced one (groups of 768 = 6 tiles each: no padding at all)."""
    model, tokens = _capacity_shape()
    e, k = model.num_experts, model.num_experts_per_token
    rows = tokens * k
    tm, _, _ = gmm_tiling(rows, model.hidden_size, model.moe_intermediate_size, e, itemsize)
    assert tm == 128
    bound = 1 + tm * e / rows
    assert bound == pytest.approx(1.1667, abs=1e-4)
    worst = [1] + [tm] * (e - 2)
    worst.append(rows - sum(worst))
    assert rows % tm == 0 and gmm_padded_rows(worst, tm) == rows + (e - 1) * tm  # 7040 rows: 1.146
    assert gmm_padded_rows(worst, tm) / rows <= bound
    assert gmm_padded_rows([rows // e] * e, tm) == rows
