"""The megablox dispatch ("gmm") against `dense_dispatch` (every expert on every token, the reference):
forward and gradients in float32, on one device and with the experts sharded over 8 fake CPU
devices; the Pallas kernel runs in interpret mode. Its tiling's padded rows against hand counts and
against megablox's own tile metadata."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import sharding, tiny_qwen3_moe
from sao_jax.models import moe as moe_lib
from sao_jax.models.moe import (
    MoE,
    dense_dispatch,
    expert_parallel_gmm_dispatch,
    gmm_dispatch,
    gmm_padded_rows,
    gmm_tiling,
)

TOLERANCE = 1e-5
gmm_interpreted = functools.partial(gmm_dispatch, interpret=True)


def _routing(kind, rng, tokens, num_experts, k):
    """expert_ids [tokens, k] (distinct experts per token) and routing weights."""
    if kind == "skewed":  # popularity halves expert by expert; the last two experts get no token
        popularity = np.array([2.0**-i for i in range(num_experts)])
        popularity[-2:] = 0.0
        ids = np.stack([rng.choice(num_experts, k, replace=False, p=popularity / popularity.sum())
                        for _ in range(tokens)])  # fmt: skip
    else:  # "one_expert_takes_all_first_choices": expert 2 gets every token; experts 0, 1 none
        ids = np.stack([np.full(tokens, 2), 3 + rng.integers(0, num_experts - 3, tokens)], axis=1)[:, :k]
    return jnp.asarray(ids, jnp.int32), jnp.asarray(rng.uniform(0.1, 1.0, (tokens, k)), jnp.float32)


def _problem(seed, routing, tokens, num_experts=6, k=2, d=8, f=16):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(tokens, d)), jnp.float32)
    params = tuple(jnp.asarray(rng.normal(scale=s[1] ** -0.5, size=s), jnp.float32) for s in
                   [(num_experts, d, f), (num_experts, d, f), (num_experts, f, d)])  # fmt: skip (outputs O(1))
    expert_ids, weights = _routing(routing, rng, tokens, num_experts, k)
    return x, expert_ids, weights, params


def _loss(dispatch, expert_ids):
    """Σ sin(dispatch(...)) · c, with fixed random c so that every output element has its own cotangent."""
    def loss(x, weights, params):
        out = dispatch(x, expert_ids, weights, *params)
        c = jax.random.normal(jax.random.key(0), out.shape)
        return jnp.sum(jnp.sin(out) * c)

    return loss


def _value_and_grads(dispatch, x, expert_ids, weights, params):
    out = jax.jit(dispatch)(x, expert_ids, weights, *params)
    grads = jax.jit(jax.grad(_loss(dispatch, expert_ids), argnums=(0, 1, 2)))(x, weights, params)
    return out, jax.tree.leaves(grads)  # x, routing weights, gate, up, down


def _max_errors(got, want):
    (out, grads), (ref_out, ref_grads) = got, want
    return [float(jnp.max(jnp.abs(a - b))) for a, b in zip([out, *grads], [ref_out, *ref_grads])]


# tokens 13 (rows 26, tm 8: padded to 32), 150 (rows 300, tm 16: padded to 304); empty experts,
# one expert with a group of every token, groups starting mid-tile
@pytest.mark.parametrize("routing,tokens", [("skewed", 13), ("skewed", 150), ("one_expert_takes_all_first_choices", 40)])
def test_gmm_dispatch_equals_dense_forward_and_gradients(routing, tokens):
    x, expert_ids, weights, params = _problem(tokens, routing, tokens)
    counts = np.bincount(np.asarray(expert_ids).ravel(), minlength=6)
    assert (counts == 0).any() and counts.max() >= tokens // 2  # empty experts and a crowded one
    want = _value_and_grads(dense_dispatch, x, expert_ids, weights, params)
    got = _value_and_grads(gmm_interpreted, x, expert_ids, weights, params)
    errors = _max_errors(got, want)
    print(f"gmm vs dense, {routing} x{tokens}: max |error| out, dx, dw, dgate, dup, ddown = {errors}")
    for name, g, w in zip(["out", "x", "weights", "gate", "up", "down"], [got[0], *got[1]], [want[0], *want[1]]):
        assert float(jnp.max(jnp.abs(w))) > 0.1, name  # a gradient of zeros would match anything
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=TOLERANCE, atol=TOLERANCE, err_msg=name)


@pytest.mark.parametrize("fault", ["group_sizes", "permutation"])
def test_a_wrong_group_size_or_permutation_fails_the_comparison(fault, monkeypatch):
    """The comparison above detects the faults it is for: one row moved to the neighbouring group, or
    two assignments of different experts swapped in the sorted order, change outputs and gradients
    far beyond the tolerance."""
    x, expert_ids, weights, params = _problem(13, "skewed", 13)
    want = _value_and_grads(dense_dispatch, x, expert_ids, weights, params)
    sort_by_expert = moe_lib._sort_by_expert

    def faulty(expert_ids, num_experts):
        order, group_sizes = sort_by_expert(expert_ids, num_experts)
        if fault == "group_sizes":
            return order, group_sizes.at[0].add(-1).at[1].add(1)
        first, last = 0, order.shape[0] - 1  # the first assignment is expert 0's, the last another's
        return order.at[first].set(order[last]).at[last].set(order[first]), group_sizes

    monkeypatch.setattr(moe_lib, "_sort_by_expert", faulty)
    fresh = functools.partial(gmm_dispatch, interpret=True)  # not `gmm_interpreted`, whose jit cache holds the right one
    errors = _max_errors(_value_and_grads(fresh, x, expert_ids, weights, params), want)
    assert errors[0] > 100 * TOLERANCE and max(errors[1:]) > 100 * TOLERANCE, errors


def test_moe_with_gmm_dispatch_equals_dense_and_reads_the_interpret_flag():
    """`ModelConfig.moe_dispatch="gmm"` routes the MoE layer through the kernel, in interpret mode iff
    `moe_kernel_interpret`; the layer's output is the dense dispatch's."""
    config = tiny_qwen3_moe(moe_dispatch="gmm", moe_kernel_interpret=True)
    layer = MoE(config, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 9, config.hidden_size))
    mask = jnp.ones((2, 9))
    out, aux = layer(x, mask)
    layer.config = config.replace(moe_dispatch="dense")
    want, want_aux = layer(x, mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=TOLERANCE, atol=TOLERANCE)
    assert float(aux) == float(want_aux)
    for interpret in (True, False):  # traced only: the non-interpreted kernel lowers on TPU alone
        layer.config = config.replace(moe_kernel_interpret=interpret)
        jaxpr = str(jax.make_jaxpr(lambda x: layer(x, mask))(x))
        assert "pallas_call" in jaxpr
        assert ("interpret=False" in jaxpr) != interpret


# ------------------------------------------------------------------------------ expert parallelism


def test_expert_parallel_gmm_equals_one_device_and_dense_on_eight_devices():
    """8 experts over a (data 2, expert 4) mesh of the 8 fake CPU devices (tests/conftest.py): each
    device runs its 2 experts on its half of the tokens; outputs and gradients equal the 1-device
    gmm dispatch and the dense reference."""
    assert len(jax.devices()) == 8
    mesh = sharding.make_mesh({"data": 2, "expert": 4})
    x, expert_ids, weights, params = _problem(3, "skewed", 24, num_experts=8, k=2)
    parallel = functools.partial(expert_parallel_gmm_dispatch, mesh=mesh, interpret=True)
    got = _value_and_grads(parallel, x, expert_ids, weights, params)
    one_device = _value_and_grads(gmm_interpreted, x, expert_ids, weights, params)
    dense = _value_and_grads(dense_dispatch, x, expert_ids, weights, params)
    print(f"EP vs 1-device gmm: max |error| = {_max_errors(got, one_device)}; vs dense: {_max_errors(got, dense)}")
    for reference in (one_device, dense):
        for g, w in zip([got[0], *got[1]], [reference[0], *reference[1]]):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=TOLERANCE, atol=TOLERANCE)
    # the experts' gradients stay sharded over the expert axis, the output's rows over data
    assert got[1][2].sharding.spec[0] == "expert"


@pytest.mark.parametrize("shape", [{"data": 2, "expert": 4}, {"fsdp": 8}], ids=["expert_parallel", "fsdp_only"])
def test_moe_layer_under_a_mesh_runs_the_kernel_in_shard_map(shape):
    """Under `use_mesh` the gmm layer is a shard_map (XLA cannot partition a Pallas call): experts over
    `expert` when it is > 1, else every device runs all experts on its own token shard (the pods' FSDP)."""
    config = tiny_qwen3_moe(num_experts=8, moe_dispatch="gmm", moe_kernel_interpret=True)
    layer = MoE(config, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (8, 3, config.hidden_size))
    mask = jnp.ones((8, 3))
    mesh = sharding.make_mesh(shape)
    with sharding.use_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(lambda x: layer(x, mask))(x))
        out, _ = jax.jit(lambda x: layer(x, mask))(x)
    assert "shard_map" in jaxpr and "psum" in jaxpr
    layer.config = config.replace(moe_dispatch="dense")
    want, _ = layer(x, mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=TOLERANCE, atol=TOLERANCE)


