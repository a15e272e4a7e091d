"""The GPU grouped matmul (Pallas, interpret mode on CPU) against `lax.ragged_dot`: outputs and
gradients within 1e-5 in float32 on O(1) values; through the MoE layer against `moe_ragged`;
and lowered for CUDA, the Triton kernels it holds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.kernels.gmm_gpu import gmm
from llm_jax.model.experts import ExpertWeights
from llm_jax.model.moe import route
from llm_jax.model.moe_dispatch import moe_ragged
from llm_jax.model.moe_parallel import moe_gmm
from llm_jax.parallel.roofline import triton_kernels_for_cuda
from llm_jax.runtime.backend import compiling_for

TOL = 1e-5


def _case(m, k, n, sizes, seed=0, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.normal(size=(m, k)) / np.sqrt(k), dtype)
    w = jnp.asarray(r.normal(size=(len(sizes), k, n)), dtype)
    return x, w, jnp.asarray(sizes, jnp.int32), jnp.asarray(r.normal(size=(m, n)), dtype)


# (M, K, N): [group sizes, ...], each shape one compiled program (the sizes are its argument):
# groups straddling the row tiles, empty groups (first, middle, last), rows past sum(sizes)
# (zero, as ragged_dot), K and N that no power-of-two tile divides (zero-padded); no rows at
# all; one group holding every row, K and N whole tiles.
CASES = [
    ((200, 96, 40), [[0, 63, 0, 64, 65, 1, 0], [0, 0, 0, 0, 0, 0, 0]]),
    ((130, 64, 64), [[130, 0]]),
]


@pytest.mark.parametrize("shape,all_sizes", CASES)
def test_matches_ragged_dot(shape, all_sizes):
    run = jax.jit(lambda a, b, gs: jax.vjp(lambda a, b: gmm(a, b, gs, interpret=True), a, b))
    for sizes in all_sizes:
        x, w, gs, dout = _case(*shape, sizes)
        want, pull = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, gs), x, w)
        got, pull_got = run(x, w, gs)
        for name, a, g in zip(("out", "dlhs", "drhs"), (want, *pull(dout)),
                              (got, *pull_got(dout))):
            assert a.shape == g.shape and a.dtype == g.dtype, (sizes, name)
            err = float(jnp.max(jnp.abs(a - g)))
            assert err < TOL * max(1.0, float(jnp.max(jnp.abs(a)))), (sizes, name, err)


def test_bfloat16_accumulates_in_float32():
    x, w, gs, _ = _case(64, 128, 32, [40, 24], dtype=jnp.bfloat16)
    got = gmm(x, w, gs, interpret=True)
    want = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), gs)
    assert got.dtype == jnp.bfloat16
    assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - want))) < 0.05  # bf16 rounding


def test_shape_errors_name_the_operands():
    x, w, gs, _ = _case(16, 16, 16, [8, 8])
    with pytest.raises(ValueError, match="lhs"):
        gmm(x[:, :8], w, gs)
    with pytest.raises(ValueError, match="group_sizes"):
        gmm(x, w, gs[:1])


def _layer(t=40, d=32, f=16, e=4, k=2, seed=0):
    r = np.random.default_rng(seed)
    a = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)  # noqa: E731
    x = a(t, d)
    w = ExpertWeights(a(e, d, 2 * f) / np.sqrt(d), a(e, 2 * f), a(e, f, d) / np.sqrt(f), a(e, d))
    return x, route(x, a(d, e), a(e), k), w


def test_moe_layer_with_the_triton_kernel_matches_ragged():
    x, routing, w = _layer()
    ct = jax.random.normal(jax.random.key(1), x.shape)

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, routing, w, 7.0) * ct)

    triton = lambda *a: moe_gmm(*a, kernel="triton", interpret=True)  # noqa: E731
    (l_ref, g_ref) = jax.jit(jax.value_and_grad(loss(moe_ragged), (0, 1)))(x, w)
    (l, g) = jax.jit(jax.value_and_grad(loss(triton), (0, 1)))(x, w)
    np.testing.assert_allclose(l, l_ref, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_lowers_to_triton_for_cuda():
    """No GPU needed: Pallas emits Triton IR itself. Forward one kernel; with gradients three
    (forward, d lhs against the transposed rhs, d rhs)."""
    sds = jax.ShapeDtypeStruct
    args = (sds((1000, 2880), jnp.bfloat16), sds((32, 2880, 5760), jnp.bfloat16),
            sds((32,), jnp.int32))

    def loss(a, b, s):
        return gmm(a, b, s).astype(jnp.float32).sum()

    assert triton_kernels_for_cuda(loss, *args) == {"gmm_gpu": 1}
    # value_and_grad: the loss's value keeps the forward kernel live (jax >= 0.11 drops a
    # forward whose output only `grad` would have discarded).
    assert triton_kernels_for_cuda(jax.value_and_grad(loss, (0, 1)), *args) == {
        "gmm_gpu": 2, "tgmm_gpu": 1}


def test_gmm_dispatch_traced_for_gpu_runs_the_triton_kernel():
    """`moe_dispatch="gmm"` on GPU: gate-up and down each one kernel forward, three backward."""
    from llm_jax.model.moe_dispatch import DISPATCHES

    x, routing, w = _layer()
    def loss(x, w):
        return jnp.sum(DISPATCHES["gmm"].fn(x, routing, w, ModelConfig(), ExecutionConfig())[0])

    with compiling_for("gpu"):
        assert triton_kernels_for_cuda(jax.value_and_grad(loss, (0, 1)), x, w) == {
            "gmm_gpu": 4, "tgmm_gpu": 2}
