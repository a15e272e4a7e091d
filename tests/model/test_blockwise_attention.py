"""Block-sparse attention: equals the direct path (`attend` with `attention_mask`), outputs and
gradients of q, k, v and the sinks, for windows 1..T, packed segments with padding, arbitrary
positions, GQA 1..8, traced windows, inside a remat'd layer scan; visits only the blocks it must.

Tolerances: float32 atol = rtol = 1e-5 against the direct path (TOL); bfloat16 inputs 2e-2
against the float32 direct path on the same (rounded) values, about 4 bf16 ulps at |x| ~ 1.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llm_jax.config import ModelConfig
from llm_jax.model.attention import Attention
from llm_jax.model.attention_math import attend, attention_mask
from llm_jax.model.blockwise_attention import (
    block_visibility,
    blockwise_attend,
    use_blockwise,
    visited_pairs,
)

TOL = dict(rtol=1e-5, atol=1e-5)


def _qkvs(b, t, n, kv, h=16, seed=0, s=None):
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    s = t if s is None else s
    return f(b, t, n, h), f(b, s, kv, h), f(b, s, kv, h), f(n), f(b, t, n, h)


def _packed(b, t, seed=0):
    """Segment ids of contiguous documents with a padded tail of zeros (a different length in
    every row) and positions restarting at 0 in each document."""
    rng = np.random.default_rng(seed)
    seg, pos = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t - 4), 3, replace=False))
        bounds = [0, *cuts, t - 4 - 3 * row]  # the last 4 + 3 row positions are padding
        for doc, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            seg[row, lo:hi] = doc + 1
            pos[row, lo:hi] = np.arange(hi - lo)
    return jnp.asarray(pos), jnp.asarray(seg)


def _layout(name, b, t):
    """(positions, segment ids) of a named layout."""
    if name == "offset":  # positions starting at 37, no segments
        return jnp.broadcast_to(jnp.arange(t) + 37, (b, t)), None
    if name == "packed":
        return _packed(b, t)
    if name == "tail_padding":  # one document per row, padded to t by a different amount per row
        seg = (jnp.arange(t)[None] < jnp.asarray([[t - 3], [t - 20]])).astype(jnp.int32)
        return jnp.broadcast_to(jnp.arange(t), (b, t)), seg
    raise ValueError(name)


@functools.lru_cache(maxsize=None)
def _both(q_block: int, block: int):
    """One jitted function per block sizes giving (output, grads of sum(output * ct)) of the
    direct and of the blockwise path. Positions, window and segment ids are its arguments:
    traced, and one compilation serves every case of a shape."""
    def both(q, k, v, sinks, ct, qp, kp, window, qs, ks):
        def out_and_grads(attn):
            out, vjp = jax.vjp(attn, q, k, v, sinks)
            return out, vjp(ct)

        return (out_and_grads(lambda q, k, v, s: attend(
                    q, k, v, s, attention_mask(qp, kp, window, qs, ks))),
                out_and_grads(lambda q, k, v, s: blockwise_attend(
                    q, k, v, s, qp, kp, window, qs, ks, q_block=q_block, block=block)))

    return jax.jit(both)


def _errors(q, k, v, sinks, ct, qp, kp, window, qs=None, ks=None, *, q_block, block):
    """Asserts blockwise = direct within TOL, output and each gradient; returns the max errors."""
    (out_d, grads_d), (out_b, grads_b) = _both(q_block, block)(q, k, v, sinks, ct, qp, kp,
                                                               jnp.int32(window), qs, ks)
    errors = {}
    for name, b, d in zip(("out", "dq", "dk", "dv", "dsinks"), (out_b, *grads_b),
                          (out_d, *grads_d)):
        np.testing.assert_allclose(b, d, **TOL, err_msg=name)
        errors[name] = float(jnp.max(jnp.abs(b - d)))
    return errors


@pytest.mark.parametrize("layout", ["offset", "packed", "tail_padding"])
@pytest.mark.parametrize("window", [0, 1, 5, 16, 40, 50, 64],
                         ids=["full", "w1", "w_lt_block", "w_eq_block", "w_gt_block", "w_eq_T",
                              "w_gt_T"])
def test_equals_direct_for_windows_and_layouts(window, layout):
    b, t = 2, 50  # blocks of 16: the last query and key block are padded
    q, k, v, sinks, ct = _qkvs(b, t, 4, 2)
    pos, seg = _layout(layout, b, t)
    _errors(q, k, v, sinks, ct, pos, pos, window, seg, seg, q_block=16, block=16)


@pytest.mark.parametrize("n, kv", [(4, 4), (4, 2), (8, 2), (8, 1)],
                         ids=["gqa1", "gqa2", "gqa4", "gqa8"])
@pytest.mark.parametrize("window", [0, 7])
def test_equals_direct_for_gqa_ratios(n, kv, window):
    b, t = 2, 50
    q, k, v, sinks, ct = _qkvs(b, t, n, kv, seed=1)
    pos, seg = _packed(b, t, seed=1)
    _errors(q, k, v, sinks, ct, pos, pos, window, seg, seg, q_block=16, block=16)


@pytest.mark.parametrize("q_block, block", [(8, 16), (32, 16), (64, 64)],
                         ids=["q8_k16", "q32_k16", "one_block"])
def test_equals_direct_for_unequal_block_sizes(q_block, block):
    b, t = 2, 61
    q, k, v, sinks, ct = _qkvs(b, t, 4, 2, seed=2)
    pos, seg = _packed(b, t, seed=2)
    for window in (0, 9):
        _errors(q, k, v, sinks, ct, pos, pos, window, seg, seg, q_block=q_block, block=block)


def test_equals_direct_for_arbitrary_positions_and_segments():
    """Shuffled positions and interleaved segment ids: the block bounds are loose, never wrong."""
    b, t = 2, 50
    rng = np.random.default_rng(3)
    q, k, v, sinks, ct = _qkvs(b, t, 4, 2, seed=3)
    pos = jnp.asarray(np.stack([rng.permutation(t) + 5 * row for row in range(b)]))
    seg = jnp.asarray(rng.integers(0, 3, (b, t)), jnp.int32)
    for window in (0, 3, 20):
        _errors(q, k, v, sinks, ct, pos, pos, window, seg, seg, q_block=16, block=16)
        _errors(q, k, v, sinks, ct, pos, pos, window, q_block=16, block=16)


def test_equals_direct_for_queries_after_a_cached_prefix():
    """T != S: 20 queries at positions 100..119 against 120 keys (a prefill after a cache)."""
    b, t, s = 2, 20, 120
    q, k, v, sinks, ct = _qkvs(b, t, 4, 2, seed=4, s=s)
    qp = jnp.broadcast_to(jnp.arange(t) + 100, (b, t))
    kp = jnp.broadcast_to(jnp.arange(s), (b, s))
    for window in (0, 30):
        _errors(q, k, v, sinks, ct, qp, kp, window, q_block=16, block=32)


def test_bfloat16_inputs():
    b, t = 2, 50
    q, k, v, sinks, ct = _qkvs(b, t, 4, 2)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    pos, seg = _packed(b, t)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

    def direct(q, k, v, s):
        return attend(*(f32(x) for x in (q, k, v)), s, attention_mask(pos, pos, 7, seg, seg))

    def blockwise(q, k, v, s):
        return blockwise_attend(q, k, v, s, pos, pos, 7, seg, seg, q_block=16, block=16)

    @jax.jit
    def out_and_grads(q, k, v, s):
        results = []
        for attn in (blockwise, direct):
            out, vjp = jax.vjp(attn, q, k, v, s)
            results.append((out, vjp(ct.astype(out.dtype))))
        return results

    (out, grads), (out_ref, grads_ref) = out_and_grads(q, k, v, sinks)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(f32(out), out_ref, rtol=2e-2, atol=2e-2)
    for name, g, g_ref, dtype in zip(("q", "k", "v", "sinks"), grads, grads_ref,
                                     (jnp.bfloat16,) * 3 + (jnp.float32,)):
        assert g.dtype == dtype, name
        np.testing.assert_allclose(f32(g), f32(g_ref), rtol=2e-2, atol=2e-2, err_msg=f"d{name}")


def test_inside_a_remat_layer_scan_with_the_window_as_data():
    """Two layers scanned with windows [5, 0] as data and jax.checkpoint around the body, as
    `Transformer` does; gradients through the scan equal the direct path's."""
    b, t = 2, 40
    q, k, v, sinks, ct = _qkvs(b, t, 4, 2, seed=6)
    pos, seg = _packed(b, t, seed=6)
    windows = jnp.asarray([5, 0], jnp.int32)

    def stack(attn):
        @jax.checkpoint
        def body(x, w):
            return x + attn(x, k, v, sinks, w), None

        return lambda q: jnp.sum(jax.lax.scan(body, q, windows)[0] * ct)

    direct = stack(lambda x, k, v, s, w: attend(x, k, v, s, attention_mask(pos, pos, w, seg, seg)))
    bw = stack(lambda x, k, v, s, w: blockwise_attend(x, k, v, s, pos, pos, w, seg, seg,
                                                      q_block=16, block=16))
    (loss_bw, grad_bw), (loss_d, grad_d) = jax.jit(
        lambda q: (jax.value_and_grad(bw)(q), jax.value_and_grad(direct)(q)))(q)
    np.testing.assert_allclose(loss_bw, loss_d, **TOL)
    np.testing.assert_allclose(grad_bw, grad_d, **TOL)


