"""The trainer's step under each malloc: one fresh process per timed call, alternating.

    python -m llm_jax.bench malloc [--repeats 5] [--steps 5] [--mallocs system,glibc,mimalloc]

A malloc is chosen at process start, so each contender is a child process (`system`: glibc as
it is; `glibc`: glibc tuned in-process by `tune_glibc`; `mimalloc`, `tcmalloc`: preloaded,
the latter only where installed). Each child compiles the train step of configs/tiny.py's model
(under the default ExecutionConfig) at 8 x 256 float32, runs 2 warm-up steps, then `steps`
timed ones, and reports its median ms/step and the minor page faults and system CPU seconds per
step (getrusage). Children run A B C A B C ...
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

from llm_jax.bench.common import machine, median, table
from llm_jax.runtime import malloc

MALLOCS = ("system", "glibc", "mimalloc", "tcmalloc")


def child_env(name: str, env: dict[str, str] | None = None) -> dict[str, str] | None:
    """The environment of a child measuring `name`, or None when it is not installed here."""
    env = {k: v for k, v in (env or os.environ).items() if k not in ("LD_PRELOAD", malloc.ENV)}
    if name == "system":
        return {**env, malloc.ENV: "system"}
    if name == "glibc":
        return env  # no preload: the child tunes glibc itself (tune_glibc)
    path = malloc.find_tcmalloc() if name == "tcmalloc" else malloc.find_mimalloc()
    if path is None:
        return None
    return malloc.preload_env({**env, malloc.ENV: path})


def measure_child(steps: int, batch: int, seq_len: int) -> dict[str, Any]:
    """In the child: the step's median ms and page faults / system seconds per step."""
    import jax  # noqa: F401  (after the environment is final)

    from llm_jax.bench.train import JaxTrainer, quick_model_config, random_batch, tiny_run_config
    from llm_jax.training.run_config import model_config

    run_cfg = tiny_run_config()
    cfg = (quick_model_config() if seq_len < 64
           else model_config(run_cfg))
    tc = run_cfg.train.copy_and_resolve_references()
    tc.batch_size, tc.grad_accum_steps = batch, 1
    trainer = JaxTrainer(cfg, tc, random_batch(cfg.vocab_size, batch, seq_len))
    trainer(2)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        trainer(1)
        times.append(time.perf_counter() - t)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"malloc": malloc.active_malloc(), "step_s": median(times), "times_s": times,
            "minor_faults_per_step": (r1.ru_minflt - r0.ru_minflt) / steps,
            "sys_s_per_step": (r1.ru_stime - r0.ru_stime) / steps, "last_loss": trainer.loss}


def run(*, repeats: int = 3, steps: int = 5, quick: bool = False,
        mallocs: tuple[str, ...] = MALLOCS) -> dict[str, Any]:
    batch, seq_len = (2, 16) if quick else (8, 256)
    if quick:
        repeats, steps = 1, 1
    envs = {m: e for m in mallocs if (e := child_env(m)) is not None}
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in envs}
    cmd = [sys.executable, "-m", "llm_jax.bench.malloc", "--child", str(steps), str(batch),
           str(seq_len)]
    for _ in range(repeats):
        for name, env in envs.items():
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for name, rs in results.items():
        rows.append({"name": name, "malloc": rs[0]["malloc"],
                     "step_s": median([r["step_s"] for r in rs]),
                     "minor_faults_per_step": median([r["minor_faults_per_step"] for r in rs]),
                     "sys_s_per_step": median([r["sys_s_per_step"] for r in rs]),
                     "last_loss": rs[0]["last_loss"], "runs": rs})
    return {"benchmark": "malloc", "machine": machine(), "repeats": repeats, "steps": steps,
            "batch": batch, "seq_len": seq_len, "rows": rows}


def format_result(r: dict[str, Any]) -> str:
    base = next((x["step_s"] for x in r["rows"] if x["name"] == "system"), None)
    rows = [[x["name"], f"{x['step_s'] * 1e3:.0f}",
             f"{base / x['step_s']:.2f}x" if base else "-", f"{x['minor_faults_per_step']:.0f}",
             f"{x['sys_s_per_step']:.3f}", x["malloc"]] for x in r["rows"]]
    return (f"train step {r['batch']}x{r['seq_len']} float32, medians of {r['repeats']} "
            f"processes x {r['steps']} steps (alternating); load "
            f"{r['machine']['load_average']}\n"
            + table(["malloc", "ms/step", "speed-up vs system", "minor faults/step",
                     "system s/step", "library"], rows))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=5, help="timed steps per process")
    p.add_argument("--mallocs", type=lambda s: tuple(s.split(",")), default=MALLOCS,
                   help=f"which of {','.join(MALLOCS)}")


def from_args(a: argparse.Namespace) -> dict[str, Any]:
    unknown = set(a.mallocs) - set(MALLOCS)
    if unknown:
        raise SystemExit(f"--mallocs: unknown {sorted(unknown)}: expected some of {MALLOCS}")
    return run(repeats=a.repeats, steps=a.steps, quick=a.quick, mallocs=a.mallocs)


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    malloc.tune_glibc()  # a no-op under `system` or a preloaded library

    print(json.dumps(measure_child(*(int(x) for x in sys.argv[2:5]))))
