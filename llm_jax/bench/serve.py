"""The server under load: continuous batching's throughput beside `sample`, and first-token
latency of a short request that arrives while long ones run.

    python -m llm_jax.bench serve [--repeats 5] [--requests 32] [--new_tokens 128]
        [--min_prompt 16] [--max_prompt 256]

Random weights of configs/tiny.py's model, saved and served by `python -m llm_jax.serve` in a
process of its own (slots = requests, max_len as `sample` would size its cache; --quick: the
same app in a thread of this one), the client a bare asyncio HTTP/1.1 reader in this process
(it shares the cores: no JSON parsing). Throughput:
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
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from llm_jax.bench.common import machine, median, table
from llm_jax.bench.train import quick_model_config, tiny_run_config
from llm_jax.inference.loop import bucket, prefill
from llm_jax.inference.sampler import sample
from llm_jax.model import init_model
from llm_jax.model.kv_cache import init_cache
from llm_jax.training.run_config import model_config
from llm_jax.weights.writers import save_llm_jax


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt: Path, slots: int, max_len: int, log: Path,
                 warmup: str = "all") -> tuple[subprocess.Popen, str]:
    """`python -m llm_jax.serve` on `ckpt` in a process of its own, once it answers /health.
    `warmup` is the server's --warmup."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llm_jax.serve", "--checkpoint", str(ckpt), "--port", str(port),
         "--slots", str(slots), "--max_len", str(max_len), "--max_queue", str(4 * slots),
         "--warmup", warmup, "--log_level", "warning"], stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not start:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def serving(ckpt: Path, slots: int, max_len: int, log: Path, *,
            quick: bool = False, warmup: str = "all") -> Iterator[str]:
    """The URL of a server on `ckpt` while it runs: `start_server`'s process, or with `quick`
    the same app (`serving.app.create_app`) under uvicorn in a thread of this process, which
    saves the process's start-up (Python, JAX and the server's imports) where only the
    wiring is measured; `warmup` as the server's --warmup."""
    if not quick:
        proc, url = start_server(ckpt, slots, max_len, log, warmup)
        try:
            yield url
        finally:
            proc.terminate()
            proc.wait(60)
        return
    import uvicorn

    from llm_jax.inference.requests import EngineConfig
    from llm_jax.serving.app import Server, create_app

    app = create_app(Server.from_checkpoint(
        ckpt, EngineConfig(slots=slots, max_len=max_len, max_queue=4 * slots), warmup=warmup))
    port = _free_port()
    # log_config=None: this process's logging configuration is left as it is.
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                                           log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="bench-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)


async def _stream(url: str, prompt: list[int], new_tokens: int,
                  started: asyncio.Event | None = None) -> dict[str, Any]:
    """One streaming completion over a bare HTTP/1.1 connection: when it was sent, each token's
    arrival time; `started` is set at its first token. The client shares the machine's cores
    with the server, so it only splits the stream into events and looks for an empty text,
    without a JSON parser or an HTTP library's per-line work."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
                       "stream": True}).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    t0, times = time.perf_counter(), []
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                 % len(body) + body)
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"the server answered {status!r}: {await reader.read()!r}")
    while await reader.readline() not in (b"\r\n", b""):  # headers
        pass
    buf = b""
    while data := await reader.read(1 << 16):
        now = time.perf_counter()
        *events, buf = (buf + data).split(b"\n\n")
        for ev in events:
            if b"data: {" in ev and b'"text": ""' not in ev:
                if b'"error"' in ev:
                    raise RuntimeError(f"the server sent an error: {ev!r}")
                times.append(now)
                if started is not None:
                    started.set()
    writer.close()
    return {"sent": t0, "times": times}


async def _load(url: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = await asyncio.gather(*(_stream(url, p, new_tokens) for p in prompts))
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
    alone = []
    for _ in range(tries):
        r = await _stream(url, short, 1)
        alone.append(r["times"][0] - r["sent"])
    started = [asyncio.Event() for _ in long_prompts]
    background = [asyncio.create_task(_stream(url, p, long_tokens, e))
                  for p, e in zip(long_prompts, started)]
    for e in started:  # every long request streams (all prefilled) ...
        await e.wait()
    await asyncio.sleep(0.02)
    busy = []
    for _ in range(tries):
        r = await _stream(url, short, 1)
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
    cfg = model_config(tiny_run_config())
    if quick:
        # Prompts of one compile bucket (16, as the latency probe's): one bucket's prefill
        # programs (the short warm-up compiles them for each row count and sampling mode).
        cfg, requests, new_tokens, min_prompt, max_prompt, repeats = (
            quick_model_config(), 4, 16, 4, 16, 1)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, cfg.vocab_size, int(n)).tolist()
               for n in rng.integers(min_prompt, max_prompt + 1, requests)]
    short = rng.integers(4, cfg.vocab_size, 16).tolist()
    model = init_model(cfg, seed)
    max_len = bucket(max_prompt) + bucket(new_tokens)  # what `sample` sizes its cache to
    ref = _sample_times(model, prompts, new_tokens, repeats)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_llm_jax(model, Path(tmp) / "tiny")
        # --quick: every prompt, and the latency probe's, is in the first bucket (16), whose
        # programs the short warm-up compiles; the others would never run.
        with serving(ckpt, requests, max_len, Path(tmp) / "log", quick=quick,
                     warmup="short" if quick else "all") as url:
            # An untimed round first: the server's warm-up compiled its programs, but not
            # everything else a first request meets.
            asyncio.run(_load(url, prompts, new_tokens))
            loads = [asyncio.run(_load(url, prompts, new_tokens)) for _ in range(repeats)]
            latency = asyncio.run(_latency(url, short, prompts[:requests - 1], new_tokens,
                                           tries=3 if quick else max(11, repeats)))
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
