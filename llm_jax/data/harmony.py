"""The harmony format that gpt-oss reads and writes: conversations rendered into it, and generated
token ids parsed back into messages as they stream.

A harmony message is `<|start|>{header}<|message|>{content}<|end|>`. The header holds the role
(`assistant`, `user`, a tool's name such as `functions.get_weather`), the channel
(`<|channel|>analysis`, `commentary` or `final`), the recipient of a tool call (`to=functions.x`,
written in the role part or the channel part) and the content type (`<|constrain|>json`). The
model ends its turn with `<|return|>` (an answer) or `<|call|>` (a tool call); `<|end|>` closes
any other message. The system message carries the reasoning effort, the developer message the
instructions and the function tools (as TypeScript-like type declarations in a `functions`
namespace). Reference: the format's description in OpenAI's `harmony` repository
(docs/format.md).

The module lives in `data/` because the SFT pipeline renders conversations with it; the server,
the chat CLI, evaluation and RL parse generated tokens with the same `Parser`. It needs no
vocabulary file: `HarmonyTokens.find` reads the special tokens' ids from the checkpoint's own
tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

SPECIAL_TOKENS = {"start": "<|start|>", "end": "<|end|>", "message": "<|message|>",
                  "channel": "<|channel|>", "constrain": "<|constrain|>",
                  "return_": "<|return|>", "call": "<|call|>"}
REASONING_EFFORTS = ("low", "medium", "high")
CHANNELS = ("analysis", "commentary", "final")
MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
FUNCTIONS = "functions"  # the namespace of the developer's function tools


@dataclasses.dataclass(frozen=True)
class HarmonyTokens:
    """The ids of harmony's special tokens in one tokenizer."""

    start: int
    end: int
    message: int
    channel: int
    constrain: int
    return_: int
    call: int

    @classmethod
    def find(cls, token_to_id: Callable[[str], int | None]) -> HarmonyTokens | None:
        """The ids from `token_to_id` (e.g. `tokenizers.Tokenizer.token_to_id`), or None when the
        tokenizer lacks any of them (the checkpoint does not speak harmony)."""
        ids = {field: token_to_id(text) for field, text in SPECIAL_TOKENS.items()}
        if any(i is None for i in ids.values()):
            return None
        return cls(**ids)  # type: ignore[arg-type]

    @property
    def stops(self) -> frozenset[int]:
        """The tokens that end the model's turn."""
        return frozenset((self.return_, self.call))


# --------------------------------------------------------------------------- rendering

def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, None, or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    raise ValueError(f"{where}: expected a string or a list of text parts, got "
                     f"{type(content).__name__}")


