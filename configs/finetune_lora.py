"""LoRA fine-tuning (SFT): rank-16 adapters on attention and per expert, the base frozen.

    python -m llm_jax.train --config configs/finetune_lora.py --workdir runs/lora \\
        --config.train.init_from=path/to/gpt-oss-20b --config.sft.files='data/*.jsonl'

Only the adapters get gradients and Adam moments; the base may be bfloat16
(`--config.model.param_dtype=bfloat16`). Export with `python -m llm_jax.export`.
"""

import os
import runpy

import ml_collections

_FULL = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "finetune_full.py"))


def get_config() -> ml_collections.ConfigDict:
    cfg = _FULL["get_config"]()
    cfg.name = "finetune_lora"
    cfg.lora.rank = 16
    cfg.lora.alpha = 32.0
    cfg.train.learning_rate = 2e-4  # adapters start at zero: larger steps than full tuning
    return cfg
