"""Training: the run config, the pure train/eval steps, checkpoints, signals, metrics."""
