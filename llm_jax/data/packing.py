"""Documents -> token rows of seq_len T that never mix documents in attention or in the loss.

A document becomes BOS + its tokens + EOS, and the element {"inputs": all but the last,
"targets": all but the first}, so every target is the next token of the same document and every
token of the text (and the EOS) is predicted once. Grain's ConcatThenSplitIterDataset then packs
the elements back to back into rows of T: a document that does not fit is split, its rest
starting the next row (with positions from 0 again). Rows carry, per token:

    inputs, targets  int32 [T]   (0 = padding)
    positions        int32 [T]   place in its document (piece): what RoPE and windows see
    segment_ids      int32 [T]   1, 2, ... per document in the row; 0 = padding

The model attends only within a nonzero segment, and the loss ignores targets of segment 0;
padding is only ever the tail of the last row of a finite (eval) split, and the empty rows
that fill out its last batch (pipeline.eval_dataset).
"""

from __future__ import annotations

import dataclasses

import grain
import numpy as np

from llm_jax.data.tokenizer import Tokenizer

ROW_KEYS = ("inputs", "targets", "positions", "segment_ids")


@dataclasses.dataclass(frozen=True)
class TokenizeDocument:
    """str -> {"inputs", "targets"} int32 [n]: one document, shifted by one (see module doc).

    Picklable (the tokenizer travels as its model proto), so it runs in Grain worker processes.
    """

    tokenizer: Tokenizer

    def __call__(self, text: str) -> dict[str, np.ndarray]:
        tok = self.tokenizer
        ids = np.asarray([tok.bos_id, *tok.encode(text), tok.eos_id], np.int32)
        return {"inputs": ids[:-1], "targets": ids[1:]}


def _row(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Grain's packed feature names -> ROW_KEYS (inputs' and targets' positions are equal)."""
    return {"inputs": packed["inputs"], "targets": packed["targets"],
            "positions": packed["inputs_positions"], "segment_ids": packed["inputs_segment_ids"]}


def pack_rows(documents: grain.IterDataset, seq_len: int) -> grain.IterDataset:
    """Rows of `seq_len` from tokenized documents (TokenizeDocument's elements), in order."""
    packed = grain.experimental.ConcatThenSplitIterDataset(
        documents, length_struct={"inputs": seq_len, "targets": seq_len})
    return packed.map(_row)


@dataclasses.dataclass(frozen=True)
class AddTargetBytes:
    """Adds "target_bytes" int32 [B, T]: UTF-8 bytes per target token (0 for pad, BOS, EOS),
    the denominator of bits per byte."""

    token_bytes: np.ndarray  # int32 [vocab], Tokenizer.token_byte_lengths()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**batch, "target_bytes": self.token_bytes[batch["targets"]]}
