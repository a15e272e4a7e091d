"""Test-wide setup: JAX on CPU, and absl flags marked parsed for Grain worker processes."""

import os

from xla_flags import FAST_XLA_FLAGS

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU's cheapest code generation (tests/xla_flags.py) for the whole suite, in process and in
# the command lines it starts (they inherit the environment). A test that sets XLA_FLAGS itself
# keeps its own.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_XLA_FLAGS}".strip()

import atexit  # noqa: E402
import shutil  # noqa: E402
import sysconfig  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
from absl import flags  # noqa: E402

# Compiled executables are cached across the tests of this run (and by the CLI subprocesses,
# through the env) in a directory of its own, removed at exit, rather than one shared by every
# run on the machine, which kept growing with executables of old code and of both CI legs.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="llm_jax_test_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# Grain worker processes read absl flags; unparsed flags raise UnparsedFlagAccessError there.
flags.FLAGS.mark_as_parsed()

def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with a `slow` test run first, each module's tests still together and in file
    order. Under `-n 2 --dist loadscope` a worker takes the next whole module as it frees up:
    a long module handed out last would leave one worker running it alone while the other
    idles, so the long ones go out while the short ones can still even out the ends."""
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)  # stable


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


# Maps a test process may hold before it drops JAX's in-process caches (vm.max_map_count is
# 65,530 by default).
MAX_MAPS = 20_000


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's in-process caches after a test module once the process holds MAX_MAPS memory
    maps. Every compiled XLA:CPU program holds about three until it is released; a pytest-xdist
    worker that kept them all passed 39,000 a third of the way through the suite, and at the
    kernel's limit the next compile or cache load crashed the worker (segfault or abort inside
    XLA, three times on jax 0.12). Dropping them after every module instead made the suite
    nearly twice as slow."""
    yield
    try:
        with open("/proc/self/maps") as f:
            maps = sum(1 for _ in f)
    except OSError:  # no /proc: not Linux
        return
    if maps > MAX_MAPS:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()



@pytest.fixture(scope="session")
def harmony_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A tiny checkpoint that answers in harmony (helpers.make_harmony_checkpoint), trained once
    per run: pytest-xdist's workers share it through their common temporary directory, the
    first to arrive makes it under a file lock (xdist's documented pattern)."""
    from filelock import FileLock
    from helpers import make_harmony_checkpoint

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the workers of this run
    d = root / "harmony_checkpoint"
    with FileLock(str(d) + ".lock"):
        if not (d / "config.json").is_file():
            make_harmony_checkpoint(d.with_name(d.name + ".partial"))
            (d.with_name(d.name + ".partial")).rename(d)
    return d


@pytest.fixture(scope="session")
def harmony_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """A directory holding only the harmony checkpoint's tokenizer (no model: seconds to make),
    for tests of rendering and data."""
    from helpers import make_harmony_tokenizer

    d = tmp_path_factory.mktemp("harmony_tokenizer")
    make_harmony_tokenizer(d)
    return d
