"""Logical axis names mapped to mesh axes by rules (MaxText style).

Model code names the dimensions of parameters and activations with *logical* axes ("embed", "mlp",
"expert", ...). A rule table maps each logical axis to zero or more *mesh* axes ("data", "fsdp",
"expert", "tensor"), so the same model shards differently on a laptop, an 8-device test mesh or a
TPU pod by changing the rules, never the model.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

M = TypeVar("M", bound=nnx.Module)

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# logical axis -> mesh axis, tuple of mesh axes, or None (replicated)
LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: LogicalRules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),
)


def logical_to_spec(logical_axes: Sequence[str | None], rules: LogicalRules) -> PartitionSpec:
    """PartitionSpec for one array whose dimensions carry `logical_axes`.

    A mesh axis may shard at most one dimension of an array, so a mesh axis already used by an
    earlier dimension is dropped from later ones. Logical axes missing from `rules` are replicated.
    """
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name in logical_axes:
        target = table.get(name) if name is not None else None
        mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
        mesh_axes = tuple(a for a in mesh_axes if a not in used)
        used.update(mesh_axes)
        spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


_ACTIVE: contextvars.ContextVar[tuple[Mesh, LogicalRules] | None] = contextvars.ContextVar(
    "sao_jax_active_mesh", default=None
)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> Iterator[None]:
    """Within this context, `with_logical_constraint` shards activations on `mesh` by `rules`."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_mesh_and_rules() -> tuple[Mesh, LogicalRules] | None:
    """The (mesh, rules) of the enclosing `use_mesh`, or None outside one."""
    return _ACTIVE.get()


def with_logical_constraint(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical axes; the identity outside `use_mesh`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(logical_axes, rules)))


def mesh_sizes(shape: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Every mesh axis's size from `shape`, e.g. `{"data": 2, "fsdp": -1}`: axes not named get 1, one
    axis may be -1 (all remaining devices); the sizes must multiply to `num_devices`."""
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"unknown mesh axis {unknown} in {dict(shape)}; mesh axes are {MESH_AXES}")
    sizes = {axis: int(shape.get(axis, 1)) for axis in MESH_AXES}
    rest = [axis for axis, size in sizes.items() if size == -1]
    if len(rest) > 1 or any(size == 0 or size < -1 for size in sizes.values()):
        raise ValueError(f"mesh shape {dict(shape)}: sizes must be >= 1, with at most one -1")
    known = math.prod(size for size in sizes.values() if size != -1)
    if rest:
        if num_devices % known:
            raise ValueError(
                f"mesh shape {dict(shape)}: {num_devices} devices are not divisible by the fixed axes' product {known}"
            )
        sizes[rest[0]] = num_devices // known
    elif known != num_devices:
        raise ValueError(
            f"mesh shape {dict(shape)} has {known} positions but there are {num_devices} devices; "
            "make the sizes multiply to the device count or set one axis to -1"
        )
    return sizes


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over (data, fsdp, expert, tensor) with `mesh_sizes(shape, len(devices))` (devices default:
    all devices of all processes). Mesh axes are `Auto`, so sharding follows `with_logical_constraint`
    and the parameter shardings.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_sizes(shape, len(devices))
    return jax.make_mesh(
        tuple(sizes.values()), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def logical_sharding(mesh: Mesh, logical_axes: Sequence[str | None], rules: LogicalRules = DEFAULT_RULES) -> NamedSharding:
    """NamedSharding on `mesh` for an array whose dimensions carry `logical_axes`,
    e.g. `("batch", "length")` for a `[batch, time]` input."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, rules))


def state_shardings(state: Any, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> Any:
    """The NamedSharding of every variable of an NNX state, from its `out_sharding` logical axes.

    `state` is the state half of `nnx.split` (real or abstract, e.g. of `nnx.eval_shape`); the result
    has the same structure, each Variable holding its NamedSharding — usable as `in_shardings` /
    `out_shardings` of `jax.jit` or with `jax.device_put`. Variables without `out_sharding` metadata
    (e.g. RNG state) are replicated.
    """

    def sharding_of(key_path: Any, variable: nnx.Variable) -> nnx.Variable:
        logical_axes = variable.get_metadata().get("out_sharding") or ()
        shape = getattr(variable.get_value(), "shape", ())
        if logical_axes and len(logical_axes) != len(shape):
            raise ValueError(
                f"variable {jax.tree_util.keystr(key_path)} of shape {shape} has {len(logical_axes)} "
                f"logical axes {tuple(logical_axes)}"
            )
        return variable.replace(logical_sharding(mesh, logical_axes, rules))

    return jax.tree_util.tree_map_with_path(sharding_of, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def sharded_init(make_model: Callable[[], M], mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> M:
    """Build `make_model()` with every variable created directly in its shard on `mesh`.

    The constructor is traced abstractly (`nnx.eval_shape`) to read shapes and logical axes, then
    run under `jax.jit` with those shardings as `out_shardings`: nothing passes through the host,
    and each device computes only its own shard (random bits too, as JAX's threefry is partitionable).
    `make_model` must be deterministic (explicit `nnx.Rngs` seeds): every process runs it.
    """
    # Logical names ("embed", ...) are not mesh axes: stop flax from sharding a variable eagerly by
    # them if a model forgot `eager_sharding=False`.
    with nnx.use_eager_sharding(False):
        graphdef, abstract_state = nnx.split(nnx.eval_shape(make_model))
        shardings = state_shardings(abstract_state, mesh, rules)
        state = jax.jit(lambda: nnx.split(make_model())[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    initialization_timeout_s: int = 300,
) -> None:
    """Join this process to a multi-process JAX run (`jax.distributed.initialize`); no-op if joined.

    On TPU pods and SLURM/MPI clusters call it with no arguments: the coordinator, process count and
    id are read from the environment. Elsewhere (e.g. several local CPU processes in tests) pass
    `coordinator_address="host:port"`, `num_processes` and this process's `process_id`. Must run
    before any other JAX call that touches devices.
    """
    if jax.distributed.is_initialized():
        return
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout_s,
    )
