"""The KV cache and the cached forward pass: prefill a batch of prompts, then one token at a time.

Shapes: B batch, P prompt time (padded), S cache slots, D hidden, N q heads, K kv heads,
H head_dim, V vocab, Ls / Lf sliding / full layers, W sliding window.

The cache holds post-RoPE keys and values (GPT_OSS_SPEC.md, "Generation with a KV cache"), in two
stacks so that sliding layers really hold only min(S, W) slots (what `describe.kv_cache_bytes`
prices): `k_full` [Lf, B, K, S, H] with slot == position, and `k_sliding` [Ls, B, K, min(S, W), H],
a ring buffer where position p lives in slot p % W. Slots come after kv heads so that a layer's
[B, K, S, H] slice is already the layout of the batched (B, K) matmuls of decode attention:
with [B, S, K, H], XLA:CPU copied each layer's whole cache into that layout on every decode step
(2 ms of a 10 ms step at batch 8). A slot's position is never stored: for a query
at position q every slot s holds q - ((q - s) mod W), or nothing if that is negative.

Prompts are right-padded; every sequence has its own positions 0..len-1 and its own write
position while decoding. The layers run as one `lax.scan` over groups of one period of the layer
pattern (sliding, full) with a leftover sliding layer after it when L is odd, so the scan step
can index each stack with the group number.

MoE in generation is always dropless, so a sequence's tokens never depend on the rest of the
batch: with few tokens (decode) each token gathers its k experts' weights; otherwise the
configured dispatch, where "capacity" becomes the block-sparse `moe_blocked`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from llm_jax.config import ModelConfig
from llm_jax.model.attention import attend, attention_mask
from llm_jax.model.moe import (
    ExpertWeights, Routing, moe_dense, moe_ragged, route, swiglu,
)
from llm_jax.sharding import logical_to_spec

# Logical names of every cache array's dimensions, mapped onto a mesh by llm_jax.sharding.RULES
# (batch on the data axes, kv heads on `tensor`), the same table the weights use.
CACHE_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")


class KVCache(NamedTuple):
    """Post-RoPE keys and values of every layer, one stack per layer kind."""

    k_sliding: jax.Array  # [Ls, B, K, min(S, W), H] ring buffer
    v_sliding: jax.Array
    k_full: jax.Array  # [Lf, B, K, S, H], slot = position
    v_full: jax.Array

    @property
    def nbytes(self) -> int:
        return sum(int(a.size) * a.dtype.itemsize for a in self)


def cache_shapes(cfg: ModelConfig, batch: int, max_len: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the four cache arrays for `batch` sequences of up to `max_len` positions."""
    windows = cfg.layer_windows
    n_sliding = sum(w > 0 for w in windows)
    k, h = cfg.num_key_value_heads, cfg.head_dim
    ring = min(max_len, cfg.sliding_window) if n_sliding else 0
    sliding = (n_sliding, batch, k, ring, h)
    full = (len(windows) - n_sliding, batch, k, max_len, h)
    return {"k_sliding": sliding, "v_sliding": sliding, "k_full": full, "v_full": full}


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty (zero) cache; `dtype` defaults to the compute dtype."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    return KVCache(**{n: jnp.zeros(s, dtype) for n, s in cache_shapes(cfg, batch, max_len).items()})


def cache_shardings(mesh: Mesh, rules=None) -> KVCache:
    """NamedShardings of the cache arrays on `mesh`, from CACHE_AXES and the sharding rules."""
    spec = logical_to_spec(CACHE_AXES) if rules is None else logical_to_spec(CACHE_AXES, rules)
    return KVCache(*(NamedSharding(mesh, spec),) * 4)


def shard_cache(cache: KVCache, mesh: Mesh | None) -> KVCache:
    """Constrains (inside jit) the cache to its logical sharding; a no-op without a mesh."""
    if mesh is None:
        return cache
    return KVCache(*(jax.lax.with_sharding_constraint(a, s)
                     for a, s in zip(cache, cache_shardings(mesh))))


# ---------------------------------------------------------------------------------------------
# Dropless MoE.


def moe_gather(x_TD: jax.Array, routing: Routing, w: ExpertWeights, limit: float) -> jax.Array:
    """Each token multiplies by its own k experts' gathered weights: T k expert reads, no drops.
    The cheapest path when T k <= E (decoding a small batch)."""
    e_Tk = routing.experts_Tk
    h = jnp.einsum("TD,TkDF->TkF", x_TD, w.gate_up_EDF2[e_Tk]) + w.gate_up_bias_EF2[e_Tk]
    y = jnp.einsum("TkF,TkFD->TkD", swiglu(h, limit), w.down_EFD[e_Tk]) + w.down_bias_ED[e_Tk]
    return jnp.einsum("TkD,Tk->TD", y, routing.weights_Tk.astype(y.dtype))


