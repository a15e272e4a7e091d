"""Batches of packed documents for training and evaluation: a streaming, resumable Grain pipeline.

Shapes: B per-process batch, T seq_len. Batches hold "inputs", "targets", "positions",
"segment_ids" int32 [B, T] (packing.py); eval batches add "target_bytes" int32 [B, T], so
bits per byte = sum(nll) / (ln 2 * sum(target_bytes)) over targets with segment_ids > 0.

Train, per process (sources.py gives each process its own share of the documents):

    share of documents (random access) -> shuffle (reseeded every epoch) -> repeat
      -> tokenize [in `worker_count` Grain worker processes] -> pack into rows of T
      -> [read-ahead thread] -> shuffle rows in windows of R -> batch B
      -> prefetch thread -> TaggedIterator (checkpointable state, resume.py)

The row shuffle matters because documents can be long: a 750 KB source file is ~800 rows of
256 tokens, so without it a hundred consecutive batches would come from one file (measured on
the tiny config: training loss swinging 2.6-5.7 and val 1.76 bits/byte, against 1.5 with it).
R = `shuffle_buffer_tokens // T` rows (a tf.data-style shuffle buffer, as Grain's window
shuffle); the read-ahead thread fills the next window while the current one is trained on, so
the trainer does not wait for a whole window at once.

Nothing is tokenized in advance or kept (a few documents and batches are buffered), so memory
does not grow with the corpus (measured: 231 MB RSS streaming 20 MB of text, 244 MB for 2 GB;
docs/benchmarks.md). The order is a function of (shuffle_seed, process index and count);
tokenizing in workers gives the same batches as in the main process, because the stateful steps
(packing, the row shuffle) run after them.
Evaluation: the process's share of the eval split in stored order, packed the same way; exactly
`num_batches` batches per process, padded with empty rows (segment 0) if the share runs out,
so that every process takes part in every eval step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np
from absl import flags

from llm_jax.data.config import DataConfig
from llm_jax.data.packing import ROW_KEYS, AddTargetBytes, TokenizeDocument, pack_rows
from llm_jax.data.resume import TaggedIterator, check_saved_state
from llm_jax.data.sources import TextSplits, open_text_splits
from llm_jax.data.tokenizer import Tokenizer, load_or_train

log = logging.getLogger(__name__)

_READ_AHEAD_DOCS = 16  # documents tokenized ahead by the read thread (per worker)


def process_seed(seed: int, process_index: int) -> int:
    """The shuffle seed of one process's share: distinct per process, fixed by both."""
    return int(np.random.SeedSequence([seed, process_index]).generate_state(1)[0])


def tokenized_documents(docs: Sequence[str], tok: Tokenizer, *, seed: int | None,
                        worker_count: int = 0) -> grain.IterDataset:
    """Tokenized documents; shuffled and endless if `seed` is given, else once in order.
    Empty documents (an empty record, or text a source skipped as bad) are dropped: they hold
    no text, and packing one would only add a BOS/EOS pair."""
    ds = grain.MapDataset.source(docs)
    if seed is not None:
        ds = ds.shuffle(seed=seed).repeat(None)  # repeat reseeds the shuffle each epoch
    it = ds.filter(bool).map(TokenizeDocument(tok)).to_iter_dataset(
        grain.ReadOptions(num_threads=1, prefetch_buffer_size=_READ_AHEAD_DOCS))
    if worker_count > 0:
        if not flags.FLAGS.is_parsed():  # Grain reads its absl flags (defaults) in workers
            flags.FLAGS.mark_as_parsed()
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
    return it


def shuffle_rows(seq_len: int, shuffle_buffer_tokens: int) -> int:
    """Rows per shuffle window: the buffer's tokens in rows of `seq_len` (1 = no shuffle)."""
    return max(1, shuffle_buffer_tokens // seq_len)


def train_dataset(docs: Sequence[str], tok: Tokenizer, *, seq_len: int, batch_size: int,
                  seed: int, worker_count: int = 0, prefetch: int = 2,
                  shuffle_buffer_tokens: int = DataConfig.shuffle_buffer_tokens
                  ) -> grain.IterDataset:
    """Endless shuffled batches of packed rows from one process's documents (module doc)."""
    if len(docs) == 0:
        raise ValueError("this process's share of the training data holds no documents: "
                         "give the data at least as many shards as there are processes")
    ds = pack_rows(tokenized_documents(docs, tok, seed=seed, worker_count=worker_count), seq_len)
    window = shuffle_rows(seq_len, shuffle_buffer_tokens)
    if window > 1:
        if prefetch > 0:  # the next window is read while this one is trained on
            ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=window)
        row_seed = int(np.random.SeedSequence([seed, 1]).generate_state(1)[0] >> 1)
        ds = grain.experimental.WindowShuffleIterDataset(ds, window_size=window, seed=row_seed)
    ds = ds.batch(batch_size, drop_remainder=True)
    if prefetch > 0:
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch)
    return ds


