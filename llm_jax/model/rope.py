"""Rotary position embedding with YaRN scaling (Peng et al. 2023), half-split rotation.

`inv_freq` blends interpolated (1 / (f * freq)) and extrapolated (1 / freq) frequencies with a
linear ramp between YaRN's `low` and `high` dimensions; cos and sin are multiplied by the
attention concentration `0.1 ln f + 1`. With `rope_scaling_factor == 1` this is plain RoPE.
Shapes: positions [B, T] -> cos, sin [B, T, H/2]; x [B, T, N, H].
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from llm_jax.config import ModelConfig, yarn_correction_range


def inv_freq_and_concentration(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """The per-pair inverse frequencies [H/2] (float64 numpy, static) and the cos/sin gain."""
    d = cfg.head_dim
    freq = cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    f = cfg.rope_scaling_factor
    if f <= 1.0:
        return 1.0 / freq, 1.0
    concentration = 0.1 * math.log(f) + 1.0
    low, high = yarn_correction_range(cfg)
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp
    inv_freq = ramp / (f * freq) + extrapolation / freq
    return inv_freq, concentration


def rope_cos_sin(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [B, T, H/2] (float32) for integer `positions` [B, T]."""
    inv_freq, concentration = inv_freq_and_concentration(cfg)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles) * concentration, jnp.sin(angles) * concentration


def apply_rope(x_BTNH: jax.Array, cos_BTh: jax.Array, sin_BTh: jax.Array) -> jax.Array:
    """Rotates the two halves of the head dimension: [x1 cos - x2 sin, x2 cos + x1 sin]."""
    xf = x_BTNH.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    cos, sin = cos_BTh[:, :, None, :], sin_BTh[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)