def moe_blocked(x_TD: jax.Array, routing: Routing, w: ExpertWeights, limit: float) -> jax.Array:
    """Dropless block-sparse dispatch (after MegaBlocks, Gale et al. 2022) for CPUs, where
    `ragged_dot` costs as much as running every expert: assignments sorted by expert, each
    expert's run padded to a multiple of `block` rows, then one small matmul per block with its
    expert's weights. Blocks: ceil(A / block) + E is a static bound on sum_e ceil(c_e / block)."""
    t, d = x_TD.shape
    k = routing.experts_Tk.shape[1]
    e = w.gate_up_EDF2.shape[0]
    a = t * k
    block = int(min(256, max(8, 1 << max(0, (a // (2 * e)).bit_length() - 1))))  # pad <= ~A/2
    n_blocks = -(-a // block) + e
    experts_A = routing.experts_Tk.reshape(-1)
    order_A = jnp.argsort(experts_A, stable=True)
    sorted_experts = experts_A[order_A]
    counts_E = jnp.bincount(experts_A, length=e).astype(jnp.int32)
    blocks_E = (counts_E + block - 1) // block
    block_end_E = jnp.cumsum(blocks_E)
    first_sorted_E = jnp.cumsum(counts_E) - counts_E
    rank = jnp.arange(a, dtype=jnp.int32) - first_sorted_E[sorted_experts]
    slot_sorted = (block_end_E - blocks_E)[sorted_experts] * block + rank
    slot_A = jnp.zeros((a,), jnp.int32).at[order_A].set(slot_sorted)  # (token, choice) order
    # Unused slots read row t, a zero row; unused blocks run expert E-1 on zeros, never read.
    token_of_slot = jnp.full((n_blocks * block,), t, jnp.int32).at[slot_A].set(
        jnp.arange(a, dtype=jnp.int32) // k)
    x_pad = jnp.concatenate([x_TD, jnp.zeros((1, d), x_TD.dtype)])
    x_GbD = x_pad[token_of_slot].reshape(n_blocks, block, d)
    expert_G = jnp.minimum(jnp.searchsorted(block_end_E, jnp.arange(n_blocks), side="right"),
                           e - 1)

    def one_block(args):
        x_bD, ex = args
        h = x_bD @ w.gate_up_EDF2[ex] + w.gate_up_bias_EF2[ex]
        return swiglu(h, limit) @ w.down_EFD[ex] + w.down_bias_ED[ex]

    y_AD = jax.lax.map(one_block, (x_GbD, expert_G)).reshape(-1, d)[slot_A]
    return jnp.einsum("TkD,Tk->TD", y_AD.reshape(t, k, d), routing.weights_Tk.astype(y_AD.dtype))


def moe_dropless(mlp: nnx.Module, x_BTD: jax.Array) -> jax.Array:
    """The MoE layer `mlp` on x, never dropping an assignment (see the module docstring)."""
    cfg = mlp.cfg
    b, t, d = x_BTD.shape
    x_TD = x_BTD.reshape(b * t, d).astype(cfg.compute_dtype)
    routing = route(x_TD, mlp.router[...], mlp.router_bias[...], cfg.experts_per_token)
    w = mlp.expert_weights()
    limit = cfg.swiglu_limit
    if b * t * cfg.experts_per_token <= cfg.num_experts:
        y = moe_gather(x_TD, routing, w, limit)
    elif cfg.moe_dispatch == "ragged":
        y = moe_ragged(x_TD, routing, w, limit)
    elif cfg.moe_dispatch == "dense":
        y = moe_dense(x_TD, routing, w, limit)
    else:  # capacity: the same function without its drops
        y = moe_blocked(x_TD, routing, w, limit)
    return y.reshape(b, t, d).astype(cfg.compute_dtype)


# ---------------------------------------------------------------------------------------------
# Running the layers with the cache.

# layer_fn(block, x, cache, sliding, index in its stack, window) -> (x, cache)
LayerFn = Callable[[nnx.Module, jax.Array, KVCache, bool, jax.Array, int],
                   tuple[jax.Array, KVCache]]


def run_layers(model: nnx.Module, x: jax.Array, cache: KVCache,
               layer_fn: LayerFn) -> tuple[jax.Array, KVCache]:
    """Applies `layer_fn` to every layer in order: a scan over (sliding, full) pairs, or over
    single full layers without a window, then the odd layer out."""
    cfg = model.cfg
    windows = tuple(cfg.layer_window(j) for j in range(max(2, cfg.num_hidden_layers)))
    period = 2 if cfg.sliding_window > 0 else 1
    groups = cfg.num_hidden_layers // period
    graphdef, state = nnx.split(model.layers)
    # Layer j of group g is layer g * period + j; its index in its kind's stack is g.
    group_states = tuple(jax.tree.map(lambda a, j=j: a[j::period][:groups], state)
                         for j in range(period))

    def group(carry, xs):
        x, cache = carry
        states, g = xs
        for j in range(period):
            x, cache = layer_fn(nnx.merge(graphdef, states[j]), x, cache, windows[j] > 0, g,
                                windows[j])
        return (x, cache), None

    if groups:
        (x, cache), _ = jax.lax.scan(group, (x, cache), (group_states, jnp.arange(groups)),
                                     unroll=cfg.scan_unroll)
    for layer in range(groups * period, cfg.num_hidden_layers):  # at most one, sliding
        block = nnx.merge(graphdef, jax.tree.map(lambda a: a[layer], state))
        x, cache = layer_fn(block, x, cache, windows[layer] > 0, jnp.asarray(groups),
                            windows[layer])
    return x, cache


def _embed(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    return model.embedding[...].astype(model.cfg.compute_dtype)[tokens]


def _mlp(block: nnx.Module, x: jax.Array) -> jax.Array:
    return x + moe_dropless(block.mlp, block.mlp_norm(x))


def ring_positions(last_B: jax.Array, slots: int) -> jax.Array:
    """[B, slots]: the position each ring slot holds once positions 0..last have been written in
    order (negative = empty): last - ((last - s) mod slots)."""
    s = jnp.arange(slots, dtype=jnp.int32)
    return last_B[:, None] - (last_B[:, None] - s) % slots


def prefill(model: nnx.Module, tokens_BP: jax.Array, lengths_B: jax.Array,
            cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Runs right-padded prompts (sequence b = tokens[b, :lengths[b]]) through the model, filling
    an empty cache. Returns the float32 logits [B, V] at each prompt's last token, and the cache."""
    b, p = tokens_BP.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    segments = (positions < lengths_B[:, None]).astype(jnp.int32)  # 0 = padding
    # Ring slot s of sequence b gets the latest prompt position that maps to it.
    ring = cache.k_sliding.shape[3]
    ring_pos_BR = ring_positions(lengths_B - 1, ring) if ring else None
    rows = jnp.arange(b)[:, None]

    def slots_first(x_BSKH: jax.Array, dtype) -> jax.Array:  # [B, S, K, H] -> cache [B, K, S, H]
        return jnp.swapaxes(x_BSKH, 1, 2).astype(dtype)


    def layer_fn(block, x, cache, sliding, idx, window):
        q, k, v = block.attn.qkv(block.attn_norm(x), positions)
        mask = attention_mask(positions, positions, window, segments, segments)
        x = x + block.attn.out(attend(q, k, v, block.attn.sinks[...], mask))
        if sliding:
            src = jnp.maximum(ring_pos_BR, 0)
            dt = cache.k_sliding.dtype
            cache = cache._replace(
                k_sliding=cache.k_sliding.at[idx].set(slots_first(k[rows, src], dt)),
                v_sliding=cache.v_sliding.at[idx].set(slots_first(v[rows, src], dt)))
        else:
            dt = cache.k_full.dtype
            cache = cache._replace(
                k_full=cache.k_full.at[idx, :, :, :p].set(slots_first(k, dt)),
                v_full=cache.v_full.at[idx, :, :, :p].set(slots_first(v, dt)))
        return _mlp(block, x), cache

    x, cache = run_layers(model, _embed(model, tokens_BP), cache, layer_fn)
    last = x[jnp.arange(b), lengths_B - 1][:, None]  # [B, 1, D]
    return model.logits(model.norm(last))[:, 0], cache


def decode_step(model: nnx.Module, tokens_B: jax.Array, positions_B: jax.Array,
                cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Feeds one token per sequence at its own position (every earlier position already cached).
    Returns the float32 logits [B, V] and the cache with this token's keys and values added."""
    b = tokens_B.shape[0]
    q_pos = positions_B[:, None]  # [B, 1]
    rows = jnp.arange(b)
    full_pos = jnp.broadcast_to(jnp.arange(cache.k_full.shape[3], dtype=jnp.int32),
                                (b, cache.k_full.shape[3]))
    ring = cache.k_sliding.shape[3]
    ring_pos_BR = ring_positions(positions_B, ring) if ring else None

    def layer_fn(block, x, cache, sliding, idx, window):
        q, k, v = block.attn.qkv(block.attn_norm(x), q_pos)
        if sliding:
            kc, vc, slot = cache.k_sliding, cache.v_sliding, positions_B % ring
        else:
            kc, vc, slot = cache.k_full, cache.v_full, positions_B
        # In bounds by construction; saying so lets XLA update in place instead of selecting
        # over the whole stack to drop out-of-bounds writes (a full cache copy per layer).
        kc = kc.at[idx, rows, :, slot].set(k[:, 0].astype(kc.dtype), mode="promise_in_bounds")
        vc = vc.at[idx, rows, :, slot].set(v[:, 0].astype(vc.dtype), mode="promise_in_bounds")
        if sliding:
            mask = attention_mask(q_pos, ring_pos_BR, window, None,
                                  (ring_pos_BR >= 0).astype(jnp.int32))
            cache = cache._replace(k_sliding=kc, v_sliding=vc)
        else:
            mask = attention_mask(q_pos, full_pos, 0)
            cache = cache._replace(k_full=kc, v_full=vc)
        cdt = block.attn.cfg.compute_dtype
        o = attend(q, jnp.swapaxes(kc[idx], 1, 2).astype(cdt),
                   jnp.swapaxes(vc[idx], 1, 2).astype(cdt), block.attn.sinks[...], mask)
        return _mlp(block, x + block.attn.out(o)), cache

    x, cache = run_layers(model, _embed(model, tokens_B[:, None]), cache, layer_fn)
    return model.logits(model.norm(x))[:, 0], cache
