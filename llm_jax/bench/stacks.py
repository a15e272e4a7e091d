"""The same train step and decode under two Python / JAX stacks (two venvs), run by turns.

    python -m llm_jax.bench stacks --pythons .venv/bin/python,.venv312/bin/python
        [--repeats 5] [--shape 8x256] [--batch 8] [--new_tokens 128]

Each interpreter must have llm_jax installed (`pip install -e .` in its venv). One round runs
`bench train` (llm_jax only, float32) and then `bench decode` (llm_jax only) once under each
interpreter in turn, A B A B, each in a fresh process with one timed call; the machine's
drifting load then falls on both stacks alike. Medians over rounds are reported, with the jax
version each stack ran. The child processes write their own JSON; this one reads it back.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from llm_jax.bench.common import machine, median, table


def _child(python: str, args: list[str], out: Path) -> dict[str, Any]:
    cmd = [python, "-m", "llm_jax.bench", *args, "--repeats", "1", "--json_out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def _versions(result: dict[str, Any]) -> str:
    """The Python and jax versions a child ran, from the machine description in its JSON."""
    m = result["machine"]
    return f"Python {m['python']}, jax {m['jax']}"


def run(*, pythons: list[str], repeats: int = 3, quick: bool = False, shape: str = "8x256",
        batch: int = 8, new_tokens: int = 128) -> dict[str, Any]:
    if len(pythons) < 1:
        raise ValueError("--pythons: expected one or more interpreters, comma-separated")
    train_args = ["train", "--no_hf", "--dtypes", "float32", "--steps", "1", "--shapes", shape]
    decode_args = ["decode", "--no_hf", "--batches", str(batch), "--new_tokens", str(new_tokens)]
    if quick:
        repeats, train_args, decode_args = 1, train_args + ["--quick"], decode_args + ["--quick"]
    got: dict[str, dict[str, list[float]]] = {p: {"step_s_runs": [], "decode_tok_s_runs": []}
                                              for p in pythons}
    versions: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as d:
        for i in range(repeats):
            for k, p in enumerate(pythons):
                t = _child(p, train_args, Path(d) / f"train_{k}_{i}.json")
                got[p]["step_s_runs"].append(t["rows"][0]["llm_jax"]["step_s"])
                versions[p] = _versions(t)
                g = _child(p, decode_args, Path(d) / f"decode_{k}_{i}.json")
                decode = g["decode"][0]["llm_jax"]["decode_tokens_per_s"]
                got[p]["decode_tok_s_runs"].append(decode)
    stacks = [{"python": p, "versions": versions[p], "step_s": median(got[p]["step_s_runs"]),
               "decode_tokens_per_s": median(got[p]["decode_tok_s_runs"]), **got[p]}
              for p in pythons]
    return {"benchmark": "stacks", "machine": machine(), "repeats": repeats,
            "train_args": train_args, "decode_args": decode_args, "stacks": stacks}


def format_result(r: dict[str, Any]) -> str:
    base = r["stacks"][0]
    rows = [[s["versions"], f"{s['step_s'] * 1e3:.1f}",
             f"{base['step_s'] / s['step_s']:.2f}x",
             f"{s['decode_tokens_per_s']:.0f}",
             f"{s['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x"]
            for s in r["stacks"]]
    return (f"stacks by turns, medians of {r['repeats']} rounds; load "
            f"{r['machine']['load_average']}\n"
            f"train: bench {' '.join(r['train_args'])}\n"
            f"decode: bench {' '.join(r['decode_args'])}\n"
            + table(["stack", "train ms/step", "train speed vs first", "decode tok/s",
                     "decode speed vs first"], rows))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pythons", type=lambda s: s.split(","), default=[sys.executable],
                   help="interpreters (each venv's bin/python), comma-separated")
    p.add_argument("--shape", default="8x256", help="train BATCHxSEQ")
    p.add_argument("--batch", type=int, default=8, help="decode batch")
    p.add_argument("--new_tokens", type=int, default=128, help="decode tokens per prompt")


def from_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(pythons=a.pythons, repeats=a.repeats, quick=a.quick, shape=a.shape,
               batch=a.batch, new_tokens=a.new_tokens)
