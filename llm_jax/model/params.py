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


def normal(std: float) -> Initializer:
    return jax.nn.initializers.normal(stddev=std)


zeros: Initializer = jax.nn.initializers.zeros
ones: Initializer = jax.nn.initializers.ones
