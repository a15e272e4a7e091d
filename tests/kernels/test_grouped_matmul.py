"""`grouped_matmul` (the kernels behind `lax.ragged_dot`'s signature) against `lax.ragged_dot`,
interpret mode: rows that do not fill a tile and rows past the groups (zero in ragged_dot)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llm_jax.kernels.grouped_matmul import grouped_matmul


@pytest.mark.parametrize("kernel", ["megablox", "triton"])
def test_matches_ragged_dot_with_rows_past_the_groups(kernel):
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(150, 128)) / 11, jnp.float32)
    w = jnp.asarray(r.normal(size=(3, 128, 256)), jnp.float32)
    sizes = jnp.asarray([70, 0, 50], jnp.int32)  # 30 rows belong to no group
    do = jnp.asarray(r.normal(size=(150, 256)), jnp.float32)
    want, pull = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), x, w)
    got, pull_got = jax.vjp(
        lambda a, b: grouped_matmul(a, b, sizes, kernel=kernel, interpret=True), x, w)
    assert float(jnp.max(jnp.abs(got[120:]))) == 0.0
    for a, g in zip((want, *pull(do)), (got, *pull_got(do))):
        np.testing.assert_allclose(g, a, rtol=1e-5, atol=2e-5)


def test_unknown_kernel_is_named():
    with pytest.raises(ValueError, match="kernel='cutlass'"):
        grouped_matmul(jnp.zeros((8, 8)), jnp.zeros((1, 8, 8)), jnp.array([8]), kernel="cutlass")
