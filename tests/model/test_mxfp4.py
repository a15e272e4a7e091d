"""MXFP4 experts kept packed: the in-model unpacking equals the host's dequantization bit for bit,
the quantizer is round-to-nearest (ties to even) and leaves MXFP4 values unchanged, and a packed
MoE layer with every dispatch of the table equals the layer with dequantized weights (outputs and
input gradients within 1e-6 in float32: E2M1 times a power of two is exact, so only the summation
order may differ), experts_per_token > 2 included."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from helpers import ragged_dot_grouped_matmul

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.model.moe import MoE, route
from llm_jax.model.moe_dispatch import DISPATCHES
from llm_jax.model.moe_parallel import experts_per_unpack
from llm_jax.model.mxfp4 import FP4_VALUES, PackedExperts, dense, unpack
from llm_jax.model.params import TRAINABLE, PackedParam
from llm_jax.weights.mxfp4 import (
    dequantize_mxfp4,
    dequantize_stack,
    quantize_mxfp4,
    to_checkpoint_layout,
    to_model_layout,
)


def _random_packed(rng, e, d_out, d_in, scale_range=(118, 124)):
    """Checkpoint layout: blocks (E, out, in / 32, 16), scales (E, out, in / 32)."""
    blocks = rng.integers(0, 256, (e, d_out, d_in // 32, 16), dtype=np.uint8)
    scales = rng.integers(*scale_range, (e, d_out, d_in // 32), dtype=np.uint8)
    return blocks, scales


def test_model_layout_holds_the_checkpoint_codes_and_gives_its_bytes_back():
    blocks, scales = _random_packed(np.random.default_rng(5), 3, 40, 96, (0, 256))
    mb, ms = to_model_layout(blocks, scales)
    assert mb.shape == (3, 3, 16, 40) and ms.shape == (3, 3, 40)
    # Byte row j of block g: value 32 g + j (low nibble) and 32 g + 16 + j (high nibble).
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(3, 40, 3, 32)  # value order
    np.testing.assert_array_equal(mb & 15, np.moveaxis(codes[..., :16], 1, -1))
    np.testing.assert_array_equal(mb >> 4, np.moveaxis(codes[..., 16:], 1, -1))
    np.testing.assert_array_equal(ms, np.swapaxes(scales, -1, -2))
    back_b, back_s = to_checkpoint_layout(mb, ms)
    np.testing.assert_array_equal(back_b, blocks)
    np.testing.assert_array_equal(back_s, scales)
    np.testing.assert_array_equal(dequantize_stack(mb, ms),
                                  np.swapaxes(dequantize_mxfp4(blocks, scales), -1, -2))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_unpack_equals_host_dequantization_bitwise_for_every_byte_and_scale(dtype):
    # Every byte value in every position, under scales from the smallest whose values are all
    # normal floats (2: 0.5 * 2^-125) to the largest (255: 0.5 * 2^128 is finite, 1 * 2^128
    # is not). Scales 0 and 1 make float32 subnormals, which XLA flushes to zero in any
    # computation (packed or dense).
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (10, 1, 1))  # [10, 16, 16]
    scales = np.repeat(np.array([2, 3, 100, 126, 127, 128, 140, 200, 254, 255], np.uint8),
                       16).reshape(10, 16)
    with np.errstate(over="ignore"):  # 6 * 2^127 is past float32's range: inf on both sides
        want = np.ascontiguousarray(dequantize_mxfp4(blocks, scales).astype(dtype).T)  # [in, out]
    got = np.asarray(jax.jit(unpack, static_argnums=2)(*to_model_layout(blocks, scales),
                                                       jnp.dtype(dtype)))
    assert got.dtype == np.dtype(dtype) and got.shape == (512, 10)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_quantizer_rounds_to_nearest_with_ties_to_even_and_keeps_mxfp4_values():
    # A block whose largest magnitude is 6: scale 2^0; 2.5 lies between 2 (even code 4) and 3,
    # 5 between 4 (even code 6) and 6; 0.25 between 0 (even) and 0.5; 1.74 is nearest 1.5.
    row = np.zeros(32, np.float32)
    row[:6] = [6.0, 2.5, -5.0, 0.25, 1.74, -0.0]
    blocks, scales = quantize_mxfp4(row)
    assert scales.tolist() == [127]
    np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales)[:6],
                                  [6.0, 2.0, -4.0, 0.0, 1.5, -0.0])
    # Values MXFP4 holds come back as they were, whatever the scale.
    b, s = _random_packed(np.random.default_rng(0), 3, 5, 64, (100, 150))
    w = dequantize_mxfp4(b, s)
    np.testing.assert_array_equal(dequantize_mxfp4(*quantize_mxfp4(w)), w)
    # Gaussian weights: E2M1 keeps ~1 mantissa bit, relative RMS error about 10 %.
    g = np.random.default_rng(1).normal(size=(8, 4096)).astype(np.float32)
    q = dequantize_mxfp4(*quantize_mxfp4(g))
    rel = np.sqrt(np.mean((q - g) ** 2) / np.mean(g ** 2))
    assert 0.05 < rel < 0.15, rel
    for bad, msg in ((np.ones(33), "multiple of 32"), (np.full(32, np.nan), "inf or NaN")):
        with pytest.raises(ValueError, match=msg):
            quantize_mxfp4(bad)


def test_packed_experts_index_like_the_dense_stack_and_carry_an_adapter():
    rng = np.random.default_rng(2)
    blocks, scales = _random_packed(rng, 4, 48, 64)
    a = rng.normal(size=(4, 64, 3)).astype(np.float32)
    b = rng.normal(size=(4, 3, 48)).astype(np.float32)
    mb, ms = to_model_layout(blocks, scales)
    w = PackedExperts(jnp.asarray(mb), jnp.asarray(ms), jnp.asarray(a), jnp.asarray(b), 0.5,
                      "float32")
    ref = np.swapaxes(dequantize_mxfp4(blocks, scales), -1, -2) + 0.5 * a @ b  # [E, I, O]
    assert w.shape == (4, 64, 48) and w[1].shape == (64, 48)
    np.testing.assert_allclose(dense(w), ref, rtol=1e-6, atol=1e-6)
    idx = jnp.array([3, 0, 3])
    np.testing.assert_allclose(dense(w[idx]), ref[[3, 0, 3]], rtol=1e-6, atol=1e-6)
    plain = jnp.ones((2, 3))
    assert dense(plain) is plain


# ------------------------------------------------------------------ the MoE layer, every dispatch

CFG = ModelConfig(num_hidden_layers=1, num_experts=8, experts_per_token=2, vocab_size=64,
                  hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=2,
                  num_key_value_heads=1, expert_format="mxfp4")


def _layers(cfg: ModelConfig, seed: int = 0) -> tuple[MoE, MoE]:
    """(packed MoE, the same MoE with its experts dequantized on the host)."""
    packed = MoE(cfg, rngs=nnx.Rngs(params=seed))
    rng = np.random.default_rng(seed)
    packed.router[...] = jnp.asarray(rng.normal(size=packed.router.shape) * 0.5, jnp.float32)
    packed.gate_up_proj_bias[...] = jnp.asarray(rng.normal(size=(cfg.num_experts,
                                                                 2 * cfg.intermediate_size)))
    # Scales so that some SwiGLU inputs pass the clamp (|h| > 7).
    b, s = _random_packed(rng, cfg.num_experts, 2 * cfg.intermediate_size, cfg.hidden_size,
                          (124, 127))
    packed.gate_up_proj_blocks[...], packed.gate_up_proj_scales[...] = to_model_layout(b, s)
    dense_layer = MoE(dataclasses.replace(cfg, expert_format="dense"), rngs=nnx.Rngs(params=9))
    for name in ("router", "router_bias", "gate_up_proj_bias", "down_proj_bias"):
        getattr(dense_layer, name)[...] = getattr(packed, name)[...]
    for name in ("gate_up_proj", "down_proj"):
        w = dequantize_stack(np.asarray(getattr(packed, f"{name}_blocks")[...]),
                             np.asarray(getattr(packed, f"{name}_scales")[...]))
        getattr(dense_layer, name)[...] = jnp.asarray(w)
    return packed, dense_layer


def _outputs_and_input_grads(layer: MoE, x: jax.Array, ct: jax.Array,
                             execution: ExecutionConfig):
    graphdef, state = nnx.split(layer)

    def loss(x, state):
        y, aux = nnx.merge(graphdef, state)(x, train=True, execution=execution)
        return jnp.sum(y * ct), (y, aux.drop_fraction)

    (_, (y, drop)), gx = jax.jit(jax.value_and_grad(loss, has_aux=True))(x, state)
    return y, drop, gx


def _assert_close(got, want):
    np.testing.assert_allclose(got, want, rtol=0,
                               atol=1e-6 * (1 + float(jnp.max(jnp.abs(want)))))


K = 3  # one k > 2 for every dispatch (k = 2 over packed experts: test_lora, test_packed_model)


@pytest.fixture(scope="module")
def layer_reference():
    """The packed layer (k = K), its input and cotangent, and the reference: the layer with its
    experts dequantized on the host, run by the dense dispatch (outputs, input gradients), once
    for every dispatch below. Measured: each dispatch over the packed experts equals the same
    dispatch over the dequantized ones bit for bit, and the dense one within a third of the
    tolerance."""
    cfg = dataclasses.replace(CFG, experts_per_token=K)
    packed, dense_layer = _layers(cfg, seed=K)
    x = jax.random.normal(jax.random.key(K), (2, 12, cfg.hidden_size))
    ct = jax.random.normal(jax.random.key(7), x.shape)
    h = np.einsum("td,edf->tef", np.asarray(x).reshape(24, -1), dense_layer.gate_up_proj[...])
    assert (np.abs(h[..., 0::2]) > 7).any()  # the clamp is in play
    y_d, drop_d, gx_d = _outputs_and_input_grads(dense_layer, x, ct,
                                                 ExecutionConfig(moe_dispatch="dense"))
    assert float(drop_d) == 0.0
    return packed, x, ct, y_d, gx_d


@pytest.mark.parametrize("dispatch", sorted(DISPATCHES))
def test_packed_layer_equals_dequantized_layer_outputs_and_input_gradients(dispatch,
                                                                           layer_reference):
    # Capacity factor E / k: C = T slots, so the dropping dispatches drop nothing either.
    packed, x, ct, y_d, gx_d = layer_reference
    ex = ExecutionConfig(moe_dispatch=dispatch, moe_capacity_factor=CFG.num_experts / K)
    y_p, drop_p, gx_p = _outputs_and_input_grads(packed, x, ct, ex)
    assert float(drop_p) == 0.0
    _assert_close(y_p, y_d)
    _assert_close(gx_p, gx_d)


def _lowered(packed: MoE, x: jax.Array, execution: ExecutionConfig) -> str:
    """The text of the packed layer's lowered forward pass on `x`."""
    graphdef, state = nnx.split(packed)
    forward = jax.jit(lambda x, s: nnx.merge(graphdef, s)(x, execution=execution)[0])
    return forward.lower(x, state).as_text()


