"""Docs that cannot drift: every module imports, and every `llm_jax.x.y` name and package file path
written in README.md, docs/, launch/, configs/ and the package's own docstrings and comments
resolves to something that exists; a name written with its module (`sharding.parse_mesh`,
"`parse_mesh` in `sharding.py`", "`sharding.py`'s `parse_mesh`") is defined in that module."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
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


# a name in backticks, qualified by a module: `sharding.parse_mesh`, `sharding.constrain(x, names)`
QUALIFIED = re.compile(r"`(\w+(?:\.\w+)+)(?:\([^`]*\))?`")
FILE_NAME = re.compile(r"\.(?:py|md|json|jsonl|txt|toml|sh|yaml|gz|safetensors|model)$")
# spans that start with a module's name but name something else
NOT_MODULE_REFERENCES = {
    "norm.scale": "the final norm's parameter path",
    "model.norm.weight": "a Hugging Face tensor name",
    "app.run": "absl's app.run",
    "run.start": "an attribute of a training run",
    "train.num_step": "a misspelt field, as an example of what the config refuses",
}
# "`parse_mesh` in `sharding.py`", "`parse_mesh()` (`parallel/sharding.py`)"
NAME_IN_FILE = re.compile(r"`(\w+(?:\.\w+)*)(?:\(\))?` (?:in |\()`((?:\w+/)*\w+)\.py`")
# "`sharding.py`'s `parse_mesh`", "`sharding.py` (`parse_mesh`)"
FILES_NAME = re.compile(r"`((?:\w+/)*\w+)\.py`(?:'s | \()`(\w+(?:\.\w+)*)(?:\(\))?`")
# a bare file name: `step.py`
BARE_FILE = re.compile(r"`(\w+\.py)`")


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


@functools.cache
def modules_named() -> dict[str, tuple[str, ...]]:
    """Each module's (or package's) last name -> the llm_jax modules that carry it."""
    named: dict[str, list[str]] = {}
    for name in modules():
        if name != "llm_jax":
            named.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    return {k: tuple(v) for k, v in named.items()}


@functools.cache
def run_config_sections() -> dict[str, frozenset[str]]:
    """The run config's sections and their fields (`train.batch_size` names a field, not the
    `llm_jax.train` module's attribute)."""
    spec = importlib.util.spec_from_file_location("tiny_config", ROOT / "configs" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    return {k: frozenset(v.keys()) for k, v in cfg.items() if hasattr(v, "keys")}


def has_attribute(obj, name: str) -> bool:
    """An attribute, or a dataclass field without a default (not a class attribute)."""
    if hasattr(obj, name):
        return True
    return isinstance(obj, type) and dataclasses.is_dataclass(obj) and any(
        f.name == name for f in dataclasses.fields(obj))


def defined_in(module: str, dotted: str) -> bool:
    """`dotted` (a name, or a name and its attributes) exists in the llm_jax module `module`;
    a submodule of a package counts."""
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError:
        return False
    for part in dotted.split("."):
        if has_attribute(obj, part):
            obj = getattr(obj, part, None)
            continue
        try:
            obj = importlib.import_module(f"{obj.__name__}.{part}")
        except (ModuleNotFoundError, AttributeError):
            return False
    return True


def qualified_name_resolves(dotted: str) -> bool:
    """`module.name[.attr]`: defined in some llm_jax module whose last name is `module`, or a
    field of the run config's section of that name. Spans whose first word names no module
    (`jax.lax.scan`, `cfg.mesh`) are not module references and pass."""
    head, rest = dotted.split(".", 1)
    candidates = modules_named().get(head)
    if candidates is None or dotted in NOT_MODULE_REFERENCES:
        return True
    packages = [m for m in candidates if (PACKAGE.parent / m.replace(".", "/")).is_dir()]
    if len(packages) == len(candidates) and not any(
            (PACKAGE.parent / p.replace(".", "/") / rest.split(".", 1)[0]).with_suffix(".py")
            .exists() for p in packages):
        return True  # `model.layers.attn`: a parameter path, not the package's submodule
    if rest.split(".", 1)[0] in run_config_sections().get(head, ()):
        return True
    return any(defined_in(m, rest) for m in candidates)


def name_in_file_resolves(path: str, dotted: str) -> bool:
    """`dotted` is defined in the llm_jax module at `path` (`sharding`, `parallel/sharding`,
    `llm_jax/parallel/sharding`); a file outside the package (`configs/tiny`) passes."""
    parts = path.removeprefix("llm_jax/").split("/")
    candidates = [m for m in modules_named().get(parts[-1], ())
                  if m.split(".")[-len(parts):] == parts]
    if not candidates:
        return True
    return any(defined_in(m, dotted) for m in candidates)


@functools.cache
def python_file_names() -> frozenset[str]:
    return frozenset(p.name for folder in ("llm_jax", "tests", "configs", "launch")
                     for p in (ROOT / folder).rglob("*.py"))


def misplaced_names(text: str) -> list[str]:
    """The names in `text` written with a module that does not define them."""
    bad = [m for m in QUALIFIED.findall(text)
           if not m.startswith("llm_jax.") and not FILE_NAME.search(m)
           and not qualified_name_resolves(m)]
    bad += [f"{n} in {p}.py" for n, p in NAME_IN_FILE.findall(text)
            if not name_in_file_resolves(p, n)]
    bad += [f"{n} in {p}.py" for p, n in FILES_NAME.findall(text)
            if not name_in_file_resolves(p, n)]
    bad += [f for f in BARE_FILE.findall(text) if f not in python_file_names()]
    return sorted(set(bad))


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


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_written_with_its_module_is_defined_there(doc):
    assert misplaced_names(doc.read_text(encoding="utf-8")) == [], doc


def test_a_name_placed_in_the_wrong_module_is_caught():
    right = ("`sharding.parse_mesh` splits the spec; `parse_mesh` in `sharding.py` and "
             "`parallel/sharding.py`'s `RULES`; `costs.param_shardings(cfg, mesh)`; the field "
             "`train.batch_size`; `jax.shard_map`; `weights.flat.aligned_empty`; "
             "`MESH_AXES` (`sharding.py`); `step.py`")
    assert misplaced_names(right) == []
    wrong = ("`costs.parse_mesh` splits the spec; `parse_mesh` in `costs.py`; `costs.py`'s "
             "`RULES`; `train.no_such_field`; `weights.flat.no_such_name`; "
             "`state_shardings` (`costs.py`); `train_step.py`")
    assert misplaced_names(wrong) == ["RULES in costs.py", "costs.parse_mesh",
                                      "parse_mesh in costs.py", "state_shardings in costs.py",
                                      "train.no_such_field", "train_step.py",
                                      "weights.flat.no_such_name"]


def test_a_misspelt_module_path_in_a_docstring_is_caught():
    text = '"""Mask rules: see `llm_jax.model.atention.attention_mask` and model/atention.py."""'
    assert stale_references(text) == ["llm_jax.model.atention.attention_mask", "model/atention.py"]
    assert stale_references(text.replace("atention", "attention")) == []
