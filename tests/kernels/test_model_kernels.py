"""The kernels inside the model: scanned layers with alternating windows (the traced window) give
the logits of the direct path (interpret mode on CPU; gradients are checked per kernel)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.kernels.splash_attention import index_positions
from llm_jax.model import init_model
from llm_jax.model.attention import ATTENTIONS, MaskInputs

SMALL = ModelConfig(num_hidden_layers=2, num_experts=4, experts_per_token=2, vocab_size=97,
                    hidden_size=32, intermediate_size=16, head_dim=8, num_attention_heads=4,
                    num_key_value_heads=2, sliding_window=5)


def _execution(impl: str) -> ExecutionConfig:
    return ExecutionConfig(moe_dispatch="dense", attention_impl=impl)


@nnx.jit
def _forward(model, tokens, positions):
    return model(tokens, positions)


def _logits(impl: str, tokens: jax.Array, positions=None) -> jax.Array:
    """One compiled program per implementation and shape: the positions are an argument (the
    model decides at run time whether splash can take them), so the splash tests share theirs."""
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return _forward(init_model(SMALL, seed=3, execution=_execution(impl)), tokens, positions)


@pytest.mark.slow
def test_flash_in_the_scanned_model_matches_direct():
    tokens = jax.random.randint(jax.random.key(0), (2, 64), 0, SMALL.vocab_size)
    assert float(jnp.max(jnp.abs(_logits("direct", tokens) - _logits("flash", tokens)))) < 1e-4


@pytest.mark.slow
def test_splash_in_the_scanned_model_matches_direct():
    tokens = jax.random.randint(jax.random.key(1), (1, 128), 0, SMALL.vocab_size)
    assert float(jnp.max(jnp.abs(_logits("direct", tokens) - _logits("splash", tokens)))) < 1e-4


def test_splash_falls_back_where_positions_are_not_the_index():
    tokens = jax.random.randint(jax.random.key(2), (1, 128), 0, SMALL.vocab_size)
    spread = 2 * jnp.arange(128)[None]  # the window then covers fewer indices than positions
    want, got = _logits("direct", tokens, spread), _logits("splash", tokens, spread)
    assert float(jnp.max(jnp.abs(want - got))) < 1e-4


def test_index_positions():
    ar = jnp.arange(6)[None]
    assert bool(index_positions(ar + 3, None))
    assert not bool(index_positions(2 * ar, None))
    packed = jnp.array([[1, 1, 2, 2, 0, 0]])  # positions restart per document
    assert bool(index_positions(jnp.array([[0, 1, 0, 1, 0, 0]]), packed))
    assert not bool(index_positions(jnp.array([[0, 1, 0, 1, 0, 0]]),
                                    jnp.array([[1, 1, 2, 2, 1, 1]])))  # segment 1 comes back


@pytest.mark.slow
def test_splash_trains_in_bfloat16():
    """The float32 sinks get a float32 gradient from splash's bf16 backward (the position check's
    cond needs both branches to agree on it): the model's splash attention (`ATTENTIONS`, the
    cond and its fallback) on the bf16 q, k, v a bf16 model computes, one splash kernel."""
    cfg = SMALL.replace(dtype="bfloat16", num_hidden_layers=1, sliding_window=0)
    r = jax.random.split(jax.random.key(0), 4)
    b, t, n, kv, h = 1, 128, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = jax.random.normal(r[0], (b, t, n, h), jnp.bfloat16)
    k, v = (jax.random.normal(x, (b, t, kv, h), jnp.bfloat16) for x in r[1:3])
    sinks = jax.random.normal(r[3], (n,), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))

    def loss(q, k, v, sinks, window):  # the window traced, as the scanned layers pass it
        mask = MaskInputs(pos, pos, window, None, None)
        return ATTENTIONS["splash"](q, k, v, sinks, mask, cfg).astype(jnp.float32).mean()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks, jnp.int32(0))
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 3 + [jnp.float32]
    assert all(bool(jnp.isfinite(g).all()) for g in grads)
