"""Run the command-line tools under tcmalloc when the machine has it.

XLA:CPU allocates each step's temporaries afresh and frees them at its end. glibc's malloc hands
blocks this large straight back to the kernel (mmap/munmap), so every step faults in and zeroes
its working set again. For configs/tiny.py at 8 x 256 that is about 160,000 page faults and
0.45 s of system time per 1.1 s step. tcmalloc keeps freed pages, and the step takes about 25 %
less time (docs/benchmarks.md). PyTorch's CPU performance guide recommends the same
(tcmalloc or jemalloc).

`LLM_JAX_MALLOC` chooses: `auto` (the default: tcmalloc when found, else the system malloc),
`system`, or a path to a malloc library to preload. On Debian/Ubuntu:
`apt install libtcmalloc-minimal4`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

ENV = "LLM_JAX_MALLOC"
LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                "/usr/lib", "/usr/local/lib")


def find_tcmalloc(dirs: tuple[str, ...] = LIBRARY_DIRS) -> str | None:
    for d in dirs:
        for name in LIBRARIES:
            path = os.path.join(d, name)
            if os.path.isfile(path):
                return path
    return None


def preload_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """The environment to re-execute with, or None when the current one is already right."""
    choice = env.get(ENV, "auto")
    preloaded = env.get("LD_PRELOAD", "")
    if choice == "system":
        return None
    if choice == "auto":
        if "malloc" in preloaded:  # tcmalloc, jemalloc or mimalloc already chosen by the user
            return None
        path = find_tcmalloc()
        if path is None:
            return None
    else:
        path = choice
        if not os.path.isfile(path):
            raise ValueError(f"{ENV}={choice!r} is not a file: expected 'auto', 'system' or the "
                             "path of a malloc library such as libtcmalloc_minimal.so.4")
        if path in preloaded.split(":"):
            return None
    return {**env, "LD_PRELOAD": ":".join(p for p in (path, preloaded) if p)}


def use_preferred_malloc() -> None:
    """Re-executes this process with the same interpreter and arguments, and tcmalloc preloaded;
    returns at once when that is already so, is switched off, or no tcmalloc is installed.
    Call it first thing in a `__main__` block, before any computation."""
    env = preload_env(os.environ)
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)


def active_malloc() -> str:
    """What the benchmarks record: the preloaded malloc library, else "system"."""
    libs = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if "malloc" in p]
    return libs[0] if libs else "system"
