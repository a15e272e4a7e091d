"""Grouped matmul for GPU in Pallas (Triton lowering): `lax.ragged_dot` without dense work.

Shapes: M rows sorted by group, K contraction, N output columns, G groups (experts);
bm, bk, bn the tile sizes.

`gmm(lhs_MK, rhs_GKN, group_sizes_G)[r] = lhs[r] @ rhs[g(r)]`, rows past sum(group_sizes) zero:
the function of `lax.ragged_dot`, which XLA:GPU has been reported to expand into dense work
(every row times every group) in jaxlib 0.10. Here each program owns one [bm, bn] output tile
and loops over only the groups whose rows meet the tile (at most G - 1 tiles in all straddle
two groups), masking the rows of the others: about M K N multiply-adds, as one matmul would.
The custom VJP runs kernels both ways (as megablox's `gmm` / `tgmm`):
- d lhs = the same kernel against rhs transposed in place (no transposed copy of the weights);
- d rhs[g] = lhs[rows of g]^T @ d out[rows of g]: one program per (g, K tile, N tile) loops over
  the row tiles of group g only.
Tiles are powers of two (Triton's rule): 64 rows (M zero-padded), and for K and N the largest
of 64 / 32 / 16 that divides them (else zero-padded, which copies the weights). The kernels name
the Triton backend (`TRITON`), since Pallas' GPU default, Mosaic GPU, does not take them.
`interpret=True` runs them in Pallas' interpreter (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

TRITON = pltriton.CompilerParams(num_warps=4, num_stages=2)
_TILES = (64, 32, 16)
ROW_TILE = 64


def _rows(m: int) -> tuple[int, int]:
    """(bm, padded m): rows are activations, cheap to pad, so always 64-row tiles."""
    return ROW_TILE, -(-m // ROW_TILE) * ROW_TILE


def _tile(n: int) -> tuple[int, int]:
    """(tile, padded n): the largest tile of _TILES dividing n, else n padded to 16."""
    for t in _TILES:
        if n % t == 0:
            return t, n
    return 16, -(-n // 16) * 16


def _pad_to(x: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
    pads = [(0, s - d) for s, d in zip(sizes, x.shape)]
    return jnp.pad(x, pads) if any(p for _, p in pads) else x


def _bounds(group_sizes: jax.Array, offset: jax.Array, g: int) -> tuple[jax.Array, jax.Array]:
    """Row ranges [lo_g, hi_g) of the `g` groups from `offset` on (of all len(group_sizes))."""
    hi = jnp.cumsum(group_sizes.astype(jnp.int32))
    lo = hi - group_sizes.astype(jnp.int32)
    return (jax.lax.dynamic_slice_in_dim(lo, offset, g),
            jax.lax.dynamic_slice_in_dim(hi, offset, g))


def _dot(a, b, contract_a: int, contract_b: int):
    dims = (((contract_a,), (contract_b,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _gmm_kernel(lo_ref, hi_ref, first_ref, last_ref, x_ref, w_ref, o_ref, *, bk: int,
                transpose_rhs: bool):
    i, j = pl.program_id(0), pl.program_id(1)
    bm, bn = o_ref.shape
    rows = i * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    cols = pl.ds(j * bn, bn)

    def group(g, acc):
        inside = (rows >= lo_ref[g]) & (rows < hi_ref[g])

        def k_step(kk, acc):
            x = jnp.where(inside, x_ref[pl.ds(i * bm, bm), pl.ds(kk * bk, bk)], 0)
            if transpose_rhs:  # rhs [G, N, K] read as [K, N]
                return acc + _dot(x, w_ref[g, cols, pl.ds(kk * bk, bk)], 1, 1)
            return acc + _dot(x, w_ref[g, pl.ds(kk * bk, bk), cols], 1, 0)

        return jax.lax.fori_loop(0, x_ref.shape[1] // bk, k_step, acc)

    acc = jax.lax.fori_loop(first_ref[i], last_ref[i] + 1, group,
                            jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _tgmm_kernel(lo_ref, hi_ref, x_ref, d_ref, o_ref, *, bm: int):
    g, kb, nb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bk, bn = o_ref.shape
    lo, hi = lo_ref[g], hi_ref[g]

    def tile(t, acc):
        rows = t * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
        x = jnp.where((rows >= lo) & (rows < hi), x_ref[pl.ds(t * bm, bm), pl.ds(kb * bk, bk)],
                      0)
        return acc + _dot(x, d_ref[pl.ds(t * bm, bm), pl.ds(nb * bn, bn)], 0, 0)

    first, end = lo // bm, jnp.where(hi > lo, (hi + bm - 1) // bm, lo // bm)
    acc = jax.lax.fori_loop(first, end, tile, jnp.zeros((bk, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _whole(x: jax.Array) -> pl.BlockSpec:
    """The whole array as one block (the kernels index it by program id)."""
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _forward(lhs, rhs, group_sizes, offset, transpose_rhs: bool, interpret: bool) -> jax.Array:
    """lhs [M, K] x rhs [G, K, N] (or [G, N, K] with transpose_rhs) -> [M, N]; rhs holds groups
    offset .. offset + G - 1 of group_sizes, rows of other groups are zero."""
    (m, k), g = lhs.shape, rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    (bm, mp), (bk, kp), (bn, np_) = _rows(m), _tile(k), _tile(n)
    lhs = _pad_to(lhs, (mp, kp))
    rhs = _pad_to(rhs, (g, np_, kp) if transpose_rhs else (g, kp, np_))
    lo, hi = _bounds(group_sizes, offset, g)
    starts = jnp.arange(mp // bm, dtype=jnp.int32) * bm
    # The groups meeting each row tile: the first ending after its first row, the last starting
    # at or before its last row (none for the tiles before or after these groups' rows).
    first = jnp.searchsorted(hi, starts, side="right").astype(jnp.int32)
    last = jnp.searchsorted(lo, starts + bm - 1, side="right") - 1
    meta = (lo, hi, first, last.astype(jnp.int32))
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, bk=bk, transpose_rhs=transpose_rhs),
        grid=(mp // bm, np_ // bn),
        in_specs=[*map(_whole, meta), _whole(lhs), _whole(rhs)],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), lhs.dtype),
        interpret=interpret, name="gmm_gpu", compiler_params=TRITON,
    )(*meta, lhs, rhs)
    return out[:m, :n]


def _transposed(lhs, dout, group_sizes, offset, num_groups: int, interpret: bool) -> jax.Array:
    """d rhs: [G, K, N] with [g] = lhs[rows of g]^T @ dout[rows of g]."""
    (m, k), n = lhs.shape, dout.shape[1]
    (bm, mp), (bk, kp), (bn, np_) = _rows(m), _tile(k), _tile(n)
    lhs, dout = _pad_to(lhs, (mp, kp)), _pad_to(dout, (mp, np_))
    lo, hi = _bounds(group_sizes, offset, num_groups)
    out = pl.pallas_call(
        functools.partial(_tgmm_kernel, bm=bm),
        grid=(num_groups, kp // bk, np_ // bn),
        in_specs=[_whole(lo), _whole(hi), _whole(lhs), _whole(dout)],
        out_specs=pl.BlockSpec((None, bk, bn), lambda g, a, b: (g, a, b)),
        out_shape=jax.ShapeDtypeStruct((num_groups, kp, np_), jnp.float32),
        interpret=interpret, name="tgmm_gpu", compiler_params=TRITON,
    )(lo, hi, lhs, dout)
    return out[:, :k, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _gmm(lhs, rhs, group_sizes, offset, interpret):
    return _forward(lhs, rhs, group_sizes, offset, False, interpret)


def _gmm_fwd(lhs, rhs, group_sizes, offset, interpret):
    out = _forward(lhs, rhs, group_sizes, offset, False, interpret)
    return out, (lhs, rhs, group_sizes, offset)


def _gmm_bwd(interpret, res, dout):
    lhs, rhs, group_sizes, offset = res
    dlhs = _forward(dout.astype(rhs.dtype), rhs, group_sizes, offset, True, interpret)
    drhs = _transposed(lhs, dout.astype(lhs.dtype), group_sizes, offset, rhs.shape[0],
                       interpret)
    return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype), None, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(lhs_MK: jax.Array, rhs_GKN: jax.Array, group_sizes_G: jax.Array, *,
        interpret: bool = False, group_offset: jax.Array | int | None = None) -> jax.Array:
    """`lax.ragged_dot(lhs, rhs, group_sizes)` for rows sorted by group, differentiable in lhs
    and rhs; the output in lhs's dtype, accumulated in float32. With `group_offset` o, rhs holds
    groups o .. o + G - 1 of len(group_sizes) and the rows of the other groups are zero."""
    if lhs_MK.ndim != 2 or rhs_GKN.ndim != 3 or lhs_MK.shape[1] != rhs_GKN.shape[1]:
        raise ValueError(f"gmm: expected lhs [M, K] and rhs [G, K, N], got {lhs_MK.shape} and "
                         f"{rhs_GKN.shape}")
    g = rhs_GKN.shape[0]
    if group_offset is None and group_sizes_G.shape != (g,):
        raise ValueError(f"gmm: group_sizes must be [G] = [{g}], got {group_sizes_G.shape}")
    if group_sizes_G.ndim != 1 or group_sizes_G.shape[0] < g:
        raise ValueError(f"gmm: group_sizes must be [>= G] = [>= {g}] with a group_offset, got "
                         f"{group_sizes_G.shape}")
    offset = jnp.asarray(0 if group_offset is None else group_offset, jnp.int32)
    return _gmm(lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32), offset, interpret)
