"""What every MoE dispatch shares: the router's outputs, the experts' weights, the clamped SwiGLU
between their two matmuls, and the one sort of assignments by expert and the weighted combine
back to tokens. Below the dispatches in model/ (of model/ it imports only `matmul.py` and
`mxfp4.py`): the dispatches (`moe_dispatch.py`, `moe_parallel.py`) import it, and the kernels
(`kernels/`) see only the arrays.

Shapes: T tokens, D hidden, E experts, k experts per token, F intermediate, A = T k assignments
in (token, choice) order: assignment a is token a // k's choice a % k.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from llm_jax.config import SWIGLU_ALPHA
from llm_jax.model.matmul import einsum
from llm_jax.model.mxfp4 import ExpertStack, PackedExperts, dense

P = jax.sharding.PartitionSpec


class Routing(NamedTuple):
    """Router outputs for T tokens."""

    logits_TE: jax.Array  # float32 router logits
    experts_Tk: jax.Array  # int32 chosen expert ids, best first
    weights_Tk: jax.Array  # float32 softmax over the chosen logits


class ExpertWeights(NamedTuple):
    """The experts' weights in compute dtype; either stack may be packed MXFP4
    (`PackedExperts`: index it like the array, `dense` it where it is multiplied)."""

    gate_up_EDF2: ExpertStack
    gate_up_bias_EF2: jax.Array
    down_EFD: ExpertStack
    down_bias_ED: jax.Array

    def unpacked(self) -> ExpertWeights:
        """Both stacks dense: for the dispatches that multiply every expert at once."""
        return self._replace(gate_up_EDF2=dense(self.gate_up_EDF2), down_EFD=dense(self.down_EFD))


def stack_spec(w: ExpertStack, spec: tuple) -> Any:
    """The shard_map spec of an expert stack whose dense [E, I, O] form has `spec` = (e, i, o):
    for a packed one, a `PackedExperts` of specs for its blocks (e, i, -, o), scales (e, i, o)
    and adapter (e, i, -), (e, -, o)."""
    e, i, o = spec
    if not isinstance(w, PackedExperts):
        return P(e, i, o)
    lora = w.lora_a is not None
    return dataclasses.replace(w, blocks=P(e, i, None, o), scales=P(e, i, o),
                               lora_a=P(e, i, None) if lora else None,
                               lora_b=P(e, None, o) if lora else None)


def expert_einsum(spec: str, x: jax.Array, w: ExpertStack, bias: jax.Array | None = None
                  ) -> jax.Array:
    """`einsum(spec, x, w, bias)` with an expert stack `w` ([..., I, O], the last two letters of
    its spec) that may be packed. A packed stack's adapter is the low-rank side path
    `scale (x A) B` in float32 beside the unpacked base, never added into the unpacked weights:
    with B = 0 (step 0) it adds exact zeros to the base's product, and no [..., I, O] delta (nor
    its gradient) is formed per expert or per assignment. (The grouped-matmul dispatches take
    one weight instead: `dense` adds the adapter into what they unpack.)"""
    if not isinstance(w, PackedExperts) or w.lora_a is None:
        return einsum(spec, x, dense(w), bias)
    sx, rest = spec.replace(" ", "").split(",")
    sw, so = rest.split("->")
    r = next(c for c in "rqpzyxwv" if c not in spec)
    out = sw[-1]
    y = einsum(spec, x, w.frozen().unpacked(), bias, preferred_element_type=jnp.float32)
    f32 = jnp.float32
    xa = jnp.einsum(f"{sx},{sw[:-1]}{r}->{so.replace(out, r)}", x.astype(f32),
                    w.lora_a.astype(f32))
    side = jnp.einsum(f"{so.replace(out, r)},{sw[:-2]}{r}{out}->{so}", xa, w.lora_b.astype(f32))
    return (y + w.lora_scale * side).astype(jnp.result_type(x.dtype, w.dtype))


def _halves(h: jax.Array, blocked: bool) -> tuple[jax.Array, jax.Array]:
    """(glu, linear) pre-activations: interleaved columns (the checkpoint's layout), or with
    `blocked` the two contiguous halves [glu | linear] (`blocked_halves`)."""
    if blocked:
        f = h.shape[-1] // 2
        return h[..., :f], h[..., f:]
    return h[..., 0::2], h[..., 1::2]


def _clamped(h: jax.Array, limit: float, blocked: bool
             ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(glu input, linear input, clamped glu, clamped linear), in float32. The halves are taken
    in h's dtype and then widened (the same values): XLA:TPU materialises a strided lane slice,
    and in bfloat16 it is half the bytes."""
    glu_in, lin_in = (x.astype(jnp.float32) for x in _halves(h, blocked))
    return glu_in, lin_in, jnp.minimum(glu_in, limit), jnp.clip(lin_in, -limit, limit)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def swiglu(h: jax.Array, limit: float, blocked: bool = False) -> jax.Array:
    """gpt-oss clamped SwiGLU on [..., 2F] pre-activations -> [..., F] in h's dtype:
    `glu * sigmoid(1.702 glu) * (lin + 1)`, glu = min(h[0::2], limit), lin = clip(h[1::2]);
    with `blocked`, glu = h[:F] and lin = h[F:] (the gate-up columns put in that order by
    `blocked_halves`).

    Computed in float32, as the norms and RoPE are (one rounding for bfloat16). The gradient is
    written out: JAX's own scatters the two strided halves back with two pads and an add, which
    XLA:CPU ran ~6x slower than this one interleaving stack in a microbenchmark (in the whole
    step the difference is within the noise). The clamps pass the gradient
    where the input is within them, bounds included, as torch's clamp does."""
    _, _, glu, lin = _clamped(h, limit, blocked)
    return (glu * jax.nn.sigmoid(SWIGLU_ALPHA * glu) * (lin + 1.0)).astype(h.dtype)


def _swiglu_fwd(h, limit, blocked):
    return swiglu(h, limit, blocked), h


def _swiglu_bwd(limit, blocked, h, g):
    glu_in, lin_in, glu, lin = _clamped(h, limit, blocked)
    g = g.astype(jnp.float32)
    sig = jax.nn.sigmoid(SWIGLU_ALPHA * glu)
    dglu = g * (lin + 1.0) * sig * (1.0 + SWIGLU_ALPHA * glu * (1.0 - sig)) * (glu_in <= limit)
    dlin = g * glu * sig * (jnp.abs(lin_in) <= limit)
    # rounded before joining (the same values): the joined copy is in h's dtype
    halves = dglu.astype(h.dtype), dlin.astype(h.dtype)
    return (jnp.concatenate(halves, -1) if blocked else _interleave(*halves),)


def _interleave(a: jax.Array, b: jax.Array) -> jax.Array:
    """[..., F], [..., F] -> [..., 2F] with a in the even columns, b in the odd ones."""
    return jnp.stack([a, b], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def blocked_halves(w: jax.Array, blocks: int = 1) -> jax.Array:
    """Interleaved gate-up columns [..., 2F] (glu, linear, glu, ...) -> [glu | linear] within
    each of `blocks` contiguous blocks of columns (the `tensor` shards of F, so each device's
    slice stays its own glu and linear halves), for `swiglu(..., blocked=True)`. The gradient
    interleaves back."""
    return _per_block(w, blocks, lambda x: jnp.concatenate(_halves(x, blocked=False), -1))


def _per_block(w: jax.Array, blocks: int, fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
    x = w.reshape(*w.shape[:-1], blocks, w.shape[-1] // blocks)
    return fn(x).reshape(w.shape)


def _blocked_halves_fwd(w, blocks):
    return blocked_halves(w, blocks), None


def _blocked_halves_bwd(blocks, _, g):
    return (_per_block(g, blocks, lambda x: _interleave(*_halves(x, blocked=True))),)


blocked_halves.defvjp(_blocked_halves_fwd, _blocked_halves_bwd)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class Sorted(NamedTuple):
    """Assignments sorted by expert (stable: token order within an expert)."""

    order_A: jax.Array  # int32 position in (token, choice) order of each sorted assignment
    inverse_A: jax.Array  # int32 sorted position of each assignment in (token, choice) order
    experts_A: jax.Array  # int32 expert of each sorted assignment
    group_sizes_E: jax.Array  # int32 assignments per expert

    def rows(self, x_TD: jax.Array) -> jax.Array:
        """Each assignment's token row, in sorted order: [T, D] -> [T k, D]."""
        k = self.order_A.shape[0] // x_TD.shape[0]
        return take_rows(x_TD, self.order_A, self.inverse_A, k)

    def unsort(self, y_AD: jax.Array) -> jax.Array:
        """Rows in sorted order back to (token, choice) order."""
        return take_rows(y_AD, self.inverse_A, self.order_A)


def sort_by_expert(experts_Tk: jax.Array, num_experts: int) -> Sorted:
    """The expert-major order of the T k assignments, and each expert's group size."""
    experts_A = experts_Tk.reshape(-1)
    order_A = jnp.argsort(experts_A, stable=True)
    return Sorted(order_A, inverse_permutation(order_A), experts_A[order_A],
                  jnp.bincount(experts_A, length=num_experts).astype(jnp.int32))


def inverse_permutation(order: jax.Array) -> jax.Array:
    """inv with inv[order[i]] = i: a scatter of int32 indices, not of rows."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def take_rows(x: jax.Array, index: jax.Array, inverse: jax.Array, repeats: int = 1) -> jax.Array:
    """Rows `index` of x with each row repeated `repeats` times (row r of the repeated array is
    x[r // repeats]); an index past the end gives a zero row. `index` must not take a repeated
    row twice, and `inverse` is its inverse: inverse[r] = the position in `index` of repeated
    row r, or past the end where none takes it.

    Every move of rows in the ragged, gmm and expert_parallel* dispatches is one of
    these (blocked, capacity and gather index rows directly): sorting assignments by expert
    (x = tokens, repeats = k), packing them into the send buffer (empty slots past the end),
    the combine's way back (dropped assignments past the end). The gradient is the gather
    g[inverse] summed over each row's repeats: neither direction scatters rows. XLA:TPU lowers
    a row scatter of bfloat16 through 32-bit copies of the whole buffer ([R, D] u32), and a
    gather's own transpose is a scatter-add."""
    return _take(x, index, repeats)


def _take(x, index, repeats):
    return jnp.take(x, index // repeats, axis=0, mode="fill", fill_value=0)


def _take_rows_fwd(x, index, inverse, repeats):
    return _take(x, index, repeats), (index, inverse)


def _take_rows_bwd(repeats, res, g):
    index, inverse = res
    g_x = jnp.take(g, inverse, axis=0, mode="fill", fill_value=0)
    if repeats > 1:
        g_x = g_x.reshape(-1, repeats, *g_x.shape[1:]).sum(1, dtype=jnp.float32).astype(g.dtype)
    return g_x, None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def expert_rows(table_E: jax.Array, experts_R: jax.Array) -> jax.Array:
    """table_E[experts_R] (each row's expert bias) as a one-hot product, exact: one product by
    1 per output, summed with zeros in float32 (HIGHEST: a float32 table is not rounded to
    bfloat16 passes on TPU). XLA:TPU materialises a row gather as its own [R, F] buffer before
    the add that reads it, and transposes it into a scatter-add; a product fuses the add into
    its output and its gradient is a product too (one-hot^T g): for the [40,960, 5,760] gate-up
    pre-activations of gpt-oss-20b at 8k tokens per chip, one [R, F] write and read less a layer
    and pass."""
    onehot = jax.nn.one_hot(experts_R, table_E.shape[0], dtype=table_E.dtype)
    return jnp.einsum("RE,E...->R...", onehot, table_E, precision=jax.lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32).astype(table_E.dtype)


def combine(y_TkD: jax.Array, weights_Tk: jax.Array) -> jax.Array:
    """`y_t = sum_k w_tk y_tk`: each token's expert outputs weighted by its router weights."""
    return einsum("TkD,Tk->TD", y_TkD, weights_Tk.astype(y_TkD.dtype))
