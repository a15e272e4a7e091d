"""Decode tokens/s and prefill time beside transformers' `generate`, on the same weights.

    python -m llm_jax.bench decode [--repeats 5] [--batches 1,8] [--prompt_len 128]
        [--new_tokens 256] [--no_hf] [--mxfp4]

Random weights of configs/tiny.py's model, greedy: llm_jax's on-device decode loop
(`llm_jax.sample`) against GptOssForCausalLM.generate with eager attention on the same weights.
Each contender runs in a process of its own (two runtimes in one process slow each other down,
bench/common.py) and they take turns call by call; and the real cache's bytes against
costs.kv_cache_bytes at several contexts. With `--mxfp4`, a third contender: the same model with
its experts held packed (`expert_format="mxfp4"`), whose decode should be no slower than dense.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llm_jax.bench.common import alternate, contender, machine, median, table, torch_info
from llm_jax.bench.train import hf_model, quick_model_config, tiny_run_config
from llm_jax.config import ModelConfig
from llm_jax.inference.loop import prefill
from llm_jax.inference.sampler import sample
from llm_jax.model import init_model
from llm_jax.model.costs import kv_cache_bytes
from llm_jax.model.kv_cache import cache_nbytes, init_cache
from llm_jax.training.run_config import model_config

MXFP4 = "llm_jax mxfp4"  # the contender with packed experts (--mxfp4)


def run(*, repeats: int = 3, quick: bool = False, batches: tuple[int, ...] = (1, 8),
        prompt_len: int = 128, new_tokens: int = 256, hf: bool = True,
        mxfp4: bool = False) -> dict[str, Any]:
    cfg = model_config(tiny_run_config())
    if quick:
        cfg, batches, prompt_len, new_tokens, repeats = quick_model_config(), (1,), 8, 256, 3
    r = bench(cfg, batches=batches, prompt_len=prompt_len, new_tokens=new_tokens,
              repeats=repeats, hf=hf, mxfp4=mxfp4, isolated=not quick)
    for row in r["decode"]:
        if MXFP4 in row:
            row["mxfp4_decode_ratio"] = (row[MXFP4]["decode_tokens_per_s"]
                                         / row["llm_jax"]["decode_tokens_per_s"])
        if "transformers" in row:
            j, h = row["llm_jax"], row["transformers"]
            row["decode_speedup"] = j["decode_tokens_per_s"] / h["decode_tokens_per_s"]
            row["prefill_speedup"] = h["prefill_s"] / j["prefill_s"]
    return {"benchmark": "decode", "machine": {**machine(), **(torch_info() if hf else {})}, **r}


def bench(cfg: ModelConfig | None = None, *, batches: Sequence[int] = (1, 8), prompt_len: int = 128,
          new_tokens: int = 256, repeats: int = 3, hf: bool = True, mxfp4: bool = False,
          kv_contexts: Sequence[int] = (128, 512, 2048, 8192), seed: int = 0,
          isolated: bool = True) -> dict[str, Any]:
    """Prefill time and decode tokens/s (medians of `repeats`) for random weights of `cfg`
    (default: the tiny config), beside transformers' `generate` on the same weights; and the real
    cache's bytes against costs.kv_cache_bytes at several contexts.

    Every contender (each side's prefill and whole generate call) runs in its own process, and
    all of a batch's contenders take turns, A B C D A B C D (`alternate`), so that the machine's
    drifting speed falls on both sides alike: decode tok/s is B (new_tokens - 1) / (median
    generate - median prefill). `isolated=False` (--quick) runs them all in this process."""
    cfg = cfg or ModelConfig()
    rng = np.random.default_rng(seed)
    sides = {"llm_jax": _jax_contender, **({"transformers": _hf_contender} if hf else {}),
             **({MXFP4: _packed_contender} if mxfp4 else {})}
    rows = []
    for b in batches:
        prompts = rng.integers(4, cfg.vocab_size, (b, prompt_len)).astype(np.int32)
        fns = {(side, what): contender(functools.partial(make, cfg, seed, prompts, new_tokens,
                                                         what), isolated=isolated)
               for side, make in sides.items() for what in ("prefill", "generate")}
        try:
            times = alternate(fns, repeats=repeats)
        finally:
            for f in fns.values():
                f.close()
        row: dict[str, Any] = {"batch": b, "prompt_len": prompt_len, "new_tokens": new_tokens}
        for side in sides:
            t_prefill, t_total = (median(times[side, w]) for w in ("prefill", "generate"))
            if t_total <= t_prefill:
                raise RuntimeError(
                    f"{side}, batch {b}: generating {new_tokens} tokens took {t_total:.2e} s, "
                    f"no longer than prefill alone ({t_prefill:.2e} s): the timer cannot "
                    "resolve the decode steps; use more --new_tokens or --repeats")
            row[side] = {"prefill_s": t_prefill, "total_s": t_total,
                         "prefill_times_s": times[side, "prefill"],
                         "total_times_s": times[side, "generate"],
                         "decode_tokens_per_s": b * (new_tokens - 1) / (t_total - t_prefill)}
        rows.append(row)
    kv = []
    for c in (cfg, cfg.replace(sliding_window=128)):
        for t in kv_contexts:
            real = cache_nbytes(init_cache(c, 1, t))
            kv.append({"sliding_window": c.sliding_window, "context": t, "real_bytes": real,
                       "predicted_bytes": kv_cache_bytes(c, t, batch=1)})
    return {"config": cfg.to_dict(), "devices": str(jax.devices()), "cpu_count": os.cpu_count(),
            "repeats": repeats, "decode": rows, "kv_cache": kv}


def _jax_contender(cfg: ModelConfig, seed: int, prompts: np.ndarray, new_tokens: int,
                   what: str) -> Callable[[], Any]:
    """In a child process: llm_jax's prefill alone, or its whole `sample` call, compiled."""
    model = init_model(cfg, seed)
    if what == "generate":
        return lambda: sample(model, prompts, max_new_tokens=new_tokens)
    graphdef, state = nnx.split(model)
    b, p = prompts.shape
    jprefill = jax.jit(lambda s, t, n: prefill(nnx.merge(graphdef, s), t, n,
                                               init_cache(cfg, b, p + new_tokens))[0])
    tokens, lengths = jnp.asarray(prompts), jnp.full((b,), p, jnp.int32)
    return lambda: jax.block_until_ready(jprefill(state, tokens, lengths))


def _packed_contender(cfg: ModelConfig, seed: int, prompts: np.ndarray, new_tokens: int,
                      what: str) -> Callable[[], Any]:
    """`_jax_contender` with the experts held packed in MXFP4 (random codes and scales)."""
    return _jax_contender(cfg.replace(expert_format="mxfp4"), seed, prompts, new_tokens, what)


def _hf_contender(cfg: ModelConfig, seed: int, prompts: np.ndarray, new_tokens: int,
                  what: str) -> Callable[[], Any]:
    """In a child process: the twin of `init_model(cfg, seed)` in transformers, its prefill (a
    forward with the cache) or its greedy `generate` of exactly `new_tokens` tokens."""
    import torch

    hf = hf_model(cfg, seed).eval()
    ids = torch.from_numpy(prompts.astype(np.int64))
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              pad_token_id=0, eos_token_id=None)

    @torch.no_grad()
    def call():
        if what == "generate":
            return hf.generate(ids, **kw)
        return hf(ids, use_cache=True)

    return call