# ------------------------------------------------------------------ which blocks are visited


def _true_visibility(qp, kp, window, qs, ks, cq, ck):
    """[I, J]: whether some query of block i sees some key of block j (from the full mask)."""
    m = np.asarray(attention_mask(qp, kp, window, qs, ks)).any(0)
    t, s = m.shape
    m = np.pad(m, ((0, -t % cq), (0, -s % ck)))
    return m.reshape(-(-t // cq), cq, -(-s // ck), ck).any((1, 3))


def test_visited_pairs_causal_is_half_and_window_grows_with_w():
    c = 16
    for t in (256, 250):  # 250: the padded rows of the last block must not widen its bounds
        pos = jnp.arange(t)[None]
        j = -(-t // c)
        assert int(visited_pairs(pos, pos, 0, q_block=c, block=c)) == j * (j + 1) // 2
    t, j = 256, 16
    pos = jnp.arange(t)[None]
    for w in (1, 8, 16, 24, 32, 64):
        per_block = -(-w // c) + 1  # the tight count: ceil(W / C) + 1 key blocks per query block
        n = int(visited_pairs(pos, pos, jnp.int32(w), q_block=c, block=c))
        assert j * per_block - per_block * (per_block - 1) // 2 >= n, (w, n)
        np.testing.assert_array_equal(np.asarray(block_visibility(pos, pos, w, q_block=c,
                                                                  block=c)),
                                      _true_visibility(pos, pos, w, None, None, c, c))
    # Each query block added by a longer T visits ceil(W / C) + 1 more key blocks: the cost is
    # T x W, where causal attention's is T^2 / 2.
    for w in (16, 64):
        short, long = (int(visited_pairs(p, p, w, q_block=c, block=c))
                       for p in (jnp.arange(256)[None], jnp.arange(1024)[None]))
        assert long - short == (1024 - 256) // c * (-(-w // c) + 1)
    # Packed documents: pairs across documents are skipped.
    pos, seg = _packed(2, t, seed=7)
    assert int(visited_pairs(pos, pos, 0, seg, seg, q_block=c, block=c)) < j * (j + 1) // 2


@pytest.mark.parametrize("seed", range(4))
def test_visibility_never_skips_a_visible_pair(seed):
    """Random positions, segments and windows: every block pair holding a visible (query, key)
    pair is visited."""
    rng = np.random.default_rng(seed)
    b, t, s = 2, 70, 90
    qp = jnp.asarray(rng.integers(0, 60, (b, t)))
    kp = jnp.asarray(rng.integers(0, 60, (b, s)))
    qs = jnp.asarray(rng.integers(0, 3, (b, t)))
    ks = jnp.asarray(rng.integers(0, 3, (b, s)))
    if seed % 2:  # sorted: tighter bounds, still conservative
        qp, kp, qs, ks = (jnp.sort(x, axis=1) for x in (qp, kp, qs, ks))
    visibility = jax.jit(block_visibility, static_argnames=("q_block", "block"))
    for window in (0, 1, 4, 30):
        for segs in ((None, None), (qs, ks)):
            vis = np.asarray(visibility(qp, kp, jnp.int32(window), *segs, q_block=16, block=8))
            need = _true_visibility(qp, kp, window, *segs, 16, 8)
            assert not (need & ~vis).any(), (window, segs[0] is None)


# ------------------------------------------------------------------ memory and the layer


def test_memory_grows_linearly_with_length():
    def temp_bytes(t, attn):
        q, k, v, s, ct = _qkvs(1, t, 4, 2, 64)
        pos = jnp.arange(t)[None]
        f = jax.jit(jax.grad(lambda q, k, v, s: jnp.sum(attn(q, k, v, s, pos) * ct)))
        return f.lower(q, k, v, s).compile().memory_analysis().temp_size_in_bytes

    bw = lambda q, k, v, s, p: blockwise_attend(q, k, v, s, p, p, 0, block=128)  # noqa: E731
    direct = lambda q, k, v, s, p: attend(q, k, v, s, attention_mask(p, p, 0))  # noqa: E731
    # 4x the length: blockwise about 4x the memory; direct about 16x for its T x T part (10x in
    # all here).
    assert temp_bytes(1024, bw) < 5 * temp_bytes(256, bw)
    assert temp_bytes(1024, direct) > 8 * temp_bytes(256, direct)


def test_attention_layer_chooses_blockwise_for_long_sequences_with_same_output():
    assert not use_blockwise(8, 128, 128, 4)
    assert use_blockwise(8, 256, 256, 4)
    assert use_blockwise(1, 8192, 8192, 4)
    assert not use_blockwise(8, 1, 8192, 4)  # one decode step stays direct
    cfg = ModelConfig(num_hidden_layers=1, num_experts=4, vocab_size=64, hidden_size=32,
                      intermediate_size=32, head_dim=8, num_attention_heads=4,
                      num_key_value_heads=2)
    from flax import nnx

    layer = Attention(cfg, rngs=nnx.Rngs(params=0))
    t = 512
    assert use_blockwise(1, t, t, cfg.num_attention_heads)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, t, 32)), jnp.float32)
    pos = jnp.arange(t)[None]
    def both(layer, x):
        q, k, v = layer.qkv(x, pos)
        return layer(x, pos, 0)[0], layer.out(attend(q, k, v, layer.sinks[...],
                                                     attention_mask(pos, pos, 0)))

    out, ref = nnx.jit(both)(layer, x)
    np.testing.assert_allclose(out, ref, **TOL)
