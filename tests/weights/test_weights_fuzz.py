"""Seeded, bounded fuzzing of weight directories: a few hundred mutations of safetensors
headers, shard indexes and config.json files of tiny Hugging Face, OpenAI and llm_jax checkpoints.
Every case must either load the weights that are on disk, or raise ValueError naming the file it
broke; never another exception, never more than MAX_SECONDS. The cases run in a subprocess (this
file as a script) whose address space is capped at HEADROOM above what it uses once warm, so an
allocation sized by a hostile field fails there as MemoryError instead of reaching the machine
(the main code asked for 954 GiB on one of these cases)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

SEED, CASES = 16, 320
HEADROOM, MAX_SECONDS = 2 * 2**30, 5
ROOT = Path(__file__).resolve().parents[2]
CFG = dict(num_hidden_layers=2, num_experts=2, experts_per_token=1, vocab_size=32,
                  hidden_size=16, intermediate_size=16, head_dim=8, num_attention_heads=2,
                  num_key_value_heads=1, sliding_window=4, rope_theta=10000.0)
VALUES = ["big", "", "F16", "BF16", "U8", "I64", "F8_E4M3", -1, 0, 1, 2, 3, 7, 16, 10**9,
          2**31, 2**63, 10**30, 1.5, -0.5, float("nan"), float("inf"), True, False, None, [],
          {}, [0], [-1], [1, 2, 3], [0, 2**63], [10**18, 16], [16, 32], {"a": 1}, "[]"]


class Timeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise Timeout(f"no answer within {MAX_SECONDS} s")


def _raw(path: Path) -> tuple[int, bytes, bytes]:
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    return n, blob[8:8 + n], blob[8 + n:]


def _pick(rng: np.random.Generator, seq: list) -> Any:
    return seq[int(rng.integers(len(seq)))]


def _value(rng: np.random.Generator, old: Any) -> Any:
    if isinstance(old, (int, float)) and not isinstance(old, bool) and rng.random() < 0.3:
        return _pick(rng, [old + 1, old - 1, old * 2, -old, str(old), float(old)])
    return _pick(rng, VALUES)


def _mutate_header(rng: np.random.Generator, path: Path) -> str:
    n, text, data = _raw(path)
    header = json.loads(text)
    names = sorted(k for k in header if k != "__metadata__")
    op = int(rng.integers(9))
    if op == 0:
        n = int(_pick(rng, [0, 1, n - 1, n + 1, len(data) + n + 1, 2**40, 2**63]))
        path.write_bytes(n.to_bytes(8, "little") + text + data)
        return f"header length {n}"
    if op == 1:
        text = _pick(rng, [b"[]", b"7", b'"x"', b"null", b"[" * 100_000, b"{" + b"\xff" * 9,
                           text[: len(text) // 2], b"{}"])
    elif op == 2:
        i = int(rng.integers(len(text)))
        text = text[:i] + bytes([int(rng.integers(256))]) + text[i + 1:]
    elif op == 3:
        name, field = _pick(rng, names), _pick(rng, ["dtype", "shape", "data_offsets", None])
        if field is None:
            header[name] = _value(rng, None)
        elif rng.random() < 0.2:
            del header[name][field]
        else:
            header[name][field] = _value(rng, None)
        text = json.dumps(header).encode()
    elif op == 4:
        a, b = _pick(rng, names), _pick(rng, names)
        header[a]["data_offsets"], header[b]["data_offsets"] = (header[b]["data_offsets"],
                                                                header[a]["data_offsets"])
        text = json.dumps(header).encode()
    elif op == 5:
        name = _pick(rng, names)
        header[name]["data_offsets"][int(rng.integers(2))] += int(_pick(rng, [-4, -1, 1, 4, 10**6]))
        text = json.dumps(header).encode()
    elif op == 6:
        data = data[: int(rng.integers(len(data)))] if rng.random() < 0.7 else data + b"\0" * 64
    elif op == 7:
        header[_pick(rng, ["__metadata__", "extra.weight", names[0]])] = _value(rng, None)
        text = json.dumps(header).encode()
    else:
        text = text.replace(b"{", b'{"%s": %s, ' % (names[0].encode(),
                                                    json.dumps(header[names[0]]).encode()), 1)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return f"header op {op}"


def _paths(d: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(d, dict):
        for k, v in d.items():
            out += _paths(v, (*prefix, k))
    return out


def _mutate_json(rng: np.random.Generator, path: Path) -> str:
    text = path.read_text()
    if rng.random() < 0.1:
        i = int(rng.integers(len(text)))
        path.write_text(_pick(rng, [text[:i], text[:i] + "}" + text[i:], "[" * 50_000, "[]"]))
        return "raw json"
    d = json.loads(text)
    key = _pick(rng, _paths(d))
    parent = d
    for k in key[:-1]:
        parent = parent[k]
    if rng.random() < 0.15:
        del parent[key[-1]]
    else:
        parent[key[-1]] = _value(rng, parent[key[-1]])
    path.write_text(json.dumps(d))
    return f"{'.'.join(map(str, key))}"


def _bases(root: Path) -> dict[str, np.ndarray]:
    """The four base directories under `root`; returns their params."""
    from llm_jax import ModelConfig
    from llm_jax.weights import flat, writers

    cfg = ModelConfig(**CFG)
    _, targets = flat.abstract_targets(cfg)
    rng = np.random.default_rng(SEED)
    model = flat.model_from_params(cfg, {k: rng.normal(size=t.shape).astype(t.dtype)
                                        for k, t in targets.items()})
    writers.save_hf(model, root / "hf")
    writers.save_hf(model, root / "sharded", max_shard_bytes=4_000)
    writers.save_openai(model, root / "openai" / "original")
    writers.save_llm_jax(model, root / "llm_jax")
    return flat.flat_params(model)


def _targets(kind: str, d: Path) -> list[Path]:
    files = sorted(d.rglob("*.json")) + sorted(d.rglob("*.safetensors"))
    return files if kind != "sharded" else files[:1] + files[1:][:3]


def _cap_address_space() -> None:
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + HEADROOM, resource.RLIM_INFINITY))


def run_cases(tmp: Path) -> dict[str, Any]:
    """The fuzz loop (in the subprocess): outcome counts and every failure, described."""
    from llm_jax import load_pretrained
    from llm_jax.weights import flat

    params = _bases(tmp / "bases")
    load_pretrained(tmp / "bases" / "hf")  # warm: JAX's threads and caches exist before the cap
    _cap_address_space()
    rng = np.random.default_rng(SEED)
    outcomes: Counter = Counter()
    failures: list[str] = []
    signal.signal(signal.SIGALRM, _on_alarm)
    for case in range(CASES):
        kind = _pick(rng, ["hf", "hf", "sharded", "openai", "llm_jax"])
        d = tmp / f"{case}"
        shutil.copytree(tmp / "bases" / kind, d)
        victim = _pick(rng, _targets(kind, d))
        what = (_mutate_header if victim.suffix == ".safetensors" else _mutate_json)(rng, victim)
        label = f"case {case}: {kind}, {victim.relative_to(d)}, {what}"
        signal.alarm(MAX_SECONDS)
        try:
            model = load_pretrained(d)
            signal.alarm(0)
            outcomes["loaded"] += 1
            if "data_offsets" not in what and "op 4" not in what:  # same bytes, same weights
                for k, v in flat.flat_params(model).items():
                    if not np.array_equal(v, params[k].astype(v.dtype), equal_nan=True):
                        failures.append(f"{label}: loaded, but {k} differs from the file")
        except ValueError as e:
            signal.alarm(0)
            outcomes["refused"] += 1
            if not (str(victim) in str(e) or (victim.name in str(e) and str(d) in str(e))):
                failures.append(f"{label}: the error does not name {victim}: {e}")
        except Exception as e:  # noqa: BLE001 - the point of the test
            signal.alarm(0)
            failures.append(f"{label}: {type(e).__name__} instead of ValueError: {str(e)[:300]}")
        shutil.rmtree(d)
    return {"outcomes": dict(outcomes), "failures": failures}


def test_fuzzed_weight_directories_load_or_name_the_file():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env,
                          timeout=CASES * MAX_SECONDS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["failures"] == [], "\n".join(result["failures"])
    outcomes = result["outcomes"]
    assert sum(outcomes.values()) == CASES and outcomes["refused"] > CASES / 2, outcomes
    assert outcomes["loaded"] > 0, outcomes
    print(outcomes, f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run_cases(Path(tmp))))
