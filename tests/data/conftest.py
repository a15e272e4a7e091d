"""A tiny local corpus of real Python source, copied into a temp dir per test session."""

from __future__ import annotations

import os
import shutil
import sysconfig

import pytest

# Small, stable standard-library modules: real code with docstrings, indentation, unicode.
_MODULES = ["json/__init__.py", "json/decoder.py", "json/encoder.py", "json/scanner.py",
            "json/tool.py", "bisect.py", "colorsys.py", "keyword.py", "textwrap.py", "this.py"]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("corpus")
    stdlib = sysconfig.get_paths()["stdlib"]
    for rel in _MODULES:
        dst = d / rel.replace("/", "_")
        shutil.copyfile(os.path.join(stdlib, rel), dst)
    text = "naïve café — 日本語 🎉\n\tx  =  1\n" * 20
    (d / "unicode.txt").write_text(text, encoding="utf-8")
    return str(d)