def _assert_equals_dequantized(packed: MoE, dense_layer: MoE, x: jax.Array,
                               executions: list[ExecutionConfig], seed: int) -> None:
    """The packed layer's outputs and input gradients under each of `executions` equal the
    dequantized layer's, computed once (these executions differ only in how packed stacks are
    unpacked, which a dense stack does not do)."""
    ct = jax.random.normal(jax.random.key(seed + 1), x.shape)
    y_d, _, gx_d = _outputs_and_input_grads(dense_layer, x, ct, executions[0])
    for execution in executions:
        y_p, _, gx_p = _outputs_and_input_grads(packed, x, ct, execution)
        _assert_close(y_p, y_d)
        _assert_close(gx_p, gx_d)


def test_kernel_dispatches_unpack_a_group_of_experts_at_a_time(monkeypatch):
    # 512 x 512 float32 gate-up experts are 1 MiB each, the 256 x 512 down ones 0.5 MiB: with
    # 1 MiB groups the gate-up stack is unpacked one expert at a time, the down stack two at a
    # time, and the layer still equals the dequantized one. Both kernel dispatches unpack through
    # `grouped_experts`: the groups are checked in both lowered programs (with the kernel), the
    # values through gmm with the kernel's plain-JAX contract in its place
    # (`ragged_dot_grouped_matmul`: the kernel with group offsets against it, tests/kernels;
    # each dispatch with its kernel at small sizes: the layer test above).
    import llm_jax.model.moe_parallel as moe_parallel

    cfg = dataclasses.replace(CFG, hidden_size=512, intermediate_size=256, experts_per_token=3)
    packed, dense_layer = _layers(cfg, seed=5)
    x = jax.random.normal(jax.random.key(5), (2, 20, cfg.hidden_size))
    ex = {dispatch: ExecutionConfig(moe_dispatch=dispatch, moe_capacity_factor=8 / 3,
                                    mxfp4_unpack_mib=1)
          for dispatch in ("gmm", "expert_parallel_gmm")}
    for dispatch, execution in ex.items():
        text = _lowered(packed, x, execution)
        assert "1x512x512xf32" in text and "2x256x512xf32" in text, dispatch
        assert "8x512x512xf32" not in text and "8x256x512xf32" not in text, dispatch
    assert experts_per_unpack(packed.expert_weights().gate_up_EDF2, 0) == 8  # 0: all at once
    assert experts_per_unpack(packed.expert_weights().gate_up_EDF2, 3) == 2  # divides E = 8
    monkeypatch.setattr(moe_parallel, "grouped_matmul", ragged_dot_grouped_matmul)
    _assert_equals_dequantized(packed, dense_layer, x, [ex["gmm"]], seed=5)


