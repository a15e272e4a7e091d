"""The server under load: continuous batching's throughput beside `sample`, and first-token
latency of a short request that arrives while long ones run.

    python -m llm_jax.bench serve [--repeats 3] [--requests 32] [--new_tokens 128]
        [--min_prompt 16] [--max_prompt 256]

Random weights of configs/tiny.py's model, saved and served by `python -m llm_jax.serve` in a
process of its own (slots = requests, max_len as `sample` would size its cache). Throughput:
`requests` streaming greedy completions of mixed prompt lengths (token-id prompts, no EOS, so
each makes exactly new_tokens), all sent at once; aggregate tokens/s end to end (first byte sent
to last token) and in the steady window (every request streaming, from the last first token to
the first finish), beside `sample` on the same prompts as one batch in this process (end to
end, and decode = B (N - 1) / (total - prefill)). Latency: a 16-token prompt asking for one
token, alone on the idle server and while requests - 1 long requests stream (sent once all of
them have their first token, so no long prefill is in the way); medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from llm_jax.bench.common import machine, median, table
from llm_jax.bench.train import quick_model_config, tiny_run_config
from llm_jax.config import ModelConfig
from llm_jax.inference.loop import bucket, prefill
from llm_jax.inference.sampler import sample
from llm_jax.model import init_model
from llm_jax.model.kv_cache import init_cache
from llm_jax.weights.formats import save_llm_jax


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt: Path, slots: int, max_len: int, log: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llm_jax.serve", "--checkpoint", str(ckpt), "--port", str(port),
         "--slots", str(slots), "--max_len", str(max_len), "--max_queue", str(4 * slots),
         "--log_level", "warning"], stdout=log.open("w"), stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not start:\n{log.read_text()[-3000:]}")


async def _stream(client, url: str, prompt: list[int], new_tokens: int,
                  started: asyncio.Event | None = None) -> dict[str, Any]:
    """One streaming completion: when it was sent, each token's arrival time; `started` is set
    at its first token."""
    t0, times = time.perf_counter(), []
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            # a chunk with text (the client's own work is kept small: it shares the machine)
            if line.startswith("data: {") and '"text": ""' not in line:
                if '"error"' not in line:
                    times.append(time.perf_counter())
                    if started is not None:
                        started.set()
                else:
                    raise RuntimeError(f"the server sent an error: {line}")
    return {"sent": t0, "times": times}


async def _load(url: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        out = await asyncio.gather(*(_stream(client, url, p, new_tokens) for p in prompts))
    end = max(o["times"][-1] for o in out)
    tokens = sum(len(o["times"]) for o in out)
    window_start = max(o["times"][0] for o in out)  # every request streaming from here ...
    window_end = min(o["times"][-1] for o in out)  # ... to the first finish
    in_window = sum(sum(window_start < t <= window_end for t in o["times"]) for o in out)
    return {"tokens": tokens, "total_s": end - t0,
            "tokens_per_s": tokens / (end - t0),
            "steady_tokens_per_s": in_window / (window_end - window_start)
            if window_end > window_start else float("nan"),
            "first_token_s": median([o["times"][0] - o["sent"] for o in out])}


async def _latency(url: str, short: list[int], long_prompts: list[list[int]],
                   long_tokens: int, tries: int) -> dict[str, Any]:
    """First-token seconds of `short` (one new token) alone, then while the long ones run."""
    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(
            max_connections=len(long_prompts) + 4)) as client:
        alone = []
        for _ in range(tries):
            r = await _stream(client, url, short, 1)
            alone.append(r["times"][0] - r["sent"])
        started = [asyncio.Event() for _ in long_prompts]
        background = [asyncio.create_task(_stream(client, url, p, long_tokens, e))
                      for p, e in zip(long_prompts, started)]
        for e in started:  # every long request streams (all prefilled) ...
            await e.wait()
        await asyncio.sleep(0.02)
        busy = []
        for _ in range(tries):
            r = await _stream(client, url, short, 1)
            busy.append(r["times"][0] - r["sent"])
            await asyncio.sleep(0.05)
        await asyncio.gather(*background)
    return {"alone_s": median(alone), "busy_s": median(busy), "alone_times_s": alone,
            "busy_times_s": busy, "ratio": median(busy) / median(alone)}


def _sample_times(model, prompts: list[list[int]], new_tokens: int,
                  repeats: int) -> dict[str, Any]:
    """`sample` on the prompts as one batch, and its prefill alone: medians after a compile."""
    graphdef, state = nnx.split(model)
    b, p = len(prompts), bucket(max(map(len, prompts)))
    tokens = np.zeros((b, p), np.int32)
    for i, q in enumerate(prompts):
        tokens[i, :len(q)] = q
    lengths = np.asarray([len(q) for q in prompts], np.int32)
    max_len = p + bucket(new_tokens)
    jprefill = jax.jit(lambda s, t, n: prefill(nnx.merge(graphdef, s), t, n,
                                               init_cache(model.cfg, b, max_len))[0])
    total, pre = [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        sample(model, prompts, max_new_tokens=new_tokens)
        t1 = time.perf_counter()
        jax.block_until_ready(jprefill(state, tokens, lengths))
        t2 = time.perf_counter()
        if i:  # the first call compiles
            total.append(t1 - t0)
            pre.append(t2 - t1)
    t, tp = median(total), median(pre)
    return {"total_s": t, "prefill_s": tp, "tokens_per_s": b * new_tokens / t,
            "decode_tokens_per_s": b * (new_tokens - 1) / (t - tp), "total_times_s": total}


def run(*, repeats: int = 3, quick: bool = False, requests: int = 32, new_tokens: int = 128,
        min_prompt: int = 16, max_prompt: int = 256, seed: int = 0) -> dict[str, Any]:
    cfg = ModelConfig.from_dict(tiny_run_config().model.to_dict())
    if quick:
        cfg, requests, new_tokens, min_prompt, max_prompt, repeats = (
            quick_model_config(), 4, 16, 4, 24, 1)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, cfg.vocab_size, int(n)).tolist()
               for n in rng.integers(min_prompt, max_prompt + 1, requests)]
    short = rng.integers(4, cfg.vocab_size, 16).tolist()
    model = init_model(cfg, seed)
    max_len = bucket(max_prompt) + bucket(new_tokens)  # what `sample` sizes its cache to
    ref = _sample_times(model, prompts, new_tokens, repeats)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_llm_jax(model, Path(tmp) / "tiny")
        proc, url = start_server(ckpt, requests, max_len, Path(tmp) / "log")
        try:
            asyncio.run(_load(url, prompts, new_tokens))  # compiles every prompt bucket
            loads = [asyncio.run(_load(url, prompts, new_tokens)) for _ in range(repeats)]
            latency = asyncio.run(_latency(url, short, prompts[:requests - 1], new_tokens,
                                           tries=max(11, repeats)))
        finally:
            proc.terminate()
            proc.wait(60)
    server = {k: median([x[k] for x in loads]) for k in
              ("total_s", "tokens_per_s", "steady_tokens_per_s", "first_token_s")}
    return {"benchmark": "serve", "machine": machine(), "config": cfg.to_dict(),
            "requests": requests, "new_tokens": new_tokens,
            "prompt_lengths": [len(p) for p in prompts], "server_max_len": max_len,
            "repeats": repeats, "sample": ref, "server": server,
            "server_runs": loads, "latency": latency,
            "throughput_ratio": server["tokens_per_s"] / ref["tokens_per_s"],
            "steady_over_decode": server["steady_tokens_per_s"] / ref["decode_tokens_per_s"]}


def format_result(r: dict[str, Any]) -> str:
    s, v, lat = r["sample"], r["server"], r["latency"]
    rows = [
        ["sample (one batch)", f"{s['total_s']:.2f}", f"{s['tokens_per_s']:.0f}",
         f"{s['decode_tokens_per_s']:.0f} (decode)"],
        ["server (streaming)", f"{v['total_s']:.2f}", f"{v['tokens_per_s']:.0f}",
         f"{v['steady_tokens_per_s']:.0f} (steady)"],
    ]
    return "\n".join([
        f"{r['requests']} requests x {r['new_tokens']} tokens, prompts "
        f"{min(r['prompt_lengths'])}-{max(r['prompt_lengths'])} tokens",
        table(["", "total s", "tok/s end to end", "tok/s decode"], rows),
        f"throughput server / sample: {r['throughput_ratio']:.2f}x end to end, "
        f"{r['steady_over_decode']:.2f}x steady / decode",
        f"first token of a short request: alone {lat['alone_s'] * 1e3:.0f} ms, "
        f"beside {r['requests'] - 1} long ones {lat['busy_s'] * 1e3:.0f} ms "
        f"({lat['ratio']:.2f}x)"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--min_prompt", type=int, default=16)
    p.add_argument("--max_prompt", type=int, default=256)


def from_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(repeats=a.repeats, quick=a.quick, requests=a.requests, new_tokens=a.new_tokens,
               min_prompt=a.min_prompt, max_prompt=a.max_prompt)
