"""A TFDS builder over local text files: by default the Python standard library's own source.

Why a real TFDS builder rather than reading files directly: the built dataset is an ArrayRecord
file set that `tfds.data_source` reads by random access without TensorFlow, the same path a
named TFDS dataset (lm1b, ...) takes, so the rest of the pipeline has one kind of source.
It lives in its own package module because TFDS resolves a builder's module to restore its
info (`dataset_info_from_configs` breaks for builders defined in `__main__` or a test file).

A build is keyed by its config name: `<source>_<hash>` where the hash covers the sorted file
list with sizes and mtimes and the validation fraction, so a different glob (or an edited file)
gets its own build instead of silently reusing a stale one.

Splits: a file goes to validation when the hash of its path (relative to the glob's root, so the
split is the same on every machine) falls below `validation_fraction`; this keeps each file's
split stable when files are added. Should that leave a split empty, the file with the lowest
(highest) hash moves over so both splits exist.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import logging
import os
import sysconfig

import tensorflow_datasets as tfds

log = logging.getLogger(__name__)

# Directories of the standard library that are not its code (installed packages) or are too
# large and odd to be useful text (the test suite: 20 MB, with deliberately broken encodings).
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)


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
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
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


def read_text_file(path: str) -> str | None:
    """The file's text, or None (with a warning naming it) if it is empty, binary or not UTF-8."""
    with open(path, "rb") as f:
        data = f.read()
    reason = None
    if not data:
        reason = "it is empty"
    elif b"\x00" in data:
        reason = "it holds NUL bytes (binary)"
    else:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            reason = f"it is not valid UTF-8 ({e.reason} at byte {e.start})"
    log.warning("skipping text file %s: %s", path, reason)
    return None


@dataclasses.dataclass(repr=False)
class LocalTextConfig(tfds.core.BuilderConfig):
    """Which files one build holds; make it with `local_text_config`, which sets the name."""

    root: str = ""
    relpaths: tuple[str, ...] = ()
    validation_fraction: float = 0.02

    def __repr__(self) -> str:  # TFDS logs the config; the file list would flood the log
        return f"LocalTextConfig({self.name!r}, {len(self.relpaths)} files under {self.root!r})"


def local_text_config(files: str, validation_fraction: float) -> LocalTextConfig:
    """The config for a glob (or, for files="", the standard library), named by content key."""
    root, paths = glob_files(files) if files else stdlib_python_files()
    h = hashlib.sha256(f"{validation_fraction!r}\n".encode())
    for p in paths:
        st = os.stat(p)
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return LocalTextConfig(
        name=f"{'files' if files else 'stdlib'}_{h.hexdigest()[:16]}",
        version="1.0.0",
        description=f"text files {files or 'of the Python standard library'} under {root}",
        root=root,
        relpaths=tuple(os.path.relpath(p, root) for p in paths),
        validation_fraction=validation_fraction,
    )


class LocalText(tfds.core.GeneratorBasedBuilder):
    """One example per usable file: {"text": its contents, "path": path under the root}."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "path": tfds.features.Text()}
            ),
            metadata=tfds.core.MetadataDict(),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        cfg = self.builder_config
        texts = {}
        skipped = []
        for rel in cfg.relpaths:
            text = read_text_file(os.path.join(cfg.root, rel))
            if text is None:
                skipped.append(rel)
            else:
                texts[rel] = text
        if skipped:
            log.warning("skipped %d of %d text files under %s", len(skipped), len(cfg.relpaths),
                        cfg.root)
        self.info.metadata["root"] = cfg.root
        self.info.metadata["skipped_files"] = skipped
        splits = assign_splits(sorted(texts), cfg.validation_fraction)
        return {
            name: self._generate_examples({rel: texts[rel] for rel in rels})
            for name, rels in splits.items()
        }

    def _generate_examples(self, texts: dict[str, str]):
        for rel, text in texts.items():
            yield rel, {"text": text, "path": rel}


def build_local_text(files: str, validation_fraction: float, data_dir: str) -> LocalText:
    """The prepared builder for `files` (built on first use, then read from `data_dir`)."""
    builder = LocalText(
        config=local_text_config(files, validation_fraction),
        data_dir=data_dir,
        file_format="array_record",
    )
    builder.download_and_prepare()
    return builder
