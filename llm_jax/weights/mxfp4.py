"""MXFP4 on the host (numpy): dequantizing a checkpoint's packed experts when a user asks for a
dense model, and quantizing dense experts (an explicit, lossy choice: a merged QLoRA export, or
an OpenAI-layout export of a dense model); and the same for a whole model's expert stacks
(`dequantize_experts`, `quantize_experts`). The format and its in-model unpacking are
model/mxfp4.py; docs/model.md, "MXFP4".

Shapes: L layers, E experts, I input (the quantized axis), O output; G blocks of 32 values,
stored as 16 bytes (two 4-bit codes each) and one scale byte.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
from flax import nnx

from llm_jax.model.mxfp4 import FP4_VALUES, MXFP4_BLOCK, SCALE_BIAS
from llm_jax.weights.flat import abstract_targets, flat_params, model_from_params


def check_packed(blocks: np.ndarray, scales: np.ndarray, what: str = "MXFP4") -> None:
    """ValueError unless blocks are uint8 (..., G, 16) and scales uint8 (..., G)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"{what}: blocks and scales must be uint8, got {blocks.dtype}, "
                         f"{scales.dtype}")
    if blocks.shape[-1:] != (MXFP4_BLOCK // 2,) or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"{what}: blocks shape {blocks.shape} does not match scales shape {scales.shape}: "
            f"expected blocks (..., G, {MXFP4_BLOCK // 2}) and scales (..., G)")


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype: Any = np.float32,
                     rows_per_chunk: int = 1 << 16) -> np.ndarray:
    """MXFP4 -> dense: blocks uint8 (..., G, 16), scales uint8 (..., G) -> (..., G * 32).

    Byte j of a block holds values 2j (low nibble) and 2j+1 (high nibble); each block of 32 values
    shares the scale 2^(s - 127). Vectorised numpy, in chunks of blocks to bound the temporaries.
    """
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    check_packed(blocks, scales)
    *lead, g, b = blocks.shape
    blocks_R16 = blocks.reshape(-1, b)
    exponents_R1 = scales.reshape(-1, 1).astype(np.int32) - SCALE_BIAS
    out_R32 = np.empty((blocks_R16.shape[0], 2 * b), dtype)
    for r in range(0, blocks_R16.shape[0], rows_per_chunk):
        blk = blocks_R16[r:r + rows_per_chunk]
        pairs = np.stack([FP4_VALUES[blk & 0x0F], FP4_VALUES[blk >> 4]], axis=-1)  # low first
        out_R32[r:r + rows_per_chunk] = np.ldexp(pairs.reshape(len(blk), 2 * b),
                                                 exponents_R1[r:r + rows_per_chunk])
    return out_R32.reshape(*lead, g * 2 * b)


