"""Parameter creation with logical axis names.

Every weight carries the logical names of its dimensions (`embed`, `heads`, `kv_heads`,
`head_dim`, `mlp`, `experts`, `vocab`) as `out_sharding` metadata; one rules table elsewhere maps
them onto mesh axes. Eager sharding is off so that a model can be built without a mesh.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from llm_jax.model.mxfp4 import random_scale

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def param(
    rngs: nnx.Rngs,
    init: Initializer,
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
    dtype: jnp.dtype,
) -> nnx.Param:
    """A Param of `shape` initialised by `init`, annotated with logical `axes`."""
    if len(axes) != len(shape):
        raise ValueError(f"param axes {axes} do not match shape {shape}")
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes, eager_sharding=False)


class PackedParam(nnx.Param):
    """A frozen weight held packed (MXFP4 blocks or scales, uint8): part of the model's params
    (saved, loaded, sharded like the others) but never trained; `TRAINABLE` leaves it out."""


# The params an optimizer updates: all but the packed ones.
TRAINABLE = nnx.All(nnx.Param, nnx.Not(PackedParam))


def packed_param(rngs: nnx.Rngs, blocks_shape: tuple[int, ...], scales_shape: tuple[int, ...],
                 axes: tuple[str | None, ...], std: float) -> tuple[PackedParam, PackedParam]:
    """Random MXFP4 (blocks, scales) for an expert stack quantized along its input, laid out as
    `model.mxfp4.PackedExperts` holds them: `axes` names (experts, in, out) of the dense stack,
    which the blocks [E, in / 32, 16, out] and scales [E, in / 32, out] share (the blocks' 16
    byte rows are unnamed). Codes are
    uniform over the 16 E2M1 values (rms 2.93), the scale the power of two nearest std / 2.93."""
    scale = random_scale(std)
    blocks = jax.random.randint(rngs.params(), blocks_shape, 0, 256, jnp.int32).astype(jnp.uint8)
    scales = jnp.full(scales_shape, scale, jnp.uint8)
    return (PackedParam(blocks, out_sharding=(*axes[:-1], None, axes[-1]), eager_sharding=False),
            PackedParam(scales, out_sharding=axes, eager_sharding=False))


def normal(std: float) -> Initializer:
    return jax.nn.initializers.normal(stddev=std)


zeros: Initializer = jax.nn.initializers.zeros
ones: Initializer = jax.nn.initializers.ones
