"""The LocalText TFDS builder: file discovery, skipping bad files, the train/validation split."""

from __future__ import annotations

import logging
import os

import pytest

from llm_jax.data import local_text
from llm_jax.data.local_text import build_local_text, local_text_config, stdlib_python_files


def _read_all(builder, split: str) -> dict[str, str]:
    source = builder.as_data_source(split=split)
    return {r["path"].decode(): r["text"].decode() for r in (source[i] for i in range(len(source)))}


def test_glob_matching_nothing_raises_naming_the_glob(tmp_path):
    pattern = str(tmp_path / "nothing" / "*.txt")
    with pytest.raises(ValueError, match="matches no files") as err:
        build_local_text(pattern, 0.2, str(tmp_path / "tfds"))
    assert pattern in str(err.value)


def test_records_hold_each_file_text_and_relative_path(corpus_dir, tmp_path):
    builder = build_local_text(f"{corpus_dir}/*", 0.2, str(tmp_path / "tfds"))
    records = {**_read_all(builder, "train"), **_read_all(builder, "validation")}
    assert sorted(records) == sorted(os.listdir(corpus_dir))
    for rel, text in records.items():
        with open(os.path.join(corpus_dir, rel), encoding="utf-8", newline="") as f:
            assert text == f.read()


def test_split_is_deterministic_disjoint_and_both_nonempty(corpus_dir, tmp_path):
    a = build_local_text(f"{corpus_dir}/*", 0.2, str(tmp_path / "a"))
    b = build_local_text(f"{corpus_dir}/*", 0.2, str(tmp_path / "b"))
    train_a, val_a = set(_read_all(a, "train")), set(_read_all(a, "validation"))
    assert train_a == set(_read_all(b, "train"))
    assert val_a == set(_read_all(b, "validation"))
    assert train_a and val_a and not train_a & val_a


def test_split_keeps_a_file_in_its_split_when_files_are_added():
    names = [f"f{i}.py" for i in range(200)]
    before = local_text.assign_splits(names, 0.1)
    after = local_text.assign_splits(names + [f"g{i}.py" for i in range(50)], 0.1)
    assert set(before["validation"]) <= set(after["validation"])
    assert 5 <= len(before["validation"]) <= 40  # about 10% of 200


def test_empty_binary_and_invalid_utf8_files_are_skipped_with_a_warning(tmp_path, caplog):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"good{i}.txt").write_text(f"good file {i}\n")
    (src / "empty.txt").write_bytes(b"")
    (src / "binary.txt").write_bytes(b"abc\x00def")
    (src / "latin1.txt").write_bytes("café".encode("latin-1"))
    with caplog.at_level(logging.WARNING, logger="llm_jax.data.local_text"):
        builder = build_local_text(f"{src}/*.txt", 0.3, str(tmp_path / "tfds"))
    bad = ["binary.txt", "empty.txt", "latin1.txt"]
    for name in bad:
        assert any(name in r.getMessage() for r in caplog.records), name
    assert sorted(builder.info.metadata["skipped_files"]) == bad
    kept = {**_read_all(builder, "train"), **_read_all(builder, "validation")}
    assert sorted(kept) == ["good0.txt", "good1.txt", "good2.txt"]


def test_a_changed_file_set_gets_a_new_build_name(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"{i}.txt").write_text("x" * i + "\n")
    name = local_text_config(f"{src}/*.txt", 0.1).name
    assert local_text_config(f"{src}/*.txt", 0.1).name == name
    assert local_text_config(f"{src}/[01].txt", 0.1).name != name
    assert local_text_config(f"{src}/*.txt", 0.2).name != name
    (src / "0.txt").write_text("edited, so the size changes\n")
    assert local_text_config(f"{src}/*.txt", 0.1).name != name


def test_default_source_is_stdlib_python_without_site_packages_or_tests():
    root, paths = stdlib_python_files()
    rels = [os.path.relpath(p, root) for p in paths]
    assert "os.py" in rels and "json/decoder.py" in rels
    assert all(r.endswith(".py") for r in rels)
    parts = {part for r in rels for part in r.split("/")}
    assert not parts & {"site-packages", "test", "tests"}
