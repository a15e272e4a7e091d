"""The server on a harmony checkpoint: throughput with the reply parsed into harmony's channels
(/v1/chat/completions) beside the same tokens served raw (/v1/completions).

    python -m llm_jax.bench serve_harmony [--repeats 5] [--requests 16] [--new_tokens 128]

Random weights of configs/tiny.py's model with a byte-level BPE tokenizer that holds harmony's
special tokens (its vocabulary is the model's), saved and served by `python -m llm_jax.serve` in
a process of its own (slots = requests; --quick: in a thread of this one). Each request is a
chat whose `tool_choice` names a function, so the prompt ends inside the call's header and every
generated token is parsed and streamed as the call's arguments (random weights would otherwise
wander in a message header, which streams nothing). The raw contender sends the same prompt ids
(rendered here with llm_jax/serving/prompts.py) to /v1/completions: the same greedy tokens,
decoded by `StopText` alone. Every request makes exactly new_tokens (each stream must end with
finish_reason "length"); throughput = requests x new_tokens / (first byte sent to last event),
the two contenders alternating, medians. Beside it, the in-process cost per token of building a
reply (`PlainReply` against `HarmonyReply`, best of repeats), which a loaded host cannot blur.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from llm_jax.bench.common import machine, median, table
from llm_jax.bench.serve import serving
from llm_jax.bench.train import quick_model_config, tiny_run_config
from llm_jax.data import harmony
from llm_jax.inference.loop import bucket
from llm_jax.inference.tokenizer import load_tokenizer
from llm_jax.model import init_model
from llm_jax.serving.prompts import chat_prompt
from llm_jax.serving.replies import HarmonyReply, PlainReply
from llm_jax.training.run_config import model_config
from llm_jax.weights.writers import save_llm_jax

TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Looks a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}
WORDS = ("the cat sat on a mat while birds sang in the park and blue water ran under old "
         "bridges; numbers 0123456789, signs ☀ ✓ é ü, and JSON {\"a\": [1, 2]}").split()


def harmony_tokenizer(path: Path, vocab: int) -> int:
    """Writes a byte-level BPE tokenizer.json with harmony's special tokens; returns its size."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(harmony.SPECIAL_TOKENS.values()),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    text = harmony.render_conversation([{"role": "user", "content": " ".join(WORDS)}],
                                       tools=[TOOL])
    tok.train_from_iterator([text] + [" ".join(WORDS[i:] + WORDS[:i]) for i in
                                      range(len(WORDS))], trainer)
    tok.save(str(path / "tokenizer.json"))
    return tok.get_vocab_size(with_added_tokens=True)


async def _stream(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streaming request on a bare HTTP/1.1 connection: when it was sent, when its last
    event came, and whether it ended at the length limit."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    t0 = time.perf_counter()
    writer.write(b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (path.encode(), len(data))
                 + data)
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"the server answered {status!r}: {await reader.read()!r}")
    last, tail = t0, b""
    while chunk := await reader.read(1 << 16):
        last, tail = time.perf_counter(), (tail + chunk)[-400:]
    writer.close()
    return {"sent": t0, "last": last, "length": b'"finish_reason": "length"' in tail}


async def _load(url: str, path: str, bodies: list[dict[str, Any]], new_tokens: int) -> float:
    t0 = time.perf_counter()
    out = await asyncio.gather(*(_stream(url, path, b) for b in bodies))
    if not all(o["length"] for o in out):
        raise RuntimeError("a request stopped before new_tokens: the throughput would mislead")
    return len(bodies) * new_tokens / (max(o["last"] for o in out) - t0)


