"""MoE expert weights kept in MXFP4, as gpt-oss ships them, and unpacked inside the computation.

MXFP4 (OCP Microscaling FP4): values in blocks of 32 along a weight's input axis share one
power-of-two scale (E8M0: byte s means 2^(s - 127)); each value is a 4-bit E2M1 code (sign, two
exponent bits, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two per byte,
low nibble first. An E2M1 value times a power of two is exact in bfloat16 and float32, so a
packed model computes exactly the function of the same model dequantized (docs/model.md,
"MXFP4").

`PackedExperts` holds one expert stack as the checkpoint's codes and scales, reordered so that
the output axis is the minor one (an export writes back the bytes that were read), and behaves
like the dense [E, in, out] stack it stands for where the MoE dispatches need it: `w[e]` picks
experts (still packed) and `dense(w)` unpacks what is left (in its compute dtype), so each
dispatch unpacks only what it multiplies (the chosen experts, one block's expert, or one device's
experts). A LoRA adapter over a packed, frozen stack rides along (`lora_a`, `lora_b`): applied
beside the unpacked experts (`experts.expert_einsum`) or added to them (`unpacked`), so the
adapter's gradient flows through exactly the experts a token used.

Shapes: E experts, I input (the quantized axis), O output, G = I / 32 blocks, r LoRA rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# OCP MX FP4 (E2M1) code points by 4-bit code (bit 3 is the sign).
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
MXFP4_BLOCK = 32  # values per scale
SCALE_BIAS = 127  # E8M0: byte s is 2^(s - 127)
FP4_RMS = float(np.sqrt(np.mean(FP4_VALUES ** 2)))  # 2.93: rms of codes drawn uniformly
BITS_PER_VALUE = (MXFP4_BLOCK * 4 + 8) / MXFP4_BLOCK  # 4.25: a 4-bit code + a byte per 32


def random_scale(std: float) -> int:
    """The E8M0 scale byte that gives codes drawn uniformly over the 16 E2M1 values (rms
    FP4_RMS) a standard deviation near `std`: the power of two nearest std / FP4_RMS."""
    return round(SCALE_BIAS + np.log2(std / FP4_RMS))


def unpack(blocks: jax.Array, scales: jax.Array, dtype: Any) -> jax.Array:
    """blocks uint8 [..., G, 16, O], scales uint8 [..., G, O] -> values [..., G * 32, O] in
    `dtype`, in the model's layout (`PackedExperts`): byte row j of block g holds value 32 g + j
    of each column in its low nibble and value 32 g + 16 + j in its high nibble. So the values
    come out a row at a time, the low nibbles of a block's 16 rows and then the high ones, and
    O is the minor axis from the bytes to the values: XLA fuses the whole unpacking into one
    loop that writes the [I, O] matrix the matmul reads (on TPU every reshape here merges whole
    tiles of 8 or 16 rows). The checkpoint's order, 16 bytes a block along the minor axis and
    two neighbouring values a byte, made XLA:TPU materialise the steps of the interleave, and
    the swap of I and O after it.

    Integer work, and a multiply a value in float32 (`_values`)."""
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.float32, jnp.bfloat16):
        return unpack(blocks, scales, jnp.float32).astype(dtype)
    codes = jnp.concatenate([blocks & 0x0F, blocks >> 4], axis=-2)  # [..., G, 32, O]
    values = _values(codes, scales[..., None, :], dtype)
    return values.reshape(*blocks.shape[:-3], -1, blocks.shape[-1])


def _values(codes: jax.Array, scales: jax.Array, dtype: Any) -> jax.Array:
    """E2M1 codes (uint8, 0..15) times 2^(scale - 127) in `dtype` (float32 or bfloat16), exactly:
    an E2M1 magnitude is 2^e times 1 or 1.5 (e in -1..2) and both dtypes have the 8-bit, bias-127
    exponent. No table lookup (a gather that XLA materialises as int32 indices). As numpy's
    ldexp, results past the range give inf (scale byte 255: 0.5 * 2^128 is still finite); values
    below 2^-126 (float32 subnormals, which XLA flushes to zero in any computation) give 0, and
    the float32 construction gives 0 for every code under scale bytes 0 and 1 (its factor
    2^(scale - 128) would be subnormal).

    Two constructions of the same bits (but under scale bytes 0 and 1), each the faster one for
    its dtype on XLA:CPU (2 layers of gpt-oss-20b in bfloat16 prefill 512 tokens in 11.9 s
    through the bfloat16 one, 14.1 s through the float32 one; the tiny float32 model decodes
    ~10 % faster through the float32 one than through writing the exponent field):
    - float32: twice the magnitude (0, 1, 2, 3, 4, 6, 8, 12) is the float whose bits are the
      code's three magnitude bits moved to bits 22-24 plus 1.0's exponent (codes 2..7), or 0 and
      1.0 (codes 0 and 1); one float multiply by half the scale, 2^(scale - 128) built from the
      scale byte's bits once per block, makes the value (about 12 operations a value);
    - bfloat16: the value's 16 bits written directly, exponent field e + scale and mantissa .0
      or .1 (integer work, no float32 copy).
    The sign goes to the top bit (code 8 is -0). float16 (5 exponent bits) goes through
    float32."""
    if dtype == jnp.bfloat16:
        codes = codes.astype(jnp.int32)
        mag = codes & 7  # 0, 0.5, 1, 1.5, 2, 3, 4, 6
        exponent = jnp.where(mag >= 2, (mag >> 1) - 1, -1) + scales.astype(jnp.int32)
        bits = jnp.where(exponent >= 255, 255 << 7,
                         (exponent << 7) | jnp.where(mag >= 2, mag & 1, 0) << 6)
        bits = jnp.where((mag == 0) | (exponent <= 0), 0, bits) | (codes >> 3) << 15
        return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), dtype)
    c = codes.astype(jnp.uint32)
    mag = c & 7
    twice = jnp.where(mag >= 2, (mag << 22) + (127 << 23), (0 - mag) & (127 << 23))
    half_scale = jax.lax.bitcast_convert_type(
        (jnp.maximum(scales, 1).astype(jnp.uint32) - 1) << 23, jnp.float32)
    return jax.lax.bitcast_convert_type(twice | (c & 8) << 28, jnp.float32) * half_scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedExperts:
    """A dense expert stack w [E, I, O] held as MXFP4 along I: `blocks` uint8 [E, G, 16, O] (see
    `unpack` for which value each nibble holds), `scales` uint8 [E, G, O]; the checkpoint's
    [E, O, G, 16] and [E, O, G] hold the same codes and scales in another order
    (`weights.mxfp4.to_model_layout`, `to_checkpoint_layout`). With a LoRA adapter (`lora_a`
    [E, I, r], `lora_b` [E, r, O], `lora_scale`) the stack it stands for is w + scale A B.

    Leading expert axes index like an array's: `w[e_A]` (gather) or `w[2]` keep it packed."""

    blocks: jax.Array
    scales: jax.Array
    lora_a: jax.Array | None = None
    lora_b: jax.Array | None = None
    lora_scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))
    dtype: str = dataclasses.field(default="float32", metadata=dict(static=True))  # unpacked

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense stack's shape [..., I, O]."""
        *lead, g, _, o = self.blocks.shape
        return (*lead, g * MXFP4_BLOCK, o)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index: Any) -> PackedExperts:
        pick = lambda x: None if x is None else x[index]  # noqa: E731
        return dataclasses.replace(self, blocks=pick(self.blocks), scales=pick(self.scales),
                                   lora_a=pick(self.lora_a), lora_b=pick(self.lora_b))

    def experts(self, start: jax.Array | int, size: int) -> PackedExperts:
        """Experts start .. start + size - 1 (a traced `start` allowed), still packed."""
        pick = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(  # noqa: E731
            x, start, size)
        return dataclasses.replace(self, blocks=pick(self.blocks), scales=pick(self.scales),
                                   lora_a=pick(self.lora_a), lora_b=pick(self.lora_b))

    def frozen(self) -> PackedExperts:
        """The packed base alone, without the adapter."""
        return dataclasses.replace(self, lora_a=None, lora_b=None, lora_scale=1.0)

    def unpacked(self) -> jax.Array:
        """The dense stack [..., I, O] in `self.dtype`, adapter included (added in float32)."""
        if self.lora_a is None:
            return unpack(self.blocks, self.scales, self.dtype)
        w = unpack(self.blocks, self.scales, jnp.float32)
        w = w + self.lora_scale * jnp.einsum("...ir,...ro->...io", self.lora_a.astype(jnp.float32),
                                             self.lora_b.astype(jnp.float32))
        return w.astype(self.dtype)


ExpertStack = jax.Array | PackedExperts


def dense(w: ExpertStack) -> jax.Array:
    """`w` as a dense array: a packed stack unpacked (in its compute dtype), an array as it is.
    The dispatches call it on the experts they are about to multiply."""
    return w.unpacked() if isinstance(w, PackedExperts) else w


def packed_shapes(experts: int, d_in: int, d_out: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks, scales) shapes of an [E, d_in, d_out] stack quantized along d_in, as the model
    holds them (`PackedExperts`)."""
    g = d_in // MXFP4_BLOCK
    return (experts, g, MXFP4_BLOCK // 2, d_out), (experts, g, d_out)
