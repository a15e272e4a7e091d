"""A grouped matmul by a Pallas kernel, behind `lax.ragged_dot`'s signature: megablox `gmm` on
TPU, the Pallas-Triton `gmm_gpu` on GPU. Arrays in, arrays out: the MoE dispatches that use it
(`gmm`, `expert_parallel_gmm`) sort, combine and shard in model/moe_parallel.py.

Shapes: M rows (sorted by group), K in, N out, E groups; `sizes_E` rows per group, in order.

Both kernels carry a custom VJP (d lhs by the kernel against the rhs transposed, d rhs by a
transposed grouped matmul), so training runs kernels both ways. megablox rows fill whole tiles:
the rows are followed by zero rows counted into the last group, whose outputs are dropped (zero
rows, zero cotangents: no effect on values or gradients).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import gmm

from llm_jax.kernels import gmm_gpu

LANES = 128
# megablox's (tm, tk, tn) by default (ExecutionConfig.gmm_tile_m / _k / _n). Each row tile
# reads its expert's whole [K, N] weight and each of the N / tn column tiles reads the rows
# again, so the bytes of one call are about x (N / tn) + (M / tm + E) w_expert + y (megablox's own cost
# estimate). Compiled for v5p (gpt-oss-20b's 2-layer step at 8k tokens per chip, docs/
# scaling.md): (1024, 512, 1024) reads 2-3 % fewer bytes than this default, with the same
# temporaries at a 40,960-row buffer but 4.7 GiB more dropless (131,072 rows); (1024, 1024,
# 1024) overflows the kernel's 16 MiB of scoped VMEM.
Tile = tuple[int, int, int]  # (tm, tk, tn)
TILE: Tile = (512, 1024, 1024)


def whole_lanes(x: int) -> int:
    """`x` rounded up to whole 128-lane tiles."""
    return -(-x // LANES) * LANES


def tiling(m: int, k: int, n: int, tile: Tile = TILE) -> Tile:
    """(tm, tk, tn) for an [m, k] x [k, n] call: `tile`'s rows (m is padded to them, or to 128
    when smaller), k and n tiles of up to `tile`'s lanes (a last partial tile is masked by the
    kernel)."""
    tm = tile[0] if m >= tile[0] else LANES
    return tm, min(tile[1], whole_lanes(k)), min(tile[2], whole_lanes(n))


KERNELS = ("megablox", "triton")


def grouped_matmul(x_MK: jax.Array, w_EKN: jax.Array, sizes_E: jax.Array, *, kernel: str,
                   interpret: bool = False, group_offset: jax.Array | int | None = None,
                   tile: Tile = TILE) -> jax.Array:
    """`lax.ragged_dot(x, w, sizes)` by a kernel (rows past sum(sizes) are zero).

    With `group_offset` o, `w_EKN` holds only groups o .. o + w.shape[0] - 1 of the len(sizes)
    groups: their rows are multiplied and every other row is zero (a packed stack is unpacked
    and multiplied a group of experts at a time, model/moe_parallel.py). megablox visits only
    the row tiles of those groups; the Triton kernel skips the others' tiles.

    megablox wants whole row tiles whose rows all belong to groups: the rows are zero-padded to
    the tile and the padding counted into the last group, then dropped. `tile`: megablox's
    (tm, tk, tn) at most (`tiling`); the Triton kernel picks its own."""
    if kernel not in KERNELS:
        raise ValueError(f"grouped_matmul: kernel={kernel!r}, expected one of {KERNELS}")
    if group_offset is None and w_EKN.shape[0] != sizes_E.shape[0]:
        raise ValueError(f"grouped_matmul: {sizes_E.shape[0]} group sizes for a stack of "
                         f"{w_EKN.shape[0]} groups, without a group_offset")
    offset = jnp.asarray(0 if group_offset is None else group_offset, jnp.int32)
    if kernel == "triton":
        return gmm_gpu.gmm(x_MK, w_EKN, sizes_E, interpret=interpret, group_offset=offset)
    m, k = x_MK.shape
    tile = tiling(m, k, w_EKN.shape[2], tile)
    mp = -(-m // tile[0]) * tile[0]
    sizes_E = sizes_E.astype(jnp.int32)
    total = jnp.sum(sizes_E)
    rows = jnp.arange(m)[:, None]
    x_MK = jnp.pad(jnp.where(rows < total, x_MK, 0), ((0, mp - m), (0, 0)))
    y = gmm(x_MK, w_EKN, sizes_E.at[-1].add(mp - total), x_MK.dtype, tile,
            None if group_offset is None else offset, None, False, interpret)
    return jnp.where(rows < total, y[:m], 0)
