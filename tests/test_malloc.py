"""The CLI's re-exec under tcmalloc: which environment it chooses, and that the child sees it."""

import os
import subprocess
import sys

import pytest

from llm_jax.runtime import malloc


def test_auto_preloads_tcmalloc_first_and_keeps_existing_preloads(monkeypatch):
    monkeypatch.setattr(malloc, "find_tcmalloc", lambda: "/lib/libtcmalloc_minimal.so.4")
    env = malloc.preload_env({"LD_PRELOAD": "/opt/libfoo.so", "PATH": "/bin"})
    assert env == {"LD_PRELOAD": "/lib/libtcmalloc_minimal.so.4:/opt/libfoo.so", "PATH": "/bin"}


def test_no_reexec_when_off_already_preloaded_or_not_installed(monkeypatch):
    monkeypatch.setattr(malloc, "find_tcmalloc", lambda: "/lib/libtcmalloc_minimal.so.4")
    assert malloc.preload_env({"LLM_JAX_MALLOC": "system"}) is None
    assert malloc.preload_env({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) is None
    monkeypatch.setattr(malloc, "find_tcmalloc", lambda: None)
    assert malloc.preload_env({}) is None


def test_explicit_library_path_is_used_once(tmp_path):
    lib = tmp_path / "libmymalloc.so"
    lib.write_bytes(b"")
    env = malloc.preload_env({"LLM_JAX_MALLOC": str(lib)})
    assert env["LD_PRELOAD"] == str(lib)
    assert malloc.preload_env(env) is None  # the re-executed child does not loop


def test_missing_library_path_names_the_variable():
    with pytest.raises(ValueError, match="LLM_JAX_MALLOC='/nonexistent/lib.so' is not a file"):
        malloc.preload_env({"LLM_JAX_MALLOC": "/nonexistent/lib.so"})


def test_find_tcmalloc_looks_in_the_given_dirs(tmp_path):
    assert malloc.find_tcmalloc((str(tmp_path),)) is None
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    assert malloc.find_tcmalloc((str(tmp_path),)) == str(tmp_path / "libtcmalloc.so.4")


@pytest.mark.skipif(malloc.find_tcmalloc() is None, reason="no tcmalloc installed here")
def test_reexec_keeps_argv_and_loads_tcmalloc_in_the_child():
    code = ("import sys; from llm_jax.malloc import use_preferred_malloc; use_preferred_malloc(); "
            "maps = open('/proc/self/maps').read(); "
            "print(sys.argv[1:], 'tcmalloc' in maps)")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LLM_JAX_MALLOC")}
    out = subprocess.run([sys.executable, "-c", code, "a", "--b=1"], env=env, text=True,
                         capture_output=True, timeout=60, check=True).stdout
    assert out.strip() == "['a', '--b=1'] True"
