"""Training as several processes (multi-controller JAX: one process per host, all running `sao-train`).

Every process runs the same program on the same config; what differs is which devices it drives.

    train state   on the global mesh of `config.mesh`: each model parameter (and its AdamW moments)
                  sharded by its logical axes (`sharding.DEFAULT_RULES`), everything else replicated;
                  the jitted steps run SPMD over it (`Cluster.step`)
    batches       the whole collated batch on every process; its rows split over (data, fsdp)
    rollouts      a list of n prompts is cut into contiguous blocks, one per process:
                  process p rolls out prompts [⌊p·n/P⌋, ⌊(p+1)·n/P⌋) on its own devices (those it keeps
                  for rollouts, `mesh.rollout_devices`, else its train devices), with a local replica
                  of the policy weights spread over them (`Cluster.local_replica`; those
                  the forward computes in bfloat16 stored so: `compute_dtype_weights`), prompt i
                  with key fold_in(key, i) (i global);
                  the trajectories are then exchanged, so every process holds all n, in prompt order,
                  and computes the same host-side metrics as one process rolling out all n
    side effects  process 0 writes metrics.jsonl, TensorBoard, plots, config.yaml, summary.json;
                  process p > 0 writes its own metric lines to OUTDIR/process_<p>/metrics.jsonl (to
                  check the hosts agree); Orbax checkpoints are written by all processes together

One process with several accelerator chips (a single TPU VM or GPU host) takes the same path with
P = 1 (the state on the mesh, rollouts on its chips). Several CPU devices do so only when
`config.mesh` gives every axis size explicitly (no -1: e.g. `mesh.fsdp=8`) or keeps devices for
rollouts (`mesh.rollout_devices`); otherwise one process trains on its first device and every
placement is the identity.

`train.mode: async` with P processes (`loop.StreamingBatches`): each process streams its own
rollouts on its own devices, and the trainer thread, which alone issues computations over the mesh,
exchanges one block of trajectories per process each step; so every process issues the same global
computations in the same order, as multi-controller JAX requires.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sao_jax.config import Config, ConfigError
from sao_jax.models import compute_dtype_weights, sharding
from sao_jax.rollout import agent_loop as agent_loop_lib
from sao_jax.rollout.trajectory import Trajectory, TrajectoryBatch

log = logging.getLogger(__name__)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """Join a multi-process run (`sharding.initialize_distributed`); before any other JAX call.

    With no arguments the coordinator, process count and id are detected (TPU pods, SLURM, ...); on
    other machines pass all three. CPU processes exchange data over gloo (TCP), built into jaxlib.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    sharding.initialize_distributed(coordinator_address, num_processes, process_id)


# Whole weights gathered per step of the copy to split-off rollout devices (`Cluster.local_replica`).
TRANSFER_GROUP_BYTES = 1 << 30


def _identity(tree: Any) -> Any:  # one function object, so its jitted copies share one compiled program
    return tree


