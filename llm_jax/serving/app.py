"""The OpenAI-compatible routes (FastAPI) over one continuous-batching `Engine`.

    GET  /health               {"status": "ok", slots, busy_slots, free_slots, waiting, steps}
    GET  /v1/models            the one model served
    POST /v1/completions       text or token-id prompts (a list of them: one choice each)
    POST /v1/chat/completions  messages through the checkpoint's chat template
    POST /v1/responses         the Responses API (llm_jax/serving/responses.py)

The POST routes take max_tokens (responses: max_output_tokens), temperature, top_p, seed and
stream (server-sent events; chat and completions end with `data: [DONE]`); chat and completions
also take stop strings. On a checkpoint whose tokenizer speaks harmony (gpt-oss), chat and
responses also take `tools`, `tool_choice` and the reasoning effort (llm_jax/serving/prompts.py),
and the reply is parsed into answer, reasoning and tool calls (llm_jax/serving/replies.py):
chat's `message.content`, `reasoning_content` and `tool_calls`, streamed as deltas of each.
The engine steps in its own thread; each request's tokens become its reply there (so a stop
string never reaches the client) and reach the event loop through one `Mailbox` (one wake-up
per batch of events). Errors are OpenAI error objects: 400 for a bad request (malformed JSON, a
wrong type, a prompt that does not fit, no chat template, a bad tool schema), 415 for a body
that is not sent as JSON, 429 when the queue is full, 503 while shutting down, 504 past the
request timeout. A client that goes away cancels its sequences, which frees their slots at the
next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import re
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from llm_jax.inference.engine import Engine
from llm_jax.inference.requests import (
    EngineClosed,
    EngineConfig,
    QueueFull,
    SamplingParams,
    Sequence,
)
from llm_jax.inference.tokenizer import CheckpointTokenizer, load_tokenizer
from llm_jax.serving import protocol, responses
from llm_jax.serving.prompts import chat_prompt
from llm_jax.serving.protocol import ChatCompletionRequest, CompletionRequest, error_body
from llm_jax.serving.replies import HarmonyReply, Piece, PlainReply
from llm_jax.serving.responses import ResponsesRequest
from llm_jax.weights.readers import load_pretrained

log = logging.getLogger(__name__)

# finish reasons of the engine that are errors, and their HTTP status
FAILURES = {"timeout": 504, "cancelled": 503, "error": 500}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(error_body(self.message, self.kind, self.param), self.status,
                            headers=headers)


@dataclasses.dataclass
class Server:
    """What the routes share: the engine (started by the app's lifespan), the tokenizer (None:
    token-id prompts only), the name the API reports, and the per-request timeout."""

    engine: Engine
    tokenizer: CheckpointTokenizer | None
    model_name: str
    request_timeout: float = 600.0
    _mailbox: Mailbox | None = None

    @classmethod
    def from_checkpoint(cls, checkpoint: str | os.PathLike, config: EngineConfig, *,
                        warmup: str = "all", dtype: str | None = None,
                        model_name: str | None = None, request_timeout: float = 600.0) -> Server:
        """The model at `checkpoint` (any format `load_pretrained` reads) in an engine of
        `config`, its tokenizer, and the name the API reports (default: the checkpoint
        folder's). `warmup`: "all" compiles the decode step and prefill of every sampling mode
        and prompt bucket before the first request, "short" those of the first bucket, "none"
        nothing (each compiles when first used)."""
        if warmup not in ("all", "short", "none"):
            raise ValueError(f"warmup={warmup!r}: expected 'all', 'short' or 'none'")
        engine = Engine(load_pretrained(checkpoint, dtype=dtype), config)
        if warmup != "none":
            engine.warmup(None if warmup == "all" else engine.prompt_buckets()[:1])
        return cls(engine, load_tokenizer(checkpoint),
                   model_name or Path(checkpoint).resolve().name, request_timeout)

    def mailbox(self) -> Mailbox:
        """The running event loop's mailbox (made on first use, inside the loop)."""
        if self._mailbox is None:
            self._mailbox = Mailbox(asyncio.get_running_loop())
        return self._mailbox


class Mailbox:
    """Moves events from the engine thread onto asyncio queues, one wake-up of the event loop per
    batch of events (an engine step makes one per running sequence) instead of one per event."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.pending, self.lock = loop, [], threading.Lock()

    def post(self, queue: asyncio.Queue, event: Any) -> None:
        with self.lock:
            self.pending.append((queue, event))
            first = len(self.pending) == 1
        if first:
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
        for queue, event in pending:
            queue.put_nowait(event)


Reply = PlainReply | HarmonyReply


class _Stream:
    """One HTTP request's sequences: their replies, and their events on the event loop's queue
    as (choice index, pieces, the engine's finish reason or None)."""

    def __init__(self, server: Server, replies: list[Reply]):
        self.mailbox = server.mailbox()
        self.queue: asyncio.Queue[tuple[int, list[Piece], str | None]] = asyncio.Queue()
        self.replies = replies
        self.seqs: list[Sequence] = []

    def listener(self, index: int):
        reply = self.replies[index]

        def on_token(seq: Sequence, token: int | None) -> bool:
            if token is None:
                pieces = reply.finish()
                if errors := reply.malformed(seq.finish_reason):
                    log.warning("malformed model output (kept as text): %s",
                                "; ".join(errors[:4]))
                self.mailbox.post(self.queue, (index, pieces, seq.finish_reason))
                return True
            pieces = reply.push(token)
            if pieces:
                self.mailbox.post(self.queue, (index, pieces, None))
            return reply.stopped

        return on_token

    def cancel(self) -> None:
        for seq in self.seqs:
            seq.cancel()


def _plain_replies(server: Server, stop: list[str], n: int) -> list[Reply]:
    decode = server.tokenizer.decode if server.tokenizer else (
        lambda ids: "".join(f" {i}" for i in ids))
    return [PlainReply(decode, stop) for _ in range(n)]


def _params(body, max_tokens: int, stop_ids: frozenset[int]) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_tokens, temperature=1.0 if body.temperature is None
        else float(body.temperature), top_p=1.0 if body.top_p is None else float(body.top_p),
        seed=random.randrange(2**31) if body.seed is None else body.seed, stop_ids=stop_ids)


def _submit(server: Server, stream: _Stream, prompts: list[list[int]], body,
            max_tokens: int | None, stop_ids: frozenset[int]) -> None:
    engine = server.engine
    try:
        for i, prompt in enumerate(prompts):
            limit = max_tokens if max_tokens is not None else engine.cfg.max_len - len(prompt)
            if limit < 1:
                raise ValueError(f"the prompt has {len(prompt)} tokens: no room left to "
                                 f"generate in max_len={engine.cfg.max_len}")
            seq = Sequence(prompt, _params(body, limit, stop_ids), stream.listener(i),
                           timeout=server.request_timeout)
            engine.submit(seq)
            stream.seqs.append(seq)
    except ValueError as e:
        stream.cancel()
        raise ApiError(400, str(e)) from None
    except QueueFull as e:
        stream.cancel()
        raise ApiError(429, str(e), "rate_limit_exceeded") from None
    except EngineClosed as e:
        stream.cancel()
        raise ApiError(503, str(e), "server_unavailable") from None


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _events(server: Server, stream: _Stream, rid: str, chat: bool) -> AsyncIterator[str]:
    name = server.model_name
    try:
        if chat:  # a harmony reply may have no content at all (a call): null, as unsent
            first = {"role": "assistant"} if isinstance(stream.replies[0], HarmonyReply) \
                else {"role": "assistant", "content": ""}
            yield _sse(protocol.chunk(rid, name, [{"index": 0, "delta": first,
                                                   "finish_reason": None, "logprobs": None}],
                                      chat))
        left = len(stream.seqs)
        while left:
            index, pieces, reason = await stream.queue.get()
            if reason in FAILURES:
                seq = stream.seqs[index]
                yield _sse(error_body(_failure_message(server, seq), "server_error"))
                return
            reply = stream.replies[index]
            finish = reply.finish_reason(reason) if reason else None
            if isinstance(reply, HarmonyReply):
                deltas = protocol.harmony_deltas(reply, pieces)
                if finish:
                    deltas.append({})
                for j, delta in enumerate(deltas):
                    last = finish if j == len(deltas) - 1 else None
                    yield _sse(protocol.chunk(rid, name, [{
                        "index": index, "delta": delta, "finish_reason": last,
                        "logprobs": None}], chat))
            else:
                delta = "".join(p.text for p in pieces)
                if delta or reason:
                    yield _sse(protocol.chunk(rid, name, [protocol.choice(
                        index, delta, finish, chat, True)], chat))
            left -= reason is not None
        yield "data: [DONE]\n\n"
    finally:  # the client is gone or the stream ended: free the slots either way
        stream.cancel()


def _failure_message(server: Server, seq: Sequence) -> str:
    if seq.finish_reason == "timeout":
        return f"the request ran past the server's request timeout ({server.request_timeout} s)"
    if seq.finish_reason == "cancelled":
        return "the server is shutting down"
    return "generation failed on the server (see its log)"


async def _collect(server: Server, stream: _Stream, request: Request) -> list[str]:
    """Waits for every sequence's end; a client that disconnects cancels them."""
    reasons: list[str | None] = [None] * len(stream.seqs)
    try:
        while any(r is None for r in reasons):
            try:
                index, _, reason = await asyncio.wait_for(stream.queue.get(), 0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise ApiError(499, "client closed the request") from None
                continue
            if reason is not None:
                reasons[index] = reason
                if reason in FAILURES:
                    raise ApiError(FAILURES[reason], _failure_message(server, stream.seqs[index]),
                                   "server_error")
    finally:
        stream.cancel()
    return reasons  # type: ignore[return-value]


def _stop_ids(server: Server, replies: list[Reply]) -> frozenset[int]:
    """The tokens that end a sequence in the engine. A harmony reply's own parser ends the turn
    at <|return|> / <|call|> (it needs to see which), so they are not among them."""
    tok = server.tokenizer
    if tok is None:
        return frozenset()
    if tok.harmony is not None and isinstance(replies[0], HarmonyReply):
        return tok.stop_ids - tok.harmony.stops
    return tok.stop_ids


def _start(server: Server, replies: list[Reply], body, prompts: list[list[int]],
           max_tokens: int | None) -> _Stream:
    stream = _Stream(server, replies)
    _submit(server, stream, prompts, body, max_tokens, _stop_ids(server, replies))
    return stream


async def _respond(server: Server, request: Request, body, prompts: list[list[int]],
                   max_tokens: int | None, chat: bool, replies: list[Reply]):
    stream = _start(server, replies, body, prompts, max_tokens)
    rid = protocol.new_id("chatcmpl" if chat else "cmpl")
    if body.stream:
        return StreamingResponse(_events(server, stream, rid, chat),
                                 media_type="text/event-stream")
    reasons = await _collect(server, stream, request)
    choices = []
    for i, (reply, reason) in enumerate(zip(replies, reasons)):
        if isinstance(reply, HarmonyReply):
            choices.append({"index": i, "message": protocol.harmony_message(reply),
                            "finish_reason": reply.finish_reason(reason), "logprobs": None})
        else:
            choices.append(protocol.choice(i, reply.text.text, reply.finish_reason(reason),
                                           chat, False))
    return JSONResponse(protocol.completion(
        rid, server.model_name, choices, sum(len(p) for p in prompts),
        sum(len(s.tokens) for s in stream.seqs), chat))


def _chat_replies(server: Server, stop: list[str], prefill: list[int]) -> list[Reply]:
    tok = server.tokenizer
    if tok is not None and tok.harmony is not None:
        return [HarmonyReply(tok.harmony, tok.decode, stop, prefill)]
    return _plain_replies(server, stop, 1)


async def _responses(server: Server, request: Request, body: ResponsesRequest):
    tok = server.tokenizer
    if tok is None:
        raise ApiError(400, "this checkpoint has no tokenizer, so no chat template: use "
                       "/v1/completions with token ids")
    try:
        messages = responses.input_messages(body)
        if tok.harmony is None:
            if body.tools:
                raise ValueError("tools: this checkpoint does not speak harmony, so it cannot "
                                 "call tools")
            messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        prompt = chat_prompt(tok, messages, tools=body.chat_tools(),
                             offer_tools=body.tool_choice != "none", forced=body.forced(),
                             reasoning_effort=body.effort())
    except ValueError as e:
        raise _bad(e, responses_tools=True) from None
    except Exception as e:  # a template's raise_exception (e.g. roles out of order)
        raise ApiError(400, f"the chat template refused these messages: {e}",
                       param="input") from None
    replies = _chat_replies(server, [], prompt.prefill)
    stream = _start(server, replies, body, [prompt.ids], body.max_output_tokens)
    reply = replies[0]
    out = responses.Output(body, server.model_name, reply.items, tok.harmony is not None)

    def finish(reason: str) -> None:
        seq = stream.seqs[0]
        thought = reply.reasoning_tokens() if isinstance(reply, HarmonyReply) else 0
        out.finish(reason, len(prompt.ids), len(seq.tokens), thought)

    if not body.stream:
        (reason,) = await _collect(server, stream, request)
        finish(reason)
        return JSONResponse(out.response())

    async def events() -> AsyncIterator[str]:
        try:
            for e in out.opening():
                yield _sse_event(e)
            while True:
                _, pieces, reason = await stream.queue.get()
                if reason in FAILURES:
                    yield _sse_event({"type": "error", "sequence_number": out.seq,
                                      "code": "server_error", "param": None,
                                      "message": _failure_message(server, stream.seqs[0])})
                    return
                if reason is not None:
                    finish(reason)
                for piece in pieces:
                    for e in out.events(piece):
                        yield _sse_event(e)
                if reason is not None:
                    for e in out.closing():
                        yield _sse_event(e)
                    return
        finally:
            stream.cancel()

    return StreamingResponse(events(), media_type="text/event-stream")


def _sse_event(obj: dict[str, Any]) -> str:
    return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n"


_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]-]*): ")


