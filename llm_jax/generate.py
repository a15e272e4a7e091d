"""Text generation with a KV cache: one batched prefill, then decoding entirely on device.

    python -m llm_jax.generate --checkpoint PATH --prompt "def fib(" [--prompt_file F]
        [--prompt_ids 1,2,3] --max_new_tokens N [--temperature T --top_k K --top_p P --seed S]
        [--output_json FILE]
    python -m llm_jax.generate --bench [--bench_json FILE]

`generate(model, prompt_ids, ...)` pads the prompts on the right (each keeps positions 0..len-1),
prefills them in one pass, then runs a `lax.while_loop` of single-token steps (kv_cache.py) that
samples on device and stops when every sequence has met `eos_id` or `max_new_tokens` are made.
The only host traffic per token is the optional streaming callback. Prompt length and
max_new_tokens are rounded up to buckets, and the sampling numbers (temperature, top_k, top_p,
seed, eos_id, max_new_tokens itself) are traced, so a new prompt or setting in the same bucket
reuses the compiled program; what is static is the batch size, the buckets, the cache dtype and
whether top_k/top_p filtering runs at all.

Sampling follows the usual order: logits / temperature, keep the top_k, keep the smallest set of
tokens whose probability reaches top_p (nucleus sampling, Holtzman et al. 2019), draw. Temperature
0 is greedy. Each sequence draws from its own key fold_in(fold_in(seed, step), row), so its tokens
do not depend on what else is in the batch.

Shapes: B batch, P prompt time (padded), N new tokens (padded), S cache slots, V vocab.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from llm_jax.kv_cache import decode_step, init_cache, prefill, shard_cache
from llm_jax.malloc import use_preferred_malloc

MIN_BUCKET = 16


def bucket(n: int) -> int:
    """Compile-size bucket for a length n: the next power of two >= n (at least 16), then
    multiples of 1024 past 1024, so padding wastes at most 2x (and at most 1023 past 1024)."""
    if n <= 1024:
        return max(MIN_BUCKET, 1 << max(0, n - 1).bit_length())
    return -(-n // 1024) * 1024


# ---------------------------------------------------------------------------------------------
# Sampling.


def greedy_tokens(logits_BV: jax.Array) -> jax.Array:
    """argmax over V (the first of ties) as a max and a min over indices: two plain reductions,
    which XLA:CPU vectorises, where `jnp.argmax`'s (value, index) reduction is a scalar loop
    (0.9 ms of a 12 ms decode step at batch 8 x V 8,000)."""
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


# ---------------------------------------------------------------------------------------------
# The compiled program.


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one generate call: a new value means a new compile."""

    new_bucket: int  # N: room for generated tokens
    max_len: int  # S: cache slots of full layers
    cache_dtype: str
    filtered: bool  # top_k or top_p active while sampling
    return_logits: bool
    stream: bool
    mesh: Mesh | None


# Streaming: the compiled loop calls _emit, which forwards to the sink of the running call.
_STREAM_SINK: list[Callable[[int, np.ndarray, np.ndarray], None] | None] = [None]


def _emit(step, tokens, active) -> None:
    sink = _STREAM_SINK[0]
    if sink is not None:
        sink(int(step), np.asarray(tokens), np.asarray(active))


def _generate_impl(graphdef, state, prompts_BP, lengths_B, max_new, key, temperature, top_k,
                   top_p, eos_id, *, plan: _Plan):
    model = nnx.merge(graphdef, state)
    b = prompts_BP.shape[0]
    n = plan.new_bucket
    rows = jnp.arange(b)

    def pick(logits_BV, step):
        keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, step), r))(rows)
        return sample_logits(logits_BV, keys, temperature, top_k, top_p, filtered=plan.filtered)

    cache = shard_cache(init_cache(model.cfg, b, plan.max_len, plan.cache_dtype), plan.mesh)
    logits, cache = prefill(model, prompts_BP, lengths_B, cache)
    first = pick(logits, 0)
    out_BN = jnp.zeros((b, n), jnp.int32).at[:, 0].set(first)
    logits_BNV = (jnp.zeros((b, n, logits.shape[-1]), jnp.float32).at[:, 0].set(logits)
                  if plan.return_logits else None)
    if plan.stream:
        jax.debug.callback(_emit, 0, first, jnp.ones((b,), bool), ordered=True)
    made_B = jnp.ones((b,), jnp.int32)
    done_B = first == eos_id

    def cond(s):
        t, *_, done, _ = s
        return (t < max_new) & ~jnp.all(done)

    def body(s):
        t, out, lg, made, done, cache = s
        logits, cache = decode_step(model, out[:, t - 1], lengths_B + t - 1, cache)
        cache = shard_cache(cache, plan.mesh)
        tok = jnp.where(done, 0, pick(logits, t))
        if plan.stream:
            jax.debug.callback(_emit, t, tok, ~done, ordered=True)
        out = out.at[:, t].set(tok)
        if lg is not None:
            lg = lg.at[:, t].set(logits)
        made = made + (~done).astype(jnp.int32)
        return t + 1, out, lg, made, done | (tok == eos_id), cache

    _, out_BN, logits_BNV, made_B, _, _ = jax.lax.while_loop(
        cond, body, (jnp.asarray(1), out_BN, logits_BNV, made_B, done_B, cache))
    return out_BN, made_B, logits_BNV