def parse_cost(tok, repeats: int) -> dict[str, float]:
    """Microseconds per token of turning tokens into a reply in-process, best of `repeats`:
    `PlainReply` (what raw serving does) and `HarmonyReply` (that, plus harmony's parser), on
    one long final-channel message."""
    body = " ".join(WORDS * 20)
    ids = tok.encode(f"<|channel|>final<|message|>{body}<|return|>")
    out = {}
    for name, make in (("plain", lambda: PlainReply(tok.decode)),
                       ("harmony", lambda: HarmonyReply(tok.harmony, tok.decode))):
        best = float("inf")
        for _ in range(max(3, repeats)):
            reply, t0 = make(), time.perf_counter()
            for i in ids:
                reply.push(i)
            reply.finish()
            best = min(best, time.perf_counter() - t0)
        out[name] = best / len(ids) * 1e6
    return out


def run(*, repeats: int = 5, quick: bool = False, requests: int = 16,
        new_tokens: int = 128) -> dict[str, Any]:
    cfg = model_config(tiny_run_config())
    vocab = 1024
    if quick:
        cfg, vocab, requests, new_tokens, repeats = quick_model_config(), 300, 2, 8, 1
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "harmony"
        ckpt.mkdir()
        cfg = cfg.replace(vocab_size=harmony_tokenizer(ckpt, vocab))
        save_llm_jax(init_model(cfg, 0), ckpt)
        tok = load_tokenizer(ckpt)
        cost = parse_cost(tok, repeats)
        chats = [[{"role": "user", "content": " ".join(WORDS[: 4 + 3 * i % len(WORDS)])}]
                 for i in range(requests)]
        choice = {"type": "function", "function": {"name": "lookup"}}
        prompts = [chat_prompt(tok, m, tools=[TOOL], forced="lookup").ids for m in chats]
        common = {"max_tokens": new_tokens, "temperature": 0, "stream": True}
        parsed = [{"messages": m, "tools": [TOOL], "tool_choice": choice, **common}
                  for m in chats]
        raw = [{"prompt": p, **common} for p in prompts]
        max_len = bucket(max(map(len, prompts))) + bucket(new_tokens)
        # --quick: no warm-up; the untimed first load compiles the one prompt bucket it uses.
        with serving(ckpt, requests, max_len, Path(tmp) / "log", quick=quick,
                     warmup="none" if quick else "all") as url:
            asyncio.run(_load(url, "/v1/completions", raw, new_tokens))  # untimed
            runs: dict[str, list[float]] = {"parsed": [], "raw": []}
            for _ in range(repeats):
                runs["raw"].append(asyncio.run(_load(url, "/v1/completions", raw, new_tokens)))
                runs["parsed"].append(asyncio.run(_load(url, "/v1/chat/completions", parsed,
                                                        new_tokens)))
    result = {k: median(v) for k, v in runs.items()}
    return {"benchmark": "serve_harmony", "machine": machine(), "config": cfg.to_dict(),
            "requests": requests, "new_tokens": new_tokens, "repeats": repeats,
            "prompt_lengths": [len(p) for p in prompts], "runs_tokens_per_s": runs,
            "parsed_tokens_per_s": result["parsed"], "raw_tokens_per_s": result["raw"],
            "parsed_over_raw": result["parsed"] / result["raw"],
            "parse_us_per_token": cost}


def format_result(r: dict[str, Any]) -> str:
    rows = [["chat, parsed as harmony", f"{r['parsed_tokens_per_s']:.0f}"],
            ["completions, raw", f"{r['raw_tokens_per_s']:.0f}"]]
    return "\n".join([
        f"{r['requests']} streaming requests x {r['new_tokens']} tokens, prompts "
        f"{min(r['prompt_lengths'])}-{max(r['prompt_lengths'])} tokens",
        table(["", "tok/s end to end"], rows),
        f"parsed / raw: {r['parsed_over_raw']:.3f}",
        f"in-process reply building per token: plain {r['parse_us_per_token']['plain']:.1f} us, "
        f"harmony {r['parse_us_per_token']['harmony']:.1f} us"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new_tokens", type=int, default=128)


def from_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(repeats=a.repeats, quick=a.quick, requests=a.requests, new_tokens=a.new_tokens)