# ------------------------------------------------------------------------------------ tiling work


def test_padded_rows_by_hand():
    """Groups [5, 0, 20, 7] at tm 8 (32 rows, no padding): group 0 rows 0-4 take tile 0; group 2 rows
    5-24 take tiles 0-3 (tile 0 again); group 3 rows 25-31 take tile 3 again: 6 tiles, 48 rows.
    Groups [3, 3, 3] at tm 8: 9 rows padded to 16 (the 7 padding rows join group 2, rows 6-15): tiles
    0, 0, 0-1: 4 tiles, 32 rows."""
    assert gmm_padded_rows([5, 0, 20, 7], 8) == 48
    assert gmm_padded_rows([3, 3, 3], 8) == 32
    assert gmm_padded_rows([16, 0, 0, 16], 8) == 32  # tile-aligned groups: no extra tile
    assert gmm_padded_rows([0, 0, 1], 16) == 16


@pytest.mark.parametrize("seed", range(4))
def test_padded_rows_are_the_tiles_megablox_schedules(seed):
    """`gmm_padded_rows` = tm × the m-tiles in megablox's own metadata (`make_group_metadata`, the
    forward's: empty groups visited by no tile), for the padded sizes `gmm_swiglu` passes."""
    from jax.experimental.pallas.ops.tpu.megablox.gmm import make_group_metadata

    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 40, 9) * (rng.uniform(size=9) < 0.7)
    tm = int(rng.choice([8, 16, 32]))
    rows = int(sizes.sum())
    padded_sizes = sizes.copy()
    padded_sizes[-1] += -rows % tm
    _, tiles = make_group_metadata(group_sizes=jnp.asarray(padded_sizes, jnp.int32), m=rows + (-rows % tm), tm=tm,
                                   start_group=jnp.int32(0), num_nonzero_groups=9, visit_empty_groups=False)  # fmt: skip
    assert gmm_padded_rows(sizes, tm) == int(tiles) * tm


