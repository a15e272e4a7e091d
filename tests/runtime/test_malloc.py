"""The preferred malloc: which environment the CLIs re-execute with, that the child has the
library mapped and does not loop, `llm_jax.run`, and glibc's in-process tuning."""

import os
import platform
import subprocess
import sys

import pytest

from llm_jax.runtime import malloc

TC = "/lib/libtcmalloc_minimal.so.4"
MI = "/venv/cmeel.prefix/lib/libmimalloc.so"


@pytest.fixture
def libs(monkeypatch):
    """Pretend tcmalloc and mimalloc are installed (`set(tc=None)` uninstalls one)."""
    found = {"tc": TC, "mi": MI}
    monkeypatch.setattr(malloc, "find_tcmalloc", lambda *a: found["tc"])
    monkeypatch.setattr(malloc, "find_mimalloc", lambda *a: found["mi"])
    return found


def test_auto_prefers_tcmalloc_and_keeps_existing_preloads(libs):
    env = malloc.preload_env({"LD_PRELOAD": "/opt/libfoo.so", "PATH": "/bin"})
    assert env == {"LD_PRELOAD": f"{TC}:/opt/libfoo.so", "PATH": "/bin"}


def test_auto_falls_back_to_the_wheels_mimalloc_which_keeps_its_pages(libs):
    libs["tc"] = None
    env = malloc.preload_env({"PATH": "/bin"})
    assert env == {"LD_PRELOAD": MI, "MIMALLOC_PURGE_DELAY": "-1", "PATH": "/bin"}
    env = malloc.preload_env({"MIMALLOC_PURGE_DELAY": "50"})  # the user's setting wins
    assert env["MIMALLOC_PURGE_DELAY"] == "50"


def test_named_choices_and_their_errors(libs):
    assert malloc.preload_env({"LLM_JAX_MALLOC": "mimalloc"})["LD_PRELOAD"] == MI
    assert malloc.preload_env({"LLM_JAX_MALLOC": "tcmalloc"})["LD_PRELOAD"] == TC
    libs["tc"] = None
    with pytest.raises(ValueError, match="LLM_JAX_MALLOC='tcmalloc' but no tcmalloc is "
                                         "installed: apt install libtcmalloc-minimal4"):
        malloc.preload_env({"LLM_JAX_MALLOC": "tcmalloc"})


def test_no_reexec_when_off_already_preloaded_or_nothing_installed(libs):
    assert malloc.preload_env({"LLM_JAX_MALLOC": "system"}) is None
    assert malloc.preload_env({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) is None
    assert malloc.preload_env({"LD_PRELOAD": TC}) is None
    libs["tc"] = libs["mi"] = None
    assert malloc.preload_env({}) is None


def test_the_reexecuted_environment_is_final(libs):
    for choice in ("auto", "mimalloc", "tcmalloc"):
        env = malloc.preload_env({"LLM_JAX_MALLOC": choice})
        assert malloc.preload_env(env) is None, choice  # the child does not loop


def test_explicit_library_path_is_used_once(tmp_path):
    lib = tmp_path / "libmymalloc.so"
    lib.write_bytes(b"")
    env = malloc.preload_env({"LLM_JAX_MALLOC": str(lib)})
    assert env["LD_PRELOAD"] == str(lib)
    assert malloc.preload_env(env) is None


def test_missing_library_path_names_the_variable():
    with pytest.raises(ValueError, match="LLM_JAX_MALLOC='/nonexistent/lib.so' is not a file"):
        malloc.preload_env({"LLM_JAX_MALLOC": "/nonexistent/lib.so"})


def test_find_tcmalloc_looks_in_the_given_dirs(tmp_path):
    assert malloc.find_tcmalloc((str(tmp_path),)) is None
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    assert malloc.find_tcmalloc((str(tmp_path),)) == str(tmp_path / "libtcmalloc.so.4")


def test_find_mimalloc_locates_the_wheels_library():
    assert malloc.find_mimalloc("no-such-distribution") is None
    path = malloc.find_mimalloc()
    if path is None and not (sys.platform.startswith("linux")
                             and platform.machine() in ("x86_64", "aarch64")):
        pytest.skip("cmeel-mimalloc is a dependency only on x86_64/aarch64 Linux")
    assert path is not None, "cmeel-mimalloc is a dependency here (pyproject.toml) but not found"
    assert path.endswith(os.path.join("cmeel.prefix", "lib", "libmimalloc.so"))


def test_mapped_malloc_reads_the_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
                    "7f02-7f03 r-xp 0 08:01 2 /venv/cmeel.prefix/lib/libmimalloc.so\n")
    assert malloc.mapped_malloc(str(maps)) == "/venv/cmeel.prefix/lib/libmimalloc.so"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc_malloc_debug.so\n")
    assert malloc.mapped_malloc(str(maps)) is None
    assert malloc.mapped_malloc(str(tmp_path / "missing")) is None


