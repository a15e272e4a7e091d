"""The compiled generation program: one batched prefill, then a `lax.while_loop` of decode steps.

Shapes: B batch, P prompt time (padded), N new tokens (padded), S cache slots, V vocab.

Prompts are right-padded; every sequence has its own positions 0..len-1 and its own write
position while decoding. Both phases run the model's own `hidden_states` with a KV cache
(model/kv_cache.py), so generation computes exactly what training and evaluation compute. The
loop samples on device and stops when every sequence has met one of its stop ids (`eos_id`) or
`max_new` tokens are made; the only host traffic per token is the optional streaming callback.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from llm_jax.inference.sampling import sample_logits
from llm_jax.model.kv_cache import KVCache, init_cache, shard_cache
from llm_jax.parallel.sharding import with_mesh
from llm_jax.runtime.backend import InferenceJit, plan

MIN_BUCKET = 16

StreamFn = Callable[[int, np.ndarray, np.ndarray], None]  # (step, tokens [B], active [B])


def bucket(n: int) -> int:
    """Compile-size bucket for a length n: the next power of two >= n (at least 16), then
    multiples of 1024 past 1024, so padding wastes at most 2x (and at most 1023 past 1024)."""
    if n <= 1024:
        return max(MIN_BUCKET, 1 << max(0, n - 1).bit_length())
    return -(-n // 1024) * 1024


def prefill(model: nnx.Module, tokens_BP: jax.Array, lengths_B: jax.Array,
            cache: KVCache, *, with_experts: bool = False):
    """Runs right-padded prompts (sequence b = tokens[b, :lengths[b]]) through the model, filling
    an empty cache. Returns the float32 logits [B, V] at each prompt's last token, and the cache
    (and, `with_experts`, the experts every position was routed to: int32 [B, P, L, k])."""
    b, p = tokens_BP.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    segments = (positions < lengths_B[:, None]).astype(jnp.int32)  # 0 = padding
    h, aux, cache = model.hidden_states(tokens_BP, positions, segments, cache)
    last = h[jnp.arange(b), lengths_B - 1][:, None]  # [B, 1, D]: no [B, P, V] logits
    out = model.logits(last)[:, 0], cache
    return (*out, jnp.moveaxis(aux.experts, 0, 2)) if with_experts else out


# XLA:CPU copies each layer's slice of the stacked weights inside the decode loop, every step;
# sliced once before the loop, a batch-8 step of the tiny config ran ~4 % faster and a batch-1
# step ~8 %. That holds a second copy of the layer weights for the call, so it is done only
# where it was measured (the plan's `slice_layers_before_decoding`: CPU), and up to this many
# bytes of layer weights.
SLICE_LAYERS_MAX_BYTES = 1 << 30


def slice_layers_once(model: nnx.Module) -> bool:
    """Whether decoding `model` slices its stacked layer weights once, before the loop."""
    nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(nnx.state(model.layers)))
    return plan().slice_layers_before_decoding and nbytes <= SLICE_LAYERS_MAX_BYTES


def decode_step(model: nnx.Module, tokens_B: jax.Array, positions_B: jax.Array,
                cache: KVCache, layers: tuple | None = None, *, with_experts: bool = False):
    """Feeds one token per sequence at its own position (every earlier position already cached).
    Returns the float32 logits [B, V] and the cache with this token's keys and values added
    (and, `with_experts`, the experts the token was routed to: int32 [B, L, k]).
    `layers`: the model's `layer_states()`, sliced once outside the decode loop."""
    h, aux, cache = model.hidden_states(tokens_B[:, None], positions_B[:, None], None, cache,
                                        layers=layers)
    out = model.logits(h)[:, 0], cache
    return (*out, jnp.moveaxis(aux.experts, 0, 2)[:, 0]) if with_experts else out


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one generate call: a new value means a new compile."""

    new_bucket: int  # N: room for generated tokens
    max_len: int  # S: cache slots of full layers
    cache_dtype: str
    filtered: bool  # top_k or top_p active while sampling
    return_logits: bool
    mesh: Mesh | None


# Stop ids a program takes (gpt-oss has three: <|return|>, <|call|>, <|endoftext|>), padded with
# -1: one shape, so any set of them runs the same compiled program.
MAX_STOPS = 8


def is_stop(tokens_B: jax.Array, stops: jax.Array) -> jax.Array:
    """Whether each token is one of the stop ids (int32 [MAX_STOPS], -1 where unused)."""
    return jnp.any(tokens_B[:, None] == stops[None, :], axis=-1)


def generate_program(graphdef, state, prompts_BP, lengths_B, max_new, key, temperature, top_k,
                     top_p, eos_id, *, plan: Plan, emit: StreamFn | None = None):
    """(new tokens [B, N], how many each row made [B], logits [B, N, V] or None), traced under
    `plan.mesh`: the model's sharding constraints and the Pallas kernels' `shard_map` (splash
    attention, grouped matmuls) see it, as in training (without it a TPU prefill on a mesh of
    several chips did not compile)."""
    return with_mesh(_generate, plan.mesh)(graphdef, state, prompts_BP, lengths_B, max_new, key,
                                           temperature, top_k, top_p, eos_id, plan=plan,
                                           emit=emit)


def _generate(graphdef, state, prompts_BP, lengths_B, max_new, key, temperature, top_k, top_p,
              eos_id, *, plan: Plan, emit: StreamFn | None):
    model = nnx.merge(graphdef, state)
    b = prompts_BP.shape[0]
    n = plan.new_bucket
    rows = jnp.arange(b)

    def pick(logits_BV, step):
        # Row r draws from fold_in(fold_in(seed, step), r): independent of the rest of the batch.
        keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, step), r))(rows)
        return sample_logits(logits_BV, keys, temperature, top_k, top_p, filtered=plan.filtered)

    def stream(step, tokens, active):
        if emit is not None:
            jax.debug.callback(lambda s, t, a: emit(int(s), np.asarray(t), np.asarray(a)),
                               step, tokens, active, ordered=True)

    cache = shard_cache(init_cache(model.cfg, b, plan.max_len, plan.cache_dtype), plan.mesh)
    logits, cache = prefill(model, prompts_BP, lengths_B, cache)
    first = pick(logits, 0)
    out_BN = jnp.zeros((b, n), jnp.int32).at[:, 0].set(first)
    logits_BNV = (jnp.zeros((b, n, logits.shape[-1]), jnp.float32).at[:, 0].set(logits)
                  if plan.return_logits else None)
    stream(0, first, jnp.ones((b,), bool))
    made_B = jnp.ones((b,), jnp.int32)
    done_B = is_stop(first, eos_id)

    def cond(s):
        t, *_, done, _ = s
        return (t < max_new) & ~jnp.all(done)

    layers = model.layer_states() if slice_layers_once(model) else None

    def body(s):
        t, out, lg, made, done, cache = s
        logits, cache = decode_step(model, out[:, t - 1], lengths_B + t - 1, cache, layers)
        cache = shard_cache(cache, plan.mesh)
        tok = jnp.where(done, 0, pick(logits, t))
        stream(t, tok, ~done)
        out = out.at[:, t].set(tok)
        if lg is not None:
            lg = lg.at[:, t].set(logits)
        made = made + (~done).astype(jnp.int32)
        return t + 1, out, lg, made, done | is_stop(tok, eos_id), cache

    _, out_BN, logits_BNV, made_B, _, _ = jax.lax.while_loop(
        cond, body, (jnp.asarray(1), out_BN, logits_BNV, made_B, done_B, cache))
    return out_BN, made_B, logits_BNV


# Compiled once per (model structure, plan); a streaming call compiles its own, since the
# callback it streams to is part of the program.
generate_jit = InferenceJit(generate_program, static_argnames=("graphdef", "plan", "emit"))
