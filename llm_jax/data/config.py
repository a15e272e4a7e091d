"""DataConfig: the `data` section of the run config as a frozen, validated dataclass.

The run config keeps the section as an ml_collections ConfigDict so the CLI can override
`--config.data.seq_len=128`; the data pipeline takes this dataclass instead, so that a typo'd
or out-of-range field fails at start-up, by name, not deep inside TFDS or Grain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# What the SFT reader does with a malformed JSONL line (run config `sft.on_bad_line`), and the
# local text source with an empty, unreadable, binary or non-UTF-8 file (`data.on_bad_file`).
ON_BAD_LINE = ("skip", "stop")
ON_BAD_FILE = ("skip", "stop")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it is cut into batches (see run_config.py)."""

    tfds_name: str = ""  # any TFDS text dataset by name; "" = local text files or ArrayRecord
    text_key: str = "text"  # feature holding the text in a TFDS dataset
    tfds_train_split: str = "train"
    tfds_eval_split: str = ""  # "" = "validation" if the dataset has it, else "test"
    files: str = ""  # glob of local text files; "" = the Python standard library's .py files
    array_record_train: str = ""  # glob of ArrayRecord shards, one UTF-8 document per record
    array_record_eval: str = ""  # the same for evaluation (needed with array_record_train)
    data_dir: str = ""  # where TFDS datasets are built; "" = WORKDIR/tfds
    validation_fraction: float = 0.02  # local text: share of files (by path hash) held out
    document_bytes: int = 1 << 20  # local text: cut longer files into documents near this size
    on_bad_file: str = "skip"  # local text: empty, unreadable, binary, non-UTF-8: skip | stop
    seq_len: int = 256
    shuffle_seed: int = 0
    shuffle_buffer_tokens: int = 1 << 20  # packed rows shuffled together (pipeline.py); 0 = off
    worker_count: int = 0  # Grain worker processes; 0 = load in the main process
    prefetch: int = 2  # batches read ahead by a background thread; 0 = none
    tokenizer_train_bytes: int = 20_000_000  # text used to train the BPE tokenizer

    def __post_init__(self) -> None:
        def bad(field: str, expected: str) -> None:
            raise ValueError(
                f"DataConfig.{field}={getattr(self, field)!r} is invalid: expected {expected}"
            )

        if self.tfds_name and self.files:
            bad("files", "'' when tfds_name is set (choose one source)")
        if self.array_record_train and (self.tfds_name or self.files):
            bad("array_record_train", "'' when tfds_name or files is set (choose one source)")
        if bool(self.array_record_train) != bool(self.array_record_eval):
            bad("array_record_eval", "a glob of evaluation shards when array_record_train is "
                "set, and '' otherwise")
        if not 0.0 < self.validation_fraction < 1.0:
            bad("validation_fraction", "a fraction in (0, 1)")
        if self.document_bytes != 0 and self.document_bytes < 1024:
            bad("document_bytes", "0 (one document per file) or >= 1024 bytes")
        if self.on_bad_file not in ON_BAD_FILE:
            bad("on_bad_file", f"one of {ON_BAD_FILE} (name and skip bad text, or stop)")
        if self.seq_len < 1:
            bad("seq_len", "a positive number of tokens")
        if not 0 <= self.shuffle_seed < 2**32:
            bad("shuffle_seed", "an integer in [0, 2**32)")
        if self.shuffle_buffer_tokens < 0:
            bad("shuffle_buffer_tokens", ">= 0 (0 = no row shuffle)")
        if self.worker_count < 0:
            bad("worker_count", ">= 0")
        if self.prefetch < 0:
            bad("prefetch", ">= 0")
        if self.tokenizer_train_bytes < 1:
            bad("tokenizer_train_bytes", "a positive number of bytes")
        if not self.text_key:
            bad("text_key", "the name of a text feature")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | Any) -> DataConfig:
        """From a mapping or ConfigDict; unknown fields are refused by name."""
        d = d.to_dict() if hasattr(d, "to_dict") else dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown data config fields {unknown}; known: {sorted(known)}")
        return cls(**d)
