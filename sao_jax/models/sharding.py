"""Logical axis names mapped to mesh axes by rules (MaxText style).

Model code names the dimensions of parameters and activations with *logical* axes ("embed", "mlp",
"expert", ...). A rule table maps each logical axis to zero or more *mesh* axes ("data", "fsdp",
"expert", "tensor"), so the same model shards differently on a laptop, an 8-device test mesh or a
TPU pod by changing the rules, never the model.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

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


def with_logical_constraint(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical axes; the identity outside `use_mesh`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(logical_axes, rules)))
