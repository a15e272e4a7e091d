"""Text around token-id generation for the command line: the checkpoint's tokenizer, decoding
ids that may lie past it, and printing a stream as it arrives."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np


def find_tokenizer(path: str | Path):
    """The Tokenizer at PATH/tokenizer.model or PATH/../tokenizer.model, or None."""
    from llm_jax.data.tokenizer import Tokenizer  # on use: sentencepiece only when one is found

    for d in (Path(path), Path(path).resolve().parent):
        if (d / "tokenizer.model").is_file():
            return Tokenizer.load(str(d / "tokenizer.model"))
    return None


def text_decoder(tok) -> Callable[[list[int]], str]:
    """ids -> text with `tok`, or " 1 2 3" without one. Ids past the tokenizer's vocabulary (a
    model's padded rows) show as <id:N> rather than failing."""
    if tok is None:
        return lambda ids: "".join(f" {i}" for i in ids)

    def decode(ids: list[int]) -> str:
        out, run = [], []
        for i in ids:
            if 0 <= i < tok.vocab_size:
                run.append(i)
            else:
                out += [tok.decode(run), f"<id:{i}>"]
                run = []
        return "".join(out) + tok.decode(run)

    return decode


class TextStream:
    """Prints the new text of sequence 0 as its tokens arrive, holding back a trailing partial
    UTF-8 character (byte-fallback tokens) until it completes or the stream ends."""

    def __init__(self, decode: Callable[[list[int]], str], prefix: str = "", out=None):
        self.decode, self.prefix, self.out, self.ids, self.shown = decode, prefix, out, [], ""

    def _write(self, final: bool) -> None:
        text = self.decode(self.ids)
        if (final or not text.endswith("\ufffd")) and text.startswith(self.shown):
            out = self.out or sys.stdout
            out.write(self.prefix + text[len(self.shown):])
            self.prefix = ""
            out.flush()
            self.shown = text

    def __call__(self, step: int, tokens: np.ndarray, active: np.ndarray) -> None:
        if active[0]:
            self.ids.append(int(tokens[0]))
            self._write(final=False)

    def finish(self) -> None:
        self._write(final=True)
