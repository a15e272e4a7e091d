"""Top-k mixture of experts with clamped SwiGLU experts, and three ways to dispatch tokens.

Shapes: T tokens (batch and time flattened), D hidden, E experts, k experts per token,
F intermediate, C capacity slots per expert, A = T * k token-expert assignments.

Router: `logits = x Wg + bg` in float32; the top k logits are softmaxed among themselves (gpt-oss).
Expert e: `h = x W1_e + b1_e` (2F wide, gate and linear parts interleaved), clamped SwiGLU
`glu * sigmoid(1.702 glu) * (lin + 1)` with glu <= limit and |lin| <= limit, then `W2_e, b2_e`.

Dispatch (`ModelConfig.moe_dispatch`), all computing the same function:
- "dense": every expert on every token, weighted by a [T, E] combine matrix. The reference.
- "ragged": dropless; assignments sorted by expert, `jax.lax.ragged_dot` grouped matmuls. TPU/GPU.
- "capacity": each expert gets C = ceil(factor * A / E) slots, filled in token order with first
  choices before second choices; assignments past capacity are dropped and counted. Batched
  einsum over [E, C, D]: the fast path on CPU.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from llm_jax.config import SWIGLU_ALPHA, ModelConfig
from llm_jax.model.params import normal, param, zeros
from llm_jax.sharding import constrain


class Routing(NamedTuple):
    """Router outputs for T tokens."""

    logits_TE: jax.Array  # float32 router logits
    experts_Tk: jax.Array  # int32 chosen expert ids, best first
    weights_Tk: jax.Array  # float32 softmax over the chosen logits


class MoEAux(NamedTuple):
    """Per-layer auxiliary outputs for training and monitoring."""

    load_balancing_loss: jax.Array  # Switch Transformer: E * sum_e f_e P_e (1.0 when balanced)
    router_z_loss: jax.Array  # ST-MoE: mean logsumexp(logits)^2
    expert_load: jax.Array  # [E] f_e: fraction of assignments routed to each expert
    drop_fraction: jax.Array  # fraction of assignments dropped (capacity path; else 0)


def route(x_TD: jax.Array, kernel_DE: jax.Array, bias_E: jax.Array, k: int) -> Routing:
    logits = jnp.einsum("TD,DE->TE", x_TD.astype(jnp.float32), kernel_DE.astype(jnp.float32))
    logits = logits + bias_E.astype(jnp.float32)
    top_logits, experts = jax.lax.top_k(logits, k)
    return Routing(logits, experts.astype(jnp.int32), jax.nn.softmax(top_logits, axis=-1))


def router_aux(routing: Routing, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(load-balancing loss, z-loss, expert load fractions [E])."""
    probs_TE = jax.nn.softmax(routing.logits_TE, axis=-1)
    counts_E = jnp.zeros((num_experts,), jnp.float32).at[routing.experts_Tk.reshape(-1)].add(1.0)
    load_E = counts_E / routing.experts_Tk.size
    lb = num_experts * jnp.sum(load_E * jnp.mean(probs_TE, axis=0))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(routing.logits_TE, axis=-1)))
    return lb, z, load_E


def swiglu(h: jax.Array, limit: float) -> jax.Array:
    """gpt-oss clamped SwiGLU on interleaved [..., 2F] pre-activations -> [..., F]."""
    glu, lin = h[..., 0::2], h[..., 1::2]
    glu = jnp.minimum(glu, limit)
    lin = jnp.clip(lin, -limit, limit)
    return glu * jax.nn.sigmoid(SWIGLU_ALPHA * glu) * (lin + 1.0)


class ExpertWeights(NamedTuple):
    gate_up_EDF2: jax.Array
    gate_up_bias_EF2: jax.Array
    down_EFD: jax.Array
    down_bias_ED: jax.Array


def moe_dense(x_TD: jax.Array, routing: Routing, w: ExpertWeights, limit: float) -> jax.Array:
    t = x_TD.shape[0]
    e = w.gate_up_EDF2.shape[0]
    h = jnp.einsum("TD,EDF->TEF", x_TD, w.gate_up_EDF2) + w.gate_up_bias_EF2
    y_TED = jnp.einsum("TEF,EFD->TED", swiglu(h, limit), w.down_EFD) + w.down_bias_ED
    combine_TE = jnp.zeros((t, e), jnp.float32).at[
        jnp.arange(t)[:, None], routing.experts_Tk].add(routing.weights_Tk)
    return jnp.einsum("TED,TE->TD", y_TED, combine_TE.astype(y_TED.dtype))


