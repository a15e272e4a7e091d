"""Attention forward + backward as T grows: the direct T x S path against the blockwise one.

    python -m llm_jax.bench attention [--repeats 3] [--seq_lens 512,1024,2048,4096,8192]

Batch 1, the tiny config's heads (N 4 q heads, K 2 kv heads, H 64), causal, float32. Time is the
median of `repeats` calls of the jitted grad of sum(attention * cotangent) w.r.t. q, k, v and the
sinks, the two paths interleaved; memory is XLA's temp_size_in_bytes of that compiled program
(`compiled.memory_analysis()`): the scratch it needs beyond its inputs and outputs.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from llm_jax.bench.common import alternate, machine, median, table
from llm_jax.config import ModelConfig
from llm_jax.model.attention import attend, attention_mask
from llm_jax.model.blockwise_attention import DEFAULT_BLOCK, blockwise_attend, use_blockwise

SEQ_LENS = (512, 1024, 2048, 4096, 8192)


def _paths(window: int, block: int) -> dict[str, Any]:
    def direct(q, k, v, s, pos):
        return attend(q, k, v, s, attention_mask(pos, pos, window))

    def blockwise(q, k, v, s, pos):
        return blockwise_attend(q, k, v, s, pos, pos, window, block=block)

    return {"direct": direct, "blockwise": blockwise}


def _fwd_bwd(attn):
    def loss(q, k, v, s, pos, ct):
        return jnp.sum(attn(q, k, v, s, pos) * ct)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def _inputs(cfg: ModelConfig, t: int, seed: int = 0) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    n, k, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    return f(1, t, n, h), f(1, t, k, h), f(1, t, k, h), f(n), pos, f(1, t, n, h)


def run(*, repeats: int = 3, quick: bool = False, seq_lens: tuple[int, ...] | None = None,
        block: int = DEFAULT_BLOCK, window: int = 0, max_direct_len: int = 8192) -> dict[str, Any]:
    cfg = ModelConfig()
    if quick:
        seq_lens, block, repeats = seq_lens or (64, 128), 32, 1
    seq_lens = seq_lens or SEQ_LENS
    rows = []
    for t in seq_lens:
        args = _inputs(cfg, t)
        fns, row = {}, {"seq_len": t, "auto": "blockwise" if use_blockwise(
            1, t, t, cfg.num_attention_heads) else "direct"}
        for name, attn in _paths(window, block).items():
            if name == "direct" and t > max_direct_len:
                continue
            compiled = _fwd_bwd(attn).lower(*args).compile()
            mem = compiled.memory_analysis()
            row[name] = {"temp_bytes": int(mem.temp_size_in_bytes) if mem else None}
            fns[name] = lambda c=compiled: jax.block_until_ready(c(*args))
        grads = {name: fn() for name, fn in fns.items()}
        if len(grads) == 2:
            row["max_abs_grad_diff"] = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
                *grads.values()))
        for name, ts in alternate(fns, repeats=repeats).items():
            row[name]["time_s"] = median(ts)
            row[name]["times_s"] = ts
        rows.append(row)
    return {"benchmark": "attention", "machine": machine(), "repeats": repeats, "block": block,
            "window": window, "heads": {"q": cfg.num_attention_heads,
                                        "kv": cfg.num_key_value_heads, "head_dim": cfg.head_dim},
            "rows": rows}


def format_result(r: dict[str, Any]) -> str:
    def cols(x):
        if x is None:
            return ["-", "-"]
        return [f"{x['time_s'] * 1e3:.1f}", f"{x['temp_bytes'] / 2**20:.1f}"]

    rows = [[row["seq_len"], *cols(row.get("direct")), *cols(row.get("blockwise")),
             f"{row['direct']['time_s'] / row['blockwise']['time_s']:.2f}x"
             if "direct" in row else "-", row["auto"]] for row in r["rows"]]
    return (f"attention fwd+bwd, batch 1, heads {r['heads']}, block {r['block']}, "
            f"window {r['window']}; load {r['machine']['load_average']}\n"
            + table(["T", "direct ms", "direct MiB", "blockwise ms", "blockwise MiB",
                     "blockwise speed-up", "auto"], rows))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq_lens", type=lambda s: tuple(int(x) for x in s.split(",")), default=None)
    p.add_argument("--block", type=int, default=DEFAULT_BLOCK)
    p.add_argument("--window", type=int, default=0)
    p.add_argument("--max_direct_len", type=int, default=8192,
                   help="skip the direct path above this T (its memory grows as T^2)")


def from_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(repeats=a.repeats, quick=a.quick, seq_lens=a.seq_lens, block=a.block,
               window=a.window, max_direct_len=a.max_direct_len)