def format_result(r: dict[str, Any]) -> str:
    rows = []
    for row in r["decode"]:
        j, h = row["llm_jax"], row.get("transformers")
        rows.append([row["batch"], row["prompt_len"], row["new_tokens"],
                     f"{j['prefill_s'] * 1e3:.1f}", f"{j['decode_tokens_per_s']:.0f}",
                     f"{h['prefill_s'] * 1e3:.1f}" if h else "-",
                     f"{h['decode_tokens_per_s']:.0f}" if h else "-",
                     f"{row['decode_speedup']:.2f}x" if h else "-"]
                    + ([f"{row[MXFP4]['decode_tokens_per_s']:.0f}",
                        f"{row['mxfp4_decode_ratio']:.2f}x"] if MXFP4 in row else []))
    mx = ["mxfp4 decode tok/s", "mxfp4 / dense"] if any(MXFP4 in row for row in r["decode"]) else []
    return (f"decode, greedy, medians of {r['repeats']}; load {r['machine']['load_average']}\n"
            + table(["batch", "prompt", "new", "llm_jax prefill ms", "llm_jax decode tok/s",
                     "transformers prefill ms", "transformers decode tok/s",
                     "decode speed-up", *mx], rows))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=lambda s: tuple(int(x) for x in s.split(",")),
                   default=(1, 8))
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--no_hf", dest="hf", action="store_false", help="skip transformers")
    p.add_argument("--mxfp4", action="store_true",
                   help="also decode with the experts held packed (expert_format=mxfp4)")


def from_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(repeats=a.repeats, quick=a.quick, batches=a.batches, prompt_len=a.prompt_len,
               new_tokens=a.new_tokens, hf=a.hf, mxfp4=a.mxfp4)
