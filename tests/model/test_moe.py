"""MoE: every dispatch equals a loop-over-experts reference (outputs and gradients); capacity
drops are counted; router auxiliary losses have their closed-form values."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import ragged_dot_grouped_matmul

from llm_jax.config import ModelConfig
from llm_jax.execution import MOE_DISPATCHES, ExecutionConfig
from llm_jax.model.experts import ExpertWeights, Routing, swiglu
from llm_jax.model.moe import MoE, route, router_aux
from llm_jax.model.moe_dispatch import (
    DISPATCHES,
    EXACT_FALLBACK,
    capacity,
    moe_capacity,
    moe_dense,
    select_dispatch,
)
from llm_jax.model.select import auto_moe

CFG = ModelConfig(hidden_size=32, intermediate_size=24, num_experts=8, experts_per_token=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  rope_scaling_factor=1.0, swiglu_limit=7.0)


def numpy_moe(x, router, router_bias, w1, b1, w2, b2, k, limit):
    """Token by token, expert by expert: the plainest statement of the gpt-oss MoE."""
    out = np.zeros_like(x, dtype=np.float64)
    logits = x @ router + router_bias
    for t in range(x.shape[0]):
        top = np.argsort(-logits[t], kind="stable")[:k]
        wts = np.exp(logits[t, top] - logits[t, top].max())
        wts /= wts.sum()
        for e, wt in zip(top, wts):
            h = x[t] @ w1[e] + b1[e]
            glu, lin = np.minimum(h[0::2], limit), np.clip(h[1::2], -limit, limit)
            a = glu / (1 + np.exp(-1.702 * glu)) * (lin + 1)
            out[t] += wt * (a @ w2[e] + b2[e])
    return out


def _weights(cfg, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
    return dict(
        router=rng.normal(size=(d, e)) * 0.5,
        router_bias=rng.normal(size=(e,)) * 0.1,
        w1=rng.normal(size=(e, d, 2 * f)) * scale / np.sqrt(d),
        b1=rng.normal(size=(e, 2 * f)) * 0.5,
        w2=rng.normal(size=(e, f, d)) / np.sqrt(f),
        b2=rng.normal(size=(e, d)) * 0.1,
    )


def _moe_module(cfg, w):
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    for name, key in [("router", "router"), ("router_bias", "router_bias"), ("gate_up_proj", "w1"),
                      ("gate_up_proj_bias", "b1"), ("down_proj", "w2"), ("down_proj_bias", "b2")]:
        getattr(moe, name)[...] = jnp.asarray(w[key], jnp.float32)
    return moe


def jax_loop_moe(x, p, k, limit):
    """Loop over experts in JAX (differentiable): each expert on every token, masked combine."""
    routing = route(x, p["router"], p["router_bias"], k)
    out = jnp.zeros_like(x)
    for e in range(p["w1"].shape[0]):
        wt = jnp.sum(jnp.where(routing.experts_Tk == e, routing.weights_Tk, 0.0), axis=-1)
        y = swiglu(x @ p["w1"][e] + p["b1"][e], limit) @ p["w2"][e] + p["b2"][e]
        out = out + wt[:, None] * y
    return out


# Every entry of the table (`auto` picks one of them by shape and backend, blocked here on CPU:
# test_auto_moe_gathers_for_few_tokens_and_is_dropless_for_many). Capacity factor E / k: C = T
# slots, so nothing can be dropped and the dropping dispatches must equal the reference too.
NO_DROP = ExecutionConfig(moe_capacity_factor=CFG.num_experts / CFG.experts_per_token)
ALL = sorted(DISPATCHES)


PARAM_OF = {"router": "router", "router_bias": "router_bias", "gate_up_proj": "w1",
            "gate_up_proj_bias": "b1", "down_proj": "w2", "down_proj_bias": "b2"}
TILE = (256, 128, 384)  # not the default: the config's megablox tiles must reach the kernel


@pytest.fixture(scope="module")
def loop_reference():
    """3 x 10 tokens and weights scaled so that the SwiGLU clamps are in play; the NumPy loop's
    outputs, and the JAX loop's loss and gradients (input and every weight) under a cotangent."""
    w = _weights(CFG, scale=4.0)
    x = np.random.default_rng(1).normal(size=(3, 10, CFG.hidden_size))
    h = np.einsum("td,edf->tef", x.reshape(30, -1), w["w1"]) + w["b1"][None]
    assert (h[..., 0::2] > 7).any() and (h[..., 1::2] < -7).any()
    ct = np.random.default_rng(4).normal(size=x.shape)
    k, lim = CFG.experts_per_token, CFG.swiglu_limit
    y_ref = numpy_moe(x.reshape(30, -1), w["router"], w["router_bias"], w["w1"], w["b1"], w["w2"],
                      w["b2"], k, lim).reshape(x.shape)
    ct_TD = jnp.asarray(ct.reshape(30, -1), jnp.float32)
    l_ref, (gx_ref, gw_ref) = jax.jit(jax.value_and_grad(
        lambda x, p: jnp.sum(jax_loop_moe(x, p, k, lim) * ct_TD), argnums=(0, 1)))(
        jnp.asarray(x.reshape(30, -1), jnp.float32),
        {key: jnp.asarray(v, jnp.float32) for key, v in w.items()})
    return w, x, ct, y_ref, l_ref, np.asarray(gx_ref).reshape(x.shape), gw_ref


