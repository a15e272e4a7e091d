"""Attention: numpy reference with sinks, rows sum below one, sliding window, GQA ratios."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llm_jax.config import ModelConfig
from llm_jax.model.attention import ATTENTIONS, Attention, MaskInputs
from llm_jax.model.attention_math import attend, attention_mask


def numpy_attention(q, k, v, sinks, window=0):
    """Reference: repeat kv heads, append the sink column, softmax, drop it. Also returns probs."""
    b, t, n, h = q.shape
    g = n // k.shape[2]
    k = np.repeat(k, g, axis=2)
    v = np.repeat(v, g, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    mask = (j <= i) & ((window == 0) | (i - j < window))
    s = np.where(mask, s, -np.inf)
    s = np.concatenate([s, np.broadcast_to(sinks[None, :, None, None], (b, n, t, 1))], -1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    p = p[..., :-1]
    return np.einsum("bnts,bsnh->btnh", p, v), p


def _inputs(n, kv, t=12, h=8, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(2, t, n, h)).astype(np.float32)
    k = rng.normal(size=(2, t, kv, h)).astype(np.float32)
    v = rng.normal(size=(2, t, kv, h)).astype(np.float32)
    sinks = rng.normal(size=(n,)).astype(np.float32)
    return q, k, v, sinks


@pytest.mark.parametrize("n, kv", [(4, 4), (4, 2), (6, 2)], ids=["ratio1", "ratio2", "ratio3"])
@pytest.mark.parametrize("window", [0, 5])
def test_gqa_attention_matches_numpy_reference(n, kv, window):
    q, k, v, sinks = _inputs(n, kv)
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
    out = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(sinks),
                 attention_mask(pos, pos, window))
    ref, _ = numpy_attention(q, k, v, sinks, window)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def _attention_weights(q, k, sinks, window):
    """Attention probabilities [B, N, T, S] read through `attend` itself: with one-hot values
    (v[s] = e_s) the output row of query t is its probability row. Needs head_dim == T."""
    b, t, _, h = q.shape
    assert h == t
    v = np.broadcast_to(np.eye(t, dtype=np.float32)[None, :, None, :], (b, t, k.shape[2], t))
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    out = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v.copy()), jnp.asarray(sinks),
                 attention_mask(pos, pos, window))
    return np.asarray(out).transpose(0, 2, 1, 3)


def test_sinks_make_attention_rows_sum_below_one():
    q, k, _, sinks = _inputs(4, 2, t=12, h=12)
    w = _attention_weights(q, k, sinks, 0)
    assert np.all(w.sum(-1) < 1.0) and np.all(w.sum(-1) > 0.0)
    _, p_ref = numpy_attention(q, k, k, sinks)
    np.testing.assert_allclose(w, p_ref, rtol=1e-5, atol=1e-6)
    # A very negative sink gives the ordinary softmax: rows sum to 1.
    w = _attention_weights(q, k, np.full_like(sinks, -1e4), 0)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("window", [1, 4, 7])
def test_sliding_layer_sees_exactly_window_keys(window):
    t = 16
    q, k, _, sinks = _inputs(4, 2, t=t, h=t)
    w = _attention_weights(q, k, sinks, window)
    visible = (w > 0).sum(-1)  # [B, N, T]
    expected = np.minimum(np.arange(t) + 1, window)
    np.testing.assert_array_equal(visible, np.broadcast_to(expected, visible.shape))
    _, p_ref = numpy_attention(q, k, k, sinks, window)
    np.testing.assert_allclose(w, p_ref, rtol=1e-5, atol=1e-6)


def test_fully_masked_row_gives_zero_output_not_nan():
    q, k, v, sinks = _inputs(4, 2, t=4)
    mask = jnp.zeros((2, 4, 4), bool)
    out = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(sinks), mask)
    np.testing.assert_array_equal(out, 0.0)


def test_segment_ids_block_attention_across_documents():
    pos = jnp.array([[0, 1, 2, 0, 1]])
    seg = jnp.array([[1, 1, 1, 2, 2]])
    m = np.asarray(attention_mask(pos, pos, 0, seg, seg))[0]
    assert m[4, 3] and m[4, 4] and not m[4, 2] and not m[3, 0]
    assert m[2].tolist() == [True, True, True, False, False]


def test_attention_module_shapes_and_window_changes_output():
    cfg = ModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      rope_scaling_factor=1.0)
    attn = Attention(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 10, 32))
    pos = jnp.broadcast_to(jnp.arange(10), (2, 10))
    # One compiled program, the window its argument (as the scanned layers pass it).
    run = nnx.jit(lambda attn, x, window: attn(x, pos, window))
    y_full, no_cache = run(attn, x, jnp.int32(0))
    assert no_cache is None
    y_win, _ = run(attn, x, jnp.int32(3))
    assert y_full.shape == (2, 10, 32)
    np.testing.assert_allclose(y_full[:, :3], y_win[:, :3], rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(y_full[:, 5:] - y_win[:, 5:]).max()) > 1e-4


@pytest.mark.slow  # splash and flash run in Pallas interpret mode on CPU
@pytest.mark.parametrize("name", sorted(ATTENTIONS))
@pytest.mark.parametrize("offset", [0, 3])  # 3: positions are not the index (splash falls back)
def test_every_attention_in_the_table_computes_the_reference(name, offset):
    b, t, n, kv, h, window = 1, 128, 2, 1, 64, 5
    r = np.random.default_rng(1)
    q, k, v = (jnp.asarray(r.normal(size=(b, t, heads, h)), jnp.float32) for heads in (n, kv, kv))
    sinks = jnp.asarray(r.normal(size=(n,)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + offset, (b, t))
    i = np.arange(t)
    seg = jnp.asarray(np.where(i < 96, np.where(i < 40, 1, 2), 0)[None], jnp.int32)
    mask = MaskInputs(pos, pos, window, seg, seg)
    cfg = ModelConfig(num_attention_heads=n, num_key_value_heads=kv, head_dim=h, sliding_window=window)
    want = attend(q, k, v, sinks, attention_mask(pos, pos, window, seg, seg))
    got = jax.jit(lambda q, k, v: ATTENTIONS[name](q, k, v, sinks, mask, cfg))(q, k, v)
    assert float(jnp.max(jnp.abs(got - want))) < 1e-5


def test_mask_with_key_segments_only_hides_padding_keys_for_any_query_length():
    # Decoding: one query over S cache slots, the empty slots marked as segment 0.
    kv_pos = jnp.asarray([[0, 1, 2, -1, -1]], jnp.int32)
    m = attention_mask(jnp.asarray([[2]], jnp.int32), kv_pos, 0, None,
                       (kv_pos >= 0).astype(jnp.int32))
    assert m.shape == (1, 1, 5)
    assert np.asarray(m)[0, 0].tolist() == [True, True, True, False, False]
