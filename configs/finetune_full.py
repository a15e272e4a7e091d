"""Full fine-tuning (SFT) of a pretrained gpt-oss: every weight trained, the model from init_from.

    python -m llm_jax.train --config configs/finetune_full.py --workdir runs/sft \\
        --config.train.init_from=path/to/gpt-oss-20b --config.sft.files='data/*.jsonl'

The `model` section is all None: every field comes from the checkpoint; set only the conversions
dtype, param_dtype or expert_format. How it runs is the `execution` section, e.g.
`--config.execution.remat=True` (docs/finetuning.md).
"""

import ml_collections

from llm_jax.config import ModelConfig
from llm_jax.training.finetune import from_checkpoint_model_section
from llm_jax.training.run_config import default_run_config


def get_config() -> ml_collections.ConfigDict:
    cfg = default_run_config("finetune_full", ModelConfig())
    cfg.model = from_checkpoint_model_section()
    cfg.data.seq_len = 2048
    cfg.train.num_steps = 1000
    cfg.train.batch_size = 8
    cfg.train.learning_rate = 1e-5  # pretrained weights: small steps
    cfg.train.warmup_steps = 50
    cfg.train.weight_decay = 0.0
    cfg.train.load_balancing_loss_weight = 0.0  # keep the pretrained router as it is
    cfg.train.router_z_loss_weight = 0.0
    cfg.train.eval_every_steps = 200  # val_loss on the held-out conversations
    cfg.train.num_samples = 0
    cfg.checkpoint.every_steps = 200
    return cfg
