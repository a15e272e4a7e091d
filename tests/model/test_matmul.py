"""model/matmul.einsum against float64 NumPy products of the same inputs: float32 operands are
jnp.einsum itself; bfloat16 operands are rounded once from a float32 accumulation, forward and
backward, and on CPU a plain-layout product runs bfloat16 x bfloat16 -> float32 throughout."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from llm_jax.model.matmul import einsum, plain_layout

# (spec, lhs shape, rhs shape): plain layouts and ones that are not, as the model uses them
SPECS = [("TD,DF->TF", (64, 32), (32, 48)),
         ("ECD,EDF->ECF", (3, 16, 8), (3, 8, 24)),
         ("BTD,DNH->BTNH", (2, 6, 16), (16, 4, 8)),
         ("BTNH,NHD->BTD", (2, 6, 4, 8), (4, 8, 16)),
         ("BTKGH,BSKH->BKGTS", (2, 5, 2, 3, 8), (2, 7, 2, 8)),
         ("TD,EDF->TEF", (9, 8), (3, 8, 12)),
         ("TkD,Tk->TD", (9, 2, 8), (9, 2))]

BF16_ULP = 2.0 ** -8  # relative spacing of bfloat16 (8 bits of mantissa)


def _inputs(shape_a, shape_b, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(shape_a), dtype),
            jnp.asarray(rng.standard_normal(shape_b), dtype))


def _f64(x):
    return np.asarray(x.astype(jnp.float32), np.float64)


def _close_to_one_rounding(ours, ref):
    """Within one bfloat16 rounding of the exact value, plus float32 accumulation error."""
    np.testing.assert_allclose(_f64(ours), ref, rtol=BF16_ULP, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("spec,shape_a,shape_b", SPECS)
def test_float32_is_jnp_einsum_in_value_and_gradient(spec, shape_a, shape_b):
    a, b = _inputs(shape_a, shape_b, jnp.float32)
    loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(spec, a, b)))  # noqa: E731
    np.testing.assert_array_equal(einsum(spec, a, b), jnp.einsum(spec, a, b))
    for ours, ref in zip(jax.grad(loss(einsum), (0, 1))(a, b),
                         jax.grad(loss(jnp.einsum), (0, 1))(a, b)):
        np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("spec,shape_a,shape_b", SPECS)
def test_bfloat16_values_and_gradients_match_float64_reference(spec, shape_a, shape_b):
    a, b = _inputs(shape_a, shape_b, jnp.bfloat16)
    out, vjp = jax.jit(lambda a, b: jax.vjp(lambda a, b: einsum(spec, a, b), a, b))(a, b)
    assert out.dtype == jnp.bfloat16
    _close_to_one_rounding(out, np.einsum(spec, _f64(a), _f64(b)))
    g = jnp.asarray(np.random.default_rng(1).standard_normal(out.shape), jnp.bfloat16)
    da, db = jax.jit(vjp)(g)
    assert da.dtype == db.dtype == jnp.bfloat16
    sa, sb, so = spec.replace("->", ",").split(",")
    _close_to_one_rounding(da, np.einsum(f"{so},{sb}->{sa}", _f64(g), _f64(b)))
    _close_to_one_rounding(db, np.einsum(f"{so},{sa}->{sb}", _f64(g), _f64(a)))


def test_bias_is_added_in_float32_before_the_one_rounding():
    a, b = _inputs((64, 32), (32, 48), jnp.bfloat16)
    bias = jnp.asarray(np.random.default_rng(2).standard_normal(48), jnp.float32)
    out, vjp = jax.vjp(lambda a, b, c: einsum("TD,DF->TF", a, b, c), a, b, bias)
    assert out.dtype == jnp.bfloat16
    _close_to_one_rounding(out, _f64(a) @ _f64(b) + np.asarray(bias, np.float64))
    g = jnp.ones(out.shape, jnp.bfloat16)
    dbias = vjp(g)[2]
    assert dbias.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(dbias), np.full(48, 64.0))


def test_bfloat16_with_float32_result_is_not_rounded():
    a, b = _inputs((64, 32), (32, 48), jnp.bfloat16)
    out = einsum("TD,DF->TF", a, b, preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float64), _f64(a) @ _f64(b), rtol=1e-5,
                               atol=1e-5)


def _dots(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _dots(sub)


def test_bfloat16_on_cpu_never_emits_a_mixed_dot_off_the_plain_layout():
    """XLA:CPU runs bfloat16 x bfloat16 -> float32 only through YNNPACK, which takes the plain
    layout: the forward and d lhs of 'TD,DF->TF' use it; d rhs (contracting T) and every
    product of a spec off that layout get float32 operands or a bfloat16 result instead."""
    for spec, shape_a, shape_b in SPECS:
        a, b = _inputs(shape_a, shape_b, jnp.bfloat16)
        loss = lambda a, b, spec=spec: jnp.sum(  # noqa: E731
            jnp.tanh(einsum(spec, a, b)).astype(jnp.float32))
        for eqn in _dots(jax.make_jaxpr(jax.grad(loss, (0, 1)))(a, b).jaxpr):
            ins = [v.aval.dtype for v in eqn.invars]
            mixed = ins == [jnp.bfloat16] * 2 and eqn.params["preferred_element_type"] == jnp.float32
            if mixed:
                (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
                a_nd, b_nd = (v.aval.ndim for v in eqn.invars)
                # plain: batch leading, lhs contracting last, rhs contracting right after batch
                # or last
                assert list(lb) == list(range(len(lb))) == list(rb), spec
                assert sorted(lc) == list(range(a_nd - len(lc), a_nd)), spec
                assert sorted(rc) in (list(range(len(rb), len(rb) + len(rc))),
                                      list(range(b_nd - len(rc), b_nd))), spec
    a, b = _inputs((64, 32), (32, 48), jnp.bfloat16)
    loss = lambda a, b: jnp.sum(einsum("TD,DF->TF", a, b).astype(jnp.float32))  # noqa: E731
    kinds = [(tuple(v.aval.dtype for v in e.invars), e.params["preferred_element_type"])
             for e in _dots(jax.make_jaxpr(jax.grad(loss, (0, 1)))(a, b).jaxpr)]
    assert kinds.count(((jnp.bfloat16, jnp.bfloat16), jnp.float32)) == 2  # forward and d lhs


@pytest.mark.parametrize("spec,plain", [("TD,DF->TF", True), ("TF,DF->TD", True),
                                        ("ECD,EDF->ECF", True), ("BTD,DNH->BTNH", True),
                                        ("TD,TF->DF", False), ("TD,EDF->TEF", False),
                                        ("BTKGH,BSKH->BKGTS", False), ("BSH,BTH->BST", True)])
def test_plain_layout(spec, plain):
    assert plain_layout(spec) is plain


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_bfloat16_on_accelerators_runs_every_product_in_bfloat16(platform):
    """Off CPU every product of the forward and backward is bfloat16 x bfloat16 -> float32,
    whatever the layout: never a float32 matmul from an upcast cotangent."""
    from llm_jax.runtime.backend import compiling_for

    for spec, shape_a, shape_b in SPECS:
        a, b = _inputs(shape_a, shape_b, jnp.bfloat16)
        bias = jnp.zeros(np.einsum(spec, np.zeros(shape_a), np.zeros(shape_b)).shape[-1:])
        loss = lambda a, b, spec=spec: jnp.sum(  # noqa: E731
            einsum(spec, a, b, bias).astype(jnp.float32))
        with compiling_for(platform):
            jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(a, b)
        found = list(_dots(jaxpr.jaxpr))
        assert len(found) == 3, spec
        for eqn in found:
            assert [v.aval.dtype for v in eqn.invars] == [jnp.bfloat16] * 2, spec
            assert eqn.params["preferred_element_type"] == jnp.float32, spec
