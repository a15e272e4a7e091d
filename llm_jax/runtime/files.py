"""Writing a directory so that no reader ever sees half of it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomically(dst: str | Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` into a temporary sibling of `dst`, then renamed into place: a crash leaves
    `dst` as it was (the temporary is removed on an error)."""
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
