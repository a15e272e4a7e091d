"""Grouped-query attention with RoPE, learned sinks, causal mask and an optional sliding window.

Shapes: B batch, T query time, S key time, D hidden, N q heads, K kv heads, G = N / K q heads per
kv head, H head_dim. Query head n reads kv head n // G.

The sink is one learned logit per query head appended as an extra column of every score row (not
scaled by 1/sqrt(H)); the softmax runs over the row including it and the column is dropped, so
rows sum to less than 1 and a head can attend to "nothing" (gpt-oss, after Xiao et al. 2023).

One `Attention.__call__` serves every path: without a cache it is self-attention over the input
(training, evaluation); with a `LayerCache` and T > 1 it is a prefill (self-attention over the
prompt, whose keys and values then fill the empty cache); with T = 1 a decode step (the new key
and value are written into their slot and the query attends over the cache).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from llm_jax.config import ModelConfig
from llm_jax.model.blockwise_attention import blockwise_attend, use_blockwise
from llm_jax.model.kv_cache import LayerCache, append, fill, ring_positions
from llm_jax.model.lora import adapted
from llm_jax.model.matmul import einsum
from llm_jax.model.params import normal, param, zeros
from llm_jax.model.rope import apply_rope, rope_cos_sin
from llm_jax.parallel.sharding import constrain

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


class Attention(nnx.Module):
    """q/k/v/o projections (all with bias) around `attend`; the window is a per-layer input."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        init, pd = normal(cfg.initializer_range), cfg.weight_dtype
        out_init = normal(cfg.initializer_range / (2 * cfg.num_hidden_layers) ** 0.5)
        self.q_proj = param(rngs, init, (d, n, h), ("embed", "heads", "head_dim"), pd)
        self.q_bias = param(rngs, zeros, (n, h), ("heads", "head_dim"), pd)
        self.k_proj = param(rngs, init, (d, k, h), ("embed", "kv_heads", "head_dim"), pd)
        self.k_bias = param(rngs, zeros, (k, h), ("kv_heads", "head_dim"), pd)
        self.v_proj = param(rngs, init, (d, k, h), ("embed", "kv_heads", "head_dim"), pd)
        self.v_bias = param(rngs, zeros, (k, h), ("kv_heads", "head_dim"), pd)
        self.o_proj = param(rngs, out_init, (n, h, d), ("heads", "head_dim", "embed"), pd)
        self.o_bias = param(rngs, zeros, (d,), ("embed",), pd)
        self.sinks = param(rngs, zeros, (n,), ("heads",), jnp.float32)

    def qkv(self, x_BTD: jax.Array, positions_BT: jax.Array) -> tuple[jax.Array, ...]:
        """Projected q [B,T,N,H] and k, v [B,T,K,H], RoPE applied to q and k."""
        cdt = self.cfg.compute_dtype
        x = x_BTD.astype(cdt)
        q = einsum("BTD,DNH->BTNH", x, adapted(self, "q_proj", cdt), self.q_bias[...])
        k = einsum("BTD,DKH->BTKH", x, adapted(self, "k_proj", cdt), self.k_bias[...])
        v = einsum("BTD,DKH->BTKH", x, adapted(self, "v_proj", cdt), self.v_bias[...])
        cos, sin = rope_cos_sin(positions_BT, self.cfg)
        q_axes, kv_axes = ("batch", "length", "heads", "head_dim"), ("batch", "length", "kv_heads",
                                                                       "head_dim")
        return (constrain(apply_rope(q, cos, sin), q_axes),
                constrain(apply_rope(k, cos, sin), kv_axes), constrain(v, kv_axes))

    def out(self, o_BTNH: jax.Array) -> jax.Array:
        cdt = self.cfg.compute_dtype
        return einsum("BTNH,NHD->BTD", o_BTNH, adapted(self, "o_proj", cdt), self.o_bias[...])

    def __call__(
        self,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        window: jax.Array | int,
        segment_ids_BT: jax.Array | None = None,
        cache: LayerCache | None = None,
    ) -> tuple[jax.Array, LayerCache | None]:
        """(output [B, T, D], the updated cache or None). See the module docstring for the
        three modes; a prefill must start from an empty cache at positions 0..T-1."""
        cfg = self.cfg
        b, t, _ = x_BTD.shape
        chex.assert_shape(positions_BT, (b, t))
        q, k, v = self.qkv(x_BTD, positions_BT)
        if cache is not None and t == 1:
            o, cache = self.decode(q, k, v, positions_BT[:, 0], window, cache)
        else:
            o = self.self_attend(q, k, v, positions_BT, window, segment_ids_BT)
            if cache is not None:
                valid = positions_BT if segment_ids_BT is None else \
                    jnp.where(segment_ids_BT != 0, positions_BT, -1)
                cache = fill(cache, k, v, jnp.max(valid, axis=1))
        chex.assert_shape(o, (b, t, cfg.num_attention_heads, cfg.head_dim))
        return self.out(o), cache

    def self_attend(self, q: jax.Array, k: jax.Array, v: jax.Array, positions_BT: jax.Array,
                    window: jax.Array | int, segment_ids_BT: jax.Array | None) -> jax.Array:
        """The implementation kernels/select.py's table names for this backend and shape."""
        from llm_jax.kernels.select import attention_impl, backend  # imports blockwise_attention

        b, t = positions_BT.shape
        impl, sinks = attention_impl(self.cfg, b, t, t), self.sinks[...]
        args = (sinks, positions_BT, positions_BT, window, segment_ids_BT, segment_ids_BT)
        if impl == "splash":  # exact when positions are the index (per segment): checked
            from llm_jax.kernels.splash_attention import index_positions, splash_attend

            splash = functools.partial(splash_attend, windows=self.cfg.layer_windows,
                                       interpret=backend() != "tpu")
            blockwise = use_blockwise(b, t, t, self.cfg.num_attention_heads)
            return jax.lax.cond(index_positions(positions_BT, segment_ids_BT),
                                lambda q, k, v: splash(q, k, v, *args),
                                lambda q, k, v: self._xla(q, k, v, *args, blockwise=blockwise),
                                q, k, v)
        if impl == "flash":  # GPU kernel (Pallas / Triton); interpreted elsewhere
            from llm_jax.kernels.flash_attention_gpu import flash_attend

            return flash_attend(q, k, v, *args, interpret=backend() != "gpu")
        return self._xla(q, k, v, *args, blockwise=impl == "blockwise")

    @staticmethod
    def _xla(q, k, v, sinks, q_positions, kv_positions, window, q_segments, kv_segments, *,
             blockwise: bool) -> jax.Array:
        """The plain-JAX paths: blockwise (memory linear in T, for long T) or direct."""
        if blockwise:
            return blockwise_attend(q, k, v, sinks, q_positions, kv_positions, window,
                                    q_segments, kv_segments)
        mask = attention_mask(q_positions, kv_positions, window, q_segments, kv_segments)
        return attend(q, k, v, sinks, mask)

    def decode(self, q_B1NH: jax.Array, k_B1KH: jax.Array, v_B1KH: jax.Array,
               positions_B: jax.Array, window: jax.Array | int,
               cache: LayerCache) -> tuple[jax.Array, LayerCache]:
        """One new position per row: write it, then attend over every slot still visible."""
        cache = append(cache, k_B1KH[:, 0], v_B1KH[:, 0], positions_B)
        kv_positions_BS = ring_positions(positions_B, cache.slots)
        mask = attention_mask(positions_B[:, None], kv_positions_BS, window, None,
                              (kv_positions_BS >= 0).astype(jnp.int32))
        cdt = self.cfg.compute_dtype
        o = attend_heads_major(q_B1NH, cache.k.astype(cdt), cache.v.astype(cdt),
                               self.sinks[...], mask)
        return o, cache