def eval_dataset(docs: Sequence[str], tok: Tokenizer, *, seq_len: int, batch_size: int
                 ) -> grain.IterDataset:
    """The share's documents once, in order, packed; the last batch padded to `batch_size`."""
    pad = functools.partial(grain.experimental.batch_and_pad, batch_size=batch_size)
    return (pack_rows(tokenized_documents(docs, tok, seed=None), seq_len)
            .batch(batch_size, batch_fn=pad)
            .map(AddTargetBytes(tok.token_byte_lengths())))


def empty_batch(batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
    """A batch of padding only (segment 0 everywhere): it adds nothing to any eval sum."""
    return {k: np.zeros((batch_size, seq_len), np.int32) for k in (*ROW_KEYS, "target_bytes")}


@dataclasses.dataclass(frozen=True, eq=False)
class Data:
    """What the trainer needs: the train iterator, fresh eval iterators, the tokenizer."""

    train_iter: TaggedIterator  # endless; checkpoint with grain.checkpoint.CheckpointSave
    tokenizer: Tokenizer
    name: str  # the dataset, e.g. "local_text/stdlib_1a2b..."
    splits: TextSplits
    eval_docs: Sequence[str]  # this process's share of the eval split
    seq_len: int
    batch_size: int  # per process
    process_count: int

    @property
    def batch_dtypes(self) -> dict[str, np.dtype]:
        """Each array of a training batch and its dtype (all [batch, seq_len])."""
        return {k: np.dtype(np.int32) for k in ROW_KEYS}

    def make_eval_iter(self, num_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """The same first `num_batches` eval batches every call, padded with empty batches if
        the share is shorter (None = the whole share: one process only, as the count of
        batches then differs between processes)."""
        ds = eval_dataset(self.eval_docs, self.tokenizer, seq_len=self.seq_len,
                          batch_size=self.batch_size)
        if num_batches is not None:
            return self._exactly(iter(ds), num_batches)
        if self.process_count > 1:
            raise ValueError("make_eval_iter(None) reads each process's whole share, a "
                             "different number of batches per process: pass num_batches")
        return iter(ds)

    def _exactly(self, it: Iterator[dict[str, np.ndarray]], n: int
                 ) -> Iterator[dict[str, np.ndarray]]:
        for i in range(n):
            batch = next(it, None)
            if batch is None:
                log.warning("the eval share holds %d batches, not the %d asked for: the rest "
                            "are padding", i, n)
                batch = empty_batch(self.batch_size, self.seq_len)
            yield batch

    def check_checkpoint(self, step_dir: str) -> None:
        """Raises ValueError if the data state saved in `step_dir` cannot resume this pipeline
        (another process count, seq_len, dataset, ...; see resume.py)."""
        check_saved_state(os.path.join(step_dir, "data"), self.train_iter.identity)


def make_datasets(
    data_cfg: DataConfig | Any,
    *,
    workdir: str,
    vocab_size: int,
    global_batch_size: int,
    process_index: int | None = None,
    process_count: int | None = None,
) -> Data:
    """Builds (or reuses) the dataset and tokenizer under `workdir`; returns `Data`.

    `data_cfg` is a DataConfig or the run config's `data` ConfigDict. Files written:
    WORKDIR/tokenizer.model (trained on the start of the train split if missing) and, for a
    named TFDS dataset, its build under data_cfg.data_dir (default WORKDIR/tfds). Local text
    files and ArrayRecord shards are read where they lie.
    """
    cfg = data_cfg if isinstance(data_cfg, DataConfig) else DataConfig.from_dict(data_cfg)
    if process_index is None or process_count is None:
        import jax  # only here: the data modules are usable without initializing JAX

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, {process_count})")
    if global_batch_size % process_count:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by "
            f"process_count={process_count}"
        )
    batch_size = global_batch_size // process_count

    splits = open_text_splits(cfg, cfg.data_dir or os.path.join(workdir, "tfds"))
    tok = load_or_train(os.path.join(workdir, "tokenizer.model"), splits.texts("train"),
                        vocab_size, cfg.tokenizer_train_bytes)
    train_docs = splits.share("train", process_index, process_count)
    train = train_dataset(train_docs, tok, seq_len=cfg.seq_len, batch_size=batch_size,
                          seed=process_seed(cfg.shuffle_seed, process_index),
                          worker_count=cfg.worker_count, prefetch=cfg.prefetch,
                          shuffle_buffer_tokens=cfg.shuffle_buffer_tokens)
    identity = {"format": 3, "dataset": splits.name, "split": splits.describe("train"),
                "tokenizer": tok.fingerprint, "seq_len": cfg.seq_len, "batch_size": batch_size,
                "shuffle_seed": cfg.shuffle_seed, "worker_count": cfg.worker_count,
                "shuffle_rows": shuffle_rows(cfg.seq_len, cfg.shuffle_buffer_tokens),
                "process_index": process_index, "process_count": process_count}
    return Data(
        train_iter=TaggedIterator(iter(train), identity),
        tokenizer=tok,
        name=splits.name,
        splits=splits,
        eval_docs=splits.share("eval", process_index, process_count),
        seq_len=cfg.seq_len,
        batch_size=batch_size,
        process_count=process_count,
    )
