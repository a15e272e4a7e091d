"""The OpenAI API's request bodies (the fields this server honours), checked by pydantic, and the
response objects it returns. Unknown fields are ignored, as OpenAI-compatible servers do; a
field of the wrong type or out of range is a 400 naming it."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

MAX_STOPS = 8  # OpenAI allows 4; a few more cost nothing here


class _Request(BaseModel):
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


class CompletionRequest(_Request):
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def as_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


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
