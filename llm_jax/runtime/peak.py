"""The machine's measured matmul FLOP/s: the denominator of MFU on hardware without a spec sheet.

Two measurements: XLA's own dot (what a jitted step can reach) and, for float32 on CPU, NumPy's
BLAS (what the machine can reach). MFU divides by the larger, so a slow XLA matmul shows up as
lost MFU instead of hiding in a low denominator.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def measure_matmul_flops(dtype: str = "float32", n: int = 2048, repeats: int = 5) -> float:
    """Median FLOP/s of an n x n x n XLA matmul in `dtype`, accumulating in float32, on device 0."""
    a = jnp.ones((n, n), dtype)
    b = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    return 2 * n**3 / _median_seconds(lambda: f(a, b).block_until_ready(), repeats)


def measure_blas_flops(n: int = 2048, repeats: int = 5) -> float:
    """Median FLOP/s of an n x n x n float32 matmul in NumPy's BLAS on the host."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), np.float32)
    b = rng.standard_normal((n, n), np.float32)
    return 2 * n**3 / _median_seconds(lambda: a @ b, repeats)


def measure_peak_flops(dtype: str = "float32", n: int = 2048, repeats: int = 5) -> dict[str, float]:
    """{"xla": ..., "blas": ... (float32 on CPU only), "peak": the larger}: the MFU denominator."""
    out = {"xla": measure_matmul_flops(dtype, n, repeats)}
    if jnp.dtype(dtype) == jnp.float32 and jax.devices()[0].platform == "cpu":
        out["blas"] = measure_blas_flops(n, repeats)
    out["peak"] = max(out.values())
    return out
