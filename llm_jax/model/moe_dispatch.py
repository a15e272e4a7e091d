"""How tokens reach their experts: every MoE dispatch, behind one table.

Shapes: T tokens (batch and time flattened), D hidden, E experts, k experts per token,
F intermediate, C capacity slots per expert, A = T k token-expert assignments, G row blocks.

All dispatches compute the same function, `y_t = sum_{e in top_k(t)} w_te * expert_e(x_t)`, and
differ in how they lay out the work:

| name                | drop | what it runs                                                        |
|---------------------|------|---------------------------------------------------------------------|
| dense               | no   | every expert on every token, masked combine: the reference          |
| ragged              | no   | assignments sorted by expert, `lax.ragged_dot` grouped matmuls      |
| gather              | no   | each token multiplies by its own k experts' gathered weights        |
| blocked             | no   | sorted assignments padded to row blocks, one small matmul per block |
| capacity            | yes  | C = ceil(factor A / E) slots per expert, batched einsum over slots  |
| expert_parallel     | yes  | `shard_map` + all_to_all over the `expert` mesh axis (moe_parallel) |
| gmm                 | no   | as ragged, with Pallas grouped matmuls: megablox on TPU, gmm_gpu    |
|                     |      | (Triton) on GPU (kernels/grouped_matmul.py)                         |
| expert_parallel_gmm | yes  | expert_parallel with those kernels for each device's experts        |

`auto` (the default) picks a dropless one by shape and backend: `gather` when T k <= E (decoding
a small batch reads only the chosen experts), else `gmm` on TPU (model/select.py says why),
`ragged` on GPU and `blocked` on CPU, where XLA lowers `ragged_dot` as dense work. The dropping
dispatches are a training-speed opt-in: they apply only when the model is called with
`train=True`, so evaluation, prefill and decode always compute the exact function
(expert_parallel runs with enough slots to drop nothing; a decode step gathers).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.model.experts import (
    ExpertWeights,
    Routing,
    combine,
    expert_einsum,
    expert_rows,
    sort_by_expert,
    swiglu,
)
from llm_jax.model.matmul import einsum
from llm_jax.model.moe_parallel import experts_per_unpack, moe_expert_parallel, moe_gmm
from llm_jax.model.mxfp4 import PackedExperts, dense
from llm_jax.model.select import auto_moe
from llm_jax.parallel.sharding import constrain
from llm_jax.runtime.backend import plan


def moe_dense(x_TD: jax.Array, routing: Routing, w: ExpertWeights, limit: float) -> jax.Array:
    t = x_TD.shape[0]
    e = w.gate_up_EDF2.shape[0]
    h = expert_einsum("TD,EDF->TEF", x_TD, w.gate_up_EDF2, w.gate_up_bias_EF2)
    y_TED = expert_einsum("TEF,EFD->TED", swiglu(h, limit), w.down_EFD, w.down_bias_ED)
    combine_TE = jnp.zeros((t, e), jnp.float32).at[
        jnp.arange(t)[:, None], routing.experts_Tk].add(routing.weights_Tk)
    return einsum("TED,TE->TD", y_TED, combine_TE.astype(y_TED.dtype))


def moe_ragged(x_TD: jax.Array, routing: Routing, w: ExpertWeights, limit: float) -> jax.Array:
    w = w.unpacked()
    t, d = x_TD.shape
    k = routing.experts_Tk.shape[1]
    s = sort_by_expert(routing.experts_Tk, w.gate_up_EDF2.shape[0])
    x_AD = s.rows(x_TD)
    h = jax.lax.ragged_dot(x_AD, w.gate_up_EDF2, s.group_sizes_E) \
        + expert_rows(w.gate_up_bias_EF2, s.experts_A)
    y_AD = jax.lax.ragged_dot(swiglu(h, limit), w.down_EFD, s.group_sizes_E) \
        + expert_rows(w.down_bias_ED, s.experts_A)
    return combine(s.unsort(y_AD).reshape(t, k, d), routing.weights_Tk)


def moe_gather(x_TD: jax.Array, routing: Routing, w: ExpertWeights, limit: float) -> jax.Array:
    """T k expert reads: the cheapest exact path when T k <= E (decoding a small batch).

    One batched matrix-vector product per assignment, [A, D] x [A, D, 2F]: the gathered weights
    are already batch-major, so XLA multiplies them in place. (Batching over tokens instead,
    [T, D] x [T, k, D, 2F], made XLA:CPU transpose every gathered matrix first: 3.4x slower
    per layer at T = 8, k = 2, E = 16.)"""
    t, d = x_TD.shape
    k = routing.experts_Tk.shape[1]
    e_A = routing.experts_Tk.reshape(-1)  # (token, choice) order
    x_AD = jnp.repeat(x_TD, k, axis=0)
    h = expert_einsum("AD,ADF->AF", x_AD, w.gate_up_EDF2[e_A], w.gate_up_bias_EF2[e_A])
    y = expert_einsum("AF,AFD->AD", swiglu(h, limit), w.down_EFD[e_A], w.down_bias_ED[e_A])
    return combine(y.reshape(t, k, d), routing.weights_Tk)


def moe_blocked(x_TD: jax.Array, routing: Routing, w: ExpertWeights, limit: float,
                unpack_mib: int = 0) -> jax.Array:
    """Dropless block-sparse dispatch (after MegaBlocks, Gale et al. 2022): assignments sorted by
    expert, each expert's run padded to a multiple of `block` rows, then one small matmul per
    block with its expert's weights. G = ceil(A / block) + E statically bounds the blocks used,
    sum_e ceil(c_e / block).

    A packed stack whose dense form fits in `unpack_mib` MiB (0: any) is unpacked once, before
    the blocks: there are up to G > E of them, and each would unpack its expert again (the tiny
    config's 128-token prefill: 48 unpacks a layer for 16 experts). A larger one (gpt-oss-20b's
    is 1.06 GB) is unpacked a block's expert at a time."""
    w = w._replace(**{name: dense(stack) for name, stack in
                      (("gate_up_EDF2", w.gate_up_EDF2), ("down_EFD", w.down_EFD))
                      if isinstance(stack, PackedExperts)
                      and experts_per_unpack(stack, unpack_mib) == stack.shape[0]})
    t, d = x_TD.shape
    k = routing.experts_Tk.shape[1]
    e = w.gate_up_EDF2.shape[0]
    a = t * k
    block = int(min(256, max(8, 1 << max(0, (a // (2 * e)).bit_length() - 1))))  # pad <= ~A/2
    n_blocks = -(-a // block) + e
    s = sort_by_expert(routing.experts_Tk, e)
    sorted_experts, counts_E = s.experts_A, s.group_sizes_E
    blocks_E = (counts_E + block - 1) // block
    block_end_E = jnp.cumsum(blocks_E)
    first_sorted_E = jnp.cumsum(counts_E) - counts_E
    rank = jnp.arange(a, dtype=jnp.int32) - first_sorted_E[sorted_experts]
    slot_sorted = (block_end_E - blocks_E)[sorted_experts] * block + rank
    slot_A = slot_sorted[s.inverse_A]  # (token, choice) order
    # Unused slots read row t, a zero row; unused blocks run expert E-1 on zeros, never read.
    token_of_slot = jnp.full((n_blocks * block,), t, jnp.int32).at[slot_A].set(
        jnp.arange(a, dtype=jnp.int32) // k)
    x_pad = jnp.concatenate([x_TD, jnp.zeros((1, d), x_TD.dtype)])
    x_GbD = x_pad[token_of_slot].reshape(n_blocks, block, d)
    expert_G = jnp.minimum(jnp.searchsorted(block_end_E, jnp.arange(n_blocks), side="right"),
                           e - 1)

    def one_block(args):
        x_bD, ex = args
        h = expert_einsum("bD,DF->bF", x_bD, w.gate_up_EDF2[ex], w.gate_up_bias_EF2[ex])
        return expert_einsum("bF,FD->bD", swiglu(h, limit), w.down_EFD[ex], w.down_bias_ED[ex])

    if isinstance(w.gate_up_EDF2, PackedExperts) or isinstance(w.down_EFD, PackedExperts):
        # Recomputed in the backward pass: otherwise every block's gathered and unpacked expert
        # is saved for it (gpt-oss-20b at 256 tokens: ~5 GB a layer), where the packed stack,
        # shared by all blocks, is already there.
        one_block = jax.checkpoint(one_block)
    y_AD = jax.lax.map(one_block, (x_GbD, expert_G)).reshape(-1, d)[slot_A]
    return combine(y_AD.reshape(t, k, d), routing.weights_Tk)


def capacity(num_tokens: int, cfg: ModelConfig, factor: float) -> int:
    """Slots per expert: ceil(factor * T * k / E), at most T (an expert sees a token once)."""
    slots = math.ceil(factor * num_tokens * cfg.experts_per_token / cfg.num_experts)
    return max(1, min(num_tokens, slots))


def moe_capacity(
    x_TD: jax.Array, routing: Routing, w: ExpertWeights, limit: float, num_slots: int
) -> tuple[jax.Array, jax.Array]:
    """Returns (output [T, D], fraction of assignments dropped). Slots fill in token order, all
    first choices before any second choice; assignments past an expert's C slots are dropped."""
    t, d = x_TD.shape
    k = routing.experts_Tk.shape[1]
    e = w.gate_up_EDF2.shape[0]
    experts_A = routing.experts_Tk.T.reshape(-1)  # [k*T], choice-major
    onehot_AE = jax.nn.one_hot(experts_A, e, dtype=jnp.int32)
    slot_A = jnp.sum((jnp.cumsum(onehot_AE, axis=0) - 1) * onehot_AE, axis=-1)
    kept_A = slot_A < num_slots
    token_A = jnp.tile(jnp.arange(t, dtype=jnp.int32), k)
    # Scatter token ids into [E, C] slots; empty slots point at token 0 and are never combined.
    flat_slot_A = jnp.where(kept_A, experts_A * num_slots + slot_A, e * num_slots)
    slot_token = jnp.zeros((e * num_slots + 1,), jnp.int32).at[flat_slot_A].set(token_A)
    x_ECD = constrain(x_TD[slot_token[:-1]].reshape(e, num_slots, d), ("experts", None, None))
    h = expert_einsum("ECD,EDF->ECF", x_ECD, w.gate_up_EDF2, w.gate_up_bias_EF2[:, None])
    y_ECD = expert_einsum("ECF,EFD->ECD", swiglu(h, limit), w.down_EFD, w.down_bias_ED[:, None])
    y_AD = y_ECD.reshape(e * num_slots, d)[jnp.minimum(flat_slot_A, e * num_slots - 1)]
    weights_A = routing.weights_Tk.T.reshape(-1) * kept_A
    y_kTD = (y_AD * weights_A[:, None].astype(y_AD.dtype)).reshape(k, t, d)
    drop_fraction = jnp.mean((~kept_A).astype(jnp.float32))
    return jnp.sum(y_kTD, axis=0), drop_fraction


# ---------------------------------------------------------------------------------------------
# The table.

DispatchFn = Callable[[jax.Array, Routing, ExpertWeights, ModelConfig, ExecutionConfig],
                      tuple[jax.Array, jax.Array]]


class Dispatch(NamedTuple):
    fn: DispatchFn  # (x_TD, routing, weights, cfg, execution) -> (y_TD, drop fraction)
    drops: bool  # may drop assignments: used only when training asks for it


def _no_drops(f: Callable[..., jax.Array]) -> DispatchFn:
    return lambda x, r, w, cfg, ex: (f(x, r, w, cfg.swiglu_limit), jnp.zeros((), jnp.float32))


def _gmm_kernel(ex: ExecutionConfig) -> dict[str, Any]:
    """The grouped-matmul kernel for the target backend: Triton on GPU, else megablox (on CPU in
    interpret mode, as the tests run it) with the execution config's tiles."""
    target = plan()
    kernel = target.grouped_matmul_kernel
    native = target.triton_kernels_native if kernel == "triton" else target.tpu_kernels_native
    return {"kernel": kernel, "interpret": not native,
            "tile": (ex.gmm_tile_m, ex.gmm_tile_k, ex.gmm_tile_n)}


def _gmm(x, r, w, cfg, ex):
    return (moe_gmm(x, r, w, cfg.swiglu_limit, unpack_mib=ex.mxfp4_unpack_mib,
                    **_gmm_kernel(ex)), jnp.zeros((), jnp.float32))


def _blocked(x, r, w, cfg, ex):
    return (moe_blocked(x, r, w, cfg.swiglu_limit, unpack_mib=ex.mxfp4_unpack_mib),
            jnp.zeros((), jnp.float32))


def _capacity(x, r, w, cfg, ex):
    return moe_capacity(x, r, w, cfg.swiglu_limit,
                        capacity(x.shape[0], cfg, ex.moe_capacity_factor))


def _expert_parallel(x, r, w, cfg, ex):
    return moe_expert_parallel(x, r, w, cfg.swiglu_limit, ex.moe_capacity_factor)


def _expert_parallel_exact(x, r, w, cfg, ex):
    # A factor of E >= the expert-axis size gives every device pair all A slots: no drops.
    return moe_expert_parallel(x, r, w, cfg.swiglu_limit, float(cfg.num_experts))


def _expert_parallel_gmm(x, r, w, cfg, ex, factor: float | None = None):
    if factor is None:
        factor = ex.moe_capacity_factor
    return moe_expert_parallel(x, r, w, cfg.swiglu_limit, factor,
                               unpack_mib=ex.mxfp4_unpack_mib, **_gmm_kernel(ex))


def _expert_parallel_gmm_exact(x, r, w, cfg, ex):
    return _expert_parallel_gmm(x, r, w, cfg, ex, float(cfg.num_experts))


DISPATCHES: dict[str, Dispatch] = {
    "dense": Dispatch(_no_drops(moe_dense), drops=False),
    "ragged": Dispatch(_no_drops(moe_ragged), drops=False),
    "gather": Dispatch(_no_drops(moe_gather), drops=False),
    "blocked": Dispatch(_blocked, drops=False),
    "gmm": Dispatch(_gmm, drops=False),
    "capacity": Dispatch(_capacity, drops=True),
    "expert_parallel": Dispatch(_expert_parallel, drops=True),
    "expert_parallel_gmm": Dispatch(_expert_parallel_gmm, drops=True),
}
# What a dropping dispatch becomes outside training.
EXACT_FALLBACK: dict[str, DispatchFn] = {"expert_parallel": _expert_parallel_exact,
                                          "expert_parallel_gmm": _expert_parallel_gmm_exact}


def select_dispatch(cfg: ModelConfig, execution: ExecutionConfig, num_tokens: int, *,
                    train: bool) -> DispatchFn:
    """The dispatch a call runs: the configured one, unless it drops and this is not training
    (then `gather` for a decode step, T k <= E, which reads only the chosen experts and needs no
    token split over the expert axis; else the exact one of the same kind, or `auto`'s
    choice); `auto` by shape and backend."""
    name = execution.moe_dispatch
    auto = auto_moe(cfg, num_tokens)
    if name != "auto":
        dispatch = DISPATCHES[name]
        if train or not dispatch.drops:
            return dispatch.fn
        if name in EXACT_FALLBACK and auto != "gather":
            return EXACT_FALLBACK[name]
    return DISPATCHES[auto].fn
