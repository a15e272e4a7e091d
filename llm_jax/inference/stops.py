"""The text of a growing sequence of token ids, released only where it is final, and cut at the
first stop string.

Decoding ids one at a time can end inside a character (byte-fallback and byte-level BPE tokens
carry UTF-8 bytes; the partial character decodes as U+FFFD) or inside what may become a stop
string. `StopText.push` returns only the text past both, so a stream never shows a stop string
or half a character, and the text a stream shows equals the final text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` may still start a stop string (or finish a
    character)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    if text.endswith(REPLACEMENT):
        hold = max(hold, len(text) - len(text.rstrip(REPLACEMENT)))
    return hold


class StopText:
    """`push(token)` -> the newly final text; `stopped` once a stop string appeared (the text
    ends before it); `finish()` -> whatever was held back, at the end of the sequence."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # everything final or held back, cut at a stop string
        self.sent = 0  # characters of `text` already returned
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token)
        text = self.decode(self.ids)
        if not text.startswith(self.text[:self.sent]):  # a tokenizer that rewrote earlier text
            return ""
        cut = min((i for s in self.stop if (i := text.find(s, max(0, self.sent - len(s) + 1)))
                   >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self._release(len(self.text))
        self.text = text
        return self._release(len(text) - _held_back(text[self.sent:], self.stop))

    def finish(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out
