"""RMSNorm (gpt-oss), its partial variant pRMSNorm, and LayerNorm for comparison.

RMSNorm: `y = x * rsqrt(mean(x^2) + eps) * scale`, computed in float32 (Zhang & Sennrich 2019).
pRMSNorm estimates the RMS from the first p of the features (p = 0.0625 in the paper).
Shapes: [..., D] -> [..., D], output in the input's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from llm_jax.config import RMS_NORM_EPS, ModelConfig
from llm_jax.model.params import ones, param, zeros


def rms_norm(x: jax.Array, scale: jax.Array, *, prms_fraction: float = 0.0,
             eps: float = RMS_NORM_EPS) -> jax.Array:
    """Functional RMSNorm; `prms_fraction` in (0, 1] uses only the leading features for the RMS."""
    xf = x.astype(jnp.float32)
    d = x.shape[-1]
    k = max(1, int(prms_fraction * d)) if prms_fraction > 0 else d
    ms = jnp.mean(jnp.square(xf[..., :k]), axis=-1, keepdims=True)
    return (xf * jax.lax.rsqrt(ms + eps) * scale.astype(jnp.float32)).astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array,
               eps: float = RMS_NORM_EPS) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * scale + bias
    return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    """Pre-norm of every block and the final norm; gain `scale` kept in float32."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.prms_fraction = cfg.prms_fraction
        self.scale = param(rngs, ones, (cfg.hidden_size,), ("embed",), jnp.float32)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], prms_fraction=self.prms_fraction)


class LayerNorm(nnx.Module):
    """LayerNorm with gain and bias: only for measuring RMSNorm against it (`norm_type="layer"`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.scale = param(rngs, ones, (cfg.hidden_size,), ("embed",), jnp.float32)
        self.bias = param(rngs, zeros, (cfg.hidden_size,), ("embed",), jnp.float32)

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.scale[...], self.bias[...])


def make_norm(cfg: ModelConfig, *, rngs: nnx.Rngs) -> RMSNorm | LayerNorm:
    return RMSNorm(cfg, rngs=rngs) if cfg.norm_type == "rms" else LayerNorm(cfg, rngs=rngs)
