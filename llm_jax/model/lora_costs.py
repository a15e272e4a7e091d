"""What fine-tuning costs per device: full (every weight trained) vs LoRA (adapters only).

Full fine-tuning is training: `costs.memory_per_device`. LoRA keeps the base (param_dtype,
e.g. bfloat16) and trains float32 adapters: gradients and Adam moments exist for the adapters
only. Because `lora.adapted` forms `w + (alpha/r) A B` inside the layer, one layer's adapted
weights and their gradient (float32, sharded like the base) are live at a time.
"""

from __future__ import annotations

from typing import Any

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.model.costs import memory_per_device, param_shards

_COMPONENT = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
              "gate_up_proj": "experts", "down_proj": "experts"}

LORA_ASSUMPTIONS = (
    "LoRA: base weights in param_dtype, frozen (no grads, no Adam moments); adapters A, B in "
    "float32 with float32 grads and Adam m + v, sharded like the weight they adapt",
    "LoRA: one layer's adapted weights w + (alpha/r) A B and their gradient in float32 are live "
    "at a time (the layer scan), sharded like the base",
    "LoRA: activations as for full training (the adapters add r-wide terms, ignored)",
)


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...],
                                                     tuple[int, ...]]]:
    """Per target, one layer's (batch, in, out) dims of the weight."""
    D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    E, F = cfg.num_experts, cfg.intermediate_size
    return {"q_proj": ((), (D,), (N, H)), "k_proj": ((), (D,), (K, H)),
            "v_proj": ((), (D,), (K, H)), "o_proj": ((), (N, H), (D,)),
            "gate_up_proj": ((E,), (D,), (2 * F,)), "down_proj": ((E,), (F,), (D,))}


def _prod(xs: tuple[int, ...]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def lora_param_counts(cfg: ModelConfig, rank: int, targets: tuple[str, ...]) -> dict[str, int]:
    """Adapter parameters per target over all layers: L * batch * r * (in + out)."""
    shapes = weight_shapes(cfg)
    return {t: cfg.num_hidden_layers * _prod(b) * rank * (_prod(i) + _prod(o))
            for t, (b, i, o) in ((t, shapes[t]) for t in targets)}


def finetune_memory_per_device(cfg: ModelConfig, *, batch: int, seq_len: int,
                               mesh: dict[str, int], rank: int,
                               targets: tuple[str, ...],
                               execution: ExecutionConfig = ExecutionConfig()) -> dict[str, Any]:
    """{"full": bytes by part, "lora": bytes by part}, per device."""
    full = memory_per_device(cfg, batch=batch, seq_len=seq_len, mesh=mesh, execution=execution)
    shards = param_shards(cfg, mesh)
    adapters = sum(n * 4 / shards[_COMPONENT[t]][1]
                   for t, n in lora_param_counts(cfg, rank, targets).items())
    shapes = weight_shapes(cfg)
    layer = sum(_prod(b) * _prod(i) * _prod(o) * 4 / shards[_COMPONENT[t]][1]
                for t, (b, i, o) in ((t, shapes[t]) for t in targets))
    lora = {"params": full["params"] + adapters, "grads": adapters, "adam_m_v": 2 * adapters,
            "adapted_layer": 2 * layer, "activations": full["activations"]}
    lora["total"] = sum(lora.values())
    parts = ("params", "grads", "adam_m_v", "activations", "total")
    return {"full": {k: full[k] for k in parts}, "lora": lora, "rank": rank,
            "targets": list(targets),
            "adapter_params": sum(lora_param_counts(cfg, rank, targets).values()),
            "assumptions": list(LORA_ASSUMPTIONS)}