def _ts_type(schema: Any, where: str) -> str:
    """A JSON schema as the TypeScript-like type harmony declares tools with."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: expected a JSON schema object, got {type(schema).__name__}")
    if "enum" in schema:
        if not isinstance(schema["enum"], list) or not schema["enum"]:
            raise ValueError(f"{where}.enum: expected a non-empty list")
        return " | ".join(json.dumps(v) for v in schema["enum"])
    for key in ("oneOf", "anyOf"):
        if key in schema:
            if not isinstance(schema[key], list):
                raise ValueError(f"{where}.{key}: expected a list of schemas")
            return " | ".join(_ts_type(s, f"{where}.{key}[{i}]")
                              for i, s in enumerate(schema[key]))
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_ts_type({**schema, "type": k}, where) for k in kind)
    if kind == "array":
        items = _ts_type(schema["items"], f"{where}.items") if "items" in schema else "any"
        return f"({items})[]" if " | " in items else f"{items}[]"
    if kind == "object":
        return _ts_object(schema, where) if schema.get("properties") else "object"
    simple = {"string": "string", "number": "number", "integer": "number",
              "boolean": "boolean", "null": "null", None: "any"}
    if kind not in simple:
        raise ValueError(f"{where}.type: {kind!r} is not a JSON schema type")
    return simple[kind]


def _ts_object(schema: dict[str, Any], where: str) -> str:
    props = schema.get("properties") or {}
    if not isinstance(props, dict):
        raise ValueError(f"{where}.properties: expected an object")
    required = schema.get("required") or []
    lines = []
    for name, prop in props.items():
        field = f"{where}.properties.{name}"
        kind = _ts_type(prop, field)
        if prop.get("description"):
            lines.append(f"// {prop['description']}")
        line = f"{name}{'' if name in required else '?'}: {kind},"
        if "default" in prop:
            d = prop["default"]
            line += f" // default: {d if isinstance(d, str) else json.dumps(d)}"
        lines.append(line)
    return "{\n" + "\n".join(lines) + "\n}"


def _function(tool: Any, where: str) -> tuple[str, str]:
    """(name, declaration) of one OpenAI-style tool: {"type": "function", "function": {...}}."""
    if not isinstance(tool, dict):
        raise ValueError(f"{where}: expected an object, got {type(tool).__name__}")
    if tool.get("type", "function") != "function":
        raise ValueError(f"{where}.type: only 'function' tools are supported, got "
                         f"{tool.get('type')!r}")
    fn = tool.get("function", tool)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}.function.name: expected a non-empty string")
    name = fn["name"]
    if not all(c.isalnum() or c in "_-" for c in name):
        raise ValueError(f"{where}.function.name: {name!r} may hold only letters, digits, _ "
                         "and -")
    params = fn.get("parameters")
    if params is not None and (not isinstance(params, dict)
                               or params.get("type", "object") != "object"):
        raise ValueError(f"{where}.function.parameters: expected a JSON schema of type object")
    head = f"// {fn['description']}\n" if fn.get("description") else ""
    if not params or not params.get("properties"):
        return name, f"{head}type {name} = () => any;"
    return name, f"{head}type {name} = (_: {_ts_object(params, where + '.function.parameters')}) => any;"


def render_tools(tools: Sequence[Any]) -> str:
    """The developer message's `# Tools` section declaring `tools` (OpenAI's function-tool
    objects) in the `functions` namespace."""
    decls = [_function(t, f"tools[{i}]")[1] for i, t in enumerate(tools)]
    return ("# Tools\n\n## functions\n\nnamespace functions {\n\n"
            + "".join(d + "\n\n" for d in decls) + "} // namespace functions")


def _tool_call(call: Any, where: str) -> tuple[str, str]:
    """(name, JSON arguments) of an assistant message's tool call (OpenAI's shape, or
    transformers' with the arguments as an object)."""
    if not isinstance(call, dict):
        raise ValueError(f"{where}: expected an object")
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}.function.name: expected a non-empty string")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args)
    return fn["name"], args


def _reasoning(m: dict[str, Any], where: str) -> str:
    """An assistant message's chain of thought: `reasoning_content` (vLLM, the OpenAI-compatible
    servers), `reasoning` or `thinking` (transformers' gpt-oss template)."""
    for key in ("reasoning_content", "reasoning", "thinking"):
        if m.get(key) is not None:
            return _text(m[key], f"{where}.{key}")
    return ""


