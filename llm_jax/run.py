"""`python -m llm_jax.run SCRIPT [ARGS]` or `python -m llm_jax.run -m MODULE [ARGS]` (the
`llm_jax-run` command does the same): run a Python program under the preferred malloc.

A program that imports llm_jax as a library starts under glibc's malloc, which cannot be swapped
once the process runs; this re-executes it with tcmalloc or mimalloc preloaded first
(`llm_jax.runtime.malloc`; `LLM_JAX_MALLOC` chooses), then runs it as `python SCRIPT` would.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from llm_jax.runtime.malloc import use_preferred_malloc

USAGE = "usage: python -m llm_jax.run SCRIPT [ARGS...] | -m MODULE [ARGS...]"


def main(argv: Sequence[str] | None = None) -> None:
    use_preferred_malloc()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args == ["-m"]:
        raise SystemExit(USAGE)
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))  # as `python SCRIPT`
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
