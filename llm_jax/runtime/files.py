"""Writing a directory so that no reader ever sees half of it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomically(dst: str | Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` into a temporary sibling of `dst`, then renamed into place: a failure leaves
    `dst` as it was (the temporary is removed on an error). The one case that cannot, a rename
    back that fails too, keeps the previous `dst` in a hidden sibling and names it."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        write(tmp)
        if dst.exists():  # a directory cannot be replaced in one rename: the old one moves
            # aside, and is deleted only once the new one is in place (put back if it is not)
            aside = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.replace(dst, aside / dst.name)
            try:
                os.replace(tmp, dst)
            except BaseException as e:  # interrupts too: the old one goes back in every case
                try:
                    os.replace(aside / dst.name, dst)
                except OSError as back:  # kept where it is: never deleted
                    raise OSError(f"{dst} could not be replaced ({e}) nor put back ({back}): "
                                  f"the previous {dst.name} is in {aside / dst.name}") from e
                aside.rmdir()
                raise
            shutil.rmtree(aside)
        else:
            os.replace(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dst
