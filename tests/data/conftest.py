"""Tiny corpora for the data tests: raw ArrayRecord shards of documents of many lengths."""

from __future__ import annotations

import numpy as np
import pytest

from llm_jax.data.shard_writer import write_text_shards


def synthetic_docs(n: int, seed: int = 0) -> list[str]:
    """`n` documents from 1 to ~120 words: short ones share a row, long ones span rows."""
    rng = np.random.default_rng(seed)
    words = ["def", "return", "x", "=", "(", ")", "\n", "    ", "for", "in", "naïve", "日本",
             "0", "1", "42", "class", "self", ".", ":", "#", "import", "os"]
    return [" ".join(rng.choice(words, size=int(rng.integers(1, 120)))) for _ in range(n)]


@pytest.fixture(scope="session")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """train-0000{0..3}-of-00004 (90 documents) and eval-00000-of-00001 (12 documents)."""
    d = tmp_path_factory.mktemp("shards")
    write_text_shards(str(d / "train"), synthetic_docs(90, seed=0), num_shards=4)
    write_text_shards(str(d / "eval"), synthetic_docs(12, seed=1), num_shards=1)
    return str(d)
