"""A chat request as prompt token ids: the messages rendered for the checkpoint and, on a
harmony checkpoint, the tools offered, the reasoning effort, and the start of the tool call
that `tool_choice` forces.

A forced call is exact without constrained decoding: the prompt ends with the call's header
(`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` for a named function,
`<|channel|>commentary to=functions.` for "required", where the model writes the name), and the
reply's parser reads those ids before the first generated token (`ChatPrompt.prefill`).

A checkpoint with its own chat template (gpt-oss's) renders through it, the messages
reshaped to what transformers' gpt-oss template reads (`hf_tokenizer.template_messages`);
without one, llm_jax/data/harmony.py renders them as they are. A checkpoint that does not speak
harmony renders role and text through its template, tools and reasoning effort ignored, as
OpenAI-compatible servers do for models without them (/v1/responses refuses tools there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from llm_jax.data import harmony
from llm_jax.inference.tokenizer import CheckpointTokenizer


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]  # the whole prompt, prefill included
    prefill: list[int]  # its last ids: the start of the reply that the request forces


def tool_names(tools: Sequence[Any] | None) -> list[str]:
    """The function names of `tools`, each tool's schema checked: a ValueError names the bad
    field (e.g. "tools[0].function.parameters.properties.city.type: ...")."""
    tools = list(tools or [])
    harmony.render_tools(tools)
    names = [t.get("function", t)["name"] for t in tools]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise ValueError(f"tools[{names.index(dup, names.index(dup) + 1)}].function.name: "
                         f"{dup!r} is declared twice")
    return names


def forced_header(forced: str | None, names: Sequence[str]) -> str:
    """The reply's start that `tool_choice` forces: `forced` is a function's name, "" for
    "required" (any function), None for nothing."""
    if forced is None:
        return ""
    if not names:
        raise ValueError("tool_choice: forces a tool call, but the request offers no tools")
    if forced == "":
        return f"<|channel|>commentary to={harmony.FUNCTIONS}."
    if forced not in names:
        raise ValueError(f"tool_choice.function.name: {forced!r} is not one of the tools "
                         f"({', '.join(names)})")
    return f"<|channel|>commentary to={harmony.FUNCTIONS}.{forced} <|constrain|>json<|message|>"


def check_tool_results(messages: Sequence[dict[str, Any]]) -> None:
    """Each tool result names its function, or answers a call made earlier."""
    ids: set[str] = set()
    for i, m in enumerate(messages):
        for call in m.get("tool_calls") or []:
            if call.get("id"):
                ids.add(call["id"])
        if m["role"] == "tool" and not m.get("name") and m.get("tool_call_id") not in ids:
            raise ValueError(f"messages[{i}].tool_call_id: a tool result needs the id of an "
                             "earlier assistant tool call (or the function's 'name'), got "
                             f"{m.get('tool_call_id')!r}")


def chat_prompt(tok: CheckpointTokenizer, messages: Sequence[dict[str, Any]], *,
                tools: Sequence[Any] | None = None, offer_tools: bool = True,
                forced: str | None = None, reasoning_effort: str | None = None) -> ChatPrompt:
    """The prompt of a chat request. `messages` in the harmony shape
    (`protocol.ChatMessage.as_harmony`) on a harmony checkpoint, else role and content.
    `offer_tools` False (tool_choice "none"): the tools are checked but not shown to the model;
    `forced`: see `forced_header`. Raises ValueError naming a bad field."""
    if tok.harmony is None:
        return ChatPrompt(tok.encode(tok.render(list(messages))), [])
    names = tool_names(tools)
    header = forced_header(forced, names) if offer_tools else ""
    check_tool_results(messages)
    options: dict[str, Any] = {}
    if names and offer_tools:
        options["tools"] = list(tools or [])
    if reasoning_effort is not None:
        options["reasoning_effort"] = reasoning_effort
    prefill = tok.encode(header) if header else []
    return ChatPrompt(tok.encode(tok.render(list(messages), **options)) + prefill, prefill)