@pytest.mark.parametrize("dispatch", ALL)
def test_moe_layer_with_each_dispatch_matches_the_loop_references(dispatch, loop_reference,
                                                                  monkeypatch):
    """The layer in training with each dispatch (nothing dropped): outputs against the NumPy loop,
    loss and gradients (input and every weight) against the JAX loop; for the kernel
    dispatches, the config's megablox tiles are the ones the kernel gets."""
    import llm_jax.model.moe_parallel as moe_parallel

    w, x, ct, y_ref, l_ref, gx_ref, gw_ref = loop_reference
    ex = NO_DROP.replace(moe_dispatch=dispatch)
    seen = []
    if dispatch in ("gmm", "expert_parallel_gmm"):
        real = moe_parallel.grouped_matmul

        def spy(*args, tile, **kwargs):
            seen.append(tile)
            return real(*args, tile=tile, **kwargs)

        monkeypatch.setattr(moe_parallel, "grouped_matmul", spy)
        ex = ex.replace(gmm_tile_m=TILE[0], gmm_tile_k=TILE[1], gmm_tile_n=TILE[2])
    graphdef, state = nnx.split(_moe_module(CFG, w))
    ct = jnp.asarray(ct, jnp.float32)

    def loss(x, state):
        y, aux = nnx.merge(graphdef, state)(x, train=True, execution=ex)
        return jnp.sum(y * ct), (y, aux.drop_fraction)

    (l, (y, drop)), (gx, gs) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        jnp.asarray(x, jnp.float32), state)
    assert float(drop) == 0.0
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(l, l_ref, rtol=1e-5)
    # Gradients to float32 rounding: 1e-4 relative, and 1e-6 of the array's largest entry for the
    # entries near zero (the input gradient reaches ~40 here, where one float32 ulp is 4e-6, and
    # jax 0.12 sums the same products in another order than 0.10).
    def close(a, ref, **kw):
        atol = 1e-6 * (1 + float(np.max(np.abs(ref))))
        np.testing.assert_allclose(a, ref, rtol=1e-4, atol=max(atol, 1e-5), **kw)

    close(gx, gx_ref)
    grads = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(gs)}
    assert sorted(grads) == sorted(PARAM_OF)
    for name, key in PARAM_OF.items():
        close(grads[name], gw_ref[key], err_msg=name)
    if dispatch in ("gmm", "expert_parallel_gmm"):
        assert seen and set(seen) == {TILE}