def test_blocked_unpacks_a_stack_that_fits_once_and_a_larger_one_block_by_block():
    # 8 experts of 512 x 1024 float32 (gate-up, 16 MiB in all) and 512 x 512 (down, 8 MiB):
    # with no limit or 12 MiB, a stack that fits is unpacked whole before the blocks; past the
    # limit (2 MiB), each block unpacks its one expert. The layer equals the dequantized one
    # either way (values checked for the two ends, where both stacks are unpacked one way; 12 MiB
    # mixes them).
    cfg = dataclasses.replace(CFG, hidden_size=512, intermediate_size=512, experts_per_token=3)
    packed, dense_layer = _layers(cfg, seed=4)
    x = jax.random.normal(jax.random.key(4), (2, 20, cfg.hidden_size))
    ex = {mib: ExecutionConfig(moe_dispatch="blocked", mxfp4_unpack_mib=mib) for mib in (0, 12, 2)}
    for unpack_mib, execution in ex.items():
        text = _lowered(packed, x, execution)
        assert ("8x512x1024xf32" in text) == (unpack_mib == 0), unpack_mib
        assert ("8x512x512xf32" in text) == (unpack_mib in (0, 12)), unpack_mib
    _assert_equals_dequantized(packed, dense_layer, x, [ex[0], ex[2]], seed=4)