_generate_jit = jax.jit(_generate_impl, static_argnames=("graphdef", "plan"))


# ---------------------------------------------------------------------------------------------
# The Python API.


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
    if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, (int, np.integer))
                               or not 0 <= eos_id < vocab):
        raise ValueError(f"eos_id={eos_id!r} is invalid: expected None or an id in [0, {vocab})")


def generate(
    model: nnx.Module,
    prompt_ids: Any,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
    return_logits: bool = False,
    *,
    max_len: int | None = None,
    cache_dtype: str | None = None,
    mesh: Mesh | None = None,
    stream: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
):
    """Continues each prompt by up to `max_new_tokens` tokens.

    prompt_ids: one prompt (list of ints / 1-D array) or a batch (list of lists / 2-D array), the
      prompts may differ in length. temperature 0 = greedy; top_k 0 and top_p 1 = off.
    eos_id: a sequence stops after producing it (it is included in the output).
    max_len: cache slots (default: the padded prompt length + max_new_tokens, rounded to buckets);
      prompt + max_new_tokens must fit. cache_dtype: default the compute dtype.
    mesh: shard the cache by llm_jax.sharding's rules on this mesh.
    stream(step, tokens [B], active [B]): called on the host as each step's tokens are drawn.

    Returns the new ids of each sequence (a list, or a list of lists for a batch); with
    return_logits also the float32 logits each token was drawn from ([n, V] per sequence).
    """
    cfg = model.cfg
    prompts, single = _as_prompts(prompt_ids)
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
    plan = _Plan(
        new_bucket=min(bucket(int(max_new_tokens)), max_len), max_len=int(max_len),
        cache_dtype=str(jnp.dtype(cache_dtype or cfg.dtype)),
        filtered=temperature > 0 and (top_k > 0 or top_p < 1),
        return_logits=return_logits, stream=stream is not None, mesh=mesh)
    graphdef, state = nnx.split(model)
    _STREAM_SINK[0] = stream
    try:
        out, made, logits = _generate_jit(
            graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths),
            jnp.asarray(max_new_tokens, jnp.int32), jax.random.key(seed),
            jnp.asarray(temperature, jnp.float32),
            jnp.asarray(min(int(top_k), cfg.vocab_size), jnp.int32),
            jnp.asarray(top_p, jnp.float32),
            jnp.asarray(-1 if eos_id is None else eos_id, jnp.int32), plan=plan)
        out, made = np.asarray(out), np.asarray(made)
        logits = None if logits is None else np.asarray(logits)
    finally:
        _STREAM_SINK[0] = None
    ids = [out[i, :made[i]].tolist() for i in range(len(prompts))]
    if not return_logits:
        return ids[0] if single else ids
    per_seq = [logits[i, :made[i]] for i in range(len(prompts))]
    return (ids[0], per_seq[0]) if single else (ids, per_seq)


# ---------------------------------------------------------------------------------------------
# Benchmark: llm_jax against transformers on the same weights.


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(cfg=None, *, batches: Sequence[int] = (1, 8), prompt_len: int = 128,
          new_tokens: int = 256, repeats: int = 3, hf: bool = True,
          kv_contexts: Sequence[int] = (128, 512, 2048, 8192), seed: int = 0) -> dict[str, Any]:
    """Prefill time and decode tokens/s (medians of `repeats`) for random weights of `cfg`
    (default: the tiny config), beside transformers' `generate` on the same weights; and the real
    cache's bytes against describe.kv_cache_bytes at several contexts."""
    from llm_jax.config import ModelConfig
    from llm_jax.describe import kv_cache_bytes
    from llm_jax.model import init_model

    cfg = cfg or ModelConfig()
    model = init_model(cfg, seed)
    rng = np.random.default_rng(seed)
    rows = []
    hf_model = _hf_twin(model) if hf else None
    graphdef, state = nnx.split(model)
    jprefill = jax.jit(lambda s, t, n: prefill(
        nnx.merge(graphdef, s), t, n, init_cache(cfg, t.shape[0], prompt_len + new_tokens))[0])
    for b in batches:
        prompts = rng.integers(4, cfg.vocab_size, (b, prompt_len)).astype(np.int32)
        lengths = jnp.full((b,), prompt_len, jnp.int32)
        jax.block_until_ready(jprefill(state, jnp.asarray(prompts), lengths))
        t_prefill = _median_time(lambda: jax.block_until_ready(
            jprefill(state, jnp.asarray(prompts), lengths)), repeats)
        run = lambda: generate(model, prompts, max_new_tokens=new_tokens)  # noqa: E731
        t0 = time.perf_counter()
        run()
        compile_s = time.perf_counter() - t0
        t_total = _median_time(run, repeats)
        row = {"batch": b, "prompt_len": prompt_len, "new_tokens": new_tokens,
               "llm_jax": {"prefill_s": t_prefill, "total_s": t_total,
                           "first_call_s": compile_s,
                           "decode_tokens_per_s": b * (new_tokens - 1) / (t_total - t_prefill)}}
        if hf_model is not None:
            row["transformers"] = _bench_hf(hf_model, prompts, new_tokens, repeats)
        rows.append(row)
    kv = []
    for c in (cfg, cfg.replace(sliding_window=128)):
        for t in kv_contexts:
            real = init_cache(c, 1, t).nbytes
            kv.append({"sliding_window": c.sliding_window, "context": t, "real_bytes": real,
                       "predicted_bytes": kv_cache_bytes(c, t, batch=1)})
    return {"config": cfg.to_dict(), "devices": str(jax.devices()), "cpu_count": os.cpu_count(),
            "repeats": repeats, "decode": rows, "kv_cache": kv}


