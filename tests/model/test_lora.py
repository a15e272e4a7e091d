"""LoRA over packed MXFP4 experts (QLoRA): step 0 is the base exactly, and the adapters'
gradients over the packed, frozen base equal those over the same base dequantized, for each MoE
dispatch (the unpacking is exact, so only the summation order may differ: float32 tolerance)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import ragged_dot_grouped_matmul

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.model import init_model
from llm_jax.model.lora import TARGETS, LoRAParam, add_lora
from llm_jax.model.params import TRAINABLE, PackedParam
from llm_jax.weights.adapters import adapter_params, attach_adapters, merge_lora

PACKED = ModelConfig(num_hidden_layers=1, num_experts=4, experts_per_token=2, vocab_size=64,
                     hidden_size=32, intermediate_size=32, head_dim=8, num_attention_heads=4,
                     num_key_value_heads=2, sliding_window=4, initializer_range=0.2,
                     expert_format="mxfp4")
NO_DROP = ExecutionConfig(moe_capacity_factor=4.0)  # E / k: nothing dropped
RANK, ALPHA = 4, 8.0
# The dispatches a LoRA adapter is tested through; expert_parallel without a mesh runs its local
# path; gmm (whose adapter `dense` adds into what it unpacks) with its kernel's plain-JAX contract
# in its place (`ragged_dot_grouped_matmul`; the kernel in interpret mode: tests/kernels, and
# through the gmm dispatch: test_moe.py).
DISPATCHES = ["dense", "ragged", "gather", "blocked", "capacity", "expert_parallel", "gmm"]
BITWISE_AT_STEP_0 = ("dense", "ragged", "expert_parallel", "gmm")  # measured on CPU


def _qlora(cfg: ModelConfig, execution: ExecutionConfig, seed: int = 0) -> nnx.Module:
    """A packed model with adapters on every target, B nonzero (so A gets a gradient too)."""
    model = add_lora(init_model(cfg, seed=seed, execution=execution), rank=RANK, alpha=ALPHA, targets=tuple(TARGETS),
                     seed=seed)
    for i, (path, v) in enumerate(nnx.to_flat_state(nnx.state(model, LoRAParam))):
        if path[-1].endswith("_lora_b"):
            v.set_value(0.05 * jax.random.normal(jax.random.key(i), v.shape))
    return model


def _dequantized_twin(model: nnx.Module, seed: int = 0) -> nnx.Module:
    """`model` (`_qlora(cfg, seed)`) with its packed experts dequantized (exactly, by
    `merge_lora` of the base alone) and the same adapters, running the same way."""
    base = merge_lora(init_model(model.cfg, seed=seed, execution=model.execution))
    assert base.execution == model.execution
    assert base.cfg.expert_format == "dense"
    return attach_adapters(base, adapter_params(model), rank=RANK, alpha=ALPHA)


def _adapter_grads(model: nnx.Module, tokens: jax.Array) -> dict:
    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)

    def loss(lora):
        m = nnx.merge(graphdef, lora, rest)
        h, _, _ = m.hidden_states(tokens[:, :-1], train=True)
        return m.cross_entropy_sum(h, tokens[:, 1:], jnp.ones(tokens[:, 1:].shape, jnp.float32))

    return {".".join(map(str, p)): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(jax.jit(jax.grad(loss))(lora))}


def _jitted_logits(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)


@pytest.mark.parametrize("dispatch", ["dense", "gather"])
def test_lora_over_packed_experts_is_the_base_at_step_0(dispatch):
    cfg, ex = PACKED, NO_DROP.replace(moe_dispatch=dispatch)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)
    want = np.asarray(_jitted_logits(init_model(cfg, seed=0, execution=ex), tokens))
    model = add_lora(init_model(cfg, seed=0, execution=ex), rank=RANK, alpha=ALPHA,
                     targets=tuple(TARGETS), seed=0)
    assert isinstance(model.layers.mlp.gate_up_proj_blocks, PackedParam)
    got = np.asarray(_jitted_logits(model, tokens))
    if dispatch in BITWISE_AT_STEP_0:
        np.testing.assert_array_equal(got, want)  # B = 0: the adapter adds exact zeros
    else:
        # The same arithmetic, but XLA:CPU compiles the per-assignment (or per-slot) matvec
        # of these dispatches differently once the adapter's side path also reads its input,
        # so the base product is summed in another order (measured: <= 2.3e-6 on logits ~1).
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # What trains: the adapters, never the packed bytes (an optimizer over LoRAParam or TRAINABLE).
    assert not [p for p, _ in nnx.to_flat_state(nnx.state(model, TRAINABLE))
                if p[-1].endswith(("_blocks", "_scales"))]


@pytest.fixture(scope="module")
def dequantized_reference():
    """The adapters' gradients over the dequantized base, computed once with the dense dispatch:
    every dispatch over the packed base is checked against this one reference (no dispatch
    drops here, so each computes the same function; only the summation order may differ)."""
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 13)), jnp.int32)
    twin = _dequantized_twin(_qlora(PACKED, NO_DROP.replace(moe_dispatch="dense")))
    return tokens, _adapter_grads(twin, tokens)


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_adapter_gradients_over_packed_experts_equal_those_over_the_dequantized_base(
        dispatch, dequantized_reference, monkeypatch):
    import llm_jax.model.moe_parallel as moe_parallel

    monkeypatch.setattr(moe_parallel, "grouped_matmul", ragged_dot_grouped_matmul)
    tokens, want = dequantized_reference
    got = _adapter_grads(_qlora(PACKED, NO_DROP.replace(moe_dispatch=dispatch)), tokens)
    assert sorted(got) == sorted(want) and len(got) == 2 * len(TARGETS)
    for key in want:
        scale = float(np.abs(want[key]).max())
        assert scale > 0, key  # every adapter gets a gradient
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-5 * scale, err_msg=key)