def test_gather_unpacks_only_the_chosen_experts():
    # Decoding one token reads k of the E packed experts: the unpacked operand is [k, D, 2F],
    # never the [E, D, 2F] stack.
    packed, _ = _layers(CFG)
    w = packed.expert_weights()
    x = jnp.ones((1, CFG.hidden_size))
    r = route(x, packed.router[...], packed.router_bias[...], CFG.experts_per_token)
    jaxpr = jax.make_jaxpr(lambda x, r, w: DISPATCHES["gather"].fn(x, r, w, CFG,
                                                                   ExecutionConfig()))(x, r, w)
    shapes = {tuple(v.aval.shape) for eqn in jaxpr.eqns for v in eqn.outvars}
    d, f2, e = CFG.hidden_size, 2 * CFG.intermediate_size, CFG.num_experts
    assert (2, d, f2) in shapes and (e, d, f2) not in shapes and (e, f2, d) not in shapes


def test_packed_stacks_are_frozen_params():
    packed, _ = _layers(CFG)
    assert isinstance(packed.gate_up_proj_blocks, PackedParam)
    trainable = nnx.state(packed, TRAINABLE)
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(trainable)}
    assert names == {"router", "router_bias", "gate_up_proj_bias", "down_proj_bias"}
    assert all(v.dtype == np.uint8 for v in jax.tree.leaves(nnx.state(packed, PackedParam)))
    # The same logical axes as the dense stack, the 16 byte rows of a block unnamed.
    assert packed.gate_up_proj_blocks.get_metadata()["out_sharding"] == (
        "experts", "embed", None, "mlp")
    assert packed.down_proj_scales.get_metadata()["out_sharding"] == ("experts", "mlp", "embed")


def test_mxfp4_needs_sizes_that_are_multiples_of_32():
    with pytest.raises(ValueError, match="intermediate_size=48 is invalid.*multiple of 32"):
        ModelConfig(hidden_size=64, intermediate_size=48, expert_format="mxfp4")
    with pytest.raises(ValueError, match="expert_format='int4' is invalid"):
        ModelConfig(expert_format="int4")
    assert FP4_VALUES.shape == (16,)
