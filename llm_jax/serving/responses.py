"""The OpenAI Responses API (POST /v1/responses): its request, its input items as chat messages,
and a reply's items as its output items and streamed events.

Input: a string (one user message) or a list of items: messages (`role`, text or a list of
input_text / output_text parts), `function_call` (an earlier call), `function_call_output` (its
result) and `reasoning` (earlier reasoning, `content` of reasoning_text parts); `instructions`
go first as a system message. Consecutive reasoning, assistant messages and function calls are
one assistant turn. `tools` are Responses' flat function tools ({"type": "function", "name",
"description", "parameters"}); `tool_choice` "auto" | "none" | "required" | {"type":
"function", "name"}; `reasoning={"effort": "low" | "medium" | "high"}`.

Output: one item per item of the reply (llm_jax/serving/replies.py): `reasoning` (its text in
`content` as reasoning_text), `message` (output_text) and `function_call`. Streamed, the events
are those of OpenAI's API in its order: response.created, response.in_progress, then per item
response.output_item.added, content_part.added / output_text.delta / reasoning_text.delta /
function_call_arguments.delta, their .done, output_item.done, and last response.completed (or
response.incomplete when max_output_tokens cut it), each with its sequence_number.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from llm_jax.serving.protocol import ReasoningEffort, SamplingRequest
from llm_jax.serving.replies import Item, Piece


class Reasoning(BaseModel):
    model_config = ConfigDict(extra="ignore")
    effort: ReasoningEffort | None = None


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: StrictStr = Field(min_length=1)


class ResponsesRequest(SamplingRequest):
    """POST /v1/responses."""

    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = None
    reasoning: Reasoning | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    previous_response_id: StrictStr | None = None  # refused: nothing is stored

    def forced(self) -> str | None:
        c = self.tool_choice
        if isinstance(c, FunctionChoice):
            return c.name
        return "" if c == "required" else None

    def effort(self) -> str | None:
        return self.reasoning.effort if self.reasoning else None

    def chat_tools(self) -> list[dict[str, Any]]:
        """`tools` in the chat API's nested shape (what the renderers read)."""
        out = []
        for i, t in enumerate(self.tools or []):
            if t.get("type") != "function":
                raise ValueError(f"tools[{i}].type: only 'function' tools are supported, got "
                                 f"{t.get('type')!r}")
            out.append({"type": "function", "function": {
                k: t[k] for k in ("name", "description", "parameters") if k in t}})
        return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") not in (
                    "input_text", "output_text", "text", "reasoning_text") \
                    or not isinstance(p.get("text"), str):
                raise ValueError(f"{where}[{j}]: expected a text part ({{'type': "
                                 "'input_text', 'text': ...}})")
            parts.append(p["text"])
        return "".join(parts)
    raise ValueError(f"{where}: expected a string or a list of text parts")


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key}: expected a string, got {type(value).__name__}")
    return value


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's instructions and input as chat messages (the harmony shape:
    reasoning_content, tool_calls, tool results by tool_call_id). Raises ValueError naming a
    bad field, e.g. "input[2].call_id"."""
    if body.previous_response_id is not None:
        raise ValueError("previous_response_id: this server stores no responses: send the "
                         "earlier output items in `input`")
    out: list[dict[str, Any]] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return out + [{"role": "user", "content": body.input}]
    turn: dict[str, Any] | None = None  # the assistant turn being gathered

    def assistant() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            out.append(turn)
        return turn

    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"{where}.role: expected user, system, developer or "
                                 f"assistant, got {role!r}")
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                t = assistant()
                t["content"] += text
            else:
                turn = None
                out.append({"role": role, "content": text})
        elif kind == "reasoning":
            content = item.get("content") or []
            text = _text(content, f"{where}.content")
            t = assistant()
            t["reasoning_content"] = t.get("reasoning_content", "") + text
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function", "function": {
                "name": _field(item, "name", where),
                "arguments": _field(item, "arguments", where)}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            turn = None
            out.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                        "content": _text(output, f"{where}.output")})
        else:
            raise ValueError(f"{where}.type: expected message, reasoning, function_call or "
                             f"function_call_output, got {kind!r}")
    if not any(m["role"] != "system" for m in out):
        raise ValueError("input: holds no message")
    return out


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class Output:
    """A reply's output items and, streamed, its events. The item ids (`ids`) and the event
    counter (`seq`) live here; `response()` is the Response object at any moment."""

    def __init__(self, body: ResponsesRequest, model: str, items: list[Item],
                 harmony: bool):
        self.body, self.model, self.items, self.harmony = body, model, items, harmony
        self.rid, self.created = _id("resp"), time.time()
        self.ids: dict[int, str] = {}
        self.seq = 0
        self.status, self.usage = "in_progress", None

    def _item_id(self, k: int) -> str:
        if k not in self.ids:
            prefix = {"text": "msg", "reasoning": "rs", "call": "fc"}[self.items[k].kind]
            self.ids[k] = _id(prefix)
        return self.ids[k]

    def item(self, k: int, status: str) -> dict[str, Any]:
        item, iid = self.items[k], self._item_id(k)
        if item.kind == "call":
            return {"id": iid, "type": "function_call", "call_id": item.call_id,
                    "name": item.name, "arguments": item.text, "status": status}
        if item.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": item.text}] if item.text or \
                status != "in_progress" else []
            return {"id": iid, "type": "reasoning", "summary": [], "content": content,
                    "status": status}
        out = {"id": iid, "type": "message", "role": "assistant", "status": status,
               "content": [] if status == "in_progress" and not item.text else
               [{"type": "output_text", "text": item.text, "annotations": [], "logprobs": []}]}
        if self.harmony:
            out["phase"] = "commentary" if item.channel == "commentary" else "final_answer"
        return out

    def finish(self, reason: str, input_tokens: int, output_tokens: int,
               reasoning_tokens: int) -> None:
        self.status = "incomplete" if reason == "length" else "completed"
        cache = {"cached_tokens": 0, "cache_write_tokens": 0}
        self.usage = {"input_tokens": input_tokens, "input_tokens_details": cache,
                      "output_tokens": output_tokens,
                      "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                      "total_tokens": input_tokens + output_tokens}

    def _item_status(self, k: int) -> str:
        cut = self.status == "incomplete" and k == len(self.items) - 1
        return "incomplete" if cut else "completed"

    def response(self) -> dict[str, Any]:
        b = self.body
        done = self.status != "in_progress"
        tc = b.tool_choice
        return {
            "id": self.rid, "object": "response", "created_at": self.created,
            "status": self.status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if self.status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": [self.item(k, self._item_status(k)) for k in range(len(self.items))]
            if done else [],
            "parallel_tool_calls": False, "temperature": b.temperature, "top_p": b.top_p,
            "tool_choice": tc.model_dump() if isinstance(tc, FunctionChoice) else tc or "auto",
            "tools": b.tools or [], "reasoning": {"effort": b.effort(), "summary": None},
            "text": {"format": {"type": "text"}}, "usage": self.usage,
            **({"completed_at": time.time()} if self.status == "completed" else {})}

    # -- streamed events

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def opening(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def events(self, piece: Piece) -> list[dict[str, Any]]:
        """The events of one piece of the reply."""
        k, item = piece.item, self.items[piece.item]
        where = {"item_id": self._item_id(k), "output_index": k}
        out = []
        if piece.start:
            out.append(self._event("response.output_item.added", output_index=k,
                                   item=self._start_item(k)))
            if item.kind != "call":
                out.append(self._event("response.content_part.added", **where, content_index=0,
                                       part=self._part(item.kind, "")))
        if piece.text:
            if item.kind == "call":
                out.append(self._event("response.function_call_arguments.delta", **where,
                                       delta=piece.text))
            elif item.kind == "reasoning":
                out.append(self._event("response.reasoning_text.delta", **where,
                                       content_index=0, delta=piece.text))
            else:
                out.append(self._event("response.output_text.delta", **where, content_index=0,
                                       delta=piece.text, logprobs=[]))
        if piece.end:
            if item.kind == "call":
                out.append(self._event("response.function_call_arguments.done", **where,
                                       name=item.name, arguments=item.text))
            else:
                done = ("response.reasoning_text.done" if item.kind == "reasoning"
                        else "response.output_text.done")
                extra = {} if item.kind == "reasoning" else {"logprobs": []}
                out.append(self._event(done, **where, content_index=0, text=item.text, **extra))
                out.append(self._event("response.content_part.done", **where, content_index=0,
                                       part=self._part(item.kind, item.text)))
            out.append(self._event("response.output_item.done", output_index=k,
                                   item=self.item(k, self._item_status(k))))
        return out

    def closing(self) -> list[dict[str, Any]]:
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return [self._event(kind, response=self.response())]

    def _start_item(self, k: int) -> dict[str, Any]:
        item = self.item(k, "in_progress")
        if item["type"] == "function_call":
            item["arguments"] = ""
        else:
            item["content"] = []
        return item

    @staticmethod
    def _part(kind: str, text: str) -> dict[str, Any]:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
