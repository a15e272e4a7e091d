"""The train iterator's checkpointed state, tagged with what the pipeline was built from.

Grain's state of a packed pipeline is positions (a shuffle index per epoch, a packing remainder)
that only mean something for the same documents, tokenizer, seq_len, batch size, seed, worker
count and process share; restored into another pipeline it would silently continue elsewhere.
So the state is saved as {"identity": ..., "pipeline": Grain's state}, and a mismatch is refused
naming the fields. The rule for the process count in particular: a run resumes with the process
count it was saved with (each process saves its own state file, process_<i>-of-<P>.json, for
its own share of the data), or not at all.

`check_saved_state` runs before Orbax restores: the trainer treats a step without a checksum
manifest that fails to restore with a ValueError as corrupt and moves it aside, which is wrong
for a config change.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any

import grain

_STATE_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")


def describe_mismatch(saved: dict[str, Any] | None, current: dict[str, Any]) -> str | None:
    """What differs between a saved identity and the current one (None: they match)."""
    if not isinstance(saved, dict):
        return ("it was saved by an older data pipeline (unpacked token chunks), whose state "
                "this one cannot continue")
    diff = [f"{k}: saved {saved.get(k)!r}, now {current.get(k)!r}"
            for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    return "; ".join(diff) or None


def tuples_from_json(state: Any) -> Any:
    """`state` with each packing remainder slice a tuple again, as Grain made it.

    JSON turns tuples into lists, and Grain 0.2.18's ConcatThenSplit compares a slice with its
    "no remainder" sentinel, the tuple (-1, -1): a list never equals it, so a restored state
    without a remainder would take the next document for one and drop it.
    """
    if isinstance(state, dict):
        return {k: ({f: tuple(sl) for f, sl in v.items()} if k == "remainder_slices"
                    else tuples_from_json(v)) for k, v in state.items()}
    if isinstance(state, list):
        return [tuples_from_json(v) for v in state]
    return state


def _refuse(problem: str, where: str) -> None:
    raise ValueError(
        f"the data iterator state in {where} does not fit this run's data pipeline ({problem}). "
        "Resume with the data settings and process count it was saved with, or start a new "
        "--workdir (llm_jax.load_pretrained can take its params).")


class TaggedIterator(grain.DatasetIterator):
    """Passes batches through; its state carries `identity` and is checked on restore."""

    def __init__(self, parent: grain.DatasetIterator, identity: dict[str, Any]):
        super().__init__(parent)
        self.identity = dict(identity)

    def __next__(self) -> Any:
        return next(self._parent)

    def start_prefetch(self) -> None:
        """Starts the pipeline's read-ahead thread now rather than at the first batch (so the
        first shuffle window can fill while the trainer compiles); a no-op without one."""
        start = getattr(self._parent, "start_prefetch", None)
        if start is not None:
            start()

    def get_state(self) -> dict[str, Any]:
        return {"identity": self.identity, "pipeline": self._parent.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        if problem := describe_mismatch(state.get("identity"), self.identity):
            _refuse(problem, "the restored state")
        self._parent.set_state(tuples_from_json(state["pipeline"]))


def check_saved_state(item_dir: str, identity: dict[str, Any]) -> None:
    """Raises ValueError naming what differs between the Grain state saved in `item_dir` (a
    checkpoint's `data` folder) and `identity`; no `data` folder: nothing to check."""
    if not os.path.isdir(item_dir):
        return
    saved = {}
    for path in glob.glob(os.path.join(item_dir, "process_*-of-*.json")):
        if m := _STATE_FILE.fullmatch(os.path.basename(path)):
            saved[int(m.group(1)), int(m.group(2))] = path
    index, count = identity["process_index"], identity["process_count"]
    counts = sorted({c for _, c in saved})
    if counts and count not in counts:
        _refuse(f"process_count: saved {counts[0] if len(counts) == 1 else counts}, "
                f"now {count}", item_dir)
    if (index, count) not in saved:
        _refuse(f"no state file process_{index}-of-{count}.json", item_dir)
    with open(saved[index, count]) as f:
        state = json.load(f)
    if problem := describe_mismatch(state.get("identity"), identity):
        _refuse(problem, saved[index, count])
