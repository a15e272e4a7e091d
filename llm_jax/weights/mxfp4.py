"""MXFP4 (OCP Microscaling FP4, E2M1 values in blocks of 32 sharing a power-of-two scale): how
gpt-oss ships its MoE weights. Read only: dequantized to dense on load (docs/model.md, "MXFP4").

Shapes: G blocks of 32 values, stored as 16 bytes (two 4-bit codes each) and one scale byte.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# OCP MX FP4 (E2M1) code points, low nibble first (docs/model.md, "MXFP4").
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
MXFP4_BLOCK = 32  # values per scale


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype: Any = np.float32,
                     rows_per_chunk: int = 1 << 16) -> np.ndarray:
    """MXFP4 -> dense: blocks uint8 (..., G, 16), scales uint8 (..., G) -> (..., G * 32).

    Byte j of a block holds values 2j (low nibble) and 2j+1 (high nibble); each block of 32 values
    shares the scale 2^(s - 127). Vectorised numpy, in chunks of blocks to bound the temporaries.
    """
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks shape {blocks.shape} does not match scales shape {scales.shape}: "
            f"expected blocks (..., G, {MXFP4_BLOCK // 2}) and scales (..., G)"
        )
    *lead, g, b = blocks.shape
    blocks_R16 = blocks.reshape(-1, b)
    exponents_R1 = scales.reshape(-1, 1).astype(np.int32) - 127
    out_R32 = np.empty((blocks_R16.shape[0], 2 * b), dtype)
    for r in range(0, blocks_R16.shape[0], rows_per_chunk):
        blk = blocks_R16[r:r + rows_per_chunk]
        pairs = np.stack([FP4_VALUES[blk & 0x0F], FP4_VALUES[blk >> 4]], axis=-1)  # low first
        out_R32[r:r + rows_per_chunk] = np.ldexp(pairs.reshape(len(blk), 2 * b),
                                                 exponents_R1[r:r + rows_per_chunk])
    return out_R32.reshape(*lead, g * 2 * b)
