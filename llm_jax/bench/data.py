"""The data pipeline's throughput and memory: packed tokens/s, and RSS against corpus size.

    python -m llm_jax.bench data [--seconds 20] [--workers 0,2] [--sizes_mb 20,2048]
                                 [--text_sizes_mb 15,1536] [--text_steps 20]
                                 [--dir /tmp/llm_jax_bench_data] [--keep]

Rows: (1) the default run's data (the standard library, read in place; seq_len 256,
batch 8, vocab 8,000) with each worker count: tokens/s of packed rows (real tokens, padding not
counted) against the tiny trainer's ~7,000 tokens/s (8 x 256 per 0.27-0.29 s step; target 5x);
(2) ArrayRecord corpora of each size generated from the same text (random slices of 0.1-12 KB,
written to a new folder in --dir, deleted afterwards unless --keep), read with the training
shuffle over all their records (target: 2 GB under 1 GB RSS), then read whole: every document
once in the shuffled order, not tokenized, to show that none of it stays in memory.
(3) with --text_sizes_mb: folders of plain text files (5 MB each, paragraphs of the same text
between blank lines) of each size, and the trainer's own command (`python -m llm_jax.train
--config configs/tiny.py --config.data.files=...`) run for --text_steps steps on each in a child
process, with the same tokenizer copied into each workdir: wall time, time to the first step
and the peak RSS of the whole process tree. The larger corpus should cost what the smaller does.
RSS is sampled every 0.2 s over the main process and its Grain workers (their sum: shared pages
count twice, so it is an upper bound); the peak is reported. Each row, and writing each
corpus (but under --quick), runs in a fresh process.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np
import psutil  # a dependency of orbax-checkpoint and tensorflow-datasets

from llm_jax.bench.common import machine, table
from llm_jax.data import DataConfig, make_datasets
from llm_jax.data.local_text import stdlib_python_files
from llm_jax.data.shard_writer import write_text_shards
from llm_jax.data.sources import open_text_splits

TRAINER_TOKENS_PER_S = 7_000  # configs/tiny.py: 8 x 256 tokens per ~0.28 s step on 2 cores
SHARD_MB = 128  # generated corpora: about this much text per shard


class PeakRss:
    """Samples the RSS of this process and of its children in a thread; keeps the peaks."""

    def __init__(self, every_s: float = 0.2):
        self.every_s = every_s
        self.main = self.total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        me = psutil.Process()
        main = me.memory_info().rss
        children = 0
        for c in me.children(recursive=True):
            try:
                children += c.memory_info().rss
            except psutil.Error:  # a worker that just exited
                pass
        self.main, self.total = max(self.main, main), max(self.total, main + children)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def __enter__(self) -> PeakRss:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def generated_docs(total_bytes: int, seed: int) -> Iterator[str]:
    """Random slices (0.1-12 KB, log-uniform) of the standard library's text, to `total_bytes`."""
    _, paths = stdlib_python_files()
    text = "".join(open(p, encoding="utf-8", errors="replace").read() for p in paths[:400])
    rng = np.random.default_rng(seed)
    written = 0
    while written < total_bytes:
        n = int(np.exp(rng.uniform(np.log(100), np.log(12_000))))
        start = int(rng.integers(0, len(text) - n))
        doc = text[start:start + n]
        written += len(doc.encode("utf-8"))
        yield doc


def generate_corpus(directory: str, size_mb: float, seed: int = 0) -> dict[str, Any]:
    """Train shards of `size_mb` MB of text, and a 1 MB eval shard, under `directory`."""
    t0 = time.perf_counter()
    size = int(size_mb * 2**20)
    train = write_text_shards(os.path.join(directory, "train"), generated_docs(size, seed),
                              num_shards=max(2, round(size_mb / SHARD_MB)))
    write_text_shards(os.path.join(directory, "eval"), generated_docs(2**20, seed + 1), 1)
    return {"text_mb": size_mb, "shards": len(train),
            "disk_mb": sum(os.path.getsize(p) for p in train) / 2**20,
            "write_s": time.perf_counter() - t0}


