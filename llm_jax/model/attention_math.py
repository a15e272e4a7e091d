"""The attention function itself, every implementation's reference: which keys a query sees
(`attention_mask`) and softmax attention with sinks over them (`attend`), in plain JAX.

Shapes: B batch, T query time, S key time, N q heads, K kv heads, G = N / K q heads per kv head,
H head_dim. Query head n reads kv head n // G.

The sink is one learned logit per query head appended as an extra column of every score row (not
scaled by 1/sqrt(H)); the softmax runs over the row including it and the column is dropped, so
rows sum to less than 1 and a head can attend to "nothing" (gpt-oss, after Xiao et al. 2023).
The layer (`model/attention.py`) and every other implementation (`model/blockwise_attention.py`,
the attention kernels of `kernels/`) compute this function and are tested against it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llm_jax.model.matmul import einsum

_MASKED = -1e30  # finite, so a row with every key masked still has its sink and no NaN


def attention_mask(
    q_positions_BT: jax.Array,
    kv_positions_BS: jax.Array,
    window: jax.Array | int,
    q_segment_ids_BT: jax.Array | None = None,
    kv_segment_ids_BS: jax.Array | None = None,
) -> jax.Array:
    """Boolean [B, T, S]: key j is visible to query i iff pos_j <= pos_i, within the window
    (pos_i - pos_j < window, when window > 0) and in the same segment (segment 0 = padding)."""
    qp = q_positions_BT[:, :, None]
    kp = kv_positions_BS[:, None, :]
    visible = kp <= qp
    window = jnp.asarray(window)
    visible &= (window <= 0) | (qp - kp < window)
    if kv_segment_ids_BS is not None:
        ks = kv_segment_ids_BS[:, None, :]
        qs = ks if q_segment_ids_BT is None else q_segment_ids_BT[:, :, None]
        visible &= (qs == ks) & (ks != 0)
    return visible


def attend(
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    sinks_N: jax.Array,
    mask_BTS: jax.Array,
) -> jax.Array:
    """Softmax attention with sinks; scores and softmax in float32. Returns [B, T, N, H]."""
    return attend_heads_major(q_BTNH, jnp.transpose(k_BSKH, (0, 2, 3, 1)),
                              jnp.swapaxes(v_BSKH, 1, 2), sinks_N, mask_BTS)


def attend_heads_major(
    q_BTNH: jax.Array,
    k_BKHS: jax.Array,
    v_BKSH: jax.Array,
    sinks_N: jax.Array,
    mask_BTS: jax.Array,
) -> jax.Array:
    """`attend` with keys [B, K, H, S] and values [B, K, S, H], the KV cache's layouts: (B, K)
    batches of a (G T, H) x (H, S) and a (G T, S) x (S, H) matmul, the plain layout XLA:CPU's
    fast kernels take. Asking for [B, T, K, G] outputs directly made it contract over non-minor
    axes in a slow generic dot (3.7x slower for a decode step's probabilities x values)."""
    b, t, n, h = q_BTNH.shape
    k_heads = k_BKHS.shape[1]
    g = n // k_heads
    q_BKGTH = jnp.transpose(q_BTNH.reshape(b, t, k_heads, g, h), (0, 2, 3, 1, 4))
    scores_BKGTS = einsum(
        "BKGTH,BKHS->BKGTS", q_BKGTH, k_BKHS, preferred_element_type=jnp.float32
    ) * (h ** -0.5)
    scores_BKGTS = jnp.where(mask_BTS[:, None, None], scores_BKGTS, _MASKED)
    # softmax over [scores, sink] without materialising the concatenated row: the sink only
    # enters the max and the normaliser.
    sink_BKGT1 = sinks_N.astype(jnp.float32).reshape(1, k_heads, g, 1, 1)
    row_max = jax.lax.stop_gradient(jnp.maximum(scores_BKGTS.max(-1, keepdims=True), sink_BKGT1))
    e = jnp.exp(scores_BKGTS - row_max)
    probs = e / (e.sum(-1, keepdims=True) + jnp.exp(sink_BKGT1 - row_max))
    out_BKGTH = einsum("BKGTS,BKSH->BKGTH", probs.astype(v_BKSH.dtype), v_BKSH)
    return jnp.transpose(out_BKGTH, (0, 3, 1, 2, 4)).reshape(b, t, n, h)
