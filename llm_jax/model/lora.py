"""LoRA adapters inside the model's own modules: a projection reads `w + (alpha/r) A B`.

Shapes: L layers, D hidden, N q heads, K kv heads, H head_dim, E experts, F intermediate, r rank.

`add_lora(model, ...)` attaches `LoRAParam`s `<name>_lora_a` / `<name>_lora_b` next to a stacked
weight in `model.layers.attn` / `model.layers.mlp`; `Attention` and `MoE` read every target weight
through `adapted(module, name)`, so training, evaluation, prefill and decode all see the adapters
and there is no second copy of the layer math. B starts at zero, so step 0 equals the base
exactly. Per expert, A and B carry the expert axis: each expert gets its own low-rank update.

| target       | weight        | A         | B          |
|--------------|---------------|-----------|------------|
| q_proj       | [D, N, H]     | [D, r]    | [r, N, H]  |
| k/v_proj     | [D, K, H]     | [D, r]    | [r, K, H]  |
| o_proj       | [N, H, D]     | [N, H, r] | [r, D]     |
| gate_up_proj | [E, D, 2F]    | [E, D, r] | [E, r, 2F] |
| down_proj    | [E, F, D]     | [E, F, r] | [E, r, D]  |
(each with a leading L in the stacked model).

Over packed MXFP4 experts (QLoRA: `expert_format="mxfp4"`) the base stack stays packed and
frozen: `adapted` returns a `PackedExperts` carrying A and B, and each MoE dispatch applies
them to the experts it multiplies (`experts.expert_einsum`'s side path `(alpha/r) (x A_e) B_e`,
or `(alpha/r) A_e B_e` added to the stack a grouped matmul unpacks), so gradients reach the
adapters and the activations only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from llm_jax.model.mxfp4 import MXFP4_BLOCK, ExpertStack, PackedExperts

# target -> (layer part, batch dims, input dims) of the weight without its layers axis; the
# rest is output.
TARGETS: dict[str, tuple[str, int, int]] = {
    "q_proj": ("attn", 0, 1), "k_proj": ("attn", 0, 1), "v_proj": ("attn", 0, 1),
    "o_proj": ("attn", 0, 2), "gate_up_proj": ("mlp", 1, 1), "down_proj": ("mlp", 1, 1),
}
_LETTERS = "abcdefgh"


class LoRAParam(nnx.Param):
    """A trainable adapter; everything else (plain `nnx.Param`) is the frozen base."""


def _delta_einsum(n_batch: int, n_in: int, n_out: int) -> str:
    """e.g. gate_up: 'aEr,arF->aEF' style: batch + in + r, batch + r + out -> batch + in + out."""
    bt, rest = _LETTERS[:n_batch], _LETTERS[n_batch:]
    ins, outs = rest[:n_in], rest[n_in:n_in + n_out]
    return f"{bt}{ins}r,{bt}r{outs}->{bt}{ins}{outs}"


def lora_delta(name: str, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """scale * A B in float32, shaped like the weight (any leading layers axis included)."""
    _, n_batch, n_in = TARGETS[name]
    lead = a.ndim - (n_batch + n_in + 1)  # 1 for the stacked model, 0 inside the layer scan
    n_out = b.ndim - lead - n_batch - 1
    spec = _delta_einsum(lead + n_batch, n_in, n_out)
    return scale * jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))


def adapted(module: nnx.Module, name: str, dtype: jnp.dtype) -> ExpertStack:
    """The weight `name` of `module` in `dtype`, with its adapter added when it has one; a
    packed expert stack stays packed, its adapter carried along (module doc)."""
    a = getattr(module, f"{name}_lora_a", None)
    b = getattr(module, f"{name}_lora_b", None)
    if hasattr(module, f"{name}_blocks"):
        return PackedExperts(
            getattr(module, f"{name}_blocks")[...], getattr(module, f"{name}_scales")[...],
            None if a is None else a[...], None if b is None else b[...],
            module.lora_scale if a is not None else 1.0, jnp.dtype(dtype).name)
    w = getattr(module, name)[...]
    if a is None:
        return w.astype(dtype)
    return (w.astype(jnp.float32) + lora_delta(name, a[...], b[...], module.lora_scale)).astype(dtype)


def base_weight_info(module: nnx.Module, name: str) -> tuple[tuple[int, ...], tuple]:
    """(shape, logical axes) of the dense weight `name` (leading layers axis included), also
    for a packed stack, whose blocks are (..., in / 32, 16, out)."""
    if hasattr(module, f"{name}_blocks"):
        blocks = getattr(module, f"{name}_blocks")
        *lead, g, _, o = blocks.shape
        *lead_axes, in_axis, _, o_axis = blocks.get_metadata()["out_sharding"]
        return (*lead, g * MXFP4_BLOCK, o), (*lead_axes, in_axis, o_axis)
    w = getattr(module, name)
    return tuple(w.shape), w.get_metadata()["out_sharding"]


def add_lora(model: nnx.Module, *, rank: int, alpha: float, targets: tuple[str, ...],
             seed: int) -> nnx.Module:
    """Attaches adapters (A ~ N(0, 1/fan_in), B = 0, float32) to `targets` in place."""
    bad = sorted(set(targets) - set(TARGETS))
    if bad or not targets:
        raise ValueError(f"lora.targets={list(targets)!r} is invalid: expected a non-empty subset "
                         f"of {sorted(TARGETS)} (unknown: {bad})")
    if rank < 1:
        raise ValueError(f"lora.rank={rank} is invalid: expected >= 1")
    key = jax.random.key(seed)
    for i, name in enumerate(targets):
        part, n_batch, n_in = TARGETS[name]
        module = getattr(model.layers, part)
        shape, axes = base_weight_info(module, name)  # ("layers", *batch, *in, *out)
        lead = 1 + n_batch
        in_shape, out_shape = shape[lead:lead + n_in], shape[lead + n_in:]
        fan_in = 1
        for s in in_shape:
            fan_in *= s
        a_shape = shape[:lead] + in_shape + (rank,)
        b_shape = shape[:lead] + (rank,) + out_shape
        a = jax.random.normal(jax.random.fold_in(key, i), a_shape, jnp.float32) / fan_in ** 0.5
        setattr(module, f"{name}_lora_a", LoRAParam(
            a, out_sharding=axes[:lead + n_in] + (None,), eager_sharding=False))
        setattr(module, f"{name}_lora_b", LoRAParam(
            jnp.zeros(b_shape, jnp.float32), out_sharding=axes[:lead] + (None,) + axes[lead + n_in:],
            eager_sharding=False))
        module.lora_scale = alpha / rank
    return model
