"""Transformer: scanned layers equal an unrolled loop, windows alternate, dtypes, param counts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.model import abstract_model, init_model

SMALL = ModelConfig(num_hidden_layers=3, num_experts=4, experts_per_token=2, vocab_size=97,
                    hidden_size=32, intermediate_size=16, head_dim=8, num_attention_heads=4,
                    num_key_value_heads=2, sliding_window=4)
DENSE = ExecutionConfig(moe_dispatch="dense")
T = 11
POSITIONS = jnp.broadcast_to(jnp.arange(T), (2, T))


@nnx.jit
def _forward(model, tokens, positions):
    """Logits and auxiliary outputs: one compiled program serves every SMALL model of the tests
    below at [2, T] (the weights and positions are its arguments)."""
    return model(tokens, positions_BT=positions, return_aux=True)


def test_scanned_layers_equal_unrolled_loop_with_alternating_windows():
    """Also: the logits are float32 and the auxiliary outputs hold one entry per layer."""
    model = init_model(SMALL, seed=1, execution=DENSE)
    tokens = jax.random.randint(jax.random.key(0), (2, T), 0, SMALL.vocab_size)
    logits, aux = _forward(model, tokens, POSITIONS)
    assert logits.shape == (2, T, 97) and logits.dtype == jnp.float32
    assert aux.load_balancing_loss.shape == (3,)
    assert aux.expert_load.shape == (3, 4)
    np.testing.assert_allclose(aux.expert_load.sum(-1), 1.0, rtol=1e-6)

    graphdef, state = nnx.split(model.layers)

    @jax.jit
    def unrolled(state, embedding, unembedding):
        x = embedding[tokens]
        for i in range(SMALL.num_hidden_layers):
            layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
            x, _, _ = layer(x, POSITIONS, SMALL.layer_window(i), execution=DENSE)
        return model.norm(x) @ unembedding.T

    ref = unrolled(state, model.embedding[...], model.unembedding[...])
    np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)
    assert SMALL.layer_windows == (4, 0, 4)


def test_bfloat16_compute_is_close_to_float32():
    model = init_model(SMALL, seed=2, execution=DENSE)
    bf16 = nnx.merge(nnx.graphdef(init_model(dataclasses.replace(SMALL, dtype="bfloat16"),
                                             execution=DENSE)),
                     nnx.state(model))
    tokens = jax.random.randint(jax.random.key(1), (2, T), 0, SMALL.vocab_size)
    ref, out = _forward(model, tokens, POSITIONS)[0], _forward(bf16, tokens, POSITIONS)[0]
    assert out.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(out - ref))) < 0.05 * float(jnp.max(jnp.abs(ref))) + 1e-3


def test_only_relative_positions_matter():
    model = init_model(SMALL, seed=3, execution=DENSE)
    tokens = jax.random.randint(jax.random.key(2), (2, T), 0, SMALL.vocab_size)
    a = _forward(model, tokens, POSITIONS)[0]
    shifted = _forward(model, tokens, POSITIONS + 1000)[0]
    np.testing.assert_allclose(a, shifted, rtol=1e-4, atol=1e-4)  # RoPE: q.k sees m - n only
    spread = _forward(model, tokens, 2 * POSITIONS)[0]
    assert float(jnp.max(jnp.abs(a - spread))) > 1e-3


def _logits_and_grads(cfg: ModelConfig, tokens: jax.Array, execution: ExecutionConfig):
    """The logits and the gradient of their sum, from one compiled program."""
    model = init_model(cfg, seed=4, execution=execution)
    g, p = nnx.split(model)

    def total(p):
        logits = nnx.merge(g, p)(tokens)
        return logits.sum(), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(total, has_aux=True))(p)
    return logits, grads


def test_unrolled_and_rematerialized_layers_give_the_same_logits_gradients_and_param_layout():
    """Scanned or unrolled layers, each with and without remat: the same logits and gradients
    (and the same stacked [L, ...] weights) as the scanned layers without remat. Two layers: one
    with a window, one without; the dense dispatch, since how the layers are iterated does not
    depend on it (each dispatch against its references: test_moe.py)."""
    cfg = SMALL.replace(num_hidden_layers=2)
    assert cfg.layer_windows == (4, 0)
    tokens = jax.random.randint(jax.random.key(5), (2, 9), 0, cfg.vocab_size)
    scanned = DENSE
    unrolled = scanned.replace(scan_layers=False)
    want_logits, want = _logits_and_grads(cfg, tokens, scanned)
    for execution in (scanned.replace(remat=True), unrolled, unrolled.replace(remat=True)):
        logits, got = _logits_and_grads(cfg, tokens, execution)
        np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-6)
        assert jax.tree.structure(got) == jax.tree.structure(want)  # same stacked weights
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert x.shape == y.shape
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_a_models_execution_is_one_assignment_that_reaches_every_layer():
    model = init_model(SMALL, seed=1, execution=DENSE)
    tokens = jax.random.randint(jax.random.key(6), (2, 8), 0, SMALL.vocab_size)
    forward = nnx.jit(lambda m, t: m(t, train=True, return_aux=True)[1].drop_fraction)
    assert float(jnp.max(forward(model, tokens))) == 0.0
    model.execution = ExecutionConfig(moe_dispatch="capacity", moe_capacity_factor=0.25)
    drops = forward(model, tokens)  # the static attribute changed: traced again
    assert drops.shape == (SMALL.num_hidden_layers,) and bool(jnp.all(drops > 0))


def _closed_form_param_count(c: ModelConfig) -> int:
    d, n, k, h, e, f, v = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                           c.head_dim, c.num_experts, c.intermediate_size, c.vocab_size)
    attn = d * (n + 2 * k) * h + (n + 2 * k) * h + n * h * d + d + n
    moe = d * e + e + e * (d * 2 * f + 2 * f + f * d + d)
    return 2 * v * d + d + c.num_hidden_layers * (attn + moe + 2 * d)


@pytest.mark.parametrize("cfg", [
    ModelConfig(),
    ModelConfig(num_hidden_layers=24, num_experts=32, experts_per_token=4, vocab_size=201088,
                hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                num_key_value_heads=8, sliding_window=128, rope_theta=150000.0),
    ModelConfig(num_hidden_layers=36, num_experts=128, experts_per_token=4, vocab_size=201088,
                hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                num_key_value_heads=8, sliding_window=128, rope_theta=150000.0),
], ids=["tiny", "20b", "120b"])
def test_param_count_from_eval_shape_matches_closed_form(cfg):
    abstract = abstract_model(cfg)
    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing allocated
    assert sum(x.size for x in leaves) == _closed_form_param_count(cfg)


def test_with_a_cache_each_layer_is_sliced_where_it_runs():
    # Off CPU each layer's weights are sliced with an index tied to the layer's input: with a
    # constant index the slices are loop-invariant inside a decode loop, and XLA:TPU hoisted
    # them out of it as copies of every layer's weights (docs/scaling.md). CPU programs compile
    # without that hoisting and keep the constant index. Both compute the same thing.
    from llm_jax.model.kv_cache import init_cache
    from llm_jax.runtime.backend import compiling_for

    model = init_model(SMALL, seed=2, execution=DENSE)
    tokens = jax.random.randint(jax.random.key(1), (2, 5), 0, SMALL.vocab_size)
    cache = init_cache(SMALL, 2, 8, "float32")
    ref = nnx.jit(lambda model, tokens: model.hidden_states(tokens)[0])(model, tokens)
    for platform in ("cpu", "tpu"):
        def hidden(model, tokens, cache):  # a function of its own: traced anew, not cached
            return model.hidden_states(tokens, None, None, cache)[0]

        with compiling_for(platform):
            jaxpr = jax.make_jaxpr(hidden)(model, tokens, cache)
            h = nnx.jit(hidden)(model, tokens, cache)
        barriers = str(jaxpr).count("optimization_barrier")
        assert barriers == (0 if platform == "cpu" else SMALL.num_hidden_layers), (platform,
                                                                                   barriers)
        np.testing.assert_allclose(h, ref, rtol=1e-5, atol=1e-5, err_msg=platform)