def write_text_files(directory: str, size_mb: float, file_mb: float = 5.0, seed: int = 0
                     ) -> dict[str, Any]:
    """Plain UTF-8 text files of about `file_mb` MB each, `size_mb` MB in all, in `directory`:
    what a user points `data.files` at."""
    t0 = time.perf_counter()
    os.makedirs(directory, exist_ok=True)
    docs = generated_docs(int(size_mb * 2**20), seed)
    files, written = 0, 0
    while (doc := next(docs, None)) is not None:
        with open(os.path.join(directory, f"text_{files:05d}.txt"), "w", encoding="utf-8") as f:
            n = 0
            while doc is not None:
                f.write(doc + "\n\n")
                n += len(doc.encode("utf-8")) + 2
                if n >= file_mb * 2**20:
                    break
                doc = next(docs, None)
        files, written = files + 1, written + n
    return {"text_mb": size_mb, "files": files, "disk_mb": written / 2**20,
            "write_s": time.perf_counter() - t0}


def train_on_files(pattern: str, workdir: str, tokenizer: str | None, steps: int
                   ) -> dict[str, Any]:
    """The trainer's command on `pattern` for `steps` steps in a child process (tokenizer copied
    in when given): wall time, time to the first step's metrics, peak RSS of the process tree."""
    os.makedirs(workdir, exist_ok=True)
    if tokenizer:
        shutil.copy(tokenizer, os.path.join(workdir, "tokenizer.model"))
    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          os.pardir, "configs", "tiny.py")
    cmd = [sys.executable, "-m", "llm_jax.train", "--config", os.path.normpath(config),
           "--workdir", workdir, f"--config.data.files={pattern}",
           f"--config.train.num_steps={steps}", "--config.train.eval_every_steps=0",
           "--config.train.num_samples=0", f"--config.checkpoint.every_steps={steps}"]
    metrics = os.path.join(workdir, "metrics.jsonl")
    first = None
    with PeakRss() as rss, open(os.path.join(workdir, "bench.log"), "w") as log:
        t0 = time.perf_counter()
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        while child.poll() is None:
            if first is None and os.path.exists(metrics) and os.path.getsize(metrics):
                first = time.perf_counter() - t0
            time.sleep(0.1)
        wall = time.perf_counter() - t0
    if child.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({child.returncode}); see {log.name}")
    return {"wall_s": wall, "first_step_s": first, "rss_tree_mb": rss.total / 2**20,
            "steps": steps}


