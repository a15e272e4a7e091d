"""Grouped-query attention with RoPE, learned sinks, causal mask and an optional sliding window.

Shapes: B batch, T query time, S key time, D hidden, N q heads, K kv heads, G = N / K q heads per
kv head, H head_dim. Query head n reads kv head n // G.

The attention function (the mask rule, the sinks) is `model/attention_math.py`; this module is
the layer around it: projections, RoPE, the KV cache and the choice of implementation.

One `Attention.__call__` serves every path: without a cache it is self-attention over the input
(training, evaluation); with a `LayerCache` and T > 1 it is a prefill (self-attention over the
prompt, whose keys and values then fill the empty cache); with T = 1 a decode step (the new key
and value are written into their slot and the query attends over the cache).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.kernels.flash_attention_gpu import flash_attend
from llm_jax.kernels.splash_attention import index_positions, splash_attend
from llm_jax.model.attention_math import attend, attend_heads_major, attention_mask
from llm_jax.model.blockwise_attention import blockwise_attend, use_blockwise
from llm_jax.model.kv_cache import LayerCache, append, fill, ring_positions
from llm_jax.model.lora import adapted
from llm_jax.model.matmul import einsum
from llm_jax.model.params import normal, param, zeros
from llm_jax.model.rope import apply_rope, rope_cos_sin
from llm_jax.model.select import attention_impl
from llm_jax.parallel.sharding import constrain
from llm_jax.runtime.backend import plan


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
        *,
        execution: ExecutionConfig = ExecutionConfig(),
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
            o = self.self_attend(q, k, v, positions_BT, window, segment_ids_BT, execution)
            if cache is not None:
                valid = positions_BT if segment_ids_BT is None else \
                    jnp.where(segment_ids_BT != 0, positions_BT, -1)
                cache = fill(cache, k, v, jnp.max(valid, axis=1))
        chex.assert_shape(o, (b, t, cfg.num_attention_heads, cfg.head_dim))
        return self.out(o), cache

    def self_attend(self, q: jax.Array, k: jax.Array, v: jax.Array, positions_BT: jax.Array,
                    window: jax.Array | int, segment_ids_BT: jax.Array | None,
                    execution: ExecutionConfig = ExecutionConfig()) -> jax.Array:
        """Self-attention by the implementation model/select.py names for this backend and
        shape, from the `ATTENTIONS` table; the mask inputs are built here, once."""
        b, t = positions_BT.shape
        mask = MaskInputs(positions_BT, positions_BT, window, segment_ids_BT, segment_ids_BT)
        impl = ATTENTIONS[attention_impl(self.cfg, execution, b, t, t)]
        return impl(q, k, v, self.sinks[...], mask, self.cfg)

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


# ---------------------------------------------------------------------------------------------
# The table: every self-attention implementation, one signature. Each computes
# `attend(q, k, v, sinks, attention_mask(*mask))` and is tested against it (tests/model,
# tests/kernels); model/select.py says which one a call runs.


class MaskInputs(NamedTuple):
    """What decides which keys a query sees (`attention_mask`'s inputs), built once per call."""

    q_positions_BT: jax.Array
    kv_positions_BS: jax.Array
    window: jax.Array | int  # 0: no window
    q_segment_ids_BT: jax.Array | None  # None: one document per row; 0 marks padding
    kv_segment_ids_BS: jax.Array | None


# (q [B,T,N,H], k, v [B,S,K,H], sinks [N], mask inputs, config) -> [B, T, N, H]
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, MaskInputs, ModelConfig],
                       jax.Array]


def _direct(q, k, v, sinks, mask: MaskInputs, cfg: ModelConfig) -> jax.Array:
    """The reference itself: the whole [B, T, S] mask and scores."""
    return attend(q, k, v, sinks, attention_mask(*mask))


def _blockwise(q, k, v, sinks, mask: MaskInputs, cfg: ModelConfig) -> jax.Array:
    """Block-sparse, memory linear in T (model/blockwise_attention.py)."""
    return blockwise_attend(q, k, v, sinks, *mask)


def _splash(q, k, v, sinks, mask: MaskInputs, cfg: ModelConfig) -> jax.Array:
    """Pallas splash on TPU (interpreted elsewhere). Exact when positions are the index (per
    segment), which is checked at run time; otherwise the plain-JAX path of this shape."""
    b, t = mask.q_positions_BT.shape
    fallback = _blockwise if use_blockwise(b, t, t, cfg.num_attention_heads) else _direct
    splash = functools.partial(splash_attend, windows=cfg.layer_windows,
                               interpret=not plan().tpu_kernels_native)
    return jax.lax.cond(index_positions(mask.q_positions_BT, mask.q_segment_ids_BT),
                        lambda q, k, v: splash(q, k, v, sinks, *mask),
                        lambda q, k, v: fallback(q, k, v, sinks, mask, cfg),
                        q, k, v)


def _flash(q, k, v, sinks, mask: MaskInputs, cfg: ModelConfig) -> jax.Array:
    """Pallas flash attention for GPU (Triton); interpreted elsewhere."""
    return flash_attend(q, k, v, sinks, *mask, interpret=not plan().triton_kernels_native)


ATTENTIONS: dict[str, AttentionFn] = {
    "direct": _direct,
    "blockwise": _blockwise,
    "splash": _splash,
    "flash": _flash,
}
