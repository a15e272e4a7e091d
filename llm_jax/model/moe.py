"""The MoE layer: a top-k router over E clamped-SwiGLU experts (gpt-oss).

Shapes: B batch, T time (flattened with B inside the layer), D hidden, E experts, k experts per
token, F intermediate.

Router: `logits = x Wg + bg` in float32; the top k logits are softmaxed among themselves.
Expert e: `h = x W1_e + b1_e` (2F wide, gate and linear parts interleaved), clamped SwiGLU
`glu * sigmoid(1.702 glu) * (lin + 1)` with glu <= limit and |lin| <= limit, then `W2_e, b2_e`.
How assignments reach the experts is `moe_dispatch.py`'s table; this module only routes and
chooses from it.

Routing replay (RL on an MoE): given the experts a token was routed to elsewhere (the sampler's
forward), the layer uses them in place of its own top k; the gate weights are still the
softmax of the router's logits at those experts, so the router keeps its gradient. Every
dispatch gets it, since they all read the one `Routing`.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.model.experts import ExpertWeights, Routing
from llm_jax.model.lora import adapted
from llm_jax.model.moe_dispatch import select_dispatch
from llm_jax.model.mxfp4 import packed_shapes
from llm_jax.model.params import normal, packed_param, param, zeros


class MoEAux(NamedTuple):
    """Per-layer auxiliary outputs for training and monitoring."""

    load_balancing_loss: jax.Array  # Switch Transformer: E * sum_e f_e P_e (1.0 when balanced)
    router_z_loss: jax.Array  # ST-MoE: mean logsumexp(logits)^2
    expert_load: jax.Array  # [E] f_e: fraction of assignments routed to each expert
    drop_fraction: jax.Array  # fraction of assignments dropped (the dropping dispatches in training; else 0)
    experts: jax.Array  # [B, T, k] int32: the experts each token went to, best first (replayable)


def route(x_TD: jax.Array, kernel_DE: jax.Array, bias_E: jax.Array, k: int,
          experts_Tk: jax.Array | None = None) -> Routing:
    """The router's top k, or the given `experts_Tk` (replay) with gates from these logits."""
    logits = jnp.einsum("TD,DE->TE", x_TD.astype(jnp.float32), kernel_DE.astype(jnp.float32))
    logits = logits + bias_E.astype(jnp.float32)
    if experts_Tk is None:
        top_logits, experts_Tk = jax.lax.top_k(logits, k)
    else:
        chex.assert_shape(experts_Tk, (x_TD.shape[0], k))
        top_logits = jnp.take_along_axis(logits, experts_Tk, axis=-1)
    return Routing(logits, experts_Tk.astype(jnp.int32), jax.nn.softmax(top_logits, axis=-1))


def router_aux(routing: Routing, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(load-balancing loss, z-loss, expert load fractions [E])."""
    probs_TE = jax.nn.softmax(routing.logits_TE, axis=-1)
    counts_E = jnp.zeros((num_experts,), jnp.float32).at[routing.experts_Tk.reshape(-1)].add(1.0)
    load_E = counts_E / routing.experts_Tk.size
    lb = num_experts * jnp.sum(load_E * jnp.mean(probs_TE, axis=0))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(routing.logits_TE, axis=-1)))
    return lb, z, load_E


class MoE(nnx.Module):
    """Router + E clamped-SwiGLU experts; weights in the Hugging Face layout (E, D, 2F).

    With `cfg.expert_format == "mxfp4"` the two expert stacks are held packed, as gpt-oss
    ships them (model/mxfp4.py): `gate_up_proj_blocks` / `_scales` and `down_proj_blocks` /
    `_scales` as `PackedExperts` holds them ([E, in / 32, 16, out] bytes, [E, in / 32, out]
    scales), frozen (`PackedParam`), and
    unpacked by each dispatch inside the layer."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
        init, pd = normal(cfg.initializer_range), cfg.weight_dtype
        out_std = cfg.initializer_range / (2 * cfg.num_hidden_layers) ** 0.5
        self.router = param(rngs, init, (d, e), ("embed", "experts"), jnp.float32)
        self.router_bias = param(rngs, zeros, (e,), ("experts",), jnp.float32)
        if cfg.expert_format == "mxfp4":
            for name, (d_in, d_out), axes, std in (
                    ("gate_up_proj", (d, 2 * f), ("embed", "mlp"), cfg.initializer_range),
                    ("down_proj", (f, d), ("mlp", "embed"), out_std)):
                blocks, scales = packed_shapes(e, d_in, d_out)
                b, s = packed_param(rngs, blocks, scales, ("experts", *axes), std)
                setattr(self, f"{name}_blocks", b)
                setattr(self, f"{name}_scales", s)
        else:
            self.gate_up_proj = param(rngs, init, (e, d, 2 * f), ("experts", "embed", "mlp"), pd)
            self.down_proj = param(rngs, normal(out_std), (e, f, d), ("experts", "mlp", "embed"),
                                   pd)
        self.gate_up_proj_bias = param(rngs, zeros, (e, 2 * f), ("experts", "mlp"), pd)
        self.down_proj_bias = param(rngs, zeros, (e, d), ("experts", "embed"), pd)

    def expert_weights(self) -> ExpertWeights:
        cdt = self.cfg.compute_dtype
        return ExpertWeights(
            adapted(self, "gate_up_proj", cdt), self.gate_up_proj_bias[...].astype(cdt),
            adapted(self, "down_proj", cdt), self.down_proj_bias[...].astype(cdt),
        )

    def __call__(self, x_BTD: jax.Array, *, train: bool = False,
                 execution: ExecutionConfig = ExecutionConfig(),
                 experts_BTk: jax.Array | None = None) -> tuple[jax.Array, MoEAux]:
        """`train=True` lets a dropping dispatch (capacity, expert_parallel*) run; otherwise
        the layer is exact whatever `execution.moe_dispatch` says. `experts_BTk` replays a
        routing (int expert ids in [0, E), distinct per token)."""
        cfg = self.cfg
        b, t, d = x_BTD.shape
        k = cfg.experts_per_token
        chex.assert_shape(x_BTD, (b, t, cfg.hidden_size))
        x_TD = x_BTD.reshape(b * t, d).astype(cfg.compute_dtype)
        replay = None if experts_BTk is None else experts_BTk.reshape(b * t, k)
        routing = route(x_TD, self.router[...], self.router_bias[...], k, replay)
        dispatch = select_dispatch(cfg, execution, b * t, train=train)
        y_TD, drop = dispatch(x_TD, routing, self.expert_weights(), cfg, execution)
        lb, z, load = router_aux(routing, cfg.num_experts)
        y = y_TD.reshape(b, t, d).astype(cfg.compute_dtype)
        return y, MoEAux(lb, z, load, drop, routing.experts_Tk.reshape(b, t, k))
