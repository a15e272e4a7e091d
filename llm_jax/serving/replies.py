"""What one generation says, built as its tokens arrive: the items of a reply and the pieces that
stream them.

An item is what the OpenAI APIs show: answer text ("text"), reasoning ("reasoning") or a function
tool call ("call": a name, an id and its arguments). A `Piece` is what one token changed: an
item started, got text, or ended. `PlainReply` is a checkpoint's decoded text as one text item
(cut at stop strings by `StopText`). `HarmonyReply` parses harmony (llm_jax/data/harmony.py):
each message of the reply is an item, by its channel and recipient: the final channel and
commentary preambles are answer text, the analysis channel (and messages to tools other than
the developer's functions) reasoning, a message to `functions.NAME` a call. Stop strings cut
the answer text only.

Malformed output never raises: a channel never closed ends with the output, a message header
cut short becomes answer text, a call's arguments are kept as written (JSON or not), and
`malformed` lists what was wrong (the server logs it).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Sequence

from llm_jax.data import harmony
from llm_jax.inference.stops import StopCut, StopText


@dataclasses.dataclass
class Item:
    kind: str  # "text" (answer), "reasoning" or "call"
    text: str = ""  # the answer or reasoning text, or a call's arguments
    name: str = ""  # a call's function name
    call_id: str = ""
    done: bool = False
    channel: str | None = None  # harmony's channel (None: plain text, or outside any channel)


@dataclasses.dataclass(frozen=True)
class Piece:
    """Item `item` (of `kind`) started, got `text`, and/or ended."""

    item: int
    kind: str
    text: str = ""
    start: bool = False
    end: bool = False


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class PlainReply:
    """A checkpoint's text as one answer item, cut at the first stop string."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self.text = StopText(decode, stop)
        self.items = [Item("text")]
        self._started = False

    @property
    def stopped(self) -> bool:
        return self.text.stopped

    def push(self, token: int) -> list[Piece]:
        new = self.text.push(token)
        return self._piece(new, end=False) if new else []

    def finish(self) -> list[Piece]:
        return self._piece(self.text.finish(), end=True)

    def _piece(self, new: str, end: bool) -> list[Piece]:
        item, start = self.items[0], not self._started
        self._started = True
        item.text += new
        item.done = end
        return [Piece(0, "text", new, start=start, end=end)]

    def finish_reason(self, engine_reason: str | None) -> str:
        return engine_reason or "length"

    def malformed(self, engine_reason: str | None) -> list[str]:
        return []


class HarmonyReply:
    """A harmony reply's items, parsed from its tokens. `prefill`: ids the prompt already holds
    past `<|start|>assistant` (a forced tool call's header), parsed before the first token."""

    def __init__(self, tokens: harmony.HarmonyTokens, decode: Callable[[list[int]], str],
                 stop: Sequence[str] = (), prefill: Sequence[int] = ()):
        self.parser = harmony.Parser(tokens, decode, text=lambda: StopText(decode))
        self.stop = list(stop)
        self.items: list[Item] = []
        self._of: dict[int, int] = {}  # parser message index -> item index
        self._cuts: dict[int, StopCut] = {}  # answer item -> its stop strings
        self._open: tuple[harmony.Message, int] | None = None  # the open message, its item
        self._cut_short = False
        self._errors_at_finish = 0
        self._pending: list[Piece] = []
        for t in prefill:
            self._pending += self._take(self.parser.push(int(t)))

    @property
    def stopped(self) -> bool:
        """The turn ended (`<|return|>` / `<|call|>`) or the answer reached a stop string."""
        return self.parser.done or self._cut_short

    def push(self, token: int) -> list[Piece]:
        out = self._take(self.parser.push(token))
        if self._pending:
            out, self._pending = self._pending + out, []
        return out

    def malformed(self, engine_reason: str | None) -> list[str]:
        """What was wrong with the output. A reply that the length limit or a stop string cut
        short did not end inside a message by its own fault."""
        if engine_reason == "length" or self._cut_short:
            return self.parser.errors[:self._errors_at_finish]
        return self.parser.errors

    def finish(self) -> list[Piece]:
        self._errors_at_finish = len(self.parser.errors)
        out, self._pending = self._pending + self._take(self.parser.finish()), []
        return out + [self._end(k) for k, item in enumerate(self.items) if not item.done]

    def finish_reason(self, engine_reason: str | None) -> str:
        """"length" when cut by the token limit, "tool_calls" when the reply holds a call, else
        "stop"."""
        if engine_reason == "length":
            return "length"
        return "tool_calls" if any(i.kind == "call" for i in self.items) else "stop"

    # -- what the reply says (read once it finished)

    def content(self) -> str:
        return "".join(i.text for i in self.items if i.kind == "text")

    def reasoning(self) -> str:
        return "".join(i.text for i in self.items if i.kind == "reasoning")

    def calls(self) -> list[Item]:
        return [i for i in self.items if i.kind == "call"]

    def reasoning_tokens(self) -> int:
        """Tokens of the reasoning's content (framing tokens not counted)."""
        return sum(len(self.parser.messages[i].content_ids) for i, k in self._of.items()
                   if self.items[k].kind == "reasoning")

    # -- parser deltas -> pieces

    def _take(self, deltas: list[harmony.Delta]) -> list[Piece]:
        out = []
        for d in deltas:
            k = self._of.get(d.index)
            if k is None:  # a new message: the one before it has ended
                if self._open is not None:
                    out.append(self._end(self._open[1]))
                k = self._of[d.index] = len(self.items)
                self.items.append(self._item(d.message))
                self._open = (d.message, k)
                out.append(Piece(k, self.items[k].kind, start=True))
            item = self.items[k]
            if item.done:
                continue
            text = d.text
            if item.kind == "text" and self.stop:
                cut = self._cuts.setdefault(k, StopCut(self.stop))
                text = cut.push(text)
                self._cut_short |= cut.stopped
            if text:
                item.text += text
                out.append(Piece(k, item.kind, text))
        if self._open is not None and self._open[0].end is not None:  # closed by its token
            out.append(self._end(self._open[1]))
        return out

    def _item(self, m: harmony.Message) -> Item:
        if harmony.is_tool_call(m):
            return Item("call", name=m.recipient[len(harmony.FUNCTIONS) + 1:],  # type: ignore
                        call_id=call_id(), channel=m.channel)
        return Item("text" if harmony.is_answer(m) else "reasoning", channel=m.channel)

    def _end(self, k: int) -> Piece:
        item = self.items[k]
        if self._open is not None and self._open[1] == k:
            self._open = None
        rest = self._cuts[k].finish() if k in self._cuts else ""
        item.text += rest
        item.done = True
        return Piece(k, item.kind, rest, end=True)
