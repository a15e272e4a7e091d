"""The machine's measured matmul FLOP/s: the denominator of every MFU figure.

    python -m llm_jax.bench peak [--repeats 5] [--n 2048]

float32, and bfloat16 inputs with float32 accumulation, via `llm_jax.runtime.peak`: XLA's dot
and, on CPU, NumPy's BLAS for float32, each the best of `repeats` n x n x n matmuls; the peak is the
larger. Each run (except --quick) adds its measurement to the machine's peak cache, whose entry
keeps the largest: the figure the trainer and `bench train` divide by.
"""

from __future__ import annotations

import argparse
from typing import Any

from llm_jax.bench.common import machine, table
from llm_jax.runtime.peak import cache_key, measure_peak_flops, record_peak

DTYPES = ("float32", "bfloat16")


def run(*, repeats: int = 9, quick: bool = False, n: int = 2048) -> dict[str, Any]:
    if quick:
        n, repeats = 256, 2
    peaks = {d: measure_peak_flops(d, n=n, repeats=repeats) for d in DTYPES}
    cached = {}
    if not quick:  # a 256^3 matmul says little about the machine's peak
        for d, f in peaks.items():
            entry, where = record_peak(d, f, n, repeats)
            cached[d] = {"key": cache_key(d), "peak": entry["peak"],
                         "measurements": entry["measurements"], "file": where}
    return {"benchmark": "peak", "machine": machine(), "n": n, "repeats": repeats,
            "flops": peaks, "cached": cached}


def format_result(r: dict[str, Any]) -> str:
    def g(x: float | None) -> str:
        return "-" if x is None else f"{x / 1e9:.1f}"

    rows = [[d, g(f["xla"]), g(f.get("blas")), g(f["peak"]),
             g(r["cached"][d]["peak"]) if d in r["cached"] else "-"]
            for d, f in r["flops"].items()]
    out = (f"matmul {r['n']}^3, best of {r['repeats']}; load {r['machine']['load_average']}\n"
           + table(["dtype", "XLA GFLOP/s", "NumPy BLAS GFLOP/s", "peak now",
                    "cached peak (MFU denominator)"], rows))
    for d, c in r["cached"].items():
        out += f"\n{d}: max of {c['measurements']} measurement(s) in {c['file']}"
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=2048, help="matrix size")


def from_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(repeats=a.repeats, quick=a.quick, n=a.n)