@pytest.mark.parametrize("rows,groups,itemsize", [(4096 * 8, 128, 2), (16 * 1024 * 2, 8, 2), (2048, 16, 4),
                                                  (300, 4, 4)])  # fmt: skip
def test_tiling_keeps_padded_rows_within_a_quarter(rows, groups, itemsize):
    """With rows >= 4 · min_tm · groups, padded / real rows <= 1 + tm · groups / rows <= 1.25 for any
    routing: the worst case (one row, then groups of tm rows each starting one row into a tile: every
    group but the first takes one tile more than its rows need, rows padded up to tiles + (groups − 1)
    tiles exactly) is checked along with random sizes. The k and n tiles divide the widths."""
    tm, tk, tn = gmm_tiling(rows, 2048, 768, groups, itemsize)
    assert tm * groups * 4 <= rows and (tk, tn) == (512, 384)
    worst = [1] + [tm] * (groups - 2)
    worst.append(rows - sum(worst))
    rng = np.random.default_rng(rows)
    random_sizes = rng.multinomial(rows, rng.dirichlet(np.ones(groups) * 0.3))
    for sizes in (worst, random_sizes):
        assert sum(sizes) == rows
        ratio = gmm_padded_rows(sizes, tm) / rows
        assert ratio <= 1 + tm * groups / rows <= 1.25, (sizes, tm, ratio)
    assert gmm_padded_rows(worst, tm) == -(-rows // tm) * tm + (groups - 1) * tm  # the bound is reached
