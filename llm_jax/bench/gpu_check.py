"""One-GPU check: the trainer's own step on a ~1B-active MoE in bf16; tokens/s, MFU, kernels.

    python -m llm_jax.bench.gpu_check [--batch 8] [--seq_len 2048] [--steps 10] [--quick]
        [--attention_impl flash] [--moe_dispatch gmm]
    bash launch/gpu_check.sh            # auto, then the Pallas kernels; 10 minutes in all

Model (`check_config`): 16 layers, hidden 2048, 32 q / 8 kv heads of 64, 16 experts top-4 of
width 2048, vocab 32,768, sliding window 128 on even layers: about 1.04B active and 3.5B total
parameters, bf16 weights and activations (about 28 GB of state with Adam: one 80 GB GPU).
MFU = tokens/s x costs.flops_per_token / the chip's dense bf16 peak (PEAK_BF16 by device
kind, else the measured matmul peak). "kernels" names what the selection table chose and the
fused kernels (custom calls: Triton, cuDNN, cuBLAS; Pallas on TPU) in the compiled step.
`--attention_impl` / `--moe_dispatch` override the table (`flash` and `gmm` are the Pallas-Triton
kernels, opt-in on GPU until a run like this one shows them faster than `auto`).
`--quick` swaps in the benchmark's tiny model and one step, so it runs on a CPU in seconds.
"""

from __future__ import annotations

import re
import time
from collections import Counter

import jax

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.runtime.cli import ArgumentParser

# Published dense bf16 tensor-core peaks (NVIDIA data sheets), FLOP/s per GPU.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "GH200": 989e12}


def check_config() -> ModelConfig:
    return ModelConfig(num_hidden_layers=16, num_experts=16, experts_per_token=4,
                       vocab_size=32768, hidden_size=2048, intermediate_size=2048, head_dim=64,
                       num_attention_heads=32, num_key_value_heads=8, sliding_window=128,
                       dtype="bfloat16", param_dtype="bfloat16")


def custom_calls(hlo_text: str) -> dict[str, int]:
    """custom-call targets in compiled HLO (e.g. __cublas$gemm, __gpu$xla.gpu.triton)."""
    return dict(Counter(re.findall(r'custom_call_target="([^"]+)"', hlo_text)))


def peak_flops(quick: bool) -> tuple[float, str]:
    kind = jax.devices()[0].device_kind
    for name, peak in PEAK_BF16.items():
        if name in kind:
            return peak, f"{kind} data sheet"
    from llm_jax.runtime.peak import measure_peak_flops

    n = 256 if quick else 4096
    return measure_peak_flops("bfloat16", n=n, repeats=3)["peak"], f"{kind} measured matmul"


def run(batch: int, seq_len: int, steps: int, quick: bool, attention_impl: str = "auto",
        moe_dispatch: str = "auto") -> dict:
    from llm_jax.bench.train import JaxTrainer, quick_model_config, random_batch, tiny_run_config
    from llm_jax.model.costs import active_params, flops_per_token, total_params
    from llm_jax.model.select import kernels_line

    t0 = time.perf_counter()
    cfg = quick_model_config().replace(dtype="bfloat16") if quick else check_config()
    # The check model recomputes each layer in the backward pass (fits seq 2,048 at batch 8).
    execution = ExecutionConfig(attention_impl=attention_impl, moe_dispatch=moe_dispatch,
                                remat=not quick)
    if quick:
        batch, seq_len, steps = 2, 16, 1
    tc = tiny_run_config().train.copy_and_resolve_references()
    tc.batch_size, tc.grad_accum_steps = batch, 1
    trainer = JaxTrainer(cfg, tc, random_batch(cfg.vocab_size, batch, seq_len),
                         execution=execution)
    hlo = trainer.steps.train.lower(trainer.state, trainer.batch).compile().as_text()
    trainer(1)  # compile and warm up
    t1 = time.perf_counter()
    trainer(steps)
    step_s = (time.perf_counter() - t1) / steps
    peak, source = peak_flops(quick)
    tps = batch * seq_len / step_s
    return {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "active_params": active_params(cfg), "total_params": total_params(cfg),
            "batch": batch, "seq_len": seq_len, "steps": steps, "step_s": step_s,
            "tokens_per_s": tps, "mfu": tps * flops_per_token(cfg, seq_len) / peak,
            "peak_flops": peak, "peak_source": source, "loss": trainer.loss,
            "kernels": kernels_line(cfg, execution, batch, seq_len),
            "custom_calls": custom_calls(hlo),
            "setup_s": t1 - t0}


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(prog="python -m llm_jax.bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="tiny model, one step (CPU smoke run)")
    p.add_argument("--attention_impl", default="auto", help="ExecutionConfig.attention_impl")
    p.add_argument("--moe_dispatch", default="auto", help="ExecutionConfig.moe_dispatch")
    a = p.parse_args(argv)
    r = run(a.batch, a.seq_len, a.steps, a.quick, a.attention_impl, a.moe_dispatch)
    print(f"device {r['device']} ({r['backend']}); model {r['active_params'] / 1e9:.2f}B active "
          f"/ {r['total_params'] / 1e9:.2f}B total, bf16; batch {r['batch']} x {r['seq_len']}")
    print(f"step {r['step_s'] * 1e3:.1f} ms, {r['tokens_per_s']:,.0f} tokens/s, MFU "
          f"{r['mfu']:.1%} of {r['peak_flops'] / 1e12:.0f} TFLOP/s ({r['peak_source']}); "
          f"loss {r['loss']:.3f}; setup + compile {r['setup_s']:.0f} s")
    print(f"kernels: {r['kernels']}; custom calls: "
          + (", ".join(f"{k} x{v}" for k, v in sorted(r["custom_calls"].items())) or "none"))


if __name__ == "__main__":
    main()
