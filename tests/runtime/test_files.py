"""write_atomically: a directory is replaced whole or not at all, and nothing is left beside it."""

import os

import pytest

from llm_jax.runtime import files
from llm_jax.runtime.files import write_atomically


def _write(text):
    return lambda tmp: (tmp / "a.txt").write_text(text)


def test_a_new_directory_replaces_the_old_one_and_leaves_nothing_beside_it(tmp_path):
    dst = tmp_path / "out"
    write_atomically(dst, _write("one"))
    write_atomically(dst, _write("two"))
    assert (dst / "a.txt").read_text() == "two"
    assert os.listdir(tmp_path) == ["out"]


def test_a_failed_write_or_rename_leaves_the_old_directory_as_it_was(tmp_path, monkeypatch):
    dst = tmp_path / "out"
    write_atomically(dst, _write("old"))

    def fails(tmp):
        (tmp / "a.txt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(dst, fails)
    assert (dst / "a.txt").read_text() == "old" and os.listdir(tmp_path) == ["out"]

    real = os.replace

    def refuse_new(src, target):  # the rename of the new directory into place fails
        if ".tmp-" in str(src):
            raise OSError("rename refused")
        real(src, target)

    monkeypatch.setattr(files.os, "replace", refuse_new)
    with pytest.raises(OSError, match="rename refused"):
        write_atomically(dst, _write("new"))
    assert (dst / "a.txt").read_text() == "old" and os.listdir(tmp_path) == ["out"]

    def refuse_both(src, target):  # ... and the rename of the old one back fails as well
        if ".tmp-" in str(src) or ".old-" in str(src):
            raise OSError("rename refused")
        real(src, target)

    monkeypatch.setattr(files.os, "replace", refuse_both)
    with pytest.raises(OSError, match="nor put back .* the previous out is in") as e:
        write_atomically(dst, _write("new"))
    kept = e.value.args[0].rsplit(" is in ", 1)[1]
    assert open(os.path.join(kept, "a.txt")).read() == "old"  # never deleted
