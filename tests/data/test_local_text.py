"""Local text files read where they lie: discovery, documents cut at text boundaries, bad files
named and skipped or refused, the train/validation split, process shares, no TFDS build."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from llm_jax.data import DataConfig, local_text
from llm_jax.data.local_text import (
    BadTextError,
    cut_after,
    num_documents,
    open_local_files,
    stdlib_python_files,
)


def _open(pattern: str, fraction: float = 0.2, document_bytes: int = 0, on_bad_file="skip"):
    return open_local_files(pattern, validation_fraction=fraction,
                            document_bytes=document_bytes, on_bad_file=on_bad_file)


def _docs(corpus, split: str, p: int = 0, n: int = 1) -> list[str]:
    share = corpus.share(split, p, n)
    return [share[i] for i in range(len(share))]


def _text_with_paragraphs(rng: np.random.Generator, size: int) -> str:
    """About `size` bytes of lines and blank lines, with multi-byte characters, and one long
    line with no line end at all (so the character-boundary fallback is exercised)."""
    words = ["naïve", "日本語", "x", "return", "é", "def", "=", "🙂", "café", "0"]
    parts, n = [], 0
    while n < size:
        kind = rng.integers(0, 10)
        if kind == 0:
            line = "".join(rng.choice(words, 800))  # a long line: no \n for several KB
        else:
            line = " ".join(rng.choice(words, int(rng.integers(1, 20))))
        parts.append(line + ("\n\n" if kind == 1 else "\n"))
        n += len(parts[-1].encode())
    return "".join(parts)


def test_glob_matching_nothing_raises_naming_the_glob(tmp_path):
    pattern = str(tmp_path / "nothing" / "*.txt")
    with pytest.raises(ValueError, match="matches no files") as err:
        _open(pattern)
    assert pattern in str(err.value)


def test_whole_file_documents_hold_each_file_exactly(corpus_dir):
    corpus = _open(f"{corpus_dir}/*")
    docs = _docs(corpus, "train") + _docs(corpus, "eval")
    expected = []
    for name in sorted(os.listdir(corpus_dir)):
        with open(os.path.join(corpus_dir, name), encoding="utf-8", newline="") as f:
            expected.append(f.read())
    assert sorted(docs) == sorted(expected)


@pytest.mark.parametrize("document_bytes", [1024, 1500, 4096, 1 << 18])
def test_cut_documents_tile_each_file_exactly_at_text_boundaries(tmp_path, document_bytes):
    rng = np.random.default_rng(document_bytes)
    src = tmp_path / "src"
    src.mkdir()
    texts = {f"{i}.txt": _text_with_paragraphs(rng, int(rng.integers(10, 40_000)))
             for i in range(6)}
    texts["big.txt"] = _text_with_paragraphs(rng, 3 * document_bytes + 123)
    texts["tiny.txt"] = "one line, no end"
    for name, text in texts.items():
        (src / name).write_text(text, encoding="utf-8")
    corpus = _open(f"{src}/*.txt", 0.3, document_bytes, on_bad_file="stop")
    for split in ("train", "eval"):
        share = corpus.share(split)
        by_file: dict[str, list[str]] = {}
        for i in range(len(share)):
            file, _ = share.locate(i)
            by_file.setdefault(file.relpath, []).append(share[i])
        for name, pieces in by_file.items():
            assert "".join(pieces) == texts[name]  # every byte once, in order
            size = len(texts[name].encode())
            assert len(pieces) == num_documents(size, document_bytes)
            search = local_text.cut_search_bytes(document_bytes)
            for piece in pieces:  # none much longer than the cap
                assert len(piece.encode()) <= document_bytes + search
            data = texts[name].encode()
            for c, piece in enumerate(pieces[:-1], 1):  # after a line end where there is one
                window = data[c * document_bytes:c * document_bytes + search]
                assert piece.endswith("\n") or b"\n" not in window


def test_cut_after_prefers_a_blank_line_then_a_line_end_then_a_character_start():
    assert cut_after(b"ab\ncd\n\nef") == 7
    assert cut_after(b"ab\ncd") == 3
    assert cut_after("\u00e9x".encode()[1:]) == 1  # starts inside a 2-byte character
    assert cut_after(b"") == 0


def test_split_is_deterministic_disjoint_and_both_nonempty(corpus_dir):
    a, b = _open(f"{corpus_dir}/*"), _open(f"{corpus_dir}/*")
    train = {f.relpath for f in a.splits["train"]}
    val = {f.relpath for f in a.splits["eval"]}
    assert train == {f.relpath for f in b.splits["train"]}
    assert val == {f.relpath for f in b.splits["eval"]}
    assert train and val and not train & val


def test_split_keeps_a_file_in_its_split_when_files_are_added():
    names = [f"f{i}.py" for i in range(200)]
    before = local_text.assign_splits(names, 0.1)
    after = local_text.assign_splits(names + [f"g{i}.py" for i in range(50)], 0.1)
    assert set(before["validation"]) <= set(after["validation"])
    assert 5 <= len(before["validation"]) <= 40  # about 10% of 200


@pytest.mark.parametrize("count", [2, 3, 5])
def test_process_shares_are_contiguous_disjoint_and_cover_the_split(tmp_path, count):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(7):
        (src / f"{i}.txt").write_text(f"line {i}\n" * (300 * (i + 1)))
    corpus = _open(f"{src}/*.txt", 0.2, document_bytes=1024)
    everything = _docs(corpus, "train")
    shares = [_docs(corpus, "train", p, count) for p in range(count)]
    assert sum(shares, []) == everything
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def _bad_corpus(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"good{i}.txt").write_text(f"good file {i}\n")
    (src / "empty.txt").write_bytes(b"")
    (src / "binary.txt").write_bytes(b"abc\x00def")
    (src / "latin1.txt").write_bytes("café".encode("latin-1"))
    return src


def test_bad_files_are_named_and_skipped_by_default(tmp_path, caplog):
    src = _bad_corpus(tmp_path)
    with caplog.at_level(logging.WARNING, logger="llm_jax.data.local_text"):
        corpus = _open(f"{src}/*.txt", 0.3)
        docs = _docs(corpus, "train") + _docs(corpus, "eval")
    for name in ("binary.txt", "empty.txt", "latin1.txt"):
        assert any(name in r.getMessage() for r in caplog.records), name
    assert sorted(d for d in docs if d) == [f"good file {i}\n" for i in range(3)]
    assert [os.path.basename(b.split(":")[0]) for b in corpus.bad] == ["empty.txt"]


def test_bad_files_are_refused_by_name_with_on_bad_file_stop(tmp_path):
    src = _bad_corpus(tmp_path)
    with pytest.raises(BadTextError, match="empty.txt: it is empty"):
        _open(f"{src}/*.txt", 0.3, on_bad_file="stop")
    os.remove(src / "empty.txt")
    corpus = _open(f"{src}/*.txt", 0.3, on_bad_file="stop")
    for split in ("train", "eval"):
        share = corpus.share(split)
        for i in range(len(share)):
            name = share.locate(i)[0].relpath
            if name.startswith("good"):
                assert share[i].startswith("good file")
            else:
                with pytest.raises(BadTextError, match=name):
                    share[i]


def test_on_bad_file_and_document_bytes_are_validated_by_name():
    with pytest.raises(ValueError, match="on_bad_file='skp'"):
        DataConfig(on_bad_file="skp")
    with pytest.raises(ValueError, match="document_bytes=100"):
        DataConfig(document_bytes=100)


def test_the_corpus_name_follows_the_file_list_sizes_and_cut(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"{i}.txt").write_text("x" * i + "\n")
    name = _open(f"{src}/*.txt", 0.1).name
    assert _open(f"{src}/*.txt", 0.1).name == name
    assert _open(f"{src}/[01].txt", 0.1).name != name
    assert _open(f"{src}/*.txt", 0.2).name != name
    assert _open(f"{src}/*.txt", 0.1, document_bytes=2048).name != name
    (src / "0.txt").write_text("edited, so the size changes\n")
    assert _open(f"{src}/*.txt", 0.1).name != name


def test_the_source_never_builds_a_tfds_dataset_or_reads_files_up_front(tmp_path, monkeypatch):
    """Start-up lists and stats files; it opens none (a 1.5 GB corpus costs what 15 MB does)."""
    import builtins

    import tensorflow_datasets as tfds

    src = tmp_path / "src"
    src.mkdir()
    for i in range(50):
        (src / f"{i}.txt").write_text(f"file {i}\n" * 1000)
    opened = []
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: (opened.append(str(f)),
                                                              real_open(f, *a, **k))[1])
    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare",
                        lambda *a, **k: pytest.fail("local text built a TFDS dataset"))
    from llm_jax.data.sources import open_text_splits

    splits = open_text_splits(DataConfig(files=f"{src}/*.txt", document_bytes=1024),
                              data_dir=str(tmp_path / "tfds"))
    share = splits.share("train", 1, 2)
    assert not [p for p in opened if p.startswith(str(src))]
    share[0]
    assert len([p for p in opened if p.startswith(str(src))]) == 1


def test_default_source_is_stdlib_python_without_site_packages_or_tests():
    root, paths = stdlib_python_files()
    rels = [os.path.relpath(p, root) for p in paths]
    assert "os.py" in rels and "json/decoder.py" in rels
    assert all(r.endswith(".py") for r in rels)
    parts = {part for r in rels for part in r.split("/")}
    assert not parts & {"site-packages", "test", "tests"}