def to_model_layout(blocks: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A checkpoint's MXFP4 stack, blocks (..., O, G, 16) and scales (..., O, G), in the model's
    layout (`model.mxfp4.PackedExperts`): blocks (..., G, 16, O), byte row j of block g holding
    value 32 g + j in its low nibble and 32 g + 16 + j in its high one, and scales (..., G, O).
    The same codes and scales, reordered: `to_checkpoint_layout` gives back the bytes."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], -1)
    half = MXFP4_BLOCK // 2
    rows = codes[..., :half] | (codes[..., half:] << 4)  # (..., O, G, 16)
    return (np.ascontiguousarray(np.moveaxis(rows, -3, -1)),
            np.ascontiguousarray(np.moveaxis(scales, -2, -1)))


def to_checkpoint_layout(blocks: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `to_model_layout`: (..., G, 16, O), (..., G, O) -> the checkpoint's
    (..., O, G, 16), (..., O, G), bitwise the bytes that were read."""
    rows = np.moveaxis(blocks, -1, -3)  # (..., O, G, 16)
    codes = np.concatenate([rows & 0x0F, rows >> 4], axis=-1)  # values 0..31 of each block
    return (np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4)),
            np.ascontiguousarray(np.moveaxis(scales, -1, -2)))


def dequantize_stack(blocks: np.ndarray, scales: np.ndarray, dtype: Any = np.float32
                     ) -> np.ndarray:
    """A packed stack in the model's layout, (..., G, 16, O) and (..., G, O), dense
    (..., G * 32, O): exact."""
    return np.swapaxes(dequantize_mxfp4(*to_checkpoint_layout(blocks, scales), dtype), -1, -2)


# Codes 0-7 are the non-negative E2M1 magnitudes in increasing order.
_MAGNITUDES = FP4_VALUES[:8]


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dense (..., G * 32) -> (blocks uint8 (..., G, 16), scales uint8 (..., G)), round to
    nearest (ties to the even code).

    Each block's scale is the smallest power of two 2^k with amax / 2^k <= 6 (E2M1's largest
    value), so no value clips. Values MXFP4 already holds come back unchanged (though the bytes
    may differ: a block whose largest magnitude is 3 or less gets a smaller scale and larger
    codes)."""
    w = np.asarray(w, np.float32)
    if w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"quantize_mxfp4: last axis {w.shape[-1]} is not a multiple of "
                         f"{MXFP4_BLOCK}")
    if not np.isfinite(w).all():
        raise ValueError("quantize_mxfp4: the weights hold inf or NaN")
    blocks_G32 = w.reshape(*w.shape[:-1], -1, MXFP4_BLOCK)
    amax = np.abs(blocks_G32).max(axis=-1)
    with np.errstate(divide="ignore"):
        k = np.ceil(np.log2(amax / 6.0))
    k = np.clip(np.where(amax > 0, k, -SCALE_BIAS), -SCALE_BIAS, 255 - SCALE_BIAS - 1)
    scaled = np.abs(blocks_G32) / np.ldexp(1.0, k.astype(np.int32))[..., None]
    # Nearest magnitude; ties go to the even code (mantissa bit 0), as round-to-nearest-even.
    dist = np.abs(scaled[..., None] - _MAGNITUDES)
    best = dist.min(axis=-1, keepdims=True)
    ties = dist == best
    even = ties & (np.arange(8) % 2 == 0)
    code = np.where(even.any(axis=-1), even.argmax(axis=-1), ties.argmax(axis=-1))
    code = (code | np.where(np.signbit(blocks_G32), 8, 0)).astype(np.uint8)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.astype(np.uint8), (k + SCALE_BIAS).astype(np.uint8)


def quantize_experts(model: nnx.Module) -> tuple[nnx.Module, dict[str, float]]:
    """A dense model's expert stacks as MXFP4 (lossy: round to nearest, `quantize_mxfp4`):
    (the model with expert_format='mxfp4', {stack: relative RMS error ||q(w) - w|| / ||w||
    over all layers}). A packed model comes back as it is, with no errors."""
    cfg = model.cfg
    if cfg.expert_format == "mxfp4":
        return model, {}
    packed_cfg = cfg.replace(expert_format="mxfp4")  # ValueError names a size MXFP4 cannot hold
    flat = flat_params(model)
    abstract = abstract_targets(packed_cfg)
    targets = abstract[1]
    params, errors = {}, {}
    for key, t in targets.items():
        if key in flat:
            params[key] = flat[key]
        elif key.endswith("_blocks"):
            stack = key.removesuffix("_blocks")
            w_LEIO = flat[stack]
            blocks = params[key] = np.empty(t.shape, np.uint8)
            scales = params[stack + "_scales"] = np.empty(targets[stack + "_scales"].shape,
                                                          np.uint8)
            error = QuantizationError()
            for n in range(w_LEIO.shape[0]):
                error.add(*quantize_experts_into(w_LEIO[n], blocks[n], scales[n]))
            errors[stack.removeprefix("layers.")] = error.relative_rms
    packed = model_from_params(packed_cfg, params, abstract)
    packed.execution = model.execution
    return packed, errors


def log_quantization(errors: dict[str, float], what: str) -> None:
    """One warning naming `what` and each quantized stack's relative RMS error (none if empty)."""
    if errors:
        logging.getLogger(__name__).warning(
            "%s: dense experts quantized to MXFP4 (lossy); relative RMS error %s", what,
            ", ".join(f"{k} {v:.4f}" for k, v in errors.items()))


class QuantizationError:
    """||q(w) - w|| / ||w|| accumulated over the parts of one tensor (or a stack of them)."""

    def __init__(self) -> None:
        self.err_sq = self.ref_sq = 0.0

    def add(self, err_sq: float, ref_sq: float) -> None:
        self.err_sq += err_sq
        self.ref_sq += ref_sq

    @property
    def relative_rms(self) -> float:
        return math.sqrt(self.err_sq / self.ref_sq) if self.ref_sq else 0.0


def quantize_experts_into(w_EIO: np.ndarray, blocks: np.ndarray, scales: np.ndarray
                          ) -> tuple[float, float]:
    """Quantizes one layer's dense experts (E, in, out) into packed `blocks` (E, in / 32, 16,
    out) and `scales` (E, in / 32, out) (the model's layout), one expert at a time (bounded
    temporaries); returns (sum of squared quantization errors, sum of squared weights)."""
    err = ref = 0.0
    for e in range(w_EIO.shape[0]):
        w_OI = np.swapaxes(np.asarray(w_EIO[e], np.float32), -1, -2)
        b, s = quantize_mxfp4(w_OI)
        blocks[e], scales[e] = to_model_layout(b, s)
        err += float(np.sum((dequantize_mxfp4(b, s) - w_OI) ** 2))
        ref += float(np.sum(w_OI ** 2))
    return err, ref


def dequantize_experts(model: nnx.Module) -> nnx.Module:
    """A packed model's expert stacks dense, as the model with expert_format='dense' (exact in
    float32 and bfloat16: an E2M1 value times a power of two); a dense model as it is."""
    cfg = model.cfg
    if cfg.expert_format == "dense":
        return model
    dense_cfg = cfg.replace(expert_format="dense")
    flat = flat_params(model)
    abstract = abstract_targets(dense_cfg)
    params = {}
    for key, t in abstract[1].items():
        if key in flat:
            params[key] = flat[key]
            continue
        blocks, scales = flat[key + "_blocks"], flat[key + "_scales"]  # [L, E, G, 16, O]
        w = params[key] = np.empty(t.shape, t.dtype)  # [L, E, I, O]
        for n, e in np.ndindex(*blocks.shape[:2]):
            w[n, e] = dequantize_stack(blocks[n, e], scales[n, e], t.dtype)
    dense = model_from_params(dense_cfg, params, abstract)
    dense.execution = model.execution
    return dense