def moe_ragged(x_TD: jax.Array, routing: Routing, w: ExpertWeights, limit: float) -> jax.Array:
    t, d = x_TD.shape
    k = routing.experts_Tk.shape[1]
    e = w.gate_up_EDF2.shape[0]
    experts_A = routing.experts_Tk.reshape(-1)
    order_A = jnp.argsort(experts_A, stable=True)
    sorted_experts_A = experts_A[order_A]
    x_AD = x_TD[order_A // k]
    group_sizes_E = jnp.bincount(experts_A, length=e).astype(jnp.int32)
    h = jax.lax.ragged_dot(x_AD, w.gate_up_EDF2, group_sizes_E) + w.gate_up_bias_EF2[sorted_experts_A]
    y_AD = jax.lax.ragged_dot(swiglu(h, limit), w.down_EFD, group_sizes_E) \
        + w.down_bias_ED[sorted_experts_A]
    y_AD = jnp.zeros_like(y_AD).at[order_A].set(y_AD)  # back to (token, choice) order
    y_TkD = y_AD.reshape(t, k, d)
    return jnp.einsum("TkD,Tk->TD", y_TkD, routing.weights_Tk.astype(y_TkD.dtype))


def capacity(num_tokens: int, cfg: ModelConfig) -> int:
    """Slots per expert: ceil(factor * T * k / E), at most T (an expert sees a token once)."""
    slots = math.ceil(cfg.moe_capacity_factor * num_tokens * cfg.experts_per_token / cfg.num_experts)
    return max(1, min(num_tokens, slots))


def moe_capacity(
    x_TD: jax.Array, routing: Routing, w: ExpertWeights, limit: float, num_slots: int
) -> tuple[jax.Array, jax.Array]:
    """Returns (output [T, D], fraction of assignments dropped)."""
    t, d = x_TD.shape
    k = routing.experts_Tk.shape[1]
    e = w.gate_up_EDF2.shape[0]
    # Priority: all first choices (in token order), then all second choices, ...
    experts_A = routing.experts_Tk.T.reshape(-1)  # [k*T], choice-major
    onehot_AE = jax.nn.one_hot(experts_A, e, dtype=jnp.int32)
    slot_A = jnp.sum((jnp.cumsum(onehot_AE, axis=0) - 1) * onehot_AE, axis=-1)
    kept_A = slot_A < num_slots
    token_A = jnp.tile(jnp.arange(t, dtype=jnp.int32), k)
    # Scatter token ids into [E, C] slots; empty slots point at token 0 and are never combined.
    flat_slot_A = jnp.where(kept_A, experts_A * num_slots + slot_A, e * num_slots)
    slot_token = jnp.zeros((e * num_slots + 1,), jnp.int32).at[flat_slot_A].set(token_A)
    x_ECD = constrain(x_TD[slot_token[:-1]].reshape(e, num_slots, d), ("experts", None, None))
    h = jnp.einsum("ECD,EDF->ECF", x_ECD, w.gate_up_EDF2) + w.gate_up_bias_EF2[:, None]
    y_ECD = jnp.einsum("ECF,EFD->ECD", swiglu(h, limit), w.down_EFD) + w.down_bias_ED[:, None]
    y_AD = y_ECD.reshape(e * num_slots, d)[jnp.minimum(flat_slot_A, e * num_slots - 1)]
    weights_A = routing.weights_Tk.T.reshape(-1) * kept_A
    y_kTD = (y_AD * weights_A[:, None].astype(y_AD.dtype)).reshape(k, t, d)
    drop_fraction = 1.0 - jnp.mean(kept_A.astype(jnp.float32))
    return jnp.sum(y_kTD, axis=0), drop_fraction


class MoE(nnx.Module):
    """Router + E clamped-SwiGLU experts; weights in the Hugging Face layout (E, D, 2F)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
        init, pd = normal(cfg.initializer_range), cfg.weight_dtype
        out_init = normal(cfg.initializer_range / (2 * cfg.num_hidden_layers) ** 0.5)
        self.router = param(rngs, init, (d, e), ("embed", "experts"), jnp.float32)
        self.router_bias = param(rngs, zeros, (e,), ("experts",), jnp.float32)
        self.gate_up_proj = param(rngs, init, (e, d, 2 * f), ("experts", "embed", "mlp"), pd)
        self.gate_up_proj_bias = param(rngs, zeros, (e, 2 * f), ("experts", "mlp"), pd)
        self.down_proj = param(rngs, out_init, (e, f, d), ("experts", "mlp", "embed"), pd)
        self.down_proj_bias = param(rngs, zeros, (e, d), ("experts", "embed"), pd)

    def expert_weights(self) -> ExpertWeights:
        cdt = self.cfg.compute_dtype
        return ExpertWeights(
            self.gate_up_proj[...].astype(cdt), self.gate_up_proj_bias[...].astype(cdt),
            self.down_proj[...].astype(cdt), self.down_proj_bias[...].astype(cdt),
        )

    def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, MoEAux]:
        cfg = self.cfg
        b, t, d = x_BTD.shape
        chex.assert_shape(x_BTD, (b, t, cfg.hidden_size))
        x_TD = x_BTD.reshape(b * t, d).astype(cfg.compute_dtype)
        routing = route(x_TD, self.router[...], self.router_bias[...], cfg.experts_per_token)
        w = self.expert_weights()
        drop = jnp.zeros((), jnp.float32)
        if cfg.moe_dispatch == "dense":
            y_TD = moe_dense(x_TD, routing, w, cfg.swiglu_limit)
        elif cfg.moe_dispatch == "ragged":
            y_TD = moe_ragged(x_TD, routing, w, cfg.swiglu_limit)
        elif cfg.moe_dispatch == "expert_parallel":  # shard_map over the mesh in context
            from llm_jax.model.moe_parallel import moe_expert_parallel

            y_TD, drop = moe_expert_parallel(x_TD, routing, w, cfg.swiglu_limit,
                                             cfg.moe_capacity_factor)
        else:
            y_TD, drop = moe_capacity(x_TD, routing, w, cfg.swiglu_limit, capacity(b * t, cfg))
        lb, z, load = router_aux(routing, cfg.num_experts)
        y = y_TD.reshape(b, t, d).astype(cfg.compute_dtype)
        return y, MoEAux(lb, z, load, drop)
