"""Where a jitted call spends its time: XLA op times summed from a `jax.profiler` trace.

    from llm_jax.bench.profile import op_times
    top = op_times(lambda: step(state, batch), calls=3)   # [(op name, seconds per call, share)]

The trace's Chrome-format JSON (`*.trace.json.gz`) holds one complete event ("ph": "X") per
executed HLO op on the XLA:CPU threads; `op_times` sums durations by op name, so `fusion.12`
and `fusion.40` stay apart but `dot.3` in each layer of a scan adds up; `grouped` then drops
the trailing `.N` instance number to sum by op kind.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import jax


def _events(trace_dir: str) -> list[dict[str, Any]]:
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    events = []
    for f in files:
        with gzip.open(f) as fh:
            events += json.load(fh).get("traceEvents", [])
    return events


def op_times(fn: Callable[[], Any], *, calls: int = 3, top: int = 15,
             hlo_only: bool = True) -> list[tuple[str, float, float]]:
    """The `top` ops by total time over `calls` calls of `fn` (already compiled and warm):
    (name, seconds per call, share of the summed op time)."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(calls):
            jax.block_until_ready(fn())
        jax.profiler.stop_trace()
        events = _events(d)
    totals: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        args = e.get("args", {})
        if hlo_only and "hlo_op" not in args:
            continue
        totals[e["name"]] += e["dur"] * 1e-6
    grand = sum(totals.values()) or 1.0
    return [(name, t / calls, t / grand) for name, t in totals.most_common(top)]


def grouped(ops: list[tuple[str, float, float]]) -> dict[str, float]:
    """Seconds per call by op kind: the name without its `.N` suffix."""
    out: collections.Counter[str] = collections.Counter()
    for name, t, _ in ops:
        out[re.sub(r"\.\d+$", "", name)] += t
    return dict(out.most_common())


_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_SOURCE = re.compile(r'op_name="([^"]*)"')
_COMP = re.compile(r"^%?([\w.\-]+) .*\{\s*$")


def hlo_ops(hlo_text: str) -> dict[str, dict[str, Any]]:
    """Per top-level op of an optimized HLO module (`compiled.as_text()`): whether it multiplies
    matrices (a dot, or a fusion whose computation holds one) and its source op_name."""
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            current = m.group(1)
            comps[current] = []
        elif current is not None:
            comps[current].append(line)
    has_dot = {c: any(re.search(r"\b(dot|convolution)\(", ln) for ln in lines)
               for c, lines in comps.items()}
    out = {}
    for lines in comps.values():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            name = m.group(1)
            calls = (c.group(1) if (c := _CALLS.search(line)) else None)
            src = (c.group(1) if (c := _SOURCE.search(line)) else "")
            is_dot = bool(re.search(r"= [^=]*\b(dot|convolution)\(", line)) or has_dot.get(calls, False)
            out[name] = {"matmul": is_dot, "source": src or ""}
    return out


def breakdown(fn: Callable[[], Any], hlo_text: str, *, calls: int = 2,
              top: int = 12) -> dict[str, Any]:
    """Op time per call split into matmul and other ops, and the top ops with their source."""
    ops = op_times(fn, calls=calls, top=10_000)
    info = hlo_ops(hlo_text)
    total = sum(t for _, t, _ in ops)
    matmul = sum(t for n, t, _ in ops if info.get(n, {}).get("matmul"))
    return {"op_seconds_per_call": total, "matmul_share": matmul / total if total else 0.0,
            "top": [{"op": n, "seconds": t, "share": s, "matmul": info.get(n, {}).get("matmul"),
                     "source": info.get(n, {}).get("source", "")} for n, t, s in ops[:top]]}


def format_breakdown(b: dict[str, Any]) -> str:
    lines = [f"op time {b['op_seconds_per_call'] * 1e3:.1f} ms/call, matmuls "
             f"{b['matmul_share']:.0%}, the rest elementwise, copies, broadcasts, gathers"]
    for o in b["top"]:
        lines.append(f"  {o['share']:6.1%} {o['seconds'] * 1e3:8.1f} ms  {o['op']:<34} "
                     f"{'matmul' if o['matmul'] else 'other ':6}  {o['source'][-70:]}")
    return "\n".join(lines)
