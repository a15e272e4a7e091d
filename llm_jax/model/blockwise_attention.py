"""Block-sparse attention with sinks: the same function as `attention_math.attend`, memory linear
in T, work proportional to the visible (query block, key block) pairs.

Shapes: B batch, T query time, S key time, N q heads, K kv heads, G = N / K, H head_dim,
Q queries per query block, C keys per key block, I = T / Q query blocks, J = S / C key blocks.

Queries and keys are both tiled (FlashAttention, Dao et al. 2022; FlashAttention-2, Dao 2023).
Before any arithmetic, `block_visibility` bounds every block by the min and max of its valid
positions and segment ids and marks the pairs (i, j) that may hold a visible (query, key) pair;
a pair is skipped only when the bounds prove that none is. Each query block's visible key blocks
are listed in order, and an outer scan over query blocks runs an inner loop over only that
list, so a causal layer does about half the pairs and a sliding-window layer about
(W + Q) / C key blocks per query block whatever T is. Inside a pair the exact mask
(`attention_mask`) is applied, so the result does not depend on how tight the bounds are.

Forward: per query row a running max m, normaliser l and weighted sum acc (online softmax:
Milakov & Gimelshein 2018). The sink logit is folded in before the first block as a key with
value zero: m starts at the sink, l at exp(sink - m) = 1. The backward pass (custom_vjp) walks the
same pairs once, recomputing each pair's probabilities from the saved log-normaliser
lse = m + log l; dq is carried per query block, and dk, dv are added into [J, ...] buffers
carried through both loops, so nothing T x S is saved or built.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from llm_jax.model.attention_math import attention_mask

# Below this many keys (at most four key blocks) the direct path (one T x S einsum) is as fast;
# from here on the blockwise one is faster, causal or not (`python -m llm_jax.bench attention`).
BLOCKWISE_MIN_KEYS = 256
# ... and above this many bytes of float32 scores (B N T S x 4) the shape rule picks blockwise.
BLOCKWISE_SCORE_BYTES = 256 * 2**20
# Block sizes: large enough that each block matmul runs near the machine's matmul rate, small
# enough that a window's edges and the causal diagonal waste few masked scores and that one
# block pair's [B, K, G Q, C] scores stay in cache (measured on XLA:CPU).
DEFAULT_BLOCK = 64  # keys per key block (C)
DEFAULT_Q_BLOCK = 128  # queries per query block (Q)

_MASKED = -1e30  # as in attention_math: finite, a fully masked block adds exp(-1e30 - m) = 0
_INT_MAX = jnp.iinfo(jnp.int32).max
_INT_MIN = jnp.iinfo(jnp.int32).min


def use_blockwise(batch: int, q_len: int, kv_len: int, num_heads: int) -> bool:
    """The automatic choice of attention implementation, by shape alone: blockwise for long
    key sequences (S >= BLOCKWISE_MIN_KEYS) or when the direct path's float32 scores would take
    more than BLOCKWISE_SCORE_BYTES; decoding (T = 1) stays direct."""
    if q_len == 1:
        return False
    return kv_len >= BLOCKWISE_MIN_KEYS or batch * num_heads * q_len * kv_len * 4 \
        > BLOCKWISE_SCORE_BYTES


def _blocks(x_BT, c: int, pad_value) -> jax.Array:
    """[B, T, ...] -> [J, B, C, ...], padding T up to a multiple of C with `pad_value`."""
    b, t = x_BT.shape[:2]
    j = -(-t // c)
    pad = [(0, 0), (0, j * c - t)] + [(0, 0)] * (x_BT.ndim - 2)
    x = jnp.pad(x_BT, pad, constant_values=pad_value)
    return x.reshape(b, j, c, *x_BT.shape[2:]).swapaxes(0, 1)


def _head_blocks(x_BTKGH, c: int) -> jax.Array:
    """[B, T, K, G, H] -> [J, B, K, G, C, H]: one contiguous (G C, H) matrix per (block, B, K)."""
    return _blocks(x_BTKGH, c, 0).transpose(0, 1, 3, 4, 2, 5)


def _unblock(x_JBKGCH, t: int) -> jax.Array:
    """Inverse of `_head_blocks`, merging K G into N: [B, T, N, H]."""
    j, b, kh, g, c, h = x_JBKGCH.shape
    return x_JBKGCH.transpose(1, 0, 4, 2, 3, 5).reshape(b, j * c, kh * g, h)[:, :t]


def _query_segments(qs_BT, ks_BS):
    """The query segment ids `attention_mask` uses: none without key segment ids, the keys'
    (self-attention) when only those are given."""
    if ks_BS is None:
        return None
    return ks_BS if qs_BT is None else qs_BT


def _bounds(pos_BT, seg_BT, c: int):
    """Per block [J, B]: whether it has a valid row, and the min/max of the valid rows' positions
    and segment ids. Valid = a real row (not block padding) of a nonzero segment."""
    valid_BT = jnp.ones(pos_BT.shape, bool) if seg_BT is None else seg_BT != 0
    valid_JBC = _blocks(valid_BT, c, False)
    any_JB = valid_JBC.any(-1)

    def lo_hi(x_BT):
        x_JBC = _blocks(x_BT.astype(jnp.int32), c, 0)
        return (jnp.where(valid_JBC, x_JBC, _INT_MAX).min(-1),
                jnp.where(valid_JBC, x_JBC, _INT_MIN).max(-1))

    return any_JB, lo_hi(pos_BT), None if seg_BT is None else lo_hi(seg_BT)


def block_visibility(
    q_positions_BT: jax.Array,
    kv_positions_BS: jax.Array,
    window: jax.Array | int,
    q_segment_ids_BT: jax.Array | None = None,
    kv_segment_ids_BS: jax.Array | None = None,
    *,
    q_block: int = DEFAULT_Q_BLOCK,
    block: int = DEFAULT_BLOCK,
) -> jax.Array:
    """Boolean [I, J]: False only where no query of block i can see any key of block j in any
    batch row (`attention_mask`'s rule applied to each block's bounds). These are the pairs
    `blockwise_attend` visits; its `visited_pairs` is their count."""
    q_segment_ids_BT = _query_segments(q_segment_ids_BT, kv_segment_ids_BS)
    q_any, (qp_lo, qp_hi), qs = _bounds(q_positions_BT, q_segment_ids_BT, q_block)
    k_any, (kp_lo, kp_hi), ks = _bounds(kv_positions_BS, kv_segment_ids_BS, block)
    q = lambda x: x[:, None]  # noqa: E731  [I, B] -> [I, 1, B]
    window = jnp.asarray(window, jnp.int32)
    vis_IJB = q(q_any) & k_any & (kp_lo <= q(qp_hi)) & ((window <= 0) | (q(qp_lo) - kp_hi < window))
    if ks is not None:
        vis_IJB &= (ks[0] <= q(qs[1])) & (q(qs[0]) <= ks[1])
    return vis_IJB.any(-1)


def visited_pairs(*args, **kwargs) -> jax.Array:
    """How many (query block, key block) pairs `blockwise_attend` computes for these inputs
    (the arguments of `block_visibility`)."""
    return block_visibility(*args, **kwargs).sum()


def _visit_lists(vis_IJ):
    """Per query block the indices of its visible key blocks, ascending and first in the row,
    and how many there are: [I, J] int32, [I] int32."""
    order_IJ = jnp.argsort(~vis_IJ, axis=-1, stable=True).astype(jnp.int32)
    return order_IJ, vis_IJ.sum(-1).astype(jnp.int32)


def _pair_mask(qp_BQ, kp_BC, window, qs_BQ, ks_BC, *, keys_first: bool = False):
    """`attention_mask` of one block pair shaped to broadcast against [B, K, G, Q, C] scores,
    [B, 1, 1, Q, C], or against keys-first [B, K, C, G, Q] ones, [B, 1, C, 1, Q]. (Broadcast
    into a merged G Q minor axis, XLA:CPU's fusion computes the mask's index element by element
    and does not vectorise.)"""
    m_BQC = attention_mask(qp_BQ, kp_BC, window, qs_BQ, ks_BC)
    return m_BQC.swapaxes(1, 2)[:, None, :, None] if keys_first else m_BQC[:, None, None]


def _query_blocks(x_BTNH, kh: int, cq: int) -> jax.Array:
    """[B, T, N, H] -> [I, B, K, R, H], R = G Q rows per (query block, kv head)."""
    b, t, n, h = x_BTNH.shape
    x = _head_blocks(x_BTNH.reshape(b, t, kh, n // kh, h), cq)
    return x.reshape(*x.shape[:3], -1, h)


def _layout(q, k, v, qp, kp, qs, ks, cq, ck):
    """Blocked operands: q [I, B, K, R, H]; k, v [J, B, K, C, H] and k transposed
    [J, B, K, H, C], so that every block matmul is a plain (M, K) x (K, N) product (XLA:CPU
    transposes an operand of the other forms inside the loop); positions [I, B, Q] and [J, B, C]
    (padding queries see nothing, padding keys are seen by nothing); segment ids with padding 0
    (or None)."""
    k_J, v_J = (_head_blocks(x[:, :, :, None], ck)[:, :, :, 0] for x in (k, v))
    blocks = lambda x, c, pad: None if x is None else _blocks(x, c, pad)  # noqa: E731
    return (_query_blocks(q, k.shape[2], cq), k_J, k_J.swapaxes(-1, -2), v_J,
            blocks(qp.astype(jnp.int32), cq, _INT_MIN), blocks(kp.astype(jnp.int32), ck, _INT_MAX),
            blocks(qs, cq, 0), blocks(ks, ck, 0))


def _rows_to_heads(x_IBKR, g: int) -> jax.Array:
    """[I, B, K, G Q, ...] -> [I, B, K, G, Q, ...]."""
    return x_IBKR.reshape(*x_IBKR.shape[:3], g, -1, *x_IBKR.shape[4:])


def _forward(q, k, v, sinks, qp, kp, window, qs, ks, cq, ck):
    """Output [B, T, N, H] and what the backward pass needs: the output and log-normaliser in
    blocks, [I, B, K, R, H] and [I, B, K, R], and the visit lists."""
    q_I, _, kt_J, v_J, qp_I, kp_J, qs_I, ks_J = _layout(q, k, v, qp, kp, qs, ks, cq, ck)
    _, b, kh, r, h = q_I.shape
    g = r // cq
    order_IJ, count_I = _visit_lists(block_visibility(qp, kp, window, qs, ks, q_block=cq,
                                                      block=ck))
    sink_BKR = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kh, g, 1),
                                (b, kh, g, cq)).reshape(b, kh, r)

    def query_block(_, xs):
        q_BKRH, qp_BQ, qs_BQ, order_J, count = xs

        def key_block(step, carry):
            m, l, acc = carry
            j = order_J[step]
            s = jnp.einsum("BKRH,BKHC->BKRC", q_BKRH, kt_J[j],
                           preferred_element_type=jnp.float32) * (h ** -0.5)
            mask = _pair_mask(qp_BQ, kp_J[j], window, qs_BQ, None if ks_J is None else ks_J[j])
            s = jnp.where(mask, s.reshape(b, kh, g, cq, -1), _MASKED).reshape(s.shape)
            m_new = jnp.maximum(m, s.max(-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            pv = jnp.einsum("BKRC,BKCH->BKRH", p.astype(v.dtype), v_J[j],
                            preferred_element_type=jnp.float32)
            return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv

        init = (sink_BKR, jnp.ones_like(sink_BKR), jnp.zeros((b, kh, r, h), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, count, key_block, init)
        return None, ((acc / l[..., None]).astype(v.dtype), m + jnp.log(l))

    _, (out_I, lse_I) = jax.lax.scan(query_block, None, (q_I, qp_I, qs_I, order_IJ, count_I))
    return _unblock(_rows_to_heads(out_I, g), q.shape[1]), (out_I, lse_I, order_IJ, count_I)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10))
def _blockwise(q, k, v, sinks, qp, kp, window, qs, ks, cq, ck):
    return _forward(q, k, v, sinks, qp, kp, window, qs, ks, cq, ck)[0]


def _blockwise_fwd(q, k, v, sinks, qp, kp, window, qs, ks, cq, ck):
    out, saved = _forward(q, k, v, sinks, qp, kp, window, qs, ks, cq, ck)
    return out, (q, k, v, sinks, qp, kp, window, qs, ks, *saved)


def _blockwise_bwd(cq, ck, res, dout_BTNH):
    """One pass over the visited pairs with every block keys-first, [C, R]: then each of the
    five matmuls is a plain (M, K) x (K, N) product with no transpose inside the loop (q and
    dO are transposed once per query block)."""
    q, k, v, sinks, qp, kp, window, qs, ks, out_I, lse_I, order_IJ, count_I = res
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    q_I, k_J, kt_J, v_J, qp_I, kp_J, qs_I, ks_J = _layout(f32(q), f32(k), f32(v), qp, kp, qs, ks,
                                                          cq, ck)
    _, b, kh, r, h = q_I.shape
    g = r // cq
    scale = h ** -0.5
    do_I = _query_blocks(f32(dout_BTNH), kh, cq)
    d_I = jnp.sum(do_I * f32(out_I), -1)  # rowsum(dO * O) = sum_j p_j dp_j: [I, B, K, R]

    def query_block(dkv, xs):
        q_BKRH, do_BKRH, lse_BKGQ, d_BKGQ, qp_BQ, qs_BQ, order_J, count = xs
        qt_BKHR, dot_BKHR = q_BKRH.swapaxes(-1, -2), do_BKRH.swapaxes(-1, -2)

        def key_block(step, carry):
            dqt, dk_J, dv_J = carry
            j = order_J[step]
            heads = lambda x: x.reshape(b, kh, ck, g, cq)  # noqa: E731  [B, K, C, G, Q]
            st = heads(jnp.einsum("BKCH,BKHR->BKCR", k_J[j], qt_BKHR) * scale)
            mask = _pair_mask(qp_BQ, kp_J[j], window, qs_BQ, None if ks_J is None else ks_J[j],
                              keys_first=True)
            pt = jnp.exp(jnp.where(mask, st, _MASKED) - lse_BKGQ[:, :, None])
            dpt = heads(jnp.einsum("BKCH,BKHR->BKCR", v_J[j], dot_BKHR))
            dst = (pt * (dpt - d_BKGQ[:, :, None]) * scale).reshape(b, kh, ck, r)
            pt = pt.reshape(dst.shape)
            dqt = dqt + jnp.einsum("BKHC,BKCR->BKHR", kt_J[j], dst)
            dk_J = dk_J.at[j].add(jnp.einsum("BKCR,BKRH->BKCH", dst, q_BKRH))
            dv_J = dv_J.at[j].add(jnp.einsum("BKCR,BKRH->BKCH", pt, do_BKRH))
            return dqt, dk_J, dv_J

        dqt, *dkv = jax.lax.fori_loop(0, count, key_block, (jnp.zeros_like(qt_BKHR), *dkv))
        return tuple(dkv), dqt.swapaxes(-1, -2)

    lse_I, d_I = _rows_to_heads(lse_I, g), _rows_to_heads(d_I, g)  # [I, B, K, G, Q]
    (dk_J, dv_J), dq_I = jax.lax.scan(
        query_block, (jnp.zeros_like(k_J), jnp.zeros_like(v_J)),
        (q_I, do_I, lse_I, d_I, qp_I, qs_I, order_IJ, count_I))

    def unblock_kv(x_JBKCH):
        return _unblock(x_JBKCH[:, :, :, None], k.shape[1])

    # The sink is a key with value 0: dp = 0, so its score's gradient is -p_sink * D.
    p_sink_I = jnp.exp(f32(sinks).reshape(1, 1, kh, g, 1) - lse_I)
    dsinks = -jnp.sum(p_sink_I * d_I, axis=(0, 1, 4)).reshape(kh * g)
    return (_unblock(_rows_to_heads(dq_I, g), q.shape[1]).astype(q.dtype),
            unblock_kv(dk_J).astype(k.dtype), unblock_kv(dv_J).astype(v.dtype),
            dsinks.astype(sinks.dtype), None, None, None, None, None)


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
    q_block: int = DEFAULT_Q_BLOCK,
) -> jax.Array:
    """`attend(q, k, v, sinks, attention_mask(q_pos, kv_pos, window, q_seg, kv_seg))`, computed
    over only the (q_block queries) x (block keys) tiles that can hold a visible pair.
    Returns [B, T, N, H] in v's dtype."""
    for name, size in (("block", block), ("q_block", q_block)):
        if size < 1:
            raise ValueError(f"blockwise_attend {name}={size} is invalid: expected a positive "
                             "integer")
    q_segment_ids_BT = _query_segments(q_segment_ids_BT, kv_segment_ids_BS)
    cq, ck = min(q_block, q_BTNH.shape[1]), min(block, k_BSKH.shape[1])
    return _blockwise(q_BTNH, k_BSKH, v_BSKH, sinks_N, q_positions_BT, kv_positions_BS,
                      jnp.asarray(window, jnp.int32), q_segment_ids_BT, kv_segment_ids_BS, cq, ck)
