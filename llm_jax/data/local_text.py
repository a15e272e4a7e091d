"""Local text files as documents, read where they lie: `data.files`, by default the standard library.

Nothing is copied and nothing is read up front: start-up lists the files and their sizes (one
`stat` each), and a document is read from its file by random access when the pipeline asks for
it, so memory, disk and time to the first step do not grow with the corpus (earlier versions
built a TFDS dataset first: a second copy of the corpus, and above ~1 GB TFDS's shuffler needed
TensorFlow, which the project does not install).

Documents. A file of at most `document_bytes` (N, default 1 MiB) is one document. A longer one
is cut near every N bytes, the way Hadoop splits text files: the nominal cut at byte c * N
moves forward to just after the first blank line in the next min(N / 4, 64 KiB) bytes, else the
first line end, else the next UTF-8 character start. Both neighbours of a cut compute it from
the same bytes, so the documents tile the file exactly (every byte in one document), each is
found from the file's size alone, and none is much longer than N. `document_bytes=0` keeps one
document per file, however large. The default leaves every file of the standard library whole
(the largest is ~750 KB), so the default run learns from the same documents as when each file
was one; it is far longer than a training row (~1 KB at seq_len 256), so the cuts cost next to
no context, and it bounds what one read holds in memory.

Splits. A file goes to validation when the hash of its path (relative to the glob's root, so
the split is the same on every machine) falls below `validation_fraction`; this keeps each
file's split stable when files are added. Should that leave a split empty, the file with the
lowest (highest) hash moves over so both splits exist. Process p of P reads the contiguous
p-th 1/P of its split's documents (as `tfds.even_splits` does), so it opens only its own files.

Bad files. An empty or unreadable file is found at start-up; bytes that are not UTF-8 (or hold
NUL, i.e. binary) when their document is read. `on_bad_file="skip"` logs each one by name (a
bad document is then read as "", which the pipeline drops), "stop" stops naming it.

The corpus's name, `local_text/<files|stdlib>_<hash>`, covers the relative paths, their sizes,
`validation_fraction` and `document_bytes`: the resume check (resume.py) compares it, so a run
never continues its data order over another file list.
"""

from __future__ import annotations

import bisect
import dataclasses
import glob
import hashlib
import itertools
import logging
import os
import sysconfig
from collections.abc import Iterator

from llm_jax.data.config import ON_BAD_FILE

log = logging.getLogger(__name__)

_LISTED_BAD = 20  # bad files named one by one in the start-up warning; the rest are counted
_MAX_SEARCH = 1 << 16  # bytes after a nominal cut searched for a line end

# Directories of the standard library that are not its code (installed packages) or are too
# large and odd to be useful text (the test suite: 20 MB, with deliberately broken encodings).
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)


class BadTextError(ValueError):
    """A text file (or part of one) that is empty, unreadable, binary or not UTF-8."""