def _hf_twin(model: nnx.Module):
    """The same weights as a transformers GptOssForCausalLM (float32, eager), via save_hf."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    import transformers

    from llm_jax.checkpoint_io import save_hf

    with tempfile.TemporaryDirectory() as d:
        save_hf(model, d)
        hf = transformers.GptOssForCausalLM.from_pretrained(
            d, dtype=torch.float32, attn_implementation="eager")
    return hf.eval()


def _bench_hf(hf_model, prompts: np.ndarray, new_tokens: int, repeats: int) -> dict[str, float]:
    import torch

    ids = torch.from_numpy(prompts.astype(np.int64))
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        hf_model(ids)
        t_prefill = _median_time(lambda: hf_model(ids, use_cache=True), repeats)
        hf_model.generate(ids, **kw)
        t_total = _median_time(lambda: hf_model.generate(ids, **kw), repeats)
    b = prompts.shape[0]
    return {"prefill_s": t_prefill, "total_s": t_total,
            "decode_tokens_per_s": b * (new_tokens - 1) / (t_total - t_prefill),
            "torch_threads": torch.get_num_threads()}


def format_bench(r: dict[str, Any]) -> str:
    lines = [f"devices {r['devices']}, {r['cpu_count']} CPUs, medians of {r['repeats']}", "",
             "| batch | prompt | new | llm_jax prefill | llm_jax decode tok/s | "
             "transformers prefill | transformers decode tok/s | speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    for row in r["decode"]:
        j, h = row["llm_jax"], row.get("transformers")
        hf_cols = (f"{h['prefill_s'] * 1e3:.1f} ms | {h['decode_tokens_per_s']:.1f} | "
                   f"{j['decode_tokens_per_s'] / h['decode_tokens_per_s']:.1f}x"
                   if h else "- | - | -")
        lines.append(f"| {row['batch']} | {row['prompt_len']} | {row['new_tokens']} | "
                     f"{j['prefill_s'] * 1e3:.1f} ms | {j['decode_tokens_per_s']:.1f} | "
                     f"{hf_cols} |")
    lines += ["", "| sliding_window | context | real cache bytes | kv_cache_bytes | equal |",
              "|---|---|---|---|---|"]
    lines += [f"| {k['sliding_window']} | {k['context']} | {k['real_bytes']:,} | "
              f"{k['predicted_bytes']:,} | {k['real_bytes'] == k['predicted_bytes']} |"
              for k in r["kv_cache"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The command line.


def find_tokenizer(path: str | Path):
    """The Tokenizer at PATH/tokenizer.model or PATH/../tokenizer.model, or None."""
    from llm_jax.data.tokenizer import Tokenizer

    for d in (Path(path), Path(path).resolve().parent):
        if (d / "tokenizer.model").is_file():
            return Tokenizer.load(str(d / "tokenizer.model"))
    return None


def text_decoder(tok) -> Callable[[list[int]], str]:
    """ids -> text with `tok`, or " 1 2 3" without one. Ids past the tokenizer's vocabulary (a
    model's padded rows) show as <id:N> rather than failing."""
    if tok is None:
        return lambda ids: "".join(f" {i}" for i in ids)

    def decode(ids: list[int]) -> str:
        out, run = [], []
        for i in ids:
            if 0 <= i < tok.vocab_size:
                run.append(i)
            else:
                out += [tok.decode(run), f"<id:{i}>"]
                run = []
        return "".join(out) + tok.decode(run)

    return decode


