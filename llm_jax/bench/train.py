"""The trainer's own jitted step (`compile_steps`) beside transformers + torch.optim.AdamW.

    python -m llm_jax.bench train [--repeats 5] [--steps 2] [--shapes 8x256,4x1024]
        [--dtypes float32,bfloat16] [--no_hf]

Both sides hold the same weights (the llm_jax init, exported with `save_hf` and loaded as
GptOssForCausalLM, eager attention) and take the same batch of random tokens. llm_jax bf16 is
dtype=bfloat16 with float32 weights; transformers bf16 is float32 weights under
torch.autocast("cpu", dtype=torch.bfloat16). One timed call = `steps` optimizer steps; the two
sides alternate A B A B for `repeats` calls after one warm-up call each, each side in its own
process (`common.Isolated`: in one process the two runtimes slow each other down; --quick keeps
both in this one); medians are reported.
MFU = tokens/s x costs.flops_per_token / the machine's cached matmul peak of the compute
dtype (`llm_jax.runtime.peak.peak_flops`; its source is printed and in the JSON).
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from llm_jax.bench.common import alternate, contender, machine, median, table, torch_info
from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.model.costs import flops_per_token
from llm_jax.training.run_config import execution_config, model_config

SHAPES = ((8, 256), (4, 1024))
DTYPES = ("float32", "bfloat16")


def tiny_run_config():
    """configs/tiny.py's run config (the file, so the benchmark follows its edits)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / "tiny.py"
    if path.is_file():
        spec = importlib.util.spec_from_file_location("_bench_tiny", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.get_config()
    # installed without the configs folder:
    from llm_jax.training.run_config import default_run_config

    return default_run_config("tiny", ModelConfig())


def quick_model_config() -> ModelConfig:
    """A model small enough that a test compiles and steps it in seconds."""
    return ModelConfig(num_hidden_layers=1, num_experts=4, vocab_size=256, hidden_size=32,
                       intermediate_size=32, head_dim=8, num_attention_heads=2,
                       num_key_value_heads=1)


def random_batch(vocab: int, batch: int, seq_len: int, seed: int = 0) -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(seed).integers(0, vocab, (batch, seq_len + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


class JaxTrainer:
    """`compile_steps`' train step on one device, called `steps` times per call."""

    def __init__(self, cfg: ModelConfig, train_cfg, batch: dict[str, np.ndarray], seed: int = 0,
                 **compile_kw: Any):
        from llm_jax.parallel.sharding import make_mesh
        from llm_jax.training.step import compile_steps

        self.steps = compile_steps(cfg, train_cfg, make_mesh(devices=jax.devices()[:1]), seed,
                                   **compile_kw)
        self.state = self.steps.init()
        self.batch = jax.device_put({k: jnp.asarray(v) for k, v in batch.items()},
                                    self.steps.batch_sharding)
        self.loss = float("nan")

    def __call__(self, steps: int = 1) -> None:
        for _ in range(steps):
            self.state, metrics = self.steps.train(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))
        self.loss = float(metrics["loss"])


def hf_model(cfg: ModelConfig, seed: int = 0):
    """GptOssForCausalLM (float32, eager attention) holding llm_jax's init for `cfg` and `seed`:
    the same weights as `compile_steps(cfg, ..., seed).init()`."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    import transformers

    from llm_jax.model import init_model
    from llm_jax.weights.writers import save_hf

    with tempfile.TemporaryDirectory() as d:
        save_hf(init_model(cfg.replace(dtype="float32", param_dtype="float32"), seed), d)
        model = transformers.GptOssForCausalLM.from_pretrained(
            d, dtype=torch.float32, attn_implementation="eager")
    return model.train()


class TorchTrainer:
    """transformers' forward, cross-entropy, backward, grad clip and torch.optim.AdamW."""

    def __init__(self, model, train_cfg, batch: dict[str, np.ndarray], bf16: bool):
        import torch

        self.torch = torch
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=train_cfg.learning_rate,
                                     betas=(train_cfg.b1, train_cfg.b2),
                                     weight_decay=train_cfg.weight_decay)
        self.clip = train_cfg.grad_clip_norm
        self.inputs = torch.from_numpy(batch["inputs"].astype(np.int64))
        self.targets = torch.from_numpy(batch["targets"].astype(np.int64))
        self.bf16 = bf16
        self.loss = float("nan")

    def __call__(self, steps: int = 1) -> None:
        torch = self.torch
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                logits = self.model(input_ids=self.inputs, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                     self.targets.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.loss = float(loss.detach())


class Repeated:
    """`trainer(steps)` as a no-argument call (what `alternate` and `Isolated` run)."""

    def __init__(self, trainer: Any, steps: int):
        self.trainer, self.steps = trainer, steps

    def __call__(self) -> None:
        self.trainer(self.steps)

    @property
    def loss(self) -> float:
        return self.trainer.loss


def jax_contender(cfg: ModelConfig, train_cfg, batch: dict[str, np.ndarray], steps: int,
                  execution: ExecutionConfig = ExecutionConfig()) -> Repeated:
    return Repeated(JaxTrainer(cfg, train_cfg, batch, execution=execution), steps)


def torch_contender(cfg: ModelConfig, train_cfg, batch: dict[str, np.ndarray], steps: int,
                    bf16: bool) -> Repeated:
    return Repeated(TorchTrainer(hf_model(cfg), train_cfg, batch, bf16=bf16), steps)


def measure_peaks(dtypes, *, quick: bool) -> tuple[dict[str, float], dict[str, str]]:
    """The MFU denominator per dtype and its source: the machine's cached peak
    (`runtime.peak.peak_flops`); --quick measures a small matmul instead, and caches nothing."""
    from llm_jax.runtime.peak import measure_peak_flops, peak_flops

    if quick:
        return ({d: measure_peak_flops(d, n=256, repeats=2)["peak"] for d in dtypes},
                {d: "measured now (--quick, 256^3), not cached" for d in dtypes})
    found = {d: peak_flops(d) for d in dtypes}
    return {d: p for d, (p, _) in found.items()}, {d: s for d, (_, s) in found.items()}


def run(*, repeats: int = 5, steps: int = 2, quick: bool = False,
        shapes: tuple[tuple[int, int], ...] = SHAPES, dtypes: tuple[str, ...] = DTYPES,
        hf: bool = True, peaks: dict[str, float] | None = None,
        profile: bool = False) -> dict[str, Any]:
    run_cfg = tiny_run_config()
    base, execution = model_config(run_cfg), execution_config(run_cfg)
    if quick:
        base, shapes, repeats, steps = quick_model_config(), ((2, 16),), 1, 1
        execution = ExecutionConfig()
    if peaks is None:
        peaks, peak_sources = measure_peaks(dtypes, quick=quick)
    else:
        peak_sources = {d: "given" for d in peaks}
    torch_versions = torch_info() if hf else {}
    rows = []
    for b, t in shapes:
        batch = random_batch(base.vocab_size, b, t)
        for dtype in dtypes:
            cfg = base.replace(dtype=dtype)
            tc = run_cfg.train.copy_and_resolve_references()
            tc.batch_size, tc.grad_accum_steps = b, 1
            # Each side in its own process, the same weights (hf_model exports llm_jax's init).
            # (--quick: both in this process, see `common.InProcess`.)
            fns = {"llm_jax": contender(functools.partial(jax_contender, cfg, tc, batch, steps,
                                                          execution), isolated=not quick)}
            if hf:
                fns["transformers"] = contender(functools.partial(
                    torch_contender, base, tc, batch, steps, dtype == "bfloat16"),
                    isolated=not quick)
            try:
                times = alternate(fns, repeats=repeats)
            finally:
                for f in fns.values():
                    f.close()
            fpt = flops_per_token(cfg, t)
            row = {"batch": b, "seq_len": t, "dtype": dtype, "steps_per_call": steps,
                   "flops_per_token": fpt, "peak_flops": peaks[dtype]}
            for name, ts in times.items():
                step_s = median(ts) / steps
                tps = b * t / step_s
                row[name] = {"step_s": step_s, "tokens_per_s": tps, "mfu": tps * fpt / peaks[dtype],
                             "times_s": ts, "last_loss": fns[name].loss}
            if hf:
                row["speedup"] = row["llm_jax"]["tokens_per_s"] / row["transformers"]["tokens_per_s"]
            if profile:
                from llm_jax.bench.profile import breakdown, format_breakdown

                j = JaxTrainer(cfg, tc, batch, execution=execution)  # here, for the profiler
                j(1)
                hlo = j.steps.train.lower(j.state, j.batch).compile().as_text()
                row["llm_jax"]["profile"] = breakdown(lambda: j(1), hlo)
                print(format_breakdown(row["llm_jax"]["profile"]), flush=True)
            rows.append(row)
            print(format_rows([row]), flush=True)
    return {"benchmark": "train", "machine": {**machine(), **torch_versions}, "repeats": repeats,
            "model": base.to_dict(), "execution": execution.to_dict(), "peak_flops": peaks, "peak_source": peak_sources,
            "rows": rows}


def format_rows(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        j, h = r["llm_jax"], r.get("transformers")
        out.append([f"{r['batch']}x{r['seq_len']}", r["dtype"], f"{j['step_s'] * 1e3:.1f}",
                    f"{j['tokens_per_s']:.0f}", f"{j['mfu']:.1%}",
                    f"{h['step_s'] * 1e3:.1f}" if h else "-",
                    f"{h['tokens_per_s']:.0f}" if h else "-", f"{h['mfu']:.1%}" if h else "-",
                    f"{r['speedup']:.2f}x" if h else "-"])
    return table(["batch", "dtype", "llm_jax ms/step", "llm_jax tok/s", "llm_jax MFU",
                  "transformers ms/step", "transformers tok/s", "transformers MFU",
                  "speed-up"], out)


def format_result(r: dict[str, Any]) -> str:
    peaks = "; ".join(f"{k} {v / 1e9:.0f} GFLOP/s ({r['peak_source'][k]})"
                      for k, v in r["peak_flops"].items())
    return (f"train step, medians of {r['repeats']} (A/B alternating); malloc "
            f"{r['machine']['malloc']}; load {r['machine']['load_average']}\nMFU peak: {peaks}\n"
            + format_rows(r["rows"]))


def _shapes(s: str) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(int(x) for x in item.split("x")) for item in s.split(","))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per timed call")
    p.add_argument("--shapes", type=_shapes, default=SHAPES, help="BATCHxSEQ,... e.g. 8x256")
    p.add_argument("--dtypes", type=lambda s: tuple(s.split(",")), default=DTYPES)
    p.add_argument("--no_hf", dest="hf", action="store_false", help="skip transformers")
    p.add_argument("--profile", action="store_true",
                   help="also trace llm_jax's step: op time in matmuls vs the rest, top ops")


def from_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(repeats=a.repeats, steps=a.steps, quick=a.quick, shapes=a.shapes,
               dtypes=a.dtypes, hf=a.hf, profile=a.profile)
