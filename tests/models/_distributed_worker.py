"""One process of the two-process test in `test_distributed.py`.

Run as `python -m tests.models._distributed_worker --process-id I --num-processes N --port P --dir DIR`
with one CPU device per process. The processes form one global mesh with every device on `fsdp`, so
parameters are sharded across processes: each process uploads only its shards of the parameters in
DIR/params.npz and only its own rows of the global batch. Each writes the loss and the gradients
(replicated to every process) to DIR/process_I.npz.
"""

import argparse
import os

import numpy as np

BATCH_SHAPE = (4, 16)


def next_token_loss(model, input_ids):
    """Mean next-token cross-entropy of a Policy plus its router load-balancing loss."""
    import jax
    import jax.numpy as jnp

    logits, _, aux_loss = model.forward(input_ids)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, input_ids[:, 1:, None], axis=-1)[..., 0]
    return jnp.mean(nll) + model.config.router_aux_loss_coef * aux_loss


def global_batch(vocab_size: int) -> np.ndarray:
    """The whole batch, identical in every process; each process uploads only its rows."""
    return np.random.default_rng(0).integers(0, vocab_size, BATCH_SHAPE, dtype=np.int32)


def flat_arrays(state) -> dict[str, np.ndarray]:
    """{"/"-joined path: numpy array} of an NNX state."""
    from flax import nnx

    return {"/".join(map(str, path)): np.asarray(v.get_value()) for path, v in nnx.to_flat_state(state)}


def upload_shards(arrays: dict[str, np.ndarray], shardings):
    """The NNX state whose variable at each path is `arrays[path]`, placed by `shardings` (an NNX
    state of NamedShardings); this process uploads only the shards of its own devices."""
    import jax
    from flax import nnx

    def upload(key_path, variable):
        array = arrays["/".join(str(key.key) for key in key_path)]
        return variable.replace(jax.make_array_from_callback(array.shape, variable.get_value(), lambda i: array[i]))

    return jax.tree_util.tree_map_with_path(upload, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from flax import nnx

    from sao_jax.models import Policy, sharding, tiny_qwen3_moe

    sharding.initialize_distributed(
        f"127.0.0.1:{args.port}", args.num_processes, args.process_id, initialization_timeout_s=60
    )
    assert jax.process_count() == args.num_processes and jax.local_device_count() == 1
    mesh = sharding.make_mesh({"fsdp": -1})
    config = tiny_qwen3_moe()
    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: Policy(config, rngs=nnx.Rngs(0))))
    state_sharding = sharding.state_shardings(abstract_state, mesh)
    with np.load(os.path.join(args.dir, "params.npz")) as params:
        state = upload_shards(dict(params), state_sharding)
    assert not state["embed"]["embedding"].get_value().is_fully_addressable  # sharded across processes

    batch_sharding = sharding.logical_sharding(mesh, ("batch", "length"))
    batch = global_batch(config.vocab_size)
    [rows] = batch_sharding.addressable_devices_indices_map(batch.shape).values()
    input_ids = jax.make_array_from_process_local_data(batch_sharding, batch[rows], batch.shape)
    assert input_ids.addressable_shards[0].data.shape[0] == batch.shape[0] // args.num_processes

    replicated = sharding.logical_sharding(mesh, ())
    loss_and_grads = jax.jit(
        lambda state, ids: jax.value_and_grad(lambda s: next_token_loss(nnx.merge(graphdef, s), ids))(state),
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=replicated,  # every process gets the full loss and gradients to write
    )
    with sharding.use_mesh(mesh):
        loss, grads = loss_and_grads(state, input_ids)
    np.savez(os.path.join(args.dir, f"process_{args.process_id}.npz"), loss=np.asarray(loss), **flat_arrays(grads))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
