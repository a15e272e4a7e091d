"""Measuring memory in a child process: the kernel's own counters (current and peak resident set,
the peak reset between phases) and a watchdog that ends the child at an RSS cap, so a benchmark
of a model near the machine's memory reports how far it got instead of swapping or being killed
by the kernel with nothing said. Linux only: both read /proc/self.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GIB = 2**30


def rss_bytes() -> dict[str, int]:
    """This process's resident set now (VmRSS) and its peak since the last `reset_peak`
    (VmHWM), from /proc/self/status."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[{"VmRSS": "rss", "VmHWM": "peak"}[key]] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> None:
    """Sets VmHWM back to the current RSS (Linux: 5 > /proc/self/clear_refs), so the next
    `rss_bytes()["peak"]` is the peak of one phase."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _watchdog(cap: int, report: Callable[[dict[str, Any]], None]) -> None:
    """Ends this process (exit 86) when its RSS passes `cap` bytes; `report` says how far."""
    t0 = time.perf_counter()

    def watch() -> None:
        while True:
            rss = rss_bytes()["rss"]
            if rss > cap:
                report({"killed": f"RSS {rss / GIB:.2f} GiB passed the cap of {cap / GIB:.1f} "
                                  f"GiB after {time.perf_counter() - t0:.0f} s",
                        "peak_rss_bytes": rss})
                os._exit(86)
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()


def _child(fn: Callable[..., dict[str, Any]], kwargs: dict[str, Any], cap: int,
           conn: Any) -> None:
    phases: dict[str, Any] = {}
    _watchdog(cap, lambda r: conn.send({**phases, **r}))
    try:
        conn.send(fn(phases=phases, **kwargs))
    except Exception as e:  # noqa: BLE001 - reported to the parent as what happened
        conn.send({**phases, "error": f"{type(e).__name__}: {str(e)[:2000]}"})


def run_capped(fn: Callable[..., dict[str, Any]], cap_bytes: int, **kwargs: Any) -> dict[str, Any]:
    """`fn(phases=..., **kwargs)` in a spawned child whose RSS may not pass `cap_bytes`; its
    result, or the phases it finished plus "killed" / "error" and the exit code."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, kwargs, cap_bytes, child))
    proc.start()
    child.close()
    try:
        result = parent.recv()
    except EOFError:
        result = {"error": "the child died without a report"}
    proc.join()
    result["exit_code"] = proc.exitcode
    return result


def process_peak_rss() -> int:
    """This process's peak resident set over its whole life (getrusage), in bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
