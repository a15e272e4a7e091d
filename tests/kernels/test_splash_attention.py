"""Splash attention (Pallas, interpret mode on CPU) against the direct path: outputs and the
gradients of q, k, v and sinks within 1e-5 in float32, for windows, segments, GQA ratios."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llm_jax.kernels.splash_attention import splash_attend
from llm_jax.model.attention_math import attend, attention_mask

TOL = 1e-5


def _inputs(b, t, n, k, h=64, seed=0):
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)  # noqa: E731
    return f(b, t, n, h), f(b, t, k, h), f(b, t, k, h), f(n), f(b, t, n, h)


def _vjp(fn, q, k, v, s, do):
    out, pull = jax.vjp(fn, q, k, v, s)
    return (out, *pull(do))


# (B, T, N, K, window, segments, windows the traced window may take)
CASES = [
    (1, 128, 2, 2, 0, True, None),  # G = 1, causal, packed segments + padding
    (2, 128, 8, 1, 5, False, (0, 5)),  # G = 8, window 5 chosen by lax.switch on a traced window
    (1, 256, 4, 2, 130, True, None),  # G = 2, window across two 128 blocks, segments
]


@pytest.mark.slow  # Pallas interpret mode: ~10-20 s a case on 2 busy cores
@pytest.mark.parametrize("b,t,n,k,window,segs,windows", CASES)
def test_matches_direct_path(b, t, n, k, window, segs, windows):
    q, kk, v, sinks, do = _inputs(b, t, n, k)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    seg = None
    if segs:  # two documents then padding (segment 0), as packed and right-padded batches are
        i = np.arange(t)
        seg = jnp.asarray(np.where(i < 3 * t // 4, np.where(i < t // 3, 1, 2), 0)[None]
                          .repeat(b, 0), jnp.int32)
    mask = attention_mask(pos, pos, window, seg, seg)
    want = _vjp(lambda *a: attend(*a, mask), q, kk, v, sinks, do)

    @jax.jit
    def got_fn(q, kk, v, sinks, w):
        w = window if windows is None else w
        return _vjp(lambda *a: splash_attend(*a, pos, pos, w, seg, seg, windows=windows or (0,),
                                             interpret=True), q, kk, v, sinks, do)

    got = got_fn(q, kk, v, sinks, jnp.int32(window))
    for name, a, g in zip(("out", "dq", "dk", "dv", "dsinks"), want, got):
        err = float(jnp.max(jnp.abs(a - g)))
        assert err < TOL, (name, err)


def test_refuses_shapes_it_cannot_run():
    q, kk, v, sinks, _ = _inputs(1, 100, 2, 2)
    pos = jnp.broadcast_to(jnp.arange(100), (1, 100))
    with pytest.raises(ValueError, match="multiple of 128"):
        splash_attend(q, kk, v, sinks, pos, pos, 0, interpret=True)
