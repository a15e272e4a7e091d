"""Test-wide setup: JAX on CPU, and absl flags marked parsed for Grain worker processes."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import shutil  # noqa: E402
import sysconfig  # noqa: E402

import pytest  # noqa: E402
from absl import flags  # noqa: E402

# Compiled executables are cached across tests (and by the CLI subprocesses, through the env).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    os.environ.get("TMPDIR", "/tmp"), f"llm_jax_test_xla_cache_{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# Grain worker processes read absl flags; unparsed flags raise UnparsedFlagAccessError there.
flags.FLAGS.mark_as_parsed()

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
