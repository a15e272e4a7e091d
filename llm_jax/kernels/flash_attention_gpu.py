"""Flash attention with learned sinks for GPU, in Pallas (Triton lowering), forward and backward.

Shapes: B batch, T query time, S key time, N q heads, K kv heads, G = N / K, H head_dim,
Q / C rows of a query / key block.

The function of `attention_math.attend` with the mask of `attention_mask` (positions, window,
segments, segment 0 = padding), computed block by block: no JAX attention library on GPU takes
trainable sinks (jax.nn.dot_product_attention has none, and its cuDNN VJP drops the logsumexp
cotangent they would need), so gpt-oss training would otherwise fall back to T x S scores.

- Forward (one program per (b, n, query block)): online softmax over key blocks (Milakov &
  Gimelshein 2018; FlashAttention, Dao et al. 2022) started from the sink: m = sink, l = 1,
  acc = 0, as if the sink were a key with value zero. Saves o and lse = m + log l.
- The mask is rebuilt from positions and segment ids inside each block, so any positions work
  (not only arange) and the window may be traced data (the scanned layers); a key block whose
  positions the whole query block cannot see (after its last query, or out of the window) is
  skipped by `cond`.
- Backward (FlashAttention-2): delta = rowsum(o . do) outside; a dq kernel per query block and a
  dk/dv kernel per key block and q head, recomputing p = exp(s - lse); dk, dv of the G q heads
  sharing a kv head are summed afterwards. d(sinks)_n = -sum exp(sink_n - lse) delta, the
  derivative of the sink's term in the normaliser.
`interpret=True` runs the kernels in Pallas' interpreter (CPU tests). The kernels name the Triton
backend (`TRITON`): Pallas' GPU default is Mosaic GPU, which cannot lower them, so without it
they would fail on every GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BLOCK = 64
_MASKED = -1e30  # finite: m starts at the (finite) sink, so exp(_MASKED - m) = 0, never NaN
# Triton, not Pallas' default Mosaic GPU backend; 4 warps and 2 stages for 64 x 64 tiles.
TRITON = pltriton.CompilerParams(num_warps=4, num_stages=2)


def flash_applies(q_len: int, kv_len: int) -> bool:
    """Whole 64-row blocks (Triton tiles are powers of two)."""
    return q_len % BLOCK == 0 and kv_len % BLOCK == 0


def _visible(qp, kp, qs, ks, window):
    """[Q, C] mask of `attention_mask` from block positions / segment ids."""
    qp, kp = qp[:, None], kp[None, :]
    v = (kp <= qp) & ((window <= 0) | (qp - kp < window))
    return v & (qs[:, None] == ks[None, :]) & (ks[None, :] != 0)


def _may_see(qp, kp, window):
    """Whether any query of the block can see any key of the block (by position)."""
    early = jnp.min(kp) <= jnp.max(qp)
    near = (window <= 0) | (jnp.min(qp) - jnp.max(kp) < window)
    return early & near


def _dot_t(a, b):
    """a @ b.T in float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _fwd_kernel(win_ref, sink_ref, q_ref, k_ref, v_ref, qp_ref, kp_ref, qs_ref, ks_ref,
                o_ref, lse_ref, *, block_k: int, scale: float):
    q = q_ref[...]
    qp, qs = qp_ref[...], qs_ref[...]
    window = win_ref[0]
    bq = q.shape[0]
    m0 = jnp.zeros((bq,), jnp.float32) + sink_ref[0].astype(jnp.float32)
    carry = (m0, jnp.ones((bq,), jnp.float32), jnp.zeros((bq, v_ref.shape[-1]), jnp.float32))

    def body(j, carry):
        sl = pl.ds(j * block_k, block_k)
        kp = kp_ref[sl]

        def step(carry):
            m, l, acc = carry
            k, v, ks = k_ref[sl, :], v_ref[sl, :], ks_ref[sl]
            s = _dot_t(q, k) * scale
            s = jnp.where(_visible(qp, kp, qs, ks, window), s, _MASKED)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[:, None])
            acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v,
                                                 preferred_element_type=jnp.float32)
            return m_new, l * alpha + jnp.sum(p, axis=1), acc

        return jax.lax.cond(_may_see(qp, kp, window), step, lambda c: c, carry)

    m, l, acc = jax.lax.fori_loop(0, k_ref.shape[0] // block_k, body, carry)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dq_kernel(win_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, qs_ref,
               ks_ref, dq_ref, *, block_k: int, scale: float):
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    qp, qs = qp_ref[...], qs_ref[...]
    window = win_ref[0]

    def body(j, dq):
        sl = pl.ds(j * block_k, block_k)
        kp = kp_ref[sl]

        def step(dq):
            k, v, ks = k_ref[sl, :], v_ref[sl, :], ks_ref[sl]
            s = jnp.where(_visible(qp, kp, qs, ks, window), _dot_t(q, k) * scale, _MASKED)
            p = jnp.exp(s - lse[:, None])
            ds = p * (_dot_t(do, v) - delta[:, None])
            return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

        return jax.lax.cond(_may_see(qp, kp, window), step, lambda d: d, dq)

    dq = jax.lax.fori_loop(0, k_ref.shape[0] // block_k, body,
                           jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(win_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, qs_ref,
                ks_ref, dk_ref, dv_ref, *, block_q: int, scale: float):
    k, v = k_ref[...], v_ref[...]
    kp, ks = kp_ref[...], ks_ref[...]
    window = win_ref[0]

    def body(i, carry):
        sl = pl.ds(i * block_q, block_q)
        qp = qp_ref[sl]

        def step(carry):
            dk, dv = carry
            q, do, qs = q_ref[sl, :], do_ref[sl, :], qs_ref[sl]
            lse, delta = lse_ref[sl], delta_ref[sl]
            s = jnp.where(_visible(qp, kp, qs, ks, window), _dot_t(q, k) * scale, _MASKED)
            p = jnp.exp(s - lse[:, None])  # [Q, C]
            dv = dv + jax.lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)
            ds = p * (_dot_t(do, v) - delta[:, None])
            dk = dk + jax.lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)
            return dk, dv

        return jax.lax.cond(_may_see(qp, kp, window), step, lambda c: c, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, q_ref.shape[0] // block_q, body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(b_, n, t, s, h, g, bq, bk, by_q: bool):
    """BlockSpecs for a grid (B, N, blocks): by_q tiles queries (forward, dq), else keys (dkv)."""
    row = (lambda b, i, j: (b, i, j, 0)) if by_q else (lambda b, i, j: (b, i, 0, 0))
    col = (lambda b, i, j: (b, i // g, 0, 0)) if by_q else (lambda b, i, j: (b, i // g, j, 0))
    qt, kt = (bq, t) if by_q else (t, t)
    q_spec = pl.BlockSpec((None, None, bq if by_q else t, h), row)
    k_spec = pl.BlockSpec((None, None, s if by_q else bk, h), col)
    t_spec = pl.BlockSpec((None, bq if by_q else t), (lambda b, i, j: (b, j)) if by_q
                          else (lambda b, i, j: (b, 0)))
    s_spec = pl.BlockSpec((None, s if by_q else bk), (lambda b, i, j: (b, 0)) if by_q
                          else (lambda b, i, j: (b, j)))
    r_spec = pl.BlockSpec((None, None, bq if by_q else t), (lambda b, i, j: (b, i, j)) if by_q
                          else (lambda b, i, j: (b, i, 0)))
    del qt, kt, b_, n
    return q_spec, k_spec, t_spec, s_spec, r_spec


_WIN = pl.BlockSpec((1,), lambda b, i, j: (0,))


def _forward(q, k, v, sinks, qp, kp, qs, ks, window, bq, bk, interpret):
    b, n, t, h = q.shape
    s, g = k.shape[2], n // k.shape[1]
    q_spec, k_spec, t_spec, s_spec, r_spec = _specs(b, n, t, s, h, g, bq, bk, True)
    sink_spec = pl.BlockSpec((None, 1), lambda b, i, j: (i, 0))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, block_k=bk, scale=h ** -0.5),
        grid=(b, n, t // bq),
        in_specs=[_WIN, sink_spec, q_spec, k_spec, k_spec, t_spec, s_spec, t_spec, s_spec],
        out_specs=[q_spec, r_spec],
        out_shape=[jax.ShapeDtypeStruct(q.shape, v.dtype),
                   jax.ShapeDtypeStruct((b, n, t), jnp.float32)],
        interpret=interpret, name="flash_sinks_fwd", compiler_params=TRITON,
    )(window, sinks[:, None].astype(jnp.float32), q, k, v, qp, kp, qs, ks)


def _backward(q, k, v, qp, kp, qs, ks, window, o, lse, do, bq, bk, interpret):
    b, n, t, h = q.shape
    kh, s = k.shape[1], k.shape[2]
    g = n // kh
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, N, T]
    args = (window, q, k, v, do, lse, delta, qp, kp, qs, ks)
    q_spec, k_spec, t_spec, s_spec, r_spec = _specs(b, n, t, s, h, g, bq, bk, True)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, block_k=bk, scale=h ** -0.5),
        grid=(b, n, t // bq),
        in_specs=[_WIN, q_spec, k_spec, k_spec, q_spec, r_spec, r_spec, t_spec, s_spec, t_spec,
                  s_spec],
        out_specs=q_spec, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret, name="flash_sinks_dq", compiler_params=TRITON,
    )(*args)
    q_spec, k_spec, t_spec, s_spec, r_spec = _specs(b, n, t, s, h, g, bq, bk, False)
    per_head = pl.BlockSpec((None, None, bk, h), lambda b, i, j: (b, i, j, 0))
    dk_n, dv_n = pl.pallas_call(
        functools.partial(_dkv_kernel, block_q=bq, scale=h ** -0.5),
        grid=(b, n, s // bk),
        in_specs=[_WIN, q_spec, k_spec, k_spec, q_spec, r_spec, r_spec, t_spec, s_spec, t_spec,
                  s_spec],
        out_specs=[per_head, per_head],
        out_shape=[jax.ShapeDtypeStruct((b, n, s, h), jnp.float32)] * 2,
        interpret=interpret, name="flash_sinks_dkv", compiler_params=TRITON,
    )(*args)
    dk = dk_n.reshape(b, kh, g, s, h).sum(2).astype(k.dtype)
    dv = dv_n.reshape(b, kh, g, s, h).sum(2).astype(v.dtype)
    return dq, dk, dv, delta


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11))
def _flash(q, k, v, sinks, qp, kp, qs, ks, window, bq, bk, interpret):
    return _forward(q, k, v, sinks, qp, kp, qs, ks, window, bq, bk, interpret)[0]


