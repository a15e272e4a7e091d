"""The GPU flash-attention kernel (Pallas, interpret mode on CPU) against the direct path:
outputs and gradients of q, k, v and sinks within 1e-5 in float32; and lowered for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llm_jax.kernels.flash_attention_gpu import flash_attend
from llm_jax.model.attention_math import attend, attention_mask
from llm_jax.parallel.roofline import triton_kernels_for_cuda

TOL = 1e-5


# (B, T, N, K, window, segments, positions offset per row)
CASES = [
    (1, 64, 2, 2, 0, False, False),  # G = 1, causal
    (2, 64, 4, 1, 5, True, False),  # G = 4, window 5, packed segments + padding
    (1, 64, 8, 1, 20, True, True),  # G = 8, window across blocks, positions not from 0
]


@pytest.mark.slow  # Pallas interpret mode: ~10-20 s a case on 2 busy cores
@pytest.mark.parametrize("b,t,n,k,window,segs,offset", CASES)
def test_matches_direct_path(b, t, n, k, window, segs, offset):
    r = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)  # noqa: E731
    q, kk, v, sinks, do = f(b, t, n, 16), f(b, t, k, 16), f(b, t, k, 16), f(n), f(b, t, n, 16)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + (7 if offset else 0), (b, t))
    seg = None
    if segs:
        i = np.arange(t)
        seg = jnp.asarray(np.where(i < 3 * t // 4, np.where(i < t // 3, 1, 2), 0)[None]
                          .repeat(b, 0), jnp.int32)
    mask = attention_mask(pos, pos, window, seg, seg)
    out, pull = jax.vjp(lambda *a: attend(*a, mask), q, kk, v, sinks)
    want = (out, *pull(do))

    @jax.jit
    def got_fn(q, kk, v, sinks, w):  # the window traced, as in the scanned layers
        out, pull = jax.vjp(lambda *a: flash_attend(*a, pos, pos, w, seg, seg, block_q=16,
                                                    block_k=16, interpret=True), q, kk, v, sinks)
        return (out, *pull(do))

    got = got_fn(q, kk, v, sinks, jnp.int32(window))
    for name, a, g in zip(("out", "dq", "dk", "dv", "dsinks"), want, got):
        err = float(jnp.max(jnp.abs(a - g)))
        assert err < TOL, (name, err)


def test_lowers_to_triton_for_cuda():
    """Forward and backward lower through Pallas' Triton backend (its GPU default, Mosaic GPU,
    rejects these kernels), in the bf16 a GPU trains in: one fwd, one dq and one dkv kernel."""
    b, t, n, k, h = 1, 128, 4, 2, 64
    sds = jax.ShapeDtypeStruct
    args = (sds((b, t, n, h), jnp.bfloat16), sds((b, t, k, h), jnp.bfloat16),
            sds((b, t, k, h), jnp.bfloat16), sds((n,), jnp.float32), sds((b, t), jnp.int32))

    def loss(q, kk, v, sinks, pos):
        return flash_attend(q, kk, v, sinks, pos, pos, 128).astype(jnp.float32).sum()

    assert triton_kernels_for_cuda(loss, *args) == {"flash_sinks_fwd": 1}
    assert triton_kernels_for_cuda(jax.grad(loss, (0, 1, 2, 3)), *args) == {
        "flash_sinks_fwd": 1, "flash_sinks_dq": 1, "flash_sinks_dkv": 1}
