"""The machine's measured matmul FLOP/s: the denominator of MFU on hardware without a spec sheet."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def measure_matmul_flops(dtype: str = "float32", n: int = 2048, repeats: int = 5) -> float:
    """Median FLOP/s of an n x n x n matmul in `dtype`, accumulating in float32, on device 0."""
    a = jnp.ones((n, n), dtype)
    b = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    f(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / float(np.median(times))
