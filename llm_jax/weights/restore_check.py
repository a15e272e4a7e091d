"""Why a checkpoint step did not restore: corruption, or something that moving it cannot fix.

Only evidence of corruption justifies moving a step aside (llm_jax.weights.checkpointing): a file
that does not match the sha256 manifest written at save time, or, for a step without a manifest, a
read error (a truncated, undecodable or missing file). Everything else, a tree that differs from
this run's (a code change that adds optimizer state, e.g. an EMA), another shape or dtype, memory,
a bug, stops the run with `RestoreError` and moves nothing: the step is good, the run is not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

# Verdicts, ordered so that the largest one over all processes is the one every process acts on.
RESTORED, CORRUPT, STOP = 0, 1, 2


class RestoreError(RuntimeError):
    """A checkpoint step that is not known to be corrupt does not restore into this run."""


def tree_differences(step_dir: Path, item: str, target: Any) -> list[str]:
    """How the arrays saved as `item` differ from `target` (a pytree of ShapeDtypeStructs):
    paths only on disk or only here (a count and the first few), then each shape or dtype that
    differs. Reads only metadata; raises what Orbax raises when that does not read."""
    saved = ocp.StandardCheckpointHandler().metadata(step_dir / item)
    saved = ocp.tree.to_flat_dict(getattr(saved, "tree", saved))
    here = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(target, keep_empty_nodes=True))

    def name(path: tuple) -> str:
        return ".".join([item, *map(str, path)])

    out = []
    for only, where in ((set(saved) - set(here), "only in the checkpoint"),
                        (set(here) - set(saved), "only in this run")):
        if only:
            first = ", ".join(name(p) for p in sorted(only)[:3])
            out.append(f"{len(only)} array(s) {where} (e.g. {first})")
    for p in sorted(set(saved) & set(here)):
        for attr in ("shape", "dtype"):
            a, b = getattr(saved[p], attr, None), getattr(here[p], attr, None)
            if a is not None and b is not None and str(a) != str(b):
                out.append(f"{name(p)} has {attr} {a} saved, {b} here")
    return out


def incompatibility(step: int, directory: str, items: dict[str, Any]) -> RestoreError | None:
    """A RestoreError naming what differs if the step's `items` ({name: target tree}) do not
    fit this run's trees, else None."""
    step_dir = Path(directory) / str(step)
    diffs = [d for item, target in items.items() for d in tree_differences(step_dir, item, target)]
    if not diffs:
        return None
    shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
    return RestoreError(
        f"checkpoint step {step} in {directory} does not fit this run's train state: {shown}. "
        "The code or config that builds the params or the optimizer state changed since it was "
        "saved (e.g. an optimizer wrapper that adds state). The checkpoint is kept as it is and "
        "nothing was moved: resume with the code and config that wrote it, or train the changed "
        "code in a new --workdir")


def is_read_failure(e: BaseException) -> bool:
    """Whether `e` looks like a file that does not read (truncated, undecodable, missing), as
    opposed to memory, permissions or a bug. TensorStore's read errors reach us as ValueError
    (DATA_LOSS, NOT_FOUND), JSONDecodeError, KeyError (a missing item) or a bare Exception
    ("Encountered error while reading array index")."""
    text = str(e)
    if isinstance(e, (MemoryError, PermissionError)) or "RESOURCE_EXHAUSTED" in text \
            or "out of memory" in text.lower():
        return False
    return isinstance(e, (ValueError, OSError, KeyError, EOFError)) or type(e) is Exception


def judge(e: BaseException | None, *, verified: bool) -> int:
    """RESTORED, CORRUPT or STOP for a restore that raised `e` (None: it worked). A step whose
    files matched their manifest is never corrupt: its failure is this run's problem."""
    if e is None:
        return RESTORED
    if isinstance(e, RestoreError) or verified or not is_read_failure(e):
        return STOP
    return CORRUPT


def stop_error(step: int, directory: str, e: BaseException | None, *, verified: bool
               ) -> RestoreError:
    """The RestoreError that stops a run on a step which is not known to be corrupt."""
    if isinstance(e, RestoreError):
        return e
    if e is None:
        cause = "restoring it failed on another process (see that process's log)"
    else:
        cause = f"restoring it failed with {type(e).__name__}: {str(e)[:1000]}"
    why = ("its files match the sha256 manifest written when it was saved, so they are intact"
           if verified else "it has no checksum manifest, and this is no read error")
    return RestoreError(
        f"checkpoint step {step} in {directory}: {cause}. It is not treated as corrupt: {why}. "
        f"Nothing was moved or deleted. Fix the cause (memory, permissions, a code change) and "
        f"rerun; if its files are damaged after all, move {directory}/{step} into the "
        f"workdir's corrupt_checkpoints/ folder by hand and rerun to resume from the step before")
