"""The train and eval text of a run: local files (via the LocalText builder) or a TFDS dataset.

Both kinds end as TFDS ArrayRecord data sources (random access, no TensorFlow) plus a name
that identifies the data, which keys the token caches made from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import tensorflow_datasets as tfds

from llm_jax.data.config import DataConfig
from llm_jax.data.local_text import build_local_text

@dataclasses.dataclass(frozen=True, eq=False)
class TextSplits:
    """A dataset's two splits as record sequences, and where the text sits in a record."""

    name: str  # e.g. "local_text/stdlib_1a2b.../1.0.0", "lm1b/1.1.0"
    train: Sequence[Any]
    eval: Sequence[Any]
    text_key: str
    eval_split: str

    def texts(self, split: str) -> Iterator[str]:
        """The documents of `split` ("train" or "eval") in stored order, as str."""
        source = self.train if split == "train" else self.eval
        # One record at a time: deserializing dominates anyway, and TFDS's mock_data (used in
        # the tests) breaks the batched __getitems__.
        for i in range(len(source)):
            text = source[i][self.text_key]
            yield text.decode("utf-8") if isinstance(text, bytes) else str(text)


def pick_eval_split(available: Iterable[str], requested: str = "") -> str:
    """`requested` if given, else "validation" when the dataset has one, else "test"."""
    if requested:
        return requested
    return "validation" if "validation" in set(available) else "test"


def open_text_splits(cfg: DataConfig, data_dir: str) -> TextSplits:
    """Builds the dataset if needed (local files: seconds; named TFDS: may download)."""
    if not cfg.tfds_name:
        builder = build_local_text(cfg.files, cfg.validation_fraction, data_dir)
        return TextSplits(
            name=builder.info.full_name,
            train=builder.as_data_source(split="train"),
            eval=builder.as_data_source(split="validation"),
            text_key="text",
            eval_split="validation",
        )
    builder = tfds.builder(cfg.tfds_name, data_dir=data_dir, file_format="array_record")
    builder.download_and_prepare()
    eval_split = pick_eval_split(builder.info.splits, cfg.tfds_eval_split)
    train = builder.as_data_source(split=cfg.tfds_train_split)
    eval_ = builder.as_data_source(split=eval_split)
    feature_keys = getattr(builder.info.features, "keys", lambda: [])()
    if feature_keys and cfg.text_key not in feature_keys:
        raise ValueError(
            f"data.text_key={cfg.text_key!r} is not a feature of {cfg.tfds_name}: "
            f"it has {sorted(feature_keys)}"
        )
    return TextSplits(
        name=builder.info.full_name,
        train=train,
        eval=eval_,
        text_key=cfg.text_key,
        eval_split=eval_split,
    )
