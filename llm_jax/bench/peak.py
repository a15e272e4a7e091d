"""The machine's measured matmul FLOP/s: the denominator of every MFU figure.

    python -m llm_jax.bench peak [--repeats 9] [--n 2048]

float32, and bfloat16 inputs with float32 accumulation, via `llm_jax.peak.measure_peak_flops`
(what the trainer calls): XLA's dot, NumPy's BLAS for float32, each the median of `repeats`
n x n x n matmuls; the peak is the larger.
"""

from __future__ import annotations

import argparse
from typing import Any

from llm_jax.bench.common import machine, table
from llm_jax.runtime.peak import measure_peak_flops

DTYPES = ("float32", "bfloat16")


def run(*, repeats: int = 9, quick: bool = False, n: int = 2048) -> dict[str, Any]:
    if quick:
        n, repeats = 256, 2
    peaks = {d: measure_peak_flops(d, n=n, repeats=repeats) for d in DTYPES}
    return {"benchmark": "peak", "machine": machine(), "n": n, "repeats": repeats,
            "flops": peaks}


def format_result(r: dict[str, Any]) -> str:
    def g(x: float | None) -> str:
        return "-" if x is None else f"{x / 1e9:.1f}"

    rows = [[d, g(f["xla"]), g(f.get("blas")), g(f["peak"])] for d, f in r["flops"].items()]
    return (f"matmul {r['n']}^3, median of {r['repeats']}; load {r['machine']['load_average']}\n"
            + table(["dtype", "XLA GFLOP/s", "NumPy BLAS GFLOP/s", "peak (MFU denominator)"],
                    rows))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=2048, help="matrix size")


def from_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(repeats=a.repeats, quick=a.quick, n=a.n)