def _flash_fwd(q, k, v, sinks, qp, kp, qs, ks, window, bq, bk, interpret):
    o, lse = _forward(q, k, v, sinks, qp, kp, qs, ks, window, bq, bk, interpret)
    return o, (q, k, v, sinks, qp, kp, qs, ks, window, o, lse)


def _flash_bwd(bq, bk, interpret, res, do):
    q, k, v, sinks, qp, kp, qs, ks, window, o, lse = res
    dq, dk, dv, delta = _backward(q, k, v, qp, kp, qs, ks, window, o, lse, do, bq, bk, interpret)
    p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)  # [B, N, T]
    dsinks = -jnp.sum(p_sink * delta, axis=(0, 2)).astype(sinks.dtype)
    return dq, dk, dv, dsinks, None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attend(
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
    block_q: int = BLOCK,
    block_k: int = BLOCK,
    interpret: bool = False,
) -> jax.Array:
    """`attend(q, k, v, sinks, attention_mask(positions, window, segments))`, [B, T, N, H].
    T and S must be multiples of the block sizes (powers of two for Triton)."""
    b, t, n, h = q_BTNH.shape
    s = k_BSKH.shape[1]
    bq, bk = min(block_q, t), min(block_k, s)
    if t % bq or s % bk:
        raise ValueError(f"flash attention: T={t} and S={s} must be multiples of the blocks "
                         f"block_q={bq}, block_k={bk}")
    if kv_segment_ids_BS is None:
        ks = jnp.ones((b, s), jnp.int32)
        qs = jnp.ones((b, t), jnp.int32)
    else:
        ks = kv_segment_ids_BS.astype(jnp.int32)
        qs = ks if q_segment_ids_BT is None else q_segment_ids_BT.astype(jnp.int32)
    w = jnp.reshape(jnp.asarray(window, jnp.int32), (1,))
    o = _flash(jnp.swapaxes(q_BTNH, 1, 2), jnp.swapaxes(k_BSKH, 1, 2), jnp.swapaxes(v_BSKH, 1, 2),
               sinks_N, q_positions_BT.astype(jnp.int32), kv_positions_BS.astype(jnp.int32),
               qs, ks, w, bq, bk, interpret)
    return jnp.swapaxes(o, 1, 2)
