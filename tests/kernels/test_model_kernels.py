"""The kernels inside the model: scanned layers with alternating windows (the traced window) give
the logits of the direct path (interpret mode on CPU; gradients are checked per kernel)."""

import jax
import jax.numpy as jnp

from llm_jax.config import ModelConfig
from llm_jax.model import init_model

SMALL = ModelConfig(num_hidden_layers=2, num_experts=4, experts_per_token=2, vocab_size=97,
                    hidden_size=32, intermediate_size=16, head_dim=8, num_attention_heads=4,
                    num_key_value_heads=2, sliding_window=5, moe_dispatch="dense")


def _logits(impl: str, tokens: jax.Array) -> jax.Array:
    return init_model(SMALL.replace(attention_impl=impl), seed=3)(tokens)


def test_flash_in_the_scanned_model_matches_direct():
    tokens = jax.random.randint(jax.random.key(0), (2, 64), 0, SMALL.vocab_size)
    assert float(jnp.max(jnp.abs(_logits("direct", tokens) - _logits("flash", tokens)))) < 1e-4


def test_splash_in_the_scanned_model_matches_direct():
    tokens = jax.random.randint(jax.random.key(1), (1, 128), 0, SMALL.vocab_size)
    assert float(jnp.max(jnp.abs(_logits("direct", tokens) - _logits("splash", tokens)))) < 1e-4