def render_conversation(messages: Sequence[dict[str, Any]], *,
                        tools: Sequence[Any] | None = None, reasoning_effort: str = "medium",
                        current_date: str | None = None,
                        knowledge_cutoff: str = KNOWLEDGE_CUTOFF,
                        model_identity: str = MODEL_IDENTITY,
                        add_generation_prompt: bool = True) -> str:
    """`messages` (OpenAI chat messages: system / developer / user / assistant with optional
    reasoning and `tool_calls` / tool results) as harmony text, special tokens written out.

    System and developer contents become the developer message's instructions, `tools` its
    function declarations. An assistant's reasoning is kept only after the last user message
    (the turn in progress, where tool calls need it) and dropped before, as the format asks.
    With `add_generation_prompt` the text ends with `<|start|>assistant` for the model to
    continue; without, an assistant answer that is the last message ends with `<|return|>` (a
    training target)."""
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort: expected one of {REASONING_EFFORTS}, got "
                         f"{reasoning_effort!r}")
    tools = list(tools or [])
    system = f"{model_identity}\nKnowledge cutoff: {knowledge_cutoff}\n"
    if current_date:
        system += f"Current date: {current_date}\n"
    system += (f"\nReasoning: {reasoning_effort}\n\n# Valid channels: analysis, commentary, "
               "final. Channel must be included for every message.")
    if tools:
        system += "\nCalls to these tools must go to the commentary channel: 'functions'."
    out = [f"<|start|>system<|message|>{system}<|end|>"]

    instructions = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}]: expected an object with a string 'role'")
        if m["role"] in ("system", "developer"):
            instructions.append(_text(m.get("content"), f"messages[{i}].content"))
    developer = []
    if any(instructions):
        developer.append("# Instructions\n\n" + "\n\n".join(t for t in instructions if t))
    if tools:
        developer.append(render_tools(tools))
    if developer:
        out.append("<|start|>developer<|message|>" + "\n\n".join(developer) + "<|end|>")

    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    call_names: dict[str, str] = {}  # tool_call id -> function name, for tool results
    for i, m in enumerate(messages):
        role, where = m["role"], f"messages[{i}]"
        if role in ("system", "developer"):
            continue
        if role == "user":
            out.append(f"<|start|>user<|message|>{_text(m.get('content'), where + '.content')}"
                       "<|end|>")
        elif role == "assistant":
            content = _text(m.get("content"), where + ".content")
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ValueError(f"{where}.tool_calls: expected a list")
            reasoning = _reasoning(m, where)
            if reasoning and i > last_user:
                out.append(f"<|start|>assistant<|channel|>analysis<|message|>{reasoning}<|end|>")
            if content and calls:  # a preamble to the calls, shown to the user
                out.append(f"<|start|>assistant<|channel|>commentary<|message|>{content}<|end|>")
            elif content:
                last = i == len(messages) - 1 and not add_generation_prompt
                out.append(f"<|start|>assistant<|channel|>final<|message|>{content}"
                           + ("<|return|>" if last else "<|end|>"))
            for j, call in enumerate(calls):
                name, args = _tool_call(call, f"{where}.tool_calls[{j}]")
                if isinstance(call.get("id"), str):
                    call_names[call["id"]] = name
                out.append(f"<|start|>assistant<|channel|>commentary to={FUNCTIONS}.{name} "
                           f"<|constrain|>json<|message|>{args}<|call|>")
        elif role == "tool":
            name = m.get("name") or call_names.get(m.get("tool_call_id"))
            if not isinstance(name, str) or not name:
                raise ValueError(f"{where}: a tool result needs 'name' or a 'tool_call_id' of "
                                 "an earlier assistant tool call")
            name = name if name.startswith(FUNCTIONS + ".") else f"{FUNCTIONS}.{name}"
            out.append(f"<|start|>{name} to=assistant<|channel|>commentary<|message|>"
                       f"{_text(m.get('content'), where + '.content')}<|end|>")
        else:
            raise ValueError(f"{where}.role: expected system, developer, user, assistant or "
                             f"tool, got {role!r}")
    if add_generation_prompt:
        out.append("<|start|>assistant")
    return "".join(out)


# --------------------------------------------------------------------------- parsing

@dataclasses.dataclass
class Message:
    """One parsed message. `end` is "end", "call" or "return" once closed, None while open (or
    cut off by a length limit). `content` is filled as text streams in."""

    role: str
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None
    content: str = ""
    end: str | None = None
    content_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Delta:
    """What one pushed token changed: message `index` started (text ""), got `text`, or closed
    (`message.end` set; text is whatever was held back)."""

    index: int
    message: Message
    text: str


class TextDecoder(Protocol):
    """Incremental text of a growing id sequence (`llm_jax.inference.stops.StopText` is one)."""

    def push(self, token: int) -> str: ...
    def finish(self) -> str: ...