def _child_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "LLM_JAX_MALLOC") and not k.startswith("MIMALLOC_")}
    return {**env, "PYTHONPATH": os.pathsep.join(sys.path), **extra}


REPORT = ("import os, sys; from llm_jax.runtime.malloc import active_malloc; "
          "print(sys.argv[1:], active_malloc(), os.environ.get('MIMALLOC_PURGE_DELAY'))")


@pytest.mark.skipif(malloc.preload_env(_child_env()) is None, reason="no malloc library here")
def test_reexec_keeps_argv_and_maps_the_library_in_the_child(tmp_path):
    code = "from llm_jax.runtime.malloc import use_preferred_malloc; use_preferred_malloc(); "
    out = subprocess.run([sys.executable, "-c", code + REPORT, "a", "--b=1"], env=_child_env(),
                         text=True, capture_output=True, timeout=120, check=True).stdout
    assert out.startswith("['a', '--b=1'] ")
    lib = out.split()[-2]  # what /proc/self/maps shows, not only what LD_PRELOAD asks for
    assert os.path.basename(lib).startswith(("libtcmalloc", "libmimalloc")), out


@pytest.mark.skipif(malloc.preload_env(_child_env()) is None, reason="no malloc library here")
def test_llm_jax_run_runs_a_script_under_the_library(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(REPORT + "; print(__name__)\n")
    out = subprocess.run([sys.executable, "-m", "llm_jax.run", str(script), "x"],
                         env=_child_env(), text=True, capture_output=True, timeout=120,
                         check=True).stdout.split()
    assert out[0] == "['x']" and "malloc" in os.path.basename(out[1]) and out[-1] == "__main__"
    out = subprocess.run([sys.executable, "-m", "llm_jax.run", "-m", "json.tool", "--help"],
                         env=_child_env(), text=True, capture_output=True, timeout=120)
    assert out.returncode == 0 and "json.tool" in out.stdout


def test_llm_jax_run_without_a_program_prints_usage():
    out = subprocess.run([sys.executable, "-m", "llm_jax.run"], text=True, capture_output=True,
                         env=_child_env(LLM_JAX_MALLOC="system"), timeout=120)
    assert out.returncode == 1 and "usage: python -m llm_jax.run SCRIPT" in out.stderr


# Imports the library's public modules in a fresh process and reports what importing them
# changed: libraries dlopen'ed through ctypes (mallopt needs libc), JAX's global config, the
# environment, and the malloc in use.
IMPORT_PROBE = """
import json, os, sys
opened = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "ctypes.dlopen" else None)
import jax
before = {k: repr(v) for k, v in jax.config.values.items()}
env = dict(os.environ)
import llm_jax
for name in ("ModelConfig", "Transformer", "init_model", "load_pretrained", "sample"):
    getattr(llm_jax, name)
import llm_jax.training.loop, llm_jax.training.step, llm_jax.inference.engine
from llm_jax.runtime.malloc import active_malloc
after = {k: repr(v) for k, v in jax.config.values.items()}
print(json.dumps({"dlopened": opened, "malloc": active_malloc(),
                  "tfds": "tensorflow_datasets" in sys.modules,
                  "config_changed": sorted(k for k in after if after[k] != before.get(k)),
                  "env_changed": sorted(k for k in set(env) | set(os.environ)
                                        if env.get(k) != os.environ.get(k))}))
"""


def test_importing_llm_jax_leaves_the_process_allocator_jax_config_and_env_alone():
    import json

    out = subprocess.run([sys.executable, "-c", IMPORT_PROBE], env=_child_env(), text=True,
                         capture_output=True, timeout=300, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert not [lib for lib in r["dlopened"] if "libc" in lib], r["dlopened"]  # no mallopt
    assert r["malloc"] == "system", r
    assert r["config_changed"] == [], r["config_changed"]
    assert r["env_changed"] == [], r["env_changed"]
    assert not r["tfds"]  # TFDS is imported by the runs that read it, not by the trainer


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_command_lines_tune_glibc_where_no_malloc_library_is_installed():
    code = ("from llm_jax.runtime import malloc; malloc.find_tcmalloc = lambda *a: None; "
            "malloc.find_mimalloc = lambda *a: None; malloc.use_preferred_malloc(); "
            "print(malloc.active_malloc())")

    def run(**env):
        return subprocess.run([sys.executable, "-c", code], env=_child_env(**env), text=True,
                              capture_output=True, timeout=120, check=True).stdout.strip()

    assert run() == "glibc (tuned)"
    assert run(LLM_JAX_MALLOC="system") == "system"
