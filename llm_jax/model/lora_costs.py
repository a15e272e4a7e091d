"""What fine-tuning costs per device: full (every weight trained) vs LoRA (adapters only).

Both are `costs.memory_per_device` of the step that trains them: full fine-tuning is training;
LoRA adds the adapters (model/lora.py) to the same abstract model and trains only them, so
gradients and Adam moments exist for the adapters alone and the base (packed MXFP4 experts
included: QLoRA) is read, never updated. Where `lora.adapted` forms `w + (alpha/r) A B` inside
a layer, that float32 weight is among what the layer saves for its backward pass.
"""

from __future__ import annotations

from typing import Any

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.model.costs import Adapters, memory_per_device

LORA_ASSUMPTIONS = (
    "LoRA: the same step's memory with adapters A, B (float32) on the targets; only they have "
    "gradients and Adam m + v; the base is frozen in its stored format",
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
                               mesh: dict[str, int], rank: int, targets: tuple[str, ...],
                               alpha: float = 16.0, platform: str = "tpu",
                               execution: ExecutionConfig = ExecutionConfig()) -> dict[str, Any]:
    """{"full": bytes by part, "lora": bytes by part}, per device (`memory_per_device`)."""
    parts = ("params", "grads", "adam_m_v", "activations", "working", "total")
    full = memory_per_device(cfg, batch=batch, seq_len=seq_len, mesh=mesh, platform=platform,
                             execution=execution)
    lora = memory_per_device(cfg, batch=batch, seq_len=seq_len, mesh=mesh, platform=platform,
                             execution=execution, adapters=Adapters(rank, alpha, tuple(targets)))
    return {"full": {k: full[k] for k in parts}, "lora": {k: lora[k] for k in parts},
            "rank": rank, "targets": list(targets),
            "adapter_params": sum(lora_param_counts(cfg, rank, targets).values()),
            "assumptions": list(LORA_ASSUMPTIONS)}
