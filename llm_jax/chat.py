"""Command line for a terminal conversation: `python -m llm_jax.chat --checkpoint PATH`.

    python -m llm_jax.chat --checkpoint PATH [--system "You are ..."] [--max_tokens 256]
        [--temperature 0.7 --top_p 0.9 --seed 0] [--max_len 4096]
        [--reasoning_effort low|medium|high] [--hide_reasoning] [--tools tools.json]

Each line you type is a user message; the conversation so far goes through the checkpoint's
chat template and the reply streams as it is generated (the continuous-batching engine with
one slot, llm_jax/inference/engine.py). `/reset` starts over, `/exit` or end of input leaves.
When the conversation leaves less than --max_tokens of --max_len for the reply, the oldest
exchanges are dropped (the system message stays).

A checkpoint that speaks harmony (gpt-oss) streams its reply parsed into messages: reasoning
(the analysis channel) dimmed on a terminal and marked `[reasoning]` elsewhere, or hidden with
--hide_reasoning; the answer plain; a tool call as `[tool call] name(arguments)`, after which
you type the tool's result at the `tool name>` prompt and the model goes on. --tools names a
JSON file holding a list of OpenAI function tools, declared to the model; --reasoning_effort
sets the system message's. The history keeps each assistant turn with its reasoning and tool
calls, so the renderer keeps or drops old reasoning as the format says.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TextIO

from llm_jax.runtime.malloc import use_preferred_malloc

if __name__ == "__main__":  # first: a restart under the preferred malloc re-imports nothing heavy
    use_preferred_malloc()

from llm_jax.data import harmony
from llm_jax.inference.engine import Engine
from llm_jax.inference.requests import EngineConfig, SamplingParams, Sequence as EngineSequence
from llm_jax.inference.stops import StopText
from llm_jax.inference.tokenizer import load_tokenizer
from llm_jax.runtime.cli import ArgumentParser, float_dtype
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
    p.add_argument("--dtype", type=float_dtype, default=None)
    p.add_argument("--reasoning_effort", choices=harmony.REASONING_EFFORTS, default=None,
                   help="harmony checkpoints: the system message's reasoning effort")
    p.add_argument("--hide_reasoning", action="store_true",
                   help="harmony checkpoints: show only the answer and tool calls")
    p.add_argument("--tools", default=None, help="harmony checkpoints: a JSON file with a list "
                   "of OpenAI function tools the model may call")
    return p.parse_args(argv)


def _options(args: argparse.Namespace, tok) -> dict:
    """The renderer's options from the flags; refuses harmony's flags on other checkpoints."""
    options = {}
    if tok.harmony is None:
        for flag in ("reasoning_effort", "tools"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag} needs a checkpoint that speaks harmony (harmony's "
                                 f"special tokens in its tokenizer.json)")
        return options
    if args.reasoning_effort is not None:
        options["reasoning_effort"] = args.reasoning_effort
    if args.tools is not None:
        try:
            with open(args.tools, encoding="utf-8") as f:
                tools = json.load(f)
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"--tools {args.tools}: {e}") from e
        if not isinstance(tools, list):
            raise ValueError(f"--tools {args.tools}: expected a JSON list of function tools")
        try:
            harmony.render_tools(tools)
        except ValueError as e:
            raise ValueError(f"--tools {args.tools}: {e}") from e
        options["tools"] = tools
    return options


def fit_conversation(tok, history: list[dict], max_prompt: int,
                     options: dict | None = None) -> list[int]:
    """The rendered conversation's ids, dropping the oldest exchanges (a user message and what
    followed it) until it fits."""
    system = [m for m in history[:1] if m["role"] == "system"]
    turns = history[len(system):]
    while True:
        ids = tok.encode(tok.render(system + turns, **(options or {})))
        if len(ids) <= max_prompt:
            return ids
        later = next((i for i, m in enumerate(turns) if i > 0 and m["role"] == "user"), None)
        if later is None:
            what = "the message alone" if len(turns) == 1 else "this exchange"
            raise ValueError(f"{what} takes {len(ids)} tokens: more than --max_len - "
                             f"--max_tokens = {max_prompt}")
        turns = turns[later:]


DIM, RESET = "\x1b[2m", "\x1b[0m"


class _Reply:
    """Shows a harmony reply as the parser's deltas arrive: one line per message, reasoning
    dimmed (a terminal) or marked (elsewhere) or hidden, tool calls as name(arguments)."""

    def __init__(self, stdout: TextIO, hide_reasoning: bool):
        self.out, self.hide = stdout, hide_reasoning
        self.dim = stdout.isatty()
        self.shown = 0  # messages shown so far
        self.current: int | None = None
        self.close = ""  # what ends the message being shown
        self.hidden = False

    def show(self, deltas: list[harmony.Delta]) -> None:
        for d in deltas:
            if d.index != self.current:
                self.end()
                self.current, self.hidden = d.index, False
                self._open(d.message)
            if not self.hidden:
                self.out.write(d.text)
        self.out.flush()

    def end(self) -> None:
        if self.current is not None and not self.hidden:
            self.out.write(self.close)
        self.current, self.close = None, ""

    def _open(self, m: harmony.Message) -> None:
        if harmony.is_reasoning(m) and self.hide:
            self.hidden = True
            return
        self.out.write("\n" if self.shown else "")
        self.shown += 1
        if harmony.is_tool_call(m):
            name = m.recipient[len(harmony.FUNCTIONS) + 1:]  # type: ignore[index]
            self.out.write(f"[tool call] {name}(")
            self.close = ")"
        elif harmony.is_reasoning(m):
            self.out.write(DIM if self.dim else "[reasoning] ")
            self.close = RESET if self.dim else ""


def assistant_turn(messages: list[harmony.Message], first_call: int) -> dict:
    """A parsed reply as the chat message the renderer reads back: its reasoning, its answer and
    its tool calls (ids from `first_call`)."""
    turn: dict = {"role": "assistant"}
    reasoning, answer = harmony.reasoning_text(messages), harmony.answer_text(messages)
    if reasoning:
        turn["reasoning_content"] = reasoning
    calls = harmony.tool_calls(messages)
    turn["content"] = answer or (None if calls else "")
    if calls:
        turn["tool_calls"] = [{"id": f"call_{first_call + k}", "type": "function",
                               "function": {"name": c.name, "arguments": c.arguments}}
                              for k, c in enumerate(calls)]
    return turn


def chat(engine, tok, args: argparse.Namespace, stdin: TextIO, stdout: TextIO,
         options: dict | None = None) -> list[dict]:
    """The loop: read a line, reply, repeat. Returns the conversation as it stands at the end."""
    history = [{"role": "system", "content": args.system}] if args.system else []
    params = dict(max_new_tokens=args.max_tokens, temperature=args.temperature,
                  top_p=args.top_p, stop_ids=tok.stop_ids)
    if tok.harmony is not None:  # the parser sees <|return|> and <|call|> and stops the turn
        params["stop_ids"] = tok.stop_ids - tok.harmony.stops
    turn = 0
    while True:
        stdout.write("you> ")
        stdout.flush()
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            stdout.write("\n")
            return history
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        while True:  # the assistant's turn: replies, and tool results typed in between
            try:
                prompt = fit_conversation(tok, history, args.max_len - args.max_tokens,
                                          options)
            except ValueError as e:
                del history[max(i for i, m in enumerate(history) if m["role"] == "user"):]
                stdout.write(f"[{e}]\n")
                break
            stdout.write("assistant> ")
            sampling = SamplingParams(seed=args.seed + turn, **params)
            turn += 1
            if tok.harmony is None:
                history.append({"role": "assistant",
                                "content": _plain_reply(engine, prompt, sampling, tok, stdout)})
                break
            reply = _harmony_reply(engine, prompt, sampling, tok, stdout, args.hide_reasoning)
            calls = sum(len(m.get("tool_calls") or []) for m in history)
            history.append(assistant_turn(reply, calls))
            if not history[-1].get("tool_calls"):
                break
            for call in history[-1]["tool_calls"]:
                name = call["function"]["name"]
                stdout.write(f"tool {name}> ")
                stdout.flush()
                result = stdin.readline()
                if not result:
                    stdout.write("\n")
                    return history
                history.append({"role": "tool", "tool_call_id": call["id"], "name": name,
                                "content": result.rstrip("\n")})


def _plain_reply(engine, prompt: list[int], sampling: SamplingParams, tok,
                 stdout: TextIO) -> str:
    """Streams the reply as text; returns it."""
    text = StopText(tok.decode)

    def show(seq, token):
        stdout.write(text.push(token) if token is not None else text.finish())
        stdout.flush()
        return False

    seq = engine.submit(EngineSequence(prompt, sampling, show))
    engine.run_until_idle()
    stdout.write("\n" if seq.finish_reason == "stop" else f" [{seq.finish_reason}]\n")
    return text.text


def _harmony_reply(engine, prompt: list[int], sampling: SamplingParams, tok, stdout: TextIO,
                   hide_reasoning: bool) -> list[harmony.Message]:
    """Streams the reply parsed into harmony messages; returns them."""
    parser = harmony.Parser(tok.harmony, tok.decode, text=lambda: StopText(tok.decode))
    reply = _Reply(stdout, hide_reasoning)

    def show(seq, token):
        reply.show(parser.push(token) if token is not None else parser.finish())
        return parser.done

    seq = engine.submit(EngineSequence(prompt, sampling, show))
    engine.run_until_idle()
    reply.end()
    stdout.write("\n" if seq.finish_reason == "stop" else f" [{seq.finish_reason}]\n")
    return parser.messages


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
        options = _options(args, tok)
        model = load_pretrained(args.checkpoint, dtype=args.dtype)
        engine = Engine(model, EngineConfig(slots=1, max_len=args.max_len, max_prefill=1))
    except ValueError as e:
        print(f"llm_jax.chat: error: {e}", file=sys.stderr)
        return 2
    try:
        chat(engine, tok, args, stdin or sys.stdin, stdout or sys.stdout, options)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
