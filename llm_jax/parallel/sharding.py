"""Device mesh and the one table that maps logical axis names onto mesh axes.

Every parameter carries logical names (`embed`, `heads`, `experts`, ...) in its `out_sharding`
metadata, and the model marks its key activations with `constrain(x, names)`; `RULES` says which
mesh axes each name is split over. Mesh axes: `data` (batch), `fsdp` (batch and weights),
`tensor` (heads, mlp, vocab), `expert` (experts, the batch, and with `fsdp` the `embed` of the
weights that are not experts). With one device every axis has size 1
and everything is replicated, so the same code runs on a laptop and a pod.

Axis types are Auto: XLA propagates shardings from the annotated params, batch and activation
constraints, which is what a pure train step wants. Explicit mode would make every einsum whose
contracting dimension is sharded state its output sharding (`out_sharding=`), spreading mesh
knowledge through every layer. Where communication must be exact or a kernel is opaque to
XLA's partitioner, the layer runs in `jax.shard_map` instead: the expert-parallel exchange and
the grouped-matmul MoE (model/moe_parallel.py), and splash attention
(kernels/splash_attention.py); the opt-in GPU flash kernel (kernels/flash_attention_gpu.py) has
no shard_map of its own.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# logical name -> mesh axes it is split over (None = replicated). The whole layout on one screen.
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp", "expert")),  # tokens: every axis that does not split heads / mlp
    ("length", None),
    ("layers", None),
    ("vocab", "tensor"),
    # weights: ZeRO-3 over fsdp, and over expert for the weights that `experts` does not split
    # (embeddings, attention, norms: as MaxText's fsdp-on-expert layout); activations: taken by
    # batch first
    ("embed", ("fsdp", "expert")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("experts", "expert"),
)

AxisSizes = Mapping[str, int]


def _resolve_sizes(axis_sizes: AxisSizes | None, num_devices: int, what: str) -> dict[str, int]:
    """Axis sizes with the one -1 filled so that their product is `num_devices`."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    sizes.update(axis_sizes if axis_sizes is not None else {"data": -1})
    unknown = sorted(set(sizes) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"{what}: unknown axis {unknown}; axes are {MESH_AXES}")
    for a, s in sizes.items():
        if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or (s < 1 and s != -1):
            raise ValueError(f"{what}: {a}={s!r} is invalid: expected a positive integer or -1")
    fill = [a for a, s in sizes.items() if s == -1]
    if len(fill) > 1:
        raise ValueError(f"{what}: at most one axis may be -1, got {fill}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if fill:
        if num_devices % known:
            raise ValueError(
                f"{what}: {fill[0]}=-1 cannot fill {num_devices} devices: the other axes "
                f"({_fmt(sizes)}) multiply to {known}, which does not divide {num_devices}")
        sizes[fill[0]] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(f"{what}: axis sizes {_fmt(sizes)} multiply to "
                         f"{math.prod(sizes.values())}, but there are {num_devices} devices")
    return sizes


def _fmt(sizes: AxisSizes) -> str:
    return ",".join(f"{a}={s}" for a, s in sizes.items())


def make_mesh(
    axis_sizes: AxisSizes | None = None,
    devices: Sequence[Any] | None = None,
    *,
    dcn_sizes: AxisSizes | None = None,
) -> Mesh:
    """A mesh with the four axes over `devices` (default: all, of every process).

    `axis_sizes` are the sizes within one slice (TPU) or one process/node (GPU): the fast
    interconnect. One of them may be -1 (fills the rest). `dcn_sizes` multiply them across
    slices / nodes (data-center network); with any > 1 the mesh comes from
    `mesh_utils.create_hybrid_device_mesh`, so e.g. `data` is split first across slices and only
    then within them. Mesh axis `a` has size `axis_sizes[a] * dcn_sizes[a]`.
    """
    devices = list(devices if devices is not None else jax.devices())
    dcn = dict.fromkeys(MESH_AXES, 1)
    dcn.update(dcn_sizes or {})
    if set(dcn) - set(MESH_AXES) or any(not isinstance(s, (int, np.integer)) or s < 1
                                        for s in dcn.values()):
        raise ValueError(f"mesh: dcn sizes {_fmt(dcn)} are invalid: expected positive integers "
                         f"for the axes {MESH_AXES}")
    granules = math.prod(dcn.values())
    if len(devices) % granules:
        raise ValueError(f"mesh: dcn sizes {_fmt(dcn)} multiply to {granules} slices/nodes, "
                         f"which does not divide the {len(devices)} devices")
    ici = _resolve_sizes(axis_sizes, len(devices) // granules, "mesh")
    ici_shape = tuple(ici[a] for a in MESH_AXES)
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if granules == 1:
        return jax.make_mesh(ici_shape, MESH_AXES, axis_types=auto, devices=devices)
    from jax.experimental import mesh_utils

    # TPU slices are granules by slice_index; GPU nodes (and CPU processes) by process.
    by_process = getattr(devices[0], "platform", "") != "tpu"
    grid = mesh_utils.create_hybrid_device_mesh(
        ici_shape, tuple(dcn[a] for a in MESH_AXES), devices, process_is_granule=by_process,
        allow_split_physical_axes=True)
    return Mesh(grid, MESH_AXES, axis_types=auto)


def parse_mesh(spec: str, *, allow_fill: bool = False) -> dict[str, int]:
    """'data=2,fsdp=4' -> {'data': 2, 'fsdp': 4, 'tensor': 1, 'expert': 1}; '' = one device.

    allow_fill: one size may be -1 (the rest of the devices; llm_jax.parallel.sharding.make_mesh)."""
    mesh = dict.fromkeys(MESH_AXES, 1)
    seen = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq:
            raise ValueError(f"--mesh item {item!r} is invalid: expected AXIS=SIZE, e.g. fsdp=4")
        if name not in MESH_AXES:
            raise ValueError(f"--mesh axis {name!r} is unknown: expected one of {MESH_AXES}")
        if name in seen:
            raise ValueError(f"--mesh axis {name!r} is given twice")
        try:
            size = int(value.strip())
        except ValueError:
            raise ValueError(
                f"--mesh {name}={value.strip()!r} is invalid: expected a positive integer") from None
        if size < 1 and not (allow_fill and size == -1):
            raise ValueError(f"--mesh {name}={size} is invalid: expected a positive integer"
                             + (" or -1" if allow_fill else ""))
        mesh[name] = size
        seen.add(name)
    return mesh


def mesh_from_config(mesh_cfg: Any, devices: Sequence[Any] | None = None) -> Mesh:
    """The mesh of a run config's `mesh` section (data, fsdp, tensor, expert, dcn_*)."""
    d = dict(mesh_cfg.items()) if hasattr(mesh_cfg, "items") else dict(mesh_cfg)
    unknown = sorted(set(d) - set(MESH_AXES) - {f"dcn_{a}" for a in MESH_AXES})
    if unknown:
        raise ValueError(f"config.mesh: unknown field(s) {unknown}; fields are {MESH_AXES} "
                         f"and dcn_<axis>")
    ici = {a: d.get(a, 1) for a in MESH_AXES}
    dcn = {a: d.get(f"dcn_{a}", 1) for a in MESH_AXES}
    return make_mesh(ici, devices, dcn_sizes=dcn if any(v != 1 for v in dcn.values()) else None)


# ------------------------------------------------------------------------ logical -> mesh


def logical_to_spec(names: Sequence[str | None] | None, rules=RULES,
                    mesh_axes: Sequence[str] | None = None) -> P:
    """PartitionSpec for a tuple of logical names; a mesh axis is used at most once (the first
    name that claims it wins), and axes not in `mesh_axes` (when given) are left out."""
    if not names:
        return P()
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name in names:
        axes = table.get(name) if name is not None else None
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        axes = tuple(a for a in axes if a not in used and (mesh_axes is None or a in mesh_axes))
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*spec)


def spec_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, 'a' or ('a', 'b'))."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def mesh_axes(mesh: Mesh | jax.sharding.AbstractMesh, names: Sequence[str | None],
              rules=RULES) -> tuple[str, ...]:
    """The mesh axes that logical `names` split over in a `shard_map` on `mesh`: those of size > 1
    and not already manual (inside an enclosing shard_map)."""
    spec = logical_to_spec(names, rules, mesh_axes=mesh.axis_names)
    manual = set(getattr(mesh, "manual_axes", ()))
    return tuple(a for e in spec for a in spec_axes(e) if mesh.shape[a] > 1 and a not in manual)


