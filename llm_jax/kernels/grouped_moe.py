"""The dropless ragged MoE dispatch through a grouped-matmul kernel: megablox `gmm` on TPU, the
Pallas-Triton `gmm_gpu` on GPU.

Shapes: T tokens, D hidden, E experts, k experts per token, A = T k assignments, M = A rounded up
to the row tile, F2 = 2F gate-up width (local F2 under tensor sharding).

The same function as `moe_dispatch.moe_ragged`: assignments sorted by expert, a grouped matmul
for gate-up and one for down, each expert's rows a contiguous group. Both kernels carry a custom
VJP (d lhs by the kernel against the rhs transposed, d rhs by a transposed grouped matmul), so
training runs kernels both ways. `grouped_matmul` is the kernels behind `lax.ragged_dot`'s
signature, also used by the expert-parallel dispatch for its local experts. megablox rows fill
whole tiles: the sorted rows are followed by zero rows counted into the last expert's group,
whose outputs are dropped (zero rows, zero cotangents: no effect on values or gradients).

A Pallas call is opaque to XLA's sharding propagation, so under a mesh the layer runs in
`jax.shard_map`: tokens split over the batch axes, expert weights split over the `mlp` axes
(tensor, on F) and gathered over the others (as FSDP gathers `embed`), the down projection's
partial sums added by `psum` over `mlp`. So on a mesh with an `expert` axis every device
gathers every expert: there `expert_parallel_gmm` (tokens sent to the experts' devices, these
kernels on each device's own experts) is the kernel path.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import gmm

from llm_jax.kernels import gmm_gpu
from llm_jax.model.moe_dispatch import ExpertWeights, Routing, _combine, swiglu
from llm_jax.parallel.sharding import RULES, logical_to_spec, spec_axes

P = jax.sharding.PartitionSpec
ROW_TILE = 512
LANES = 128


def tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """(tm, tk, tn): 512 rows (m is padded to it, or to 128 when smaller), k and n tiles of up
    to 1024 lanes (a last partial tile is masked by the kernel)."""
    tm = ROW_TILE if m >= ROW_TILE else LANES
    lanes = lambda x: min(1024, -(-x // LANES) * LANES)  # noqa: E731
    return tm, lanes(k), lanes(n)


KERNELS = ("megablox", "triton")


def grouped_matmul(x_MK: jax.Array, w_EKN: jax.Array, sizes_E: jax.Array, *, kernel: str,
                   interpret: bool = False) -> jax.Array:
    """`lax.ragged_dot(x, w, sizes)` by a kernel (rows past sum(sizes) are zero).

    megablox wants whole row tiles whose rows all belong to groups: the rows are zero-padded to
    the tile and the padding counted into the last group, then dropped."""
    if kernel == "triton":
        return gmm_gpu.gmm(x_MK, w_EKN, sizes_E, interpret=interpret)
    if kernel != "megablox":
        raise ValueError(f"grouped_matmul: kernel={kernel!r}, expected one of {KERNELS}")
    m, k = x_MK.shape
    tile = tiling(m, k, w_EKN.shape[2])
    mp = -(-m // tile[0]) * tile[0]
    sizes_E = sizes_E.astype(jnp.int32)
    total = jnp.sum(sizes_E)
    rows = jnp.arange(m)[:, None]
    x_MK = jnp.pad(jnp.where(rows < total, x_MK, 0), ((0, mp - m), (0, 0)))
    y = gmm(x_MK, w_EKN, sizes_E.at[-1].add(mp - total), x_MK.dtype, tile, None, None, False,
            interpret)
    return jnp.where(rows < total, y[:m], 0)


def _local(x_TD, experts_Tk, weights_Tk, w1, b1, w2, b2, *, limit: float, interpret: bool,
           kernel: str, mlp_axes: tuple[str, ...]):
    t, d = x_TD.shape
    k = experts_Tk.shape[1]
    e = w1.shape[0]
    experts_A = experts_Tk.reshape(-1)
    order_A = jnp.argsort(experts_A, stable=True)
    sorted_experts_A = experts_A[order_A]
    sizes_E = jnp.bincount(experts_A, length=e).astype(jnp.int32)
    grouped = functools.partial(grouped_matmul, kernel=kernel, interpret=interpret)
    h_AF2 = grouped(x_TD[order_A // k], w1, sizes_E) + b1[sorted_experts_A]
    y_AD = grouped(swiglu(h_AF2, limit), w2, sizes_E)
    if mlp_axes:
        y_AD = jax.lax.psum(y_AD, mlp_axes)
    y_AD = y_AD + b2[sorted_experts_A]
    y_AD = jnp.zeros_like(y_AD).at[order_A].set(y_AD)  # back to (token, choice) order
    return _combine(y_AD.reshape(t, k, d), Routing(None, experts_Tk, weights_Tk))


def _axes(mesh, name: str) -> tuple[str, ...]:
    spec = logical_to_spec((name,), RULES, mesh_axes=mesh.axis_names)
    return tuple(a for e in spec for a in spec_axes(e) if mesh.shape[a] > 1)


def moe_gmm(x_TD: jax.Array, routing: Routing, w: ExpertWeights, limit: float, *,
            kernel: str = "megablox", interpret: bool = False) -> jax.Array:
    """`moe_ragged` with grouped-matmul kernels (`kernel`: "megablox" for TPU, "triton" for
    GPU); on the mesh in context (see module doc)."""
    args = (x_TD, routing.experts_Tk, routing.weights_Tk, w.gate_up_EDF2, w.gate_up_bias_EF2,
            w.down_EFD, w.down_bias_ED)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return _local(*args, limit=limit, interpret=interpret, kernel=kernel, mlp_axes=())
    batch, mlp = _axes(mesh, "batch"), _axes(mesh, "mlp")
    if x_TD.shape[0] % math.prod(mesh.shape[a] for a in batch):
        batch = ()
    bs, ms = batch or None, mlp or None
    fn = functools.partial(_local, limit=limit, interpret=interpret, kernel=kernel,
                           mlp_axes=mlp)
    return jax.shard_map(
        fn, mesh=mesh,
        in_specs=(P(bs), P(bs), P(bs), P(None, None, ms), P(None, ms), P(None, ms, None), P()),
        out_specs=P(bs), check_vma=False,
    )(*args)
