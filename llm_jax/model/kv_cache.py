"""The KV cache: post-RoPE keys and values of every layer, for prefill and decode.

Shapes: L layers, B batch, K kv heads, S cache slots of a layer, H head_dim, W sliding window.

Each layer has its own `LayerCache` of S slots, a ring: position p lives in slot p % S. A full
layer has S = max_len, so its slot is its position; a sliding layer keeps only the last
S = min(max_len, W) positions it can still see (what `costs.kv_cache_bytes` prices). A slot's
position is never stored: for a sequence whose newest position is q, slot s holds
q - ((q - s) mod S), or nothing if that is negative.

The layouts are those of decode attention's (B, K) batched matmuls, so a step reads the cache
in place: values [B, K, S, H] (probabilities [G T, S] x values [S, H]) and keys transposed,
[B, K, H, S] (queries [G T, H] x keys [H, S]). With keys [B, K, S, H] XLA:CPU ran the score
product as a transposed-operand matmul about 2x slower (the score op alone, batch 8).
Per-layer arrays (not one stack) let every layer be updated in place without slicing copies.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from llm_jax.config import ModelConfig
from llm_jax.parallel.sharding import fitted_spec

# Logical names of a layer cache's dimensions, mapped onto a mesh by llm_jax.parallel.sharding.RULES
# (batch on the batch axes data, fsdp, expert; kv heads on `tensor`), the same table the
# weights use.
KEY_CACHE_AXES = ("batch", "kv_heads", "head_dim", "length")
VALUE_CACHE_AXES = ("batch", "kv_heads", "length", "head_dim")


class LayerCache(NamedTuple):
    """One layer's post-RoPE keys [B, K, H, S] and values [B, K, S, H]."""

    k: jax.Array
    v: jax.Array

    @property
    def slots(self) -> int:
        return self.v.shape[2]


CACHE_AXES = LayerCache(KEY_CACHE_AXES, VALUE_CACHE_AXES)


KVCache = tuple[LayerCache, ...]  # one entry per layer


def cache_nbytes(cache: KVCache) -> int:
    return sum(int(a.size) * a.dtype.itemsize for layer in cache for a in layer)


def layer_slots(cfg: ModelConfig, layer: int, max_len: int) -> int:
    """S of layer `layer`: a sliding layer needs only its last W positions."""
    window = cfg.layer_window(layer)
    return min(max_len, window) if window > 0 else max_len


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty (zero) cache for `batch` sequences of up to `max_len` positions; `dtype`
    defaults to the compute dtype."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    k, h = cfg.num_key_value_heads, cfg.head_dim

    def empty(layer: int) -> LayerCache:
        s = layer_slots(cfg, layer, max_len)
        return LayerCache(jnp.zeros((batch, k, h, s), dtype), jnp.zeros((batch, k, s, h), dtype))

    return tuple(empty(i) for i in range(cfg.num_hidden_layers))


def cache_shardings(cache: KVCache, mesh: Mesh) -> KVCache:
    """NamedShardings of `cache`'s arrays (real or abstract) on `mesh`: CACHE_AXES through the
    sharding rules, a dimension its mesh axes do not divide left unsplit (a batch of 3 on
    data=2, an Engine pool of any number of slots)."""
    return tuple(LayerCache(*(NamedSharding(mesh, fitted_spec(a.shape, axes, mesh))
                              for a, axes in zip(layer, CACHE_AXES))) for layer in cache)


def shard_cache(cache: KVCache, mesh: Mesh | None) -> KVCache:
    """Constrains (inside jit) the cache to `cache_shardings`; a no-op without a mesh."""
    return cache if mesh is None else jax.lax.with_sharding_constraint(
        cache, cache_shardings(cache, mesh))


def ring_positions(newest_B: jax.Array, slots: int) -> jax.Array:
    """[B, slots]: the position each slot holds once positions 0..newest have been written in
    order (negative = empty): newest - ((newest - s) mod slots)."""
    s = jnp.arange(slots, dtype=jnp.int32)
    return newest_B[:, None] - (newest_B[:, None] - s) % slots


def fill(cache: LayerCache, k_BTKH: jax.Array, v_BTKH: jax.Array,
         newest_B: jax.Array) -> LayerCache:
    """The cache after a prefill wrote positions 0..newest[b] (= their index in T) of every row:
    each slot takes the newest position that maps to it."""
    rows = jnp.arange(k_BTKH.shape[0])[:, None]
    src_BS = jnp.maximum(ring_positions(newest_B, cache.slots), 0)  # empty slots: any row

    def put(x_BTKH: jax.Array, dtype, order: tuple[int, ...]) -> jax.Array:
        return jnp.transpose(x_BTKH[rows, src_BS], order).astype(dtype)  # from [B, S, K, H]

    return LayerCache(put(k_BTKH, cache.k.dtype, (0, 2, 3, 1)),
                      put(v_BTKH, cache.v.dtype, (0, 2, 1, 3)))


def append(cache: LayerCache, k_BKH: jax.Array, v_BKH: jax.Array,
           positions_B: jax.Array) -> LayerCache:
    """The cache with one new position per row written into its slot."""
    rows = jnp.arange(k_BKH.shape[0])
    slot = positions_B % cache.slots
    # In bounds by construction; saying so lets XLA update in place instead of selecting over
    # the whole array to drop out-of-bounds writes.
    k = cache.k.at[rows, :, :, slot].set(k_BKH.astype(cache.k.dtype), mode="promise_in_bounds")
    v = cache.v.at[rows, :, slot].set(v_BKH.astype(cache.v.dtype), mode="promise_in_bounds")
    return LayerCache(k, v)
