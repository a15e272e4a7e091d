"""A byte-fallback BPE tokenizer (sentencepiece) that round-trips any string exactly.

Code is the default corpus, so whitespace must survive: no normalization ("identity"), no
extra-whitespace removal, no dummy prefix, whitespace-only pieces allowed (indentation becomes
a few tokens), "\\n" a piece of its own, and every other unseen character falls back to its
UTF-8 bytes. One gap remains in sentencepiece itself: it writes spaces as U+2581 ("▁") inside
pieces, so a literal "▁" in the input would decode as a space. `encode` closes the gap by
emitting a literal "▁" as its three byte-fallback tokens, which decode to "▁" again.

Special ids: pad 0, unk 1 (never produced, thanks to byte fallback), bos 2, eos 3.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile
from collections.abc import Iterable, Iterator

import numpy as np
import sentencepiece as spm

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
_SPACE = "\u2581"  # sentencepiece's stand-in for " " inside pieces
_MAX_LINE_BYTES = 1 << 16  # longer training lines are skipped by sentencepiece anyway


def _training_lines(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    """Non-empty lines of `texts` up to about `max_bytes` of UTF-8: sentencepiece's sentences."""
    seen = 0
    for text in texts:
        for line in text.split("\n"):
            if not line or len(line) > _MAX_LINE_BYTES:
                continue
            yield line
            seen += len(line.encode("utf-8")) + 1
            if seen >= max_bytes:
                return


def _raise_clear_vocab_error(err: RuntimeError, vocab_size: int) -> None:
    """Re-raises sentencepiece's size complaints as a ValueError naming the limit."""
    msg = str(err)
    if m := re.search(r"smaller than required_chars\. \d+ vs (\d+)", msg):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the byte fallback, special tokens and the "
            f"corpus' required characters need at least {m.group(1)} pieces"
        ) from err
    if m := re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", msg):
        raise ValueError(
            f"vocab_size={vocab_size} is too large for this corpus: sentencepiece can reach at "
            f"most {m.group(1)} pieces from it (add text or lower vocab_size)"
        ) from err
    raise err


class Tokenizer:
    """Text <-> token ids; a thin wrapper over a sentencepiece model proto."""

    def __init__(self, model_proto: bytes):
        self._proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self._space_ids = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in _SPACE.encode()]

    def __reduce__(self):  # Grain workers receive the model proto, not the C++ object
        return (Tokenizer, (self._proto,))

    # ------------------------------------------------------------------ building
    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        *,
        max_bytes: int = 20_000_000,
        character_coverage: float = 0.9995,
    ) -> Tokenizer:
        """BPE on the lines of `texts` (up to `max_bytes`); deterministic given the same text."""
        model = io.BytesIO()
        failed: list[Exception] = []  # sentencepiece turns the reader's errors into its own

        def lines() -> Iterator[str]:
            try:
                yield from _training_lines(texts, max_bytes)
            except Exception as e:
                failed.append(e)
                raise

        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=lines(),
                model_writer=model,
                model_type="bpe",
                vocab_size=vocab_size,
                byte_fallback=True,
                character_coverage=character_coverage,
                split_digits=True,
                allow_whitespace_only_pieces=True,
                remove_extra_whitespaces=False,
                normalization_rule_name="identity",
                add_dummy_prefix=False,
                user_defined_symbols=["\n"],
                max_sentence_length=_MAX_LINE_BYTES,
                shuffle_input_sentence=False,  # with the default sampling off, no randomness
                input_sentence_size=0,
                num_threads=1,  # BPE merges are ordered; one thread rules out any race
                pad_id=PAD_ID,
                unk_id=UNK_ID,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
                minloglevel=2,
            )
        except RuntimeError as err:
            if failed:  # e.g. a corrupt shard, named by the data source
                raise failed[0] from None
            _raise_clear_vocab_error(err, vocab_size)
        return cls(model.getvalue())

    @classmethod
    def load(cls, path: str) -> Tokenizer:
        with open(path, "rb") as f:
            return cls(f.read())

    def save(self, path: str) -> None:
        """Writes atomically, so concurrent processes never read half a model."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(self._proto)
        os.replace(tmp, path)

    # ------------------------------------------------------------------ use
    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def fingerprint(self) -> str:
        """A short hash of the model: names it in the data pipeline's resume identity."""
        return hashlib.sha256(self._proto).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str], num_threads: int = 0) -> list[list[int]]:
        """Encodes many texts at once (sentencepiece threads; 0 = all cores, which sentencepiece
        spells -1: its 0 is one thread)."""
        ids = self._sp.encode(texts, num_threads=num_threads if num_threads > 0 else -1)
        for i, text in enumerate(texts):
            if _SPACE in text:  # rare: see the module docstring
                parts = self._sp.encode(text.split(_SPACE))
                ids[i] = parts[0]
                for part in parts[1:]:
                    ids[i] = ids[i] + self._space_ids + part
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def token_byte_lengths(self) -> np.ndarray:
        """int32 [vocab]: UTF-8 bytes each token decodes to (0 for pad/unk/bos/eos).

        Sums over target tokens give the byte count for bits per byte. Exact for any sequence
        encode() produces: byte pieces are 1 byte, other pieces their text with "▁" as " ".
        """
        lengths = np.zeros(self.vocab_size, np.int32)
        for i in range(self.vocab_size):
            if self._sp.is_byte(i):
                lengths[i] = 1
            elif not (self._sp.is_control(i) or self._sp.is_unknown(i)):
                lengths[i] = len(self._sp.id_to_piece(i).replace(_SPACE, " ").encode("utf-8"))
        return lengths


def utf8_len(text: str) -> int:
    """Bytes of `text` in UTF-8: the denominator of bits per byte."""
    return len(text.encode("utf-8"))


def load_or_train(
    path: str, texts: Iterable[str], vocab_size: int, max_bytes: int
) -> Tokenizer:
    """The tokenizer at `path`; trains and saves one first if there is none.

    A saved tokenizer is reused so a resumed run keeps its token ids; one of another vocab
    size is refused rather than silently mismatching the model's embedding table.
    """
    if os.path.exists(path):
        tok = Tokenizer.load(path)
        if tok.vocab_size != vocab_size:
            raise ValueError(
                f"tokenizer at {path} has vocab_size={tok.vocab_size}, the model wants "
                f"vocab_size={vocab_size}; delete it or use another workdir"
            )
        return tok
    tok = Tokenizer.train(texts, vocab_size, max_bytes=max_bytes)
    tok.save(path)
    return tok