class _WholeText:
    """A TextDecoder that decodes once, at the end: for parsing whole outputs."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode, self.ids = decode, []

    def push(self, token: int) -> str:
        self.ids.append(token)
        return ""

    def finish(self) -> str:
        return self.decode(self.ids)


class Parser:
    """Generated token ids -> harmony messages, one token at a time.

    Starts inside a header whose role the prompt already wrote (`<|start|>assistant`). Text in
    a message's content goes through a `TextDecoder` per message (`text`, default: decoded
    whole when the message ends), so a stream never splits a character. `done` is set by
    `<|return|>` or `<|call|>`. Malformed output never raises and no framing token ever
    reaches a message's content: a special token out of place is dropped, text between
    messages or in a header that never closed becomes a message of no channel, and `errors`
    says what was wrong."""

    def __init__(self, tokens: HarmonyTokens, decode: Callable[[list[int]], str],
                 role: str = "assistant",
                 text: Callable[[], TextDecoder] | None = None):
        self.tokens, self.decode = tokens, decode
        self.text = text or (lambda: _WholeText(decode))
        self.messages: list[Message] = []
        self.errors: list[str] = []
        self.done = False
        self._names = {v: k for k, v in dataclasses.asdict(tokens).items()}
        self._role: str | None = role
        self._header: list[tuple[str, list[int]]] = [("role", [])]  # (part, ids)
        self._raw: list[int] = []  # every id of the header so far, special tokens included
        self._state = "header"  # header | content | between
        self._decoder: TextDecoder | None = None

    def push(self, token: int) -> list[Delta]:
        if self.done:
            self.errors.append(f"token {token} after the end of the turn (ignored)")
            return []
        kind = self._names.get(token)
        if self._state == "header":
            return self._in_header(token, kind)
        if self._state == "content":
            return self._in_content(token, kind)
        if kind == "start":
            self._new_header()
            return []
        if kind in ("return_", "call"):  # the turn ends after a closed message
            self.errors.append(f"{SPECIAL_TOKENS[kind]} after <|end|> instead of in its place")
            self.done = True
            return []
        self.errors.append("text between messages (kept as a message with no channel)")
        out = self._open(Message(role="assistant"))
        return out + self._in_content(token, kind)

    def finish(self) -> list[Delta]:
        """Ends the stream (a length limit, or a stop token already pushed): closes what is
        open and returns its held-back text."""
        if self._state == "header" and self._raw:
            self.errors.append("the output ended inside a message header (its text kept)")
            return self._header_as_text(None)
        if self._state == "content":
            if not self.done:
                self.errors.append("the output ended inside a message")
            return self._close(None)
        return []

    # -- states

    def _in_header(self, token: int, kind: str | None) -> list[Delta]:
        if kind is None:
            self._header[-1][1].append(token)
            self._raw.append(token)
            return []
        if kind in ("channel", "constrain"):
            self._header.append((kind, []))
            self._raw.append(token)
            return []
        if kind == "message":
            return self._open(self._parse_header())
        if kind == "start":
            self.errors.append("a message header was not closed before <|start|> (its text kept)")
            out = self._header_as_text(None) if self._raw else []
            self._new_header()
            return out
        # <|end|>, <|return|> or <|call|> before <|message|>: a header with a channel is a
        # message with no content (a call with no arguments); plain text stays text
        self.errors.append(f"{SPECIAL_TOKENS[kind]} inside a message header")
        self.done = kind != "end"
        end = {"end": "end", "return_": "return", "call": "call"}[kind]
        if any(part == "channel" for part, _ in self._header):
            return self._open(self._parse_header()) + self._close(end)
        return self._header_as_text(end)

    def _new_header(self) -> None:
        self._role, self._header, self._raw, self._state = None, [("role", [])], [], "header"

    def _header_as_text(self, end: str | None) -> list[Delta]:
        """A header that never reached <|message|>: a message of no channel holding its text
        (its framing tokens left out)."""
        out = self._open(Message(role=self._role or "assistant"))
        for t in self._raw:
            if t not in self._names:
                out += self._in_content(t, None)
        self._raw = []
        return out + self._close(end)

    def _in_content(self, token: int, kind: str | None) -> list[Delta]:
        if kind in ("end", "return_", "call"):
            self.done = kind != "end"
            return self._close({"end": "end", "return_": "return", "call": "call"}[kind])
        if kind == "start":
            self.errors.append("a message was not closed before <|start|>")
            out = self._close(None)
            self._new_header()
            return out
        if kind is not None:  # framing never reaches content: dropped, and reported
            self.errors.append(f"{SPECIAL_TOKENS[kind]} inside a message's content (dropped)")
            return []
        msg = self.messages[-1]
        msg.content_ids.append(token)
        new = self._decoder.push(token)  # type: ignore[union-attr]
        msg.content += new
        return [Delta(len(self.messages) - 1, msg, new)] if new else []

    def _open(self, msg: Message) -> list[Delta]:
        self.messages.append(msg)
        self._decoder, self._state = self.text(), "content"
        return [Delta(len(self.messages) - 1, msg, "")]

    def _close(self, end: str | None) -> list[Delta]:
        msg = self.messages[-1]
        rest = self._decoder.finish()  # type: ignore[union-attr]
        msg.content += rest
        msg.end, self._state, self._decoder = end, "between", None
        return [Delta(len(self.messages) - 1, msg, rest)]

    def _parse_header(self) -> Message:
        """role [to=recipient] [<|channel|>channel [to=recipient] [type]] [<|constrain|>type]"""
        msg = Message(role=self._role or "")
        extra = []
        for part, ids in self._header:
            words = self.decode(ids).split()
            if part == "constrain":
                msg.content_type = " ".join(words) or None
                continue
            if part == "channel" and words and not words[0].startswith("to="):
                msg.channel = words.pop(0)
            elif part == "role" and self._role is None and words \
                    and not words[0].startswith("to="):
                msg.role = words.pop(0)
            for w in words:
                if w.startswith("to="):
                    msg.recipient = w[3:]
                else:
                    extra.append(w)
        if extra and msg.content_type is None:
            msg.content_type = " ".join(extra)  # `<|channel|>commentary json` (no constrain)
        if not msg.role:
            self.errors.append("a message header without a role (assistant assumed)")
            msg.role = "assistant"
        if msg.channel is not None and msg.channel not in CHANNELS:
            self.errors.append(f"unknown channel {msg.channel!r}")
        return msg


def parse(tokens: HarmonyTokens, ids: Sequence[int], decode: Callable[[list[int]], str],
          role: str = "assistant") -> list[Message]:
    """Every message in generated `ids` (what followed a prompt ending in `<|start|>{role}`)."""
    parser = Parser(tokens, decode, role)
    for i in ids:
        parser.push(int(i))
    parser.finish()
    return parser.messages


# --------------------------------------------------------------------------- what a reply says

@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str  # the function's name, without the `functions.` namespace
    arguments: str  # as the model wrote them (JSON when well formed)


def is_tool_call(m: Message) -> bool:
    return m.role == "assistant" and (m.recipient or "").startswith(FUNCTIONS + ".")


def is_answer(m: Message) -> bool:
    """What the user is meant to see: the final channel, commentary preambles, and text the
    model wrote outside any channel (kept rather than lost)."""
    return m.recipient is None and m.channel != "analysis"


def is_reasoning(m: Message) -> bool:
    """Everything else: the analysis channel, and messages to recipients other than the
    developer's functions (built-in tools such as `python` or `browser.search`)."""
    return not is_answer(m) and not is_tool_call(m)


def final_text(messages: Sequence[Message]) -> str:
    """The final channel's text: the answer that evaluation and rewards read ("" when the model
    never reached it)."""
    return "".join(m.content for m in messages if m.channel == "final" and m.recipient is None)


def reasoning_text(messages: Sequence[Message]) -> str:
    return "".join(m.content for m in messages if is_reasoning(m))


def answer_text(messages: Sequence[Message]) -> str:
    return "".join(m.content for m in messages if is_answer(m))


def tool_calls(messages: Sequence[Message]) -> list[ToolCall]:
    return [ToolCall(m.recipient[len(FUNCTIONS) + 1:], m.content)  # type: ignore[index]
            for m in messages if is_tool_call(m)]
