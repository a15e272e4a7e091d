"""Write documents as ArrayRecord shards that `data.array_record_train` / `_eval` read.

One record per document, its UTF-8 bytes; `group_size:1` (one record per compressed chunk) is
what Grain needs for fast random access.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

WRITER_OPTIONS = "group_size:1"


def shard_names(prefix: str, num_shards: int) -> list[str]:
    """`PREFIX-00000-of-00004.array_record`, ...: the usual sharded-file names, in order."""
    return [f"{prefix}-{i:05d}-of-{num_shards:05d}.array_record" for i in range(num_shards)]


def write_text_shards(prefix: str, docs: Iterable[str], num_shards: int) -> list[str]:
    """Writes `docs` round-robin into `num_shards` shards; returns their paths."""
    from array_record.python.array_record_module import ArrayRecordWriter

    paths = shard_names(prefix, num_shards)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    writers = [ArrayRecordWriter(p, WRITER_OPTIONS) for p in paths]
    try:
        for i, doc in enumerate(docs):
            writers[i % num_shards].write(doc.encode("utf-8"))
    finally:
        for w in writers:
            w.close()
    return paths
