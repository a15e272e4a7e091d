"""A whole model with packed MXFP4 experts, read from Hugging Face and OpenAI directories of
several shapes: it keeps the checkpoint's bytes, and computes the same logits as the model read
with `expert_format="dense"` (dequantized on the host) for each dispatch (k = 2), within 1e-6 in
float32 (the unpacking is exact), and decodes the same tokens with the same logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.inference.sampler import sample
from llm_jax.model import init_model
from llm_jax.weights.flat import flat_params
from llm_jax.weights.readers import load_pretrained
from llm_jax.weights.writers import save_hf, save_openai

SHAPES = {
    "k2": ModelConfig(num_hidden_layers=2, num_experts=4, experts_per_token=2, vocab_size=96,
                      hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=4,
                      num_key_value_heads=2, expert_format="mxfp4", initializer_range=0.2),
    "k4-window": ModelConfig(num_hidden_layers=3, num_experts=8, experts_per_token=4,
                             vocab_size=80, hidden_size=32, intermediate_size=64, head_dim=8,
                             num_attention_heads=2, num_key_value_heads=1, sliding_window=4,
                             expert_format="mxfp4", initializer_range=0.2),
}
SAVE = {"hf": lambda m, d: save_hf(m, d), "openai": lambda m, d: save_openai(m, d / "original")}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """`checkpoint(shape, fmt)`: (directory, flat params of the model saved there), each written
    once for the module."""
    made = {}

    def make(shape: str, fmt: str):
        if (shape, fmt) not in made:
            model = init_model(SHAPES[shape], seed=len(shape))
            d = tmp_path_factory.mktemp(f"{shape}-{fmt}")
            SAVE[fmt](model, d)
            made[shape, fmt] = d, flat_params(model)
        return made[shape, fmt]

    return make


ALL_CHECKPOINTS = [(s, f) for s in SHAPES for f in SAVE]


@pytest.mark.parametrize("shape,fmt", ALL_CHECKPOINTS, ids=lambda p: p)
def test_packed_load_keeps_the_checkpoint_bytes(checkpoint, shape, fmt):
    path, source = checkpoint(shape, fmt)
    model = load_pretrained(path)
    assert model.cfg.expert_format == "mxfp4"
    flat = flat_params(model)
    assert "layers.mlp.gate_up_proj" not in flat
    for key in [k for k in source if k.endswith(("_blocks", "_scales"))]:
        assert flat[key].dtype == np.uint8
        np.testing.assert_array_equal(flat[key], source[key])


def _jitted_logits(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    graphdef, state = nnx.split(model)
    out = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)
    return out[0] if isinstance(out, tuple) else out


# Every dispatch over the k = 2 shape read from Hugging Face (the default, `auto`, is `blocked`
# on CPU at these shapes: tested once, below); the windowed k = 4 shape (three layers) with the
# default dispatch (each dispatch over packed experts with k > 2, outputs and gradients:
# test_mxfp4.py's layer test); the OpenAI reader (whose bytes are the same, above) with the
# default dispatch.
@pytest.mark.parametrize("shape,fmt,dispatch",
                         [("k2", "hf", d) for d in ("dense", "ragged", "gather", "blocked")]
                         + [("k4-window", "hf", "auto")]
                         + [(s, "openai", "auto") for s in SHAPES])
def test_packed_logits_equal_dequantized_logits(checkpoint, shape, fmt, dispatch):
    path, _ = checkpoint(shape, fmt)
    packed = load_pretrained(path, execution=ExecutionConfig(moe_dispatch=dispatch))
    dense = load_pretrained(path, execution=ExecutionConfig(moe_dispatch=dispatch),
                            expert_format="dense")
    assert packed.execution.moe_dispatch == dense.execution.moe_dispatch == dispatch
    assert dense.cfg.expert_format == "dense"
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, packed.cfg.vocab_size, (2, 13)))
    a, b = _jitted_logits(packed, tokens), _jitted_logits(dense, tokens)
    assert float(jnp.std(b)) > 0.1  # not a degenerate model
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * (1 + float(jnp.max(jnp.abs(b)))))


# The windowed k = 4 shape, three layers, read from the OpenAI directory: its prefill runs the
# many-token dispatch and each decode step (T k <= E) gathers the chosen packed experts, as the
# k = 2 shape's would.
def test_packed_decode_equals_dequantized_decode(checkpoint):
    path, _ = checkpoint("k4-window", "openai")
    prompts = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 2]]
    ids_p, logits_p = sample(load_pretrained(path), prompts, max_new_tokens=6,
                             return_logits=True)
    ids_d, logits_d = sample(load_pretrained(path, expert_format="dense"), prompts,
                             max_new_tokens=6, return_logits=True)
    assert ids_p == ids_d
    for a, b in zip(logits_p, logits_d):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", ["hf", "llm_jax"])
def test_dense_weights_loaded_packed_report_the_quantization_error(tmp_path, caplog, fmt):
    """Asking for packed experts from dense weights quantizes them (lossy, by choice): the load
    says so, with each stack's relative RMS error ||q(w) - w|| / ||w||, checked here against the
    dequantized bytes it kept (HF: quantized while reading; llm_jax: after building)."""
    from llm_jax.weights.mxfp4 import dequantize_stack
    from llm_jax.weights.writers import save_llm_jax

    cfg = SHAPES["k2"].replace(expert_format="dense")
    model = init_model(cfg, seed=3)
    (save_hf if fmt == "hf" else save_llm_jax)(model, tmp_path)
    dense = flat_params(model)
    with caplog.at_level("WARNING"):
        packed = load_pretrained(tmp_path, expert_format="mxfp4")
    assert packed.cfg.expert_format == "mxfp4"
    flat = flat_params(packed)
    for stack in ("gate_up_proj", "down_proj"):
        w_LEIO = dense[f"layers.mlp.{stack}"].astype(np.float64)
        q_LEIO = dequantize_stack(flat[f"layers.mlp.{stack}_blocks"],
                                  flat[f"layers.mlp.{stack}_scales"], np.float64)
        err = np.linalg.norm(q_LEIO - w_LEIO) / np.linalg.norm(w_LEIO)
        assert 1e-3 < err < 0.2  # 4-bit values: a real, bounded error
        assert f"mlp.{stack} {err:.4f}" in caplog.text, caplog.text
    assert "quantized to MXFP4 (lossy)" in caplog.text
