"""The Python API of generation: `sample(model, prompt_ids, ...)` continues token-id prompts.

Prompt length and max_new_tokens are rounded up to buckets, and the sampling numbers
(temperature, top_k, top_p, seed, eos_id, max_new_tokens itself) are traced, so a new prompt or
setting in the same bucket reuses the compiled program; what is static is the batch size, the
buckets, the cache length and dtype, whether top_k/top_p filtering runs at all, `return_logits`,
the mesh and the `stream` callback (a streaming call compiles its own program). Each sequence
draws from its own key, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from llm_jax.config import ModelConfig
from llm_jax.inference.loop import MAX_STOPS, Plan, StreamFn, bucket, generate_jit


def _as_prompts(prompt_ids: Any) -> tuple[list[list[int]], bool]:
    """(list of prompts, whether a single 1-D prompt was given)."""
    if isinstance(prompt_ids, (np.ndarray, jax.Array)):
        arr = np.asarray(prompt_ids)
        if arr.ndim not in (1, 2):
            raise ValueError(f"prompt_ids has shape {arr.shape}: expected one prompt [T] or a "
                             f"batch [B, T]")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompt_ids has dtype {arr.dtype}: expected integer token ids")
        return ([arr.tolist()] if arr.ndim == 1 else arr.tolist()), arr.ndim == 1
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
        raise ValueError(f"prompt_ids={prompt_ids!r:.60}: expected token ids (a list of ints, or a "
                         f"list of such lists); encode text with a Tokenizer first")
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: expected at least one prompt")
    single = all(isinstance(i, (int, np.integer)) for i in prompt_ids)
    prompts = [list(prompt_ids)] if single else [list(p) for p in prompt_ids]
    return prompts, single


def _check_args(prompts: list[list[int]], vocab: int, max_new_tokens: Any, temperature: Any,
                top_k: Any, top_p: Any, eos_id: Any) -> None:
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt_ids[{i}] is empty: expected at least one token (a BOS or "
                             f"some text) to condition on")
        bad = [t for t in p if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_ids[{i}] holds {bad[0]!r}, outside the vocabulary: expected "
                             f"integer ids in [0, {vocab})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid: expected an integer >= 1")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature={temperature!r} is invalid: expected a finite number >= 0 "
                         f"(0 = greedy)")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k={top_k!r} is invalid: expected an integer >= 0 (0 = off)")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} is invalid: expected a number in (0, 1] (1 = off)")
    ids = [eos_id] if isinstance(eos_id, (int, np.integer)) else eos_id
    if ids is not None and (
            isinstance(eos_id, bool) or isinstance(ids, (str, bytes))
            or not isinstance(ids, Sequence | set | frozenset) or not 1 <= len(ids) <= MAX_STOPS
            or any(isinstance(i, bool) or not isinstance(i, (int, np.integer))
                   or not 0 <= i < vocab for i in ids)):
        raise ValueError(f"eos_id={eos_id!r} is invalid: expected None, an id or 1 to "
                         f"{MAX_STOPS} ids in [0, {vocab})")


def stop_ids_array(eos_id: int | Sequence[int] | None) -> jax.Array:
    """The stop ids as the program takes them: int32 [MAX_STOPS], -1 where unused (no token is
    -1), so any set of them runs the same compiled program."""
    ids = [] if eos_id is None else [eos_id] if isinstance(eos_id, (int, np.integer)) else eos_id
    out = np.full((MAX_STOPS,), -1, np.int32)
    out[:len(ids)] = sorted(ids)
    return jnp.asarray(out)


def program_inputs(cfg: ModelConfig, prompts: list[list[int]], max_new_tokens: int,
                   temperature: float, top_k: int, top_p: float, seed: int,
                   eos_id: int | Sequence[int] | None,
                   return_logits: bool, *, max_len: int | None, cache_dtype: str | None,
                   mesh: Mesh | None) -> tuple[Plan, tuple[jax.Array, ...]]:
    """The checked, padded inputs of `generate_jit` after the weights: (its static plan, its
    array arguments). `sample` runs them; `aot.compile_generate` compiles them for a topology."""
    _check_args(prompts, cfg.vocab_size, max_new_tokens, temperature, top_k, top_p, eos_id)
    longest = max(len(p) for p in prompts)
    needed = longest + int(max_new_tokens)
    if max_len is None:
        max_len = bucket(longest) + bucket(int(max_new_tokens))
    elif isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
        raise ValueError(f"max_len={max_len!r} is invalid: expected a positive integer")
    if needed > max_len:
        i = max(range(len(prompts)), key=lambda j: len(prompts[j]))
        raise ValueError(
            f"prompt_ids[{i}] has {longest} tokens; with max_new_tokens={max_new_tokens} it needs "
            f"{needed} cache slots, more than max_len={max_len}: shorten the prompt, lower "
            f"max_new_tokens or raise max_len")
    p_pad = min(bucket(longest), max_len)
    tokens = np.zeros((len(prompts), p_pad), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    plan = Plan(
        new_bucket=min(bucket(int(max_new_tokens)), max_len), max_len=int(max_len),
        cache_dtype=str(jnp.dtype(cache_dtype or cfg.dtype)),
        filtered=temperature > 0 and (top_k > 0 or top_p < 1),
        return_logits=return_logits, mesh=mesh)
    args = (jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(max_new_tokens, jnp.int32),
            jax.random.key(seed), jnp.asarray(temperature, jnp.float32),
            jnp.asarray(min(int(top_k), cfg.vocab_size), jnp.int32),
            jnp.asarray(top_p, jnp.float32),
            stop_ids_array(eos_id))
    return plan, args


def sample(
    model: nnx.Module,
    prompt_ids: Any,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | Sequence[int] | None = None,
    return_logits: bool = False,
    *,
    max_len: int | None = None,
    cache_dtype: str | None = None,
    mesh: Mesh | None = None,
    stream: StreamFn | None = None,
):
    """Continues each prompt by up to `max_new_tokens` tokens.

    prompt_ids: one prompt (list of ints / 1-D array) or a batch (list of lists / 2-D array), the
      prompts may differ in length. temperature 0 = greedy; top_k 0 and top_p 1 = off.
    eos_id: an id, or up to MAX_STOPS ids (a checkpoint's stop tokens: gpt-oss's `<|return|>`,
      `<|call|>`, ...): a sequence stops after producing one (it is included in the output).
    max_len: cache slots (default: the padded prompt length + max_new_tokens, rounded to buckets);
      prompt + max_new_tokens must fit. cache_dtype: default the compute dtype.
    mesh: trace under this mesh: the cache and the activations are sharded by
      llm_jax.parallel.sharding's rules (the weights stay as given).
    stream(step, tokens [B], active [B]): called on the host as each step's tokens are drawn.

    Returns the new ids of each sequence (a list, or a list of lists for a batch); with
    return_logits also the float32 logits each token was drawn from ([n, V] per sequence).
    """
    prompts, single = _as_prompts(prompt_ids)
    plan, args = program_inputs(model.cfg, prompts, max_new_tokens, temperature, top_k, top_p,
                                seed, eos_id, return_logits, max_len=max_len,
                                cache_dtype=cache_dtype, mesh=mesh)
    graphdef, state = nnx.split(model)
    out, made, logits = generate_jit(graphdef, state, *args, plan=plan, emit=stream)
    out, made = np.asarray(out), np.asarray(made)
    logits = None if logits is None else np.asarray(logits)
    ids = [out[i, :made[i]].tolist() for i in range(len(prompts))]
    if not return_logits:
        return ids[0] if single else ids
    per_seq = [logits[i, :made[i]] for i in range(len(prompts))]
    return (ids[0], per_seq[0]) if single else (ids, per_seq)
