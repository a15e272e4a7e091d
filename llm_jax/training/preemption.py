"""Graceful stop on SIGTERM / SIGINT and on TPU preemption: finish the step, save, exit.

The first signal only sets a flag; the train loop reads it (with `should_stop`) between steps,
saves a checkpoint of the finished step (data state included) and raises `Interrupted`. A second
signal exits at once with `os._exit`: whatever save is in flight is left as an Orbax temporary
directory, which the next run reports and removes, so the last complete checkpoint is untouched.

Multi-process runs: JAX's preemption service (on by default with `jax.distributed`) owns SIGTERM
there: a SIGTERM to any one process reaches all of them through the coordination service, which
picks the call of `reached_preemption_sync_point` at which every process stops, one past the
furthest any process had reached. This module then leaves SIGTERM to it and only catches SIGINT,
whose flag the processes agree on at log steps (`should_stop(..., agree=True)`), so no process
leaves a collective the others are in. The value given to the sync point counts this run's calls
(1, 2, ...) rather than being the training step: a notice that arrives before the first call (during
start-up) sets the sync point to 1, which a resumed run starting at step 800 would otherwise never
reach. Orbax's own calls, which would set the counter back, are switched off
(the manager of llm_jax.weights.checkpointing.Checkpointer).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import jax
from absl import logging

from llm_jax.parallel import distributed

_EXIT_NOW = "second signal %s: exiting now; the last complete checkpoint is kept\n"


class Interrupted(Exception):
    """Training stopped early on a signal or preemption, after saving a checkpoint."""

    def __init__(self, message: str, step: int, signum: int):
        super().__init__(message)
        self.step = step
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 143 for SIGTERM, 130 for SIGINT


def _jax_owns_sigterm() -> bool:
    from jax._src import distributed as jax_distributed

    state = jax_distributed.global_state
    return state.client is not None and state.preemption_sync_manager is not None


class StopRequest:
    """Context manager that catches stop signals for the train loop (main thread only)."""

    def __init__(self):
        self.signum: int | None = None
        self.preempted = False
        self._previous: dict[int, object] = {}
        self._calls = 0  # should_stop calls so far: the preemption sync counter

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread
        signums = [signal.SIGINT] + ([] if _jax_owns_sigterm() else [signal.SIGTERM])
        for s in signums:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            sys.stderr.write(_EXIT_NOW % name)
            sys.stderr.flush()
            os._exit(128 + signum)
        self.signum = signum
        logging.warning("%s received: finishing the current step, then saving a checkpoint "
                        "(send it again to exit at once)", name)

    def should_stop(self, step: int, *, agree: bool = False) -> bool:
        """Whether to stop before `step`. Call once per step, at the same steps on every
        process; `agree=True` (at log steps) lets multi-process runs act on a local signal."""
        from jax.experimental import multihost_utils

        self._calls += 1
        try:
            preempted = multihost_utils.reached_preemption_sync_point(self._calls)
        except RuntimeError:  # jax.distributed without the preemption service
            preempted = False
        if preempted:
            self.preempted = True
            self.signum = self.signum or signal.SIGTERM
            return True
        if jax.process_count() == 1:
            return self.signum is not None
        if not agree:
            return False
        flags = distributed.process_allgather_int(self.signum or 0)
        signum = max(flags)
        if signum:
            self.signum = signum
        return bool(signum)


def save_and_stop(stop: StopRequest, completed: int, last_saved: int,
                  save: Callable[[int], None], ckpt: Any, what: str = "step") -> None:
    """After a stop signal: `save(completed)` unless that step is saved already, wait for the
    checkpoint to be complete, then raise `Interrupted` naming the signal and the step."""
    if completed != last_saved:
        save(completed)
    ckpt.wait()
    name = "preemption" if stop.preempted else signal.Signals(stop.signum).name
    if ckpt.latest_step() is None:  # stopped before a first step completed
        raise Interrupted(f"stopped by {name} before the first {what} completed: nothing saved "
                          f"in {ckpt.directory}", completed, stop.signum)
    raise Interrupted(
        f"stopped by {name} after {what} {completed}: checkpoint step {completed} saved in "
        f"{ckpt.directory}; rerun the same command to resume", completed, stop.signum)