def stdlib_python_files() -> tuple[str, list[str]]:
    """(root, sorted absolute paths) of the running interpreter's standard library .py files."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS)
        paths.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    if not paths:
        raise ValueError(f"no .py files found under the standard library root {root!r}")
    return root, sorted(paths)


def glob_files(pattern: str) -> tuple[str, list[str]]:
    """(root, sorted absolute file paths) matching `pattern`; root is its non-glob prefix."""
    paths = sorted(os.path.abspath(p) for p in glob.glob(pattern, recursive=True))
    paths = [p for p in paths if os.path.isfile(p)]
    if not paths:
        raise ValueError(f"data.files={pattern!r} matches no files")
    static = []
    for part in os.path.abspath(pattern).split(os.sep):
        if glob.has_magic(part):
            break
        static.append(part)
    root = os.sep.join(static) or os.sep
    if not os.path.isdir(root):  # the pattern names a single file
        root = os.path.dirname(root)
    return root, paths


def path_hash_fraction(relpath: str) -> float:
    """A uniform number in [0, 1) fixed by the path: the file's place in the split."""
    digest = hashlib.sha256(relpath.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_splits(relpaths: list[str], validation_fraction: float) -> dict[str, list[str]]:
    """{"train": [...], "validation": [...]}, by path hash; both non-empty given two files."""
    if len(relpaths) < 2:
        raise ValueError(
            f"need at least 2 usable files to split into train and validation, got {relpaths}"
        )
    by_hash = sorted(relpaths, key=path_hash_fraction)
    n_val = sum(path_hash_fraction(p) < validation_fraction for p in by_hash)
    n_val = min(max(n_val, 1), len(by_hash) - 1)
    return {"train": sorted(by_hash[n_val:]), "validation": sorted(by_hash[:n_val])}


def cut_after(window: bytes) -> int:
    """Where a document boundary falls in `window` (bytes from a nominal cut): just after the
    first blank line, else after the first line end, else at the first UTF-8 character start
    (a byte that is not 0b10xxxxxx); len(window) if there is none."""
    for sep in (b"\n\n", b"\n"):
        at = window.find(sep)
        if at >= 0:
            return at + len(sep)
    return next((i for i, b in enumerate(window) if b & 0xC0 != 0x80), len(window))


def cut_search_bytes(document_bytes: int) -> int:
    """How far past a nominal cut the boundary is looked for (module doc)."""
    return min(document_bytes // 4, _MAX_SEARCH)


def num_documents(size: int, document_bytes: int) -> int:
    """Documents in a file of `size` bytes: 1 for a whole file, else one per nominal cut."""
    return 1 if document_bytes == 0 or size <= document_bytes else -(-size // document_bytes)


def document_range(f, size: int, index: int, document_bytes: int) -> tuple[int, bytes]:
    """(start offset, bytes) of document `index` of an open binary file of `size` bytes."""
    if num_documents(size, document_bytes) == 1:
        f.seek(0)
        return 0, f.read()
    search = cut_search_bytes(document_bytes)
    lo = index * document_bytes
    hi = lo + document_bytes
    f.seek(lo)
    buf = f.read(document_bytes + search)  # this cut's window, the text, the next cut's window
    start = 0 if index == 0 else cut_after(buf[:search])
    end = len(buf) if hi >= size else document_bytes + cut_after(buf[document_bytes:])
    return lo + start, buf[start:max(start, end)]


def decode_document(data: bytes, where: str) -> str:
    """UTF-8 text; BadTextError naming `where` for NUL bytes (binary) or invalid UTF-8."""
    if b"\x00" in data:
        raise BadTextError(f"{where} holds NUL bytes (a binary file?)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadTextError(f"{where} is not valid UTF-8 ({e.reason} at byte {e.start} of "
                           "that range)") from e


@dataclasses.dataclass(frozen=True)
class TextFile:
    relpath: str  # under the corpus root
    size: int  # bytes, at start-up


@dataclasses.dataclass(frozen=True, eq=False)
class FileDocuments:
    """One process's documents of one split, as str by index: a Grain MapDataset source
    (picklable: it holds paths and numbers, and opens a file per read)."""

    root: str
    files: tuple[TextFile, ...]  # the split's files, sorted
    starts: tuple[int, ...]  # starts[k] = the split's documents before files[k]
    first: int  # this share: the split's documents [first, stop)
    stop: int
    document_bytes: int
    on_bad_file: str

    def __len__(self) -> int:
        return self.stop - self.first

    def locate(self, index: int) -> tuple[TextFile, int]:
        """(file, document number in that file) of this share's document `index`."""
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} is outside this share of {len(self)}")
        g = self.first + index
        k = bisect.bisect_right(self.starts, g) - 1
        return self.files[k], g - self.starts[k]

    def __getitem__(self, index: int) -> str:
        file, n = self.locate(int(index))
        path = os.path.join(self.root, file.relpath)
        try:
            with open(path, "rb") as f:
                start, data = document_range(f, file.size, n, self.document_bytes)
            return decode_document(data, f"bytes [{start}, {start + len(data)}) of {path}")
        except (OSError, BadTextError) as e:
            reason = e if isinstance(e, BadTextError) else f"cannot read {path}: {e}"
            if self.on_bad_file == "stop":
                raise BadTextError(f"{reason} (data.on_bad_file='stop'; set 'skip' to skip "
                                   "such text with a warning)") from e
            log.warning("skipping %s", reason)
            return ""  # dropped by the pipeline (an empty document holds no text)


def split_shares(n: int, process_count: int) -> list[tuple[int, int]]:
    """[first, stop) of each process's contiguous part of n documents (sizes differ by <= 1)."""
    return [(p * n // process_count, (p + 1) * n // process_count) for p in range(process_count)]


@dataclasses.dataclass(frozen=True, eq=False)
class LocalFiles:
    """A corpus of local text files: its usable files by split, and how they are cut."""

    name: str  # "local_text/files_<hash>" or "local_text/stdlib_<hash>" (module doc)
    root: str
    splits: dict[str, tuple[TextFile, ...]]  # "train" / "eval" -> sorted files
    document_bytes: int
    on_bad_file: str
    bad: tuple[str, ...]  # files left out at start-up (empty or unreadable), with the reason

    def share(self, split: str, process_index: int = 0, process_count: int = 1
              ) -> FileDocuments:
        """Process `process_index` of `process_count`'s documents of `split` ("train"/"eval")."""
        files = self.splits[split]
        starts = tuple(itertools.accumulate(
            (num_documents(f.size, self.document_bytes) for f in files), initial=0))
        first, stop = split_shares(starts[-1], process_count)[process_index]
        return FileDocuments(self.root, files, starts[:-1], first, stop, self.document_bytes,
                             self.on_bad_file)

    def texts(self, split: str) -> Iterator[str]:
        """Every document of `split` in file order, read lazily (to train the tokenizer)."""
        docs = self.share(split)
        return (docs[i] for i in range(len(docs)))

    def describe(self, split: str) -> str:
        files = self.splits[split]
        return f"{len(files)} files, {sum(f.size for f in files):,} bytes"


def open_local_files(files: str, *, validation_fraction: float, document_bytes: int,
                     on_bad_file: str) -> LocalFiles:
    """Lists `files` (a glob; "" = the standard library's .py files) and their sizes; reads
    none of them. Empty or unreadable files are named, and skipped or refused (`on_bad_file`)."""
    if on_bad_file not in ON_BAD_FILE:
        raise ValueError(f"data.on_bad_file={on_bad_file!r} is invalid: expected one of "
                         f"{ON_BAD_FILE}")
    root, paths = glob_files(files) if files else stdlib_python_files()
    usable, bad = [], []
    for path in paths:
        rel = os.path.relpath(path, root)
        try:
            size = os.stat(path).st_size
            problem = ("it is empty" if size == 0 else
                       None if os.access(path, os.R_OK) else "it is not readable")
        except OSError as e:
            problem = f"cannot stat it: {e.strerror}"
        if problem:
            bad.append(f"{path}: {problem}")
        else:
            usable.append(TextFile(rel, size))
    if bad:
        listed = "; ".join(bad[:_LISTED_BAD]) + (
            f"; and {len(bad) - _LISTED_BAD} more" if len(bad) > _LISTED_BAD else "")
        if on_bad_file == "stop":
            raise BadTextError(f"{len(bad)} of {len(paths)} files of data.files={files!r} "
                               f"cannot be used: {listed} (data.on_bad_file='stop')")
        log.warning("skipping %d of %d text files: %s", len(bad), len(paths), listed)
    by_rel = {f.relpath: f for f in usable}
    assigned = assign_splits(sorted(by_rel), validation_fraction)
    h = hashlib.sha256(f"{validation_fraction!r} {document_bytes}\n".encode())
    for f in usable:
        h.update(f"{f.relpath}\0{f.size}\n".encode("utf-8", "surrogateescape"))
    return LocalFiles(
        name=f"local_text/{'files' if files else 'stdlib'}_{h.hexdigest()[:16]}",
        root=root,
        splits={"train": tuple(by_rel[r] for r in assigned["train"]),
                "eval": tuple(by_rel[r] for r in assigned["validation"])},
        document_bytes=document_bytes,
        on_bad_file=on_bad_file,
        bad=tuple(bad),
    )