def isolated(fn: Any, **kwargs: Any) -> Any:
    """fn(**kwargs) in a fresh process: its RSS is that row's alone, not what an earlier row
    (or writing a corpus) left in this process's heap."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(fn, **kwargs).result()


def measure(cfg: DataConfig, workdir: str, *, seconds: float, vocab_size: int,
            batch_size: int) -> dict[str, Any]:
    """Start-up time, then tokens/s and peak RSS while reading batches for `seconds`."""
    with PeakRss() as rss:
        t0 = time.perf_counter()
        data = make_datasets(cfg, workdir=workdir, vocab_size=vocab_size,
                             global_batch_size=batch_size, process_index=0, process_count=1)
        next(data.train_iter)
        start_s = time.perf_counter() - t0
        tokens, batches, t1 = 0, 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t1) < seconds:
            tokens += int((next(data.train_iter)["segment_ids"] > 0).sum())
            batches += 1
        data.train_iter.close()
    return {"tokens_per_s": tokens / elapsed, "batches": batches, "start_s": start_s,
            "rss_main_mb": rss.main / 2**20, "rss_total_mb": rss.total / 2**20,
            "vs_trainer": tokens / elapsed / TRAINER_TOKENS_PER_S}


def scan(cfg: DataConfig) -> dict[str, Any]:
    """Reads every training document once in the shuffled order (no tokenizing): the whole
    corpus passes through, and the peak RSS says whether any of it stays."""
    docs = open_text_splits(cfg, data_dir="").share("train")
    with PeakRss() as rss:
        t0, nbytes = time.perf_counter(), 0
        no_threads = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        for text in grain.MapDataset.source(docs).shuffle(seed=0).to_iter_dataset(no_threads):
            nbytes += len(text.encode("utf-8"))
        elapsed = time.perf_counter() - t0
    return {"scan_mb": nbytes / 2**20, "scan_mb_per_s": nbytes / 2**20 / elapsed,
            "scan_rss_mb": rss.main / 2**20}


def text_file_rows(directory: str, sizes_mb: tuple[float, ...], steps: int, keep: bool
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Training on folders of text files of each size (module doc, (3)); the first size's run
    first trains the tokenizer, unmeasured, that every measured run then copies."""
    rows, corpora = [], []
    tokenizer = os.path.join(directory, "text_tokenizer", "tokenizer.model")
    for i, size in enumerate(sizes_mb):
        where = os.path.join(directory, f"text_{size:g}mb")
        corpora.append({"kind": "text files", **isolated(write_text_files, directory=where,
                                                          size_mb=size)})
        pattern = os.path.join(where, "*.txt")
        if i == 0:
            train_on_files(pattern, os.path.dirname(tokenizer), None, 1)
        rows.append({"corpus": f"text files {size:g} MB",
                     **train_on_files(pattern, os.path.join(directory, f"train_{size:g}mb"),
                                      tokenizer, steps)})
        if not keep:
            shutil.rmtree(where)
    return rows, corpora


def run(*, seconds: float = 20.0, workers: tuple[int, ...] = (0, 2),
        sizes_mb: tuple[float, ...] = (20.0, 2048.0), directory: str = "/tmp/llm_jax_bench_data",
        keep: bool = False, quick: bool = False, text_sizes_mb: tuple[float, ...] = (),
        text_steps: int = 20) -> dict[str, Any]:
    vocab, batch, seq_len = 8000, 8, 256
    if quick:
        seconds, workers, sizes_mb, vocab, batch, seq_len = 0.5, (0,), (1.0,), 1000, 2, 64
    os.makedirs(directory, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="run_", dir=directory)  # all that is deleted after
    workdir = os.path.join(directory, "workdir")
    rows, corpora = [], []
    try:
        if not quick:  # the default run's data; its tokenizer then serves the generated corpora
            # Run first, on its own: the rows then measure reading, not the tokenizer's
            # training.
            isolated(measure, cfg=DataConfig(seq_len=seq_len), workdir=workdir, seconds=0,
                     vocab_size=vocab, batch_size=batch)
            for w in workers:
                cfg = DataConfig(seq_len=seq_len, worker_count=w)
                rows.append({"corpus": "stdlib", "workers": w,
                             **isolated(measure, cfg=cfg, workdir=workdir, seconds=seconds,
                                        vocab_size=vocab, batch_size=batch)})
        # --quick writes and scans its 1 MB here; only the row's RSS needs a fresh process.
        aside = (lambda fn, **kw: fn(**kw)) if quick else isolated
        for size in sizes_mb:
            where = os.path.join(directory, f"corpus_{size:g}mb")
            corpora.append(aside(generate_corpus, directory=where, size_mb=size))
            cfg = DataConfig(array_record_train=f"{where}/train-*", seq_len=seq_len,
                             array_record_eval=f"{where}/eval-*")
            rows.append({"corpus": f"generated {size:g} MB", "workers": 0,
                         **isolated(measure, cfg=cfg, workdir=workdir, seconds=seconds,
                                    vocab_size=vocab, batch_size=batch),
                         **aside(scan, cfg=cfg)})
            if not keep:
                shutil.rmtree(where)  # before the next one: /tmp need not hold them all
        text_rows, text_corpora = ([], []) if not text_sizes_mb else text_file_rows(
            directory, text_sizes_mb, text_steps, keep)
    finally:
        if not keep:
            shutil.rmtree(directory, ignore_errors=True)
    return {"benchmark": "data", "machine": machine(), "seconds": seconds, "batch": batch,
            "seq_len": seq_len, "vocab_size": vocab, "trainer_tokens_per_s":
            TRAINER_TOKENS_PER_S, "rows": rows, "corpora": corpora, "text_rows": text_rows,
            "text_corpora": text_corpora,
            "stdlib_root": sysconfig.get_paths()["stdlib"]}


