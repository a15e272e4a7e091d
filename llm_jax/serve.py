"""Command line for the OpenAI-compatible server: `python -m llm_jax.serve --checkpoint PATH`.

    python -m llm_jax.serve --checkpoint PATH [--host 127.0.0.1 --port 8000] [--slots 16]
        [--max_len 2048] [--max_queue 64] [--max_prefill 8] [--request_timeout 600]
        [--warmup all|short|none]

The checkpoint is any directory `llm_jax.load_pretrained` reads; its tokenizer and chat
template come from the same directory (llm_jax/inference/tokenizer.py). A tokenizer with
harmony's special tokens (gpt-oss) makes chat and /v1/responses parse replies into answer,
reasoning and tool calls and take tools, tool_choice and the reasoning effort. The routes are in
llm_jax/serving/app.py, the continuous batching in llm_jax/inference/engine.py (docs/generation.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from llm_jax.runtime.malloc import use_preferred_malloc

if __name__ == "__main__":  # first: a restart under the preferred malloc re-imports nothing heavy
    use_preferred_malloc()

from llm_jax.inference.requests import EngineConfig
from llm_jax.runtime.cli import ArgumentParser, float_dtype
from llm_jax.serving.app import Server, create_app


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m llm_jax.serve", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="llm_jax workdir/checkpoint, Hugging Face "
                   "directory or OpenAI original/ directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model_name", default=None, help="the model id the API reports "
                   "(default: the checkpoint directory's name)")
    p.add_argument("--slots", type=int, default=16, help="sequences decoded together")
    p.add_argument("--max_len", type=int, default=2048, help="positions per slot: prompt + "
                   "new tokens")
    p.add_argument("--max_queue", type=int, default=64, help="waiting requests before 429")
    p.add_argument("--max_prefill", type=int, default=8, help="prompts prefilled in one call")
    p.add_argument("--request_timeout", type=float, default=600.0, help="seconds per request, "
                   "waiting included")
    p.add_argument("--dtype", type=float_dtype, default=None,
                   help="load weights and compute in this dtype")
    p.add_argument("--cache_dtype", type=float_dtype, default=None,
                   help="KV-cache dtype (default: compute dtype)")
    p.add_argument("--warmup", choices=("all", "short", "none"), default="all",
                   help="before listening, compile the decode step and prefill of every "
                   "sampling mode for every prompt length bucket up to --max_len (all), for "
                   "prompts up to 16 tokens (short), or nothing (compile on first use)")
    p.add_argument("--log_level", default="info")
    return p.parse_args(argv)


def build_server(args: argparse.Namespace):
    """(the Server, its app): the model, tokenizer and engine, warmed up unless told not to."""
    server = Server.from_checkpoint(
        args.checkpoint, EngineConfig(slots=args.slots, max_len=args.max_len,
                                      max_queue=args.max_queue, max_prefill=args.max_prefill,
                                      cache_dtype=args.cache_dtype),
        warmup=args.warmup, dtype=args.dtype, model_name=args.model_name,
        request_timeout=args.request_timeout)
    return server, create_app(server)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    try:
        server, app = build_server(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"llm_jax.serve: error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    print(f"llm_jax.serve: {server.model_name} on http://{args.host}:{args.port} "
          f"({args.slots} slots x {args.max_len} positions)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
