"""Device mesh and the one table that maps logical axis names onto mesh axes.

Every parameter carries logical names (`embed`, `heads`, `experts`, ...) in its `out_sharding`
metadata; `RULES` says which mesh axes each name is split over. Mesh axes: `data` (batch),
`fsdp` (batch and weights), `tensor` (heads, mlp), `expert` (experts). With one device every
axis has size 1 and everything is replicated, so the same code runs on a laptop and a pod.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# logical name -> mesh axes it is split over (None = replicated).
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("experts", "expert"),
)


def make_mesh(axis_sizes: Mapping[str, int] | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over `devices` with the four axes; one size may be -1 (fills the rest).

    Axis types are Auto: XLA propagates shardings from the annotated params and batch, which is
    what a pure train step wants; explicit-sharding mode would make every einsum state its output.
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = {a: 1 for a in MESH_AXES}
    sizes.update(axis_sizes or {"data": -1})
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh: unknown axis {sorted(unknown)}; axes are {MESH_AXES}")
    fill = [a for a, s in sizes.items() if s == -1]
    if len(fill) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {fill}")
    known = int(np.prod([s for s in sizes.values() if s != -1]))
    if fill:
        if len(devices) % known:
            raise ValueError(f"mesh: {len(devices)} devices do not divide by {known}")
        sizes[fill[0]] = len(devices) // known
    if int(np.prod(list(sizes.values()))) != len(devices):
        raise ValueError(f"mesh: axis sizes {sizes} need {np.prod(list(sizes.values()))} devices, "
                         f"have {len(devices)}")
    shape = tuple(sizes[a] for a in MESH_AXES)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES,
                axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(names: Sequence[str | None] | None, rules=RULES) -> P:
    """PartitionSpec for a tuple of logical names; a mesh axis is used at most once."""
    if not names:
        return P()
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name in names:
        axes = table.get(name) if name is not None else None
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*spec)


def state_shardings(state: nnx.State, mesh: Mesh, rules=RULES):
    """NamedShardings for every variable of `state`, from its logical `out_sharding` names."""

    def one(v):
        if not isinstance(v, nnx.Variable):
            return NamedSharding(mesh, P())
        return v.replace(NamedSharding(mesh, logical_to_spec(v.get_metadata().get("out_sharding"),
                                                             rules)))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(("batch", "length")))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
