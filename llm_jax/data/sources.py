"""The documents of a run, and each process's share of them, read by random access.

Three kinds of data (DataConfig), all read by random access without TensorFlow, a document
only when the pipeline asks for it (a named TFDS dataset is built once first; ArrayRecord shards'
footers are read for their counts); each kind is a `TextSplits` (name, share, texts, describe):
- local text files, by default the standard library, read where they lie (`LocalFiles`,
  local_text.py);
- a TFDS dataset by name (`tfds_name`, built with file_format="array_record"; `TfdsSplits`);
- ArrayRecord shards whose records are UTF-8 documents (`array_record_train` / `_eval` globs;
  `ArrayRecordSplits`).

A process's share, for process p of P (see docs/training.md, "Data"):
- Local files: the p-th contiguous 1/P of the split's documents (local_text.py).
- TFDS: `tfds.even_splits(split, P)[p]`, a contiguous 1/P of the split's records. TFDS knows
  every shard's length from its metadata, so a process opens only the shards its range covers.
- ArrayRecord shards (sorted by path): whole shards, files[p::P]. Nothing else is opened, not
  even to count records, so a pod's hosts never touch each other's shards.
Any failure to read is re-raised naming the shard file and record: array_record's own messages
("Corrupted Riegeli/records file: chunk header hash mismatch ...") do not name the file.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import glob
import itertools
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import grain

from llm_jax.data.config import DataConfig
from llm_jax.data.local_text import open_local_files

_COUNT_THREADS = 16  # shards opened at once to read their record counts (footers)


class ShardReadError(ValueError):
    """A shard could not be opened or one of its records read or decoded."""


@dataclasses.dataclass(frozen=True)
class Shard:
    """Records [skip, skip + take) of one ArrayRecord file."""

    path: str
    skip: int
    take: int


@dataclasses.dataclass(frozen=True, eq=False)
class DocumentSource:
    """One process's documents as str by index: a Grain MapDataset source (picklable)."""

    records: Sequence[Any]  # a TFDS data source, or grain.sources.ArrayRecordDataSource
    shards: tuple[Shard, ...]  # in record order: index i is in the shard whose range holds it
    text_key: str | None  # the feature holding the text; None = a record is the UTF-8 bytes

    def __len__(self) -> int:
        return len(self.records)

    def shard_of(self, index: int) -> tuple[str, int]:
        """(file, record number in that file) of document `index`."""
        starts = list(itertools.accumulate((s.take for s in self.shards), initial=0))
        k = min(max(bisect.bisect_right(starts, index) - 1, 0), len(self.shards) - 1)
        shard = self.shards[k]
        return shard.path, shard.skip + index - starts[k]

    def __getitem__(self, index: int) -> str:
        index = int(index)
        try:
            record = self.records[index]
            text = record if self.text_key is None else record[self.text_key]
            return text.decode("utf-8") if isinstance(text, bytes) else str(text)
        except MemoryError:
            raise  # the host, not the shard
        except Exception as e:  # noqa: BLE001 - array_record raises bare RuntimeErrors
            path, record_no = self.shard_of(index) if self.shards else ("?", index)
            raise ShardReadError(
                f"cannot read record {record_no} of shard {path}: {type(e).__name__}: {e} "
                "(a corrupt or truncated shard? rewrite it, or remove it from the data)") from e


def shard_paths(pattern: str, field: str) -> list[str]:
    """The sorted files matching `pattern`; an error naming `field` if there are none."""
    paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not paths:
        raise ValueError(f"data.{field}={pattern!r} matches no files")
    return paths


def count_records(path: str) -> int:
    """Records in one ArrayRecord file (reads its footer); a corrupt file is named."""
    from array_record.python.array_record_module import ArrayRecordReader

    try:
        reader = ArrayRecordReader(path)
        try:
            return int(reader.num_records())
        finally:
            reader.close()
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - array_record raises bare RuntimeErrors
        raise ShardReadError(f"cannot open ArrayRecord shard {path}: {type(e).__name__}: {e} "
                             "(a corrupt or truncated shard?)") from e


def array_record_share(paths: Sequence[str], process_index: int, process_count: int
                       ) -> DocumentSource:
    """Whole shards paths[p::P] of raw UTF-8 documents (may be empty: the caller decides)."""
    mine = list(paths[process_index::process_count])
    with concurrent.futures.ThreadPoolExecutor(_COUNT_THREADS) as pool:
        counts = list(pool.map(count_records, mine))
    shards = tuple(Shard(p, 0, n) for p, n in zip(mine, counts) if n)
    # "path[start:end]" tells Grain the count, so it does not open every file again to count.
    records = (grain.sources.ArrayRecordDataSource([f"{s.path}[0:{s.take}]" for s in shards])
               if shards else ())
    return DocumentSource(records, shards, text_key=None)


