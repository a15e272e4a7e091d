"""Docs that cannot drift: every module imports, and every `llm_jax.x.y` name and package file path
written in README.md, docs/, launch/, configs/ and the package's own docstrings and comments
resolves to something that exists."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llm_jax"
FOLDERS = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())

DOTTED = re.compile(r"(?<![\w./-])llm_jax(?:\.\w+)+")
# `llm_jax/model/attention.py`, or a package-relative `model/attention.py` / `kernels/select.py`
FILE_PATH = re.compile(r"(?<![\w./-])(?:llm_jax/)?(?:" + "|".join(FOLDERS) + r")/[\w/]*\w\.py\b")
# `model/matmul.einsum`: a package-relative module and a name in it
MODULE_ATTR = re.compile(r"(?<![\w./-])(?:llm_jax/)?((?:" + "|".join(FOLDERS) + r")/\w+)\.(?!py\b)(\w+)")
TEST_PATH = re.compile(r"(?<![\w./-])tests/[\w/]*\w\.py\b")


def modules() -> list[str]:
    names = []
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def documents() -> list[pathlib.Path]:
    return ([ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
            + sorted(p for p in (ROOT / "launch").iterdir() if p.is_file())
            + sorted((ROOT / "configs").glob("*.py")) + sorted(PACKAGE.rglob("*.py")))


def resolves(dotted: str) -> bool:
    """`llm_jax.a.b.c`: the longest importable module prefix, then attributes for the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def file_exists(path: str) -> bool:
    rel = path if path.startswith(("llm_jax/", "tests/")) else "llm_jax/" + path
    return (ROOT / rel).exists()


def stale_references(text: str) -> list[str]:
    """The names and paths in `text` that do not resolve."""
    bad = [m for m in DOTTED.findall(text) if not resolves(m.rstrip("."))]
    bad += [f"{m}.{a}" for m, a in MODULE_ATTR.findall(text)
            if not resolves("llm_jax." + m.removeprefix("llm_jax/").replace("/", ".") + "." + a)]
    bad += [m for m in FILE_PATH.findall(text) + TEST_PATH.findall(text) if not file_exists(m)]
    return sorted(set(bad))


@pytest.mark.parametrize("name", modules())
def test_every_package_module_imports(name):
    importlib.import_module(name)


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_reference_in_docs_and_docstrings_resolves(doc):
    assert stale_references(doc.read_text(encoding="utf-8")) == [], doc


def test_a_misspelt_module_path_in_a_docstring_is_caught():
    text = '"""Mask rules: see `llm_jax.model.atention.attention_mask` and model/atention.py."""'
    assert stale_references(text) == ["llm_jax.model.atention.attention_mask", "model/atention.py"]
    assert stale_references(text.replace("atention", "attention")) == []