def shard_count(size: int, name: str, rules=RULES) -> int:
    """How many ways the current (abstract) mesh splits a dimension of `size` with logical
    `name`, as `constrain` would: 1 without a mesh, or when its mesh axes do not divide `size`."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    n = math.prod(mesh.shape[a] for a in mesh_axes(mesh, (name,), rules))
    return n if size % n == 0 else 1


def logical_axes(names: Sequence[str | None], rules=RULES) -> tuple[str, ...]:
    """All mesh axes the logical `names` map onto, in order (e.g. batch -> data, fsdp, expert)."""
    return tuple(a for e in logical_to_spec(names, rules) for a in spec_axes(e))


def state_shardings(state: Any, mesh: Mesh, rules=RULES):
    """NamedShardings for every variable of `state`, from its logical `out_sharding` names.

    Works on any pytree holding nnx Variables: params, and the optimizer state built from them
    (optax's `tree_map`s over an nnx.State keep each Variable and its metadata, so Adam's m and
    v get exactly their param's sharding; tests/parallel/test_sharding.py checks it). Other leaves (step,
    Adam's count) are replicated.
    """

    def one(v):
        if not isinstance(v, nnx.Variable):
            return NamedSharding(mesh, P())
        return v.replace(NamedSharding(mesh, logical_to_spec(v.get_metadata().get("out_sharding"),
                                                             rules)))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def check_divisible(abstract: Any, shardings: Any, *, what: str = "") -> None:
    """Raises ValueError naming the array, dimension, its size and the mesh axes that do not
    divide it (e.g. num_experts=6 on expert=4), instead of XLA's opaque shape error."""

    def check(path, a, s):
        s = _unwrap(s)
        if not isinstance(s, NamedSharding):
            return
        sizes = dict(s.mesh.shape)
        for dim, (n, entry) in enumerate(zip(a.shape, s.spec)):
            axes = spec_axes(entry)
            k = math.prod(sizes[x] for x in axes)
            if n % k:
                names = a.get_metadata().get("out_sharding") if isinstance(a, nnx.Variable) else None
                logical = f" ({names[dim]})" if names else ""
                raise ValueError(
                    f"{what}{jax.tree_util.keystr(path)}: dimension {dim}{logical} has size {n}, "
                    f"not divisible by mesh axes {'x'.join(f'{x}={sizes[x]}' for x in axes)} "
                    f"= {k}")

    jax.tree_util.tree_map_with_path(check, abstract, shardings,
                                     is_leaf=lambda x: isinstance(x, nnx.Variable))


def _unwrap(x: Any) -> Any:
    return x.get_value() if isinstance(x, nnx.Variable) else x


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows split over the batch axes, every later dimension whole: one sharding for a batch's
    arrays of any rank (tokens [B, T], RL's advantages [B] and routing [B, T, L, k])."""
    return NamedSharding(mesh, logical_to_spec(("batch",)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# ------------------------------------------------------------------------ activations


def constrain(x: jax.Array, names: Sequence[str | None], rules=RULES) -> jax.Array:
    """`with_sharding_constraint(x, spec of names)` under a mesh context; a no-op without one.

    A hint to XLA's propagation, so it never changes values: a dimension its mesh axes do not
    divide (a batch of 1 in generation, say) is left unconstrained rather than refused.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = fitted_spec(x.shape, names, mesh, rules)
    if all(e is None for e in spec):
        return x
    return jax.lax.with_sharding_constraint(x, spec)


def fitted_spec(shape: Sequence[int], names: Sequence[str | None], mesh: Any,
                rules=RULES) -> P:
    """The spec of logical `names` for an array of `shape` on `mesh` (abstract or concrete):
    a dimension its mesh axes do not divide is left unsplit, and manual axes (inside a
    shard_map) are left out."""
    sizes = dict(mesh.shape)
    spec = logical_to_spec(names, rules, mesh_axes=mesh.axis_names)
    manual = set(getattr(mesh, "manual_axes", ()))
    entries = []
    for n, entry in zip(shape, spec):
        axes = tuple(a for a in spec_axes(entry) if a not in manual)
        ok = axes and n % math.prod(sizes[a] for a in axes) == 0
        entries.append((axes[0] if len(axes) == 1 else axes) if ok else None)
    return P(*entries)


def with_mesh(fn: Callable, mesh: Mesh | None) -> Callable:
    """`fn` traced under `mesh` (as an abstract mesh), so `constrain` and the expert-parallel
    MoE see it; usable inside `jax.jit` (where `jax.set_mesh` is refused)."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with traced_under(mesh):
            return fn(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def traced_under(mesh: Mesh | None) -> Iterator[None]:
    """`with_mesh`'s context: what is traced inside sees `mesh` as its abstract mesh (nothing
    changes without one)."""
    if mesh is None:
        yield
        return
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        yield

