"""A model's params as a flat {"layers.attn.q_proj": array} dict, and back: the form every
reader fills and every writer reads. A model is built from flat params without random
initialisation (an abstract model, `nnx.eval_shape`, filled)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from llm_jax.config import ModelConfig
from llm_jax.model import abstract_model


def flat_params(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's params as {"layers.attn.q_proj": numpy array, ...}."""
    return {".".join(str(p) for p in path): np.asarray(v.get_value())
            for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def abstract_targets(cfg: ModelConfig) -> tuple[nnx.Module, dict[str, jax.ShapeDtypeStruct]]:
    model = abstract_model(cfg)
    targets = {".".join(str(p) for p in path): v.get_value()
               for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    return model, targets


XLA_CPU_ALIGNMENT = 64  # bytes: XLA:CPU uses a host buffer in place only at this alignment


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array whose data starts on a XLA_CPU_ALIGNMENT boundary, for a reader
    to fill: `model_from_params` then holds it without a copy (numpy's own allocations start
    16 bytes into a page, and XLA:CPU copied such a buffer at its first use: 6.4 GB more for
    gpt-oss-20b's packed gate_up stack)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    buf = np.empty(nbytes + XLA_CPU_ALIGNMENT, np.uint8)
    start = -buf.ctypes.data % XLA_CPU_ALIGNMENT
    return buf[start:start + nbytes].view(dtype).reshape(shape)


def model_from_params(cfg: ModelConfig, params: Mapping[str, np.ndarray],
                      abstract: tuple[nnx.Module, dict[str, jax.ShapeDtypeStruct]] | None = None
                      ) -> nnx.Module:
    """A Transformer for `cfg` holding `params` (flat keys), built without random initialisation
    (`abstract`: `abstract_targets(cfg)` if the caller has it already)."""
    model, targets = abstract or abstract_targets(cfg)
    missing = sorted(set(targets) - set(params))
    if missing:
        raise ValueError(f"params are missing {missing}")
    for key, t in targets.items():
        if tuple(params[key].shape) != tuple(t.shape):
            raise ValueError(f"param {key!r} has shape {params[key].shape}, expected {t.shape}")
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    for key, t in targets.items():
        node = pure
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        value = np.asarray(params[key])
        # On CPU an aligned array is used in place (may_alias; `aligned_empty`): a loaded model
        # holds its weights once, not the reader's copy and a second (gpt-oss-20b: 12.8 GiB).
        node[leaf] = jax.device_put(value if value.dtype == t.dtype else value.astype(t.dtype),
                                    may_alias=True)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)
