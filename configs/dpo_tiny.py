"""DPO on a synthetic preference set, from scratch on CPU in about a minute: a tiny model learns
which kind of thing a word is from pairs of replies (llm_jax/data/preference_synthetic.py);
held-out preference accuracy 0.5 at step 0, 0.94 at step 50, 1.0 from step 80
(docs/posttraining.md, "Measured").

    python -m llm_jax.data.preference_synthetic --out runs/dpo_data
    python -m llm_jax.train --config configs/dpo_tiny.py --workdir runs/dpo_tiny

Full fine-tuning (lora.rank=0): the reference policy is the initial model, whose log-probs of
every pair are computed once before step 1 (WORKDIR/dpo_reference). `--config.lora.rank=8`
trains adapters instead, the reference then being the base with the adapters off (with
`--config.dpo.beta=0.5 --config.train.learning_rate=3e-3 --config.train.num_steps=200`);
`--config.dpo.loss=simpo --config.dpo.beta=2.0` is reference-free (docs/posttraining.md).
"""

import ml_collections

from llm_jax.config import ModelConfig
from llm_jax.training.run_config import default_run_config


def get_config() -> ml_collections.ConfigDict:
    model = ModelConfig(
        num_hidden_layers=2, num_experts=4, experts_per_token=2, vocab_size=320,
        hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=0, rope_scaling_factor=1.0)
    cfg = default_run_config("dpo_tiny", model)
    cfg.dpo.files = "runs/dpo_data/pairs.jsonl"
    cfg.dpo.tokenizer = "runs/dpo_data"
    cfg.dpo.loss = "dpo"
    cfg.dpo.beta = 0.1
    cfg.dpo.validation_fraction = 0.2  # 17 of the 90 prompts: 34 held-out pairs
    cfg.data.seq_len = 48
    cfg.train.num_steps = 100
    cfg.train.batch_size = 8  # pairs
    cfg.train.learning_rate = 1e-3
    cfg.train.warmup_steps = 10
    cfg.train.weight_decay = 0.0
    cfg.train.log_every_steps = 10
    cfg.train.eval_every_steps = 10
    cfg.train.eval_batches = 5  # the 34 held-out pairs
    cfg.train.num_samples = 0
    cfg.train.peak_flops = 1e11  # no matmul measured at start-up: MFU means nothing here
    cfg.checkpoint.every_steps = 50
    return cfg
