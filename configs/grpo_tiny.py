"""GRPO on the tiny model configs/sft_task_tiny.py warmed up: RL with verifiable rewards on the
same generated task, rollouts by the project's engine on the weights being trained.

    python -m llm_jax.train --config configs/sft_task_tiny.py
    python -m llm_jax.train --config configs/grpo_tiny.py [--config.rl.beta=0.04 ...]

Each step samples 8 completions of 8 prompts at temperature 1, rewards an exact answer (1) and
a closed final message (0.1), and takes one full fine-tuning step of DAPO's loss (token-level,
clip-higher; rl.aggregation / rl.ratio / rl.epsilon_* / rl.beta choose another). The greedy
pass rate on 100 held-out problems is logged every 50 steps (metrics.jsonl, TensorBoard) and
drawn with the reward in WORKDIR/rewards.png. docs/posttraining.md has the options and figures.
"""

import ml_collections

from llm_jax.config import ModelConfig
from llm_jax.training.finetune import from_checkpoint_model_section
from llm_jax.training.run_config import default_run_config

TASK = dict(name="sort", min_operand=0, max_operand=9, min_terms=3, max_terms=5, eval_size=100)


def get_config() -> ml_collections.ConfigDict:
    cfg = default_run_config("grpo_tiny", ModelConfig())
    cfg.model = from_checkpoint_model_section()  # the warmed-up checkpoint's
    cfg.execution.scan_layers = False
    cfg.task.update(TASK)  # configs/sft_task_tiny.py's
    cfg.train.update(init_from="runs/sft_task_tiny", num_steps=500, learning_rate=2e-4,
                     warmup_steps=5, weight_decay=0.0, log_every_steps=1)
    cfg.rl.update(rewards="exact:1,format:0.1", group_size=8, prompts_per_step=8,
                  max_prompt_tokens=80, max_new_tokens=20, temperature=1.0,
                  eval_every_steps=50, eval_examples=100)
    cfg.checkpoint.every_steps = 50
    return cfg
