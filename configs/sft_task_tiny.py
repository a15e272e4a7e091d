"""The SFT warm-up of configs/grpo_tiny.py: a tiny gpt-oss trained from scratch on the reference
replies of a generated task (sorting 3-5 one-digit numbers), in harmony, to a middling held-out
pass rate that RL then raises.

    python -m llm_jax.train --config configs/sft_task_tiny.py        # workdir runs/sft_task_tiny
    python -m llm_jax.train --config configs/grpo_tiny.py            # RL from it

No tokenizer is given: the SFT run writes the task's own (harmony's special tokens, digits one
token each) into its workdir, where the RL run finds it through train.init_from.
"""

import ml_collections

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.training.run_config import default_run_config

# The task both runs share: an RL run on another task is refused when it resumes, and a model
# warmed up on another one starts from nothing. Held out by prompt hash, so no SFT or RL example
# is ever an eval problem.
TASK = dict(name="sort", min_operand=0, max_operand=9, min_terms=3, max_terms=5, eval_size=100)

MODEL = ModelConfig(
    num_hidden_layers=2,
    num_experts=4,
    experts_per_token=2,
    vocab_size=384,  # the task tokenizer: bytes, harmony's tokens and ~120 merges
    hidden_size=128,
    intermediate_size=128,
    head_dim=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    sliding_window=0,
    initial_context_length=512,
    rope_scaling_factor=1.0,
)


def get_config() -> ml_collections.ConfigDict:
    cfg = default_run_config("sft_task_tiny", MODEL, ExecutionConfig(scan_layers=False))
    cfg.task.update(TASK)
    cfg.data.seq_len = 256  # about 3 conversations a row (the harmony system message is ~60)
    # Short on purpose: 150 steps reach about a third of the held-out problems (0.31-0.34,
    # docs/posttraining.md), leaving RL room (400 steps reach about 0.95).
    cfg.train.update(num_steps=150, batch_size=8, learning_rate=3e-3, warmup_steps=20,
                     load_balancing_loss_weight=0.0, eval_every_steps=0, num_samples=0,
                     log_every_steps=10)
    cfg.checkpoint.every_steps = 150
    return cfg
