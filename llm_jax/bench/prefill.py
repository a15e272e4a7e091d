"""Long-prompt prefill: time and the whole process's peak RSS, one fresh process per length.

    python -m llm_jax.bench prefill [--prompt_lens 8192,32768] [--window 128] [--repeats 5]

configs/tiny.py's model with random weights and `sliding_window` set (even layers slide), batch 1,
the jitted `inference.loop.prefill` into a cache of prompt + 16 slots. Each length runs in its
own Python process, so its peak resident memory (`ru_maxrss`, the Python runtime, JAX and the
compiled program included) is that length's alone. (--quick: one short prompt through the
benchmarks' tiny test model, `train.quick_model_config`.)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from typing import Any

from llm_jax.bench.common import machine, table


def _child(prompt_len: int, window: int, repeats: int, quick: int = 0) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from llm_jax.bench.train import quick_model_config, tiny_run_config
    from llm_jax.inference.loop import prefill
    from llm_jax.model import init_model
    from llm_jax.model.kv_cache import init_cache
    from llm_jax.training.run_config import model_config

    cfg = (quick_model_config() if quick else model_config(tiny_run_config())).replace(
        sliding_window=window)
    graphdef, state = nnx.split(init_model(cfg, 0))
    run = jax.jit(lambda s, t, n: prefill(nnx.merge(graphdef, s), t, n,
                                          init_cache(cfg, 1, prompt_len + 16))[0])
    tokens = jnp.asarray(np.random.default_rng(0).integers(4, cfg.vocab_size, (1, prompt_len)),
                         jnp.int32)
    lengths = jnp.full((1,), prompt_len, jnp.int32)
    t0 = time.perf_counter()
    jax.block_until_ready(run(state, tokens, lengths))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(state, tokens, lengths))
        times.append(time.perf_counter() - t0)
    return {"prompt_len": prompt_len, "window": window, "first_call_s": first,
            "prefill_s": sorted(times)[len(times) // 2],
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run(*, prompt_lens: tuple[int, ...] = (8192, 32768), window: int = 128, repeats: int = 2,
        quick: bool = False) -> dict[str, Any]:
    if quick:
        prompt_lens, repeats = (64,), 1
    rows = []
    for t in prompt_lens:
        out = subprocess.run([sys.executable, "-m", "llm_jax.bench.prefill", "--child", str(t),
                              str(window), str(repeats), str(int(quick))],
                             capture_output=True, text=True)
        if out.returncode:
            rows.append({"prompt_len": t, "window": window,
                         "error": out.stderr.strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {"benchmark": "prefill", "machine": machine(), "repeats": repeats, "rows": rows}


def format_result(r: dict[str, Any]) -> str:
    rows = [[x["prompt_len"], x["window"], f"{x['prefill_s']:.2f}", f"{x['first_call_s']:.1f}",
             f"{x['peak_rss_bytes'] / 2**30:.2f}"] if "error" not in x
            else [x["prompt_len"], x["window"], "failed", "-", " ".join(x["error"])]
            for x in r["rows"]]
    return (f"prefill, batch 1, medians of {r['repeats']}; load {r['machine']['load_average']}\n"
            + table(["prompt", "window", "prefill s", "first call s", "peak RSS GiB"], rows))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt_lens", type=lambda s: tuple(int(x) for x in s.split(",")),
                   default=(8192, 32768))
    p.add_argument("--window", type=int, default=128)


def from_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(prompt_lens=a.prompt_lens, window=a.window, repeats=a.repeats, quick=a.quick)


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    print(json.dumps(_child(*(int(x) for x in sys.argv[2:6]))))
