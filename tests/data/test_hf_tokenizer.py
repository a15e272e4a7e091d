"""A run's own copy of its tokenizer (`run_tokenizer`): made whole or not at all on the first
start, read by every later start, and a changed source refused by the field that names it. Plain
files, no model: the copy compares bytes, it does not parse them."""

from __future__ import annotations

import pytest

from llm_jax.data import hf_tokenizer
from llm_jax.data.hf_tokenizer import RUN_TOKENIZER_DIR, run_tokenizer, tokenizer_dir


def _source(d, vocab="a b c"):
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_text(vocab)
    (d / "chat_template.jinja").write_text("{{ messages }}")
    (d / "model.safetensors").write_text("weights: not a tokenizer file")
    return d


def test_first_start_copies_the_tokenizer_files_and_a_resume_reads_the_copy(tmp_path):
    src, work = _source(tmp_path / "base"), tmp_path / "run"
    copy = run_tokenizer(work, str(src), "sft.tokenizer", fresh=True, write=True)
    assert copy == work / RUN_TOKENIZER_DIR
    assert sorted(p.name for p in copy.iterdir()) == ["chat_template.jinja", "tokenizer.json"]
    assert [p.name for p in work.iterdir()] == [RUN_TOKENIZER_DIR]  # no temporary left behind
    # Resumed with the source unchanged, then with it gone: the copy either way.
    assert run_tokenizer(work, str(src), "sft.tokenizer", fresh=False, write=True) == copy
    for p in src.iterdir():
        p.unlink()
    src.rmdir()
    assert run_tokenizer(work, str(src), "sft.tokenizer", fresh=False, write=True) == copy
    assert (copy / "tokenizer.json").read_text() == "a b c"
    # Another process of the run reads what process 0 copied, and writes nothing.
    assert run_tokenizer(work, "", "train.init_from", fresh=False, write=False) == copy


def test_a_resume_whose_source_changed_is_refused_naming_the_field_and_both_paths(tmp_path):
    src, work = _source(tmp_path / "base"), tmp_path / "run"
    copy = run_tokenizer(work, str(src), "train.init_from", fresh=True, write=True)
    (src / "tokenizer.json").write_text("a b c d")
    with pytest.raises(ValueError, match=rf"train\.init_from='{src}'.*{src / 'tokenizer.json'}"
                                         rf".*\({copy / 'tokenizer.json'}\).*mid-run"):
        run_tokenizer(work, str(src), "train.init_from", fresh=False, write=True)
    assert (copy / "tokenizer.json").read_text() == "a b c"  # the run's copy is left alone
    # A fresh start (no checkpoint yet) takes the source as it is now.
    run_tokenizer(work, str(src), "train.init_from", fresh=True, write=True)
    assert (copy / "tokenizer.json").read_text() == "a b c d"


def test_a_copy_interrupted_half_way_is_never_read(tmp_path, monkeypatch):
    src, work = _source(tmp_path / "base"), tmp_path / "run"
    copies = []

    def copy_then_crash(a, b):
        if copies:
            raise OSError("disk full")
        copies.append(b)
        return b.write_bytes(a.read_bytes())

    monkeypatch.setattr(hf_tokenizer.shutil, "copyfile", copy_then_crash)
    with pytest.raises(OSError, match="disk full"):
        run_tokenizer(work, str(src), "sft.tokenizer", fresh=True, write=True)
    assert not (work / RUN_TOKENIZER_DIR).exists()  # the half copy is a temporary, not the copy
    monkeypatch.undo()
    # The restart (still no checkpoint) copies again, over the leftover temporary.
    copy = run_tokenizer(work, str(src), "sft.tokenizer", fresh=True, write=True)
    assert sorted(p.name for p in copy.iterdir()) == ["chat_template.jinja", "tokenizer.json"]
    assert [p.name for p in work.iterdir()] == [RUN_TOKENIZER_DIR]


def test_a_source_without_tokenizer_json_is_returned_for_the_reader_to_refuse(tmp_path):
    src, work = tmp_path / "empty", tmp_path / "run"
    src.mkdir()
    assert run_tokenizer(work, str(src), "dpo.tokenizer", fresh=True, write=True) == src
    assert not (work / RUN_TOKENIZER_DIR).exists()


def test_a_run_from_before_copies_gets_one_on_resume_and_lends_it_as_a_source(tmp_path):
    src, work = _source(tmp_path / "base"), tmp_path / "run"
    copy = run_tokenizer(work, str(src), "rl.tokenizer", fresh=False, write=True)
    assert (copy / "tokenizer.json").is_file()
    assert tokenizer_dir(work) == copy  # train.init_from=WORKDIR of a later run finds it
