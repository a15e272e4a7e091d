"""Command line for a terminal conversation: `python -m llm_jax.chat --checkpoint PATH`.

    python -m llm_jax.chat --checkpoint PATH [--system "You are ..."] [--max_tokens 256]
        [--temperature 0.7 --top_p 0.9 --seed 0] [--max_len 4096]

Each line you type is a user message; the conversation so far goes through the checkpoint's
chat template and the reply streams as it is generated (the continuous-batching engine with
one slot, llm_jax/inference/engine.py). `/reset` starts over, `/exit` or end of input leaves.
When the conversation outgrows --max_len, the oldest turns are dropped (the system message
stays).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from llm_jax.runtime.malloc import use_preferred_malloc

if __name__ == "__main__":  # first: a restart under the preferred malloc re-imports nothing heavy
    use_preferred_malloc()

from llm_jax.inference.engine import Engine
from llm_jax.inference.requests import EngineConfig, SamplingParams, Sequence as EngineSequence
from llm_jax.inference.stops import StopText
from llm_jax.inference.tokenizer import load_tokenizer
from llm_jax.runtime.cli import ArgumentParser
from llm_jax.weights.readers import load_pretrained


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m llm_jax.chat", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="a directory `load_pretrained` reads, "
                   "with tokenizer.json and a chat template")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max_tokens", type=int, default=256, help="most new tokens per reply")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_len", type=int, default=4096, help="positions: conversation + reply")
    p.add_argument("--dtype", default=None)
    return p.parse_args(argv)


def _fit(tok, history: list[dict], max_prompt: int) -> list[int]:
    """The rendered conversation's ids, dropping the oldest turns until it fits."""
    system = [m for m in history[:1] if m["role"] == "system"]
    turns = history[len(system):]
    while True:
        ids = tok.encode(tok.render(system + turns))
        if len(ids) <= max_prompt:
            return ids
        if len(turns) <= 1:
            raise ValueError(f"the message alone takes {len(ids)} tokens: more than "
                             f"--max_len - --max_tokens = {max_prompt}")
        turns = turns[2:] if len(turns) > 2 else turns[1:]


def chat(engine, tok, args: argparse.Namespace, stdin: TextIO, stdout: TextIO) -> None:
    """The loop: read a line, reply, repeat."""
    history = [{"role": "system", "content": args.system}] if args.system else []
    params = dict(max_new_tokens=args.max_tokens, temperature=args.temperature,
                  top_p=args.top_p, stop_ids=tok.stop_ids)
    turn = 0
    while True:
        stdout.write("you> ")
        stdout.flush()
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            stdout.write("\n")
            return
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        try:
            prompt = _fit(tok, history, args.max_len - args.max_tokens)
        except ValueError as e:
            history.pop()
            stdout.write(f"[{e}]\n")
            continue
        text = StopText(tok.decode)

        def show(seq, token, text=text):
            stdout.write(text.push(token) if token is not None else text.finish())
            stdout.flush()
            return False

        stdout.write("assistant> ")
        seq = engine.submit(EngineSequence(prompt, SamplingParams(seed=args.seed + turn,
                                                                  **params), show))
        engine.run_until_idle()
        stdout.write("\n" if seq.finish_reason == "stop" else f" [{seq.finish_reason}]\n")
        history.append({"role": "assistant", "content": text.text})
        turn += 1


def main(argv: Sequence[str] | None = None, stdin: TextIO | None = None,
         stdout: TextIO | None = None) -> int:
    args = _parse_args(argv)
    try:
        tok = load_tokenizer(args.checkpoint)
        if tok is None or not tok.has_chat_template:
            raise ValueError(f"{args.checkpoint} has no tokenizer.json with a chat template")
        if not 1 <= args.max_tokens < args.max_len:
            raise ValueError(f"--max_tokens={args.max_tokens} must be in [1, --max_len="
                             f"{args.max_len})")
        model = load_pretrained(args.checkpoint, dtype=args.dtype)
        engine = Engine(model, EngineConfig(slots=1, max_len=args.max_len, max_prefill=1))
    except ValueError as e:
        print(f"llm_jax.chat: error: {e}", file=sys.stderr)
        return 2
    try:
        chat(engine, tok, args, stdin or sys.stdin, stdout or sys.stdout)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
