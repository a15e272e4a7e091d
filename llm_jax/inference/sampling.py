"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus).

Sampling follows the usual order: logits / temperature, keep the top_k, keep the smallest set of
tokens whose probability reaches top_p (Holtzman et al. 2019), draw. Temperature 0 is greedy.

Shapes: B batch, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def greedy_tokens(logits_BV: jax.Array) -> jax.Array:
    """argmax over V (the first of ties) as a max and a min over indices: two plain reductions,
    which XLA:CPU vectorises, where `jnp.argmax`'s (value, index) reduction is a scalar loop
    (0.9 ms of a batch-8 decode step of the tiny config)."""
    v = logits_BV.shape[-1]
    best = jnp.max(logits_BV, axis=-1, keepdims=True)
    nan = jnp.isnan(logits_BV)  # argmax picks the first NaN (XLA:CPU's fast max skips NaNs)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, logits_BV == best)
    return jnp.min(jnp.where(hit, jnp.arange(v, dtype=jnp.int32), v), axis=-1)


def sample_logits(
    logits_BV: jax.Array,
    keys_B: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    *,
    filtered: bool,
) -> jax.Array:
    """Next tokens [B] (int32) from float32 logits [B, V], one key per row; temperature 0 =
    greedy. Only `filtered` (whether top_k / top_p apply: a sort of V per step) is static; the
    numbers are traced (top_k 0 = off), so greedy and sampling share one compiled program, and a
    `lax.cond` runs only the branch in use (greedy draws no random bits)."""

    def sample(logits_BV: jax.Array) -> jax.Array:
        logits = logits_BV.astype(jnp.float32) / temperature
        if filtered:
            v = logits.shape[-1]
            k = jnp.where(top_k > 0, top_k, v)
            sorted_BV = jnp.sort(logits, axis=-1)[:, ::-1]
            # top_p acts on the distribution renormalised over the top k.
            probs = jax.nn.softmax(jnp.where(jnp.arange(v) < k, sorted_BV, -jnp.inf), axis=-1)
            before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly better tokens
            kept = jnp.sum((before < top_p) & (probs > 0), axis=-1, keepdims=True)  # >= 1
            threshold = jnp.take_along_axis(sorted_BV, kept - 1, axis=-1)
            logits = jnp.where(logits < threshold, -jnp.inf, logits)
        return jax.vmap(jax.random.categorical)(keys_B, logits).astype(jnp.int32)

    return jax.lax.cond(temperature > 0, sample, greedy_tokens, logits_BV)
