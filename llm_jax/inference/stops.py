"""The text of a growing sequence of token ids, released only where it is final, and cut at the
first stop string.

Decoding ids one at a time can end inside a character (byte-fallback and byte-level BPE tokens
carry UTF-8 bytes; the partial character decodes as U+FFFD) or inside what may become a stop
string. `StopText.push` returns only the text past both, so a stream never shows a stop string
or half a character, and the text a stream shows equals the final text. `finish` releases
what was held back: bytes that never formed a character end the text as the tokenizer decodes
them (U+FFFD), so the final text is the decode of every token (cut at a stop string).
`StopCut` is the stop-string half alone, for text that arrives already decoded.
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
    ends before it); `finish()` -> whatever was held back, at the end of the sequence.

    Decoding is incremental (as transformers' TextStreamer and vLLM do): each push decodes the
    few tokens since the last complete character twice, with and without the newest, from the
    same earlier token, so a tokenizer that treats a text's first piece specially (a leading
    space) does so in both and the difference is exactly the new text; a push costs the same
    at the 1st token and the 10,000th. The stop strings are `StopCut`'s job."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self.decode = decode
        self.cut = StopCut(stop)
        self.ids: list[int] = []
        self.prefix_at = 0  # ids[prefix_at:read_at] decode to text already in `text`
        self.read_at = 0

    @property
    def text(self) -> str:
        """Everything decoded (final or held back), cut at a stop string."""
        return self.cut.text

    @property
    def stopped(self) -> bool:
        return self.cut.stopped

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token)
        prefix = self.decode(self.ids[self.prefix_at:self.read_at])
        window = self.decode(self.ids[self.prefix_at:])
        if len(window) <= len(prefix) or window.endswith(REPLACEMENT):
            return ""  # inside a character (or a token with no text yet): wait for more
        self.prefix_at, self.read_at = self.read_at, len(self.ids)
        return self.cut.push(window[len(prefix):])

    def finish(self) -> str:
        out = ""
        if not self.stopped and self.read_at < len(self.ids):  # an unfinished character
            prefix = self.decode(self.ids[self.prefix_at:self.read_at])
            out = self.cut.push(self.decode(self.ids[self.prefix_at:])[len(prefix):])
            self.read_at = len(self.ids)
        return out + self.cut.finish()


class StopCut:
    """Stop strings over text that arrives in pieces: `push(text)` -> the newly final text,
    holding back a tail that may start a stop string; `stopped` once one appeared (the text
    ends before it); `finish()` -> the rest."""

    def __init__(self, stop: Sequence[str] = ()):
        self.stop = [s for s in stop if s]
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, new: str) -> str:
        if self.stopped or not new:
            return ""
        start = len(self.text)
        self.text += new
        cut = min((i for s in self.stop
                   if (i := self.text.find(s, max(self.sent, start - len(s) + 1))) >= 0),
                  default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            return self._release(cut)
        return self._release(len(self.text) - _held_back(self.text[self.sent:], self.stop))

    def finish(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out
