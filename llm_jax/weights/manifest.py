"""The sha256 manifest of a checkpoint step: written (in a background thread) once a save has
finished, checked before the step is restored. A mismatch is evidence of corruption and moves
the step aside, as a read error does for a step without a manifest (restore_check.py,
docs/reliability.md)."""

from __future__ import annotations

import hashlib
import json
import os

from llm_jax.weights.restore_check import RestoreError

MANIFEST = "llm_jax_sha256.json"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _files(step_dir: str) -> list[str]:
    out = []
    for root, _, names in os.walk(step_dir):
        out += [os.path.relpath(os.path.join(root, n), step_dir) for n in names]
    return sorted(f for f in out if f != MANIFEST and not f.endswith(".tmp"))


def write_manifest(step_dir: str) -> None:
    """Writes the step's checksum manifest (atomically: a reader never sees half of it)."""
    try:
        files = {f: [os.path.getsize(os.path.join(step_dir, f)), _sha256(os.path.join(step_dir, f))]
                 for f in _files(step_dir)}
        tmp = os.path.join(step_dir, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"format": 1, "algorithm": "sha256", "files": files}, f)
        os.replace(tmp, os.path.join(step_dir, MANIFEST))
    except FileNotFoundError:  # garbage-collected (max_to_keep) while being hashed: no step
        return


def _manifest_files(path: str) -> dict[str, tuple[int, str]] | str:
    """{file: (size, sha256)} from a manifest, or what is wrong with it."""
    try:
        with open(path, "rb") as f:
            files = json.loads(f.read())["files"]
        out = {rel: (size, digest) for rel, (size, digest) in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        return f"its manifest {MANIFEST} is unreadable ({type(e).__name__}: {e})"
    if not all(isinstance(r, str) and type(s) is int and isinstance(d, str)
               for r, (s, d) in out.items()):
        return f"its manifest {MANIFEST} is unreadable (entries are not [size, sha256])"
    return out


def verify_manifest(step_dir: str) -> str | None:
    """What is wrong with the step's files by its manifest, or None if they match.
    Raises FileNotFoundError if the step has no manifest."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    files = _manifest_files(path)
    if isinstance(files, str):
        return files
    for rel, (size, digest) in files.items():
        path = os.path.join(step_dir, rel)
        if not os.path.isfile(path):
            return f"file {rel} is missing"
        actual = os.path.getsize(path)
        if actual != size:
            return f"file {rel} has {actual} bytes, {size} when saved (truncated or overwritten)"
        try:
            if _sha256(path) != digest:
                return f"file {rel} does not match its sha256 from the save (corrupted)"
        except PermissionError as e:  # not corruption: moving the step would not help
            raise RestoreError(f"{path} cannot be read to check its sha256: {e}; nothing was "
                               "moved: fix its permissions and rerun") from e
        except OSError as e:  # an I/O error reading it back is evidence enough
            return f"file {rel} does not read back ({e})"
    return None
