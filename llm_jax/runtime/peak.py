"""The machine's matmul FLOP/s, the denominator of MFU: measured once per machine, then cached.

Two measurements: XLA's own dot (what a jitted step can reach) and, for float32 on CPU, NumPy's
BLAS (what the machine can reach). MFU divides by the larger, so a slow XLA matmul shows up as
lost MFU instead of hiding in a low denominator. Each takes the best of its repeats: on a shared
machine the median moves with the load (2x between start-ups), the best much less.

`peak_flops` keeps one figure per machine in a JSON file (`$XDG_CACHE_HOME/llm_jax/
peak_flops.json`, else `~/.cache/...`; `LLM_JAX_PEAK_CACHE` names another file, or `off`),
keyed by the device (CPU model and usable threads, or the accelerator's kind), dtype and jax
version. An entry only ever rises to the largest measurement (`python -m llm_jax.bench peak`
adds one), so every later run divides by the same number, and says where it came from.

A figure measured by the trainer at start-up is rough: the machine may be busy then (the figure
in a fresh run on 2 shared cores was 8.2e10 where a quiet `bench peak` gives 2.1e11, so the
first MFU read 0.8). So the entry counts the measurements `bench peak` made on purpose, and
until there is one `peak_flops` says plainly that the figure is rough and how to make it exact.
The trainer measures before its data pipeline and compiler start, to keep its own load out.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

CACHE_ENV = "LLM_JAX_PEAK_CACHE"


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(min(times))


def measure_matmul_flops(dtype: str = "float32", n: int = 2048, repeats: int = 9) -> float:
    """Best FLOP/s of an n x n x n XLA matmul in `dtype`, accumulating in float32, on device 0."""
    a = jnp.ones((n, n), dtype)
    b = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    return 2 * n**3 / _best_seconds(lambda: f(a, b).block_until_ready(), repeats)


def measure_blas_flops(n: int = 2048, repeats: int = 9) -> float:
    """Best FLOP/s of an n x n x n float32 matmul in NumPy's BLAS on the host."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), np.float32)
    b = rng.standard_normal((n, n), np.float32)
    return 2 * n**3 / _best_seconds(lambda: a @ b, repeats)


def measure_peak_flops(dtype: str = "float32", n: int = 2048, repeats: int = 9) -> dict[str, float]:
    """{"xla": ..., "blas": ... (float32 on CPU only), "peak": the larger}: the MFU denominator."""
    out = {"xla": measure_matmul_flops(dtype, n, repeats)}
    if jnp.dtype(dtype) == jnp.float32 and jax.devices()[0].platform == "cpu":
        out["blas"] = measure_blas_flops(n, repeats)
    out["peak"] = max(out.values())
    return out


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo, else platform.processor())."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def device_key() -> str:
    """What the peak belongs to: the CPU model and the threads this process may use, or the
    accelerator's kind."""
    d = jax.devices()[0]
    if d.platform == "cpu":
        affinity = getattr(os, "sched_getaffinity", None)
        threads = len(affinity(0)) if affinity else os.cpu_count()
        return f"cpu: {cpu_model()} x {threads} threads"
    return f"{d.platform}: {d.device_kind}"


def cache_key(dtype: str) -> str:
    return f"{device_key()} | {jnp.dtype(dtype).name} | jax {jax.__version__}"


def cache_file() -> Path | None:
    """The cache's path, or None when `LLM_JAX_PEAK_CACHE=off`."""
    env = os.environ.get(CACHE_ENV)
    if env == "off":
        return None
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llm_jax" / "peak_flops.json"


def _read(path: Path | None) -> dict[str, Any]:
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # unreadable or half-written: measure again
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)  # atomic: concurrent runs never read half a file


def load_per_core() -> float | None:
    """The 1-minute load average per usable core (None where the OS does not say)."""
    try:
        return os.getloadavg()[0] / max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return None


def record_peak(dtype: str, measured: dict[str, float], n: int, repeats: int, *,
                by_bench: bool = True) -> tuple[dict, str]:
    """Adds one measurement to the cache: the entry keeps the largest peak seen. `by_bench`:
    made on purpose by `bench peak` (not in passing at a trainer's start-up). Returns the
    entry and where it is (or why it was not stored)."""
    path, key = cache_file(), cache_key(dtype)
    data = _read(path)
    old = data.get(key, {})
    entry = {"peak": max(measured["peak"], float(old.get("peak", 0.0))),
             "measurements": int(old.get("measurements", 0)) + 1,
             "bench_measurements": int(old.get("bench_measurements", 0)) + int(by_bench),
             "last": {**measured, "n": n, "repeats": repeats, "load_per_core": load_per_core(),
                      "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}}
    if path is None:
        return entry, f"{CACHE_ENV}=off"
    try:
        _write(path, {**data, key: entry})
    except OSError as e:
        return entry, f"not cached: {e.strerror} ({path})"
    return entry, str(path)


ROUGH_HINT = ("ROUGH: no `python -m llm_jax.bench peak` has measured this machine; run it "
              "once on a quiet machine to make MFU exact, or set train.peak_flops")


def is_rough(source: str) -> bool:
    """Whether `peak_flops`'s source says the figure is rough."""
    return source.startswith("ROUGH")


def peak_flops(dtype: str = "float32", *, n: int = 2048, repeats: int = 9) -> tuple[float, str]:
    """(the MFU denominator in FLOP/s, its source): this machine's cached peak, else one
    measurement of `repeats` n^3 matmuls, then cached. The source starts with "ROUGH" (and
    says what to do) until `bench peak` has measured the machine (module doc)."""
    path, key = cache_file(), cache_key(dtype)
    entry = _read(path).get(key)
    if entry and entry.get("peak", 0) > 0:
        where = f"max of {entry.get('measurements', 1)} measurement(s), {path}"
    else:
        entry, stored = record_peak(dtype, measure_peak_flops(dtype, n, repeats), n, repeats,
                                    by_bench=False)
        load = entry["last"]["load_per_core"]
        where = (f"measured now, best of {repeats} {n}^3 matmuls"
                 + ("" if load is None else f" at load {load:.2f} per core") + f", {stored}")
    if entry.get("bench_measurements", 0) > 0:
        return float(entry["peak"]), f"cached peak, {where}"
    return float(entry["peak"]), f"{ROUGH_HINT} ({where})"
