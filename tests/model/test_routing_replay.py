"""MoE routing replay: a forward given the experts another forward recorded computes the same
function; given other experts it follows them exactly (against a token-by-token NumPy loop);
and the router still gets its gradient, through the gates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import SMALL_MODEL

from llm_jax.execution import ExecutionConfig
from llm_jax.model import init_model
from llm_jax.model.kv_cache import init_cache
from llm_jax.model.moe import MoE

CFG = SMALL_MODEL
K, E, LIMIT = CFG.experts_per_token, CFG.num_experts, CFG.swiglu_limit
T = 12


def numpy_moe_given(x, p, experts):
    """Token by token with the experts given: gates = softmax of the router's logits there."""
    logits = x @ p["router"] + p["router_bias"]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = logits[t, experts[t]]
        gates = np.exp(chosen - chosen.max())
        gates /= gates.sum()
        for e, g in zip(experts[t], gates):
            h = x[t] @ p["gate_up_proj"][e] + p["gate_up_proj_bias"][e]
            glu, lin = np.minimum(h[0::2], LIMIT), np.clip(h[1::2], -LIMIT, LIMIT)
            out[t] += g * ((glu / (1 + np.exp(-1.702 * glu)) * (lin + 1)) @ p["down_proj"][e]
                           + p["down_proj_bias"][e])
    return out


@pytest.fixture(scope="module")
def moe_and_input():
    moe = MoE(CFG, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    moe.router_bias[...] = jnp.asarray(rng.normal(size=E) * 0.5, jnp.float32)
    x = rng.normal(size=(1, T, CFG.hidden_size)).astype(np.float32)
    # for each token, k distinct experts that its router would not pick: the lowest logits
    logits = x[0] @ np.asarray(moe.router[...]) + np.asarray(moe.router_bias[...])
    others = np.argsort(logits, axis=1)[:, :K].astype(np.int32)
    return moe, x, others


@pytest.mark.parametrize("dispatch", ["dense", "ragged", "gather", "capacity"])
def test_a_replayed_routing_is_followed_exactly_by_each_dispatch(moe_and_input, dispatch):
    moe, x, others = moe_and_input
    ex = ExecutionConfig(moe_dispatch=dispatch, moe_capacity_factor=E / K)  # capacity: no drops
    y, aux = nnx.jit(lambda m, x, e: m(x, train=True, execution=ex, experts_BTk=e))(
        moe, x, others[None])
    p = {k: np.asarray(v[...], np.float64) for k, v in nnx.state(moe, nnx.Param).items()}
    np.testing.assert_allclose(y[0], numpy_moe_given(x[0].astype(np.float64), p, others),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(aux.experts[0], others)


def test_the_router_gets_its_gradient_through_the_replayed_gates(moe_and_input):
    """d(sum y * c)/d(router) with replay equals the same derivative of the NumPy loop, taken by
    central differences on a few router entries (float64 reference, 1e-3 relative)."""
    moe, x, others = moe_and_input
    c = np.random.default_rng(1).normal(size=x.shape).astype(np.float32)

    def objective(router):
        m = nnx.clone(moe)
        m.router[...] = router
        return jnp.sum(m(x, experts_BTk=jnp.asarray(others)[None])[0] * c)

    grad = np.asarray(jax.jit(jax.grad(objective))(moe.router[...]))
    p = {k: np.asarray(v[...], np.float64) for k, v in nnx.state(moe, nnx.Param).items()}
    assert np.abs(grad).max() > 1e-3
    for i, j in [(0, 0), (3, 1), (CFG.hidden_size - 1, E - 1)]:
        h = 1e-4
        up, down = dict(p), dict(p)
        up["router"], down["router"] = p["router"].copy(), p["router"].copy()
        up["router"][i, j] += h
        down["router"][i, j] -= h
        x64, c64 = x[0].astype(np.float64), c[0].astype(np.float64)
        fd = (np.sum(numpy_moe_given(x64, up, others) * c64)
              - np.sum(numpy_moe_given(x64, down, others) * c64)) / (2 * h)
        np.testing.assert_allclose(grad[i, j], fd, rtol=1e-3, atol=1e-4)


def test_replaying_a_models_own_routing_gives_the_same_logits_scanned_or_with_a_cache():
    model = init_model(CFG, seed=0)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 9)), jnp.int32)
    logits, aux = nnx.jit(lambda m, t: m(t, return_aux=True))(model, tokens)
    recorded = jnp.moveaxis(aux.experts, 0, 2)  # [L, B, T, k] -> [B, T, L, k]
    assert recorded.shape == (2, 9, CFG.num_hidden_layers, K)
    replay = nnx.jit(lambda m, t, e: m(t, experts_BTLk=e))
    replayed = replay(model, tokens, recorded)
    np.testing.assert_array_equal(replayed, logits)
    # prefill with a cache (the layers as a Python loop): the same routing recorded and replayed
    def prefill(m, t, e):
        h, aux, _ = m.hidden_states(t, cache=init_cache(CFG, 2, 16, "float32"), experts_BTLk=e)
        return h, aux.experts

    prefill = nnx.jit(prefill)
    h, experts = prefill(model, tokens, None)
    np.testing.assert_array_equal(jnp.moveaxis(experts, 0, 2), recorded)
    np.testing.assert_array_equal(prefill(model, tokens, recorded)[0], h)
    # a routing that differs changes the function: replay is really used
    shifted = (recorded + 1) % E
    assert not np.allclose(replay(model, tokens, shifted), logits)


def test_a_replay_of_the_wrong_shape_is_refused():
    model = init_model(CFG, seed=0)
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(AssertionError, match="shape"):
        model(tokens, experts_BTLk=jnp.zeros((1, 4, CFG.num_hidden_layers + 1, K), jnp.int32))