def process_block(n: int, process: int, num_processes: int) -> range:
    """Indices of the contiguous block of n items that `process` handles: [⌊p·n/P⌋, ⌊(p+1)·n/P⌋)."""
    return range(process * n // num_processes, (process + 1) * n // num_processes)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """How this process takes part in the run; `mesh` is None for a single process (all identities).

    `rollout_devices`: this process's devices kept for sampling (`mesh.rollout_devices` > 0), which the
    train mesh leaves out; empty when the sampler shares this process's train devices.
    """

    mesh: Mesh | None = None
    rollout_devices: tuple = ()

    @classmethod
    def for_config(cls, config: Config) -> Cluster:
        """The global mesh of `config.mesh` when there are several processes, one process drives
        several accelerator chips (a single TPU VM or GPU host), one process's mesh sizes are all
        explicit and span several devices, or devices are split off for rollouts; else no mesh.
        Several CPU devices (the fake devices of tests: one CPU device already uses every core) need
        the explicit sizes.

        With `mesh.rollout_devices` = r > 0 every process keeps its first r devices for its sampler
        and the train mesh is built from the others of every process (the per-host split of
        docs/scaling.md, "Rollout and train meshes")."""
        sizes = config.mesh.shape().values()
        explicit = -1 not in sizes and np.prod(list(sizes)) > 1
        several_chips = jax.device_count() > 1 and jax.default_backend() != "cpu"
        split = config.mesh.rollout_devices
        if jax.process_count() == 1 and not explicit and not several_chips and not split:
            if jax.device_count() > 1:
                log.info("one process, %d CPU devices: training on the first (a run uses them all when the "
                         "mesh sizes are given, e.g. mesh.fsdp=%d)", jax.device_count(), jax.device_count())
            return cls()
        by_process = _devices_by_process(jax.devices())
        local = by_process[jax.process_index()]
        if split >= len(local):
            raise ConfigError(f"mesh.rollout_devices={split} must be less than the {len(local)} devices of each "
                             "process: the others train")  # fmt: skip
        mesh = sharding.make_mesh(config.mesh.shape(), devices=[d for row in by_process for d in row[split:]])
        rows = mesh.shape["data"] * mesh.shape["fsdp"]
        batches = [("train.batch_size", config.train.batch_size)]
        batches += [("sft.batch_size", config.sft.batch_size)] if config.sft.steps else []
        for key, size in batches:
            if size % rows:
                raise ConfigError(f"{key}={size} must be a multiple of mesh data x fsdp = {rows}: "
                                 "the batch's rows are split over them")
        log.info("process %d of %d: train state on the mesh %s%s", jax.process_index(), jax.process_count(),
                 " ".join(f"{axis}={size}" for axis, size in mesh.shape.items()),
                 f"; rollouts on {split} other device(s) of each process" if split else "")  # fmt: skip
        return cls(mesh, tuple(local[:split]))

    @property
    def is_primary(self) -> bool:
        """Whether this process writes the run's files (process 0)."""
        return jax.process_index() == 0

    def place(self, tree: Any) -> Any:
        """`tree` (a train state, optimizer state, params, a key) on the mesh: an NNX Variable by its
        `out_sharding` logical axes, any other array replicated. Arrays already placed so are kept;
        host or process-local values must be equal on every process."""
        if self.mesh is None:
            return tree

        def place_variable(variable: nnx.Variable) -> nnx.Variable:
            logical_axes = variable.get_metadata().get("out_sharding") or ()
            target = sharding.logical_sharding(self.mesh, logical_axes)
            return variable.replace(self._put(variable.get_value(), target))

        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree.map(lambda x: place_variable(x) if isinstance(x, nnx.Variable) else self._put(x, replicated),
                            tree, is_leaf=lambda x: isinstance(x, nnx.Variable))  # fmt: skip

    def place_batch(self, batch: TrajectoryBatch) -> TrajectoryBatch:
        """A collated batch (the same host arrays on every process) with its rows split over (data, fsdp)."""
        if self.mesh is None:
            return batch
        return jax.tree.map(lambda x: self._put(x, sharding.logical_sharding(self.mesh, ("batch",))), batch)

    def _put(self, x: Any, target: NamedSharding) -> jax.Array:
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(self._put(jax.random.key_data(x), target), impl=jax.random.key_impl(x))
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x if x.sharding == target else jax.device_put(x, target)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, target, lambda index: host[index])

    def step(self, update: Callable) -> Callable:
        """`update(*args)` (a jitted step) with each argument placed first: a `TrajectoryBatch` by
        rows, anything else by `place`; traced under `sharding.use_mesh`, so the models' activation
        constraints apply. Its outputs stay on the mesh (scalar metrics are replicated: readable)."""
        if self.mesh is None:
            return update

        def placed(*args):
            args = [self.place_batch(a) if isinstance(a, TrajectoryBatch) else self.place(a) for a in args]
            with sharding.use_mesh(self.mesh):
                return update(*args)

        return placed

    def local_replica(self, tree: Any) -> Any:
        """A whole copy of `tree` (arrays on the mesh) for this process's sampler, spread over its
        rollout devices (its train devices when none are split off): each NNX Variable by its logical
        axes on a local mesh whose `tensor` axis is all of those devices (heads, kv heads, MLP and vocab
        dimensions split; a dimension that does not divide stays whole), anything else replicated.

        First a jitted reshard over the train devices, arranged [process, local train device], to
        those shardings replicated across processes: an all-gather after which every process holds a
        whole copy, 1/L of it on each of its L train chips (no chip ever holds a whole replica). Then
        each process assembles its own shards into arrays on a local mesh, where its sampler runs
        computations no other process takes part in; with rollout devices split off, those arrays are
        copied onto them (a copy within the process: multi-controller JAX has no `device_put` between
        the disjoint device sets of different processes). That copy goes in groups of at most
        `TRANSFER_GROUP_BYTES` of whole weights, the extra memory on the train chips while it lasts.
        """
        if self.mesh is None:
            return tree
        train_mesh, transfer_mesh, rollout_mesh = self._rollout_meshes
        leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
        values = [leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf for leaf in leaves]
        key_impls = [jax.random.key_impl(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else None
                     for v in values]  # fmt: skip
        values = [v if impl is None else jax.random.key_data(v) for v, impl in zip(values, key_impls)]

        def spec(leaf, shape, mesh):
            if not isinstance(leaf, nnx.Variable):
                return PartitionSpec()
            axes = leaf.get_metadata().get("out_sharding") or ()
            return _divisible_spec(shape, sharding.logical_to_spec(axes, sharding.DEFAULT_RULES), mesh)

        specs = [spec(leaf, v.shape, train_mesh) for leaf, v in zip(leaves, values)]
        train_devices = list(train_mesh.devices.flat)
        replica = []
        for group in _byte_groups(values, TRANSFER_GROUP_BYTES if self.rollout_devices else None):
            gathered = jax.jit(_identity, out_shardings=[NamedSharding(transfer_mesh, specs[i]) for i in group])(
                [values[i] for i in group])  # fmt: skip
            for i, x in zip(group, gathered):
                shards = {shard.device: shard.data for shard in x.addressable_shards}
                x = jax.make_array_from_single_device_arrays(x.shape, NamedSharding(train_mesh, specs[i]),
                                                             [shards[d] for d in train_devices])  # fmt: skip
                if self.rollout_devices:
                    x = jax.device_put(x, NamedSharding(rollout_mesh, spec(leaves[i], x.shape, rollout_mesh)))
                replica.append(x)
        out = []
        for leaf, x, impl in zip(leaves, replica, key_impls):
            x = x if impl is None else jax.random.wrap_key_data(x, impl=impl)
            out.append(leaf.replace(x) if isinstance(leaf, nnx.Variable) else x)
        return jax.tree.unflatten(treedef, out)

    @functools.cached_property
    def _rollout_meshes(self) -> tuple[Mesh, Mesh, Mesh]:
        """(this process's train devices as a mesh with `tensor` = all of them; every train device as a
        mesh [process, data, fsdp, expert, tensor] whose row p holds process p's in that order; the
        sampler's mesh: the rollout devices, or the first mesh when none are split off)."""
        rows = _devices_by_process(self.mesh.devices.flat)
        if len({len(row) for row in rows}) != 1:
            raise ValueError(f"processes drive different numbers of devices: {[len(row) for row in rows]}")
        local = next(row for row in rows if row[0].process_index == jax.process_index())
        train_mesh = _tensor_mesh(local)
        transfer_mesh = Mesh(np.array(rows).reshape(len(rows), 1, 1, 1, -1), ("process", *sharding.MESH_AXES))
        return train_mesh, transfer_mesh, _tensor_mesh(self.rollout_devices) if self.rollout_devices else train_mesh

    def all_gather(self, items: Sequence[Any]) -> list[Any]:
        """Every process's `items` (picklable), concatenated in process order, on every process."""
        if self.mesh is None or jax.process_count() == 1:
            return list(items)
        data = np.frombuffer(pickle.dumps(list(items)), np.uint8)
        lengths = multihost_utils.process_allgather(np.array(len(data), np.int64))
        padded = np.zeros(int(lengths.max()), np.uint8)
        padded[: len(data)] = data
        gathered = multihost_utils.process_allgather(padded)
        return [item for row, length in zip(gathered, lengths) for item in pickle.loads(row[:length].tobytes())]

    def rollouts(self, loop: agent_loop_lib.AgentLoop) -> agent_loop_lib.AgentLoop | ProcessRollouts:
        """`loop` itself for one process, else the `ProcessRollouts` that shares its prompts out."""
        return loop if self.mesh is None else ProcessRollouts(loop, self)


def _divisible_spec(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> PartitionSpec:
    """`spec` with the mesh axes dropped from each dimension they do not divide evenly."""
    out = []
    for size, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        split = int(np.prod([mesh.shape[name] for name in names]))
        out.append(axes if size % split == 0 else None)
    return PartitionSpec(*out)


def _devices_by_process(devices) -> list[list[jax.Device]]:
    """`devices` grouped by process, in process order, each group in device id order."""
    rows: dict[int, list] = {}
    for device in sorted(devices, key=lambda d: (d.process_index, d.id)):
        rows.setdefault(device.process_index, []).append(device)
    return [rows[p] for p in sorted(rows)]


def _tensor_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A mesh of the model axes whose `tensor` axis is all of `devices`."""
    return Mesh(np.array(devices).reshape(1, 1, 1, -1), sharding.MESH_AXES)


def _byte_groups(values: Sequence[Any], limit: int | None) -> list[list[int]]:
    """Indices of `values` in order, cut into runs of at most `limit` bytes (one run when None; a
    larger value alone)."""
    groups, size = [[]], 0
    for i, value in enumerate(values):
        nbytes = getattr(value, "nbytes", 0)
        if limit is not None and groups[-1] and size + nbytes > limit:
            groups, size = [*groups, []], 0
        groups[-1].append(i)
        size += nbytes
    return groups


class ProcessRollouts:
    """`AgentLoop.rollout` shared out over the processes (module docstring): each rolls out its block
    of the prompts with a local replica of the weights and the prompts' global keys, and every process
    returns all trajectories in prompt order — the same list one process would roll out alone."""

    def __init__(self, loop: agent_loop_lib.AgentLoop, cluster: Cluster):
        self.loop, self.cluster = loop, cluster

    def rollout(self, weights: tuple[Any, int], prompts: Sequence[Any], key: jax.Array, *,
                indices: Sequence[int] | None = None,
                on_trajectory: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:  # fmt: skip
        """weights: `(params on the mesh, version)`; prompts, key and indices: as `AgentLoop.rollout`;
        `on_trajectory` gets each of this process's trajectories (its `process_block`) as it ends."""
        params, version = weights
        prompts = list(prompts)
        mine = process_block(len(prompts), jax.process_index(), jax.process_count())
        # Stored in the compute dtype before the gather: the same rollouts from half the bytes in bf16.
        local = (self.cluster.local_replica(compute_dtype_weights(params, self.loop.sampler.config)), version)
        trajectories = self.loop.rollout(local, [prompts[i] for i in mine], key, first_index=mine.start,
                                         indices=None if indices is None else [indices[i] for i in mine],
                                         on_trajectory=on_trajectory)  # fmt: skip
        return self.cluster.all_gather(trajectories)
