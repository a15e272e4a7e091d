"""Where training metrics go: WORKDIR/metrics.jsonl (one JSON object per logged step) and
TensorBoard event files. Only process 0 writes."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import numpy as np


def _jsonable(v: Any) -> Any:
    if isinstance(v, (np.ndarray, jax.Array)):
        v = np.asarray(v)
        return v.item() if v.ndim == 0 else v.tolist()
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    return v


class MetricsWriter:
    """Appends to metrics.jsonl (kept across resumes) and writes TensorBoard scalars."""

    def __init__(self, workdir: str, *, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        if enabled:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _jsonable(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)):
                self._tb.add_scalar(k, v, step)
        self._tb.flush()

    def truncate_after(self, step: int) -> None:
        """Drops records past `step`: a resumed run redoes those steps and logs them again."""
        if not self.enabled or not os.path.exists(self.path):
            return
        kept = [line for line in read_metrics_lines(self.path) if json.loads(line)["step"] <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)

    def close(self) -> None:
        """Stops TensorBoard's writer thread; safe to call again. A run that fails must call it
        too: else tensorboardX's exit hook starts a thread at interpreter shutdown and fails."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics_lines(path: str) -> list[str]:
    """The file's records; a line a kill cut short (not valid JSON) is dropped with a warning."""
    lines = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except ValueError:
                logging.getLogger(__name__).warning("%s:%d is not a JSON record (a write cut "
                                                    "short?); dropping it", path, n)
                continue
            lines.append(line if line.endswith("\n") else line + "\n")
    return lines


def read_metrics(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in read_metrics_lines(path)]
