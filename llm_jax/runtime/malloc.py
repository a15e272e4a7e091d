"""Run under a malloc that keeps freed pages: tcmalloc or mimalloc, else glibc tuned in-process.

XLA:CPU allocates each step's temporaries afresh and frees them at its end. glibc's malloc hands
blocks this large straight back to the kernel (mmap/munmap), so every step faults in and zeroes
its working set again, a quarter of a CPU step for configs/tiny.py (docs/benchmarks.md).
tcmalloc and mimalloc keep freed pages. A malloc can only be replaced before the process
starts, so the command-line tools that compute (train, generate, serve, chat, eval, bench)
re-execute themselves with it in LD_PRELOAD (`use_preferred_malloc`), and
`python -m llm_jax.run SCRIPT` (or `llm_jax-run`) does the same for any program; where neither
library is installed they tune glibc in-process instead (`tune_glibc`). A process that merely
imports llm_jax keeps its malloc as it is: a library does not change its host's allocator.

`LLM_JAX_MALLOC` chooses: `auto` (the default: tcmalloc if the system has it, else mimalloc from
the `cmeel-mimalloc` wheel that `pip install` brings), `tcmalloc`, `mimalloc`, `system` (glibc
as it is, untuned), or the path of a malloc library to preload.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import re
import sys
from collections.abc import Mapping

ENV = "LLM_JAX_MALLOC"
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                "/usr/lib", "/usr/local/lib")
# mimalloc returns freed memory to the kernel after 10 ms by default: never, like tcmalloc.
MIMALLOC_ENV = {"MIMALLOC_PURGE_DELAY": "-1"}
_MAPPED = re.compile(r"lib(tc|mi|je)malloc[\w.\-]*\.so")


def find_tcmalloc(dirs: tuple[str, ...] = LIBRARY_DIRS) -> str | None:
    """The system's tcmalloc (`apt install libtcmalloc-minimal4`), or None."""
    for d in dirs:
        for name in TCMALLOC_NAMES:
            path = os.path.join(d, name)
            if os.path.isfile(path):
                return path
    return None


def find_mimalloc(distribution: str = "cmeel-mimalloc") -> str | None:
    """libmimalloc.so inside the installed `cmeel-mimalloc` wheel (cmeel.prefix/lib), or None."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == "libmimalloc.so":
            path = str(f.locate())
            if os.path.isfile(path):
                return path
    return None


def _library(choice: str) -> str | None:
    """The library `choice` names (None for `system`, or `auto` with nothing installed)."""
    if choice == "system":
        return None
    if choice == "auto":
        return find_tcmalloc() or find_mimalloc()
    if choice in ("tcmalloc", "mimalloc"):
        path = find_tcmalloc() if choice == "tcmalloc" else find_mimalloc()
        if path is None:
            how = ("apt install libtcmalloc-minimal4" if choice == "tcmalloc"
                   else "pip install cmeel-mimalloc")
            raise ValueError(f"{ENV}={choice!r} but no {choice} is installed: {how}, or set "
                             f"{ENV}=auto")
        return path
    if not os.path.isfile(choice):
        raise ValueError(f"{ENV}={choice!r} is not a file: expected 'auto', 'tcmalloc', "
                         "'mimalloc', 'system' or the path of a malloc library such as "
                         "libtcmalloc_minimal.so.4")
    return choice


def preload_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """The environment to re-execute with, or None when the current one is already right. The
    re-executed child has the library in LD_PRELOAD and so gets None: no loop."""
    if not sys.platform.startswith("linux"):
        return None
    choice = env.get(ENV, "auto")
    preloaded = env.get("LD_PRELOAD", "")
    if choice == "auto" and _MAPPED.search(preloaded):  # the user already chose one
        return None
    path = _library(choice)
    if path is None or path in preloaded.split(":"):
        return None
    out = {**env, "LD_PRELOAD": ":".join(p for p in (path, preloaded) if p)}
    if "mimalloc" in os.path.basename(path):
        out = {**MIMALLOC_ENV, **out}  # the user's own MIMALLOC_* settings win
    return out


def use_preferred_malloc() -> None:
    """Re-executes this process with the same interpreter and arguments and the preferred malloc
    preloaded; returns at once when that is already so or is switched off, and tunes glibc
    in-process when no library is installed. Call it first thing in a command line's `__main__`
    block, before any computation (never at import: that is the host program's choice)."""
    env = preload_env(os.environ)
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)
    tune_glibc()


def mapped_malloc(maps_path: str = "/proc/self/maps") -> str | None:
    """The malloc library mapped into this process (tcmalloc, mimalloc, jemalloc or one named in
    LD_PRELOAD), or None."""
    try:
        with open(maps_path) as f:
            maps = f.read()
    except OSError:
        return None
    preloaded = {os.path.realpath(p) for p in os.environ.get("LD_PRELOAD", "").split(":") if p}
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if _MAPPED.search(os.path.basename(path)) or path in preloaded:
            return path
    return None


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_glibc_tuned = False


def tune_glibc() -> bool:
    """Makes glibc keep freed memory in this process: no mmap for large blocks, no trimming, and
    one arena for threads started from now on (a thread's own arena would still mmap them), so
    call it before XLA starts its threads.
    Resident memory then stays at its peak. Returns whether glibc is now tuned; does nothing
    under another malloc, off Linux/glibc, or with LLM_JAX_MALLOC=system."""
    global _glibc_tuned
    if _glibc_tuned:
        return True
    if (not sys.platform.startswith("linux") or os.environ.get(ENV, "auto") == "system"
            or mapped_malloc() is not None):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    _glibc_tuned = all(mallopt(p, v) == 1 for p, v in (
        (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_ARENA_MAX, 1)))
    return _glibc_tuned


def active_malloc() -> str:
    """What the train log and the benchmarks record: the malloc library mapped into this
    process, else "glibc (tuned)" or "system"."""
    lib = mapped_malloc()
    if lib is None and not os.path.exists("/proc/self/maps"):  # no /proc: trust LD_PRELOAD
        lib = next((p for p in os.environ.get("LD_PRELOAD", "").split(":")
                    if _MAPPED.search(p)), None)
    if lib is not None:
        return lib
    return "glibc (tuned)" if _glibc_tuned else "system"
