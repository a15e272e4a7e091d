"""Fault injection for the reliability tests (docs/reliability.md): faults on purpose, from config.

Both hooks are off by default (-1) and cost nothing then: the NaN hook is applied at trace
time only when set, and the kill hook is one integer comparison per checkpoint save.

- `train.inject_nan_at_step = N`: the loss of the update that produces step N is multiplied by
  NaN, so that step's loss and every gradient are NaN, as a bad batch or an overflow would make
  them. The other steps are untouched (bitwise).
- `checkpoint.inject_kill_during_save_at_step = N`: the process SIGKILLs itself right after the
  (asynchronous) save of step N has started, while Orbax is still writing its temporary
  directory: a deterministic `kill -9` mid-save.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def poison_loss(loss_fn: Callable[..., Any], step: jax.Array, nan_at_step: int) -> Callable:
    """`loss_fn` whose loss (and so its gradients) is NaN when `step + 1 == nan_at_step`."""
    if nan_at_step < 0:
        return loss_fn

    def poisoned(params, **kwargs):
        loss, metrics = loss_fn(params, **kwargs)
        scale = jnp.where(step + 1 == nan_at_step, jnp.nan, 1.0).astype(loss.dtype)
        return loss * scale, {**metrics, **{k: metrics[k] * scale for k in ("loss", "total_loss")
                                            if k in metrics}}

    return poisoned


def maybe_kill_during_save(step: int, kill_at_step: int) -> None:
    """SIGKILLs this process if `step` is the configured one (called just after a save starts)."""
    if step == kill_at_step:
        os.kill(os.getpid(), signal.SIGKILL)
