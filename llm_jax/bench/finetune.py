"""Full fine-tuning vs LoRA: tokens/s of the trainer's step and the optimizer state it keeps.

    python -m llm_jax.bench finetune [--repeats 5] [--steps 2] [--shape 8x256] [--rank 16]

configs/tiny.py's model (blocked MoE) and one random batch; three contenders alternate:
`full` (every weight trained), `lora` (rank r on q/k/v/o and per expert on gate_up/down) and
`lora_attn` (attention only). The LoRA step forms `w + (alpha/r) A B` and its gradient for each
adapted weight, so adapting the experts saves optimizer work but not matmul work.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax

from llm_jax.bench.common import alternate, machine, median, table
from llm_jax.bench.train import JaxTrainer, quick_model_config, random_batch, tiny_run_config
from llm_jax.execution import ExecutionConfig
from llm_jax.training import finetune
from llm_jax.training.run_config import execution_config, model_config

TARGETS = {"full": "", "lora": "q_proj,k_proj,v_proj,o_proj,gate_up_proj,down_proj",
           "lora_attn": "q_proj,k_proj,v_proj,o_proj"}


def run(*, repeats: int, quick: bool, steps: int, shape: tuple[int, int],
        rank: int) -> dict[str, Any]:
    run_cfg = tiny_run_config()
    run_cfg.execution.moe_dispatch = "blocked"
    cfg, execution = model_config(run_cfg), execution_config(run_cfg)
    if quick:
        # `bench train --quick`'s model and execution (auto: blocked on CPU): under a
        # persistent compilation cache (the test suite sets one) the full mode's step is then
        # that program, loaded instead of compiled again.
        cfg, execution = quick_model_config(), ExecutionConfig()
    batch_size, seq_len = (2, 16) if quick else shape
    steps, repeats = (1, 1) if quick else (steps, repeats)
    batch = random_batch(cfg.vocab_size, batch_size, seq_len)
    # --quick checks the wiring: `lora_attn` differs from `lora` only in its target list.
    modes = {n: t for n, t in TARGETS.items() if not (quick and n == "lora_attn")}
    trainers = {}
    for name, targets in modes.items():
        lora = run_cfg.lora.copy_and_resolve_references()
        lora.rank, lora.targets = (rank if targets else 0), targets or lora.targets
        trainers[name] = JaxTrainer(cfg, run_cfg.train, batch, model_fn=finetune.model_fn(
            cfg, lora, 0, execution), trainable=finetune.trainable(lora))
    times = alternate({n: (lambda t=t: t(steps)) for n, t in trainers.items()}, repeats=repeats)
    rows = []
    for name, t in trainers.items():
        opt = sum(x.nbytes for x in jax.tree.leaves(t.state.opt_state))
        rows.append({"mode": name, "tokens_per_sec": steps * batch_size * seq_len
                     / median(times[name]), "optimizer_state_bytes": opt})
    return {"benchmark": "finetune", "rows": rows, "batch": batch_size, "seq_len": seq_len,
            "rank": rank, "repeats": repeats, "steps": steps, "machine": machine()}


def format_result(r: dict[str, Any]) -> str:
    head = (f"train step, batch {r['batch']} x {r['seq_len']}, LoRA rank {r['rank']}; medians "
            f"of {r['repeats']}; load {r['machine']['load_average']}\n")
    return head + table(["mode", "tokens/s", "optimizer state MiB"],
                        [[x["mode"], x["tokens_per_sec"], x["optimizer_state_bytes"] / 2**20]
                         for x in r["rows"]])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per timed call")
    p.add_argument("--shape", type=lambda s: tuple(int(x) for x in s.split("x")), default=(8, 256))
    p.add_argument("--rank", type=int, default=16)


def from_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(repeats=a.repeats, quick=a.quick, steps=a.steps, shape=a.shape, rank=a.rank)