def format_result(r: dict[str, Any]) -> str:
    rows = [[x["corpus"], x["workers"], f"{x['tokens_per_s']:,.0f}", f"{x['vs_trainer']:.0f}x",
             f"{x['start_s']:.1f}", f"{x['rss_main_mb']:.0f}", f"{x['rss_total_mb']:.0f}"]
            for x in r["rows"]]
    scans = [[x["corpus"], f"{x['scan_mb']:,.0f}", f"{x['scan_mb_per_s']:,.0f}",
              f"{x['scan_rss_mb']:.0f}"] for x in r["rows"] if "scan_mb" in x]
    corpora = "; ".join(f"{c['text_mb']:g} MB of text in {c['shards']} shards "
                        f"({c['disk_mb']:.0f} MB on disk, written in {c['write_s']:.0f} s)"
                        for c in r["corpora"])
    text = ""
    if r.get("text_rows"):
        base = r["text_rows"][0]
        text = ("\ntraining on text files (configs/tiny.py, data.files):\n" + table(
            ["corpus", "files", "steps", "wall s", "first step s", "peak RSS MB", "wall x",
             "RSS x"],
            [[x["corpus"], c["files"], x["steps"], f"{x['wall_s']:.1f}",
              f"{x['first_step_s']:.1f}", f"{x['rss_tree_mb']:.0f}",
              f"{x['wall_s'] / base['wall_s']:.2f}",
              f"{x['rss_tree_mb'] / base['rss_tree_mb']:.2f}"]
             for x, c in zip(r["text_rows"], r["text_corpora"])]))
    return (f"packed batches {r['batch']}x{r['seq_len']}, {r['seconds']:g} s each; "
            f"load {r['machine']['load_average']}\n"
            + table(["corpus", "workers", "tokens/s", "vs trainer", "start s", "RSS main MB",
                     "RSS +workers MB"], rows)
            + (f"\ngenerated: {corpora}\nevery document read once, shuffled, not tokenized:\n"
               + table(["corpus", "MB read", "MB/s", "RSS MB"], scans) if corpora else "")
            + text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    p.add_argument("--seconds", type=float, default=20.0, help="reading time per row")
    p.add_argument("--workers", type=ints, default=(0, 2), help="worker counts (stdlib rows)")
    p.add_argument("--sizes_mb", type=lambda s: tuple(float(x) for x in s.split(",") if x),
                   default=(20.0, 2048.0), help="generated corpus sizes in MB of text")
    p.add_argument("--dir", default="/tmp/llm_jax_bench_data",
                   help="a scratch folder is made in it")
    p.add_argument("--keep", action="store_true", help="keep the generated corpora")
    p.add_argument("--text_sizes_mb", type=lambda s: tuple(float(x) for x in s.split(",") if x),
                   default=(), help="train on folders of text files of these sizes (MB), e.g. "
                   "15,1536")
    p.add_argument("--text_steps", type=int, default=20, help="training steps per text corpus")


def from_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(seconds=a.seconds, workers=a.workers, sizes_mb=a.sizes_mb, directory=a.dir,
               keep=a.keep, quick=a.quick, text_sizes_mb=a.text_sizes_mb,
               text_steps=a.text_steps)
