"""Decode tokens/s and prefill time beside transformers' `generate`, on the same weights.

    python -m llm_jax.bench decode [--repeats 3] [--batches 1,8] [--prompt_len 128]
        [--new_tokens 256] [--no_hf]

A thin wrapper around the generation module's own benchmark (`llm_jax.generate.bench`: random
weights of configs/tiny.py's model, greedy, llm_jax's on-device decode loop against
GptOssForCausalLM.generate with eager attention), adding the speed-ups and the machine.
"""

from __future__ import annotations

import argparse
from typing import Any

from llm_jax.bench.common import machine, table
from llm_jax.bench.train import quick_model_config, tiny_run_config
from llm_jax.config import ModelConfig


def run(*, repeats: int = 3, quick: bool = False, batches: tuple[int, ...] = (1, 8),
        prompt_len: int = 128, new_tokens: int = 256, hf: bool = True) -> dict[str, Any]:
    from llm_jax.generate import bench

    cfg = ModelConfig.from_dict(tiny_run_config().model.to_dict())
    if quick:
        cfg, batches, prompt_len, new_tokens, repeats = quick_model_config(), (1,), 8, 8, 1
    r = bench(cfg, batches=batches, prompt_len=prompt_len, new_tokens=new_tokens,
              repeats=repeats, hf=hf)
    for row in r["decode"]:
        if "transformers" in row:
            j, h = row["llm_jax"], row["transformers"]
            row["decode_speedup"] = j["decode_tokens_per_s"] / h["decode_tokens_per_s"]
            row["prefill_speedup"] = h["prefill_s"] / j["prefill_s"]
    return {"benchmark": "decode", "machine": machine(), **r}


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
