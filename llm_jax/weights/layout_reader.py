"""A checkpoint's tensors against a layout (layouts.py), and read into ours.

`check_layout` compares every header the config implies (name, shape, dtype) with the files,
and finds none left over, before anything sized by the config is allocated; `read_layout` then
fills our flat params, dequantizing MXFP4 one expert at a time for a dense model, or keeping
the bytes for a packed one (quantizing dense weights only when a packed model is asked for:
lossy, and the error is logged). readers.py chooses the layout for each format.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np

from llm_jax.config import ModelConfig
from llm_jax.weights.configs import ARCH_FIELDS
from llm_jax.weights.flat import aligned_empty
from llm_jax.weights.layouts import Layout, TensorSpec, packed_shapes
from llm_jax.weights.mxfp4 import (
    QuantizationError,
    dequantize_mxfp4,
    log_quantization,
    quantize_experts_into,
    to_model_layout,
)
from llm_jax.weights.safetensors_header import FLOAT_DTYPES
from llm_jax.weights.tensor_store import TensorStore


def fields_of(shape: tuple[int, ...], expected: tuple[int, ...], cfg: ModelConfig,
               names: Mapping[str, str]) -> str:
    """Which config fields the mismatching dims of `expected` come from, for the error."""
    out = []
    for axis, (got, want) in enumerate(itertools.zip_longest(shape, expected)):
        if got != want and want is not None:
            fields = [names.get(k, k) for k in ARCH_FIELDS if getattr(cfg, k) == want]
            out.append(f"axis {axis} = {' or '.join(fields) or 'a product of fields'} = {want}")
    return f" ({'; '.join(out)})" if out else ""


def check_tensor(store: TensorStore, name: str, shape: tuple[int, ...], packed: bool,
                  source: Path, cfg: ModelConfig, names: Mapping[str, str]) -> None:
    """The header of tensor `name` against the shape `source` implies; dtype float, or uint8
    for MXFP4 blocks and scales (`packed`)."""
    info = store.info(name)
    if info.shape != shape:
        raise ValueError(f"tensor {name!r} in {info.file} has shape {info.shape}, expected "
                         f"{shape} from {source}{fields_of(info.shape, shape, cfg, names)}: is "
                         "the config that of these weights?")
    if (info.dtype == np.uint8) if packed else (info.dtype in FLOAT_DTYPES):
        return
    raise ValueError(f"tensor {name!r} in {info.file} has dtype {info.dtype}, expected "
                     f"{'uint8 (MXFP4)' if packed else 'a floating-point dtype'}")


def check_layout(store: TensorStore, specs: Layout, cfg: ModelConfig,
                 source: Path, names: Mapping[str, str]) -> None:
    """Every tensor the config at `source` implies, by name, shape and dtype, against the
    headers, and none left over: before anything sized by the config is built or allocated.
    Layer by layer, so a layer count beyond the weights fails at the first missing layer."""
    top, layer = specs
    used: set[str] = set()

    def check(spec: TensorSpec, name: str, n: int | None) -> None:
        packed = [name + x for x in spec.mxfp4 or () if name + x in store]
        if name in store and packed:
            raise ValueError(f"checkpoint has both {name!r} (in {store.info(name).file}) and "
                             f"{packed[0]!r} (in {store.info(packed[0]).file}): a weight comes "
                             "plain or as MXFP4 blocks and scales, not both")
        if name in store:
            check_tensor(store, name, spec.src_shape, False, source, cfg, names)
            used.add(name)
        elif packed:
            for suffix, shape in zip(spec.mxfp4, packed_shapes(spec)):
                if name + suffix not in store:
                    raise ValueError(f"checkpoint has {packed[0]!r} (in "
                                     f"{store.info(packed[0]).file}) but not {name + suffix!r}: "
                                     "MXFP4 comes as blocks and scales")
                check_tensor(store, name + suffix, shape, True, source, cfg, names)
                used.add(name + suffix)
        else:
            layers = ("" if n is None else
                      f" (layer {n} of num_hidden_layers={cfg.num_hidden_layers})")
            where = ", ".join(str(f) for f in store.files)
            raise ValueError(f"checkpoint is missing tensor {name!r}, which {source} implies"
                             f"{layers} (looked in {where})")

    for spec in top:
        check(spec, spec.src, None)
    for n in range(cfg.num_hidden_layers):
        for spec in layer:
            check(spec, spec.src.format(n=n), n)
    unused = sorted(set(store.names()) - used)
    if unused:
        raise ValueError(f"checkpoint has {len(unused)} tensor(s) that {source} does not "
                         f"imply, e.g. {unused[:5]} (in {store.info(unused[0]).file}; is the "
                         "config that of these weights?)")


def read_tensor(store: TensorStore, spec: TensorSpec, name: str, out: np.ndarray) -> None:
    """Fills `out` (our layout, target dtype) from checkpoint tensor `name` (checked by
    `check_layout`), dequantizing MXFP4 one expert at a time to bound the float32 temporary."""
    if name in store:
        out[...] = spec.to_ours(store.get(name)).astype(out.dtype)
        return
    blocks, scales = (store.get(name + s) for s in spec.mxfp4)
    for i in range(out.shape[0]):  # packed (E, out, in) -> ours (E, in, out)
        out[i] = dequantize_mxfp4(blocks[i], scales[i]).T.astype(out.dtype)


def read_packed(store: TensorStore, spec: TensorSpec, name: str, blocks: np.ndarray,
                scales: np.ndarray) -> tuple[float, float]:
    """Fills a packed expert stack (E, in / 32, 16, out) + (E, in / 32, out), the model's layout:
    the checkpoint's MXFP4 codes and scales reordered one expert at a time (`to_model_layout`:
    exact, and an export writes the same bytes back), or (a model asked for with
    expert_format='mxfp4' from dense weights: lossy, by choice) its dense tensor quantized one
    expert at a time. Returns the quantization's (squared error, squared weights): zero for
    MXFP4 read as it is."""
    if name + spec.mxfp4[0] in store:
        stored_blocks, stored_scales = (store.get(name + s) for s in spec.mxfp4)
        for e in range(blocks.shape[0]):
            blocks[e], scales[e] = to_model_layout(stored_blocks[e], stored_scales[e])
        return 0.0, 0.0
    return quantize_experts_into(spec.to_ours(store.get(name)), blocks, scales)  # ours: (E, in, out)


def read_layout(store: TensorStore, specs: Layout, cfg: ModelConfig,
                targets: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, np.ndarray]:
    """The params in our layout from tensors that `check_layout` has passed; packed expert
    stacks (targets `<key>_blocks` / `<key>_scales`) as their bytes, never dense."""
    top, layer = specs
    params: dict[str, np.ndarray] = {}
    errors: dict[str, float] = {}
    for spec in top:
        t = targets[spec.key]
        params[spec.key] = aligned_empty(t.shape, t.dtype)
        read_tensor(store, spec, spec.src, params[spec.key])
    for spec in layer:
        key = f"layers.{spec.key}"
        if key + "_blocks" in targets:
            tb, ts = targets[key + "_blocks"], targets[key + "_scales"]
            blocks = params[key + "_blocks"] = aligned_empty(tb.shape, tb.dtype)
            scales = params[key + "_scales"] = aligned_empty(ts.shape, ts.dtype)
            error = QuantizationError()
            for n in range(cfg.num_hidden_layers):
                error.add(*read_packed(store, spec, spec.src.format(n=n), blocks[n], scales[n]))
            if error.ref_sq:
                errors[spec.key] = error.relative_rms
            continue
        t = targets[key]
        out = params[key] = aligned_empty(t.shape, t.dtype)
        for n in range(cfg.num_hidden_layers):
            read_tensor(store, spec, spec.src.format(n=n), out[n])
    log_quantization(errors, f"reading {store.files[0].parent}")
    return params


def with_stored_expert_format(cfg: ModelConfig, store: TensorStore, specs: Layout,
                               source: Path) -> ModelConfig:
    """`cfg` with expert_format 'mxfp4' when every expert stack of every layer is MXFP4-packed
    (then the model keeps them packed unless asked for expert_format='dense'), else 'dense' (a
    checkpoint packed in some layers only is dequantized, exactly, rather than quantizing the
    rest)."""
    stacks = [s for s in specs[1] if s.mxfp4 is not None]
    # A generator: a hostile layer count stops at the first layer the files do not have.
    if not stacks or not all(s.src.format(n=n) + s.mxfp4[0] in store for s in stacks
                             for n in range(cfg.num_hidden_layers)):
        return cfg.replace(expert_format="dense")
    try:
        return cfg.replace(expert_format="mxfp4")
    except ValueError as e:  # a size MXFP4 cannot hold: name the file and a packed tensor
        first = stacks[0].src.format(n=0) + stacks[0].mxfp4[0]
        raise ValueError(f"{source}: {e}; but {first!r} in {store.info(first).file} "
                         "is MXFP4") from None