def tfds_shards(builder: Any, split: Any) -> tuple[Shard, ...]:
    """The shard ranges TFDS reads for `split`, from its metadata (none under mock_data)."""
    try:
        instructions = builder.info.splits[split].file_instructions
    except KeyError:
        return ()
    return tuple(Shard(os.fspath(fi.filename), fi.skip, fi.take) for fi in instructions)


class TextSplits(Protocol):
    """A dataset's train and eval splits; `share` opens one process's part of one."""

    name: str  # e.g. "local_text/stdlib_1a2b...", "lm1b/1.1.0", "array_record/<glob>"

    def share(self, split: str, process_index: int = 0, process_count: int = 1
              ) -> Sequence[str]:
        """Process `process_index` of `process_count`'s documents of `split` ("train"/"eval")."""

    def texts(self, split: str) -> Iterator[str]:
        """Every document of `split` in stored order, to train the tokenizer on a prefix.
        Lazy: a file or shard is opened when the reading reaches it."""

    def describe(self, split: str) -> str:
        """What `split` is, for the resume check: a TFDS split name, a count of shards."""


@dataclasses.dataclass(frozen=True, eq=False)
class TfdsSplits:
    """A TFDS dataset built as ArrayRecord: its splits by name."""

    name: str  # e.g. "lm1b/1.1.0"
    builder: Any
    splits: dict[str, str]  # "train" / "eval" -> TFDS split name
    text_key: str

    def share(self, split: str, process_index: int = 0, process_count: int = 1
              ) -> DocumentSource:
        import tensorflow_datasets as tfds  # only TFDS runs pay its import (~0.3 s)

        sub = tfds.even_splits(self.splits[split], n=process_count)[process_index]
        return DocumentSource(self.builder.as_data_source(split=sub),
                              tfds_shards(self.builder, sub), self.text_key)

    def texts(self, split: str) -> Iterator[str]:
        docs = self.share(split)  # TFDS opens a shard on its first read
        return (docs[i] for i in range(len(docs)))

    def describe(self, split: str) -> str:
        return self.splits[split]


@dataclasses.dataclass(frozen=True, eq=False)
class ArrayRecordSplits:
    """ArrayRecord shards of raw UTF-8 documents, one list of shard paths per split."""

    name: str  # "array_record/<train glob>"
    splits: dict[str, list[str]]  # "train" / "eval" -> sorted shard paths

    def share(self, split: str, process_index: int = 0, process_count: int = 1
              ) -> DocumentSource:
        return array_record_share(self.splits[split], process_index, process_count)

    def texts(self, split: str) -> Iterator[str]:
        for path in self.splits[split]:  # one shard at a time, in order
            docs = array_record_share([path], 0, 1)
            yield from (docs[i] for i in range(len(docs)))

    def describe(self, split: str) -> str:
        return f"{len(self.splits[split])} shards"


def pick_eval_split(available: Iterable[str], requested: str = "") -> str:
    """`requested` if given, else "validation" when the dataset has one, else "test"."""
    if requested:
        return requested
    return "validation" if "validation" in set(available) else "test"


def open_text_splits(cfg: DataConfig, data_dir: str) -> TextSplits:
    """The configured source's splits; a named TFDS dataset is built (and maybe downloaded)
    under `data_dir` first, local files and ArrayRecord shards are only listed."""
    if cfg.array_record_train:
        splits = {"train": shard_paths(cfg.array_record_train, "array_record_train"),
                  "eval": shard_paths(cfg.array_record_eval, "array_record_eval")}
        return ArrayRecordSplits(f"array_record/{cfg.array_record_train}", splits)
    if not cfg.tfds_name:
        return open_local_files(cfg.files, validation_fraction=cfg.validation_fraction,
                                document_bytes=cfg.document_bytes, on_bad_file=cfg.on_bad_file)
    import tensorflow_datasets as tfds  # only TFDS runs pay its import (~0.3 s)

    builder = tfds.builder(cfg.tfds_name, data_dir=data_dir, file_format="array_record")
    builder.download_and_prepare()
    feature_keys = getattr(builder.info.features, "keys", lambda: [])()
    if feature_keys and cfg.text_key not in feature_keys:
        raise ValueError(
            f"data.text_key={cfg.text_key!r} is not a feature of {cfg.tfds_name}: "
            f"it has {sorted(feature_keys)}"
        )
    splits = {"train": cfg.tfds_train_split,
              "eval": pick_eval_split(builder.info.splits, cfg.tfds_eval_split)}
    return TfdsSplits(builder.info.full_name, builder, splits, cfg.text_key)
