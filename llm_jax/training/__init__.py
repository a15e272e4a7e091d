"""Training: the run config, the loop and its pure train/eval steps, fine-tuning, DPO, RL,
ahead-of-time compiles, signals, metrics."""
