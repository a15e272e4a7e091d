"""End-of-run pictures: loss curves, expert load per layer over time (collapsed experts show
up as dark rows), and an RL run's rewards and pass rates."""

from __future__ import annotations

from typing import Any

import numpy as np


def plot_losses(records: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    bpb = [(r["step"], r["val_bpb"]) for r in records if "val_bpb" in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        axes[0].plot(*zip(*train), label="train loss")
    if val:
        axes[0].plot(*zip(*val), "o-", label="validation loss")
    axes[0].set(xlabel="step", ylabel="cross-entropy (nats/token)", title="Loss")
    axes[0].legend()
    if bpb:
        axes[1].plot(*zip(*bpb), "o-", color="C2")
    axes[1].set(xlabel="step", ylabel="bits per byte", title="Validation bits per byte")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_expert_load(records: list[dict[str, Any]], path: str) -> None:
    """One panel per layer: experts (rows) by logged step (columns), colour = load fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if "expert_load" in r]
    if not rows:
        return
    load = np.asarray([r["expert_load"] for r in rows])  # [S, L, E]
    steps = [r["step"] for r in rows]
    num_layers, num_experts = load.shape[1], load.shape[2]
    fig, axes = plt.subplots(1, num_layers, figsize=(3.2 * num_layers, 3.6), squeeze=False)
    vmax = max(float(load.max()), 2.0 / num_experts)
    for layer, ax in enumerate(axes[0]):
        im = ax.imshow(load[:, layer].T, aspect="auto", origin="lower", vmin=0, vmax=vmax,
                       extent=(steps[0], steps[-1], -0.5, num_experts - 0.5), cmap="viridis")
        ax.set(title=f"layer {layer}", xlabel="step", ylabel="expert" if layer == 0 else None)
    fig.colorbar(im, ax=axes[0].tolist(), label=f"load fraction (balanced = {1 / num_experts:.3f})")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_rewards(records: list[dict[str, Any]], path: str) -> None:
    """An RL run: mean reward and sampled pass rate per logged step, greedy eval pass rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key: str) -> list[tuple[int, float]]:
        return [(r["step"], r[key]) for r in records if key in r]

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if reward := series("reward_mean"):
        axes[0].plot(*zip(*reward), label="mean reward (sampled)")
    axes[0].set(xlabel="RL step", ylabel="reward", title="Reward")
    axes[0].legend()
    for key, style, label in (("pass_rate", "-", "sampled"),
                              ("eval_pass_rate", "o-", "greedy, held out")):
        if points := series(key):
            axes[1].plot(*zip(*points), style, label=label)
    axes[1].set(xlabel="RL step", ylabel="pass rate", title="Pass rate", ylim=(-0.02, 1.02))
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
