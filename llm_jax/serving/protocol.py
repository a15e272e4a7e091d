"""The OpenAI API's request bodies (the fields this server honours), checked by pydantic, and the
response objects it returns. Unknown fields are ignored, as OpenAI-compatible servers do; a
field of the wrong type or out of range is a 400 naming it."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from llm_jax.serving.replies import HarmonyReply, Item, Piece

MAX_STOPS = 8  # OpenAI allows 4; a few more cost nothing here


class SamplingRequest(BaseModel):
    """The fields the generating routes share: length, sampling, stop strings (which
    /v1/responses does not read), streaming."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)  # None: 1, as OpenAI
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    n: StrictInt | None = Field(None, ge=1, le=1)  # one choice per prompt
    stream: StrictBool | None = False
    stop: StrictStr | list[StrictStr] | None = Field(None)
    seed: StrictInt | None = Field(None, ge=0, lt=2**31)

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"stop has {len(stops)} strings: at most {MAX_STOPS}")
        return [s for s in stops if s]


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `prompt`: text, token ids, or a list of either (one choice each)."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1)  # OpenAI's default

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        if not p:
            raise ValueError("prompt is empty: expected text, token ids or a list of them")
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr = Field(min_length=1)
    arguments: StrictStr | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    """An earlier assistant message's tool call, as the OpenAI API writes it."""

    model_config = ConfigDict(extra="ignore")
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None  # a tool result's function
    tool_call_id: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: StrictStr | None = None  # an assistant's chain of thought (vLLM's field)
    reasoning: StrictStr | None = None  # the same, as some clients name it

    def text(self) -> str:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return content or ""

    def as_dict(self) -> dict[str, Any]:
        """What a chat template reads: the role and the text."""
        return {"role": self.role, "content": self.text()}

    def as_harmony(self) -> dict[str, Any]:
        """Everything harmony renders: also reasoning, tool calls and tool results' names."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        reasoning = self.reasoning_content if self.reasoning_content is not None \
            else self.reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr = Field(min_length=1)


class NamedToolChoice(BaseModel):
    """tool_choice {"type": "function", "function": {"name": ...}}: call this function."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice
ReasoningEffort = Literal["low", "medium", "high"]


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions. On a harmony checkpoint also `tools` (OpenAI's function tools,
    their schemas checked when rendered), `tool_choice` and `reasoning_effort`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    reasoning_effort: ReasoningEffort | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def forced(self) -> str | None:
        """The function `tool_choice` names, "" for "required", None when nothing is forced."""
        c = self.tool_choice
        if isinstance(c, NamedToolChoice):
            return c.function.name
        return "" if c == "required" else None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: the `openai` client raises it as an APIStatusError subclass."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def completion(rid: str, model: str, choices: list[dict[str, Any]], prompt_tokens: int,
               completion_tokens: int, chat: bool) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def choice(index: int, text: str, finish_reason: str | None, chat: bool,
           stream: bool) -> dict[str, Any]:
    if not chat:
        return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}
    key = "delta" if stream else "message"
    body: dict[str, Any] = {"role": "assistant", "content": text} if not stream or text else {}
    return {"index": index, key: body, "finish_reason": finish_reason, "logprobs": None}


def chunk(rid: str, model: str, choices: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices}


def _call(item: Item) -> dict[str, Any]:
    return {"id": item.call_id, "type": "function",
            "function": {"name": item.name, "arguments": item.text}}


def harmony_message(reply: HarmonyReply) -> dict[str, Any]:
    """A finished harmony reply as a chat message: `content` (the answer; None when the reply
    has none), `reasoning_content` (vLLM's field; None without reasoning) and `tool_calls`."""
    kinds = {i.kind for i in reply.items}
    out: dict[str, Any] = {
        "role": "assistant", "content": reply.content() if "text" in kinds else None,
        "reasoning_content": reply.reasoning() if "reasoning" in kinds else None}
    if "call" in kinds:
        out["tool_calls"] = [_call(i) for i in reply.calls()]
    return out


def harmony_deltas(reply: HarmonyReply, pieces: list[Piece]) -> list[dict[str, Any]]:
    """Streamed chat deltas of pieces of a harmony reply, as the OpenAI API and vLLM send them:
    {"content": ...}, {"reasoning_content": ...}, and a tool call's first delta with its index,
    id, type, name and arguments "", then {"index", "function": {"arguments": ...}}."""
    out: list[dict[str, Any]] = []
    for p in pieces:
        item = reply.items[p.item]
        if item.kind == "call":
            index = sum(i.kind == "call" for i in reply.items[:p.item])
            if p.start:
                out.append({"tool_calls": [{"index": index, **_call(item),
                                            "function": {"name": item.name, "arguments": ""}}]})
            if p.text:
                out.append({"tool_calls": [{"index": index,
                                            "function": {"arguments": p.text}}]})
        elif p.text:
            key = "content" if item.kind == "text" else "reasoning_content"
            if out and list(out[-1]) == [key]:  # one chunk for consecutive text
                out[-1][key] += p.text
            else:
                out.append({key: p.text})
    return out
