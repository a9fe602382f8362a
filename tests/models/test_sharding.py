"""Meshes, logical-axis shardings, sharded init, and a sharded forward+backward on 8 fake CPU devices
checked against the same computation on one device."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from sao_jax.models import Policy, tiny_glm4_moe, tiny_qwen3_moe
from sao_jax.models import sharding
from tests.models._distributed_worker import next_token_loss

MESH_SHAPE = {"data": 2, "fsdp": 2, "expert": 2}


def test_make_mesh_fills_the_rest_axis_and_defaults_to_one():
    mesh = sharding.make_mesh({"data": 2, "fsdp": -1})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "expert": 1, "tensor": 1}
    assert mesh.size == len(jax.devices()) == 8
    assert dict(sharding.make_mesh(MESH_SHAPE).shape) == {"data": 2, "fsdp": 2, "expert": 2, "tensor": 1}


@pytest.mark.parametrize(
    "shape, message",
    [
        ({"data": 3}, "3 positions but there are 8 devices"),
        ({"data": 3, "fsdp": -1}, "not divisible"),
        ({"data": -1, "fsdp": -1}, "at most one -1"),
        ({"data": 0, "fsdp": -1}, ">= 1"),
        ({"model": 8}, "unknown mesh axis \\['model'\\]"),
    ],
)
def test_make_mesh_rejects_shapes_that_do_not_fit(shape, message):
    with pytest.raises(ValueError, match=message):
        sharding.make_mesh(shape)


def test_logical_to_spec_uses_each_mesh_axis_once_and_replicates_unknown_axes():
    rules = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("expert", "expert"))
    assert sharding.logical_to_spec(("batch", "length"), rules) == P(("data", "fsdp"), None)
    assert sharding.logical_to_spec(("expert", "embed", "mlp"), rules) == P("expert", "fsdp", None)
    assert sharding.logical_to_spec(("batch", "embed"), rules) == P(("data", "fsdp"), None)  # fsdp taken
    assert sharding.logical_to_spec((None, "embed"), rules) == P(None, "fsdp")


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh(MESH_SHAPE)


def test_state_shardings_follow_each_variables_logical_axes(mesh):
    abstract = nnx.eval_shape(lambda: Policy(tiny_glm4_moe(), rngs=nnx.Rngs(0)))
    specs = {
        path: variable.get_value().spec
        for path, variable in nnx.to_flat_state(sharding.state_shardings(nnx.state(abstract), mesh))
    }
    assert specs[("embed", "embedding")] == P("tensor", "fsdp")  # ("vocab", "embed")
    assert specs[("layers", 1, "mlp", "experts", "gate_proj")] == P("expert", "fsdp", "tensor")
    assert specs[("layers", 1, "mlp", "router", "kernel")] == P("fsdp", "expert")  # ("embed", "expert")
    assert specs[("layers", 1, "attn", "q_proj", "kernel")] == P("fsdp", "tensor", None)
    assert specs[("layers", 1, "mlp", "router", "e_score_correction_bias")] == P(None)  # buffer: replicated
    assert specs[("final_norm", "scale")] == P(None)


@pytest.fixture(scope="module")
def config():
    return tiny_qwen3_moe()


@pytest.fixture(scope="module")
def reference_model(config):
    return Policy(config, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def sharded_model(config, mesh):
    return sharding.sharded_init(lambda: Policy(config, rngs=nnx.Rngs(0)), mesh)


@pytest.mark.slow
def test_sharded_init_places_shards_and_matches_unsharded_init(reference_model, sharded_model, mesh):
    reference = dict(nnx.to_flat_state(nnx.state(reference_model)))
    sharded = dict(nnx.to_flat_state(nnx.state(sharded_model)))
    assert reference.keys() == sharded.keys()
    for path, variable in sharded.items():
        array = variable.get_value()
        assert array.sharding.mesh == mesh, path
        # jit vs eager init may round the scaled normal sample differently in the last bit
        np.testing.assert_allclose(np.asarray(array), np.asarray(reference[path].get_value()), rtol=1e-6, atol=1e-9)
    experts = sharded[("layers", 1, "mlp", "experts", "gate_proj")].get_value()  # [4, 32, 16] on expert, fsdp
    assert experts.sharding.spec == P("expert", "fsdp", "tensor")
    assert {shard.data.shape for shard in experts.addressable_shards} == {(2, 16, 16)}


@pytest.mark.slow
def test_sharded_forward_backward_matches_single_device(config, reference_model, sharded_model, mesh):
    input_ids = jax.random.randint(jax.random.key(3), (8, 16), 0, config.vocab_size)

    def loss_and_grads(graphdef, state, input_ids):
        return jax.value_and_grad(lambda s: next_token_loss(nnx.merge(graphdef, s), input_ids))(state)

    graphdef, state = nnx.split(reference_model)
    single_loss, single_grads = jax.jit(loss_and_grads, static_argnums=0)(graphdef, state, input_ids)

    graphdef, state = nnx.split(sharded_model)
    state_sharding = sharding.state_shardings(state, mesh)
    batch_sharding = sharding.logical_sharding(mesh, ("batch", "length"))
    sharded_ids = jax.device_put(input_ids, batch_sharding)
    assert sharded_ids.sharding.spec == P(("data", "fsdp"), None)
    step = jax.jit(
        loss_and_grads,
        static_argnums=0,
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(sharding.logical_sharding(mesh, ()), state_sharding),
    )
    with sharding.use_mesh(mesh):
        loss, grads = step(graphdef, state, sharded_ids)

    np.testing.assert_allclose(loss, single_loss, rtol=1e-5)
    flat_single = dict(nnx.to_flat_state(single_grads))
    for path, grad in nnx.to_flat_state(grads):
        np.testing.assert_allclose(grad.get_value(), flat_single[path].get_value(), rtol=1e-4, atol=1e-6, err_msg=str(path))
    expert_grad = grads["layers"][1]["mlp"]["experts"]["down_proj"].get_value()
    assert not expert_grad.sharding.is_fully_replicated
    assert expert_grad.addressable_shards[0].data.shape == (2, 16, 16)  # [4, 16, 32] over expert, fsdp
