"""Decode tokens/s and prefill time beside transformers' `generate`, on the same weights.

    python -m llm_jax.bench decode [--repeats 3] [--batches 1,8] [--prompt_len 128]
        [--new_tokens 256] [--no_hf]

Random weights of configs/tiny.py's model, greedy: llm_jax's on-device decode loop
(`llm_jax.sample`) against GptOssForCausalLM.generate with eager attention on the same weights,
run in a process of its own (two runtimes in one process slow each other down, bench/common.py);
and the real cache's bytes against describe.kv_cache_bytes at several contexts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llm_jax.bench.common import in_own_process, machine, table
from llm_jax.bench.train import quick_model_config, tiny_run_config
from llm_jax.config import ModelConfig
from llm_jax.inference.loop import prefill
from llm_jax.inference.sampler import sample
from llm_jax.model.kv_cache import cache_nbytes, init_cache


def run(*, repeats: int = 3, quick: bool = False, batches: tuple[int, ...] = (1, 8),
        prompt_len: int = 128, new_tokens: int = 256, hf: bool = True) -> dict[str, Any]:
    cfg = ModelConfig.from_dict(tiny_run_config().model.to_dict())
    if quick:
        cfg, batches, prompt_len, new_tokens, repeats = quick_model_config(), (1,), 8, 32, 3
    r = bench(cfg, batches=batches, prompt_len=prompt_len, new_tokens=new_tokens,
              repeats=repeats, hf=hf)
    for row in r["decode"]:
        if "transformers" in row:
            j, h = row["llm_jax"], row["transformers"]
            row["decode_speedup"] = j["decode_tokens_per_s"] / h["decode_tokens_per_s"]
            row["prefill_speedup"] = h["prefill_s"] / j["prefill_s"]
    return {"benchmark": "decode", "machine": machine(), **r}


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(cfg: ModelConfig | None = None, *, batches: Sequence[int] = (1, 8), prompt_len: int = 128,
          new_tokens: int = 256, repeats: int = 3, hf: bool = True,
          kv_contexts: Sequence[int] = (128, 512, 2048, 8192), seed: int = 0) -> dict[str, Any]:
    """Prefill time and decode tokens/s (medians of `repeats`) for random weights of `cfg`
    (default: the tiny config), beside transformers' `generate` on the same weights; and the real
    cache's bytes against describe.kv_cache_bytes at several contexts."""
    from llm_jax.model.costs import kv_cache_bytes
    from llm_jax.model import init_model

    cfg = cfg or ModelConfig()
    model = init_model(cfg, seed)
    rng = np.random.default_rng(seed)
    rows = []
    graphdef, state = nnx.split(model)
    jprefill = jax.jit(lambda s, t, n: prefill(
        nnx.merge(graphdef, s), t, n, init_cache(cfg, t.shape[0], prompt_len + new_tokens))[0])
    for b in batches:
        prompts = rng.integers(4, cfg.vocab_size, (b, prompt_len)).astype(np.int32)
        lengths = jnp.full((b,), prompt_len, jnp.int32)
        jax.block_until_ready(jprefill(state, jnp.asarray(prompts), lengths))
        t_prefill = _median_time(lambda: jax.block_until_ready(
            jprefill(state, jnp.asarray(prompts), lengths)), repeats)
        run = lambda: sample(model, prompts, max_new_tokens=new_tokens)  # noqa: E731
        t0 = time.perf_counter()
        run()
        compile_s = time.perf_counter() - t0
        t_total = _median_time(run, repeats)
        row = {"batch": b, "prompt_len": prompt_len, "new_tokens": new_tokens,
               "llm_jax": {"prefill_s": t_prefill, "total_s": t_total,
                           "first_call_s": compile_s,
                           "decode_tokens_per_s": b * (new_tokens - 1) / (t_total - t_prefill)}}
        if hf:
            row["transformers"] = in_own_process(_hf_row, cfg, seed, prompts, new_tokens,
                                                  repeats)
        rows.append(row)
    kv = []
    for c in (cfg, cfg.replace(sliding_window=128)):
        for t in kv_contexts:
            real = cache_nbytes(init_cache(c, 1, t))
            kv.append({"sliding_window": c.sliding_window, "context": t, "real_bytes": real,
                       "predicted_bytes": kv_cache_bytes(c, t, batch=1)})
    return {"config": cfg.to_dict(), "devices": str(jax.devices()), "cpu_count": os.cpu_count(),
            "repeats": repeats, "decode": rows, "kv_cache": kv}


def _hf_row(cfg: ModelConfig, seed: int, prompts: np.ndarray, new_tokens: int,
            repeats: int) -> dict[str, float]:
    """transformers' side, in a fresh process: the twin of `init_model(cfg, seed)`, timed."""
    from llm_jax.model import init_model

    return _bench_hf(_hf_twin(init_model(cfg, seed)), prompts, new_tokens, repeats)


def _hf_twin(model: nnx.Module):
    """The same weights as a transformers GptOssForCausalLM (float32, eager), via save_hf."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    import transformers

    from llm_jax.weights.formats import save_hf

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


def format_result(r: dict[str, Any]) -> str:
    rows = []
    for row in r["decode"]:
        j, h = row["llm_jax"], row.get("transformers")
        rows.append([row["batch"], row["prompt_len"], row["new_tokens"],
                     f"{j['prefill_s'] * 1e3:.1f}", f"{j['decode_tokens_per_s']:.0f}",
                     f"{h['prefill_s'] * 1e3:.1f}" if h else "-",
                     f"{h['decode_tokens_per_s']:.0f}" if h else "-",
                     f"{row['decode_speedup']:.2f}x" if h else "-"])
    return (f"decode, greedy, medians of {r['repeats']}; load {r['machine']['load_average']}\n"
            + table(["batch", "prompt", "new", "llm_jax prefill ms", "llm_jax decode tok/s",
                     "transformers prefill ms", "transformers decode tok/s",
                     "decode speed-up"], rows))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=lambda s: tuple(int(x) for x in s.split(",")),
                   default=(1, 8))
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--no_hf", dest="hf", action="store_false", help="skip transformers")


def from_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(repeats=a.repeats, quick=a.quick, batches=a.batches, prompt_len=a.prompt_len,
               new_tokens=a.new_tokens, hf=a.hf)