class _TextStream:
    """Prints the new text of sequence 0 as its tokens arrive, holding back a trailing partial
    UTF-8 character (byte-fallback tokens) until it completes or the stream ends."""

    def __init__(self, decode: Callable[[list[int]], str], prefix: str = "", out=None):
        self.decode, self.prefix, self.out, self.ids, self.shown = decode, prefix, out, [], ""

    def _write(self, final: bool) -> None:
        text = self.decode(self.ids)
        if (final or not text.endswith("\ufffd")) and text.startswith(self.shown):
            out = self.out or sys.stdout
            out.write(self.prefix + text[len(self.shown):])
            self.prefix = ""
            out.flush()
            self.shown = text

    def __call__(self, step: int, tokens: np.ndarray, active: np.ndarray) -> None:
        if active[0]:
            self.ids.append(int(tokens[0]))
            self._write(final=False)

    def finish(self) -> None:
        self._write(final=True)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m llm_jax.generate", description=__doc__.split(
        "\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="llm_jax workdir/checkpoint, Hugging Face directory or "
                   "OpenAI original/ directory")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompt_file", action="append", default=[],
                   help="a file whose whole text is one prompt (repeatable)")
    p.add_argument("--prompt_ids", action="append", default=[],
                   help="comma-separated token ids, e.g. 1,2,3 (repeatable; no tokenizer needed)")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=0, help="0 = off")
    p.add_argument("--top_p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eos_id", type=int, default=None,
                   help="stop token (default: the tokenizer's EOS; -1 = never stop early)")
    p.add_argument("--dtype", default=None, help="load weights and compute in this dtype")
    p.add_argument("--cache_dtype", default=None, help="KV-cache dtype (default: compute dtype)")
    p.add_argument("--max_len", type=int, default=None, help="KV-cache slots")
    p.add_argument("--output_json", default=None, help="write ids and text of every sequence")
    p.add_argument("--no_stream", action="store_true", help="print only when done")
    p.add_argument("--bench", action="store_true",
                   help="benchmark decode on the tiny config against transformers")
    p.add_argument("--bench_json", default=None, help="with --bench: also write results here")
    p.add_argument("--bench_repeats", type=int, default=3)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.bench:
        r = bench(repeats=args.bench_repeats)
        print(format_bench(r))
        if args.bench_json:
            Path(args.bench_json).write_text(json.dumps(r, indent=2))
        return 0
    try:
        if not args.checkpoint:
            raise ValueError("--checkpoint is required (or --bench)")
        from llm_jax.checkpoint_io import load_pretrained

        model = load_pretrained(args.checkpoint, dtype=args.dtype)
        tok = find_tokenizer(args.checkpoint)
        texts = list(args.prompt) + [Path(f).read_text() for f in args.prompt_file]
        if texts and tok is None:
            raise ValueError(f"--prompt/--prompt_file need a tokenizer, and there is no "
                             f"tokenizer.model in {args.checkpoint} or its parent; pass "
                             f"--prompt_ids instead")
        prompts = tok.encode_batch(texts) if texts else []
        for s in args.prompt_ids:
            try:
                prompts.append([int(x) for x in s.replace(" ", "").split(",") if x])
            except ValueError:
                raise ValueError(f"--prompt_ids={s!r} is invalid: expected comma-separated "
                                 f"integers like 1,2,3") from None
        if not prompts:
            raise ValueError("give at least one --prompt, --prompt_file or --prompt_ids")
        eos = args.eos_id if args.eos_id is not None else (tok.eos_id if tok else None)
        eos = None if eos is not None and eos < 0 else eos
        decode = text_decoder(tok)
        stream = None
        if len(prompts) == 1 and not args.no_stream:
            stream = _TextStream(decode, prefix=texts[0] if texts else args.prompt_ids[0])
        ids = generate(model, prompts, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed, eos_id=eos, max_len=args.max_len,
                       cache_dtype=args.cache_dtype, stream=stream)
    except ValueError as e:
        print(f"llm_jax.generate: error: {e}", file=sys.stderr)
        return 2
    if stream is not None:
        stream.finish()
        print()
    else:
        for i, (p, out) in enumerate(zip(prompts, ids)):
            head = texts[i] if i < len(texts) else ",".join(map(str, p))
            print(f"--- [{i}]\n{head}{decode(out)}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps([
            {"prompt_ids": p, "ids": out, "text": decode(out)} for p, out in zip(prompts, ids)],
            indent=2))
    return 0


class _CallableModule(types.ModuleType):
    """Lets `llm_jax.generate(model, prompt_ids, ...)` call `generate` although the name is also
    this module's (which `python -m llm_jax.generate` and `from llm_jax.generate import` need)."""

    def __call__(self, *args: Any, **kwargs: Any):
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    use_preferred_malloc()
    sys.exit(main())
