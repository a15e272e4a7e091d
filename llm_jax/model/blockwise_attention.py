"""Blockwise attention with sinks: the same function as `attention.attend`, memory linear in T.

Shapes: B batch, T query time, S key time, N q heads, K kv heads, G = N / K, H head_dim,
C keys per block, J = S / C blocks.

A scan over key blocks keeps, per query row, a running max m, normaliser l and weighted sum acc
(online softmax: Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022). The sink logit is
folded in before the first block as a key with value zero: m starts at the sink, l at
exp(sink - m) = 1. The visibility mask is built per block from positions, window and segment ids
(`attention_mask`), so neither the T x S scores nor the T x S mask ever exist whole. The backward
pass (custom_vjp) recomputes each block's probabilities from the saved log-normaliser
lse = m + log l, as FlashAttention does, so nothing T x S is saved for it either: what lives at
once is one [B, N, T, C] block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Below this many keys the direct path (one T x S einsum) is as fast and its memory is small.
BLOCKWISE_MIN_KEYS = 1024
# ... and above this many bytes of float32 scores (B N T S x 4) the direct path is refused.
BLOCKWISE_SCORE_BYTES = 256 * 2**20
DEFAULT_BLOCK = 256

_MASKED = -1e30  # as attention._MASKED: finite, a fully masked block adds exp(-1e30 - m) = 0
_PAD_POSITION = jnp.iinfo(jnp.int32).max  # padded keys sit "after" every query: never visible


def use_blockwise(batch: int, q_len: int, kv_len: int, num_heads: int) -> bool:
    """The automatic choice of attention implementation, by shape alone: blockwise for long
    key sequences (S >= BLOCKWISE_MIN_KEYS) or when the direct path's float32 scores would take
    more than BLOCKWISE_SCORE_BYTES; decoding (T = 1) stays direct."""
    if q_len == 1:
        return False
    return kv_len >= BLOCKWISE_MIN_KEYS or batch * num_heads * q_len * kv_len * 4 \
        > BLOCKWISE_SCORE_BYTES


def _mask(qp_BT, kp_BC, window, qs_BT, ks_BC):
    from llm_jax.model.attention import attention_mask  # attention.py imports this module

    return attention_mask(qp_BT, kp_BC, window, qs_BT, ks_BC)


def _blocks(x_BS, c: int, pad_value):
    """[B, S, ...] -> [J, B, C, ...], padding S up to a multiple of C with `pad_value`."""
    b, s = x_BS.shape[:2]
    j = -(-s // c)
    pad = [(0, 0), (0, j * c - s)] + [(0, 0)] * (x_BS.ndim - 2)
    x = jnp.pad(x_BS, pad, constant_values=pad_value)
    return x.reshape(b, j, c, *x_BS.shape[2:]).swapaxes(0, 1)


def _scores(q_BTKGH, k_BCKH, qp, kp, window, qs, ks):
    """Masked, scaled float32 scores of one key block: [B, K, G, T, C]."""
    h = q_BTKGH.shape[-1]
    s = jnp.einsum("BTKGH,BCKH->BKGTC", q_BTKGH, k_BCKH,
                   preferred_element_type=jnp.float32) * (h ** -0.5)
    return jnp.where(_mask(qp, kp, window, qs, ks)[:, None, None], s, _MASKED)


def _key_blocks(k, v, kp, ks, c):
    kb = _blocks(k, c, 0)
    vb = _blocks(v, c, 0)
    kpb = _blocks(kp.astype(jnp.int32), c, _PAD_POSITION)
    ksb = None if ks is None else _blocks(ks, c, 0)
    return kb, vb, kpb, ksb


def _forward(q, k, v, sinks, qp, kp, window, qs, ks, c):
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    q_BTKGH = q.reshape(b, t, kh, g, h)
    sink_BKGT = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kh, g, 1), (b, kh, g, t))

    def body(carry, xs):
        m, l, acc = carry
        kb, vb, kpb, ksb = xs
        s = _scores(q_BTKGH, kb, qp, kpb, window, qs, ksb)
        m_new = jnp.maximum(m, s.max(-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        l = l * alpha + p.sum(-1)
        pv = jnp.einsum("BKGTC,BCKH->BKGTH", p.astype(v.dtype), vb,
                        preferred_element_type=jnp.float32)
        return (m_new, l, acc * alpha[..., None] + pv), None

    init = (sink_BKGT, jnp.ones_like(sink_BKGT), jnp.zeros((b, kh, g, t, h), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(body, init, _key_blocks(k, v, kp, ks, c))
    out_BKGTH = acc / l[..., None]
    out_BTNH = out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(v.dtype)
    return out_BTNH, m + jnp.log(l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _blockwise(q, k, v, sinks, qp, kp, window, qs, ks, c):
    return _forward(q, k, v, sinks, qp, kp, window, qs, ks, c)[0]


def _blockwise_fwd(q, k, v, sinks, qp, kp, window, qs, ks, c):
    out, lse = _forward(q, k, v, sinks, qp, kp, window, qs, ks, c)
    return out, (q, k, v, sinks, qp, kp, window, qs, ks, out, lse)


def _blockwise_bwd(c, res, dout_BTNH):
    q, k, v, sinks, qp, kp, window, qs, ks, out, lse_BKGT = res
    b, t, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    g = n // kh
    scale = h ** -0.5
    q_BTKGH = q.reshape(b, t, kh, g, h)
    do_BKGTH = dout_BTNH.astype(jnp.float32).reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4)
    o_BKGTH = out.astype(jnp.float32).reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4)
    d_BKGT = jnp.sum(do_BKGTH * o_BKGTH, -1)  # rowsum(dO * O) = sum_j p_j dp_j

    def body(dq_BKGTH, xs):
        kb, vb, kpb, ksb = xs
        p = jnp.exp(_scores(q_BTKGH, kb, qp, kpb, window, qs, ksb) - lse_BKGT[..., None])
        dv = jnp.einsum("BKGTC,BKGTH->BCKH", p, do_BKGTH)
        dp = jnp.einsum("BKGTH,BCKH->BKGTC", do_BKGTH, vb.astype(jnp.float32))
        ds = p * (dp - d_BKGT[..., None]) * scale
        dq_BKGTH = dq_BKGTH + jnp.einsum("BKGTC,BCKH->BKGTH", ds, kb.astype(jnp.float32))
        dk = jnp.einsum("BKGTC,BTKGH->BCKH", ds, q_BTKGH.astype(jnp.float32))
        return dq_BKGTH, (dk, dv)

    dq, (dk_JBCKH, dv_JBCKH) = jax.lax.scan(
        body, jnp.zeros((b, kh, g, t, h), jnp.float32), _key_blocks(k, v, kp, ks, c))

    def unblock(x_JBCKH):
        return x_JBCKH.swapaxes(0, 1).reshape(b, -1, kh, h)[:, :s_len]

    # The sink is a key with value 0: dp = 0, so its score's gradient is -p_sink * D.
    p_sink = jnp.exp(sinks.astype(jnp.float32).reshape(1, kh, g, 1) - lse_BKGT)
    dsinks = -jnp.sum(p_sink * d_BKGT, axis=(0, 3)).reshape(n)
    dq = dq.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
    return (dq.astype(q.dtype), unblock(dk_JBCKH).astype(k.dtype),
            unblock(dv_JBCKH).astype(v.dtype), dsinks.astype(sinks.dtype),
            None, None, None, None, None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attend(
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    sinks_N: jax.Array,
    q_positions_BT: jax.Array,
    kv_positions_BS: jax.Array,
    window: jax.Array | int,
    q_segment_ids_BT: jax.Array | None = None,
    kv_segment_ids_BS: jax.Array | None = None,
    *,
    block: int = DEFAULT_BLOCK,
) -> jax.Array:
    """`attend(q, k, v, sinks, attention_mask(q_pos, kv_pos, window, q_seg, kv_seg))`, one key
    block of `block` keys at a time. Returns [B, T, N, H] in v's dtype."""
    if block < 1:
        raise ValueError(f"blockwise_attend block={block} is invalid: expected a positive integer")
    if kv_segment_ids_BS is not None and q_segment_ids_BT is None:
        q_segment_ids_BT = kv_segment_ids_BS  # attention_mask's convention: self-attention
    c = min(block, k_BSKH.shape[1])
    return _blockwise(q_BTNH, k_BSKH, v_BSKH, sinks_N, q_positions_BT, kv_positions_BS,
                      jnp.asarray(window, jnp.int32), q_segment_ids_BT, kv_segment_ids_BS, c)
