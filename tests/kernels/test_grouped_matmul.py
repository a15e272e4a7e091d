"""`grouped_matmul` (the kernels behind `lax.ragged_dot`'s signature) against `lax.ragged_dot`,
interpret mode: with a `group_offset`, some groups' weights only (the others' rows, and the rows
past the groups, exactly zero), whose sum over the groups is the whole product (float32, within
2e-5 on O(1) values), for both kernels; megablox's tiles, rows that do not fill a tile and rows
past the groups (exactly zero, as in ragged_dot) without an offset. (The Triton kernel without
an offset: tests/kernels/test_gmm_gpu.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llm_jax.execution import ExecutionConfig
from llm_jax.kernels.grouped_matmul import TILE, grouped_matmul, tiling


@pytest.mark.parametrize("kernel", ["megablox", "triton"])
def test_a_group_offset_multiplies_those_groups_rows_only(kernel):
    r = np.random.default_rng(1)
    x = jnp.asarray(r.normal(size=(300, 128)) / 11, jnp.float32)
    w = jnp.asarray(r.normal(size=(6, 128, 256)), jnp.float32)
    # Groups that straddle row tiles, an empty one, rows past the groups (the padding rows join
    # the last group, in the last part only).
    sizes = jnp.asarray([70, 0, 131, 1, 60, 20], jnp.int32)
    do = jnp.asarray(r.normal(size=(300, 256)), jnp.float32)
    want, pull = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), x, w)
    dx_want, dw_want = pull(do)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    total, dx, dws = 0.0, 0.0, []

    @jax.jit  # the offset is an argument: one program for the three parts
    def part(a, b, start):
        return jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, kernel=kernel, interpret=True,
                                                   group_offset=start), a, b)

    for start in (0, 2, 4):  # three parts of two groups each
        got, pull_got = part(x, w[start:start + 2], jnp.int32(start))
        lo, hi = bounds[start], bounds[start + 2]
        outside = np.concatenate([np.asarray(got)[:lo], np.asarray(got)[hi:]])
        assert not outside.any()
        np.testing.assert_allclose(got[lo:hi], want[lo:hi], rtol=1e-5, atol=2e-5)
        g_x, g_w = pull_got(do)
        total, dx = total + got, dx + g_x
        dws.append(g_w)
    np.testing.assert_allclose(total, want, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(dx, dx_want, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(jnp.concatenate(dws), dw_want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("tile", [(256, 128, 128), (128, 256, 384), TILE])
def test_megablox_tiles_change_no_value_or_gradient(tile):
    """Row tiles that groups straddle, several contracted and output tiles (a last partial
    one), and the default (whose 1,024 rows exceed m: 128-row tiles)."""
    r = np.random.default_rng(2)
    x = jnp.asarray(r.normal(size=(300, 256)) / 16, jnp.float32)
    w = jnp.asarray(r.normal(size=(4, 256, 448)), jnp.float32)
    # Group bounds 120, 177, 177, 257 (43 rows past the groups): row tiles of 128 and of 256
    # rows end inside groups.
    sizes = jnp.asarray([120, 57, 0, 80], jnp.int32)
    do = jnp.asarray(r.normal(size=(300, 448)), jnp.float32)
    want, pull = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), x, w)
    got, pull_got = jax.vjp(
        lambda a, b: grouped_matmul(a, b, sizes, kernel="megablox", interpret=True, tile=tile),
        x, w)
    assert float(jnp.max(jnp.abs(got[257:]))) == 0.0  # rows past the groups: zero, as ragged_dot
    for a, g in zip((want, *pull(do)), (got, *pull_got(do))):  # d x reaches |20|: float32 sums
        np.testing.assert_allclose(g, a, rtol=1e-5, atol=2e-6 * float(jnp.max(jnp.abs(a))))


def test_tiling_takes_the_tile_or_what_the_shape_needs():
    assert tiling(40960, 2880, 5760) == TILE == (512, 1024, 1024)
    ex = ExecutionConfig()
    assert (ex.gmm_tile_m, ex.gmm_tile_k, ex.gmm_tile_n) == TILE  # the config's defaults
    assert tiling(40960, 2880, 5760, (1024, 512, 1024)) == (1024, 512, 1024)
    assert tiling(700, 64, 200) == (512, 128, 256)  # lanes padded to 128
    assert tiling(100, 2880, 5760) == (128, 1024, 1024)  # fewer rows than a tile: 128-row tiles


def test_unknown_kernel_is_named():
    with pytest.raises(ValueError, match="kernel='cutlass'"):
        grouped_matmul(jnp.zeros((8, 8)), jnp.zeros((1, 8, 8)), jnp.array([8]), kernel="cutlass")
