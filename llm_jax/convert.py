"""Converts a checkpoint directory between formats (any readable one -> hf | openai | llm_jax).

    python -m llm_jax.convert --src PATH --dst PATH --to hf|openai|llm_jax [--dtype bfloat16]

The result is written to a temporary sibling of `--dst` and renamed into place only when complete,
so a failing run leaves `--dst` as it was. A non-empty `--dst` is refused unless `--overwrite`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from llm_jax.runtime.cli import ArgumentParser
from llm_jax.weights import readers, writers

WRITERS = {
    "hf": writers.save_hf,
    "openai": writers.save_openai,
    "llm_jax": writers.save_llm_jax,
}


def convert(src: str | Path, dst: str | Path, to: str, *, dtype: str | None = None,
            overwrite: bool = False) -> Path:
    """Loads `src` (format detected), writes it to `dst` in format `to`; returns `dst`."""
    if to not in WRITERS:
        raise ValueError(f"--to={to!r} is invalid: expected one of {sorted(WRITERS)}")
    check_destination(dst, overwrite)
    model = readers.load_pretrained(src, dtype=dtype)
    return write_atomically(dst, lambda tmp: WRITERS[to](model, tmp))


def check_destination(dst: str | Path, overwrite: bool, flag: str = "--dst") -> None:
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not overwrite:
        raise ValueError(f"{flag} {dst} exists and is not empty; pass --overwrite to replace it")


def write_atomically(dst: str | Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` into a temporary sibling of `dst`, then renamed into place."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        write(tmp)
        if dst.exists():  # move the old one aside first, so that no moment has neither
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.replace(dst, old / dst.name)
            os.replace(tmp, dst)
            shutil.rmtree(old)
        else:
            os.replace(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dst


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m llm_jax.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", required=True, help="checkpoint directory (llm_jax, HF or OpenAI)")
    parser.add_argument("--dst", required=True, help="output directory")
    parser.add_argument("--to", required=True, choices=sorted(WRITERS))
    parser.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default=None,
                        help="weight and compute dtype of the result (default: the source's)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --dst")
    args = parser.parse_args(argv)
    try:
        out = convert(args.src, args.dst, args.to, dtype=args.dtype, overwrite=args.overwrite)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.to} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
