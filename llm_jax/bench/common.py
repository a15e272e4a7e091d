"""What every benchmark shares: A/B timing, the machine's description, tables, JSON output."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from llm_jax.runtime.malloc import active_malloc
from llm_jax.runtime.peak import cpu_model

DEFAULT_DIR = Path("runs/bench")


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages (what `uptime` prints): how busy the machine was."""
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, Any]:
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "jax": jax.__version__,
            "devices": [str(d) for d in jax.devices()],
            "load_average": load_average(), "malloc": active_malloc()}


def torch_info() -> dict[str, Any]:
    """torch's version and thread count (what its contenders in spawned processes get too)."""
    import torch

    return {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call takes; `fn` must block until its work is done. An `Isolated` contender
    is timed inside its own process, so the pipe's round trip (a millisecond or more on a busy
    machine, as long as a small model's whole prefill) is not counted."""
    if isinstance(fn, Isolated):
        return fn.timed_call()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def alternate(fns: Mapping[str, Callable[[], Any]], *, repeats: int, warmup: int = 1,
              gap_s: float = 0.05) -> dict[str, list[float]]:
    """Times each fn `repeats` times, interleaved A B A B ... after `warmup` untimed calls each,
    so that the machine's drifting load falls on every contender alike. `gap_s` of sleep between
    calls lets one runtime's spinning worker threads go idle before the other starts."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            time.sleep(gap_s)
            times[name].append(timed(fn))
    return times


def _serve(factory: Callable[[], Callable[[], Any]], conn: Any) -> None:
    """The child's loop: build the contender, then run it once per request."""
    fn = factory()
    conn.send("ready")
    while conn.recv() == "call":
        t0 = time.perf_counter()
        fn()
        conn.send((getattr(fn, "loss", None), time.perf_counter() - t0))
    conn.close()


class Isolated:
    """A contender that runs in its own (spawned) process, called from the parent like a function.

    Two runtimes in one process slow each other down: torch's and XLA's thread pools, their
    allocators and caches share it (measured: the llm_jax train step took 680 ms alternating
    with transformers in one process, 560 ms alone). In separate processes, the idle one waits
    on a pipe while the other runs. `factory` must be picklable (a module-level function or a
    functools.partial of one); it builds the callable in the child. `loss` mirrors the child's.
    """

    def __init__(self, factory: Callable[[], Callable[[], Any]]):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(factory, child), daemon=True)
        self._proc.start()
        child.close()
        self.loss: Any = None
        self.last_s = float("nan")
        try:
            ready = self._conn.recv()
        except EOFError:
            ready = None
        if ready != "ready":
            self._proc.join(5)
            raise RuntimeError(f"benchmark worker for {factory!r} failed to start "
                               f"(exit code {self._proc.exitcode}); its error is above")

    def __call__(self) -> None:
        try:
            self._conn.send("call")
            self.loss, self.last_s = self._conn.recv()
        except (EOFError, BrokenPipeError) as e:
            self._proc.join(5)
            raise RuntimeError(f"benchmark worker died during a call (exit code "
                               f"{self._proc.exitcode}); its error is above") from e

    def timed_call(self) -> float:
        """Calls the contender; returns the seconds the child measured around its call."""
        self()
        return self.last_s

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send("stop")
            self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()

    def __enter__(self) -> Isolated:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class InProcess:
    """A contender built and called in this process: `Isolated`'s interface (`loss`, `close`,
    a context manager) without the process. What --quick runs, where the sizes are too small
    for the runtimes to disturb each other and a process launch costs more than the whole
    measurement; `Isolated` itself has its own test."""

    def __init__(self, factory: Callable[[], Callable[[], Any]]):
        self._fn = factory()

    def __call__(self) -> None:
        self._fn()

    @property
    def loss(self) -> Any:
        return getattr(self._fn, "loss", None)

    def close(self) -> None:
        pass

    def __enter__(self) -> InProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def contender(factory: Callable[[], Callable[[], Any]], *, isolated: bool) -> Isolated | InProcess:
    """`Isolated(factory)`, or `InProcess(factory)` where `isolated` is False (--quick)."""
    return Isolated(factory) if isolated else InProcess(factory)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; floats with 4 significant digits."""
    def cell(x: Any) -> str:
        return f"{x:.4g}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(result: Mapping[str, Any], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=2, default=float))
    return p