def _bad(e: ValueError, responses_tools: bool = False) -> ApiError:
    """A 400 for a request the renderers refused, `param` the field their message names."""
    message = str(e)
    m = _FIELD.match(message)
    param = m.group(1) if m else None
    if responses_tools and param and param.startswith("tools["):  # Responses' flat tools
        param = re.sub(r"^(tools\[\d+\])\.function", r"\1", param)
        message = param + message[m.end(1):]  # type: ignore[union-attr]
    return ApiError(400, message, param=param)


def _encode(server: Server, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if server.tokenizer is None:
        raise ApiError(400, "this checkpoint has no tokenizer: send the prompt as token ids",
                       param="prompt")
    return server.tokenizer.encode(prompt)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    e = errors[0]
    if e.get("type") == "json_invalid":
        return f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    loc = [x for x in e.get("loc", ()) if x != "body"]
    if len(errors) > 1:  # a union's members each failed: name the field, not the members
        n = 0
        while n < len(loc) and all(len(x.get("loc", ())) > n + 1
                                   and x["loc"][n + 1] == loc[n] for x in errors):
            n += 1
        loc = loc[:n] or loc
    field = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")
    field = field or "body"
    got = e.get("input")
    got = "" if isinstance(got, dict) else f" (got {json.dumps(got, default=repr)[:60]})"
    return f"{field}: {e.get('msg')}{got}", field


def _not_json(exc: RequestValidationError) -> bool:
    """Whether the body reached validation as raw bytes: FastAPI parses JSON only when the
    Content-Type says so (application/json, */*+json, or none at all)."""
    return any(isinstance(e.get("input"), (bytes, bytearray)) for e in exc.errors())


def create_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if server.engine.thread is None:
            server.engine.start()
        yield
        await asyncio.to_thread(server.engine.close)

    app = FastAPI(title="llm_jax", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError):
        if _not_json(exc):
            kind = request.headers.get("content-type", "")
            return ApiError(415, f"the body must be JSON sent with Content-Type: "
                            f"application/json, got Content-Type: {kind[:60]}").response()
        message, field = _validation_message(exc)
        return ApiError(400, message, param=field).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        return ApiError(500, f"internal error: {type(exc).__name__}", "server_error").response()

    @app.get("/health")
    async def health():
        engine = server.engine
        ok = not engine.closed and engine.thread is not None and engine.thread.is_alive()
        return JSONResponse({"status": "ok" if ok else "unavailable", **engine.stats()},
                            200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                            "owned_by": "llm_jax"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        try:
            prompts = [_encode(server, p) for p in body.prompts()]
            stop = body.stops()
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return await _respond(server, request, body, prompts, body.max_tokens, False,
                              _plain_replies(server, stop, len(prompts)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        tok = server.tokenizer
        if tok is None:
            raise ApiError(400, "this checkpoint has no tokenizer, so no chat template: use "
                           "/v1/completions with token ids")
        try:
            stop = body.stops()
            harmony = tok.harmony is not None
            prompt = chat_prompt(
                tok, [m.as_harmony() if harmony else m.as_dict() for m in body.messages],
                tools=body.tools, offer_tools=body.tool_choice != "none",
                forced=body.forced(), reasoning_effort=body.reasoning_effort)
        except ValueError as e:
            raise _bad(e) from None
        except Exception as e:  # a template's raise_exception (e.g. roles out of order)
            raise ApiError(400, f"the chat template refused these messages: {e}",
                           param="messages") from None
        return await _respond(server, request, body, [prompt.ids], body.limit(), True,
                              _chat_replies(server, stop, prompt.prefill))

    @app.post("/v1/responses")
    async def responses_route(body: ResponsesRequest, request: Request):
        return await _responses(server, request, body)

    return app
