"""RMSNorm against LayerNorm in the real train step (`ModelConfig.norm_type` rms | layer).

    python -m llm_jax.bench norm [--repeats 5] [--steps 2] [--shape 8x256] [--dtype float32]

The seed book says RMSNorm trains 7-9 % faster than LayerNorm (measured in transformers); here
both variants of configs/tiny.py run `compile_steps`' step on the same batch, alternating A B A B
after a warm-up, and the ratio of the medians is reported as measured.
"""

from __future__ import annotations

import argparse
from typing import Any

from llm_jax.bench.common import alternate, machine, median, table
from llm_jax.bench.train import JaxTrainer, quick_model_config, random_batch, tiny_run_config
from llm_jax.execution import ExecutionConfig
from llm_jax.training.run_config import execution_config, model_config


def run(*, repeats: int = 7, steps: int = 2, quick: bool = False, shape: tuple[int, int] = (8, 256),
        dtype: str = "float32") -> dict[str, Any]:
    run_cfg = tiny_run_config()
    base, execution = model_config(run_cfg).replace(dtype=dtype), execution_config(run_cfg)
    if quick:
        base, shape, repeats, steps = quick_model_config().replace(dtype=dtype), (2, 16), 1, 1
        execution = ExecutionConfig()
    b, t = shape
    tc = run_cfg.train.copy_and_resolve_references()
    tc.batch_size, tc.grad_accum_steps = b, 1
    batch = random_batch(base.vocab_size, b, t)
    trainers = {n: JaxTrainer(base.replace(norm_type=n), tc, batch, execution=execution)
                for n in ("rms", "layer")}
    times = alternate({n: (lambda f=f: f(steps)) for n, f in trainers.items()}, repeats=repeats)
    res = {n: {"step_s": median(ts) / steps, "times_s": ts} for n, ts in times.items()}
    return {"benchmark": "norm", "machine": machine(), "repeats": repeats, "batch": b,
            "seq_len": t, "dtype": dtype, "steps_per_call": steps, **res,
            "layer_over_rms": res["layer"]["step_s"] / res["rms"]["step_s"]}


def format_result(r: dict[str, Any]) -> str:
    return (f"train step {r['batch']}x{r['seq_len']} {r['dtype']}, medians of {r['repeats']} "
            f"(A/B alternating); load {r['machine']['load_average']}\n"
            + table(["norm", "ms/step"], [[n, f"{r[n]['step_s'] * 1e3:.1f}"]
                                          for n in ("rms", "layer")])
            + f"\nLayerNorm step / RMSNorm step = {r['layer_over_rms']:.3f} "
            f"(RMSNorm {r['layer_over_rms'] - 1:+.1%} faster)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per timed call")
    p.add_argument("--shape", type=lambda s: tuple(int(x) for x in s.split("x")), default=(8, 256))
    p.add_argument("--dtype", default="float32")


def from_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(repeats=a.repeats, steps=a.steps, quick=a.quick, shape=a.shape, dtype=a.dtype)