@pytest.mark.parametrize("dispatch", ["gmm", "expert_parallel"])
def test_sorted_dispatches_with_the_gate_up_stack_blocked_match_the_loop_reference(dispatch,
                                                                                  monkeypatch):
    """Enough rows (T k >= E D) that the gate-up columns are reordered to [glu | linear]
    (`gate_up_blocked`): outputs and gradients against the interleaved loop reference. The two
    local paths that reorder: gmm's, and expert_parallel's, which expert_parallel_gmm shares
    with a kernel for its grouped matmuls. gmm's kernel is replaced by its contract in plain JAX
    (`ragged_dot_grouped_matmul`): what is checked here is the reordering around it (the kernel
    against ragged_dot: tests/kernels; gmm with its kernel: the layer test above)."""
    import llm_jax.model.moe_parallel as moe_parallel
    from llm_jax.model.moe_parallel import gate_up_blocked

    monkeypatch.setattr(moe_parallel, "grouped_matmul", ragged_dot_grouped_matmul)

    w = {k: jnp.asarray(v, jnp.float32) for k, v in _weights(CFG, seed=7, scale=3.0).items()}
    t = CFG.num_experts * CFG.hidden_size // CFG.experts_per_token + 8
    x = jax.random.normal(jax.random.key(8), (t, CFG.hidden_size))
    ct = jax.random.normal(jax.random.key(9), (t, CFG.hidden_size))
    ew = ExpertWeights(w["w1"], w["b1"], w["w2"], w["b2"])
    assert gate_up_blocked(ew, t * CFG.experts_per_token, 1, 1)[1]
    assert not gate_up_blocked(ew, 4, 1, 1)[1]  # a decoding step's rows: left interleaved
    k, lim = CFG.experts_per_token, CFG.swiglu_limit

    def loss(x, p):
        r = route(x, p["router"], p["router_bias"], k)
        y, _ = DISPATCHES[dispatch].fn(x, r, ExpertWeights(p["w1"], p["b1"], p["w2"], p["b2"]),
                                       CFG, NO_DROP)
        return jnp.sum(y * ct)

    l_ref, g_ref = jax.jit(jax.value_and_grad(
        lambda x, p: jnp.sum(jax_loop_moe(x, p, k, lim) * ct), argnums=(0, 1)))(x, w)
    l, g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(l, l_ref, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_capacity_path_drops_overflow_and_reports_the_rate():
    w = {k: jnp.asarray(v, jnp.float32) for k, v in _weights(CFG, seed=5).items()}
    # All tokens identical: all route to the same 2 experts, so each gets T assignments.
    x = jnp.broadcast_to(jax.random.normal(jax.random.key(6), (CFG.hidden_size,)), (16, CFG.hidden_size))
    r = route(x, w["router"], w["router_bias"], 2)
    ew = ExpertWeights(w["w1"], w["b1"], w["w2"], w["b2"])
    y, drop = jax.jit(moe_capacity, static_argnums=(3, 4))(x, r, ew, 7.0, 4)
    assert float(drop) == pytest.approx(1 - 8 / 32)  # 2 experts x 4 slots kept of 32 assignments
    full = jax.jit(moe_dense, static_argnums=3)(x, r, ew, 7.0)
    np.testing.assert_allclose(y[:4], full[:4], rtol=1e-5, atol=1e-5)  # first 4 tokens fit
    np.testing.assert_array_equal(y[4:], 0.0)  # the rest were dropped by both experts


def test_dropping_dispatches_run_only_in_training_and_the_rest_is_exact():
    w = _weights(CFG, seed=7)
    # All tokens identical and a small capacity: training drops, evaluation must not.
    x = np.broadcast_to(np.random.default_rng(8).normal(size=CFG.hidden_size), (1, 16, CFG.hidden_size))
    ref = numpy_moe(x[0], w["router"], w["router_bias"], w["w1"], w["b1"], w["w2"], w["b2"],
                    CFG.experts_per_token, CFG.swiglu_limit)
    graphdef, state = nnx.split(_moe_module(CFG, w))
    for dispatch in ("capacity", "expert_parallel"):
        ex = ExecutionConfig(moe_dispatch=dispatch, moe_capacity_factor=0.5)
        run = jax.jit(lambda x, s, train, ex=ex: nnx.merge(graphdef, s)(x, train=train,
                                                                        execution=ex),
                      static_argnums=2)
        _, aux_train = run(jnp.asarray(x, jnp.float32), state, True)
        assert float(aux_train.drop_fraction) >= 0.5  # capacity 0.875, expert_parallel 0.5
        y, aux = run(jnp.asarray(x, jnp.float32), state, False)
        assert float(aux.drop_fraction) == 0.0
        np.testing.assert_allclose(y[0], ref, rtol=1e-4, atol=1e-4)
    assert select_dispatch(CFG, ExecutionConfig(moe_dispatch="capacity"), 64, train=False) \
        is not DISPATCHES["capacity"].fn
    assert select_dispatch(CFG, ExecutionConfig(moe_dispatch="dense"), 64, train=False) \
        is DISPATCHES["dense"].fn
    # Outside training a dropping dispatch runs exactly: expert_parallel with every slot, or, for
    # a decode step (T k <= E: one token need not split over the expert axis), gather.
    ep = ExecutionConfig(moe_dispatch="expert_parallel_gmm")
    assert select_dispatch(CFG, ep, 64, train=False) is EXACT_FALLBACK["expert_parallel_gmm"]
    assert select_dispatch(CFG, ep, 1, train=False) is DISPATCHES["gather"].fn
    assert select_dispatch(CFG, ep, 1, train=True) is DISPATCHES["expert_parallel_gmm"].fn


def test_auto_moe_gathers_for_few_tokens_and_is_dropless_for_many():
    assert auto_moe(CFG, 4) == "gather"  # T k = 8 <= E = 8: read only the chosen experts
    assert auto_moe(CFG, 5) == ("blocked" if jax.default_backend() == "cpu" else "ragged")
    assert not any(DISPATCHES[auto_moe(CFG, t)].drops for t in (1, 5, 1000))
    assert sorted([*DISPATCHES, "auto"]) == sorted(MOE_DISPATCHES)  # the config's names


def test_capacity_slots_formula():
    assert capacity(64, CFG, 1.25) == 20  # ceil(1.25 * 64 * 2 / 8)
    assert capacity(63, CFG, 1.25) == 20  # ceil(19.69)
    assert capacity(2, CFG, 100.0) == 2  # at most T


def test_router_aux_losses_closed_form_for_uniform_router():
    t, e = 32, 8
    logits = jnp.zeros((t, e))
    experts = jnp.stack([jnp.arange(t) % e, (jnp.arange(t) + 1) % e], axis=1)
    lb, z, load = router_aux(Routing(logits, experts, jnp.full((t, 2), 0.5)), e)
    assert float(lb) == pytest.approx(1.0)  # balanced: E * sum_e (1/E)(1/E) * E ... = 1
    assert float(z) == pytest.approx(np.log(e) ** 2, rel=1e-6)
    np.testing.assert_allclose(load, 1 / e)


def test_load_balancing_loss_grows_when_routing_collapses():
    t, e = 32, 8
    logits = jnp.zeros((t, e)).at[:, 0].set(5.0).at[:, 1].set(4.0)
    experts = jnp.broadcast_to(jnp.array([0, 1]), (t, 2))
    lb, _, load = router_aux(Routing(logits, experts, jnp.full((t, 2), 0.5)), e)
    p = np.exp([5.0, 4.0] + [0.0] * 6)
    p /= p.sum()
    assert float(lb) == pytest.approx(e * (0.5 * p[0] + 0.5 * p[1]), rel=1e-5)
    assert float(lb) > 1.0
    np.testing.assert_allclose(load, [0.5, 0.5] + [0.0] * 6)


def _numpy_swiglu_grad(h, g, limit):
    """d/dh of sum(g * swiglu(h)), by hand: torch's clamp passes the gradient inside its
    bounds, bounds included."""
    glu_in, lin_in = h[..., 0::2], h[..., 1::2]
    glu, lin = np.minimum(glu_in, limit), np.clip(lin_in, -limit, limit)
    sig = 1 / (1 + np.exp(-1.702 * glu))
    dh = np.empty_like(h)
    dh[..., 0::2] = g * (lin + 1) * (sig + 1.702 * glu * sig * (1 - sig)) * (glu_in <= limit)
    dh[..., 1::2] = g * glu * sig * (np.abs(lin_in) <= limit)
    return dh


@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2.0 ** -7)])
def test_swiglu_gradient_matches_closed_form_across_the_clamps(dtype, rtol):
    limit = 7.0
    rng = np.random.default_rng(0)
    h = rng.normal(size=(5, 3, 64)) * 6  # many pre-activations past +-7 on both halves
    h[0, 0, :4] = [limit, limit, -3.0, -limit]  # on the bounds: glu = 7, lin = 7 and -7
    g = rng.normal(size=(5, 3, 32))
    hj, gj = jnp.asarray(h, dtype), jnp.asarray(g, dtype)
    y, vjp = jax.vjp(lambda h: swiglu(h, limit), hj)
    (dh,) = vjp(gj)
    assert y.dtype == dh.dtype == dtype
    h64, g64 = (np.asarray(x.astype(jnp.float32), np.float64) for x in (hj, gj))
    glu, lin = np.minimum(h64[..., 0::2], limit), np.clip(h64[..., 1::2], -limit, limit)
    y_ref = glu / (1 + np.exp(-1.702 * glu)) * (lin + 1)
    atol = rtol * np.abs(y_ref).max()
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), y_ref, rtol=rtol, atol=atol)
    dh_ref = _numpy_swiglu_grad(h64, g64, limit)
    np.testing.assert_allclose(np.asarray(dh.astype(jnp.float32)), dh_ref, rtol=rtol,
                               atol=rtol * np.abs(dh_ref).max())
    assert (np.asarray(dh, np.float32)[h64 > limit] == 0).all()  # both halves clamped above


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_expert_rows_is_the_gather_exactly_and_its_gradient_the_segment_sum(dtype):
    from llm_jax.model.experts import expert_rows

    rng = np.random.default_rng(3)
    table = jnp.asarray(rng.normal(size=(5, 7)) * 1e3, dtype)  # large and small, all bits kept
    table = table.at[1].set(jnp.asarray(rng.normal(size=7) * 1e-6, dtype))
    experts = jnp.asarray(rng.integers(0, 5, size=40), jnp.int32)
    y, vjp = jax.vjp(lambda t: expert_rows(t, experts), table)
    assert y.dtype == dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(table[experts], np.float32))
    g = jnp.asarray(rng.normal(size=(40, 7)), dtype)
    want = np.zeros((5, 7))
    np.add.at(want, np.asarray(experts), np.asarray(g, np.float64))
    np.testing.assert_allclose(np.asarray(vjp(g)[0], np.float32), want,
                               rtol=1e-6 if dtype == jnp.float32 else 1e-2, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("blocks", [1, 2])
def test_blocked_swiglu_equals_the_interleaved_one_bitwise(dtype, blocks):
    """Gate-up columns reordered to [glu | linear] within each of `blocks` tensor shards by
    `blocked_halves`, then `swiglu(blocked=True)` on each shard: the same values and the same
    gradient as the interleaved SwiGLU, bit for bit (both reorderings only move values; the
    gradients are the same per-element expressions)."""
    from llm_jax.model.experts import blocked_halves

    limit = 7.0
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(size=(6, 48)) * 6, dtype)
    h = h.at[0, :4].set(jnp.asarray([limit, limit, -3.0, -limit], dtype))  # on the bounds
    g = jnp.asarray(rng.normal(size=(6, 24)), dtype)
    hb = blocked_halves(h, blocks)
    w = 48 // blocks
    np.testing.assert_array_equal(np.asarray(hb[:, w - w // 2:w], np.float32),  # a linear half
                                  np.asarray(h[:, 1:w:2], np.float32)[:, -(w // 2):])

    def blocked(h):  # each shard's SwiGLU, as each device of the tensor axis computes it
        parts = jnp.split(blocked_halves(h, blocks), blocks, axis=-1)
        return jnp.concatenate([swiglu(p, limit, True) for p in parts], -1)

    y_ref, vjp_ref = jax.vjp(lambda h: swiglu(h, limit), h)
    y, vjp = jax.vjp(blocked, h)
    assert y.dtype == dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(vjp(g)[0], np.float32),
                                  np.asarray(vjp_ref(g)[0], np.float32))


def test_take_rows_of_a_permutation_matches_indexing_in_value_and_gradient():
    from llm_jax.model.experts import inverse_permutation, take_rows

    x = jax.random.normal(jax.random.key(0), (7, 3))
    order = jax.random.permutation(jax.random.key(1), 7)
    inv = inverse_permutation(order)
    np.testing.assert_array_equal(np.asarray(inv[order]), np.arange(7))
    w = jax.random.normal(jax.random.key(2), (7, 3))
    f = lambda x: jnp.sum(w * take_rows(x, order, inv) ** 2)  # noqa: E731
    ref = lambda x: jnp.sum(w * x[order] ** 2)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(take_rows(x, order, inv)), np.asarray(x[order]))
    np.testing.assert_allclose(np.asarray(jax.grad(f)(x)), np.asarray(jax.grad(ref)(x)),
                               rtol=1e-6)


@pytest.mark.parametrize("repeats", [1, 3])
def test_take_rows_with_repeats_empty_and_dropped_rows_against_numpy(repeats):
    """The send buffer's map: T tokens each repeated k times, some repeated rows dropped (no
    slot), some slots empty (index past the end). Value and gradient against NumPy: the
    gradient of x is the sum over each token's kept repeats of its slots' cotangents."""
    from llm_jax.model.experts import take_rows

    rng = np.random.default_rng(repeats)
    t, d, slots = 6, 4, 20
    a = t * repeats
    kept = rng.permutation(a)[: a - 2]  # two repeated rows dropped
    slot_of = np.full(a, slots)  # past the end: dropped
    slot_of[kept] = rng.choice(slots, size=kept.size, replace=False)
    index = np.full(slots, a)  # past the end: empty slot
    index[slot_of[kept]] = kept
    x = rng.standard_normal((t, d)).astype(np.float32)
    g = rng.standard_normal((slots, d)).astype(np.float32)
    y_ref = np.where((index < a)[:, None], np.repeat(x, repeats, 0)[np.minimum(index, a - 1)], 0)
    gx_ref = np.zeros((a, d), np.float32)
    gx_ref[kept] = g[slot_of[kept]]
    gx_ref = gx_ref.reshape(t, repeats, d).sum(1)
    fn = lambda x: take_rows(x, jnp.asarray(index), jnp.asarray(slot_of), repeats)  # noqa: E731
    y, vjp = jax.vjp(fn, jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(y), y_ref)
    np.testing.assert_allclose(np.asarray(vjp(jnp.asarray(g))[0]), gx_ref, rtol=1e-6, atol=1e-6)
    # and the way back: the slots' rows to the repeated rows, the transpose of the map above
    back = lambda ys: take_rows(ys, jnp.asarray(slot_of), jnp.asarray(index))  # noqa: E731
    z, vjp_back = jax.vjp(back, jnp.asarray(g))
    z_ref = np.where((slot_of < slots)[:, None], g[np.minimum(slot_of, slots - 1)], 0)
    np.testing.assert_array_equal(np.asarray(z), z_ref)
    h = rng.standard_normal((a, d)).astype(np.float32)
    gs_ref = np.where((index < a)[:, None], h[np.minimum(index, a - 1)], 0)
    np.testing.assert_array_equal(np.asarray(vjp_back(jnp.asarray(h))[0]), gs_ref)


