"""The model's einsum: float32 accumulation, bfloat16 operands kept as they are.

`jnp.einsum` on two bfloat16 arrays returns bfloat16, and XLA:CPU lowers that dot as converts
to float32 around a float32 matmul. The same operands asking for a float32 result run YNNPACK's
bfloat16 kernel instead, about 1.8x the float32 matmul's rate on an AVX2 CPU (docs/benchmarks.md),
with the same numbers: products of bfloat16 are exact in float32, and both accumulate in
float32 before the one rounding to bfloat16. JAX's own gradient of such a dot would multiply a
float32 cotangent by a bfloat16 operand: the slow path on CPU, and a float32 matmul on GPU. So
`einsum` gives it a VJP whose two products are bfloat16 x bfloat16 -> float32 as well, which
is what MXUs and tensor cores run for bfloat16 anyway.

XLA:CPU runs a bfloat16 x bfloat16 -> float32 dot only through YNNPACK; its fallback
(`DotThunk`) refuses the mixed types at run time. So on CPU the fast form is used only for a
product in the plain layout YNNPACK takes, (batch..., M..., K...) x (batch..., K... or N...,
...) -> (batch..., M..., N...); any other (a weight gradient contracting the leading tokens
axis, batch axes not leading) gets float32 operands, as XLA:CPU would have given it.
Float32 operands (the default compute dtype) take plain `jnp.einsum`: nothing changes there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from llm_jax.runtime.backend import plan  # the platform traced for (AOT targets included)


def _spec(spec: str) -> tuple[str, str, str]:
    ins, out = spec.replace(" ", "").split("->")
    a, b = ins.split(",")
    return a, b, out


def plain_layout(spec: str) -> bool:
    """Whether `spec` is a batched matmul with batch axes leading everywhere, the lhs
    (batch, M, K), the rhs (batch, K, N) or (batch, N, K) and the output (batch, M, N)."""
    sa, sb, so = _spec(spec)
    batch = "".join(c for c in sa if c in sb and c in so)
    contract = "".join(c for c in sa if c in sb and c not in so)
    m = "".join(c for c in sa if c not in sb)
    n = "".join(c for c in sb if c not in sa)
    k_in_b = "".join(c for c in sb if c in contract)
    return (bool(contract) and set(k_in_b) == set(contract) and sa == batch + m + contract
            and so == batch + m + n and sb in (batch + k_in_b + n, batch + n + k_in_b))


def _product(spec: str, a: jax.Array, b: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    """One bfloat16 product accumulated in float32, in a form the backend runs."""
    if plan().float32_transposed_products and not plain_layout(spec):
        f32 = jnp.float32
        return jnp.einsum(spec, a.astype(f32), b.astype(f32)).astype(out_dtype)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _low_precision(spec: str, a: jax.Array, b: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    return _product(spec, a, b, out_dtype)


def _fwd(spec, a, b, out_dtype):
    return _low_precision(spec, a, b, out_dtype), (a, b)


def _bwd(spec, out_dtype, res, g):
    a, b = res
    sa, sb, so = _spec(spec)
    g = g.astype(a.dtype)  # the cotangent in the operands' precision, as autocast keeps it
    return (_product(f"{so},{sb}->{sa}", g, b, a.dtype),
            _product(f"{so},{sa}->{sb}", g, a, b.dtype))


_low_precision.defvjp(_fwd, _bwd)


def einsum(spec: str, a: jax.Array, b: jax.Array, bias: jax.Array | None = None, *,
           preferred_element_type: jnp.dtype | None = None) -> jax.Array:
    """`jnp.einsum(spec, a, b) + bias` accumulated in float32, the bias added in float32 before
    the one rounding to `preferred_element_type` (default: the operands' dtype). Two operands,
    explicit output, no index on one operand alone."""
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(a, b))
    acc_dtype = jnp.dtype(jnp.float32) if bias is not None else out_dtype
    if a.dtype == b.dtype == jnp.bfloat16:
        sa, sb, so = _spec(spec)
        if not set(sa) <= set(sb) | set(so) or not set(sb) <= set(sa) | set(so) \
                or len(set(sa)) < len(sa) or len(set(sb)) < len(sb) or "." in spec:
            raise ValueError(f"einsum spec {spec!r}: expected two operands without ellipsis, "
                             "repeated or single-operand indices")
        y = _low_precision(spec, a, b, acc_dtype)
    else:
        y = jnp.einsum(spec, a, b, preferred_element_type=acc_dtype)
    if bias is None:
        return y
    # the bias's gradient is then a float32 sum too (XLA:CPU sums bfloat16 in slow reduce-windows)
    return (y + bias.astype(acc_dtype)).astype(out_dtype)
